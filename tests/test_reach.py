"""A running job reached by its owner: a port it listens on (`gpuport forward`, ``job.forward``)
and a command inside its sandbox (`gpuport exec`, ``job.exec``), against the real server with its
sandbox, as an ordinary user."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

import gpuport
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import Conflict, PermissionDenied
from tests.conftest import CLIENT_ENV, RunningServer, client_env, wait_for

# A job that says who and where it is, then serves HTTP on its own loopback until it is stopped.
_SERVE = (
    "import http.server, os\n"
    "class Handler(http.server.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    def do_GET(self):\n"
    "        body = ('hello from ' + self.path).encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "    def log_message(self, *args):\n"
    "        pass\n"
    "server = http.server.ThreadingHTTPServer(('127.0.0.1', PORT), Handler)\n"
    "print('uid', os.getuid(), 'cwd', os.getcwd(), 'pid', os.getpid(), flush=True)\n"
    "print('ready', flush=True)\n"
    "server.serve_forever()\n"
)
_PORT = 8765


def _serving(client: gpuport.Client, **env: str) -> gpuport.Job:
    """A running job serving HTTP on port _PORT of its loopback, once it listens."""
    job = client.submit(["python", "-c", _SERVE.replace("PORT", str(_PORT))], env=env or None)
    wait_for(lambda: "ready" in list(job.logs()), 60, "the job's HTTP server")
    return job


def _stop(job: gpuport.Job) -> None:
    with contextlib.suppress(Conflict):  # it has ended already
        job.cancel()


def _said(job: gpuport.Job) -> dict[str, str]:
    words = next(line for line in job.logs() if line.startswith("uid ")).split()
    return dict(zip(words[::2], words[1::2]))


def _get(conn: socket.socket, path: str) -> bytes:
    """One HTTP/1.1 request on a kept-alive connection; the body of its answer."""
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: job\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed after {data!r}"
        data += chunk
    return data.partition(b"\r\n\r\n")[2]


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.fixture
def user(server: RunningServer, user_token: str) -> Iterator[gpuport.Client]:
    with server.connect(user_token) as client:
        yield client


@pytest.fixture
def other(server: RunningServer, admin: gpuport.Client) -> Iterator[gpuport.Client]:
    token = admin.create_token(f"other-{uuid.uuid4().hex[:8]}").token
    with server.connect(token) as client:
        yield client


# ---- exec -----------------------------------------------------------------------------------------


def test_exec_runs_as_the_job_in_its_folder_with_its_environment(user: gpuport.Client) -> None:
    job = _serving(user, GREETING="hi there")
    try:
        said = _said(job)
        done = job.exec(["sh", "-c", 'id -u; pwd; echo "$GREETING"; cat; echo oops >&2; exit 3'], input=b"fed in\n")
        assert done.exit_code == 3
        assert done.stdout.decode().splitlines() == [said["uid"], said["cwd"], "hi there", "fed in"]
        assert done.stderr == b"oops\n"
        assert said["uid"] != str(os.getuid())  # the job's own uid, not the server's
    finally:
        job.cancel()


def test_exec_sees_the_jobs_processes_and_network(user: gpuport.Client) -> None:
    job = _serving(user)
    try:
        said = _said(job)
        # The job's pid namespace: its server is there under the pid it saw itself, and few others.
        pids = job.exec(["sh", "-c", "ls /proc | grep -E '^[0-9]+$'"]).stdout.decode().split()
        assert said["pid"] in pids and len(pids) < 20
        cmdline = job.exec(["cat", f"/proc/{said['pid']}/cmdline"]).stdout
        assert b"http.server" in cmdline
        # Its network namespace: its server answers on its loopback.
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{_PORT}/in').read().decode())"
        assert job.exec(["python", "-c", code]).stdout == b"hello from /in\n"
    finally:
        job.cancel()


def test_exec_from_the_cli_passes_output_and_exit_code(
    server: RunningServer, user_token: str, user: gpuport.Client, cli
) -> None:  # type: ignore[no-untyped-def]
    job = _serving(user)
    try:
        done = cli("exec", job.id, "--", "sh", "-c", "echo out; echo err >&2; exit 5", **client_env(server, user_token))
        assert (done.code, done.stdout, done.stderr) == (5, "out\n", "err\n"), done
        piped = cli("exec", job.id, "--", "tr", "a-z", "A-Z", input="shout\n", **client_env(server, user_token))
        assert (piped.code, piped.stdout) == (0, "SHOUT\n")
    finally:
        job.cancel()


def test_exec_it_runs_an_interactive_shell_on_a_terminal(
    server: RunningServer, user_token: str, user: gpuport.Client
) -> None:
    job = _serving(user)
    try:
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
        env.update(client_env(server, user_token), TERM="dumb")
        leader, follower = pty.openpty()
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuport", "exec", "-it", job.id, "--", "sh"],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            env=env,
            start_new_session=True,
        )
        os.close(follower)
        seen = bytearray()

        def read_until(marker: bytes) -> None:
            deadline = time.monotonic() + 60
            while marker not in seen:
                assert time.monotonic() < deadline, f"no {marker!r} in {bytes(seen)!r}"
                if select.select([leader], [], [], 1)[0]:
                    try:
                        seen.extend(os.read(leader, 4096))
                    except OSError:  # EIO: the CLI has exited
                        break

        try:
            read_until(b"$ ")  # the shell's prompt: it runs
            os.write(leader, b"tty; echo sum-$((40 + 2))\n")
            read_until(b"sum-42")
            assert b"/dev/pts/" in seen  # its stdin is a terminal there
            os.write(leader, b"exit 3\n")
            assert process.wait(timeout=60) == 3
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            os.close(leader)
    finally:
        job.cancel()


def test_exec_is_refused_for_another_user_an_admin_and_a_finished_job(
    user: gpuport.Client, other: gpuport.Client, admin: gpuport.Client
) -> None:
    job = _serving(user)
    try:
        for stranger in (other, admin):
            with pytest.raises(PermissionDenied, match="not yours: only its owner"):
                gpuport.Job(stranger.transport, job.info).exec(["true"])
            with pytest.raises(PermissionDenied, match="not yours"):
                gpuport.Job(stranger.transport, job.info).forward(_PORT)
    finally:
        job.cancel()
    job.wait(60)
    with pytest.raises(Conflict, match="it can be reached only while a job runs"):
        job.exec(["true"])


def test_an_execd_process_dies_with_the_jobs_cancel(user: gpuport.Client) -> None:
    job = _serving(user)
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(job.exec(["sleep", "600"])), daemon=True)
    thread.start()
    wait_for(lambda: b"sleep" in job.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline"]).stdout, 30, "sleep running")
    job.cancel()
    thread.join(60)
    assert done and done[0].exit_code < 0  # type: ignore[attr-defined]


# ---- forward --------------------------------------------------------------------------------------


def test_forward_carries_many_connections_and_closes_with_the_job(user: gpuport.Client) -> None:
    job = _serving(user)
    try:
        with job.forward(_PORT) as forward:
            first = socket.create_connection(("127.0.0.1", forward.local_port))
            second = socket.create_connection(("127.0.0.1", forward.local_port))
            with first, second:
                # Both open at once, each kept alive for several requests.
                for n in range(3):
                    assert _get(first, f"/a{n}") == f"hello from /a{n}".encode()
                    assert _get(second, f"/b{n}") == f"hello from /b{n}".encode()
                job.cancel()
                assert forward.wait(60)
                assert "ended" in forward.why
                first.settimeout(30)
                assert first.recv(100) == b""  # closed with the job
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", forward.local_port), timeout=5)
    finally:
        _stop(job)


def test_a_revoked_token_ends_its_forward(server: RunningServer, admin: gpuport.Client) -> None:
    name = f"revoked-{uuid.uuid4().hex[:8]}"
    token = admin.create_token(name).token
    with server.connect(token) as client:
        job = _serving(client)
        try:
            forward = job.forward(_PORT)
            conn = socket.create_connection(("127.0.0.1", forward.local_port))
            assert _get(conn, "/before") == b"hello from /before"
            admin.revoke_token(name)
            conn.settimeout(30)
            assert conn.recv(100) == b""  # cut by the server at once
            assert forward.wait(90)
            conn.close()
        finally:
            _stop(admin.job(job.id))


def test_forward_from_the_cli_prints_where_and_ends_with_the_job(
    server: RunningServer, user_token: str, user: gpuport.Client
) -> None:
    job = _serving(user)
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env.update(client_env(server, user_token))
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuport", "forward", job.id, str(_PORT), "--local", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line.startswith("forwarding 127.0.0.1:") and line.endswith(f" -> {job.id}:{_PORT}"), line
        local = int(line.split(":")[1].split()[0])
        with socket.create_connection(("127.0.0.1", local)) as conn:
            assert _get(conn, "/cli") == b"hello from /cli"
        job.cancel()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
        _stop(job)


def _spare(transport: object, ticket: object) -> socket.socket:
    """A data-port connection that presented a forward's ticket (its answer not read yet)."""
    conn = transport.connect_data_port(ticket.port)  # type: ignore[attr-defined]
    conn.sendall(ticket.ticket.encode() + b"\n")  # type: ignore[attr-defined]
    return conn


def _answer(conn: socket.socket) -> bytes:
    """The data port's answer to a ticket: ``R``, or ``E`` and why."""
    conn.settimeout(30)
    data = b""
    while not data.endswith((b"R", b"\n")):
        chunk = conn.recv(1000)
        if not chunk:
            break
        data += chunk
    return data


def test_a_forwards_ticket_serves_each_connection_until_its_token_is_revoked(
    server: RunningServer, admin: gpuport.Client
) -> None:
    name = f"reused-{uuid.uuid4().hex[:8]}"
    token = admin.create_token(name).token
    with server.connect(token) as client:
        job = _serving(client)
        try:
            transport = client.transport
            ticket = transport.call(transport.jobs.Reach, pb.ReachRequest(job_id=job.id, port=_PORT))
            # One ticket, many connections: each is made ready ahead, then reaches the job on its G.
            for n in range(5):
                conn = _spare(transport, ticket)
                with conn:
                    assert _answer(conn) == b"R"
                    conn.sendall(b"G")
                    assert _get(conn, f"/again{n}") == f"hello from /again{n}".encode()
            waiting = _spare(transport, ticket)
            assert _answer(waiting) == b"R"  # ready, not used yet
            admin.revoke_token(name)
            assert waiting.recv(100) == b""  # cut at once
            waiting.close()
            with _spare(transport, ticket) as refused:
                assert b"revoked" in _answer(refused)
        finally:
            _stop(admin.job(job.id))


def test_a_forwards_ticket_reaches_nothing_once_its_job_has_ended(user: gpuport.Client) -> None:
    job = _serving(user)
    transport = user.transport
    ticket = transport.call(transport.jobs.Reach, pb.ReachRequest(job_id=job.id, port=_PORT))
    ready = _spare(transport, ticket)
    assert _answer(ready) == b"R"
    job.cancel()
    job.wait(60)
    with ready:  # made ahead, used after the job's end: closed, nothing reached
        with contextlib.suppress(OSError):
            ready.sendall(b"G" + b"GET / HTTP/1.1\r\nHost: job\r\n\r\n")
        ready.settimeout(30)
        with contextlib.suppress(OSError):
            assert ready.recv(100) == b""
    with _spare(transport, ticket) as late:
        assert b"not running" in _answer(late)


def test_more_connections_open_at_once_than_spares_and_waiting_threads(user: gpuport.Client) -> None:
    """Eight connections held open together: more than a forward's spares and its threads waiting in
    accept, so both are made on the way, and each connection still gets its own answers."""
    job = _serving(user)
    try:
        with job.forward(_PORT) as forward:
            conns = [socket.create_connection(("127.0.0.1", forward.local_port), timeout=30) for _ in range(8)]
            try:
                for round_ in range(2):
                    for n, conn in enumerate(conns):
                        assert _get(conn, f"/c{n}r{round_}") == f"hello from /c{n}r{round_}".encode()
            finally:
                for conn in conns:
                    conn.close()
            with socket.create_connection(("127.0.0.1", forward.local_port), timeout=30) as conn:
                assert _get(conn, "/after") == b"hello from /after"
            assert not forward.closed
    finally:
        _stop(job)


def test_many_connections_one_after_another_through_one_forward(user: gpuport.Client) -> None:
    job = _serving(user)
    try:
        with job.forward(_PORT) as forward:
            for n in range(30):  # more than its spares: made again as they are used
                with socket.create_connection(("127.0.0.1", forward.local_port), timeout=30) as conn:
                    assert _get(conn, f"/n{n}") == f"hello from /n{n}".encode()
            assert not forward.closed
    finally:
        _stop(job)
