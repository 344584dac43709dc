"""The tunnels' byte relay (TensorFlow's remote device): a real TLS connection on 127.0.0.1 on one
side, a plain socket on the other, and the relay's thread between them."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuport.protocol.relay import relay
from gpuport.server.tls import _make_certificate


@contextlib.contextmanager
def _tunnel(
    tmp_path: Path, spin: float, replied: object = None
) -> Iterator[tuple[ssl.SSLSocket, socket.socket, threading.Thread]]:
    """(the far end of the TLS side, the far end of the plain side, the relay's thread)."""
    cert, key = _make_certificate({"127.0.0.1"})
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    calling = ssl.create_default_context(cafile=tmp_path / "cert.pem")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted: list[ssl.SSLSocket] = []
        acceptor = threading.Thread(
            target=lambda: accepted.append(serving.wrap_socket(listener.accept()[0], server_side=True))
        )
        acceptor.start()
        far_tls = calling.wrap_socket(socket.create_connection(listener.getsockname()), server_hostname="127.0.0.1")
        acceptor.join(timeout=10)
    near_plain, far_plain = socket.socketpair()
    kwargs = {"spin": spin, "replied": replied}
    thread = threading.Thread(target=relay, args=(accepted[0], near_plain), kwargs=kwargs, daemon=True)
    thread.start()
    try:
        yield far_tls, far_plain, thread
    finally:
        for end in (far_tls, far_plain):  # the relay sees them go and ends
            with contextlib.suppress(OSError):
                end.close()
        thread.join(timeout=10)
        # Only then its own ends: closed under its poll, they would vanish from it unseen.
        for end in (accepted[0], near_plain):
            end.close()


def _read(end: socket.socket, n: int) -> bytes:
    got = bytearray()
    end.settimeout(10)
    while len(got) < n:
        chunk = end.recv(n - len(got))
        assert chunk, f"the connection ended after {len(got)} of {n} bytes"
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("spin", [50e-6, 0.0], ids=["polls-after-each-message", "sleeps-at-once"])
def test_bytes_cross_both_ways_in_order_whether_the_relay_was_polling_or_asleep(tmp_path: Path, spin: float) -> None:
    with _tunnel(tmp_path, spin) as (far_tls, far_plain, _):
        for i in range(200):  # small messages, as an RPC's frames are: answered at once, inside the polling
            far_tls.sendall(b"up %d" % i)
            assert _read(far_plain, len(b"up %d" % i)) == b"up %d" % i
            far_plain.sendall(b"down %d" % i)
            assert _read(far_tls, len(b"down %d" % i)) == b"down %d" % i
        time.sleep(0.05)  # long past the polling: the relay sleeps, and the next message wakes it
        far_plain.sendall(b"after a pause")
        assert _read(far_tls, 13) == b"after a pause"
        big = os.urandom(3 * 1024 * 1024 + 17)  # larger than the relay's buffer, both ways
        sender = threading.Thread(target=far_tls.sendall, args=(big,))
        sender.start()
        assert _read(far_plain, len(big)) == big
        sender.join(timeout=10)
        far_plain.sendall(big)
        assert _read(far_tls, len(big)) == big


def test_the_relay_ends_and_shuts_the_other_side_when_one_side_closes(tmp_path: Path) -> None:
    with _tunnel(tmp_path, 50e-6) as (far_tls, far_plain, thread):
        far_tls.sendall(b"last words")
        assert _read(far_plain, 10) == b"last words"
        far_plain.close()
        thread.join(timeout=10)
        assert not thread.is_alive()
        far_tls.settimeout(10)
        with contextlib.suppress(ssl.SSLError, ConnectionResetError):  # a TLS end may close unclean
            assert far_tls.recv(100) == b""


@pytest.mark.parametrize("tls", [True, False], ids=["tls-end", "plain-ends"])
def test_replied_is_called_once_after_the_first_answer_went_on(tmp_path: Path, tls: bool) -> None:
    """A forward makes its next spare when its connection's first answer came back: the relay says
    when, once, after those bytes went on (not when the request went out)."""
    calls: list[bytes] = []
    ends: dict[str, socket.socket] = {}

    def replied() -> None:
        ends["a"].settimeout(10)
        calls.append(ends["a"].recv(100))  # the answer is there already

    def exchange(far_a: socket.socket, far_b: socket.socket) -> None:
        ends["a"] = far_a
        far_a.sendall(b"request")
        assert _read(far_b, 7) == b"request"
        time.sleep(0.1)
        assert calls == []  # a request alone is no answer
        far_b.sendall(b"answer")
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        far_b.sendall(b"more")
        assert _read(far_a, 4) == b"more"

    if tls:
        with _tunnel(tmp_path, 50e-6, replied) as (far_a, far_b, _):
            exchange(far_a, far_b)
    else:
        near_a, far_a = socket.socketpair()
        near_b, far_b = socket.socketpair()
        thread = threading.Thread(target=relay, args=(near_a, near_b), kwargs={"replied": replied}, daemon=True)
        thread.start()
        exchange(far_a, far_b)
        for end in (far_a, far_b):
            end.close()
        thread.join(timeout=10)
        for end in (near_a, near_b):
            end.close()
    assert calls == [b"answer"]
