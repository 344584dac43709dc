"""What the benchmarks share: the result rows and their table, printing and formatting, alternated
timing, the opening lines and the temp dir of a run, a fresh gpuport server (from _servers.py)
to measure, with a client connected to it, and a 2-node Ray cluster for servers to place jobs on."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import _servers

import gpuport

if TYPE_CHECKING:
    from tests._ray import RayCluster

MB = 1e6  # MB are 10^6 bytes


@dataclass
class Row:
    figure: str
    ours: float | None  # seconds, MB/s, jobs/s or bytes, as ``unit`` says
    anchor: float | None
    anchor_name: str
    goal: str
    met: bool | None
    unit: str = "s"  # "s", "MB/s", "jobs/s", "MB", "cores" or "count"
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.anchor:
            return None
        return self.ours / self.anchor


ROWS: list[Row] = []  # what a benchmark found, appended as it goes; print_table() prints them


def say(text: str = "") -> None:
    print(text, flush=True)


def banner(versions: str, quick: bool, where: str = "everything on 127.0.0.1") -> None:
    """A run's first lines: what measures (gpuport, Python, ``versions`` of the peers), on what
    machine, and the load already there (two cores leave no room for anyone else: a load shows in
    every figure)."""
    say(
        f"gpuport {gpuport.__version__}, Python {platform.python_version()}, {versions}, {os.cpu_count()} CPUs, "
        f"{platform.machine()}, {where}" + (" (--quick)" if quick else "")
    )
    say("load average at the start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def compile_gpuport() -> None:
    """Compile gpuport's modules, as an install leaves them: whole-process timings of the CLI then
    measure what users run (with PYTHONDONTWRITEBYTECODE, set on some machines, each command would
    compile what changed since, and time that)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(gpuport.__file__)], check=True)


@contextlib.contextmanager
def isolated_workdir() -> Iterator[Path]:
    """A temp dir, removed at the end, that holds the client's config and cache dirs; nothing of the
    user's own setup (GPUPORT_* variables) leaks into the run."""
    for key in [k for k in os.environ if k.startswith("GPUPORT_")]:
        del os.environ[key]
    with _servers.workdir() as tmp:
        work = Path(tmp)
        os.environ["GPUPORT_CONFIG_DIR"] = str(work / "config")
        os.environ["GPUPORT_CACHE_DIR"] = str(work / "cache")
        yield work


def cli_login_env(server: _servers.Gpuport, config: Path, cache: Path) -> dict[str, str]:
    """The environment of a CLI user logged in to ``server`` (`gpuport login`, its profile in
    ``config``: the certificate pinned there, as after a login), with its hash cache in ``cache``."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env.update(GPUPORT_CONFIG_DIR=str(config), GPUPORT_CACHE_DIR=str(cache), GPUPORT_AGENT="0")
    login = [sys.executable, "-m", "gpuport", "login", server.url, "--token", server.token]
    subprocess.run([*login, "--fingerprint", server.fingerprint], env=env, check=True, capture_output=True)
    del env["GPUPORT_AGENT"]
    return env


def cli_helper_env(work: Path) -> dict[str, str]:
    """Settings that give the CLI processes of a run a helper of their own (gpuport/cli/_agent.py),
    under ``work/runtime``: stop it with ``stop_cli_helpers(work)``."""
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return {"XDG_RUNTIME_DIR": str(runtime), "GPUPORT_AGENT": "1"}


def cli_helpers(work: Path) -> list[int]:
    """The pids of the CLI helpers running under ``work/runtime`` (from their lock files)."""
    pids = []
    for lock in (work / "runtime").glob("gpuport-*/agent-*.sock.lock"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(lock.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"gpuport.cli._agent" in f.read():
                    pids.append(pid)
    return pids


def stop_cli_helpers(work: Path) -> None:
    """End the CLI helpers of this run, by their pids."""
    import signal

    for pid in cli_helpers(work):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def median(values: list[float]) -> float:
    return statistics.median(values)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def fmt(value: float | None, unit: str) -> str:
    """``value`` as a table cell: ``unit`` is one of Row.unit's."""
    if value is None:
        return "-"
    if unit == "MB/s":
        return f"{value:.0f} MB/s"
    if unit == "jobs/s":
        return f"{value:.1f}/s"
    if unit == "MB":
        return f"{value / MB:.0f} MB"
    if unit == "cores":
        return f"{value:.3f}"
    if unit == "count":
        return f"{value:g}"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` as a call that returns how long it took (seconds), for ``rotate``."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def rotate(n: int, calls: Mapping[str, Callable[[], float | None]]) -> dict[str, list[float]]:
    """Run each call ``n`` times; the order rotates every round so drift hits all alike.

    A call that returns None (it had nothing to time) is left out of its list."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            t = calls[name]()
            if t is not None:
                times[name].append(t)
    return times


@contextlib.contextmanager
def gpuport_server(work: Path, name: str, options: Sequence[str] = ()) -> Iterator[_servers.Gpuport]:
    """A fresh gpuport server (empty state dir) under ``work/name``, stopped after.

    Its state stays until the whole temp dir goes at the end: deleting thousands of files between
    rounds would make the next round's file creation slower on some filesystems (see bench_jobs' fs_note).
    """
    folder = work / name
    folder.mkdir()
    server = _servers.start_gpuport(folder, options=options)
    try:
        yield server
    finally:
        try:
            server.stop()
        finally:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait(timeout=10)


def ray_bench_start(doc: str) -> bool:
    """A Ray bench's start: its command line read (``--quick``, its docstring as help), an exit saying
    what to install where Ray is missing, and the opening lines. Returns whether ``--quick`` was given."""
    import argparse

    import _peers

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    if _peers.ray_cli() is None:
        raise SystemExit("Ray is not installed: pip install 'gpuport[ray,bench]'")
    banner(f"ray {_peers.ray_version()}", args.quick)
    return bool(args.quick)


@contextlib.contextmanager
def ray_cluster(work: Path) -> Iterator[RayCluster]:
    """A 2-node Ray cluster on this machine (tests/_ray.py: token auth, 2 fake GPUs a node) under
    ``work/cluster``, its token in ``RAY_AUTH_TOKEN`` for the ``--ray`` servers started meanwhile
    (``_servers.start_gpuport`` passes this process's environment on); its nodes stopped after, by pid."""
    from tests._ray import start_cluster  # the repository's root is on the path of the scripts that call this

    start = time.perf_counter()
    cluster = start_cluster(work / "cluster")
    say(f"== a 2-node Ray cluster (token auth, 2 fake GPUs each) up in {time.perf_counter() - start:.1f}s")
    try:
        os.environ["RAY_AUTH_TOKEN"] = cluster.token
        yield cluster
    finally:
        cluster.close()


def connect(server: _servers.Gpuport) -> gpuport.Client:
    return gpuport.connect(server.url, server.token, fingerprint=server.fingerprint)


def print_table(order: Sequence[str], width: int, legend: str) -> None:
    """Print ROWS as a table, sorted by the first prefix in ``order`` each figure starts with (the
    order of the brief, whatever order they ran in), the figure column ``width`` wide, then ``legend``."""
    rows = sorted(ROWS, key=lambda row: next(i for i, o in enumerate(order) if row.figure.startswith(o)))
    say()
    say(f"{'figure':<{width}} {'gpuport':>9} {'anchor':>9} {'ratio':>6}  {'goal':<28} {'met?':<4}  anchor")
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        met = {True: "yes", False: "NO", None: "-"}[row.met]
        goal = row.goal + (f" ({row.note})" if row.note else "")
        say(
            f"{row.figure:<{width}} {fmt(row.ours, row.unit):>9} {fmt(row.anchor, row.unit):>9} {ratio:>6}  "
            f"{goal:<28} {met:<4}  {row.anchor_name}"
        )
    say(legend)
