"""A running job reached from outside: `gpuport forward` and `gpuport exec` against their anchors.

    .venv/bin/python bench/bench_reach.py            # about 2 minutes
    .venv/bin/python bench/bench_reach.py --quick    # fewer rounds
    .venv/bin/python bench/bench_reach.py --hops     # what each hop of a forward costs, alone

Two servers on 127.0.0.1: one as it runs in use (bubblewrap sandbox, a uid per user, the job in its
own network namespace), and one with `--no-sandbox`, whose job listens on the host's loopback.
Each runs the same job: a small HTTP/1.1 server (keep-alive; 16-byte answers).

- forward, kept alive: one HTTP request and its answer on one open connection to `job.forward`'s
  local port (TLS to the data port, then the job's port inside its namespace), against the same on
  one open connection straight to the `--no-sandbox` job's port (the server's own way to its port,
  no gpuport in between). Goal ≤ 1.5x.
- forward, a fresh connection: connect, one request, its answer, close; the same anchor, fresh.
  Each comes 50 ms after the one before (either kind): the spare the last one took is made again
  by then, as between a user's connections; a burst of more than the forward's three spares at
  once makes spares on its way.
- exec: `gpuport exec JOB -- true` as a whole CLI process, as a user runs it (through the CLI's
  fast-start helper, which an exec without a terminal goes through; and beside it with
  GPUPORT_AGENT=0, in a process of its own), against `ssh gpubox true` to an sshd on 127.0.0.1
  (tests/_sshd.py: a throwaway key, no connection sharing). And `job.exec(["true"])` from an open
  client beside it. Goal ≤ 0.5x ssh.

Rounds alternate the figures (``rotate``), so drift hits all alike; medians.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
    "address = sys.argv[2] if len(sys.argv) > 2 else '127.0.0.1'\n"
    "server = http.server.ThreadingHTTPServer((address, int(sys.argv[1])), Handler)\n"
    "print('ready', flush=True)\n"
    "server.serve_forever()\n"
)
T = TypeVar("T")
_REQUEST = b"GET / HTTP/1.1\r\nHost: job\r\n\r\n"
_SETTLE = 0.05  # seconds before each fresh connection (both kinds): see _settled


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


def _settled(call: object) -> float:
    """``call`` timed after a pause of ``_SETTLE`` seconds: each fresh connection comes to a machine
    at rest (the forward's spare taken by the one before made again), as a user's connections,
    spaced, do; connections one right after another are not what the figure is about."""
    time.sleep(_SETTLE)
    return _timed(call)


def _fresh(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _round_trip(conn)


def _hops(client: object, job: object, state: Path, direct_port: int, rounds: int) -> None:
    """Time each hop of a connection through a forward, alone, and print the medians: the ticket
    (``Jobs.Reach``, once per forward since the ticket is reused), the data port's TCP connect and
    TLS handshake, the server's way from a ticket line to its answer (redeemed, a thread, the job's
    namespaces checked and a socket made in its network namespace: a spare, made ahead), those
    steps alone in this process, and what is left when a connection comes: ``G`` and a request
    through a spare, against a fresh connection and the request straight to the ``--no-sandbox``
    job's port (the table's anchor)."""
    from gpuport.protocol import gpuport_pb2 as pb
    from gpuport.server.executors import reach

    transport = client.transport  # type: ignore[attr-defined]
    job_id = job.id  # type: ignore[attr-defined]
    request = pb.ReachRequest(job_id=job_id, port=8080)
    job_dir = next(state.glob(f"**/{job_id}/supervisor.json")).parent
    times: dict[str, list[float]] = {}

    def timed(name: str, call: Callable[..., T], *args: object) -> T:
        t = time.perf_counter()
        result = call(*args)
        times.setdefault(name, []).append(time.perf_counter() - t)
        return result

    def answered(conn: socket.socket, line: bytes) -> None:
        conn.sendall(line)
        assert conn.recv(1) == b"R"

    def used(conn: socket.socket) -> None:
        conn.sendall(b"G" + _REQUEST)
        _round_trip(conn)

    for _ in range(rounds):
        ticket = timed("Jobs.Reach (a gRPC round trip)", transport.call, transport.jobs.Reach, request)
        conn = timed("data port: TCP connect + TLS handshake", transport.connect_data_port, ticket.port)
        with conn:
            timed("ticket line -> R (the server readies a spare)", answered, conn, ticket.ticket.encode() + b"\n")
            timed("G + HTTP request through a spare", used, conn)
        timed("(anchor: fresh connection + request, straight)", _fresh, direct_port)
        spaces = timed("  job's namespaces checked, opened", reach.sandbox_namespaces, job_dir, job_id, _yes, ("net",))
        made = timed("  sockets made in its netns (thread + setns)", reach._sockets_in, spaces.fds["net"])
        spaces.close()
        with made[0]:
            timed("  connect to the job's port, in its netns", made[0].connect, ("127.0.0.1", 8080))
        for end in made[1:]:
            end.close()
    for name, values in times.items():
        print(f"  {name:<48} {median(values) * 1e3:7.3f} ms")


def _yes() -> bool:
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--hops", action="store_true", help="time each hop of a forward, alone (then stop)")
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
        env.update(_report.cli_helper_env(work))  # as a user has it: the CLI's fast-start helper on
        alone = dict(env, GPUPORT_AGENT="0")
        with _report.connect(boxed) as client, _report.connect(bare) as bare_client:
            direct_port = _free_port()
            job = _serving(client, 8080)
            bare_job = _serving(bare_client, direct_port)
            try:
                if args.hops:
                    _hops(client, job, boxed.state_dir, direct_port, 15 if args.quick else 60)
                    return
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
                            "forward": lambda: _settled(lambda: _fresh(forward.local_port)),
                            "direct": lambda: _settled(lambda: _fresh(direct_port)),
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
                run(cli, env)  # starts the helper
                _wait_for_helper(work)
                times = _report.rotate(
                    exec_n,
                    {
                        "cli": lambda: _timed(lambda: run(cli, env)),
                        "alone": lambda: _timed(lambda: run(cli, alone)),
                        "ssh": lambda: _timed(lambda: run(ssh)),
                        "api": lambda: _timed(lambda: job.exec(["true"])),  # type: ignore[attr-defined]
                    },
                )
                for name, figure in (
                    ("cli", "exec: `gpuport exec JOB -- true`"),
                    ("alone", "exec: the same, GPUPORT_AGENT=0 (no helper)"),
                    ("api", "exec: job.exec(['true'])"),
                ):
                    ROWS.append(
                        Row(
                            figure,
                            median(times[name]),
                            median(times["ssh"]),
                            "`ssh box true`, 127.0.0.1",
                            "" if name == "alone" else "<= 0.5x",
                            None if name == "alone" else median(times[name]) <= 0.5 * median(times["ssh"]),
                        )
                    )
            finally:
                _report.stop_cli_helpers(work)
                job.cancel()  # type: ignore[attr-defined]
                bare_job.cancel()  # type: ignore[attr-defined]
    order = ["forward, HTTP", "forward, fresh", "exec: `", "exec: the same", "exec: job"]
    _report.print_table(order, 50, "medians; rounds alternate")


def _wait_for_helper(work: Path) -> None:
    """Wait until the CLI's helper that the first command started listens."""
    deadline = time.monotonic() + 30
    while not (_report.cli_helpers(work) and list((work / "runtime").glob("gpuport-*/agent-*.sock"))):
        assert time.monotonic() < deadline, "the CLI's helper did not start"
        time.sleep(0.05)


if __name__ == "__main__":
    main()
