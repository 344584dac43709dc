"""The link from the server to a node, for byte streams to workers there (``Executor.connect``).

One TLS listener per node (``NodeListener``) on the node's address: in the agent of a Ray node
(``ray_agent.py``), and in a Slurm job whose workers the server talks to, inside its allocation
(``slurm_link.py``). Its certificate is made there and never leaves the node: the server pins its
fingerprint, as a client pins the server's. The server gives the listener a secret (Ray: by a Ray
call, Ray's own authenticated channel; Slurm: a file of the job's folder, read and removed before
the job runs), which the listener then asks of every connection. A connection (``dial``) says in a
small header the secret, a job id and an endpoint name; the listener connects to that job's worker
endpoint exactly as the local executor does (``connect_endpoint``: the socket must be one of the
job's processes'), answers ok or the error, then relays bytes both ways; to a session's worker it
carries frames instead, handing the worker its large values in memfds as the front door does on its
own machine (``node_values.py``). Values cross the link itself as bytes.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuport.protocol.errors import InvalidRequest
from gpuport.protocol.relay import relay
from gpuport.protocol.sockets import recv_exact
from gpuport.protocol.tls import fingerprint, wrap_socket
from gpuport.server.executors.base import Stream, handed_over
from gpuport.server.executors.node_values import serve_worker
from gpuport.server.memfds import SessionMemory

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_MAX_MESSAGE = 4096  # bytes of a header or an answer
_HANDSHAKE_TIMEOUT = 10.0  # seconds for a connection's TLS handshake and header
_DIAL_TIMEOUT = 10.0  # seconds for the server to reach a node's agent and hear its answer
_KEEPALIVE_IDLE = 10  # seconds a link is idle before the server probes whether its node is there
_KEEPALIVE_EVERY = 5  # seconds between unanswered probes (3 of them: the node is gone)
# What an agent's answer may name, as the executor seam raises it; anything else is InvalidRequest.
_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "ConnectionError": ConnectionError,
    "PermissionError": PermissionError,
}


class LinkError(ConnectionError):
    """The link to a node's agent failed (unreachable, not the pinned agent, the secret refused):
    not an answer about the worker."""


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv(sock: socket.socket, peer: str) -> dict[str, Any]:
    prefix = bytearray(_LENGTH.size)
    recv_exact(sock, memoryview(prefix), peer)
    (size,) = _LENGTH.unpack(prefix)
    if size > _MAX_MESSAGE:
        raise EOFError(f"{peer} sent a message of {size} bytes: not a gpuport link")
    body = bytearray(size)
    recv_exact(sock, memoryview(body), peer)
    message = json.loads(body)
    return message if isinstance(message, dict) else {}  # then no secret, no ok: refused


# ---- on the node ------------------------------------------------------------------------------------


def node_endpoint(stream: Stream, name: str) -> Stream:
    """A worker's endpoint ``stream`` as the link relays it: a tunnel's connection (``tunnel-*``) taken
    over here, where the worker can pass it (a descriptor does not cross the link)."""
    if not name.startswith("tunnel-"):
        return stream
    return Stream(handed_over(stream, name), passes_fds=False)


class NodeListener:
    """The node's TLS listener: connections that bring the secret reach ``connect(job_id, name)``."""

    def __init__(self, address: str, connect: Callable[[str, str], Stream]) -> None:
        from gpuport.server.tls import link_certificate

        cert_pem, key_pem = link_certificate(address)
        self.fingerprint = fingerprint(cert_pem)
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.minimum_version = ssl.TLSVersion.TLSv1_2
        with tempfile.TemporaryDirectory() as folder:  # read once into the context, then gone
            cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            cert.write_bytes(cert_pem)
            key.write_bytes(key_pem)
            self._context.load_cert_chain(cert, key)
        self._connect = connect
        self._secret = b""
        # A session's memory for large values, shared by its connections: (memory, connections open).
        self._memories: dict[str, tuple[SessionMemory, int]] = {}
        self._memories_lock = threading.Lock()
        self._sock = socket.create_server((address, 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="link listener", daemon=True).start()

    def open(self, secret: str) -> dict[str, Any]:
        """Take ``secret`` as the one connections must bring (the last server's stops working)."""
        self._secret = bytes.fromhex(secret)
        return {"port": self.port, "fingerprint": self.fingerprint}

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="link", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        worker: Stream | None = None
        tls: socket.socket = conn  # the TLS socket takes the connection over once made
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT)
            tls = wrap_socket(self._context, conn, server_side=True)
            header = _recv(tls, "the server")
            secret = bytes.fromhex(str(header.get("secret", "")))
            if not self._secret or not hmac.compare_digest(secret, self._secret):
                log.warning("a connection to this node's gpuport link brought a wrong secret: refused")
                return
            try:
                worker = self._connect(str(header.get("job", "")), str(header.get("endpoint", "")))
            except ValueError as e:  # not an endpoint's name
                _send(tls, {"error": "InvalidRequest", "message": str(e)})
                return
            except OSError as e:
                kind = next((name for name, error in _ERRORS.items() if isinstance(e, error)), "ConnectionError")
                _send(tls, {"error": kind, "message": str(e)})
                return
            _send(tls, {"ok": True})
            tls.settimeout(None)
            job, name = str(header.get("job", "")), str(header.get("endpoint", ""))
            if name == "worker" and worker.passes_fds:  # a session's worker: its frames, values in memfds
                with self._memory(job) as memory:
                    serve_worker(tls, worker.sock, memory)
            else:
                relay(tls, worker.sock)
        except (OSError, ValueError, EOFError) as e:
            log.debug("a link connection ended: %s", e)
        finally:
            if worker is not None:
                worker.close()
            tls.close()

    @contextlib.contextmanager
    def _memory(self, job_id: str) -> Iterator[SessionMemory]:
        """The memory of job ``job_id``'s session while a connection to its worker is open; freed
        when its last one closes (the worker ended, or the server let go of it)."""
        with self._memories_lock:
            memory, count = self._memories.get(job_id, (SessionMemory(), 0))
            self._memories[job_id] = (memory, count + 1)
        try:
            yield memory
        finally:
            with self._memories_lock:
                memory, count = self._memories.pop(job_id)
                if count > 1:
                    self._memories[job_id] = (memory, count - 1)
            if count == 1:
                memory.drop_spare()

    def close(self) -> None:
        self._sock.close()


# ---- on the server ---------------------------------------------------------------------------------


def dial(address: str, port: int, pinned: str, secret: str, job_id: str, name: str, direct: bool = False) -> Stream:
    """A byte stream to the endpoint ``name`` of job ``job_id``'s worker, through the agent listening
    at ``address:port`` whose certificate has the fingerprint ``pinned``. Raises what the agent
    answers (``FileNotFoundError`` and ``ConnectionError`` while the worker starts, ``PermissionError``,
    ``InvalidRequest``), ``LinkError`` when the agent cannot be reached, is not the pinned one or
    refuses the secret.

    The stream is a local socket, relayed to the TLS link by a thread of its own: a session's
    connection sends frames with ``sendmsg``, which a TLS socket has not, and its event loop waits on
    the socket, which a TLS socket's buffered bytes would fool. ``direct``: the TLS socket itself,
    for a caller that only reads and writes it, blocking (a data-port channel's thread)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # the pinned certificate is the only one trusted: names do not matter
    context.verify_mode = ssl.CERT_NONE
    where = f"the gpuport agent at {address}:{port}"
    try:
        raw = socket.create_connection((address, port), timeout=_DIAL_TIMEOUT)
    except OSError as e:
        raise LinkError(f"cannot reach {where}: {e}") from None
    _keep_alive(raw)
    tls: socket.socket = raw  # the TLS socket takes the connection over once made
    try:
        tls = wrap_socket(context, raw)
        seen = fingerprint(tls.getpeercert(binary_form=True) or b"")
        if not hmac.compare_digest(seen, pinned):
            raise LinkError(f"{where} is not the node's agent (certificate {seen}, expected {pinned})")
        _send(tls, {"secret": secret, "job": job_id, "endpoint": name})
        answer = _recv(tls, where)
    except LinkError:
        tls.close()
        raise
    except (OSError, EOFError, ValueError) as e:
        tls.close()
        raise LinkError(f"the link to {where} failed: {e}") from None
    except BaseException:
        tls.close()
        raise
    if not answer.get("ok"):
        tls.close()
        raise _ERRORS.get(str(answer.get("error")), InvalidRequest)(str(answer.get("message", "refused")))
    tls.settimeout(None)
    if direct:
        tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Stream(tls, passes_fds=False)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    threading.Thread(target=_relay, args=(tls, theirs), name=f"link {job_id}/{name}", daemon=True).start()
    return Stream(ours, passes_fds=False)


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle link, so that a node that vanished (no FIN: its machine went) ends the call
    waiting on it within about ``_KEEPALIVE_IDLE + 3 * _KEEPALIVE_EVERY`` seconds instead of never."""
    with contextlib.suppress(OSError, AttributeError):  # the TCP_KEEP* options are Linux's
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_EVERY)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _relay(tls: socket.socket, local: socket.socket) -> None:
    try:
        relay(tls, local)
    finally:
        for end in (tls, local):
            with contextlib.suppress(OSError):
                end.close()
