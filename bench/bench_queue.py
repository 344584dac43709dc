"""The scheduler's queue against its anchors, measured in the same run, on 127.0.0.1.

    .venv/bin/python bench/bench_queue.py            # full sizes: one to two minutes on 2 cores
    .venv/bin/python bench/bench_queue.py --quick    # 5 latency runs, 200 jobs: under a minute

(a) submit-to-start latency with an idle queue: a job that prints the time its code started,
    `python -c "import time; print(repr(time.time()))"`, submitted with gpu.submit(..., workdir=None)
    (no folder sync) on an open connection; latency = the printed time - the time just before
    submit(), read from the job's log after job.wait(). Anchor: the same command run here with
    subprocess.Popen and the server's Python first on PATH (as jobs get it); latency = the printed
    time - the time just before Popen. Alternated one by one, median of N (--latency-runs, default
    20). Both include the start of a Python interpreter; the difference is what gpuport adds to it.
    Goal: at most 50 ms beyond process start (gpuport - local <= 50 ms).
(b) throughput: N no-op jobs (`true`, workdir=None, cpus=1; --jobs, default 1,000) submitted by one
    client, sequentially on one connection, as fast as it can, then all waited for; jobs/s = N / (time
    from the first submit to the end of the last job, as the job records say). With cpus=1 on this
    machine's CPUs, that many run at once and the rest wait in the queue. Anchor: N `true` processes
    run here with subprocess, as many at a time as the queue allows. Every job must end `succeeded`
    (as job.wait() saw it, and as gpu.jobs(all=True) lists it): failures are counted and printed,
    and the run exits 1. Printed beside it: each submit() call's time as the queue grows, and the
    start rate while the queue is deep and while it drains. Goal: >= 20 jobs/s on 2 cores.
    Also the server's memory: its VmRSS before the run, and its peak (VmHWM) at the end, read from
    /proc/<pid>/status of the server's own Python process; the anchor is its RSS before.
    Goal: peak <= 150 MB.
(c) idle server RSS: VmRSS of a freshly started server after one authenticated call (gpu.ping())
    and a second of idle. Anchor: the raw gRPC server of _servers.py (grpc.aio with TLS, the same
    certificate, and nothing of gpuport's: the floor) after one call and a second of idle.
    Goal: <= 80 MB.

Sections run in the order (c), (a) on the same server (after (c) is read), then (b) on a fresh one,
so that its peak RSS is that of the run alone. MB are 10^6 bytes. The load average at the start and
the end is printed: on 2 cores, anything else running shows in every figure. Every server runs in a temp dir
removed at the end, and is stopped in `finally`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
import _servers  # noqa: E402
from _report import (  # noqa: E402
    MB,
    ROWS,
    Row,
    banner,
    connect,
    gpuport_server,
    isolated_workdir,
    median,
    ms,
    print_table,
    rotate,
    say,
)

import gpuport  # noqa: E402
from gpuport.protocol import gpuport_pb2 as pb  # noqa: E402

BIN = Path(sys.executable).parent
# Prints the time its own code starts: after the interpreter's start, before anything else.
CLOCK = ["python", "-c", "import time; print(repr(time.time()))"]
NOOP = ["true"]
IDLE_S = 1.0  # the idle second of (c): what the server holds once it has settled after a call


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak RSS) of process ``pid``, in bytes."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = float(rest.split()[0]) * 1024  # the kernel writes kB, meaning KiB
    return values


def server_pid(server: _servers.Gpuport) -> int:
    """The pid of the server's own Python process (not a wrapper that would hold a different one)."""
    pid = server.process.pid
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    exe = os.path.realpath(f"/proc/{pid}/exe")
    if os.path.realpath(sys.executable) != exe or b"gpuport" not in argv or b"server" not in argv:
        raise SystemExit(f"pid {pid} is not the gpuport server's Python: {exe} {argv!r}")
    return pid


def job_env() -> dict[str, str]:
    """The environment a job gets, as far as finding `python` goes: the server's Python first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_") and k != "PYTHONUNBUFFERED"}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "/usr/bin:/bin")])
    return env


def ended_badly(job: gpuport.Job) -> str | None:
    i = job.info
    if i.state == "succeeded":
        return None
    return f"job {job.id} ended {i.state} (exit {i.exit_code}): {i.message}"


# ---- (a) submit-to-start latency ---------------------------------------------------------------------


def bench_latency(args: argparse.Namespace, server: _servers.Gpuport) -> None:
    say(f"== (a) submit-to-start latency, idle queue: {' '.join(CLOCK[:2])} '...print(time.time())'")
    env = job_env()
    spans: list[tuple[float, float, float]] = []  # t0 -> created, created -> started, started -> code

    with connect(server) as gpu:

        def remote() -> float:
            t0 = time.time()
            job = gpu.submit(CLOCK, workdir=None)
            job.wait(60)
            if (bad := ended_badly(job)) is not None:
                raise RuntimeError(bad)
            printed = float([line for line in job.logs() if line.strip()][-1])
            i = job.info
            assert i.started_at is not None
            spans.append((i.created_at - t0, i.started_at - i.created_at, printed - i.started_at))
            return printed - t0

        def local() -> float:
            t0 = time.time()
            process = subprocess.Popen(CLOCK, stdout=subprocess.PIPE, env=env, text=True)
            out, _ = process.communicate(timeout=60)
            if process.returncode != 0:
                raise RuntimeError(f"local {CLOCK[0]} exited {process.returncode}")
            return float(out.strip()) - t0

        rotate(2, {"remote": remote, "local": local})  # warm-up
        spans.clear()
        t = rotate(args.latency_runs, {"remote": remote, "local": local})
    r, lo = median(t["remote"]), median(t["local"])
    say(
        f"  gpuport median {ms(r)} (min {ms(min(t['remote']))}, max {ms(max(t['remote']))}), "
        f"local Popen median {ms(lo)} (min {ms(min(t['local']))}); {args.latency_runs} each, alternated"
    )
    rpc, queued, launch = (median([s[k] for s in spans]) for k in range(3))
    say(
        f"  split (medians, server clock): submit call to the job's record {ms(rpc)}; record to started "
        f"(scheduling) {ms(queued)}; started to the job's code running {ms(launch)} (job dir, supervisor, "
        f"interpreter: the local run's whole start is {ms(lo)})"
    )
    extra = r - lo
    ROWS.append(
        Row(
            "submit-to-start, idle queue",
            r,
            lo,
            "local Popen, same command",
            "<= local + 50 ms",
            extra <= 0.050,
            note=f"is {extra * 1e3:+.0f} ms",
        )
    )


# ---- (b) throughput ----------------------------------------------------------------------------------


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals that were open at once."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def bench_throughput(args: argparse.Namespace, server: _servers.Gpuport) -> int:
    """Returns the number of jobs that did not succeed."""
    n = args.jobs
    slots = os.cpu_count() or 1  # what the server counts: os.cpu_count()
    say(f"== (b) throughput: {n:,} jobs `true` (cpus=1: {slots} at a time on {slots} CPUs), one client")
    pid = server_pid(server)

    with connect(server) as gpu:
        gpu.ping()
        before = memory(pid)["VmRSS"]
        jobs: list[gpuport.Job] = []
        submits: list[float] = []  # each submit call's duration, as the queue grows
        first = time.time()
        for _ in range(n):
            start = time.perf_counter()
            jobs.append(gpu.submit(NOOP, workdir=None, cpus=1))
            submits.append(time.perf_counter() - start)
        submitted = time.time()
        waiting = len(gpu.queue())
        for job in jobs:
            job.wait(600)
        seen = time.time()
        after = memory(pid)
        listed = gpu.jobs(all=True)
    bad = {job.id: why for job in jobs if (why := ended_badly(job)) is not None}
    ours = {job.id for job in jobs}
    # A second door on the same records: what the list says of our jobs must agree.
    for j in listed:
        if j.id in ours and j.id not in bad and j.info.state != "succeeded":
            bad[j.id] = f"job {j.id} is {j.info.state} in gpu.jobs(all=True), succeeded as waited for"
    failures = list(bad.values())

    infos = [job.info for job in jobs]
    last = max(i.ended_at for i in infos if i.ended_at is not None)
    rate = n / (last - first)
    tenth = max(1, n // 10)
    say(
        f"  submitted sequentially on one connection in {submitted - first:.2f}s "
        f"({n / (submitted - first):.0f} submits/s); {waiting} still queued then; one submit() took "
        f"{ms(median(submits[:tenth]))} (median of the first {tenth}), "
        f"{ms(median(submits[-tenth:]))} (of the last {tenth})"
    )
    say(
        f"  first submit to the last job's end {last - first:.2f}s: {rate:.1f} jobs/s "
        f"(to the client seeing every end: {seen - first:.2f}s)"
    )
    spans = [(i.started_at, i.ended_at) for i in infos if i.started_at is not None and i.ended_at is not None]
    runs = sorted(b - a for a, b in spans)
    starts = sorted(a for a, _ in spans)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    quarter = max(2, len(starts) // 4)
    early = (quarter - 1) / (starts[quarter - 1] - starts[0])
    late = (quarter - 1) / (starts[-1] - starts[-quarter])
    say(
        f"  per job (server records): started->ended median {ms(median(runs))} (p90 {ms(runs[len(runs) * 9 // 10])}); "
        f"between consecutive starts median {ms(median(gaps))}; most running at once {max_overlap(spans)} "
        f"(of {slots} slots)"
    )
    say(f"  starts/s: {early:.1f} over the first {quarter} starts (queue deepest), {late:.1f} over the last {quarter}")
    if len(listed) < n:
        say(f"  note: gpu.jobs(all=True) listed {len(listed)} jobs, not all {n:,}: the server caps the list")
    if failures:
        say(f"  FAILED: {len(failures)} of {n:,} jobs did not succeed:")
        for line in failures[:20]:
            say(f"    {line}")
        if len(failures) > 20:
            say(f"    ... and {len(failures) - 20} more")
    else:
        say(f"  all {n:,} jobs succeeded")

    def run_true(_: int) -> None:
        subprocess.run(NOOP, check=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(run_true, range(n)))
    local_rate = n / (time.perf_counter() - start)
    say(f"  local: {n:,} `true` processes, {slots} at a time (threads + subprocess.run): {local_rate:.0f} jobs/s")

    peak = after["VmHWM"]
    say(
        f"  server (pid {pid}) RSS: {before / MB:.0f} MB before, {after['VmRSS'] / MB:.0f} MB after, "
        f"peak {peak / MB:.0f} MB"
    )
    ROWS.append(
        Row(
            f"throughput, {n:,} no-op jobs",
            rate,
            local_rate,
            f"local `true`, {slots} at a time",
            ">= 20 jobs/s",
            rate >= 20 and not failures,
            unit="jobs/s",
            note=f"{len(failures)} failed" if failures else "",
        )
    )
    ROWS.append(
        Row(
            f"server peak RSS over {n:,} jobs",
            peak,
            before,
            "its own RSS before",
            "<= 150 MB",
            peak <= 150 * MB,
            unit="MB",
        )
    )
    return len(failures)


# ---- (c) idle RSS ------------------------------------------------------------------------------------


def raw_ping(address: str, cert: bytes) -> None:
    channel = grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=cert),
        options=[("grpc.ssl_target_name_override", "localhost")],
    )
    with channel:
        call = channel.unary_unary(
            _servers.PROTO_METHOD,
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.Empty.FromString,
        )
        call(pb.Empty(), timeout=10)


def bench_idle(server: _servers.Gpuport) -> None:
    say("== (c) idle RSS of a fresh server, after one authenticated call and a second of idle")
    pid = server_pid(server)
    with connect(server) as gpu:
        gpu.ping()
        time.sleep(IDLE_S)  # idle is what is measured: no condition to poll for
        ours = memory(pid)["VmRSS"]
    cert_path, key_path = server.state_dir / "tls" / "cert.pem", server.state_dir / "tls" / "key.pem"
    raw = _servers.start_raw(cert_path, key_path)
    try:
        raw_ping(raw.address, cert_path.read_bytes())
        time.sleep(IDLE_S)
        floor = memory(raw.process.pid)["VmRSS"]
    finally:
        raw.stop()
    say(f"  gpuport server {ours / MB:.0f} MB; raw grpc.aio server with TLS {floor / MB:.0f} MB")
    ROWS.append(
        Row("idle server RSS", ours, floor, "raw grpc.aio + TLS server", "<= 80 MB", ours <= 80 * MB, unit="MB")
    )


# ---- main --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 latency runs and 200 jobs")
    parser.add_argument("--latency-runs", type=int, help="submit-to-start runs of each kind (default 20)")
    parser.add_argument("--jobs", type=int, help="no-op jobs for the throughput figure (default 1000)")
    args = parser.parse_args()
    if args.latency_runs is None:
        args.latency_runs = 5 if args.quick else 20
    if args.jobs is None:
        args.jobs = 200 if args.quick else 1000

    banner(f"grpcio {grpc.__version__}", args.quick)
    failed = 0
    with isolated_workdir() as work:
        with gpuport_server(work, "idle-server") as server:
            bench_idle(server)
            bench_latency(args, server)
        with gpuport_server(work, "queue-server") as server:
            failed = bench_throughput(args, server)
    say("load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print_table(
        ("submit-to-start", "throughput", "server peak", "idle"),  # the brief's order, not the run's
        width=34,
        legend="ratio: gpuport / anchor (times and MB: lower is better; jobs/s: higher is better)",
    )
    if failed:
        raise SystemExit(f"{failed} of {args.jobs} jobs did not succeed")


if __name__ == "__main__":
    main()
