"""The data port: a session's large values as plain bytes over TLS, beside gRPC.

gRPC in Python moved 0.38 GB/s on this project's 2-core test VM where a TLS socket moved 0.6–1.3
GB/s (protobuf copies every chunk twice, and the event loop sees each one), and sessions exist to
move arrays. So a
value past ``SESSION_INLINE_BYTES`` goes here instead: the client asks for a ticket over gRPC
(``Sessions.Transfer``, authenticated like any call), connects, sends the ticket (64 hex digits and a
newline) and then the bytes, received straight into the memfd the worker will map; or it receives
the bytes of a staged result, sent straight from the worker's memory. An upload is answered with one
byte, ``K``, once every byte has arrived. A connection with a bad ticket is answered ``E`` and the
reason, and closed. Same certificate, same cipher as the gRPC port; one thread per transfer.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import ssl
import threading
from pathlib import Path

from gpuport.protocol.errors import ConfigError
from gpuport.server.services.sessions import Staging

log = logging.getLogger(__name__)

_TICKET_LINE = 65  # 64 hex digits and "\n"
_HANDSHAKE_TIMEOUT = 10.0
_IDLE_TIMEOUT = 60.0  # seconds a transfer may stall before the server gives up on it
_SLICE = 16 * 1024 * 1024  # bytes per send or receive call


class DataPort:
    def __init__(self, staging: Staging, host: str, port: int, cert: Path | None, key: Path | None) -> None:
        self.staging = staging
        self._context: ssl.SSLContext | None = None
        if cert is not None and key is not None:
            self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._context.load_cert_chain(cert, key)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as e:
            self._listener.close()
            raise ConfigError(
                f"cannot listen for data on {host}:{port}: {e.strerror} — is another server using it? "
                "pick another --data-port"
            ) from None
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._accept, name="gpuport data port", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), name="gpuport transfer", daemon=True).start()

    def _serve(self, raw: socket.socket, peer: object) -> None:
        conn: socket.socket = raw
        try:
            raw.settimeout(_HANDSHAKE_TIMEOUT)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                conn = self._context.wrap_socket(raw, server_side=True)
            line = _read_line(conn)
            found = self.staging.redeem(line.decode("ascii", "replace").strip())
            if found is None:
                conn.sendall(b"Ethis ticket is unknown, used or expired: ask for another with Sessions.Transfer\n")
                return
            key, kind, staged = found
            conn.settimeout(_IDLE_TIMEOUT)
            if kind == "upload":
                fd, _, size = staged.parts[0]
                if size:
                    with mmap.mmap(fd, size) as mapped:
                        view = memoryview(mapped)
                        try:
                            _receive(conn, view)
                        finally:
                            view.release()
                staged.complete = True
                conn.sendall(b"K")
            else:
                views = staged.views()
                try:
                    for _, view in views:
                        for at in range(0, len(view), _SLICE):
                            conn.sendall(view[at : at + _SLICE])
                finally:
                    for mapped, view in views:
                        view.release()
                        mapped.close()
                    staged.close()
        except (OSError, EOFError, ValueError) as e:
            log.info("a transfer from %s failed: %s", peer, e)
        finally:
            with contextlib.suppress(OSError):
                conn.close()


def _read_line(conn: socket.socket) -> bytes:
    data = bytearray()
    while len(data) < _TICKET_LINE:
        chunk = conn.recv(_TICKET_LINE - len(data))
        if not chunk:
            raise EOFError("the client closed the connection before sending its ticket")
        data += chunk
    return bytes(data)


def _receive(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got : got + _SLICE])
        if not n:
            raise EOFError(f"the client closed the connection after {got} of {len(view)} bytes")
        got += n
