"""Memory for a session's large values: memfds that a worker maps, kept for reuse.

Whoever hands a session's worker its large values in shared memory keeps a ``SessionMemory`` for
it: the front door for a worker on its own machine (``services/staging.py``), a node's agent for a
worker on its node (``executors/node_values.py``). A value is received into a memfd the worker maps;
the memfds the worker lets go of come back and receive the next values, their pages already made.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from gpuport.defaults import SESSION_REUSE_BYTES
from gpuport.server.worker import wire

KEEP_MAP_BYTES = 16 * 1024 * 1024  # uploads from this size keep the server's map for reuse (see SessionMemory.sent)


class _Upload(Protocol):
    """An upload on its way to a worker: its memfd (the first part's), the map made of it here."""

    parts: list[tuple[int, int, int]]
    size: int
    mapped: mmap.mmap | None

    def close(self) -> None: ...


@dataclass
class SessionMemory:
    """A session's memory for large values: memfds its worker let go of, and the server's maps of them."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # calls come from channel threads too
    spare: list[tuple[int, int, float]] = field(default_factory=list)  # (memfd, size, since): see take_spare
    # The server's maps of uploads passed to the worker, by the memfd's inode: an upload into memory
    # that comes back (spare) needs no new map, whose making costs 0.17 s a GiB on a 2-core VM.
    maps: dict[int, mmap.mmap] = field(default_factory=dict)

    def sent(self, staged: _Upload) -> None:
        """An upload went to the worker: keep its map (a large one: a map costs the server little, but
        thousands of small values would each hold one) for when its memory comes back, and let it go."""
        if staged.mapped is not None and staged.parts and staged.size >= KEEP_MAP_BYTES:
            with contextlib.suppress(OSError):
                inode = os.fstat(staged.parts[0][0]).st_ino
                with self.lock:
                    old = self.maps.pop(inode, None)
                    self.maps[inode] = staged.mapped
                if old is not None:
                    _unmap(old)
                staged.mapped = None
        staged.close()

    def borrow(self, fd: int) -> mmap.mmap | None:
        """The map kept of the memfd ``fd`` (a value that was put), to send a result from; not to close."""
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        with self.lock:
            return self.maps.get(inode)

    def keep_spare(self, fd: int, size: int) -> None:
        """Keep a memfd the worker let go of, for the session's next large value; within
        ``SESSION_REUSE_BYTES`` (the oldest go first). One that cannot be held to its size (the
        worker could cut it under the server's map: ``wire.hold_size``) is closed instead."""
        if not wire.hold_size(fd):
            os.close(fd)
            return
        with self.lock:
            self.spare.append((fd, size, time.monotonic()))
            doomed = []
            while sum(s for _, s, _ in self.spare) > SESSION_REUSE_BYTES:
                doomed.append(self.spare.pop(0)[0])
        for old in doomed:
            self._forget(old)

    def take_spare(self, size: int) -> tuple[int, mmap.mmap | None] | None:
        """A kept memfd made ``size`` bytes long (the one closest in size), with the server's map of it
        when there is one, or None. Its pages were made by an earlier value, so receiving into it costs
        no page faults (beyond its old size)."""
        with self.lock:
            # Only one no larger: kept memory is sealed against shrinking (``keep_spare``).
            fits = [i for i in range(len(self.spare)) if self.spare[i][1] <= size]
            if not fits:
                return None
            best = max(fits, key=lambda i: self.spare[i][1])
            fd, had, _ = self.spare.pop(best)
        with self.lock:
            mapped = self.maps.pop(os.fstat(fd).st_ino, None)
        if had != size:
            os.ftruncate(fd, size)  # growing adds pages to make
            if mapped is not None:
                _unmap(mapped)
                mapped = None
        return fd, mapped

    def _forget(self, fd: int) -> None:
        with contextlib.suppress(OSError), self.lock:
            mapped = self.maps.pop(os.fstat(fd).st_ino, None)
            if mapped is not None:
                _unmap(mapped)
        os.close(fd)

    def drop_spare(self, older_than: float = 0.0) -> None:
        """Free kept memory: what came back more than ``older_than`` seconds ago, and with 0 every map
        (the session ends, or its worker and the values it held)."""
        now = time.monotonic()
        with self.lock:
            doomed = [fd for fd, _, since in self.spare if now - since >= older_than]
            self.spare = [kept for kept in self.spare if now - kept[2] < older_than]
        for fd in doomed:
            self._forget(fd)
        if not older_than:
            with self.lock:
                maps, self.maps = list(self.maps.values()), {}
            for mapped in maps:
                _unmap(mapped)

    def upload_memory(self, size: int) -> tuple[int, mmap.mmap | None]:
        """A memfd of ``size`` bytes to receive a value into: one the worker let go of (with the
        server's map of it, when kept), or a new one."""
        spare = self.take_spare(size) if size else None
        if spare is not None:
            return spare
        fd = wire.memory_file(size, "gpuport-upload")
        if not wire.hold_size(fd):  # the worker gets it: it must not cut it under the server's map
            os.close(fd)
            raise OSError("this system cannot seal memory against shrinking (memfd seals)")
        return fd, None


def _unmap(mapped: mmap.mmap) -> None:
    """Close a map; one a download still sends from is unmapped once that ends (and drops its view)."""
    with contextlib.suppress(BufferError):
        mapped.close()
