"""The link from the server to a node's agent (executors/node_link.py), without Ray: a real TLS
listener in front of a real Unix socket, as an agent has one in front of its jobs' workers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuport.defaults import ENV_RUN_DIR
from gpuport.protocol import values
from gpuport.protocol.errors import InvalidRequest
from gpuport.server.executors.base import Stream
from gpuport.server.executors.node_link import LinkError, NodeListener, dial
from gpuport.server.worker import wire
from tests.conftest import wait_for

SECRET = "ab" * 32


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[str]:
    """A Unix socket that reads a length-prefixed message whole, then answers its sha256 and the
    message back (a request, then its reply, as a session's worker answers)."""
    path = str(tmp_path / "w.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a caller that closed at once
            size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            data = bytearray()
            while len(data) < size and (part := conn.recv(1 << 20)):
                data += part
            conn.sendall(hashlib.sha256(data).digest() + data)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path
    finally:
        listener.close()


@pytest.fixture
def link(worker: str) -> Iterator[tuple[NodeListener, dict]]:
    def connect(job_id: str, name: str) -> Stream:
        if job_id == "starting":
            raise FileNotFoundError(f"no endpoint {name} yet")
        if job_id == "refused":
            raise ConnectionRefusedError("nothing listens yet")
        if job_id == "another":
            raise PermissionError("not the worker's socket")
        if name != "worker":
            raise ValueError(f"{name!r} is not an endpoint's name")
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(worker)
        return Stream(sock, passes_fds=False)  # a byte echo, not a session's frames: the link relays it

    listener = NodeListener("127.0.0.1", connect)
    try:
        yield listener, listener.open(SECRET)
    finally:
        listener.close()


def _recv(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size and (part := sock.recv(1 << 20)):
        data += part
    return bytes(data)


def test_bytes_reach_the_worker_and_come_back_whole_as_a_local_stream(link: tuple[NodeListener, dict]) -> None:
    _, opened = link
    stream = dial("127.0.0.1", opened["port"], opened["fingerprint"], SECRET, "j-1", "worker")
    try:
        assert not stream.passes_fds  # another machine's worker: bytes, never descriptors
        assert stream.sock.family == socket.AF_UNIX  # sendmsg works on it, as on a local worker's
        message = os.urandom(8 << 20)
        stream.sock.sendall(len(message).to_bytes(8, "little") + message)
        reply = _recv(stream.sock, 32 + len(message))
        assert reply[:32] == hashlib.sha256(message).digest() and reply[32:] == message
    finally:
        stream.close()


@pytest.mark.parametrize(
    ("job_id", "name", "error"),
    [
        ("starting", "worker", FileNotFoundError),
        ("refused", "worker", ConnectionError),
        ("another", "worker", PermissionError),
        ("j-1", "nope", InvalidRequest),
    ],
)
def test_the_agents_answer_is_raised_as_the_seam_says(
    link: tuple[NodeListener, dict], job_id: str, name: str, error: type[Exception]
) -> None:
    _, opened = link
    with pytest.raises(error) as caught:
        dial("127.0.0.1", opened["port"], opened["fingerprint"], SECRET, job_id, name)
    assert not isinstance(caught.value, LinkError)  # an answer about the worker, not a broken link


def test_a_wrong_secret_or_another_certificate_is_refused(link: tuple[NodeListener, dict]) -> None:
    listener, opened = link
    with pytest.raises(LinkError, match="closed the connection"):
        dial("127.0.0.1", opened["port"], opened["fingerprint"], "cd" * 32, "j-1", "worker")
    with pytest.raises(LinkError, match="is not the node's agent"):
        dial("127.0.0.1", opened["port"], "sha256:" + "0" * 64, SECRET, "j-1", "worker")
    # A new secret (a restarted server's) replaces the old one.
    assert listener.open("ef" * 32) == opened
    with pytest.raises(LinkError):
        dial("127.0.0.1", opened["port"], opened["fingerprint"], SECRET, "j-1", "worker")
    dial("127.0.0.1", opened["port"], opened["fingerprint"], "ef" * 32, "j-1", "worker").close()


def test_a_stranger_that_speaks_no_tls_is_cut_off(link: tuple[NodeListener, dict]) -> None:
    _, opened = link
    with socket.create_connection(("127.0.0.1", opened["port"]), timeout=15) as sock:
        sock.sendall(b'{"secret": "", "job": "j-1", "endpoint": "worker"}\n')
        got = b""
        try:
            while part := sock.recv(1024):  # a TLS alert at most, then the end
                got += part
        except ConnectionResetError:
            pass
        assert len(got) < 64, got


def test_a_tunnel_carrying_megabytes_both_ways_at_once_never_deadlocks(tmp_path: Path) -> None:
    """Two relays in a row (the server's, then the agent's) in front of a worker that echoes what it
    reads while the client keeps sending: every relay must read one side while the other side's
    peer is itself blocked writing, or the bytes stop for good."""
    path = str(tmp_path / "echo.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def echo() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                while part := conn.recv(1 << 20):
                    conn.sendall(part)

    def connect(job_id: str, name: str) -> Stream:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        return Stream(sock, passes_fds=False)  # relayed, as a tunnel's connection is

    threading.Thread(target=echo, daemon=True).start()
    listener = NodeListener("127.0.0.1", connect)
    stream = None
    try:
        opened = listener.open(SECRET)
        stream = dial("127.0.0.1", opened["port"], opened["fingerprint"], SECRET, "j-1", "worker")
        message = os.urandom(64 << 20)

        def send() -> None:
            with contextlib.suppress(OSError):  # a stuck tunnel: the reading side fails the test
                stream.sock.sendall(message)

        sent = threading.Thread(target=send, daemon=True)
        stream.sock.settimeout(30)  # no byte back in 30 s: the tunnel is stuck
        sent.start()
        got = bytearray()
        try:
            while len(got) < len(message) and (part := stream.sock.recv(1 << 20)):
                got += part
        except TimeoutError:
            pytest.fail(f"the tunnel stopped after echoing {len(got)} of {len(message)} bytes: a deadlock")
        sent.join(30)
        assert not sent.is_alive()
        assert hashlib.sha256(got).digest() == hashlib.sha256(message).digest()
    finally:
        if stream is not None:
            stream.close()
        listener.close()
        server.close()


@pytest.fixture
def session_worker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real session worker (``python -m gpuport.server.worker.session``) listening in ``tmp_path``."""
    env = {**os.environ, ENV_RUN_DIR: str(tmp_path), "GPUPORT_JOB_ID": "j-1"}
    process = subprocess.Popen([sys.executable, "-m", "gpuport.server.worker.session"], env=env, cwd=tmp_path)
    try:
        wait_for(lambda: (tmp_path / "worker.sock").exists() or process.poll() is not None, 60, "the worker to listen")
        assert process.poll() is None, "the session worker ended at its start"
        yield process, str(tmp_path / "worker.sock")
    finally:
        process.kill()
        process.wait()


def _ask(sock: socket.socket, header: dict, buffers: list = ()) -> wire.Frame:  # type: ignore[assignment]
    """A request as the front door sends one to a worker on another node (answered inline), and its reply."""
    wire.send(
        sock,
        {"function": "", "keep": False, "name": "", "ref_ids": [], "device": "", **header, "inline": True},
        buffers,
    )
    return wire.recv(sock)


@pytest.mark.parametrize("size", [0, 5, (4 << 20) + 1, (9 << 20) - 3])
def test_a_sessions_large_values_reach_its_worker_in_memory_it_maps_and_come_back_whole(
    session_worker: tuple[subprocess.Popen[bytes], str], size: int
) -> None:
    """The link serves a session's worker as the front door serves one on its own machine: a large value
    is received from the link into a memfd the worker maps (no copy through its socket), and a result the
    worker leaves in one goes onto the link from it; what the worker lets go of receives the next value."""
    process, path = session_worker

    def connect(job_id: str, name: str) -> Stream:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        return Stream(sock, passes_fds=True)

    listener = NodeListener("127.0.0.1", connect)
    stream = None
    try:
        opened = listener.open(SECRET)
        stream = dial("127.0.0.1", opened["port"], opened["fingerprint"], SECRET, "j-1", "worker", direct=True)
        stream.sock.settimeout(60)
        # Not a multiple of a chunk (1 MiB) nor of a TLS record (16 KiB), aturn the inline limit (4 MiB).
        large = size > 4 << 20
        kept = {}
        for turn in range(3):
            value = np.frombuffer(os.urandom(size), dtype=np.uint8)
            encoded = values.encode(value)
            reply = _ask(stream.sock, {"op": "put", "value": encoded.header.decode()}, list(encoded.buffers))
            assert "ref" in reply.header, reply.header
            kept[reply.header["ref"]["ref_id"]] = hashlib.sha256(value).hexdigest()
            maps = Path(f"/proc/{process.pid}/maps").read_text()
            assert ("memfd:gpuport-upload" in maps) == large  # large: mapped by the worker, never copied
            for ref_id, digest in kept.items():  # each kept on the node across calls, intact
                got = _ask(stream.sock, {"op": "get", "ref_ids": [ref_id]})
                assert not got.fds and "parts" not in got.header  # bytes on the link, never descriptors
                back = values.decode(got.header["value"], got.buffers)
                assert back.nbytes == size and hashlib.sha256(back).hexdigest() == digest, (turn, ref_id)
            with listener._memories_lock:
                (memory,) = [memory for memory, _ in listener._memories.values()]
            if turn == 1:  # the first value goes: its memory comes back to the link...
                first = next(iter(kept))
                assert _ask(stream.sock, {"op": "delete", "ref_ids": [first]}).header.get("values") == 1
                del kept[first]
                if large:  # (kept once the reply went)
                    wait_for(lambda m=memory: [had for _, had, _ in m.spare] == [size], 10, "the memfd back")
        assert memory.spare == []  # ... and the third value was received into it
    finally:
        if stream is not None:
            stream.close()
        listener.close()
