"""The peers the benchmarks measure gpuport against, all on 127.0.0.1: an rsync daemon and a local Ray
head (bench_jobs.py submits jobs to it; bench_sessions.py connects a driver to it for actor calls).

Each is started in its own session and stopped by the pids of that session only (never by process
name, so another Ray or rsync on the machine is left alone); their files live in the bench's temp dir.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuport.protocol.sockets import is_loopback

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, process: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before listening")
        try:
            socket.create_connection((LOOPBACK, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout:g}s")


def session_processes(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a session this bench created, so only its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) == sid:
                found.append(pid)
        except OSError:
            continue
    return found


def alive_in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` still running (zombies waiting to be reaped are not)."""
    return [pid for pid in session_processes(sid) if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_session(sid: int, leader: subprocess.Popen[bytes] | None = None, grace: float = 5.0) -> None:
    """SIGTERM every process of session ``sid``, then SIGKILL whatever is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = session_processes(sid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()  # reap our own child, or it stays a zombie of this session
            if not alive_in_session(sid):
                return
            time.sleep(0.1)


# ---- rsync ----------------------------------------------------------------------------------------


@dataclass
class Rsync:
    process: subprocess.Popen[bytes]
    url: str  # rsync://127.0.0.1:PORT/bench
    dest: Path  # what the module serves
    log: Path

    def push(self, source: Path, into: str) -> float:
        """``rsync -a SOURCE/ rsync://.../bench/INTO/`` as a whole process; return its wall time."""
        start = time.perf_counter()
        subprocess.run(["rsync", "-a", f"{source}/", f"{self.url}/{into}/"], check=True)
        return time.perf_counter() - start

    def stop(self) -> None:
        stop_session(self.process.pid, self.process)
        self.process.wait(timeout=10)


def rsync_version() -> str | None:
    if not shutil.which("rsync"):
        return None
    out = subprocess.run(["rsync", "--version"], check=False, capture_output=True, text=True).stdout
    return out.split("\n", 1)[0].replace("  ", " ").strip()


def start_rsync(work: Path) -> Rsync:
    """An rsync daemon on 127.0.0.1 (plain rsync protocol: no TLS, no auth) with a writable module ``bench``."""
    dest = work / "rsync-dest"
    dest.mkdir(parents=True)
    conf, log = work / "rsyncd.conf", work / "rsyncd.log"
    conf.write_text(
        f"use chroot = no\nuid = {os.getuid()}\ngid = {os.getgid()}\nlog file = {log}\n"
        f"[bench]\n  path = {dest}\n  read only = no\n"
    )
    port = free_port()
    process = subprocess.Popen(
        ["rsync", "--daemon", "--no-detach", f"--config={conf}", f"--port={port}", f"--address={LOOPBACK}"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_port(port, process, "rsync --daemon")
    except BaseException:
        stop_session(process.pid, process)
        raise
    return Rsync(process, f"rsync://{LOOPBACK}:{port}/bench", dest, log)


# ---- Ray ------------------------------------------------------------------------------------------


def ray_cli() -> str | None:
    """The `ray` command of this Python environment, or None when Ray is not installed here."""
    if importlib.util.find_spec("ray") is None:
        return None
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else shutil.which("ray")


def ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


@dataclass
class RayHead:
    process: subprocess.Popen[bytes]  # `ray start`, the leader of the session every Ray process joins
    address: str  # the job-submission (dashboard) address
    temp_dir: Path
    env: dict[str, str]
    cli: str
    auth: str
    notes: list[str] = field(default_factory=list)
    gcs_address: str = ""  # 127.0.0.1:PORT, what a driver's ray.init(address=...) takes

    def submit(self, argv: list[str], cwd: Path) -> float:
        """``ray job submit --address ... -- ARGV`` as a whole process; return its wall time."""
        start = time.perf_counter()
        result = subprocess.run(
            [self.cli, "job", "submit", "--address", self.address, "--", *argv],
            check=False,
            cwd=cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        elapsed = time.perf_counter() - start
        if result.returncode != 0 or "succeeded" not in result.stdout + result.stderr:
            raise RuntimeError(
                f"ray job submit failed ({result.returncode}): {(result.stdout + result.stderr)[-2000:]}"
            )
        return elapsed

    def check_loopback(self) -> str:
        """Say whether every socket Ray listens on, and every address in its logs, is 127.0.0.1."""
        import psutil

        pids = set(session_processes(self.process.pid))
        listening, mapped, offenders, remote = 0, 0, set(), set()
        for conn in psutil.net_connections(kind="inet"):
            if conn.pid not in pids:
                continue
            if conn.status == psutil.CONN_LISTEN:
                listening += 1
                mapped += conn.laddr.ip.startswith("::ffff:")
                if not is_loopback(conn.laddr.ip):
                    offenders.add(f"{conn.laddr.ip}:{conn.laddr.port}")
            elif conn.raddr and not is_loopback(conn.raddr.ip):
                remote.add(f"{conn.raddr.ip}:{conn.raddr.port}")
        in_logs = set()
        for path in self.temp_dir.glob("session_*/logs/**/*"):
            if path.is_file() and path.suffix in {".log", ".out", ".err", ".txt"}:
                text = path.read_text(errors="replace")
                for found in re.findall(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])", text):
                    try:
                        ipaddress.ip_address(found)
                    except ValueError:
                        continue  # a version number or the like
                    if not is_loopback(found):
                        in_logs.add(found)
        parts = [f"{listening} listening sockets of {len(pids)} Ray processes"]
        if offenders:
            parts.append(f"NOT loopback: {', '.join(sorted(offenders))}")
        else:
            parts.append(f"all on 127.0.0.1 ({mapped} of them dual-stack, as ::ffff:127.0.0.1)")
        parts.append("no connection leaves 127.0.0.1" if not remote else f"connected to {', '.join(sorted(remote))}")
        parts.append("logs name no other address" if not in_logs else f"logs also name {', '.join(sorted(in_logs))}")
        return "; ".join(parts)

    def stop(self) -> None:
        stop_session(self.process.pid, self.process)
        self.process.wait(timeout=10)


def start_ray(work: Path) -> RayHead:
    """A Ray head on 127.0.0.1 with its dashboard (the job server), token auth, usage stats off."""
    cli = ray_cli()
    assert cli is not None
    temp_dir = work / "ray"  # kept short: Ray puts unix sockets under it (108-byte limit)
    temp_dir.mkdir()
    scratch = work / "t"  # TMPDIR of every Ray process: what they leave behind (pymp-* dirs) goes with the bench's
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",  # no report to the internet
        RAY_AUTH_MODE="token",  # as gpuport: a token on every call (Ray 2.60's job API takes it)
        RAY_AUTH_TOKEN=secrets.token_hex(32),  # given here, so nothing lands in ~/.ray
        PYTHONUNBUFFERED="1",
        TMPDIR=str(scratch),
        # Jobs find this environment's Python first, as gpuport's jobs find the server's.
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")]),
    )
    ports = {name: free_port() for name in ("port", "dashboard", "client", "agent_http", "agent_grpc", "env_agent")}
    ports["metrics"] = free_port()
    dashboard = ports["dashboard"]
    argv = [
        cli, "start", "--head", "--block",
        f"--node-ip-address={LOOPBACK}", f"--port={ports['port']}",
        f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dashboard}", "--include-dashboard=true",
        f"--ray-client-server-port={ports['client']}",
        f"--dashboard-agent-listen-port={ports['agent_http']}", f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
        f"--runtime-env-agent-port={ports['env_agent']}", f"--metrics-export-port={ports['metrics']}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats", f"--num-cpus={os.cpu_count() or 1}",
    ]  # fmt: skip
    with open(work / "ray-start.log", "wb") as log:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    head = RayHead(process, f"http://{LOOPBACK}:{dashboard}", temp_dir, env, cli, "token")
    head.gcs_address = f"{LOOPBACK}:{ports['port']}"
    try:
        _wait_port(dashboard, process, "ray start", timeout=120)
        # The dashboard listens before its job module is ready: wait until the job API answers.
        deadline = time.monotonic() + 120
        while True:
            probe = subprocess.run(
                [cli, "job", "list", "--address", head.address],
                check=False, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            if probe.returncode == 0:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray's job API did not answer: {(probe.stdout + probe.stderr)[-1500:]}")
            time.sleep(0.5)
        # Is the token really asked for? (Ray before token auth ignores RAY_AUTH_MODE.)
        bare = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
        probe = subprocess.run(
            [cli, "job", "list", "--address", head.address],
            check=False, env=bare, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if probe.returncode == 0:
            head.auth = "token asked, but not enforced: calls without it work"
        else:
            head.auth = "token (calls without it are refused)"
    except BaseException:
        head.stop()
        raise
    return head
