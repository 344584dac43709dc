"""The scheduler at scale: one `scheduler.plan` pass (a pure function: no server), with every GPU busy
and the queue full, as after a submit on a loaded machine. Median of --runs passes per case.

Cases (queued jobs, users, GPUs): the issue's, from a small lab to a cluster's queue. Each job asks
for 1 GPU (a tenth for 2, a 4 GiB slice for a tenth), priorities 0 and a few 10s; a tenth of the
running jobs belong to the queued users. Goal: one pass at most 50 ms at 100,000 jobs, 1,000 users
and 1,000 GPUs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from _report import ROWS, Row, print_table, say  # noqa: E402

from gpuport.server.scheduler import Cluster, Holding, Machine, Pending, Request, plan  # noqa: E402

GiB = 2**30
CASES = [(1_000, 10, 8), (10_000, 100, 64), (10_000, 1_000, 64), (50_000, 1_000, 512), (100_000, 1_000, 1_000)]


def case(jobs: int, users: int, gpus: int, seed: int = 1) -> tuple[list[Pending], list[Holding], Cluster]:
    rng = random.Random(seed)
    per_node = 8
    nodes = max(1, gpus // per_node)
    cluster = Cluster(
        tuple((f"node{n:04d}", Machine((80 * GiB,) * min(per_node, gpus), 64.0, 512 * GiB)) for n in range(nodes))
    )
    running = [
        Holding(f"r{n}-{i}", f"user{rng.randrange(users)}", Request(gpus=1), (i,), node=name)
        for n, (name, machine) in enumerate(cluster.nodes)
        for i in range(len(machine.gpu_memory))
    ]
    queued = []
    for seq in range(jobs):
        kind = rng.random()
        request = Request(gpus=2) if kind < 0.1 else Request(gpu_memory=4 * GiB) if kind < 0.2 else Request(gpus=1)
        priority = 10 if rng.random() < 0.01 else 0
        queued.append(Pending(f"j{seq}", f"user{rng.randrange(users)}", request, priority, seq))
    return queued, running, cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--largest", type=int, default=len(CASES), help="how many of the cases to run, smallest first")
    args = parser.parse_args()
    say(f"Python {sys.version.split()[0]}; one plan() pass, median of {args.runs}")
    for jobs, users, gpus in CASES[: args.largest]:
        queued, running, cluster = case(jobs, users, gpus)
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            decisions = plan(queued, running, cluster)
            times.append(time.perf_counter() - started)
        assert len(decisions) == jobs and not any(d.gpu_indices is not None for d in decisions)
        took = statistics.median(times)
        goal = "<= 50 ms" if jobs == 100_000 else "-"
        met = took <= 0.050 if jobs == 100_000 else None
        ROWS.append(Row(f"plan: {jobs:,} jobs, {users:,} users, {gpus:,} GPUs", took, None, "-", goal, met))
        say(f"  {jobs:>7,} jobs {users:>5,} users {gpus:>5,} GPUs: {took * 1000:.1f} ms")
    print_table(["plan"], 44, "one pass of the scheduler's pure function (no server), median")


if __name__ == "__main__":
    main()
