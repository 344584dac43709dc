"""A byte relay between two sockets, for tunnels: the data port's side and the client's side."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl

_CHUNK = 1024 * 1024


def relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` (TLS or plain) and ``b`` in this one thread, until either
    side closes; then shut both down. One thread: a TLS socket is never read and written at once."""
    try:
        while True:
            pending = isinstance(a, ssl.SSLSocket) and a.pending()
            ready = [a] if pending else select.select([a, b], [], [])[0]
            for source in ready:
                data = source.recv(_CHUNK)
                if not data:
                    return
                (b if source is a else a).sendall(data)
    except (OSError, ValueError):
        return  # either side went away: the tunnel is over
    finally:
        for end in (a, b):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
