"""Listing jobs with many running: `gpuport jobs` (the List RPC) on a `--ray` server, against a local one.

    .venv/bin/python bench/bench_listing.py            # about three minutes on 2 cores
    .venv/bin/python bench/bench_listing.py --quick

200 running `sleep` jobs that reserve nothing (the admin's quota of running jobs raised for them), on
a gpuport server that places jobs on a 2-node Ray cluster (nodes on this machine: tests/_ray.py),
then on a one-machine gpuport server, one after the other in the same run. Each listing is
`gpu.jobs()` on an open connection: the List RPC, every job with its log's size. Timed: the median
of the listings once the 200 run, the first of them included (the Ray server has then asked its
nodes for no log size yet). Goal: at most 100 ms on Ray.

Every cluster and server runs in a temp dir removed at the end, and is stopped in `finally` by the
pids it started.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _report
from _report import ROWS, Row, connect, gpuport_server, isolated_workdir, median, ms, print_table, say

JOBS = 200
SLEEP = ["sleep", "900"]
START_TIMEOUT = 600.0  # seconds for the 200 jobs to be running


def listings(server: object, n: int, what: str) -> list[float]:
    """Start JOBS sleeping jobs, time ``n`` listings once all run, then cancel them."""
    with connect(server) as gpu:  # type: ignore[arg-type]
        me = gpu.status().user
        gpu.set_quota(me, jobs=JOBS + 10, queued=JOBS + 10)
        start = time.perf_counter()
        jobs = [gpu.submit(SLEEP, workdir=None, name=f"sleep-{i}") for i in range(JOBS)]
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            running = [j for j in gpu.jobs() if j.info.state == "running"]
            if len(running) == JOBS:
                break
            if time.monotonic() > deadline:
                queued = [j.info for j in gpu.jobs() if j.info.state != "running"]
                raise RuntimeError(f"{what}: {len(running)} of {JOBS} running after {START_TIMEOUT:g}s: {queued[:2]}")
            time.sleep(1.0)
        say(f"  {what}: {JOBS} jobs running after {time.perf_counter() - start:.1f}s")
        times = []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                listed = gpu.jobs()
                times.append(time.perf_counter() - t0)
                assert len(listed) >= JOBS, len(listed)
        finally:
            for job in jobs:
                job.cancel()
    return times


def main() -> None:
    quick = _report.ray_bench_start(__doc__)
    n = 10 if quick else 30
    with isolated_workdir() as work:
        with _report.ray_cluster(work) as cluster:
            say(f"== `gpuport jobs` (List) with {JOBS} running jobs, {n} listings each")
            with gpuport_server(work, "ray-server", ["--ray", cluster.address]) as on_ray:
                ray_t = listings(on_ray, n, "Ray executor, 2 nodes")
        with gpuport_server(work, "local-server") as local:
            local_t = listings(local, n, "local executor")
    ray_s, local_s = median(ray_t), median(local_t)
    say(f"  Ray: median {ms(ray_s)} (first {ms(ray_t[0])}, max {ms(max(ray_t))}); local: median {ms(local_s)}")
    ROWS.append(Row(f"jobs listing: {JOBS} running, Ray", ray_s, local_s, "local executor", "<= 100 ms", ray_s <= 0.1))
    print_table(["jobs listing"], 40, "")


if __name__ == "__main__":
    main()
