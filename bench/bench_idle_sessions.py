"""What open, idle sessions cost the server: its CPU with N sessions open and nothing called, against
the same server with none.

    .venv/bin/python bench/bench_idle_sessions.py              # 5 sessions, 10 s each way: about 40 s
    .venv/bin/python bench/bench_idle_sessions.py --sessions 20

One sandboxed server on 127.0.0.1; a client opens the sessions, calls each once (its worker runs, its
output is followed, as ``gpu.session()`` does), then waits. The server's CPU time (user + system, from
/proc through psutil) over the same span without sessions and with them; the difference divided by the
count is what one idle session costs. A session's output is followed by the server (it reads the
worker's stdout and stderr files); an idle one's is read twice a second, a busy one's every 20 ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _report
from _report import ROWS, Row


def _server_cpu(process: object, seconds: float) -> float:
    """Cores the server used over ``seconds`` from now."""
    before = process.cpu_times()  # type: ignore[attr-defined]
    time.sleep(seconds)
    after = process.cpu_times()  # type: ignore[attr-defined]
    return (after.user + after.system - before.user - before.system) / seconds


def main() -> None:
    import psutil

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=5, help="idle sessions to hold open")
    parser.add_argument("--seconds", type=float, default=10.0, help="span of each measurement")
    args = parser.parse_args()
    _report.banner(f"{args.sessions} idle sessions", quick=False)
    with (
        _report.isolated_workdir() as work,
        _report.gpuport_server(work, "sandboxed") as server,
        _report.connect(server) as client,
    ):
        process = psutil.Process(server.process.pid)
        time.sleep(2.0)  # the server's start settles
        alone = _server_cpu(process, args.seconds)
        sessions = [client.session(progress=False) for _ in range(args.sessions)]
        try:
            for session in sessions:
                session.call(abs, -1)
            time.sleep(2.0)  # past the second after their last call, when their output is read often
            held = _server_cpu(process, args.seconds)
        finally:
            for session in sessions:
                session.close()
    each = max(held - alone, 0.0) / args.sessions
    ROWS.append(Row(f"server CPU, {args.sessions} idle sessions open", held, alone, "none open", "", None, "cores"))
    ROWS.append(Row("server CPU, each idle session", each, None, "", "", None, "cores"))
    _report.print_table(["server CPU, ", "server CPU, each"], 44, "cores: the server's CPU time over the span")


if __name__ == "__main__":
    main()
