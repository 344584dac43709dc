"""The blob store: file contents kept once, under their SHA-256, shared by every snapshot and output.

Layout: ``STATE_DIR/blobs/ab/cdef...`` (read-only files); an upload in flight is a hidden
``.cdef....part`` file beside where its blob will be (one staging folder for everything made ext4's
inode allocator the bottleneck of a first sync). A blob appears under its name only after its bytes
were checked against it, so a reader never sees a partial or wrong blob.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from gpuport.defaults import MAX_BLOB_BYTES
from gpuport.protocol.errors import InvalidRequest, ResourceUnavailable
from gpuport.protocol.units import format_size

_HASH = re.compile(r"[0-9a-f]{64}")
_KNOWN_SIZES = 1_000_000
_STALE_MARGIN = 5.0  # seconds before the store opened that a partial file must be older than to go
_STAGING = "incoming"  # where a job's output is copied before its hash, and so its folder, is known


def check_hash(blob: str) -> str:
    if not _HASH.fullmatch(blob):
        raise InvalidRequest(f"{blob[:80]!r} is not a blob id (64 lowercase hex digits of SHA-256)")
    return blob


class BlobStore:
    def __init__(self, root: Path, *, tidy: bool = True) -> None:
        """``tidy``: remove uploads a restart cut off (the server's own store; not a helper process's
        view of it, whose start is no restart)."""
        self.root = root
        self._folders: set[str] = set()  # blobs/ab/ folders known to exist
        # Sizes of blobs known to be present: blobs are never changed, so a re-sync of a large
        # project needs no stat per file. Bounded; past the bound, it is simply refilled.
        self._known: dict[str, int] = {}
        root.mkdir(parents=True, exist_ok=True)
        # Uploads cut off by a restart (their senders upload again): removed in the background,
        # as a large store takes a while to list.
        if tidy:
            threading.Thread(target=self._remove_stale_parts, name="blob store cleanup", daemon=True).start()

    def _remove_stale_parts(self) -> None:
        started = time.time()
        for folder in self.root.iterdir():
            if folder.is_dir():
                for entry in os.scandir(folder):
                    if entry.name.startswith(".") and entry.name.endswith(".part"):
                        with contextlib.suppress(OSError):
                            # A file's time is the kernel's coarse clock, which may lag time.time():
                            # one made just after this store opened must not pass for a stale one.
                            if entry.stat().st_mtime < started - _STALE_MARGIN:
                                os.unlink(entry.path)

    def _folder(self, blob: str) -> str:
        """The folder ``blob`` goes in, made if needed."""
        folder = f"{self.root}/{blob[:2]}"
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        return folder

    def temp_file(self, blob: str) -> tuple[int, str]:
        """A new hidden file (fd, path) beside where ``blob`` goes, to receive its bytes."""
        return tempfile.mkstemp(dir=self._folder(blob), prefix=f".{blob[2:10]}.", suffix=".part")

    def path(self, blob: str) -> Path:
        return self.root / blob[:2] / blob[2:]

    def sizes(self, blobs: Iterable[str]) -> dict[str, int | None]:
        """Each blob's size, or None for a blob the store lacks (one stat each)."""
        root = str(self.root)
        known = self._known
        sizes: dict[str, int | None] = {}
        for blob in blobs:
            if blob in sizes:
                continue
            size = known.get(blob)
            if size is None:
                try:
                    size = os.stat(f"{root}/{blob[:2]}/{blob[2:]}").st_size
                except FileNotFoundError:
                    pass
                else:
                    if len(known) >= _KNOWN_SIZES:
                        known.clear()
                    known[blob] = size
            sizes[blob] = size
        return sizes

    def forget(self, blob: str) -> None:
        """Drop what is known of ``blob``, about to be removed (the storage sweep)."""
        self._known.pop(blob, None)

    def _place(self, temp: str, blob: str) -> None:
        os.chmod(temp, 0o444)
        os.replace(temp, f"{self.root}/{blob[:2]}/{blob[2:]}")

    def writer(self, budget: int | None = None) -> BlobWriter:
        """A writer for one upload stream, refusing (``ResourceUnavailable``) bytes past ``budget``."""
        return BlobWriter(self, budget)

    def ingest(self, source: BinaryIO) -> tuple[str, int]:
        """Add the content of ``source`` (a job's output, open) to the store; return its hash and size.

        Copied while hashed, in one pass, never hard-linked: the file's inode is the job's, which it
        (or a link to it kept elsewhere) could change after the blob was checked."""
        staging = self.root / _STAGING
        staging.mkdir(exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=staging, prefix=".ingest.", suffix=".part")
        digest = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as copy:
                while chunk := source.read(1 << 20):
                    copy.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            blob = digest.hexdigest()
            if self.sizes([blob])[blob] is None:
                self._folder(blob)
                self._place(temp, blob)
            else:  # kept by the storage sweep's grace period until its new holder is recorded
                with contextlib.suppress(OSError):
                    os.utime(self.path(blob))
        finally:
            Path(temp).unlink(missing_ok=True)
        return blob, size

    def open(self, blob: str) -> BinaryIO:
        return open(self.path(blob), "rb")

    def copy_to(self, blob: str, dest: Path, mode: int) -> None:
        shutil.copyfile(self.path(blob), dest)
        os.chmod(dest, mode & 0o777 | 0o200)  # the job may change its copy; the blob stays read-only

    def link_to(self, blob: str, dest: Path) -> None:
        """A read-only hard link to the blob (datasets): no copy, however large."""
        try:
            os.link(self.path(blob), dest)
        except OSError:
            shutil.copyfile(self.path(blob), dest)
            os.chmod(dest, 0o444)


class BlobWriter:
    """Receives an upload stream's parts, in order, and places each blob once its hash checks out.

    ``write`` takes one message's parts (in a thread: writing and hashing release the GIL).
    """

    def __init__(self, store: BlobStore, budget: int | None = None) -> None:
        self.store = store
        self.placed: list[str] = []  # the blobs received whole and checked, in order
        self.bytes = 0
        self.budget = budget  # the most bytes this stream may bring (the sender's storage left); None: any
        self.over = False  # it brought more: none of its blobs is the sender's
        self._blob: str | None = None  # the blob being received
        self._offset = 0
        self._file: BinaryIO | None = None
        self._temp = ""
        self._digest = hashlib.sha256()

    def write(self, parts: Sequence[Part]) -> None:
        for part in parts:
            self.write_part(part.blob, part.offset, part.data, part.last)  # .data: a copy, taken once

    def write_part(self, blob: str, offset: int, data: bytes | memoryview, last: bool) -> None:
        """The bytes of ``blob`` at ``offset``; ``last`` closes it (checked, then placed)."""
        if self._blob is None:
            check_hash(blob)
            if offset != 0:
                raise InvalidRequest(f"blob {blob} starts at offset {offset}, not 0 — upload it again")
            fd, self._temp = self.store.temp_file(blob)
            self._file = os.fdopen(fd, "wb")
            self._blob, self._offset, self._digest = blob, 0, hashlib.sha256()
        elif blob != self._blob:
            raise InvalidRequest(f"blob {self._blob} ended without its last part — upload it again")
        elif offset != self._offset:
            raise InvalidRequest(f"blob {blob}: part at offset {offset}, expected {self._offset}")
        if self._offset + len(data) > MAX_BLOB_BYTES:
            raise InvalidRequest(f"blob {blob} is larger than the limit of {MAX_BLOB_BYTES} bytes")
        if self.budget is not None and self.bytes + self._offset + len(data) > self.budget:
            self.over = True
            raise ResourceUnavailable(
                f"storage quota exceeded: this upload brings more than the {format_size(self.budget)} you may "
                "still keep — nothing of it was stored; remove snapshots or outputs you no longer need "
                "(`gpuport snapshots rm NAME_OR_ID`), or ask an admin for more (`gpuport quota set USER --storage SIZE`)"
            )
        assert self._file is not None
        self._file.write(data)
        self._digest.update(data)
        self._offset += len(data)
        if last:
            self._close(blob)

    def _close(self, blob: str) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        actual = self._digest.hexdigest()
        if actual != blob:
            raise InvalidRequest(
                f"the bytes uploaded as blob {blob} hash to {actual} — the file changed while it was "
                "uploaded, or the upload was corrupted; nothing was stored, sync again"
            )
        self.store._place(self._temp, blob)
        self._temp = ""
        self._blob = None
        self.placed.append(blob)
        self.bytes += self._offset

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._temp:
            Path(self._temp).unlink(missing_ok=True)
            self._temp = ""
        self._blob = None

    def finish(self) -> None:
        if self._blob is not None:
            blob = self._blob
            self.abort()
            raise InvalidRequest(f"the upload stream ended inside blob {blob} — upload it again")


class BlobSink:
    """Blobs received into reused buffers and written and hashed by ``writers`` threads, each blob
    by one of them: writing files is most of a first push on the server (the page cache's new
    pages). On the 2-core VM two threads wrote 280 MB of new files in 309 ms where one took 600,
    and a first push took 588–692 ms against 588–829 with one writer (tmpfs, in turns).

    The receiving thread fills a buffer from ``buffer()`` with parts, records each with ``part()``,
    and hands it over with ``send()``; a part continuing a blob goes to the thread that has it.
    ``finish()`` (or ``abort()``) waits for the threads. A thread's error (a blob that does not hash
    to its name) is raised by the next ``send()`` or by ``finish()``; the blobs placed before it stay.
    """

    def __init__(self, store: BlobStore, writers: int = 2, buffers: int = 8, buffer_bytes: int = 1 << 20) -> None:
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(buffers):
            self._free.put(bytearray(buffer_bytes))
        self._queues: list[queue.SimpleQueue[_Filled | None]] = [queue.SimpleQueue() for _ in range(writers)]
        self._writers = [BlobWriter(store) for _ in range(writers)]
        self._backlog = [0] * writers  # bytes handed to each thread and not yet written
        self._errors: list[BaseException] = []
        self._owner = -1  # the thread writing the blob left open by the last send, if any
        self._filled: _Filled | None = None
        self._threads = [
            threading.Thread(target=self._write, args=(i,), name=f"blob writer {i}", daemon=True)
            for i in range(writers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def placed(self) -> list[str]:
        return [blob for writer in self._writers for blob in writer.placed]

    @property
    def bytes(self) -> int:
        return sum(writer.bytes for writer in self._writers)

    def buffer(self) -> bytearray:
        """A free buffer to fill (waits for one while every buffer is being written)."""
        buffer = self._free.get()
        self._filled = _Filled(buffer, [])
        return buffer

    def part(self, blob: str, offset: int, start: int, size: int, last: bool) -> None:
        """Bytes ``start`` to ``start + size`` of the current buffer are ``blob``'s at ``offset``."""
        assert self._filled is not None
        self._filled.parts.append((blob, offset, start, size, last))

    def send(self) -> None:
        """Hand the current buffer's parts over to be written."""
        filled, self._filled = self._filled, None
        if self._errors:
            if filled is not None:
                self._free.put(filled.buffer)
            raise self._errors[0]
        if filled is None or not filled.parts:
            if filled is not None:
                self._free.put(filled.buffer)
            return
        first, last = filled.parts[0], filled.parts[-1]
        if first[1] and self._owner >= 0:  # goes on with the blob the last buffer left open
            index = self._owner
        else:
            index = min(range(len(self._queues)), key=self._backlog.__getitem__)
        self._owner = -1 if last[4] else index
        filled.bytes = sum(part[3] for part in filled.parts)
        self._backlog[index] += filled.bytes  # lowered by the writer thread: only ever an estimate
        self._queues[index].put(filled)

    def finish(self) -> None:
        """Wait for every part to be written; raise the first error met."""
        self._stop()
        for writer in self._writers:
            if self._errors:
                break
            try:
                writer.finish()
            except InvalidRequest as e:
                self._errors.append(e)
        if self._errors:
            self.abort()
            raise self._errors[0]

    def abort(self) -> None:
        """Stop, and remove what was not placed (nothing, after ``finish()``); may be called again."""
        self._stop()
        for writer in self._writers:
            writer.abort()

    def _stop(self) -> None:
        if self._filled is not None:
            self._free.put(self._filled.buffer)
            self._filled = None
        if not self._threads:
            return  # stopped already
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _write(self, index: int) -> None:
        writer = self._writers[index]
        while (filled := self._queues[index].get()) is not None:
            try:
                if not self._errors:
                    with memoryview(filled.buffer) as view:
                        for blob, offset, start, size, last in filled.parts:
                            writer.write_part(blob, offset, view[start : start + size], last)
            except BaseException as e:  # raised in the receiving thread
                self._errors.append(e)
                writer.abort()
            finally:
                self._backlog[index] -= filled.bytes
                self._free.put(filled.buffer)


@dataclass
class _Filled:
    buffer: bytearray
    parts: list[tuple[str, int, int, int, bool]]  # blob, offset, start in the buffer, size, last
    bytes: int = 0


class Part(Protocol):
    @property
    def blob(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def data(self) -> bytes: ...
    @property
    def last(self) -> bool: ...


def read_parts(store: BlobStore, blobs: Iterable[str], part_bytes: int) -> Iterator[tuple[str, int, bytes, bool]]:
    """(blob, offset, data, last) for each blob in turn, ``part_bytes`` at most per part."""
    for blob in blobs:
        with store.open(blob) as f:
            offset = 0
            data = f.read(part_bytes)
            while True:
                following = f.read(part_bytes) if len(data) == part_bytes else b""
                yield blob, offset, data, not following
                if not following:
                    break
                offset += len(data)
                data = following


@dataclass(frozen=True)
class Entry:
    """A file of a snapshot's manifest: its path, its blob (empty for a symlink), size, mode and link."""

    path: str
    blob: str  # empty for a symlink
    size: int
    mode: int
    link: str = ""


def write_entries(entries: Iterable[Entry], blobs: BlobStore, dest: Path, *, read_only: bool = False) -> None:
    """Write a manifest's files under ``dest`` from ``blobs`` (copies; read-only hard links with ``read_only``)."""
    dest.mkdir(parents=True, exist_ok=True)
    made: set[str] = set()
    for e in entries:
        target = dest / e.path
        parent = os.path.dirname(e.path)
        if parent and parent not in made:
            target.parent.mkdir(parents=True, exist_ok=True)
            made.add(parent)
        if e.link:
            os.symlink(e.link, target)
        elif read_only:
            blobs.link_to(e.blob, target)
        else:
            blobs.copy_to(e.blob, target, e.mode)
