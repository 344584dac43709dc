"""The client's side of the server's data port (``server/api/data_port.py``) for sessions: plain bytes
over TLS, each connection opened with a single-use ticket from ``Sessions.Transfer`` (a line: the
ticket and a newline). ``Transport`` owns it (``open_channel``); sessions reach the data port only
through a channel.

- A channel: a session's calls, one at a time. The server answers ``C`` to the ticket; then a call
  is a length and a serialized ``CallRequest`` out, a length, a kind and a ``CallReply`` (kind 0)
  or an error as JSON back. A large value's bytes follow its request (``Value.follows``: the
  buffers of ``sizes``, laid end to end), and a large result's follow its reply likewise when the
  request allows it (``results_follow``): a session's values take no connection of their own, and
  to a worker on another node they pass through the server as they come.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

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

    def call(
        self,
        request: pb.CallRequest,
        following: Sequence[memoryview] = (),
        advance: Callable[[int], None] | None = None,
        receiving: Callable[[int], tuple[memoryview, Any]] | None = None,
    ) -> tuple[pb.CallReply, memoryview | None]:
        """Make the call. ``following``: the value's buffers, sent after the request
        (``request.value.follows``), each slice counted by ``advance``. A result whose bytes follow
        the reply (``reply.value.follows``) is received into the memory ``receiving(total)`` gives,
        with its progress bar (``advance``, ``close``); returned beside the reply."""
        data = request.SerializeToString()
        head = bytearray(self._REPLY.size)
        received = None
        with self._lock:
            try:
                self._sock.sendall(self._LENGTH.pack(len(data)) + data)
                for buffer in following:
                    for at in range(0, buffer.nbytes, _DATA_SLICE):
                        piece = buffer[at : at + _DATA_SLICE]
                        self._sock.sendall(piece)
                        if advance is not None:
                            advance(piece.nbytes)
                recv_exact(self._sock, memoryview(head), "the server")
                size, kind = self._REPLY.unpack(head)
                body = bytearray(size)
                recv_exact(self._sock, memoryview(body), "the server")
                reply = pb.CallReply.FromString(bytes(body)) if kind == 0 else None
                if reply is not None and reply.value.follows:
                    if receiving is None:
                        raise ChannelLost  # a result this call cannot take: the channel is out of step
                    received, bar = receiving(sum(reply.value.sizes))
                    try:
                        for at in range(0, len(received), _DATA_SLICE):
                            piece = received[at : at + _DATA_SLICE]
                            recv_exact(self._sock, piece, "the server")
                            bar.advance(piece.nbytes)
                    finally:
                        bar.close()
            except (OSError, EOFError):
                raise ChannelLost from None
        if reply is not None:
            return reply, received
        error = json.loads(body)
        raise error_from_name(error["error"], error["message"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
