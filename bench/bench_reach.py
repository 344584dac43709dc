"""A running job reached from outside: `gpuport forward` and `gpuport exec` against their anchors.

    .venv/bin/python bench/bench_reach.py            # about 2 minutes
    .venv/bin/python bench/bench_reach.py --quick    # fewer rounds

Two servers on 127.0.0.1: one as it runs in use (bubblewrap sandbox, a uid per user, the job in its
own network namespace), and one with `--no-sandbox`, whose job listens on the host's loopback.
Each runs the same job: a small HTTP/1.1 server (keep-alive; 16-byte answers).

- forward, kept alive: one HTTP request and its answer on one open connection to `job.forward`'s
  local port (TLS to the data port, then the job's port inside its namespace), against the same on
  one open connection straight to the `--no-sandbox` job's port (the server's own way to its port,
  no gpuport in between). Goal ≤ 1.5x.
- forward, a fresh connection: connect, one request, its answer, close; the same anchor, fresh.
- exec: `gpuport exec JOB -- true` as a whole CLI process (no helper: `exec` runs in its own
  process), against `ssh gpubox true` to an sshd on 127.0.0.1 (tests/_sshd.py: a throwaway key, no
  connection sharing). And `job.exec(["true"])` from an open client beside it. Goal ≤ 0.5x ssh.

Rounds alternate the figures (``rotate``), so drift hits all alike; medians.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _report
from _report import ROWS, Row, median

from tests._sshd import sshd

_SERVE = (
    "import http.server, sys\n"
    "class Handler(http.server.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    disable_nagle_algorithm = True\n"
    "    def do_GET(self):\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', '16')\n"
    "        self.end_headers()\n"
    "        self.wfile.write(b'0123456789abcdef')\n"
    "    def log_message(self, *args):\n"
    "        pass\n"
    "server = http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), Handler)\n"
    "print('ready', flush=True)\n"
    "server.serve_forever()\n"
)
_REQUEST = b"GET / HTTP/1.1\r\nHost: job\r\n\r\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serving(client: object, port: int) -> object:
    job = client.submit(["python", "-c", _SERVE, str(port)], workdir=None)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60
    while "ready" not in list(job.logs()):
        assert time.monotonic() < deadline, "the job's HTTP server did not start"
        time.sleep(0.05)
    return job


def _round_trip(conn: socket.socket) -> None:
    conn.sendall(_REQUEST)
    data = b""
    while not data.endswith(b"0123456789abcdef"):
        chunk = conn.recv(4096)
        assert chunk, "the connection closed"
        data += chunk


def _timed(call: object) -> float:
    t = time.perf_counter()
    call()  # type: ignore[operator]
    return time.perf_counter() - t


def _fresh(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _round_trip(conn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    kept_n, fresh_n, exec_n = (300, 60, 15) if args.quick else (2000, 300, 40)
    ssh_version = subprocess.run(["ssh", "-V"], check=False, capture_output=True, text=True).stderr.strip()
    _report.banner(ssh_version, args.quick)
    _report.compile_gpuport()
    with (
        _report.isolated_workdir() as work,
        _report.gpuport_server(work, "sandboxed") as boxed,
        _report.gpuport_server(work, "bare", ["--no-sandbox"]) as bare,
        sshd(work / "sshd") as ssh_config,
    ):
        env = _report.cli_login_env(boxed, work / "config", work / "cache")
        env["GPUPORT_AGENT"] = "0"
        with _report.connect(boxed) as client, _report.connect(bare) as bare_client:
            direct_port = _free_port()
            job = _serving(client, 8080)
            bare_job = _serving(bare_client, direct_port)
            try:
                with job.forward(8080) as forward:  # type: ignore[attr-defined]
                    kept = socket.create_connection(("127.0.0.1", forward.local_port))
                    direct = socket.create_connection(("127.0.0.1", direct_port))
                    for conn in (kept, direct):
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    with kept, direct:
                        times = _report.rotate(
                            kept_n,
                            {
                                "forward": lambda: _timed(lambda: _round_trip(kept)),
                                "direct": lambda: _timed(lambda: _round_trip(direct)),
                            },
                        )
                    ROWS.append(
                        Row(
                            "forward, HTTP request on a kept-alive connection",
                            median(times["forward"]),
                            median(times["direct"]),
                            "the job's port, straight",
                            "<= 1.5x",
                            median(times["forward"]) <= 1.5 * median(times["direct"]),
                        )
                    )
                    times = _report.rotate(
                        fresh_n,
                        {
                            "forward": lambda: _timed(lambda: _fresh(forward.local_port)),
                            "direct": lambda: _timed(lambda: _fresh(direct_port)),
                        },
                    )
                    ROWS.append(
                        Row(
                            "forward, fresh connection + HTTP request",
                            median(times["forward"]),
                            median(times["direct"]),
                            "the job's port, straight",
                            "<= 1.5x",
                            median(times["forward"]) <= 1.5 * median(times["direct"]),
                        )
                    )
                cli = [sys.executable, "-m", "gpuport", "exec", job.id, "--", "true"]  # type: ignore[attr-defined]
                ssh = ["ssh", "-F", str(ssh_config), "-o", "ControlMaster=no", "gpubox", "true"]
                run = lambda argv, e=None: subprocess.run(argv, env=e, check=True, capture_output=True)
                times = _report.rotate(
                    exec_n,
                    {
                        "cli": lambda: _timed(lambda: run(cli, env)),
                        "ssh": lambda: _timed(lambda: run(ssh)),
                        "api": lambda: _timed(lambda: job.exec(["true"])),  # type: ignore[attr-defined]
                    },
                )
                for name, figure in (
                    ("cli", "exec: `gpuport exec JOB -- true`"),
                    ("api", "exec: job.exec(['true'])"),
                ):
                    ROWS.append(
                        Row(
                            figure,
                            median(times[name]),
                            median(times["ssh"]),
                            "`ssh box true`, 127.0.0.1",
                            "<= 0.5x",
                            median(times[name]) <= 0.5 * median(times["ssh"]),
                        )
                    )
            finally:
                job.cancel()  # type: ignore[attr-defined]
                bare_job.cancel()  # type: ignore[attr-defined]
    _report.print_table(["forward, HTTP", "forward, fresh", "exec: `", "exec: job"], 50, "medians; rounds alternate")


if __name__ == "__main__":
    main()
