"""Submits per second through the API into the store, as the queue grows deep, on 127.0.0.1.

    .venv/bin/python bench/bench_submits.py            # 4,000 jobs: about a minute on 2 cores
    .venv/bin/python bench/bench_submits.py --quick    # 1,000 jobs

A fresh server with two fake GPUs, both held by sleeping jobs, so that every job
submitted stays queued: each submit is an insert into the store, and a scheduling pass over a queue
one job deeper until the queue is past the pass's look-ahead (then the last pass stands: see
``decided_alike`` in gpuport/server/scheduler.py). --threads clients (each its own connection) submit `true` (1 GPU, workdir=None:
no folder to sync) as fast as they can; submits/s is counted per band of 1,000 queued jobs, and
over the run. Anchor: the same clients making the same number of authenticated no-op calls
(`Client.ping`) in the same run: the API's own rate on this machine, which a submit cannot beat.
Goal: >= 1,000 submits/s. The holding jobs are cancelled and the server stopped at the end (the
queued jobs never run: their state dir goes with the temp dir).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import ROWS, Row, banner, connect, gpuport_server, isolated_workdir, print_table, say  # noqa: E402

HOLD = "import time; time.sleep(3600)"
BAND = 1000


def run_clients(clients: list, count: int, call: object) -> list[float]:
    """``count`` calls of ``call(client)`` shared by one thread per client; the time each call ended."""
    ends: list[float] = []
    lock = threading.Lock()
    left = [count]

    def work(client: object) -> None:
        while True:
            with lock:
                if not left[0]:
                    return
                left[0] -= 1
            call(client)  # type: ignore[operator]
            done = time.perf_counter()
            with lock:
                ends.append(done)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1,000 jobs")
    args = parser.parse_args()
    jobs = 1000 if args.quick else args.jobs
    banner(f"{args.threads} client threads", args.quick)
    with isolated_workdir() as work, gpuport_server(work, "submits") as server:
        clients = [connect(server) for _ in range(args.threads)]
        gpu = clients[0]
        holders = []
        try:
            holders += [gpu.submit(["python", "-c", HOLD], workdir=None, gpus=1) for _ in range(2)]
            deadline = time.monotonic() + 60
            while not all(h.status == "running" for h in holders):
                if time.monotonic() > deadline:
                    raise SystemExit("the two holding jobs did not start")
                time.sleep(0.05)
            for client in clients:  # connections open, first calls made
                client.ping()
            started = time.perf_counter()
            pings = run_clients(clients, jobs, lambda c: c.ping())
            ping_rate = jobs / (pings[-1] - started)
            started = time.perf_counter()
            submits = run_clients(clients, jobs, lambda c: c.submit(["true"], workdir=None, gpus=1))
            rate = jobs / (submits[-1] - started)
            queued = gpu.job(gpu.jobs()[0].id).info
            assert queued.state == "queued", queued
            say(f"  pings: {ping_rate:.0f}/s; submits: {rate:.0f}/s over {jobs:,} jobs")
            edges = [started, *submits[BAND - 1 :: BAND]]
            for n, (a, b) in enumerate(zip(edges, edges[1:])):
                say(f"    queued {n * BAND:>6,}-{(n + 1) * BAND:,}: {BAND / (b - a):.0f} submits/s")
            ROWS.append(
                Row(
                    f"submits/s into a queue {jobs:,} deep",
                    rate,
                    ping_rate,
                    "no-op calls/s (Client.ping), same clients",
                    ">= 1,000/s",
                    rate >= 1000,
                    unit="jobs/s",
                )
            )
        finally:
            for holder in holders:  # jobs outlive a server that stops: they end now
                holder.cancel()
            for holder in holders:
                holder.wait(30)
            for client in clients:
                client.close()
    print_table(["submits"], 34, f"{args.threads} client threads, one connection each; the ratio is submits/pings")


if __name__ == "__main__":
    main()
