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
_POLLIN = 1  # select.EPOLLIN and select.POLLIN alike


def relay(a: socket.socket, b: socket.socket, *, spin: float = TUNNEL_SPIN_SECONDS) -> None:
    """Copy bytes both ways between ``a`` (TLS or plain) and ``b`` in this one thread, until either
    side closes; then shut both down. One thread: a TLS socket is never read and written at once.
    Small writes go out at once (TCP_NODELAY on either TCP end): a tunnel carries RPCs, and Nagle's
    wait for the peer's delayed ACK would add 40 ms to each. After bytes went through, the thread
    polls for up to ``spin`` seconds before it sleeps (see ``TUNNEL_SPIN_SECONDS``)."""
    for end in (a, b):
        if end.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not isinstance(a, ssl.SSLSocket) and not isinstance(b, ssl.SSLSocket):
        return _both_ways(a, b)
    tls = tuple(end for end in (a, b) if isinstance(end, ssl.SSLSocket))
    ends = {a.fileno(): (a, b), b.fileno(): (b, a)}
    buffer = memoryview(bytearray(_CHUNK))  # one buffer, reused: no bytes object per message
    # Registered once, not rebuilt per message; poll() where there is no epoll (macOS).
    poller = select.epoll() if hasattr(select, "epoll") else select.poll()
    try:
        for fd in ends:
            poller.register(fd, _POLLIN)
        poll = poller.poll
        spin_ns = int(spin * 1e9)
        while True:
            # Bytes OpenSSL has already decrypted wake no poll: served first.
            for source in tls:
                while source.pending():
                    if not _move(source, ends[source.fileno()][1], buffer):
                        return
            for fd, _ in poll(0) or _spin(poll, spin_ns) or poll():
                source, sink = ends[fd]
                if not _move(source, sink, buffer):
                    return
    except (OSError, ValueError):
        return  # either side went away: the tunnel is over
    finally:
        if hasattr(poller, "close"):
            poller.close()
        for end in (a, b):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


def _spin(poll: Callable[[int], list[tuple[int, int]]], spin_ns: int) -> list[tuple[int, int]]:
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


def _move(source: socket.socket, sink: socket.socket, buffer: memoryview) -> bool:
    """Copy what ``source`` has to ``sink``; False once ``source`` has closed."""
    n = source.recv_into(buffer)
    if not n:
        return False
    sink.sendall(buffer[:n])
    return True


def _both_ways(a: socket.socket, b: socket.socket) -> None:
    """Plain sockets both ways: a thread each way, blocked in recv (no select per message)."""
    other = threading.Thread(target=_one_way, args=(b, a), daemon=True)
    other.start()
    _one_way(a, b)
    other.join()


def _one_way(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(_CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
