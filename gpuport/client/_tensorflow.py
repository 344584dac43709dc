"""TensorFlow's own remote device, over gpuport's authenticated TLS.

TensorFlow can run ops on another machine's devices (``tf.distribute.Server`` there,
``tf.config.experimental_connect_to_host`` here), but its server has neither authentication nor
encryption. ``gpu.tensorflow()`` opens a session (an allocation, queued like any), starts a TF
server in the session's worker bound to the worker's own loopback (its own network namespace on a
sandboxed server: no other job and no other host can reach it), and listens on a loopback port here.
Each connection TensorFlow makes to that port rides the server's data port, with a ticket for the
session's owner; the worker hands the server a connection to its TF server (a file descriptor over
its Unix socket), and the server relays the client's bytes to it.

TensorFlow's cluster addresses must agree on both ends, so the worker's server listens on the same
port number as the local end: ``127.0.0.1:PORT`` is the same "worker" to TensorFlow here and there.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gpuport.client._sessions import Session, open_session
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import ConnectionFailed, GpuportError, InvalidRequest
from gpuport.protocol.relay import relay

if TYPE_CHECKING:
    from gpuport.client._transport import Transport

JOB = "worker"
_TUNNEL = "tf"
_STATE = "__gpuport_tensorflow__"  # the worker's module holding its TF server, so that it lives on


def _start_server(port: int) -> list[str]:
    """(In the session's worker.) Start TensorFlow's server for job "worker" on 127.0.0.1:``port``
    (the worker's own loopback), and listen on ``tunnel-tf.sock`` in the session's folder: each
    connection there (the server's, for a tunnel) is handed a new connection to TensorFlow's server,
    passed as a file descriptor, so that no relay runs in the worker. Return the server's devices.
    Once per worker."""
    import os
    import sys
    import types

    state = sys.modules.get(_STATE)
    if state is not None:
        return list(state.devices)
    import tensorflow as tf

    cluster = tf.train.ClusterSpec({JOB: [f"127.0.0.1:{port}"]})
    server = tf.distribute.Server(cluster, job_name=JOB, task_index=0, protocol="grpc", start=True)
    from gpuport.protocol.sockets import listen

    listener = listen(os.environ["GPUPORT_SESSION_DIR"], f"tunnel-{_TUNNEL}.sock", backlog=64)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            with conn, contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", port)) as target:
                    target.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    socket.send_fds(conn, [b"F"], [target.fileno()])

    threading.Thread(target=accept, name="gpuport tensorflow tunnel", daemon=True).start()
    module = types.ModuleType(_STATE)
    module.server, module.listener = server, listener  # type: ignore[attr-defined]
    module.devices = [d.name.rpartition("device:")[2] for d in tf.config.list_logical_devices()]  # type: ignore[attr-defined]
    sys.modules[_STATE] = module
    return list(module.devices)  # type: ignore[attr-defined]


class RemoteTensorFlow:
    """A TensorFlow server in a session on the GPU machine, reached at ``address`` here (made by
    ``Client.tensorflow``). ``device("GPU:0")`` names one of its devices for ``tf.device`` and for
    strategies; ``devices`` lists them ("CPU:0", "GPU:0", ...). ``close()`` (or leaving the ``with``
    block) ends the session and frees its allocation."""

    def __init__(self, transport: Transport, session: Session, *, connect: bool) -> None:
        self._transport = transport
        self.session = session
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._closed = threading.Event()
        try:
            self.devices: list[str] = session.call(_start_server, self.port)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._accept, name="gpuport tensorflow tunnel", daemon=True).start()
        if connect:
            import tensorflow as tf

            tf.config.experimental_connect_to_host(self.address, job_name=JOB)

    def device(self, name: str = "CPU:0") -> str:
        """The full name of the remote device ``name`` ("GPU:0", "CPU:0"), for ``tf.device``."""
        if self.devices and name not in self.devices:
            raise InvalidRequest(f"no device {name!r} there: it has {', '.join(self.devices)}")
        return f"/job:{JOB}/replica:0/task:0/device:{name}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._tunnel, args=(conn,), name="gpuport tensorflow tunnel", daemon=True).start()

    def _tunnel(self, conn: socket.socket) -> None:
        try:
            request = pb.TransferRequest(session_id=self.session.id, tunnel=_TUNNEL)
            ticket, remote = self._transport.data_connection(request)
            if remote is None:
                raise ConnectionFailed("the server's data port cannot be reached: TensorFlow's tunnel needs it")
            remote.sendall(ticket.ticket.encode() + b"\n")
            answer = remote.recv(1)
            if answer != b"T":
                said = (answer + remote.recv(300)).decode(errors="replace")[1:].strip()
                remote.close()
                raise ConnectionFailed(f"the server refused TensorFlow's tunnel: {said}")
        except (GpuportError, OSError):
            conn.close()
            return
        relay(conn, remote)
        with contextlib.suppress(OSError):
            remote.close()
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.session.close()

    def __enter__(self) -> RemoteTensorFlow:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RemoteTensorFlow {self.address} in session {self.session.id}>"


def open_remote(transport: Transport, connect: bool, **allocation: Any) -> RemoteTensorFlow:
    """A session with ``allocation``, and TensorFlow's server started in it (see ``Client.tensorflow``)."""
    session = open_session(transport, **allocation)
    try:
        return RemoteTensorFlow(transport, session, connect=connect)
    except BaseException:
        session.close()
        raise
