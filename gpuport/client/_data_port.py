"""The client's side of the server's data port (``server/api/data_port.py``) for sessions: plain bytes
over TLS, each connection opened with a single-use ticket from ``Sessions.Transfer`` (a line: the
ticket and a newline). ``Transport`` owns it (``open_channel``, ``send_value``, ``receive_value``);
sessions reach the data port only through those.

- A channel: a session's calls, one at a time. The server answers ``C`` to the ticket; then a call
  is a length and a serialized ``CallRequest`` out, a length, a kind and a ``CallReply`` (kind 0)
  or an error as JSON back.
- An upload: the value's bytes after the ticket; the server answers ``K`` once all arrived.
- A download: the staged result's bytes after the ticket, or ``E`` and a message line.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import ConnectionFailed, error_from_name
from gpuport.protocol.sockets import recv_exact

if TYPE_CHECKING:
    from gpuport.client._transport import Transport

_DATA_SLICE = 1024 * 1024  # bytes per send or receive call on the data port


def open_channel(transport: Transport, session_id: str) -> Channel | None:
    """A new channel for session ``session_id``'s calls, or None without a data port (gRPC then)."""
    if not transport.data_port:
        return None
    ticket, connection = transport.data_connection(pb.TransferRequest(session_id=session_id, channel=True))
    return Channel(connection, ticket.ticket) if connection is not None else None


def send_value(
    transport: Transport, session_id: str, buffers: Sequence[memoryview], total: int, advance: Callable[[int], None]
) -> str | None:
    """Upload a value's ``buffers`` (``total`` bytes) for a call of session ``session_id``; its staged
    key, or None without a data port (gRPC then). Raises ``ConnectionFailed``."""
    if not transport.data_port:
        return None
    ticket, connection = transport.data_connection(pb.TransferRequest(session_id=session_id, size=total))
    if connection is None:
        return None
    try:
        with connection:
            connection.sendall(ticket.ticket.encode() + b"\n")
            for buffer in buffers:
                flat = buffer.cast("B") if buffer.ndim != 1 or buffer.format != "B" else buffer
                for at in range(0, flat.nbytes, _DATA_SLICE):
                    piece = flat[at : at + _DATA_SLICE]
                    connection.sendall(piece)
                    advance(piece.nbytes)
            answer = connection.recv(1)
    except OSError as e:
        raise ConnectionFailed(f"sending a value to the server's data port failed: {e}") from None
    if answer != b"K":
        raise ConnectionFailed("the server's data port did not confirm the upload; try again")
    return ticket.staged


def receive_value(
    transport: Transport, session_id: str, staged: str, view: memoryview, advance: Callable[[int], None]
) -> bool:
    """Receive session ``session_id``'s staged result ``staged`` into ``view``; False without a data
    port (gRPC then). Raises ``ConnectionFailed``."""
    if not transport.data_port:
        return False
    ticket, connection = transport.data_connection(pb.TransferRequest(session_id=session_id, staged=staged))
    if connection is None:
        return False
    got = 0
    try:
        with connection:
            connection.sendall(ticket.ticket.encode() + b"\n")
            while got < len(view):
                n = connection.recv_into(view[got : got + _DATA_SLICE])
                if not n:
                    break
                if got == 0 and view[0:1] == b"E" and n < 200 and bytes(view[n - 1 : n]) == b"\n":
                    raise ConnectionFailed(f"the server's data port refused: {bytes(view[1:n]).decode().strip()}")
                got += n
                advance(n)
    except OSError as e:
        raise ConnectionFailed(f"receiving a value from the server's data port failed: {e}") from None
    if got != len(view):
        raise ConnectionFailed(f"the server's data port sent {got} of {len(view)} bytes; try again")
    return True


class ChannelLost(Exception):
    """The channel's connection broke during a call: the call may or may not have run."""


class Channel:
    """A session's calls over one data-port connection (see server/api/data_port.py): a length and
    a serialized ``CallRequest`` out, a length, a kind and a ``CallReply`` (or an error) back."""

    _LENGTH = struct.Struct("<I")
    _REPLY = struct.Struct("<IB")

    def __init__(self, sock: socket.socket, ticket: str) -> None:
        self._sock = sock
        self._lock = threading.Lock()  # one call at a time, whichever thread makes it
        try:
            sock.sendall(ticket.encode() + b"\n")
            answer = sock.recv(1)
        except OSError as e:
            sock.close()
            raise ConnectionFailed(f"opening a channel on the server's data port failed: {e}") from None
        if answer != b"C":
            rest = b""
            with contextlib.suppress(OSError):
                rest = sock.recv(200)
            sock.close()
            raise ConnectionFailed(
                f"the server's data port refused the channel: {(answer + rest)[1:].decode().strip()}"
            )

    def idle_and_closed(self) -> bool:
        """Whether the server closed the channel while no call was on it (it sends nothing unasked)."""
        with self._lock:
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
            except (OSError, ValueError):
                return True
            return bool(readable)

    def call(self, request: pb.CallRequest) -> pb.CallReply:
        data = request.SerializeToString()
        head = bytearray(self._REPLY.size)
        with self._lock:
            try:
                self._sock.sendall(self._LENGTH.pack(len(data)) + data)
                recv_exact(self._sock, memoryview(head), "the server")
                size, kind = self._REPLY.unpack(head)
                body = bytearray(size)
                recv_exact(self._sock, memoryview(body), "the server")
            except (OSError, EOFError):
                raise ChannelLost from None
        if kind == 0:
            return pb.CallReply.FromString(bytes(body))
        error = json.loads(body)
        raise error_from_name(error["error"], error["message"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
