"""Jobs, sync and logs of gpuport against their anchors, measured in the same run, on 127.0.0.1.

    .venv/bin/python bench/bench_jobs.py            # full sizes: a few minutes on 2 cores
    .venv/bin/python bench/bench_jobs.py --quick    # smaller sizes and fewer repeats: about a minute

(a) launch
    1. Python API: gpu.submit(["python", "-c", "pass"], workdir=<1-file folder>) + job.wait(), on an
       open connection, against `python -c pass` run here as a subprocess (the same interpreter: jobs
       run with the server's Python first on PATH). Alternated one by one, median of N.
       Goal: at most 100 ms more than the local run.
    2. CLI: `gpuport run --workdir <1-file folder> -- python -c pass` as a whole process (Python
       start, imports, connect, sync, run, log stream, exit). Median of N. Goal: under 0.5 s.
    3. The peer: `ray job submit -- python -c pass` to a local Ray head (token auth, dashboard and
       everything else on 127.0.0.1), as a whole process, against the CLI of (2). Median of N.
(b) sync of a synthetic project (seeded random content: small files of 1-20 KB in nested folders,
    and a few large files), against `rsync -a DIR/ rsync://127.0.0.1:PORT/...` to an rsync daemon
    (whole process; plain rsync protocol, no TLS, no auth). Cases:
      first sync   gpuport: a fresh server (empty blob store) and an empty client hash cache;
                   rsync: an empty destination folder.
      no change    the same folder again.
      after touch  after rewriting the content of 10 small files (same sizes).
    gpuport is timed both in-process (gpu.push(folder, name=...) on an open connection) and as a
    whole `gpuport push DIR --name NAME` process (logged in, through the CLI's helper, as users get
    it). Beside them, not an anchor: `rsync -a -e ssh` through an sshd on 127.0.0.1 with throwaway
    keys (the way people sync today; skipped, saying why, without openssh-server). All are
    alternated, order rotating. Goals: first sync at most 1.0x rsync; no change and after touch at
    most 0.5x. For the first sync it also prints the CPU each side spent (rsync's daemon and client;
    gpuport's server and this process during the API push), the user's and the kernel's.
(c) logs: a job printing 100-byte lines in a loop (100 MB by default), streamed with
    job.log_chunks(follow=True) from submit to the last byte, against the same program run here with
    stdout redirected to a file. Goal: at least 0.5x the local speed.

Needs `rsync` (Debian package) for (b) and `ray[default]` for (a3); without them those figures are
skipped with a line saying so. Sections run in the order (b), (a), (c), (a3): sync first, on a
filesystem this run has not churned yet; Ray last, so that its idle daemons load no CPU during the
others. Every server and daemon runs in a temp dir removed at the end, and is stopped in `finally`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).parent))
import _peers  # noqa: E402
import _servers  # noqa: E402
from _report import (  # noqa: E402
    ROWS,
    Row,
    banner,
    cli_helper_env,
    cli_login_env,
    compile_gpuport,
    connect,
    gpuport_server,
    isolated_workdir,
    median,
    ms,
    print_table,
    rotate,
    say,
    stop_cli_helpers,
    timed,
)

import gpuport  # noqa: E402

BIN = Path(sys.executable).parent
GPUPORT_CLI = str(BIN / "gpuport")
PASS = ["python", "-c", "pass"]
# gpuport caches the hash of a file only once the file is 2 s old; a real project's files are older than
# that, so the synthetic one is given 2 s to settle before its first sync.
SETTLED_S = 2.1


def run_quiet(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:4])} ... exited {result.returncode}: {(result.stdout + result.stderr)[-2000:]}"
        )
    return result


def cli_env(server: _servers.Gpuport, work: Path, cache: Path) -> dict[str, str]:
    """A CLI user logged in to ``server``, with server commands through the CLI's helper, as users get it."""
    return {**cli_login_env(server, work / "cli-config", cache), **cli_helper_env(work)}


def cli_has(command: str) -> bool:
    """Whether the installed CLI has ``gpuport COMMAND``."""
    try:
        run_quiet([GPUPORT_CLI, command, "--help"])
    except (RuntimeError, OSError):
        return False
    return True


# ---- (a) launch --------------------------------------------------------------------------------------


def bench_launch(args: argparse.Namespace, work: Path, server: _servers.Gpuport) -> float | None:
    """(1) and (2); returns the CLI's median for the Ray comparison."""
    say("== (a) launch: `python -c pass`")
    workdir = work / "launch-project"
    workdir.mkdir()
    (workdir / "train.py").write_text("print('hello')\n")
    cli_cwd = work / "cli-cwd"  # `gpuport run` puts outputs under ./gpuport-outputs/
    cli_cwd.mkdir()

    with connect(server) as gpu:

        def api() -> None:
            job = gpu.submit(PASS, workdir=workdir)
            job.wait()
            if job.info.exit_code != 0:
                raise RuntimeError(f"job {job.id} ended {job.info.state} ({job.info.exit_code}): {job.info.message}")

        def local() -> None:
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        rotate(3, {"api": timed(api), "local": timed(local)})  # warm-up
        t = rotate(args.launch, {"api": timed(api), "local": timed(local)})
        # Where the time goes, from the server's own timestamps, on a few more runs.
        spans = []
        for _ in range(min(5, args.launch)):
            start = time.time()
            job = gpu.submit(PASS, workdir=workdir)
            submitted = time.time()
            job.wait()
            done = time.time()
            i = job.info
            assert i.started_at and i.ended_at
            spans.append((submitted - start, i.ended_at - i.started_at, done - submitted - (i.ended_at - i.started_at)))
    api_s, local_s = median(t["api"]), median(t["local"])
    say(
        f"  API submit+wait  median {ms(api_s)} (min {ms(min(t['api']))}), local subprocess median {ms(local_s)}"
        f" (min {ms(min(t['local']))}), of {args.launch} each, alternated"
    )
    sync_submit, supervised, rest = (median([s[k] for s in spans]) for k in range(3))
    say(
        f"  split (median of {len(spans)}): submit() incl. workdir sync {ms(sync_submit)}; "
        f"job started->ended (server clock) {ms(supervised)}; the rest (queue, start, wait reply) {ms(rest)}"
    )
    extra = api_s - local_s
    ROWS.append(
        Row(
            "launch: API submit+wait",
            api_s,
            local_s,
            "local `python -c pass`",
            "<= local + 100 ms",
            extra <= 0.100,
            note=f"is +{extra * 1e3:.0f} ms",
        )
    )

    env = cli_env(server, work, work / "cli-cache")
    cli_argv = [GPUPORT_CLI, "run", "--workdir", str(workdir), "--", *PASS]
    if not cli_has("run"):
        say("  CLI: no `gpuport run` command; skipped")
        ROWS.append(Row("launch: CLI `gpuport run`", None, local_s, "local `python -c pass`", "< 0.5 s", None))
        return None
    run_quiet(cli_argv, env=env, cwd=cli_cwd)  # warm-up
    t = rotate(
        args.cli,
        {
            "cli": timed(lambda: run_quiet(cli_argv, env=env, cwd=cli_cwd)),
            "bare": timed(lambda: run_quiet([GPUPORT_CLI, "--version"], env=env, cwd=cli_cwd)),
        },
    )
    cli_s, bare_s = median(t["cli"]), median(t["bare"])
    say(
        f"  CLI `gpuport run -- python -c pass` median {ms(cli_s)} (min {ms(min(t['cli']))}) of {args.cli}; "
        f"`gpuport --version` alone (Python start + CLI imports) {ms(bare_s)}"
    )
    ROWS.append(Row("launch: CLI `gpuport run`", cli_s, local_s, "local `python -c pass`", "< 0.5 s", cli_s < 0.5))
    return cli_s


def bench_ray(args: argparse.Namespace, work: Path, cli_s: float | None) -> None:
    say("== (a3) launch: `ray job submit -- python -c pass` to a local Ray head")
    figure = "launch: CLI `gpuport run` vs Ray"
    if _peers.ray_cli() is None:
        say("  ray: not installed (pip install 'gpuport[bench]')")
        ROWS.append(Row(figure, cli_s, None, "ray: not installed", "peer (info)", None))
        return
    folder = work / "ray-cwd"
    folder.mkdir()
    start = time.perf_counter()
    try:
        head = _peers.start_ray(work)
    except Exception as e:  # noqa: BLE001 - say why and go on: Ray is the peer, not the subject
        say(f"  ray {_peers.ray_version()}: could not start a head here: {str(e)[-1500:]}")
        ROWS.append(Row(figure, cli_s, None, "ray: failed to start", "peer (info)", None))
        return
    try:
        say(f"  ray {_peers.ray_version()} head up in {time.perf_counter() - start:.1f}s, job API at {head.address}, "
            f"auth: {head.auth}")  # fmt: skip
        say(f"  loopback check: {head.check_loopback()}")
        head.submit(PASS, folder)  # warm-up
        times = [head.submit(PASS, folder) for _ in range(args.ray)]
        ray_s = median(times)
        say(f"  ray job submit median {ms(ray_s)} (min {ms(min(times))}) of {args.ray}")
        say(f"  loopback check after the jobs: {head.check_loopback()}")
    except Exception as e:  # noqa: BLE001
        say(f"  ray: job submission failed here: {str(e)[-1500:]}")
        ROWS.append(Row(figure, cli_s, None, "ray: submit failed", "peer (info)", None))
        return
    finally:
        head.stop()
        left = _peers.alive_in_session(head.process.pid)
        if left:
            say(f"  WARNING: Ray processes still alive after stop: {left}")
    ROWS.append(Row(figure, cli_s, ray_s, "ray job submit", "peer (info)", None))


# ---- (b) sync ----------------------------------------------------------------------------------------


def make_project(root: Path, small: int, big: int, big_mb: int, seed: int) -> tuple[list[Path], int]:
    """A seeded synthetic project: ``small`` files of 1-20 KB in nested folders, ``big`` files of ``big_mb`` MB."""
    rng = random.Random(seed)
    files: list[Path] = []
    total = 0
    for i in range(small):
        path = root / "src" / f"pkg{i % 20:02d}" / f"mod{(i // 20) % 5}" / f"file{i:05d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(1024, 20 * 1024))
        path.write_bytes(data)
        files.append(path)
        total += len(data)
    (root / "data").mkdir(exist_ok=True)
    for k in range(big):
        data = rng.randbytes(big_mb * 1024 * 1024)
        (root / "data" / f"shard{k}.bin").write_bytes(data)
        total += len(data)
    return files, total


def bench_sync(args: argparse.Namespace, work: Path) -> None:
    say("== (b) sync of a synthetic project")
    version = _peers.rsync_version()
    if version is None:
        say("  rsync: not installed (apt-get install rsync); sync figures skipped")
        for case in ("first", "no change", "10 touched"):
            ROWS.append(Row(f"sync {case}: API push", None, None, "rsync not installed", "-", None))
        return
    project = work / "project"
    start = time.perf_counter()
    small_files, total = make_project(project, args.small_files, args.big_files, args.big_mb, args.seed)
    made = time.perf_counter()
    count = len(small_files) + args.big_files
    say(
        f"  project: {len(small_files)} files of 1-20 KB in {len({p.parent for p in small_files})} folders + "
        f"{args.big_files} x {args.big_mb} MB = {count} files, {total / 1e6:.0f} MB (made in {made - start:.1f}s)"
    )
    time.sleep(max(0.0, SETTLED_S - (time.perf_counter() - made)))  # see SETTLED_S
    has_push = cli_has("push")
    rsync = _peers.start_rsync(work)
    cache_root = work / "sync-caches"
    saved_cache = os.environ.get("GPUPORT_CACHE_DIR")
    servers: list[contextlib.ExitStack] = []
    over_ssh = contextlib.ExitStack()  # rsync over ssh, the way people sync today: beside, not the anchor
    try:
        say(f"  {version}; daemon at {rsync.url}")
        ssh_push = _rsync_over_ssh(over_ssh, work, project)
        if not has_push:
            say("  CLI: no `gpuport push DIR --name NAME` command; only the in-process API is timed")
        name = "proj"
        last: dict[str, object] = {}

        # -- first sync: a fresh server, fresh hash caches and a fresh rsync destination every round
        first: dict[str, list[float]] = {"rsync": [], "api": [], "cli": [], "ssh": []}
        cpus: dict[str, list[_Cpu]] = {"rsync": [], "api": []}
        for i in range(args.first):
            stack = contextlib.ExitStack()
            servers.append(stack)
            api_server = stack.enter_context(gpuport_server(work, f"sync-api-{i}"))
            gpu = stack.enter_context(connect(api_server))
            api_cache, cli_cache = cache_root / f"api-{i}", cache_root / f"cli-{i}"
            env: dict[str, str] = {}
            if has_push:
                cli_server = stack.enter_context(gpuport_server(work, f"sync-cli-{i}"))
                env = cli_env(cli_server, work, cli_cache)

            def api_push(
                gpu: gpuport.Client = gpu, cache: Path = api_cache, server: _servers.Gpuport = api_server
            ) -> float:
                os.environ["GPUPORT_CACHE_DIR"] = str(cache)
                before = _cpu_of(server.process.pid), resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                snap = gpu.push(project, name=name)
                elapsed = time.perf_counter() - start
                after = _cpu_of(server.process.pid), resource.getrusage(resource.RUSAGE_SELF)
                last["api"] = snap
                last["api cpu"] = _Cpu.between(before, after)
                return elapsed

            def cli_push(env: dict[str, str] = env) -> float | None:
                if not has_push:
                    return None
                start = time.perf_counter()
                result = run_quiet([GPUPORT_CLI, "push", str(project), "--name", name], env=env)
                elapsed = time.perf_counter() - start
                last["cli"] = result.stderr.strip()
                return elapsed

            dest = f"first-{i}"

            def rsync_push(dest: str = dest) -> float:
                before = _cpu_of(rsync.process.pid, children=True), resource.getrusage(resource.RUSAGE_CHILDREN)
                elapsed = rsync.push(project, dest)
                after = _reaped_cpu(rsync.process.pid, before[0]), resource.getrusage(resource.RUSAGE_CHILDREN)
                last["rsync cpu"] = _Cpu.between(before, after)
                return elapsed

            order = {
                "rsync": rsync_push,
                "api": api_push,
                "cli": cli_push,
                "ssh": lambda dest=dest: ssh_push(dest),
            }
            names = list(order)[i % 4 :] + list(order)[: i % 4]
            for key in names:
                os.sync()  # no one pays for the writeback of another's files
                if (elapsed := order[key]()) is not None:
                    first[key].append(elapsed)
            cpus["rsync"].append(last["rsync cpu"])  # type: ignore[arg-type]
            cpus["api"].append(last["api cpu"])  # type: ignore[arg-type]
            if i < args.first - 1:  # keep only the last round's servers running, for the re-syncs
                stack.close()
                servers.remove(stack)
        snap = last["api"]
        assert isinstance(snap, gpuport.Snapshot)
        copied = sum(1 for p in (rsync.dest / dest).rglob("*") if p.is_file())
        say(
            f"  first sync: API pushed {snap.files} files / uploaded {snap.uploaded_files} "
            f"({snap.uploaded_bytes / 1e6:.0f} MB); "
            f"CLI said: {last.get('cli', '-')}; rsync destination holds {copied} files"
        )
        if snap.uploaded_files != count or copied != count:
            say(f"  WARNING: expected {count} files on both sides")
        report_sync("first", first, args.first, goal=1.0)
        r, a = _Cpu.median(cpus["rsync"]), _Cpu.median(cpus["api"])
        say(
            f"  {'':<10} CPU of a first sync (median): rsync {r.total:.2f} s (daemon {r.server:.2f} + client "
            f"{r.client:.2f}; in the kernel {r.system:.2f}), API push {a.total:.2f} s (server {a.server:.2f} + "
            f"client {a.client:.2f}; in the kernel {a.system:.2f}) on {os.cpu_count()} cores"
        )

        # -- no change
        resync = {
            "rsync": lambda: rsync.push(project, dest),
            "api": api_push,
            "cli": cli_push,
            "ssh": lambda: ssh_push(dest),
        }
        rotate(1, resync)  # warm-up
        t = rotate(args.resync, resync)
        snap = last["api"]
        assert isinstance(snap, gpuport.Snapshot)
        say(f"  no change: API uploaded {snap.uploaded_files} files; CLI said: {last.get('cli', '-')}")
        report_sync("no change", t, args.resync, goal=0.5)

        # -- after touching 10 small files: rewrite their content (same size), then each tool syncs it
        rng = random.Random(args.seed + 1)
        touched: dict[str, list[float]] = {"rsync": [], "api": [], "cli": [], "ssh": []}
        uploaded = []
        picks = rng.sample(small_files, min(len(small_files), 10 * args.touch))
        for i in range(args.touch):
            for path in picks[i * 10 : (i + 1) * 10]:
                path.write_bytes(rng.randbytes(path.stat().st_size))
            names = list(resync)[i % 4 :] + list(resync)[: i % 4]
            for key in names:
                if (elapsed := resync[key]()) is not None:
                    touched[key].append(elapsed)
            snap = last["api"]
            assert isinstance(snap, gpuport.Snapshot)
            uploaded.append(snap.uploaded_files)
        say(f"  after touch: API uploaded {uploaded} files per round; CLI said: {last.get('cli', '-')}")
        report_sync("10 touched", touched, args.touch, goal=0.5)
    finally:
        for stack in servers:
            stack.close()
        over_ssh.close()
        rsync.stop()
        if saved_cache is not None:
            os.environ["GPUPORT_CACHE_DIR"] = saved_cache


_Sample = tuple[tuple[float, float], resource.struct_rusage]


@dataclass(frozen=True)
class _Cpu:
    """CPU seconds a sync cost: the receiving end's (server or daemon), the sender's, and how much
    of both was spent in the kernel."""

    server: float
    client: float
    system: float

    @property
    def total(self) -> float:
        return self.server + self.client

    @staticmethod
    def between(before: _Sample, after: _Sample) -> _Cpu:
        """From (receiver's (user, system), sender's rusage) samples taken before and after a sync."""
        server_user, server_system = (after[0][0] - before[0][0]), (after[0][1] - before[0][1])
        user, system = after[1].ru_utime - before[1].ru_utime, after[1].ru_stime - before[1].ru_stime
        return _Cpu(server_user + server_system, user + system, server_system + system)

    @staticmethod
    def median(samples: list[_Cpu]) -> _Cpu:
        return min(samples, key=lambda c: abs(c.total - median([s.total for s in samples])))


def _cpu_of(pid: int, children: bool = False) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, or of the children it has reaped."""
    times = psutil.Process(pid).cpu_times()
    return (times.children_user, times.children_system) if children else (times.user, times.system)


def _reaped_cpu(pid: int, before: tuple[float, float]) -> tuple[float, float]:
    """The rsync daemon's children's CPU once it has reaped the one that served the last sync."""
    deadline = time.monotonic() + 2
    while (now := _cpu_of(pid, children=True)) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


def _rsync_over_ssh(stack: contextlib.ExitStack, work: Path, project: Path) -> Callable[[str], float | None]:
    """`rsync -a -e ssh` of ``project`` to a folder on this machine through an sshd on 127.0.0.1 (its
    own throwaway keys): a function timing one such sync to ``dest`` (None when there is no sshd)."""
    try:
        sys.path.insert(0, str(Path(__file__).parent.parent))
        from tests._sshd import sshd

        config = stack.enter_context(sshd(work / "ssh"))
    except BaseException as e:  # openssh-server missing: its test helper skips, saying what to install
        if isinstance(e, KeyboardInterrupt):
            raise
        say(f"  rsync over ssh: skipped ({e})")
        return lambda dest: None
    say("  rsync over ssh: to an sshd on 127.0.0.1 (ed25519 keys, a new login each sync)")

    def push(dest: str) -> float:
        start = time.perf_counter()
        argv = ["rsync", "-a", "-e", f"ssh -F {config}", f"{project}/", f"gpubox:{work}/ssh-{dest}/"]
        subprocess.run(argv, check=True, capture_output=True)
        return time.perf_counter() - start

    return push


def report_sync(case: str, t: dict[str, list[float]], n: int, goal: float) -> None:
    r, a = median(t["rsync"]), median(t["api"])
    c = median(t["cli"]) if t["cli"] else None
    cli = f", CLI push {ms(c)} ({c / r:.2f}x)" if c is not None else ""
    say(f"  {case:<10} rsync {ms(r)}, API push {ms(a)} ({a / r:.2f}x){cli}; median of {n}")
    if t["ssh"] and c is not None:
        s = median(t["ssh"])
        say(f"  {'':<10} rsync over ssh {ms(s)}: the CLI push is {c / s:.2f}x that")
        ROWS.append(Row(f"sync {case}: CLI vs rsync over ssh", c, s, "`rsync -a -e ssh` process", "-", None))
    ROWS.append(Row(f"sync {case}: API push", a, r, "`rsync -a` process", f"<= {goal:.1f}x", a / r <= goal))
    met = None if c is None else c / r <= goal
    ROWS.append(Row(f"sync {case}: CLI `gpuport push`", c, r, "`rsync -a` process", f"<= {goal:.1f}x", met))


# ---- (c) logs ----------------------------------------------------------------------------------------

# One 100-byte line per step, printed in a loop, as a training script's progress lines are.
LOG_PROGRAM = """
import sys
n = int(sys.argv[1])
for i in range(n):
    print(f"step {i:>10} loss {1.0 / (i + 1):.10f} " + "x" * 65)
"""


# How a job's stdout behaves: unbuffered (a write per print), or buffered (and then kept live by gpuport?).
STDOUT_PROBE = """
import os, sys
print(f"PYTHONUNBUFFERED={os.environ.get('PYTHONUNBUFFERED', '')!r}, write_through={sys.stdout.write_through}, "
      f"line_buffering={sys.stdout.line_buffering}, stderr is {type(sys.stderr).__name__}")
"""


def bench_logs(args: argparse.Namespace, work: Path, server: _servers.Gpuport) -> None:
    lines = args.log_mb * 1_000_000 // 100
    expected = lines * 100
    assert len(f"step {0:>10} loss {1.0:.10f} " + "x" * 65) + 1 == 100
    say(f"== (c) logs: a job printing {lines:,} lines of 100 bytes ({expected / 1e6:.0f} MB) with print() in a loop")
    workdir = work / "logs-project"
    workdir.mkdir()
    argv = ["python", "-c", LOG_PROGRAM, str(lines)]
    out = work / "local-log.txt"

    with connect(server) as gpu:
        probe = gpu.submit(["python", "-c", STDOUT_PROBE], workdir=workdir)
        mode = " ".join(probe.logs(follow=True)).strip()
        say(f"  a job's stdout here: {mode}")

        def remote() -> float:
            start = time.perf_counter()
            job = gpu.submit(argv, workdir=workdir)
            received = 0
            for _, data in job.log_chunks(0, follow=True):
                received += len(data)
            elapsed = time.perf_counter() - start
            job.wait()
            if job.info.exit_code != 0 or received != expected:
                raise RuntimeError(f"job {job.id}: exit {job.info.exit_code}, {received} of {expected} log bytes")
            return elapsed

        def local(unbuffered: bool = False) -> float:
            # Python's default for stdout to a file is block buffering; PYTHONUNBUFFERED (which gpuport sets
            # for every job, and this shell may have set too) makes every print() a write of its own.
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
            if unbuffered:
                env["PYTHONUNBUFFERED"] = "1"
            start = time.perf_counter()
            with open(out, "wb") as f:
                subprocess.run([sys.executable, "-c", LOG_PROGRAM, str(lines)], stdout=f, check=True, env=env)
            elapsed = time.perf_counter() - start
            if out.stat().st_size != expected:
                raise RuntimeError(f"local run wrote {out.stat().st_size} of {expected} bytes")
            return elapsed

        t = rotate(args.log_repeats, {"remote": remote, "local": local, "unbuffered": lambda: local(True)})
    out.unlink(missing_ok=True)
    mb = expected / 1e6
    r, lo, un = (mb / median(t[k]) for k in ("remote", "local", "unbuffered"))
    say(
        f"  streamed to the client {r:.0f} MB/s ({median(t['remote']):.2f}s), local to a file {lo:.0f} MB/s "
        f"({median(t['local']):.2f}s, default buffering); median of {args.log_repeats}"
    )
    say(
        f"  the same program locally with PYTHONUNBUFFERED=1 (a write per print) writes {un:.0f} MB/s "
        f"({median(t['unbuffered']):.2f}s); the job streamed at {r / un:.2f}x of that"
    )
    ROWS.append(
        Row(
            f"logs {mb:.0f} MB: job streamed to client",
            r,
            lo,
            "local, stdout to a file",
            ">= 0.5x",
            r / lo >= 0.5,
            unit="MB/s",
        )
    )
    ROWS.append(
        Row("logs: the same, anchor unbuffered", r, un, "local, PYTHONUNBUFFERED=1", "(info)", None, unit="MB/s")
    )


# ---- main --------------------------------------------------------------------------------------------


def fs_note(path: Path) -> str:
    """The filesystem the temp dir is on. ext4 without a journal skips inodes freed in the last minutes
    when it allocates new ones (recently_deleted() in fs/ext4/ialloc.c), which makes creating many files
    slow after many were deleted: worth knowing when reading the sync figures."""
    best, fstype, device = "", "?", ""
    with open("/proc/mounts") as f:
        for line in f:
            dev, mount, kind = line.split()[:3]
            if (str(path).startswith(mount.rstrip("/") + "/") or mount == "/") and len(mount) > len(best):
                best, fstype, device = mount, kind, dev
    note = f"temp dir {path} on {fstype} ({device} at {best})"
    if fstype == "ext4":
        try:
            task = Path(f"/sys/fs/ext4/{Path(device).name}/journal_task").read_text().strip()
        except OSError:
            task = ""
        if task == "<none>":
            note += ", without a journal: file creation slows down after many recent deletions"
    return note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute)")
    parser.add_argument("--skip", action="append", default=[], choices=["launch", "ray", "sync", "logs"])
    parser.add_argument("--launch", type=int, help="API launches and local runs to time (default 20)")
    parser.add_argument("--cli", type=int, help="`gpuport run` processes to time (default 10)")
    parser.add_argument("--ray", type=int, help="`ray job submit` processes to time (default 3)")
    parser.add_argument("--first", type=int, help="first syncs, each on a fresh server (default 3)")
    parser.add_argument("--resync", type=int, help="no-change re-syncs (default 5)")
    parser.add_argument("--touch", type=int, help="rounds of touching 10 files (default 3)")
    parser.add_argument("--small-files", type=int, help="small files in the project (default 2000)")
    parser.add_argument("--big-files", type=int, help="large files in the project (default 5)")
    parser.add_argument("--big-mb", type=int, help="size of each large file in MB (default 50)")
    parser.add_argument("--log-mb", type=int, help="MB the log job prints (default 100)")
    parser.add_argument("--log-repeats", type=int, help="log runs of each kind (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sizes = (
        "launch",
        "cli",
        "ray",
        "first",
        "resync",
        "touch",
        "small_files",
        "big_files",
        "big_mb",
        "log_mb",
        "log_repeats",
    )
    full = (20, 10, 3, 3, 5, 3, 2000, 5, 50, 100, 3)
    quick = (8, 4, 1, 1, 3, 2, 500, 2, 10, 20, 2)
    for key, value in zip(sizes, quick if args.quick else full, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)

    banner(f"grpcio {grpc.__version__}", args.quick)
    compile_gpuport()  # the CLI's processes as an install leaves them
    with isolated_workdir() as work:
        say(fs_note(work))
        cli_s = None
        try:
            if "sync" not in args.skip:  # first, on a filesystem no part of this run has churned yet
                bench_sync(args, work)
            if not {"launch", "logs"} <= set(args.skip):
                with gpuport_server(work, "jobs-server") as server:
                    if "launch" not in args.skip:
                        cli_s = bench_launch(args, work, server)
                    if "logs" not in args.skip:
                        bench_logs(args, work, server)
            if "ray" not in args.skip:
                bench_ray(args, work, cli_s)
        finally:
            stop_cli_helpers(work)
    print_table(
        ("launch", "sync", "logs"),  # the figures in the order of the brief, whatever order they ran in
        width=36,
        legend="ratio: gpuport / anchor (times: lower is better; MB/s: higher is better)",
    )


if __name__ == "__main__":
    main()
