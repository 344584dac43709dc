"""Fair over a week: the pure scheduler (``plan``) driven by a simulated clock, the same jobs under
three policies in one run.

The workload (seeded): 1,000 users with 1 to 4 shares (uniform) submit 100,000 jobs over one
simulated week to 8 nodes of 8 GPUs (a ``Cluster``: a job runs on one node, an 8-GPU job takes a
whole one). Users' activity is heavy-tailed (lognormal weights), independent of their shares, so
some ask for far more than their share and many for less. Each job asks for 1, 2, 4 or 8 GPUs
(55/20/15/10 %) and runs a bounded-Pareto time (alpha 1.2, 1 minute to 8 hours, scaled so that the
jobs ask for ``--load`` times what the GPUs give in the week: 1.3 by default). Arrivals are uniform
over the week. ``--quick``: 100 users, 10,000 jobs, 2 nodes of 8 GPUs, one day.

Event-driven, as the server runs: at each submit and each end, a pass of ``plan`` over the kept
``Queue`` with the server's look-ahead (``LOOK_AHEAD``), skipped as the server skips it when
``could_start`` says nothing queued fits what is free; what the pass starts starts now (its end is
an event), and a job the pass says reserves gets ``reserved_at`` as the server records it.

The policies, each over the same jobs:
(a) decayed fair share: ``plan(..., fair=FairShare(...))`` with each user's decayed use (the
    server's formula in services/usage.py, advanced with the simulated clock, exact at each pass),
    their shares, and the server's defaults (half-life 7 days, age weight 0.01 an hour); a second
    row with the age weight 0 shows what the age factor does with 1,000 users;
(b) FIFO: every job given one owner, so the order is submission order (the reservation rule kept);
(c) today's instantaneous fair share: ``fair=None`` (dominant share of what runs now, no shares).

Jain's index "relative to shares": a user cannot be given more than they asked for, so each user's
fair amount is the weighted max-min (water-filling) allocation of the GPU-hours the policy
delivered: ``fair_i = min(demand_i, level * shares_i)``, the level chosen so the fair amounts sum
to what was delivered; ``x_i = got_i / fair_i`` over every user who asked for anything, and
``J = (sum x)^2 / (n sum x^2)``. A user who asked for less than their share is fair when given
what they asked for; a saturated user, when given ``level * shares``. (Restricting to saturated
users alone would drop the light users a bad policy starves.) ``demand_i``: the GPU-hours their
jobs would hold inside the week if started at submission (a job near the week's end counts only
to the end).

Figures, within the week: Jain's index (goal >= 0.95), the median wait of 1-GPU jobs (jobs still
queued at the end count as waiting until the end: a lower bound), GPU utilisation (GPU-hours held
/ GPU-hours in the week; goal: fair share >= 95% of FIFO's), and the work lost to preemption with
checkpoints every 5 minutes (goal <= 2% of GPU-hours): ``plan`` does not preempt yet (no preemption
in gpuport/server/scheduler.py when this was written), so that row says it is not measurable.

Differences from the server, named: a pass that ``could_start`` says starts nothing is skipped
after a submit too (the server runs it for the reply's reasons; it can record a reservation, which
the next pass here records instead). Cost: every pass decides ``LOOK_AHEAD`` jobs (0.8-10 ms here),
and a week of 100,000 jobs is ~200,000 events a policy: the full run takes most of an hour on a
loaded 2-core machine; ``--hours`` simulates only the window's start, for the figures' trend and
the cost per pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from _report import ROWS, Row, print_table, say

from gpuport.defaults import DEFAULT_AGE_WEIGHT, DEFAULT_FAIRSHARE_HALF_LIFE
from gpuport.server import scheduler
from gpuport.server.scheduler import (
    LOOK_AHEAD,
    Cluster,
    FairShare,
    Holding,
    Machine,
    Pending,
    Queue,
    Request,
    could_start,
    plan,
)

GiB = 2**30
HOUR = 3600.0
DAY = 24 * HOUR
T0 = 1_700_000_000.0  # the simulated clock's start (a ``created_at`` of 0 means no age)
SIZES = ((1, 0.55), (2, 0.20), (4, 0.15), (8, 0.10))


@dataclass(frozen=True)
class Job:
    job_id: str
    owner: str
    gpus: int
    submit: float  # seconds after T0
    duration: float


@dataclass
class Workload:
    users: list[str]
    shares: dict[str, float]
    jobs: list[Job]
    cluster: Cluster
    gpus: int
    span: float  # seconds of the simulated window


def bounded_pareto(rng: random.Random, alpha: float, low: float, high: float) -> float:
    u = rng.random()
    ratio = (low / high) ** alpha
    return low / (1 - u * (1 - ratio)) ** (1 / alpha)


def workload(users: int, jobs: int, nodes: int, span: float, load: float, seed: int = 36) -> Workload:
    rng = random.Random(seed)
    names = [f"user{i:04d}" for i in range(users)]
    shares = {u: float(rng.randint(1, 4)) for u in names}
    weights = [rng.lognormvariate(0.0, 1.0) for _ in names]
    owners = rng.choices(names, weights=weights, k=jobs)
    sizes = rng.choices([s for s, _ in SIZES], weights=[w for _, w in SIZES], k=jobs)
    submits = sorted(rng.uniform(0, span) for _ in range(jobs))
    durations = [bounded_pareto(rng, 1.2, 60.0, 8 * HOUR) for _ in range(jobs)]
    gpus = nodes * 8
    scale = load * gpus * span / sum(g * d for g, d in zip(sizes, durations, strict=True))
    cluster = Cluster(tuple((f"node{n}", Machine((80 * GiB,) * 8, 64.0, 512 * GiB)) for n in range(nodes)))
    listed = [Job(f"j{i}", owners[i], sizes[i], submits[i], durations[i] * scale) for i in range(jobs)]
    return Workload(names, shares, listed, cluster, gpus, span)


class Decayed(Mapping[str, float]):
    """Each user's decayed use at the simulated ``now``, worked out when asked (``FairShare.turn``
    asks only for the users with queued jobs): the server's formula (services/usage.py), a run of
    dominant share ``s`` from ``a`` to ``b`` counting ``s * (2^-(now-b)/h - 2^-(now-a)/h)``, kept
    as sums against the fixed origin T0 so that advancing the clock costs nothing."""

    def __init__(self, half_life: float) -> None:
        self.h = half_life
        self.ended: dict[str, float] = {}  # sum of s * (2^(b/h) - 2^(a/h)) of ended runs
        self.held: dict[str, float] = {}  # sum of s of running runs
        self.began: dict[str, float] = {}  # sum of s * 2^(a/h) of running runs
        self.now = 0.0

    def start(self, user: str, share: float, at: float) -> None:
        self.held[user] = self.held.get(user, 0.0) + share
        self.began[user] = self.began.get(user, 0.0) + share * 2 ** (at / self.h)

    def end(self, user: str, share: float, began: float, at: float) -> None:
        self.held[user] -= share
        self.began[user] -= share * 2 ** (began / self.h)
        self.ended[user] = self.ended.get(user, 0.0) + share * (2 ** (at / self.h) - 2 ** (began / self.h))

    def get(self, user: str, default: float = 0.0) -> float:  # type: ignore[override]
        if user not in self.held:
            return default
        now = self.now
        return (self.ended.get(user, 0.0) - self.began[user]) * 2 ** (-now / self.h) + self.held[user]

    def __getitem__(self, user: str) -> float:
        if user not in self.held:
            raise KeyError(user)
        return self.get(user)

    def __iter__(self) -> Iterator[str]:
        return iter(self.held)

    def __len__(self) -> int:
        return len(self.held)


@dataclass
class Outcome:
    name: str
    got: dict[str, float] = field(default_factory=dict)  # user → GPU-seconds held inside the window
    waits: list[float] = field(default_factory=list)  # 1-GPU jobs
    passes: int = 0
    skipped: int = 0
    seconds: float = 0.0  # wall time of the simulation
    plan_seconds: float = 0.0


def simulate(w: Workload, name: str, policy: str, age_weight: float = DEFAULT_AGE_WEIGHT) -> Outcome:
    """Run ``w`` under ``policy`` ('fair', 'fifo' or 'now') until the window's end."""
    started = time.perf_counter()
    out = Outcome(name)
    cluster, span = w.cluster, w.span
    jobs = {j.job_id: j for j in w.jobs}
    queue = Queue()
    running: dict[str, Holding] = {}
    began: dict[str, float] = {}
    free = w.gpus
    decayed = Decayed(DEFAULT_FAIRSHARE_HALF_LIFE)
    ends: list[tuple[float, str]] = []
    submits = w.jobs
    i, seq = 0, 0
    while True:
        next_submit = submits[i].submit if i < len(submits) else math.inf
        next_end = ends[0][0] if ends else math.inf
        now = min(next_submit, next_end)
        if now >= span:
            break
        if next_end <= next_submit:
            _, job_id = heapq.heappop(ends)
            del running[job_id]
            job = jobs[job_id]
            free += job.gpus
            out.got[job.owner] = out.got.get(job.owner, 0.0) + job.gpus * (now - began[job_id])
            decayed.end(job.owner, job.gpus / w.gpus, began[job_id], now)
        else:
            job = submits[i]
            i += 1
            seq += 1
            owner = "everyone" if policy == "fifo" else job.owner
            queue.add(Pending(job.job_id, owner, Request(gpus=job.gpus), 0, seq, created_at=T0 + job.submit))
        if not free or not queue:
            out.skipped += 1
            continue
        holdings = list(running.values())
        if not could_start(queue.kinds(), holdings, cluster):
            out.skipped += 1
            continue
        fair = None
        if policy == "fair":
            decayed.now = now
            fair = FairShare(decayed, w.shares, T0 + now, age_weight)
        t = time.perf_counter()
        decisions = plan(queue, holdings, cluster, None, "", LOOK_AHEAD, None, fair)
        out.plan_seconds += time.perf_counter() - t
        out.passes += 1
        for d in decisions:
            pending = queue[d.job_id]
            if d.reserves and pending.reserved_at is None:
                queue.add(dataclasses.replace(pending, reserved_at=T0 + now))
            if d.gpu_indices is None:
                continue
            job = jobs[d.job_id]
            queue.pop(d.job_id)
            running[d.job_id] = Holding(d.job_id, pending.owner, pending.request, d.gpu_indices, node=d.node)
            began[d.job_id] = now
            free -= job.gpus
            decayed.start(job.owner, job.gpus / w.gpus, now)
            heapq.heappush(ends, (now + job.duration, d.job_id))
            if job.gpus == 1:
                out.waits.append(now - job.submit)
    for job_id in running:
        job = jobs[job_id]
        out.got[job.owner] = out.got.get(job.owner, 0.0) + job.gpus * (span - began[job_id])
    out.waits += [span - p.created_at + T0 for p in queue.values() if p.request.gpus == 1]
    out.seconds = time.perf_counter() - started
    return out


def demand(w: Workload) -> dict[str, float]:
    """Each user's GPU-seconds asked for inside the window (a job counts to the window's end)."""
    asked: dict[str, float] = {}
    for j in w.jobs:
        if j.submit < w.span:
            asked[j.owner] = asked.get(j.owner, 0.0) + j.gpus * min(j.duration, w.span - j.submit)
    return asked


def fair_amounts(asked: Mapping[str, float], shares: Mapping[str, float], total: float) -> dict[str, float]:
    """Weighted max-min (water-filling) of ``total``: each user gets min(asked, level * shares)."""
    users = sorted(asked, key=lambda u: asked[u] / shares[u])
    level, left, weight = 0.0, total, sum(shares[u] for u in users)
    fair: dict[str, float] = {}
    for k, u in enumerate(users):
        capped = asked[u] / shares[u]
        if capped * weight >= left:  # the level is reached before this user's demand: all the rest saturated
            level = left / weight
            for v in users[k:]:
                fair[v] = level * shares[v]
            return fair
        fair[u] = asked[u]
        left -= asked[u]
        weight -= shares[u]
    return fair


def jain(out: Outcome, asked: Mapping[str, float], shares: Mapping[str, float]) -> tuple[float, int]:
    fair = fair_amounts(asked, shares, sum(out.got.values()))
    x = [out.got.get(u, 0.0) / fair[u] for u in asked if fair[u] > 0]
    saturated = sum(1 for u in asked if fair[u] < asked[u] - 1e-6)
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)), saturated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 users, 10,000 jobs, 16 GPUs, one day")
    parser.add_argument("--load", type=float, default=1.3, help="GPU-hours asked / GPU-hours in the window")
    parser.add_argument("--profile", action="store_true", help="profile the decayed fair share's run")
    parser.add_argument("--hours", type=float, help="simulate only the window's first HOURS (a cost estimate)")
    args = parser.parse_args()
    if args.quick:
        w = workload(100, 10_000, 2, DAY, args.load)
    else:
        w = workload(1_000, 100_000, 8, 7 * DAY, args.load)
    if args.hours:
        w = dataclasses.replace(w, span=min(w.span, args.hours * HOUR))
    say(
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; load average at the start: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + (" (--quick)" if args.quick else "")
    )
    say(
        f"{len(w.users):,} users (shares 1-4), {len(w.jobs):,} jobs, {w.gpus} GPUs "
        f"({len(w.cluster.nodes)} nodes of 8), {w.span / DAY:g} simulated days, asked {args.load:g}x "
        f"the GPU-hours; plan() {LOOK_AHEAD} jobs deep; half-life {DEFAULT_FAIRSHARE_HALF_LIFE / DAY:g} days"
    )
    runs = [
        ("decayed fair share", "fair", DEFAULT_AGE_WEIGHT),
        ("decayed fair share, age weight 0", "fair", 0.0),
        ("FIFO", "fifo", 0.0),
        ("instantaneous fair share", "now", 0.0),
    ]
    outcomes: dict[str, Outcome] = {}
    for label, policy, age in runs:
        if args.profile and policy == "fair" and age == DEFAULT_AGE_WEIGHT:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            out = profiler.runcall(simulate, w, label, policy, age)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)
        else:
            out = simulate(w, label, policy, age)
        outcomes[label] = out
        say(
            f"  {label}: {out.seconds:.1f} s ({out.passes:,} passes, {out.plan_seconds / max(out.passes, 1) * 1e3:.2f} ms "
            f"each; {out.skipped:,} events without a pass)"
        )
    asked = demand(w)
    fifo = outcomes["FIFO"]
    capacity = w.gpus * w.span
    util = {k: sum(o.got.values()) / capacity for k, o in outcomes.items()}
    say()
    say(f"{'policy':<34} {'Jain':>6} {'saturated':>9} {'1-GPU wait':>11} {'util':>6}")
    indexes = {}
    for k, o in outcomes.items():
        index, saturated = jain(o, asked, w.shares)
        indexes[k] = index
        wait = statistics.median(o.waits) if o.waits else 0.0
        say(f"{k:<34} {index:>6.3f} {saturated:>9} {wait / 60:>9.1f} m {util[k]:>6.1%}")
    tag = " (quick)" if args.quick else ""
    tag += f" ({args.hours:g} h)" if args.hours else ""
    for k in outcomes:
        if k == "FIFO":
            continue
        goal = ">= 0.95" if k == "decayed fair share" else "-"
        met = indexes[k] >= 0.95 if k == "decayed fair share" else None
        ROWS.append(Row(f"Jain index: {k}{tag}", indexes[k], indexes["FIFO"], "FIFO", goal, met, "cores"))
    for k, o in outcomes.items():
        if k != "FIFO":
            wait = statistics.median(o.waits)
            ROWS.append(Row(f"median wait, 1 GPU: {k}{tag}", wait, statistics.median(fifo.waits), "FIFO", "-", None))
    for k in outcomes:
        if k == "FIFO":
            continue
        goal = ">= 0.95x FIFO" if k.startswith("decayed") else "-"
        met = util[k] >= 0.95 * util["FIFO"] if k.startswith("decayed") else None
        ROWS.append(Row(f"GPU utilisation: {k}{tag}", util[k], util["FIFO"], "FIFO", goal, met, "cores"))
    preempts = "preempt" in Path(scheduler.__file__).read_text()
    ROWS.append(
        Row(
            f"work lost to preemption{tag}",
            None,
            None,
            "-",
            "<= 2% of GPU-hours",
            None,
            note="not measurable: plan() does not preempt yet"
            if not preempts
            else "plan() preempts: not simulated here",
        )
    )
    print_table(
        ["Jain", "median wait", "GPU util", "work lost"],
        56,
        "Jain's index and utilisation as fractions (utilisation: GPU-hours held / GPU-hours in the window), "
        "waits in seconds; anchor: the same jobs under FIFO",
    )


if __name__ == "__main__":
    main()
