"""The anchor of a value put to a worker on another node and got back: raw TLS over the same two
hops, with nothing of gpuport's on the way.

    client --TLS--> forwarder (127.0.0.1, a process of its own) --TLS--> sink (127.0.0.2, another)

The sink reads SIZE bytes into one reused buffer, then sends them back (a put, then a get); the
forwarder copies each way in a thread of its own, through reused buffers. Python's ``ssl`` on every
hop, as gpuport's. ``hops(folder, size)`` starts both processes and gives a function that times one
put+get; run as a script, this file is one of the two processes.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_CHUNK = 1 << 20


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the peer closed")
        got += n


def _serving(folder: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return context


def _calling(folder: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=folder / "cert.pem")
    context.check_hostname = False  # one certificate for both addresses; pinned by its file
    return context


def _listen(host: str, folder: Path, name: str) -> socket.socket:
    listener = socket.create_server((host, 0))
    # Renamed into place: the file is looked for as the sign that the port is in it.
    (folder / f"{name}.port.new").write_text(str(listener.getsockname()[1]))
    (folder / f"{name}.port.new").rename(folder / f"{name}.port")
    return listener


def _sink(folder: Path, size: int) -> None:
    with _listen("127.0.0.2", folder, "sink") as listener:
        conn = _serving(folder).wrap_socket(listener.accept()[0], server_side=True)
    buffer = memoryview(bytearray(size))
    with contextlib.suppress(ConnectionError), conn:
        while True:
            _recv_exactly(conn, buffer)
            conn.sendall(buffer)


def _copy(source: socket.socket, target: socket.socket, size: int, buffer: memoryview) -> None:
    left = size
    while left:
        chunk = buffer[: min(left, len(buffer))]
        _recv_exactly(source, chunk)  # a whole chunk, then one write of it (not one per TLS record)
        target.sendall(chunk)
        left -= len(chunk)


def _forwarder(folder: Path, size: int) -> None:
    with _listen("127.0.0.1", folder, "forwarder") as listener:
        near = _serving(folder).wrap_socket(listener.accept()[0], server_side=True)
    port = int((folder / "sink.port").read_text())
    far = _calling(folder).wrap_socket(socket.create_connection(("127.0.0.2", port)))
    for end in (near, far):
        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # One direction at a time, as the bytes go (a put, then its get), in one thread: a TLS socket is
    # never read and written by two threads at once. Each chunk goes on as soon as it came.
    buffer = memoryview(bytearray(_CHUNK))
    with contextlib.suppress(ConnectionError), near, far:
        while True:
            _copy(near, far, size, buffer)
            _copy(far, near, size, buffer)


@contextlib.contextmanager
def hops(folder: Path, size: int) -> Iterator[Callable[[], None]]:
    """Start the sink and the forwarder (certificate and key in ``folder``); yield a put+get of
    ``size`` bytes through them. Both processes are ended, by pid, after."""
    from gpuport.server.tls import _make_certificate

    cert, key = _make_certificate({"127.0.0.1", "127.0.0.2"})
    (folder / "cert.pem").write_bytes(cert)
    (folder / "key.pem").write_bytes(key)
    started = []
    try:
        for role, wait_for in (("sink", "sink.port"), ("forwarder", "forwarder.port")):
            started.append(subprocess.Popen([sys.executable, __file__, role, str(folder), str(size)]))
            deadline = time.monotonic() + 30
            while not (folder / wait_for).exists():
                if time.monotonic() > deadline or started[-1].poll() is not None:
                    raise RuntimeError(f"the anchor's {role} did not start")
                time.sleep(0.01)
        port = int((folder / "forwarder.port").read_text())
        client = _calling(folder).wrap_socket(socket.create_connection(("127.0.0.1", port)))
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        value = memoryview(bytes(size))
        back = memoryview(bytearray(size))

        def put_get() -> None:
            client.sendall(value)  # the sink answers once it has it all
            _recv_exactly(client, back)

        with client:
            yield put_get
    finally:
        for process in started:
            process.kill()
            process.wait()


if __name__ == "__main__":
    role, where, nbytes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    sys.path.insert(0, str(Path(__file__).parent.parent))
    _sink(where, nbytes) if role == "sink" else _forwarder(where, nbytes)
