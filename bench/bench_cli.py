"""How fast the CLI starts, as a user types it: whole processes, median of --runs, against
`python -c pass` (the interpreter's own start) in the same run, taken in turns; gpuport's modules
compiled first, as an install leaves them.

  gpuport --version, gpuport --help     goal: at most 60 ms
  gpuport status, gpuport jobs          goal: at most 120 ms (a TLS connection, a Hello, one call)
  gpuport push DIR of an unchanged folder (20 small files)   goal: at most 120 ms
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _report  # noqa: E402
from _report import ROWS, Row, median, say  # noqa: E402

GPUPORT = str(Path(sys.executable).parent / "gpuport")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    _report.banner("gpuport's CLI", quick=False)
    # As pip leaves an install: every module compiled. (PYTHONDONTWRITEBYTECODE, set on some machines,
    # would have each command compile what changed since, and time that.)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(Path(__file__).parent.parent / "gpuport")], check=True
    )
    with _report.isolated_workdir() as work, _report.gpuport_server(work, "server") as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
        env.update(GPUPORT_URL=server.url, GPUPORT_TOKEN=server.token, GPUPORT_FINGERPRINT=server.fingerprint)
        env.update(GPUPORT_CONFIG_DIR=str(work / "config"), GPUPORT_CACHE_DIR=str(work / "cache"))
        project = work / "project"
        (project / "src").mkdir(parents=True)
        for i in range(20):
            (project / "src" / f"m{i}.py").write_text(f"x = {i}\n" * 50)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "gpuport --version": [GPUPORT, "--version"],
            "gpuport --help": [GPUPORT, "--help"],
            "gpuport status": [GPUPORT, "status"],
            "gpuport jobs": [GPUPORT, "jobs"],
            "gpuport push (unchanged)": [GPUPORT, "push", str(project), "--name", "p"],
        }
        subprocess.run(commands["gpuport push (unchanged)"], env=env, check=True, capture_output=True)
        time.sleep(2.1)  # the hash cache keeps a file's hash once the file is 2 s old
        subprocess.run(commands["gpuport push (unchanged)"], env=env, check=True, capture_output=True)

        def run(argv: list[str]) -> float:
            started = time.perf_counter()
            done = subprocess.run(argv, env=env, capture_output=True)
            elapsed = time.perf_counter() - started
            if done.returncode:
                raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.decode()[-500:]}")
            return elapsed

        times = _report.rotate(args.runs, {name: (lambda argv=argv: run(argv)) for name, argv in commands.items()})
    python = median(times["python -c pass"])
    for name, goal in (
        ("gpuport --version", 0.060),
        ("gpuport --help", 0.060),
        ("gpuport status", 0.120),
        ("gpuport jobs", 0.120),
        ("gpuport push (unchanged)", 0.120),
    ):
        ours = median(times[name])
        ROWS.append(Row(name, ours, python, "python -c pass", f"<= {goal * 1000:.0f} ms", ours <= goal))
    say(f"(python -c pass: {python * 1000:.1f} ms)")
    _report.print_table(
        ["gpuport --version", "gpuport --help", "gpuport status", "gpuport jobs", "gpuport push"],
        28,
        f"whole processes, median of {args.runs}, taken in turns; ratio: against the interpreter's own start",
    )


if __name__ == "__main__":
    main()
