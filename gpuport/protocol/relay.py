"""A byte relay between two sockets, for tunnels: the data port's side and the client's side."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable

from gpuport.defaults import TUNNEL_SPIN_SECONDS

_CHUNK = 1024 * 1024
# Buffers of relays that ended, kept for the next: a new one is 1 MiB of fresh pages, whose first
# touch costs a relay 0.5-1 ms each on a VM (page faults), on a fresh connection's way. At most
# this many are kept (list.append and pop hold the GIL: no lock).
_KEPT_BUFFERS = 8
_buffers: list[memoryview] = []
_FLUSH_TIMEOUT = 30.0  # seconds the last bytes of a side that went wait for the other to take them
_POLLIN = 1  # select.EPOLLIN and select.POLLIN alike
_POLLOUT = 4  # select.EPOLLOUT and select.POLLOUT alike
_GONE = 8 | 16  # ERR and HUP, for epoll and poll alike: a side went away


def relay(
    a: socket.socket,
    b: socket.socket,
    *,
    spin: float = TUNNEL_SPIN_SECONDS,
    replied: Callable[[], object] | None = None,
) -> None:
    """Copy bytes both ways between ``a`` (TLS or plain) and ``b`` until either side closes; then
    shut both down. Small writes go out at once (TCP_NODELAY on either TCP end): a tunnel carries
    RPCs, and Nagle's wait for the peer's delayed ACK would add 40 ms to each.

    With a TLS end, one thread serves both ways (a TLS socket is never read and written at once by
    two threads), on non-blocking sockets with a buffer per direction: a side whose peer does not
    read holds back only its own direction, never the other. Blocking writes would deadlock two
    relays in a row (each blocked writing to a peer that is itself blocked writing to it) once both
    directions carry more than the sockets' buffers hold. After bytes went through, the thread
    polls for up to ``spin`` seconds before it sleeps (see ``TUNNEL_SPIN_SECONDS``).

    ``replied`` is called once, when bytes from ``b`` went on to ``a`` and then nothing more came
    for a moment (the relay is about to sleep): the connection's first answer is through, and
    whoever waits to do work that would slow it (a forward's next spare) does it then."""
    for end in (a, b):
        if end.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not isinstance(a, ssl.SSLSocket) and not isinstance(b, ssl.SSLSocket):
        return _both_ways(a, b, replied)
    a.setblocking(False)
    b.setblocking(False)
    ways = (_Way(a, b), _Way(b, a))
    # Registered once, modified only when what a direction waits for changes (not per message);
    # poll() where there is no epoll (macOS).
    poller = select.epoll() if hasattr(select, "epoll") else select.poll()
    try:
        asked = {a.fileno(): _POLLIN, b.fileno(): _POLLIN}
        for fd, events in asked.items():
            poller.register(fd, events)
        poll = poller.poll
        spin_ns = int(spin * 1e9)
        ready: list[tuple[int, int]] = []
        while True:
            if ready:
                for way in ways:
                    if not (due := way.due(ready)):
                        continue
                    if not way.step():
                        return  # a side closed
                    if due is _GONE and way.start < way.end:
                        # Its source went while bytes it sent wait for the sink: they still go on
                        # (waiting for the sink now: the source's hang-up would wake every poll).
                        way.flush()
            # Bytes OpenSSL has already decrypted wake no poll: served before sleeping.
            while ways[0].hot() or ways[1].hot():
                for way in ways:
                    if way.hot() and not way.step():
                        return
            if ways[0].moved or ways[1].moved:
                wanted = dict.fromkeys(asked, 0)
                for way in ways:
                    wanted[way.fd] |= way.events
                    way.moved = False
                for fd, events in wanted.items():
                    if asked[fd] != events:
                        poller.modify(fd, events)
                        asked[fd] = events
            ready = poll(0) or spin_poll(poll, spin_ns)
            if not ready:
                if replied is not None and ways[1].took:
                    replied, answered = None, replied
                    answered()
                    ready = poll(0)
                ready = ready or poll()
    except (OSError, ValueError):
        return  # either side went away: the tunnel is over
    finally:
        for way in ways:
            if len(_buffers) < _KEPT_BUFFERS:
                _buffers.append(way.buffer)
        if hasattr(poller, "close"):
            poller.close()
        for end in (a, b):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


class _Way:
    """One direction of a relay: bytes read from ``source`` wait in this direction's own buffer
    (reused: no bytes object per message) until ``sink`` took them all; meanwhile the source is not
    read. ``fd`` and ``events`` say what it waits for; ``moved`` that they changed."""

    __slots__ = ("buffer", "end", "events", "fd", "moved", "pending", "sink", "source", "source_fd", "start", "took")

    def __init__(self, source: socket.socket, sink: socket.socket) -> None:
        self.source, self.sink = source, sink
        self.took = False  # whether bytes came from the source yet
        try:
            self.buffer = _buffers.pop()
        except IndexError:
            self.buffer = memoryview(bytearray(_CHUNK))
        self.start = self.end = 0
        self.source_fd = source.fileno()
        self.fd, self.events, self.moved = self.source_fd, _POLLIN, False
        self.pending = source.pending if isinstance(source, ssl.SSLSocket) else None

    def due(self, ready: list[tuple[int, int]]) -> int:
        """Whether an event in ``ready`` is one this direction waits for (its events), or says that
        its source went away (``_GONE``: it reads what is left); 0 when neither."""
        for fd, events in ready:
            if fd == self.source_fd and events & _GONE:
                return _GONE
            if fd == self.fd and events & self.events:
                return self.events
        return 0

    def hot(self) -> bool:
        """Whether the TLS source holds decrypted bytes that this direction can take now."""
        return self.pending is not None and self.start == self.end and self.events == _POLLIN and self.pending() > 0

    def step(self) -> bool:
        """Move what moves without blocking: the buffer's rest to the sink, then (once it is empty)
        one read from the source, sent on at once. False once the source has closed."""
        if self.start < self.end and not self._send():
            return True
        try:
            n = self.source.recv_into(self.buffer)
        except (BlockingIOError, ssl.SSLWantReadError):
            self._wait(self.source, _POLLIN)
            return True
        except ssl.SSLWantWriteError:  # TLS itself must write first
            self._wait(self.source, _POLLOUT)
            return True
        if not n:
            return False
        self.start, self.end = 0, n
        self.took = True
        self._send()
        return True

    def _send(self) -> bool:
        """Send what the buffer holds; True when all of it went (then the source is waited on)."""
        try:
            # A TLS send that would block is retried later with the same bytes, as OpenSSL asks.
            self.start += self.sink.send(self.buffer[self.start : self.end])
        except (BlockingIOError, ssl.SSLWantWriteError):
            self._wait(self.sink, _POLLOUT)
            return False
        except ssl.SSLWantReadError:  # TLS itself must read first
            self._wait(self.sink, _POLLIN)
            return False
        if self.start < self.end:
            self._wait(self.sink, _POLLOUT)
            return False
        self.start = self.end = 0
        self._wait(self.source, _POLLIN)
        return True

    def flush(self) -> None:
        """Send what the buffer holds, waiting for the sink (up to ``_FLUSH_TIMEOUT``)."""
        self.sink.settimeout(_FLUSH_TIMEOUT)
        try:
            self.sink.sendall(self.buffer[self.start : self.end])
        finally:
            self.sink.setblocking(False)
        self.start = self.end = 0
        self._wait(self.source, _POLLIN)

    def _wait(self, end: socket.socket, events: int) -> None:
        fd = end.fileno()
        if fd != self.fd or events != self.events:
            self.fd, self.events, self.moved = fd, events, True


def spin_poll(poll: Callable[[int], list[tuple[int, int]]], spin_ns: int) -> list[tuple[int, int]]:
    """Poll without sleeping for up to ``spin_ns``, giving the CPU to any other ready thread
    between polls: what became ready, or [] when nothing did."""
    if spin_ns <= 0:
        return []
    clock, pause = time.monotonic_ns, os.sched_yield
    until = clock() + spin_ns
    while clock() < until:
        pause()
        if ready := poll(0):
            return ready
    return []


def _both_ways(a: socket.socket, b: socket.socket, replied: Callable[[], object] | None = None) -> None:
    """Plain sockets both ways: a thread each way, blocked in recv (no select per message)."""
    other = threading.Thread(target=_one_way, args=(b, a, replied), daemon=True)
    other.start()
    _one_way(a, b)
    other.join()


def _one_way(source: socket.socket, sink: socket.socket, replied: Callable[[], object] | None = None) -> None:
    try:
        while data := source.recv(_CHUNK):
            sink.sendall(data)
            if replied is not None and not select.select([source], [], [], 0)[0]:  # through, for now
                replied, answered = None, replied
                answered()
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
