"""Fixtures: a real `gpuport server` on 127.0.0.1 (random ports, temporary state dir, TLS on), and
the CLI run as a real subprocess against it."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

import gpuport
from gpuport.server.daemon import parse_banner
from gpuport.server.isolation import Sandbox, detect
from tests._terminal import drew_progress, run_on_terminal

# Each CLI process of the tests runs its command itself; the helper that makes the CLI's commands
# start fast (gpuport/cli/_agent.py) has tests of its own (test_cli_start.py), each with a private one.
os.environ["GPUPORT_AGENT"] = "0"

READY_TIMEOUT = 60.0
# A server on loopback, on ports the kernel picks.
SERVER_ARGS = ("server", "--host", "127.0.0.1", "--port", "0", "--http-port", "0")
CLIENT_ENV = ("GPUPORT_URL", "GPUPORT_TOKEN", "GPUPORT_FINGERPRINT", "GPUPORT_PROFILE")


def restartable_ports(count: int) -> int:
    """A port P with P .. P+count-1 free on loopback now, all below the kernel's range of ephemeral
    ports: for a server stopped and started again on them (a server on ``--port P`` also takes P+2 and
    P+3). A port from that range can be handed to some connection's local end in between."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, low - count)
        with contextlib.ExitStack() as stack:
            try:
                for offset in range(count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + offset))
            except OSError:
                continue
        return base
    raise AssertionError(f"no {count} free ports in a row below {low}")


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    state_dir: Path
    output: list[str] = field(default_factory=list)
    url: str = ""
    http_url: str = ""
    fingerprint: str = ""
    admin_token: str = ""
    pid: int = 0  # the server's own process: ``process`` is a wrapper's, when it was started with one
    _drainer: threading.Thread | None = None

    @property
    def banner(self) -> str:
        return "\n".join(self.output)

    @property
    def cert_port(self) -> int:
        """The gRPC port for client certificates, from the banner."""
        found = re.search(r"^  cert port\s+(\d+)", self.banner, re.MULTILINE)
        assert found, self.banner
        return int(found[1])

    def connect(self, token: str | None = None) -> gpuport.Client:
        return gpuport.connect(self.url, token or self.admin_token, fingerprint=self.fingerprint or None)

    def rest(self, method: str, path: str, token: str | None = None, **kw: object) -> httpx.Response:
        """Call the REST API, trusting exactly this server's certificate, as `curl --cacert` would."""
        headers = dict(kw.pop("headers", None) or {})  # type: ignore[call-overload]
        if token:
            headers["Authorization"] = f"Bearer {token}"
        trust = ssl.create_default_context(cafile=str(self.state_dir / "tls" / "cert.pem"))
        with httpx.Client(verify=trust, timeout=10) as http:
            return http.request(method, self.http_url + path, headers=headers, **kw)  # type: ignore[arg-type]

    def job(self, job_id: str, token: str | None = None) -> dict:
        """The job as ``GET /v1/jobs/ID`` gives it (the admin's token unless ``token``)."""
        reply = self.rest("GET", f"/v1/jobs/{job_id}", token or self.admin_token)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def ended(self, job_id: str, timeout: float = 60, token: str | None = None) -> dict:
        """The job once it has left the queue and ended, waited for at most ``timeout`` seconds."""
        return wait_for(  # type: ignore[return-value]
            lambda: (j := self.job(job_id, token))["state"] not in ("queued", "running") and j,
            timeout,
            lambda: f"job {job_id} to end (its log: {self.job_log(job_id)[-2000:]!r})",
        )

    def job_log(self, job_id: str) -> str:
        """The job's whole log, as ``GET /v1/jobs/ID/logs`` gives it."""
        reply = self.rest("GET", f"/v1/jobs/{job_id}/logs", self.admin_token)
        assert reply.status_code == 200, reply.text
        return reply.json()["data"]

    def drain(self) -> None:
        """Keep reading what the server prints (into ``output``), so its pipe never fills up."""
        assert self.process.stdout is not None
        self._drainer = threading.Thread(target=self._read_rest, daemon=True)
        self._drainer.start()

    def _read_rest(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid or self.process.pid, sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._drainer is not None:
            self._drainer.join(timeout=10)
        if self.process.stdout:
            self.process.stdout.close()
        return self.process.returncode


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def start_server(
    state_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    expect_ready: bool = True,
    wrapper: tuple[str, ...] = (),
) -> RunningServer:
    """Start `gpuport server` (after the command prefix ``wrapper``, if any) and wait (bounded) for
    its `ready` line; parse what it printed."""
    command = [*wrapper, sys.executable, "-m", "gpuport", *SERVER_ARGS, "--state-dir", str(state_dir), *args]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or server_env(GPUPORT_FAKE_GPUS="2x16GiB"),
    )
    server = RunningServer(process, state_dir)
    _STARTED.append(server)
    _ENDED.discard(state_dir)
    if not expect_ready:
        assert process.stdout is not None
        with process.stdout:
            server.output = process.stdout.read().splitlines()
        process.wait(timeout=READY_TIMEOUT)
        return server
    deadline = time.monotonic() + READY_TIMEOUT
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            server.stop()
            raise AssertionError(f"server exited before it was ready:\n{server.banner}")
        server.output.append(line.rstrip("\n"))
        if line.strip() == "ready":
            break
    else:
        server.stop(signal.SIGKILL)
        raise AssertionError(f"server not ready in {READY_TIMEOUT}s:\n{server.banner}")
    if wrapper:  # a wrapper that passes no signal on: the server's own pid gets them (`ip netns exec` is none)
        found = [p for p in psutil.Process(process.pid).children(recursive=True) if "gpuport" in p.cmdline()[1:3]]
        server.pid = found[0].pid if found else process.pid
    banner = parse_banner(server.banner)
    server.url, server.http_url = banner.grpc_url, banner.http_url
    server.fingerprint, server.admin_token = banner.fingerprint or "", banner.admin_token or ""
    server.drain()
    return server


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# The machine refuses outbound connections; as root Chromium needs --no-sandbox.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright (no browser download)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


_STARTED: list[RunningServer] = []  # every server the tests started, in order


_ENDED: set[Path] = set()  # state dirs whose servers all stopped and whose supervisors were ended


@pytest.fixture(autouse=True)
def _no_job_outlives_its_servers() -> Iterator[None]:
    """After each test, end the supervisors (jobs, session workers, model replicas) of the state dirs
    whose servers have all stopped (a test's own, or a module's fixture's once the module is done): a
    job a test left running would hold CPU and memory through every later test, under init, for ever."""
    yield
    running = {s.state_dir for s in _STARTED if s.process.poll() is None}
    stopped = {s.state_dir for s in _STARTED} - running - _ENDED
    if stopped:
        end_supervisors(stopped)
        _ENDED.update(stopped)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The last module's fixture servers stop after every test's end: their supervisors go here."""
    stopped = {s.state_dir for s in _STARTED if s.process.poll() is not None} - _ENDED
    if stopped:
        end_supervisors(stopped)


def end_supervisors(state_dirs: Collection[Path]) -> list[int]:
    """End (SIGUSR1: kill the job at once; SIGKILL after 10 s) every supervisor of a job under
    ``state_dirs``; the pids ended."""
    under = [str(d) + os.sep for d in state_dirs]
    found = []
    for p in psutil.process_iter(["cmdline"]):
        args = p.info["cmdline"] or []
        if len(args) >= 2 and args[-2].endswith("supervisor.py") and any(args[-1].startswith(u) for u in under):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGUSR1)
                found.append(p)
    _, alive = psutil.wait_procs(found, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in found]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One shared server with two fake 16 GiB GPUs, for tests that do not stop or restart it."""
    running = start_server(tmp_path_factory.mktemp("state") / "gpuport")
    yield running
    running.stop()
    end_supervisors([running.state_dir])


@pytest.fixture(autouse=True)
def client_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own client config dir, and no GPUPORT_* settings from outside."""
    folder = tmp_path / "config"
    monkeypatch.setenv("GPUPORT_CONFIG_DIR", str(folder))
    monkeypatch.setenv("GPUPORT_CACHE_DIR", str(tmp_path / "cache"))
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    return folder


@pytest.fixture
def admin(server: RunningServer) -> Iterator[gpuport.Client]:
    with server.connect() as client:
        yield client


@functools.cache
def _sandbox() -> Sandbox:
    return detect()


def needs_users() -> None:
    """Skip a test that needs tokens other than admin tokens where the server could not make them:
    without a sandbox for jobs, every token is an admin token (``make test`` installs bubblewrap as root)."""
    sandbox = _sandbox()
    if not sandbox.isolated:
        pytest.skip(f"jobs cannot be isolated here, so there are only admin tokens: {sandbox.why}")


@pytest.fixture
def user_token(admin: gpuport.Client) -> str:
    """A fresh non-admin token."""
    needs_users()
    return admin.create_token(f"user-{uuid.uuid4().hex[:8]}").token


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str
    raw: str = ""  # on a terminal: what it wrote, control sequences (a progress bar's drawing) and all

    @property
    def output(self) -> str:
        """Everything it wrote (on a terminal, stdout and stderr are both that one text)."""
        return self.stdout if self.raw else self.stdout + self.stderr

    def drew_progress(self, verb: str) -> bool:
        """Whether it drew a progress bar saying ``verb`` (``uploading``, ``downloading``)."""
        return drew_progress(self.raw, verb)


@pytest.fixture(params=["piped", "terminal"])
def stdio(request: pytest.FixtureRequest) -> str:
    """Where a CLI command's stdin, stdout and stderr go: pipes, or a pseudo-terminal (100x30)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def cli(client_config: Path) -> object:
    """Run `gpuport ARGS...` as a subprocess with this test's config dir; returns a CliResult. It runs
    in an empty folder of the test's unless ``cwd`` says where (a `gpuport run` syncs its folder: the
    repository's would be a project with a pyproject.toml, whose dependencies it would build)."""
    empty = client_config.parent / "cli-cwd"
    empty.mkdir(exist_ok=True)

    def run(
        *args: str,
        input: str | None = None,
        cwd: Path | None = None,
        on: Sequence[str] = (),
        stdio: str = "piped",
        **env: str,
    ) -> CliResult:
        """``on``: a command prefix to run it with (``ip netns exec HOST``: on a test host).
        ``stdio="terminal"``: on a pseudo-terminal of 100x30 instead of pipes (no ``input`` then);
        ``stdout`` and ``stderr`` of the result are then both what the terminal showed."""
        full_env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
        full_env.update({"GPUPORT_CONFIG_DIR": str(client_config), "COLUMNS": "200", **env})  # COLUMNS: env's wins
        if stdio == "terminal":
            assert input is None and not on, "a command on a terminal reads nothing typed, and runs here"
            code, text, raw = run_on_terminal(args, full_env, cwd or empty)
            return CliResult(code, text, text, raw)
        assert stdio == "piped", stdio
        done = subprocess.run(
            [*on, sys.executable, "-m", "gpuport", *args],
            capture_output=True,
            text=True,
            input=input if input is not None else "",
            env=full_env,
            timeout=120,
            cwd=cwd or empty,
        )
        return CliResult(done.returncode, done.stdout, done.stderr)

    return run


def wait_for(
    condition: Callable[[], object], timeout: float = 30.0, what: str | Callable[[], str] = "condition"
) -> object:
    """Poll ``condition`` until it returns something true, for at most ``timeout`` seconds. ``what``
    names the condition in the error (a callable: asked then, to say what was seen last)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what() if callable(what) else what} not met within {timeout}s")


def data_port_unreachable(client: gpuport.Client) -> None:
    """Make ``client``'s tickets name a port where nothing listens, as for a server reached through
    a firewall that lets only the gRPC port through."""
    import socket

    from gpuport.protocol import gpuport_pb2 as pb

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once this socket is closed
    original = client.transport.sessions.Transfer

    def elsewhere(request: pb.TransferRequest, **kw: object) -> pb.TransferTicket:
        ticket = original(request, **kw)
        return pb.TransferTicket(ticket=ticket.ticket, port=closed)

    client.transport.sessions.Transfer = elsewhere  # type: ignore[method-assign]


def touch_in_job(state_dir: Path, job_id: str, name: str) -> None:
    """Make the file ``name`` in a running job's working folder: the one folder of the server's disk
    that its sandbox shows it (the test's own tmp_path is not there), so a test's way to signal a job.
    A job that has ended has no folder left: nothing to signal."""
    folder = state_dir / "jobs" / job_id / "work"
    if folder.is_dir():
        (folder / name).touch()


class JobFlag:
    """A file named ``name`` that holding jobs wait for in their working folder. Once ``touch()``ed,
    it is made in the folder of every job of the server: those running and, until ``close()``, those
    that start later (jobs released by it free GPUs for queued ones, which must see it too)."""

    def __init__(self, state_dir: Path, name: str = "go") -> None:
        self.state_dir, self.name = state_dir, name
        self._raised = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._spread, daemon=True)
        self._thread.start()

    def __str__(self) -> str:
        return self.name

    def touch(self) -> None:
        self._raised.set()

    def _spread(self) -> None:
        self._raised.wait()
        while not self._closed.wait(0.02):
            for work in (self.state_dir / "jobs").glob("*/work"):
                with contextlib.suppress(OSError):  # a job that ended meanwhile
                    (work / self.name).touch()

    def close(self) -> None:
        """Raise it (so that a failed test leaves no job holding GPUs for the next) and stop."""
        self.touch()
        time.sleep(0.1)
        self._closed.set()
        self._thread.join(5)


def rest_job_ended(server: RunningServer, token: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    """``GET /v1/jobs/{job_id}`` until the job has ended; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = server.rest("GET", f"/v1/jobs/{job_id}", token).json()
        if job["state"] not in ("queued", "running"):
            return job  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end within {timeout:g} s")


def client_env(server: RunningServer, token: str | None = None) -> dict[str, str]:
    """The environment that points the CLI at ``server`` without a login."""
    return {
        "GPUPORT_URL": server.url,
        "GPUPORT_TOKEN": token or server.admin_token,
        "GPUPORT_FINGERPRINT": server.fingerprint,
    }


def _nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and _nvml_gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (NVML found none)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
