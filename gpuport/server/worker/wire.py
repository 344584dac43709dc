"""Frames between the server and a session's worker, over the worker's Unix socket.

A frame is a fixed prefix (header length, inline bytes), a JSON header and the inline buffers laid
end to end; file descriptors (memfds holding large buffers) ride along with the prefix as
``SCM_RIGHTS``. The header is JSON on purpose: the worker runs the user's code, so the server never
unpickles anything the worker sends. Each side reads exactly one frame's bytes at a time, so the
descriptors of a frame always arrive with its own prefix.

The worker's side (``send``/``recv``) blocks, as do the server's data-port channels (``connect``); the
server's own connection (``Link``) runs on the event loop. A worker answers each of its connections,
one request at a time.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gpuport.protocol.sockets import (
    listen,  # noqa: F401 - re-exported: the workers make their endpoints with it
    recv_exact,
)

if TYPE_CHECKING:
    import asyncio

# asyncio, ssl and tempfile are imported where they are used: a session worker, which imports this
# module first thing, needs none of them (45 ms of its start on a 2-core VM).


def _is_tls(sock: socket.socket) -> bool:
    """Whether ``sock`` is a TLS socket: never, where nothing imported ``ssl``."""
    ssl = sys.modules.get("ssl")
    return ssl is not None and isinstance(sock, ssl.SSLSocket)


_PREFIX = struct.Struct("<IQ")  # header bytes, inline buffer bytes
_MAX_HEADER = 64 * 1024 * 1024
_MAX_FDS = 16
_GATHER = 64  # buffers handed to one sendmsg at most (the system allows 1,024)
_JOIN_BYTES = 64 * 1024  # a frame up to this size goes over TLS joined, in one record
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)

Buffer = bytes | bytearray | memoryview


class Frame:
    __slots__ = ("buffers", "fds", "header")

    def __init__(self, header: dict[str, Any], buffers: list[memoryview], fds: list[int]) -> None:
        self.header = header
        self.buffers = buffers  # inline buffers, split by header["sizes"]
        self.fds = fds  # received descriptors: the receiver owns (and closes) them


def _encode(header: dict[str, Any], buffers: Sequence[Buffer]) -> tuple[bytes, int]:
    sizes = [memoryview(b).nbytes for b in buffers]
    head = json.dumps({**header, "sizes": sizes}, separators=(",", ":")).encode()
    total = sum(sizes)
    return _PREFIX.pack(len(head), total) + head, total


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array("i")
            ints.frombytes(data[: len(data) - len(data) % ints.itemsize])
            fds.extend(ints)
    return fds


def _sizes(prefix: bytearray) -> tuple[int, int]:
    """A frame's header and inline sizes, from its prefix."""
    head_size, total = _PREFIX.unpack(prefix)
    if head_size > _MAX_HEADER:
        raise EOFError(f"a frame header of {head_size} bytes: the stream is corrupt")
    return head_size, total


def _frame(body: memoryview, head_size: int, fds: list[int]) -> Frame:
    header = json.loads(bytes(body[:head_size]))
    return Frame(header, split(header, body[head_size:]), fds)


def split(header: dict[str, Any], data: memoryview) -> list[memoryview]:
    """A frame's buffers, laid end to end in ``data``, by the ``sizes`` its header names (taken out of it)."""
    out, at = [], 0
    for size in header.pop("sizes", []):
        out.append(data[at : at + size])
        at += size
    return out


# Pages mapped at once rather than faulted in one by one as bytes arrive (where the system has it).
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def memory_file(size: int, name: str = "gpuport-value") -> int:
    """A descriptor of ``size`` bytes of memory: a memfd (an unlinked temp file where there is none),
    which can be sealed (``hold_size``)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    else:  # pragma: no cover - not Linux
        import tempfile

        fd, path = tempfile.mkstemp(prefix=name)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold_size(fd: int) -> bool:
    """Seal the memfd ``fd`` against shrinking, so that no process holding it (a worker runs its
    user's code) can cut it under a map of it: a read or write past a shrunk file's end is SIGBUS,
    which would end the server. False where it cannot be (not a memfd, one made without sealing, or
    sealed against more seals): the server maps no such memory of a worker's. It may still grow."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except (OSError, AttributeError):  # AttributeError: a system without seals
        return False
    return True


def staging_file(size: int, name: str = "gpuport-value") -> tuple[int, mmap.mmap | None]:
    """A ``memory_file`` and a writable map of it (None for 0 bytes)."""
    fd = memory_file(size, name)
    try:
        return fd, (mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE) if size else None)
    except BaseException:
        os.close(fd)
        raise


def map_file(fd: int, size: int) -> memoryview:
    """The ``size`` bytes behind ``fd``, mapped (shared, writable); the map outlives the descriptor."""
    if not size:
        return memoryview(b"")
    return memoryview(mmap.mmap(fd, size))


@contextlib.contextmanager
def _reachable(path: str) -> Iterator[str]:
    """An address for the socket at ``path``: a Unix socket's may have at most 107 bytes, so a longer
    one goes through a descriptor of its folder, open while the address is used."""
    if len(os.fsencode(path)) < 100 or not os.path.isdir("/proc/self/fd"):
        yield path
        return
    folder, name = os.path.split(path)
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder_fd}/{name}"
    finally:
        os.close(folder_fd)


# ---- blocking: the worker's side, and the server's data-port channels ------------------------------


def connect(path: str, peer: Callable[[int], bool]) -> socket.socket:
    """A blocking connection to the worker listening at ``path``, whose pid ``peer`` accepts."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _reachable(path) as address:
            sock.connect(address)
        _check_peer(sock, path, peer)
    except BaseException:
        sock.close()
        raise
    return sock


def _check_peer(sock: socket.socket, path: str, peer: Callable[[int], bool]) -> None:
    """Refuse a socket that is not the worker's: the folder it lies in is the job's to write, so a
    job could put a link there to another worker's socket (the server would follow it)."""
    pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    if not peer(pid):
        raise PermissionError(f"{path} is not the worker's socket (process {pid} listens on it)")


def _parts(prefix: bytes, buffers: Sequence[Buffer]) -> list[memoryview]:
    parts = [memoryview(prefix)]
    for b in buffers:
        view = memoryview(b)
        if view.nbytes:
            parts.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return parts


def _rest(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``parts`` once ``sent`` bytes of them went."""
    for i, part in enumerate(parts):
        if sent < part.nbytes:
            return [part[sent:], *parts[i + 1 :]]
        sent -= part.nbytes
    return []


def _rights(fds: Sequence[int]) -> list[tuple[int, int, array.array[int]]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def send(sock: socket.socket, header: dict[str, Any], buffers: Sequence[Buffer] = (), fds: Sequence[int] = ()) -> None:
    """A frame in one gathering write where it fits (one wake-up of the other side), the rest after.
    On a TLS socket (a node's link, ``Executor.connect(direct=True)``), which has no ``sendmsg`` and
    passes no descriptors: a small frame in one write, a large one part by part."""
    parts = _parts(_encode(header, buffers)[0], buffers)
    if _is_tls(sock):
        if fds:
            raise ValueError("descriptors cannot travel over a TLS link")
        for part in [b"".join(parts)] if sum(p.nbytes for p in parts) <= _JOIN_BYTES else parts:
            sock.sendall(part)
        return
    rest = _rest(parts, sock.sendmsg(parts[:_GATHER], _rights(fds)))
    for part in rest:
        sock.sendall(part)


def send_head(sock: socket.socket, header: dict[str, Any], buffers: Sequence[Buffer], following: Sequence[int]) -> None:
    """A frame's start: its header and ``buffers``, announcing buffers of the ``following`` sizes
    that the caller then sends itself (as they come from elsewhere: streamed, never held whole)."""
    sizes = [memoryview(b).nbytes for b in buffers] + list(following)
    head = json.dumps({**header, "sizes": sizes}, separators=(",", ":")).encode()
    for part in _parts(_PREFIX.pack(len(head), sum(sizes)) + head, buffers):
        sock.sendall(part)


def recv(sock: socket.socket) -> Frame:
    """The next frame; ``EOFError`` when the other side has gone."""
    header, total, fds = recv_head(sock)
    body = memoryview(bytearray(total))
    recv_exact(sock, body)
    return Frame(header, split(header, body), fds)


PREFIX_BYTES = _PREFIX.size  # a frame's fixed prefix: its header's size, then its buffers'


def frame_prefix(head_size: int, total: int) -> bytes:
    """The prefix of a frame whose header has ``head_size`` bytes and its buffers ``total``."""
    return _PREFIX.pack(head_size, total)


def frame_sizes(prefix: Buffer) -> tuple[int, int]:
    """A frame's header and inline sizes, from its prefix (``PREFIX_BYTES``); ``EOFError`` for a corrupt one."""
    return _sizes(bytearray(prefix))


def recv_some(sock: socket.socket, view: memoryview) -> tuple[int, list[int]]:
    """What ``sock`` has, up to ``len(view)`` bytes, received into ``view`` (waiting for one byte at
    least), and the descriptors that came along; ``EOFError`` when the other side has gone. For one
    that reads a frame's start in one call where nothing but that frame can come (a request's reply)."""
    if _is_tls(sock):  # one TLS record at most; no descriptors come over a TLS link
        n, fds = sock.recv_into(view), []
    else:
        n, ancdata, _, _ = sock.recvmsg_into([view], _ANCILLARY)
        fds = _fds_of(ancdata)
    if not n:
        for fd in fds:
            os.close(fd)
        raise EOFError("the other side closed the connection")
    return n, fds


def recv_head(sock: socket.socket) -> tuple[dict[str, Any], int, list[int]]:
    """The next frame's header (its ``sizes`` still in it), how many bytes of buffers follow it on
    ``sock``, and the descriptors that came with it; ``EOFError`` when the other side has gone."""
    prefix = bytearray(_PREFIX.size)
    got, fds = 0, []
    if _is_tls(sock):  # no descriptors come over a TLS link
        recv_exact(sock, memoryview(prefix))
        got = len(prefix)
    while got < len(prefix):
        data, ancdata, _, _ = sock.recvmsg(len(prefix) - got, _ANCILLARY)
        if not data:
            raise EOFError("the other side closed the connection")
        fds += _fds_of(ancdata)
        prefix[got : got + len(data)] = data
        got += len(data)
    head_size, total = _sizes(prefix)
    head = memoryview(bytearray(head_size))
    recv_exact(sock, head)
    return json.loads(bytes(head)), total, fds


# ---- the server's side: on the event loop --------------------------------------------------------


class Link:
    """The server's connection to one worker: one request at a time (the caller holds a lock)."""

    def __init__(self, sock: socket.socket) -> None:
        import asyncio

        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._waiting: tuple[asyncio.Future[None], int, bool] | None = None  # a wait for the socket: fd, write

    @classmethod
    async def connect(cls, path: str, peer: Callable[[int], bool]) -> Link:
        """Connect to the worker listening at ``path``, whose pid ``peer`` accepts."""
        import asyncio

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            with _reachable(path) as address:
                await asyncio.get_running_loop().sock_connect(sock, address)
            _check_peer(sock, path, peer)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def close(self) -> None:
        """Close the connection; a ``send`` or ``recv`` waiting on it raises ``ConnectionAbortedError``
        at once (its worker's node may be gone without a word: nothing else would end the wait)."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            fut, fd, write = waiting
            (self._loop.remove_writer if write else self._loop.remove_reader)(fd)
            if not fut.done():
                fut.set_exception(ConnectionAbortedError("the connection to the worker was closed"))
        self.sock.close()

    async def _ready(self, write: bool) -> None:
        fut = self._loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise ConnectionAbortedError("the connection to the worker was closed")

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        (self._loop.add_writer if write else self._loop.add_reader)(fd, wake)
        self._waiting = (fut, fd, write)
        try:
            await fut
        finally:
            if self._waiting is not None and self._waiting[0] is fut:  # else close() removed it
                self._waiting = None
                (self._loop.remove_writer if write else self._loop.remove_reader)(fd)

    async def send(self, header: dict[str, Any], buffers: Sequence[Buffer] = (), fds: Sequence[int] = ()) -> None:
        parts = _parts(_encode(header, buffers)[0], buffers)
        while True:
            try:
                sent = self.sock.sendmsg(parts[:_GATHER], _rights(fds))
                break
            except BlockingIOError:
                await self._ready(write=True)
        for part in _rest(parts, sent):
            while part:  # not the loop's sock_sendall: a close() must end this wait too
                try:
                    part = part[self.sock.send(part) :]
                except BlockingIOError:
                    await self._ready(write=True)

    async def recv(self, wait: float = 0.0) -> Frame:
        """The worker's next frame. With ``wait``, first wait up to that many seconds for it without
        yielding to the event loop: a quick reply (a no-op call) then costs no turns of the loop."""
        if wait:
            select.select([self.sock], [], [], wait)
        prefix = bytearray(_PREFIX.size)
        got, fds = 0, []
        while got < len(prefix):
            try:
                data, ancdata, _, _ = self.sock.recvmsg(len(prefix) - got, _ANCILLARY)
            except BlockingIOError:
                await self._ready(write=False)
                continue
            if not data:
                raise EOFError("the worker closed the connection")
            fds += _fds_of(ancdata)
            prefix[got : got + len(data)] = data
            got += len(data)
        head_size, total = _sizes(prefix)
        body = memoryview(bytearray(head_size + total))
        at = 0
        while at < len(body):
            try:  # usually there already: straight from the socket, without a turn of the loop
                n = self.sock.recv_into(body[at:])
            except BlockingIOError:
                await self._ready(write=False)
                continue
            if not n:
                raise EOFError("the worker closed the connection")
            at += n
        return _frame(body, head_size, fds)
