"""A session's worker on a node, served by the node's link as the front door serves one on its own machine.

The server's frames to a session's worker (``worker/wire.py``) cross the node's TLS link as bytes:
a large value inline, and the request asks the worker to answer inline (``"inline"``), since the
server shares no memory with it. The link (``node_link.NodeListener``, in a Ray node's agent or a
Slurm job's link) does not copy those bytes on to the worker's Unix socket: it receives a large
value from the link straight into a memfd (the TLS decrypt writes into it) and hands the worker the
memfd (``SCM_RIGHTS``), exactly as the front door does on one machine; it lets the worker answer
with memfds, and sends a large result onto the link from the mapped memfd. The memfds the worker
lets go of come back and receive the session's next values, their pages made (``SessionMemory``,
the front door's own). Nothing of the link reaches the worker: only frames and the memfds made here.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import socket
from typing import Any

from gpuport.defaults import SESSION_INLINE_BYTES, SESSION_REUSE_SECONDS, TUNNEL_SPIN_SECONDS
from gpuport.protocol.relay import spin_poll
from gpuport.protocol.sockets import recv_exact
from gpuport.server.memfds import SessionMemory
from gpuport.server.worker import wire

_LARGE = 1024 * 1024  # a request's buffers from the first this large on go to the worker in a memfd
_INLINE = b',"inline":true'  # how the server's request asks for its reply inline (see wire._encode)
_START = 64 * 1024  # bytes of a frame read in one call at most: a small frame whole
_CLOSED = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)  # a side that went away


class _Upload:
    """A value received here into a memfd, on its way to the worker (``SessionMemory.sent``)."""

    def __init__(self, fd: int, size: int, mapped: mmap.mmap | None) -> None:
        self.parts, self.size, self.mapped = [(fd, 0, size)], size, mapped

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.parts[0][0])
        if self.mapped is not None:
            with contextlib.suppress(BufferError):
                self.mapped.close()
            self.mapped = None


def serve_worker(link: socket.socket, worker: socket.socket, memory: SessionMemory) -> None:
    """Carry the server's requests from ``link`` (TLS) to the session's worker on ``worker`` (its Unix
    socket), and its replies back, one at a time, until either side goes (then it returns, or raises
    ``OSError``/``EOFError``/``ValueError``: the caller closes both)."""
    with contextlib.suppress(OSError):
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply goes out at once
    buffer = memoryview(bytearray(_START))  # reused: a small frame is read whole into it, in one call
    waiting = select.poll()
    waiting.register(worker, select.POLLIN)
    waiting.register(link, _CLOSED)
    while True:
        try:
            head, total, came, _ = _start(link, buffer)
        except EOFError:
            return
        _request(link, worker, memory, head, total, came)
        # The reply, or the server gone meanwhile (a timed-out call: its worker is killed).
        ready = waiting.poll(0) or spin_poll(waiting.poll, int(TUNNEL_SPIN_SECONDS * 1e9)) or waiting.poll()
        if not any(fd == worker.fileno() for fd, _ in ready):
            return
        _reply(worker, link, memory, buffer)
        memory.drop_spare(older_than=SESSION_REUSE_SECONDS)


def _start(sock: socket.socket, buffer: memoryview) -> tuple[memoryview, int, memoryview, list[int]]:
    """A frame's start, read in as few calls as it takes (one for a small frame): its header's bytes,
    the size of its buffers, those of their bytes that came with it (in ``buffer``) and the
    descriptors. Reads no further than the frame: nothing else comes before it is answered."""
    got, fds = wire.recv_some(sock, buffer)
    try:
        while got < wire.PREFIX_BYTES:
            n, more = wire.recv_some(sock, buffer[got:])
            got, fds = got + n, fds + more
        head_size, total = wire.frame_sizes(buffer[: wire.PREFIX_BYTES])
        end = wire.PREFIX_BYTES + head_size
        if end > len(buffer):  # a header larger than the buffer
            head = memoryview(bytearray(head_size))
            head[: got - wire.PREFIX_BYTES] = buffer[wire.PREFIX_BYTES : got]
            recv_exact(sock, head[got - wire.PREFIX_BYTES :])
            return head, total, memoryview(b""), fds
        while got < end:
            n, more = wire.recv_some(sock, buffer[got:])
            got, fds = got + n, fds + more
        if got - end > total:
            raise ValueError("more bytes came than the frame holds")
        return buffer[wire.PREFIX_BYTES : end], total, buffer[end:got], fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _request(
    link: socket.socket, worker: socket.socket, memory: SessionMemory, head: memoryview, total: int, came: memoryview
) -> None:
    """A request from the server (``came``: its first bytes of buffers), passed to the worker: a large
    value in a memfd, the rest inline."""
    if len(came) == total and (raw := bytes(head)).count(_INLINE) == 1:
        # A small request, whole here: on as it came, but for its ``inline`` (taken off in the bytes:
        # such a key cannot be part of a string, where a quote is escaped). Nothing to parse.
        raw = raw.replace(_INLINE, b"")
        worker.sendall(b"".join((wire.frame_prefix(len(raw), total), raw, came)))
        return
    header = json.loads(bytes(head))
    sizes = [int(size) for size in header.pop("sizes", [])]
    if sum(sizes) != total or any(size < 0 for size in sizes):
        raise ValueError("the server sent a frame whose sizes do not add up")
    header.pop("inline", None)  # here the worker's large results come back in memfds
    cut = next((i for i, size in enumerate(sizes) if size >= _LARGE), len(sizes))
    if sum(sizes[cut:]) <= SESSION_INLINE_BYTES:
        cut = len(sizes)
    body = memoryview(bytearray(sum(sizes[:cut])))
    early = min(len(came), len(body))
    body[:early] = came[:early]
    came = came[early:]
    recv_exact(link, body[early:], "the server")
    buffers = wire.split({"sizes": sizes[:cut]}, body)
    if cut == len(sizes):
        wire.send(worker, header, buffers)
        return
    size = total - len(body)
    fd, mapped = memory.upload_memory(size)
    upload = _Upload(fd, size, mapped)
    try:
        if upload.mapped is None:
            upload.mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | wire.POPULATE)
        view = memoryview(upload.mapped)
        try:
            view[: len(came)] = came
            recv_exact(link, view[len(came) :], "the server")
        finally:
            view.release()
        # The worker's handle() appends the memfd's buffers after the inline ones: the order stays.
        header["fd_sizes"], header["staged_sizes"] = [size], sizes[cut:]
        wire.send(worker, header, buffers, [fd])
    except BaseException:
        upload.close()
        raise
    memory.sent(upload)  # its map kept for when the worker lets the memfd go; the descriptor closed


def _reply(worker: socket.socket, link: socket.socket, memory: SessionMemory, buffer: memoryview) -> None:
    """The worker's reply, sent on to the server inline: a result it left in memfds read from them."""
    head, total, came, fds = _start(worker, buffer)
    if not fds:  # nothing in shared memory (no result there, no memory let go of): it goes on as it came
        if head.obj is buffer.obj:
            link.sendall(buffer[: wire.PREFIX_BYTES + len(head) + len(came)])
        else:
            link.sendall(bytes(buffer[: wire.PREFIX_BYTES]) + bytes(head))
        left = total - len(came)
        while left:
            part = buffer[: min(left, len(buffer))]
            recv_exact(worker, part, "the worker")
            link.sendall(part)
            left -= len(part)
        return
    header = json.loads(bytes(head))
    released = header.pop("released", [])
    if not isinstance(released, list) or len(released) > len(fds):
        released = []
    kept = len(fds) - len(released)  # the last descriptors: memory the worker let go of
    maps: list[mmap.mmap] = []
    views: list[memoryview] = []
    try:
        body = memoryview(bytearray(total))
        body[: len(came)] = came
        recv_exact(worker, body[len(came) :], "the worker")
        buffers: list[Any] = wire.split(header, body)
        for index, offset, size in header.pop("parts", []):
            if not 0 <= index < kept:
                raise ValueError("the worker named a descriptor it did not send")
            views.append(_view(fds[index], offset, size, memory, maps))
        wire.send(link, header, [*buffers, *views])
    finally:
        for view in views:
            view.release()
        for mapped in maps:
            with contextlib.suppress(BufferError):
                mapped.close()
        for fd in fds[:kept]:
            os.close(fd)
        for fd, (_, size) in zip(fds[kept:], released, strict=True):
            if _is_memfd(fd) and isinstance(size, int) and size >= 0:
                memory.keep_spare(fd, size)  # the session's next large value is received into it
            else:
                os.close(fd)


def _view(fd: int, offset: int, size: int, memory: SessionMemory, maps: list[mmap.mmap]) -> memoryview:
    """The ``size`` bytes at ``offset`` of the worker's memfd ``fd``: in the map kept of it (a value
    that was put), or a map made now (added to ``maps``, closed after the send)."""
    if not size:
        return memoryview(b"")
    kept = memory.borrow(fd)
    if kept is not None and 0 <= offset and offset + size <= len(kept):
        return memoryview(kept)[offset : offset + size]
    if not wire.hold_size(fd):
        raise ValueError("the worker's memory for a value could be cut under the link: not read")
    if offset < 0 or size < 0 or os.fstat(fd).st_size < offset + size:
        raise ValueError("the worker named bytes past the end of its memory")
    # Populated at once: faulting a GiB in page by page costs more than the mapping saves.
    mapped = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | wire.POPULATE, prot=mmap.PROT_READ)
    maps.append(mapped)
    return memoryview(mapped)[offset : offset + size]


def _is_memfd(fd: int) -> bool:
    """Whether ``fd`` is a memfd (what a worker gives back must be one: the next value is written into it)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False
