"""gpuport in front of Slurm (`gpuport server --slurm`), against Slurm's own commands in the same run.

    .venv/bin/python bench/bench_slurm.py            # about five minutes on 2 cores (as root, with
    .venv/bin/python bench/bench_slurm.py --quick    # Debian's slurm-wlm and munge installed)
    .venv/bin/python bench/bench_slurm.py --quick --only one-node --slurm-rest   # (a), (b) through slurmrestd

With --slurm-rest the cluster also runs slurmrestd (JWT; Debian's slurmrestd package) and the
server submits, lists and cancels through it (`--slurm-rest URL`, SLURM_JWT): the anchors stay
Slurm's commands.

A one-node Slurm cluster on this machine (tests/_slurm.py: slurmctld + slurmd, 2 fake GPUs as gres).

(a) submit -> exit of `python -c pass`: through gpuport's Python API (gpu.submit(..., workdir=None)
    + job.wait(), on an open connection), against `sbatch --wait --wrap 'python -c pass'` of the same
    (the anchor of the goal), and against `sbatch --parsable` followed by `squeue -j ID` every 20 ms
    until the job has left (a tight watcher: what Slurm itself can do). Alternated one by one.
    Goal: at most sbatch --wait + 150 ms.
(b) the queue with 1,000 gpuport jobs pending in Slurm (both GPUs held by a job of Slurm's own):
    `gpu.queue()` (the Queue RPC, on an open connection; goal: at most 300 ms: one squeue for all of
    them, never one per job), and the whole CLI process `gpuport queue --json` and `gpuport queue`
    (its table), against `squeue` listing the same jobs.
(c) submit -> exit of a job over two nodes (a second cluster: two slurmd on this machine), one
    `python -c pass` on each: gpu.submit(..., nodes=2) against `sbatch --wait --nodes=2 --wrap
    'srun python -c pass'`. No goal: what gpuport's setup of the ranks (scontrol, a srun step that
    asks each node for free ports, a srun step per rank) adds to Slurm's own.

The cluster and the server run in a temp dir removed at the end, and are stopped by their pids.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from _report import (
    ROWS,
    Row,
    banner,
    cli_login_env,
    connect,
    gpuport_server,
    isolated_workdir,
    median,
    ms,
    print_table,
    rotate,
    say,
)

from tests._slurm import SlurmCluster, missing, rest_missing, start_cluster

PASS = [sys.executable, "-c", "pass"]


def _sbatch_version(cluster: SlurmCluster) -> str:
    done = subprocess.run(["sbatch", "--version"], env=cluster.env(), capture_output=True, text=True, check=False)
    return done.stdout.strip() or "sbatch ?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only", choices=["one-node", "nodes"], help="(a) and (b), or (c) alone")
    parser.add_argument("--slurm-rest", action="store_true", help="the server talks to Slurm through slurmrestd")
    args = parser.parse_args()
    if missing() or (args.slurm_rest and rest_missing()):
        raise SystemExit(missing() or rest_missing())
    rest = args.slurm_rest
    with isolated_workdir() as work:
        if args.only != "nodes":
            start = time.perf_counter()
            cluster = start_cluster(work / "cluster", rest=rest)
            banner(_sbatch_version(cluster) + (", through slurmrestd" if rest else ""), args.quick)
            say(f"== a one-node Slurm cluster (2 fake GPUs as gres) up in {time.perf_counter() - start:.1f}s")
            try:
                os.environ["SLURM_CONF"] = str(cluster.conf)  # the server's (start_gpuport passes our env on)
                options = ["--slurm", "--shared-dir", str(work / "shared")]
                if rest:
                    os.environ["SLURM_JWT"] = cluster.token(lifespan=7200)
                    options += ["--slurm-rest", cluster.rest_url]
                with gpuport_server(work, "slurm-server", options) as server:
                    bench_launch(3 if args.quick else 6, work, server, cluster)
                    bench_queue(1000, work, server, cluster)
            finally:
                cluster.cancel_all()
                cluster.close()
        if args.only != "one-node":
            start = time.perf_counter()
            cluster = start_cluster(work / "cluster2", nodes=2, rest=rest)
            if args.only == "nodes":
                banner(_sbatch_version(cluster), args.quick)
            say(f"== a two-node Slurm cluster (2 fake GPUs each) up in {time.perf_counter() - start:.1f}s")
            try:
                os.environ["SLURM_CONF"] = str(cluster.conf)
                options = ["--slurm", "--shared-dir", str(work / "shared2")]
                if rest:
                    os.environ["SLURM_JWT"] = cluster.token(lifespan=7200)
                    options += ["--slurm-rest", cluster.rest_url]
                with gpuport_server(work, "slurm-server2", options) as server:
                    bench_nodes(3 if args.quick else 6, work, server, cluster)
            finally:
                cluster.cancel_all()
                cluster.close()
    print_table(["launch", "queue", "nodes"], 40, "")


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def bench_launch(n: int, work: Path, server: object, cluster: SlurmCluster) -> None:
    say("== (a) submit -> exit of `python -c pass`: gpuport's API vs sbatch --wait vs sbatch + a tight squeue watch")
    env = cluster.env()
    out = str(work / "slurm-%j.out")
    with connect(server) as gpu:  # type: ignore[arg-type]

        def through_gpuport() -> None:
            job = gpu.submit(PASS, workdir=None).wait(120)
            if job.info.exit_code != 0:
                raise RuntimeError(f"job {job.id} ended {job.info.state}: {job.info.message}")

        def sbatch_wait() -> None:
            argv = ["sbatch", "--wait", f"--output={out}", "--wrap", " ".join(PASS)]
            subprocess.run(argv, env=env, check=True, capture_output=True)

        def sbatch_watched() -> None:
            argv = ["sbatch", "--parsable", f"--output={out}", "--wrap", " ".join(PASS)]
            slurm_id = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout.strip()
            while True:
                listed = subprocess.run(
                    ["squeue", "-h", "-j", slurm_id], env=env, capture_output=True, text=True, check=False
                )
                if listed.returncode or not listed.stdout.strip():
                    return
                time.sleep(0.02)

        calls = {"gpuport": timed(through_gpuport), "sbatch": timed(sbatch_wait), "watched": timed(sbatch_watched)}
        rotate(1, calls)  # warm-up
        t = rotate(n, calls)
    ours, anchor, tight = median(t["gpuport"]), median(t["sbatch"]), median(t["watched"])
    say(
        f"  gpuport median {ms(ours)} (min {ms(min(t['gpuport']))}), sbatch --wait {ms(anchor)}, "
        f"sbatch + squeue every 20 ms {ms(tight)}, of {n} each"
    )
    ROWS.append(
        Row("launch: API via Slurm", ours, anchor, "sbatch --wait", "<= sbatch --wait + 150 ms", ours <= anchor + 0.150)
    )
    ROWS.append(Row("launch: API via Slurm, tight anchor", ours, tight, "sbatch + squeue/20ms", "(no goal)", None))


def bench_queue(count: int, work: Path, server: object, cluster: SlurmCluster) -> None:
    say(f"== (b) `gpuport queue` with {count} gpuport jobs pending in Slurm, vs squeue of them")
    env = cluster.env()
    hold = ["sbatch", "--parsable", "--gres=gpu:2", f"--output={work / 'hold.out'}", "--wrap", "sleep 3600"]
    subprocess.run(hold, env=env, check=True, capture_output=True)
    jobs_dir = work / "shared" / "jobs"
    start = time.perf_counter()
    with connect(server) as gpu, ThreadPoolExecutor(4) as pool:  # type: ignore[arg-type]
        list(pool.map(lambda _: gpu.submit(PASS, workdir=None, gpus=1), range(count)))
    deadline = time.monotonic() + 600
    while sum(1 for _ in jobs_dir.glob("*/slurm.id")) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    say(f"  {count} jobs submitted and handed to Slurm in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    with connect(server) as gpu:  # type: ignore[arg-type]
        while time.perf_counter() - start < 120:  # the watcher's next look at Slurm's queue shows the last ones
            if sum(1 for j in gpu.queue() if j.message.startswith("Slurm: ")) >= count:
                break
            time.sleep(0.2)
    say(f"  all of them listed with Slurm's reason {time.perf_counter() - start:.1f}s later")
    cli_env = cli_login_env(server, work / "config", work / "cache")  # type: ignore[arg-type]
    cli_env["COLUMNS"] = "200"

    def api_queue(gpu: object) -> Callable[[], float]:
        def once() -> float:
            time.sleep(0.5)  # the server's own look at Slurm's queue (its watcher's, each second) goes on meanwhile
            start = time.perf_counter()
            listed = gpu.queue()  # type: ignore[attr-defined]
            took = time.perf_counter() - start
            if sum(1 for j in listed if j.message.startswith("Slurm: ")) < count:
                raise RuntimeError(f"the queue listed {len(listed)} jobs")
            return took

        return once

    def cli_queue(*flags: str) -> Callable[[], float]:
        def once() -> float:
            start = time.perf_counter()
            argv = [sys.executable, "-m", "gpuport", "queue", *flags]
            done = subprocess.run(argv, env=cli_env, capture_output=True, text=True, check=False)
            took = time.perf_counter() - start
            if done.returncode or done.stdout.count("Slurm: ") < count:
                raise RuntimeError(f"gpuport queue listed {done.stdout.count('Slurm: ')} jobs: {done.stderr[-2000:]}")
            return took

        return once

    def squeue() -> float:
        start = time.perf_counter()
        subprocess.run(["squeue", "-h", "-u", "root", "-o", "%i|%T|%r"], env=env, check=True, capture_output=True)
        return time.perf_counter() - start

    def rest_jobs() -> float:  # what the server's watcher asks of slurmrestd each second with --slurm-rest
        headers = {"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": os.environ["SLURM_JWT"]}
        request = urllib.request.Request(f"{cluster.rest_url}/slurm/v0.0.38/jobs", headers=headers)
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as reply:
            reply.read()
        return time.perf_counter() - start

    with connect(server) as gpu:  # type: ignore[arg-type]
        calls = {"api": api_queue(gpu), "json": cli_queue("--json"), "table": cli_queue(), "squeue": squeue}
        if cluster.rest_url:
            calls["rest"] = rest_jobs
        t = rotate(5, calls)
    api, js, table, anchor = (median(t[k]) for k in ("api", "json", "table", "squeue"))
    say(
        f"  gpu.queue() median {ms(api)} (max {ms(max(t['api']))}), `gpuport queue --json` {ms(js)}, "
        f"`gpuport queue` (the table) {ms(table)}, squeue {ms(anchor)}, of 5 each"
    )
    ROWS.append(Row(f"queue: gpu.queue(), {count} pending", api, anchor, "squeue", "<= 300 ms", api <= 0.300))
    ROWS.append(Row(f"queue: `gpuport queue --json`, {count}", js, anchor, "squeue", "(no goal)", None))
    ROWS.append(Row(f"queue: `gpuport queue`, {count} (table)", table, anchor, "squeue", "(no goal)", None))
    if cluster.rest_url:
        rest = median(t["rest"])
        say(f"  slurmrestd's GET /slurm/v0.0.38/jobs (all jobs Slurm keeps, as JSON) {ms(rest)}, of 5")
        ROWS.append(Row("queue: slurmrestd GET /jobs, all", rest, anchor, "squeue", "(no goal)", None))


def bench_nodes(n: int, work: Path, server: object, cluster: SlurmCluster) -> None:
    say("== (c) submit -> exit of `python -c pass` on each of two nodes: gpuport's API vs sbatch --wait + srun")
    env = cluster.env()
    out = str(work / "slurm2-%j.out")
    with connect(server) as gpu:  # type: ignore[arg-type]

        def through_gpuport() -> None:
            job = gpu.submit(PASS, workdir=None, nodes=2).wait(120)
            if job.info.exit_code != 0:
                raise RuntimeError(f"job {job.id} ended {job.info.state}: {job.info.message}")

        def sbatch_srun() -> None:
            argv = ["sbatch", "--wait", "--nodes=2", f"--output={out}", "--wrap", "srun " + " ".join(PASS)]
            subprocess.run(argv, env=env, check=True, capture_output=True)

        calls = {"gpuport": timed(through_gpuport), "sbatch": timed(sbatch_srun)}
        rotate(1, calls)  # warm-up
        t = rotate(n, calls)
    ours, anchor = median(t["gpuport"]), median(t["sbatch"])
    say(f"  gpuport median {ms(ours)} (min {ms(min(t['gpuport']))}), sbatch --wait + srun {ms(anchor)}, of {n} each")
    ROWS.append(Row("nodes: API via Slurm, 2 nodes", ours, anchor, "sbatch --wait + srun", "(no goal)", None))


if __name__ == "__main__":
    main()
