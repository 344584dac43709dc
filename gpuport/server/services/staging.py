"""Staging: a session's values on their way between a client and its worker, held in memory the
worker maps (memfds), and the data port's single-use tickets that name them.

``Staging`` keeps the staged values of every session and the tickets handed out for them (and for a
session's channel, a worker's tunnel, a blob upload, a forward); the data port's threads redeem the
tickets. ``SessionMemory`` (``server/memfds.py``, shared with a node's agent) keeps, per session, the
memory its worker let go of and the server's maps of it, so that the next large value costs no new
pages. The session's lifecycle (its worker, its calls, its end) is ``sessions.py``'s.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil

from gpuport.protocol.errors import AuthenticationError, InvalidRequest, ResourceUnavailable
from gpuport.protocol.sockets import recv_exact
from gpuport.protocol.units import format_size
from gpuport.server.memfds import SessionMemory  # noqa: F401 - a session's, here with its staging
from gpuport.server.services.auth import Identity
from gpuport.server.worker import wire

STAGED_TTL = 600.0  # seconds an upload waits for its call, or a result for its download
_TICKET_TTL = 60.0  # seconds a data-port ticket stays valid
# Seconds a forward's ticket stays valid after its last use: it is good for every connection through
# the forward (one Jobs.Reach per forward, not per connection), until its owner's token is revoked.
_FORWARD_TICKET_TTL = 600.0


@dataclass
class Staged:
    """Bytes in memory between the client and a worker: an upload on its way to a call, or a result
    on its way to the client. ``parts`` are (descriptor, offset, size), laid end to end."""

    owner: str
    session_id: str
    parts: list[tuple[int, int, int]]
    size: int
    created: float = field(default_factory=time.monotonic)
    mapped: mmap.mmap | None = None  # an upload's memory, mapped here (writable)
    borrow: Callable[[int], mmap.mmap | None] | None = None  # a result's: the session's map of a memfd

    def close(self) -> None:
        for fd in {fd for fd, _, _ in self.parts}:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None

    def views(self) -> list[tuple[mmap.mmap | None, memoryview]]:
        """Each part's bytes, and the map made for them here (close it after use; None: a map the
        session keeps, of the upload whose memory this is)."""
        out: list[tuple[mmap.mmap | None, memoryview]] = []
        for fd, offset, size in self.parts:
            if not size:
                continue
            kept = self.borrow(fd) if self.borrow is not None else None
            if kept is not None and offset + size <= len(kept):
                out.append((None, memoryview(kept)[offset : offset + size]))
                continue
            if not wire.hold_size(fd):
                raise ValueError("the worker's memory for a value could be cut under the server: not read")
            if offset < 0 or size < 0 or os.fstat(fd).st_size < offset + size:
                raise ValueError("the worker named bytes past the end of its memory")
            # Populated at once: faulting a GiB in page by page costs more than the mapping saves.
            mapped = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | wire.POPULATE, prot=mmap.PROT_READ)
            out.append((mapped, memoryview(mapped)[offset : offset + size]))
        return out

    @contextlib.contextmanager
    def read_once(self) -> Iterator[list[memoryview]]:
        """Each part's bytes (``views``), for sending it once: the views and the maps made for them
        are released afterwards, and this value closed."""
        views = self.views()
        try:
            yield [view for _, view in views]
        finally:
            for mapped, view in views:
                view.release()
                if mapped is not None:
                    mapped.close()
            self.close()

    def inodes(self) -> set[int]:
        out = set()
        for fd, _, _ in self.parts:
            with contextlib.suppress(OSError):
                out.add(os.fstat(fd).st_ino)
        return out


@dataclass(frozen=True)
class Redeemed:
    """What a data-port ticket was for: a channel for the calls of session ``key`` by ``caller``, a
    tunnel to its worker, blobs, a forward to a job or a command in it."""

    key: str
    kind: str  # channel, tunnel:NAME, blobs, forward:PORT, exec
    caller: Identity | None = None
    revocations: int = 0  # the caller's revocations when it was redeemed (see Staging.revocations)


class Staging:
    """The staged values of every session, by key; shared with the data port's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, Staged] = {}
        # ticket → (key, "channel" | "tunnel:NAME" | "blobs" | "forward:PORT" | "exec", expiry, caller)
        self._tickets: dict[str, tuple[str, str, float, Identity | None]] = {}
        # The tickets of revoked tokens, until they would have expired: ticket → (name, expiry), so that
        # presenting one is refused with the reason, not as an unknown ticket.
        self._revoked: dict[str, tuple[str, float]] = {}
        self._revocations: dict[str, int] = {}  # name → how many times their token was revoked

    def add(self, staged: Staged, prefix: str) -> str:
        key = prefix + secrets.token_hex(8)
        with self._lock:
            self._items[key] = staged
        return key

    def take(self, key: str) -> Staged | None:
        with self._lock:
            return self._items.pop(key, None)

    def peek(self, key: str) -> Staged | None:
        with self._lock:
            return self._items.get(key)

    def ticket(self, key: str, kind: str, caller: Identity) -> str:
        ticket = secrets.token_hex(32)
        lasts = _FORWARD_TICKET_TTL if kind.startswith("forward:") else _TICKET_TTL
        with self._lock:
            self._tickets[ticket] = (key, kind, time.monotonic() + lasts, caller)
        return ticket

    def forget(self, name: str) -> None:
        """``name``'s token was revoked: refuse the tickets handed to them that are not redeemed yet,
        and free what they uploaded (through gRPC) that no call took yet."""
        doomed: list[Staged] = []
        with self._lock:
            self._revocations[name] = self._revocations.get(name, 0) + 1
            for ticket, (_, _, expiry, caller) in list(self._tickets.items()):
                if caller is not None and caller.name == name:
                    del self._tickets[ticket]
                    self._revoked[ticket] = (name, expiry)
            # Their uploads that arrived whole (one still arriving ends with its stream).
            for key in [k for k, v in self._items.items() if k.startswith("u-") and v.owner == name]:
                doomed.append(self._items.pop(key))
        for staged in doomed:
            staged.close()

    def revocations(self, name: str) -> int:
        """How many times ``name``'s token was revoked: a transfer redeemed before a revocation it
        did not see (``Redeemed.revocations``) must not start."""
        with self._lock:
            return self._revocations.get(name, 0)

    def redeem(self, ticket: str) -> Redeemed | None:
        """What a ticket is for (once: a ticket is used up; a forward's, ``forward:PORT``, again and
        again, each use keeping it for ``_FORWARD_TICKET_TTL`` more), or None for an unknown, used or
        expired one. Raises ``AuthenticationError`` for a ticket whose token was revoked since it was
        handed out."""
        with self._lock:
            found = self._tickets.pop(ticket, None)
            if found is not None and found[1].startswith("forward:") and found[2] >= time.monotonic():
                self._tickets[ticket] = (*found[:2], time.monotonic() + _FORWARD_TICKET_TTL, found[3])
            if found is None or found[2] < time.monotonic():
                revoked = self._revoked.pop(ticket, None)
                if revoked is not None and revoked[1] >= time.monotonic():
                    raise AuthenticationError(
                        f"this ticket was handed to '{revoked[0]}', whose token has been revoked since: "
                        "nothing was transferred — log in with a valid token and try again"
                    )
                return None
            key, kind, _, caller = found
            revocations = self._revocations.get(caller.name, 0) if caller is not None else 0
        return Redeemed(key, kind, caller, revocations)

    def holds(self, inode: int) -> bool:
        """Whether a staged value lies in the memfd ``inode`` (a result on its way out of it)."""
        with self._lock:
            items = list(self._items.values())
        return any(inode in staged.inodes() for staged in items)

    def drop(self, session_id: str | None = None, older_than: float | None = None) -> None:
        """Free the staged values of a session, or those older than ``older_than`` seconds."""
        now = time.monotonic()
        with self._lock:
            doomed = [
                key
                for key, staged in self._items.items()
                if (session_id is None or staged.session_id == session_id)
                and (older_than is None or now - staged.created > older_than)
            ]
            gone = [self._items.pop(key) for key in doomed]
            self._tickets = {t: v for t, v in self._tickets.items() if v[2] >= now}
            self._revoked = {t: v for t, v in self._revoked.items() if v[1] >= now}
        for staged in gone:
            staged.close()


def check_size(size: int) -> None:
    """Refuse an upload of ``size`` bytes that is negative or does not fit in the server's memory."""
    if size < 0:
        raise InvalidRequest(f"upload size {size} is negative")
    available = psutil.virtual_memory().available
    if size > available:
        raise ResourceUnavailable(
            f"a value of {format_size(size)} does not fit in the server's memory ({format_size(available)} "
            "available): send it in parts"
        )


@dataclass
class Direct:
    """A data-port channel's own connection to a session's worker, used by the channel's thread only."""

    session_id: str
    sock: socket.socket | None = None
    job_id: str = ""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


_PASS_CHUNK = 1024 * 1024  # bytes read, then written on, at a time when a value passes through


class ClientGone(Exception):
    """The client of a data-port channel went away, or broke off a value it was sending: the
    channel is out of step and ends."""


@dataclass
class Following:
    """A call's value whose bytes follow its request on a data-port channel (``conn``): the call
    takes them as it needs them, passed on as they come or received into memory; whatever it left
    is read and dropped after it (``drain``), so that the channel's next call starts where it should."""

    conn: socket.socket
    size: int
    taken: int = 0

    def into(self, view: memoryview) -> None:
        """Receive the value's next ``len(view)`` bytes into ``view``."""
        at = 0
        while at < len(view):
            at += self._recv(view[at : at + _PASS_CHUNK])

    def pass_to(self, target: socket.socket) -> None:
        """Send the value's bytes on to ``target`` as they come, never all held. Raises OSError when
        ``target`` failed (the rest drained from the client first), ``ClientGone`` when the client did."""
        buffer = memoryview(bytearray(min(_PASS_CHUNK, self.size - self.taken) or 1))
        while self.taken < self.size:
            chunk = buffer[: self.size - self.taken]
            self.into(chunk)  # a whole chunk (TLS gives a record, 16 KiB, a read): one write of it on
            try:
                target.sendall(chunk)
            except OSError:
                self.drain()
                raise

    def drain(self) -> None:
        """Read and drop what is left of the value."""
        buffer = memoryview(bytearray(min(_PASS_CHUNK, self.size - self.taken) or 1))
        while self.taken < self.size:
            self._recv(buffer[: self.size - self.taken])

    def _recv(self, view: memoryview) -> int:
        try:
            n = self.conn.recv_into(view)
        except OSError as e:
            raise ClientGone(f"the client's channel failed while it sent a value: {e}") from None
        if not n:
            raise ClientGone(f"the client closed its channel after {self.taken} of a value's {self.size} bytes")
        self.taken += n
        return n


def pass_on(source: socket.socket, target: socket.socket, size: int) -> None:
    """Send ``size`` bytes from ``source`` on to ``target`` as they come (a result on its way from a
    worker to a client). Raises ``EOFError``/OSError as either side fails."""
    buffer = memoryview(bytearray(min(_PASS_CHUNK, size) or 1))
    left = size
    while left:
        chunk = buffer[: min(left, len(buffer))]
        recv_exact(source, chunk, f"the worker (with {left} bytes of a result of {size} to come)")
        target.sendall(chunk)
        left -= len(chunk)
