"""Per-project Python environments (issue 34, point 7): what an environment costs a job, measured in
one run on fresh servers, against building the same by hand with uv and through Ray's runtime_env.

    .venv/bin/python bench/bench_envs.py            # 15 warm rounds: about two minutes on 2 cores
    .venv/bin/python bench/bench_envs.py --quick    # 5 warm rounds
    .venv/bin/python bench/bench_envs.py --quick --cold-rounds 5 --no-ray   # (b) as medians of 5

Every package comes from this machine's index (UV_INDEX_URL / PIP_INDEX_URL set to INDEX, with
pip.conf's other settings as the server passes them to uv): five small pure-Python packages the
server's environment lacks, PACKAGES.

(a) warm launch: submit -> exit of `python -c pass` through the Python API on an open connection,
    with requirements whose environment is built already, against the same job bare; alternated.
    Goal: at most +20 ms.
(b) cold build: a job with PACKAGES as requirements on a fresh server (empty uv cache) until it
    exits, against `uv venv` + `uv pip install` of the same by hand with the same index settings and
    an empty cache of its own, then the job's command run in it (the job's figure runs it too; goal
    <= 1.3x), and against `ray job submit --runtime-env-json
    '{"pip": PACKAGES}'` to a fresh Ray head with its job server and an empty pip cache (goal <= 0.3x).
    Once each by default; ``--cold-rounds N`` repeats the job and the by-hand build N times, alternated,
    each on a fresh server or folder with an empty cache, and reports their medians (Ray: once).
(c) 10 jobs with the same new requirements submitted at once: how many builds (jobs whose log says
    "building environment", and environments made). Goal: 1.

The servers, the Ray head and the folders live in a temp dir removed at the end; each is stopped in
`finally` by the pids this run started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _peers
from _report import ROWS, Row, banner, connect, gpuport_server, isolated_workdir, median, ms, print_table, rotate, say

import gpuport

INDEX = "file:///opt/pypi/simple"  # this machine's index, on its disk
PACKAGES = ["tomli-w", "toolz", "tabulate", "humanize", "appdirs"]
IMPORTS = "import tomli_w, toolz, tabulate, humanize, appdirs"
UV = str(Path(sys.executable).parent / "uv")
PASS = ["python", "-c", "pass"]
AT_ONCE = 10


def timed_job(gpu: gpuport.Client, argv: list[str], **options: object) -> float:
    start = time.perf_counter()
    job = gpu.submit(argv, workdir=None, **options).wait(timeout=600)
    took = time.perf_counter() - start
    if job.info.state != "succeeded":
        raise SystemExit(f"job {job.id} {job.info.state}: {job.info.message}\n" + "\n".join(job.logs())[-2000:])
    return took


def warm_launch(gpu: gpuport.Client, rounds: int) -> None:
    say("== (a) warm launch: a job with a built environment against a bare job")
    requirements = "\n".join(PACKAGES) + "\n"
    timed_job(gpu, PASS, requirements=requirements)  # builds it
    times = rotate(
        rounds,
        {"env": lambda: timed_job(gpu, PASS, requirements=requirements), "bare": lambda: timed_job(gpu, PASS)},
    )
    ours, bare = median(times["env"]), median(times["bare"])
    say(f"  with environment {ms(ours)} (min {ms(min(times['env']))}), bare {ms(bare)} (min {ms(min(times['bare']))})")
    ROWS.append(
        Row("warm launch with an environment", ours, bare, "bare job, same run", "<= +20 ms", ours - bare <= 0.020)
    )


def cold_gpuport(work: Path, name: str = "cold") -> float:
    with gpuport_server(work, name) as server, connect(server) as gpu:
        took = timed_job(gpu, ["python", "-c", IMPORTS], requirements="\n".join(PACKAGES) + "\n")
    say(f"  gpuport job, cold: {took:.2f}s")
    return took


def cold_by_hand(work: Path, name: str = "by-hand") -> float:
    from gpuport.server.environments import index_settings

    settings = index_settings()
    env = {**os.environ, **dict(settings.env), "UV_CACHE_DIR": str(work / f"{name}-uv-cache")}
    folder = work / name
    start = time.perf_counter()
    subprocess.run([UV, "venv", "--quiet", str(folder)], check=True, env=env)
    install = [UV, "pip", "install", "--quiet", "--python", str(folder / "bin" / "python"), *settings.args, *PACKAGES]
    subprocess.run(install, check=True, env=env)
    subprocess.run([str(folder / "bin" / "python"), "-c", IMPORTS], check=True)  # what the job runs, too
    took = time.perf_counter() - start
    say(f"  uv venv + uv pip install + the job's command, by hand: {took:.2f}s ({' '.join(settings.args)})")
    return took


def cold_ray(work: Path) -> float | None:
    if _peers.ray_cli() is None:
        say("  Ray is not installed (pip install -e '.[bench]'): no Ray figure")
        return None
    (work / "ray-cwd").mkdir()
    os.environ["PIP_CACHE_DIR"] = str(work / "pip-cache")  # the head's env is made from this one
    try:
        head = _peers.start_ray(work)
    except RuntimeError as e:  # e.g. "Cannot include dashboard with missing packages" (ray[default])
        log = (work / "ray-start.log").read_text(errors="replace").strip().splitlines()
        say(f"  the Ray head with its job server did not start ({e}; {log[-1] if log else 'no log'}): no Ray figure")
        return None
    try:
        runtime_env = json.dumps({"pip": PACKAGES})
        start = time.perf_counter()
        done = subprocess.run(
            [head.cli, "job", "submit", "--address", head.address, "--runtime-env-json", runtime_env, "--",
             "python", "-c", IMPORTS],
            check=False, cwd=work / "ray-cwd", env=head.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        )  # fmt: skip
        took = time.perf_counter() - start
    finally:
        head.stop()
    if done.returncode != 0 or "succeeded" not in done.stdout + done.stderr:
        raise SystemExit(f"ray job submit failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    say(f"  ray job submit with runtime_env pip, cold: {took:.2f}s")
    return took


def at_once(gpu: gpuport.Client, server_state: Path) -> None:
    say(f"== (c) {AT_ONCE} jobs with the same new requirements submitted at once")
    requirements = f"tomli-w\ntabulate\n# {uuid.uuid4().hex}\n"
    before = {p.name for p in (server_state / "envs").iterdir()} if (server_state / "envs").is_dir() else set()
    jobs = [gpu.submit(["python", "-c", "import tomli_w, tabulate"], workdir=None, requirements=requirements)
            for _ in range(AT_ONCE)]  # fmt: skip
    for job in jobs:
        job.wait(timeout=600)
    states = {job.wait(timeout=1).info.state for job in jobs}
    builds = sum("building environment" in "\n".join(job.logs()) for job in jobs)
    made = {p.name for p in (server_state / "envs").iterdir() if p.is_dir() and len(p.name) == 16} - before
    hashes = {job.info.environment for job in jobs}
    say(f"  states {sorted(states)}; builds {builds}; environments made {len(made)}; hashes {len(hashes)}")
    ROWS.append(
        Row(f"{AT_ONCE} jobs at once, same new requirements: builds", builds, 1, "one build", "1 build", builds == 1
            and len(made) == 1 and states == {"succeeded"}, unit="count")
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 warm rounds")
    parser.add_argument("--cold-rounds", type=int, default=1, help="cold builds of each, alternated (medians)")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray's cold figure out (a minute or more)")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    if not Path(INDEX.removeprefix("file://"), PACKAGES[0]).is_dir():
        raise SystemExit(f"this machine has no package index at {INDEX}")
    os.environ["UV_INDEX_URL"] = INDEX  # the servers', uv's by hand (index_settings) and, as pip's, Ray's
    os.environ["PIP_INDEX_URL"] = INDEX
    versions = f"uv {subprocess.run([UV, '--version'], check=True, capture_output=True, text=True).stdout.split()[1]}"
    if _peers.ray_cli() is not None:
        versions += f", Ray {_peers.ray_version()}"
    banner(f"{versions}, packages {' '.join(PACKAGES)}, {rounds} warm rounds", args.quick)
    with isolated_workdir() as work:
        say("== (b) a cold build of 5 small packages")
        times = rotate(
            args.cold_rounds,
            {"ours": lambda: cold_gpuport(work, f"cold-{uuid.uuid4().hex[:8]}"),
             "hand": lambda: cold_by_hand(work, f"by-hand-{uuid.uuid4().hex[:8]}")},
        )  # fmt: skip
        ours, hand = median(times["ours"]), median(times["hand"])
        if args.cold_rounds > 1:
            say(f"  medians of {args.cold_rounds}: job {ours:.2f}s, by hand {hand:.2f}s ({ours / hand:.2f}x)")
        ray = None if args.no_ray else cold_ray(work)
        ROWS.append(Row("cold build: job vs uv by hand", ours, hand, "uv venv + uv pip install + run", "<= 1.3x",
                        ours <= 1.3 * hand))  # fmt: skip
        ROWS.append(Row("cold build: job vs Ray runtime_env pip", ours, ray, "ray job submit, runtime_env pip",
                        "<= 0.3x", ours <= 0.3 * ray if ray else None))  # fmt: skip
        with gpuport_server(work, "warm") as server, connect(server) as gpu:
            warm_launch(gpu, rounds)
            at_once(gpu, work / "warm" / "state")
    print_table(
        ["warm", "cold build: job vs uv", "cold build: job vs Ray", f"{AT_ONCE} jobs"],
        52,
        f"warm: medians over the rounds; cold: {args.cold_rounds} run(s) each (medians), every cache empty",
    )


if __name__ == "__main__":
    main()
