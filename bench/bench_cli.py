"""How fast the CLI starts, as a user types it: whole processes, median of --runs, against
`python -c pass` (the interpreter's own start) in the same run, taken in turns; gpuport's modules
compiled first, as an install leaves them.

  gpuport --version, gpuport --help     goal: at most 60 ms (--version without click; help written by the helper)
  gpuport status, gpuport jobs          goal: at most 120 ms (a TLS connection, a Hello, one call)
  gpuport push DIR of an unchanged folder (20 small files)   goal: at most 120 ms

The server commands and --help run as users get them: logged in (`gpuport login`: the certificate pinned in
the profile), through the CLI's helper (gpuport/cli/_agent.py), which the first of them starts; the
bench's helper is its own (a private runtime folder) and is stopped at the end. The same commands
with GPUPORT_AGENT=0 (every import in the command's own process) are timed in the same turns and
printed beside them, with the first command's time (helper starting).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _report  # noqa: E402
from _report import ROWS, Row, median, ms, say  # noqa: E402

GPUPORT = str(Path(sys.executable).parent / "gpuport")


def _wait_for_helper(work: Path) -> None:
    """Wait until the CLI's helper that the first server command started listens."""
    deadline = time.monotonic() + 30
    while not (_report.cli_helpers(work) and list((work / "runtime").glob("gpuport-*/agent-*.sock"))):
        if time.monotonic() > deadline:
            raise SystemExit("the CLI's helper did not start")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    _report.banner("gpuport's CLI", quick=False)
    _report.compile_gpuport()
    with _report.isolated_workdir() as work, _report.gpuport_server(work, "server") as server:
        env = _report.cli_login_env(server, work / "config", work / "cache")  # as after `gpuport login`
        env.update(_report.cli_helper_env(work))
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
        alone = dict(env, GPUPORT_AGENT="0")
        for name in ("gpuport --help", "gpuport status", "gpuport jobs", "gpuport push (unchanged)"):
            commands[f"{name}, no helper"] = commands[name]
        subprocess.run(commands["gpuport push (unchanged)"], env=alone, check=True, capture_output=True)
        time.sleep(2.1)  # the hash cache keeps a file's hash once the file is 2 s old
        subprocess.run(commands["gpuport push (unchanged)"], env=alone, check=True, capture_output=True)

        def run(name: str, argv: list[str]) -> float:
            started = time.perf_counter()
            done = subprocess.run(argv, env=alone if name.endswith("no helper") else env, capture_output=True)
            elapsed = time.perf_counter() - started
            if done.returncode:
                raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.decode()[-500:]}")
            return elapsed

        try:
            first = run("gpuport status", commands["gpuport status"])  # starts the helper
            _wait_for_helper(work)
            calls = {name: (lambda name=name, argv=argv: run(name, argv)) for name, argv in commands.items()}
            times = _report.rotate(args.runs, calls)
        finally:
            _report.stop_cli_helpers(work)
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
        if f"{name}, no helper" in times:
            alone_s = median(times[f"{name}, no helper"])
            ROWS.append(Row(f"{name}, no helper", alone_s, python, "python -c pass", "-", None))
    say(f"(python -c pass: {python * 1000:.1f} ms; the first server command, which starts the helper: {ms(first)})")
    _report.print_table(
        ["gpuport --version", "gpuport --help", "gpuport status", "gpuport jobs", "gpuport push"],
        38,
        f"whole processes, median of {args.runs}, taken in turns; ratio: against the interpreter's own start",
    )


if __name__ == "__main__":
    main()
