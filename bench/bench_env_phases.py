"""Where a cold environment build's time goes (issue 34, point 7): the phases of
``Environments.ensure`` on an empty state (empty uv cache), in the build sandbox as a build uid as the
server runs it, against ``uv venv`` + ``uv pip install`` of the same by hand in the same run.

    .venv/bin/python bench/bench_env_phases.py             # 7 rounds, alternated with the anchor
    .venv/bin/python bench/bench_env_phases.py --rounds 5

Each phase is the median over the rounds: every uv run in a sandbox (named as the build names it),
the sandbox's own start (``true`` in the same sandbox), the server's steps after uv (rename, own,
layer, seal, the installed list, the size, meta.json) and the job's first Python (the command run
in the built environment, in a sandbox as a job's uid). The job's launch through the server (about
160 ms on this machine: its supervisor, its sandbox, its exit read back) is ``bench_envs.py``'s
bare job. Run as root (the build uid), with bubblewrap, like the server.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent))
from gpuport.server import environments, isolation
from gpuport.server.environments import Environments, EnvRequest, index_settings

INDEX = "file:///opt/pypi/simple"
PACKAGES = ["tomli-w", "toolz", "tabulate", "humanize", "appdirs"]
IMPORTS = "import tomli_w, toolz, tabulate, humanize, appdirs"
UV = str(Path(sys.executable).parent / "uv")
BUILD_UID = 61990  # a uid of the jobs' range, as the server's build uid
JOB_UID = 61991


def timed(phases: dict[str, float], name: str | Callable[..., str], function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            key = name(*args, **kwargs) if callable(name) else name
            phases[key] = phases.get(key, 0.0) + time.perf_counter() - start

    return wrapper


def ours(work: Path, sandbox: isolation.Sandbox) -> dict[str, float]:
    root = work / "envs"
    project = work / "project"
    project.mkdir()
    (project / "requirements.txt").write_text("\n".join(PACKAGES) + "\n")
    phases: dict[str, float] = {}
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, name: str | Callable[..., str]) -> None:
        if hasattr(owner, attr):
            patched.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, timed(phases, name, getattr(owner, attr)))

    # named by its `what`: the last text among its arguments (before and after the two runs became one)
    def run_name(self: Environments, *rest: Any, **options: Any) -> str:
        if callable(rest[-1]):
            return "one build sandbox: uv resolves, then installs"
        return "sandboxed uv: " + [a for a in rest if isinstance(a, str)][-1]

    patch(Environments, "_run", run_name)
    if "then" in inspect.signature(Environments._run).parameters:  # one sandbox: when the server was told
        run = Environments._run

        def told(self: Environments, *args: Any, **options: Any) -> None:
            start = time.perf_counter()

            def then() -> list[str] | None:
                phases["  of which uv's resolution (until the server names it)"] = time.perf_counter() - start
                mark = time.perf_counter()
                try:
                    return args[-1]()
                finally:
                    phases["  of which the server names it, takes its lock"] = time.perf_counter() - mark

            run(self, *args[:-1], then, **options)

        Environments._run = told  # type: ignore[method-assign]
        patched.append((Environments, "_run", run))
    for attr in ("own_tree", "_layer", "seal_tree", "_installed", "_size", "atomic_write", "box_packages"):
        patch(environments, attr, attr)
    patch(environments.os, "rename", "rename")
    try:
        start = time.perf_counter()
        store = Environments(root, sandbox)
        with open(work / "job.log", "wb") as log_file:
            built = Environments.ensure(store, EnvRequest(), project, [], log_file, BUILD_UID)
        phases["ensure (all)"] = time.perf_counter() - start
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)
    assert built is not None, (work / "job.log").read_text()
    # The job's first Python, in the environment, in a sandbox as a job's uid.
    prefix = sandbox.argv(uid=JOB_UID, writable=[], readable=[built.path], cwd=Path("/"))
    start = time.perf_counter()
    subprocess.run([*prefix, built.python, "-c", IMPORTS], check=True)
    phases["job's command in a sandbox"] = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([*prefix, "true"], check=True)
    phases["(a sandbox's start alone)"] = time.perf_counter() - start
    phases["total (ensure + command)"] = phases["ensure (all)"] + phases["job's command in a sandbox"]
    return phases


def by_hand(work: Path) -> dict[str, float]:
    settings = index_settings()
    env = {**os.environ, **dict(settings.env), "UV_CACHE_DIR": str(work / "uv-cache")}
    folder = work / "by-hand"
    phases = {}
    start = time.perf_counter()
    subprocess.run([UV, "venv", "--quiet", str(folder)], check=True, env=env)
    phases["uv venv"] = time.perf_counter() - start
    mark = time.perf_counter()
    install = [UV, "pip", "install", "--quiet", "--python", str(folder / "bin" / "python"), *settings.args, *PACKAGES]
    subprocess.run(install, check=True, env=env)
    phases["uv pip install"] = time.perf_counter() - mark
    mark = time.perf_counter()
    subprocess.run([str(folder / "bin" / "python"), "-c", IMPORTS], check=True)
    phases["the command"] = time.perf_counter() - mark
    phases["total"] = time.perf_counter() - start
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the build runs as a build uid, as the server's does")
    os.environ["UV_INDEX_URL"] = INDEX
    os.environ["PIP_INDEX_URL"] = INDEX
    print("load average at the start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    top = Path(tempfile.mkdtemp(prefix="gpuport-env-phases-"))
    os.chmod(top, 0o755)
    try:
        sandbox = isolation.detect(copies=top / "python")
        if not sandbox.isolated:
            raise SystemExit(f"no sandbox here: {sandbox.why}")
        found: dict[str, dict[str, list[float]]] = {"ours": defaultdict(list), "by hand": defaultdict(list)}
        for round_ in range(args.rounds):
            for name, run in (("ours", lambda w: ours(w, sandbox)), ("by hand", by_hand))[:: 1 if round_ % 2 else -1]:
                work = top / f"{name.replace(' ', '-')}-{round_}"
                work.mkdir(mode=0o755)
                for phase, took in run(work).items():
                    found[name][phase].append(took)
                shutil.rmtree(work, ignore_errors=True)
        for name, phases in found.items():
            print(f"{name} (median of {args.rounds}, ms):")
            for phase, times in phases.items():
                print(f"  {phase:48s} {statistics.median(times) * 1000:8.1f}   (min {min(times) * 1000:.1f})")
        ratio = statistics.median(found["ours"]["total (ensure + command)"]) / statistics.median(
            found["by hand"]["total"]
        )
        print(f"ensure + command against by hand: {ratio:.2f}x (the job's launch through a server not counted)")
        print("load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
