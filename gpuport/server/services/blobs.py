"""The blob store: file contents kept once, under their SHA-256, shared by every snapshot and output.

Layout: ``STATE_DIR/blobs/ab/cdef...`` (read-only files) and ``STATE_DIR/blobs/tmp/`` for uploads in
flight. A blob appears under its name only after its bytes were checked against it, so a reader
never sees a partial or wrong blob.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from gpuport.defaults import MAX_BLOB_BYTES
from gpuport.protocol.errors import InvalidRequest

_HASH = re.compile(r"[0-9a-f]{64}")
_READ_BYTES = 1024 * 1024


def check_hash(blob: str) -> str:
    if not _HASH.fullmatch(blob):
        raise InvalidRequest(f"{blob[:80]!r} is not a blob id (64 lowercase hex digits of SHA-256)")
    return blob


def hash_file(path: Path | str) -> tuple[str, int]:
    """SHA-256 hex and size of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        for stale in self.tmp.iterdir():  # uploads cut off by a restart: their senders upload again
            stale.unlink(missing_ok=True)

    def path(self, blob: str) -> Path:
        return self.root / blob[:2] / blob[2:]

    def has(self, blob: str) -> bool:
        return self.path(blob).exists()

    def sizes(self, blobs: Iterable[str]) -> dict[str, int | None]:
        """Each blob's size, or None for a blob the store lacks (one stat each)."""
        root = str(self.root)
        sizes: dict[str, int | None] = {}
        for blob in blobs:
            if blob not in sizes:
                try:
                    sizes[blob] = os.stat(f"{root}/{blob[:2]}/{blob[2:]}").st_size
                except FileNotFoundError:
                    sizes[blob] = None
        return sizes

    def _place(self, temp: str, blob: str) -> None:
        target = self.path(blob)
        target.parent.mkdir(exist_ok=True)
        os.chmod(temp, 0o444)
        os.replace(temp, target)

    def writer(self) -> BlobWriter:
        return BlobWriter(self)

    def ingest(self, path: Path) -> tuple[str, int]:
        """Add the file at ``path`` to the store (a hard link when it is new); return its hash and size."""
        blob, size = hash_file(path)
        if not self.has(blob):
            fd, temp = tempfile.mkstemp(dir=self.tmp)
            os.close(fd)
            try:
                os.unlink(temp)
                try:
                    os.link(path, temp)
                except OSError:
                    shutil.copyfile(path, temp)
                self._place(temp, blob)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
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
    """Receives the parts of an upload stream, in order, and places each blob once its hash checks out."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self.blobs = 0
        self.bytes = 0
        self._blob: str | None = None
        self._file: BinaryIO | None = None
        self._temp = ""
        self._digest = hashlib.sha256()
        self._offset = 0

    def write(self, blob: str, offset: int, data: bytes, last: bool) -> None:
        if blob != self._blob:
            if self._blob is not None:
                raise InvalidRequest(f"blob {self._blob} ended without its last part — upload it again")
            check_hash(blob)
            if offset != 0:
                raise InvalidRequest(f"blob {blob} starts at offset {offset}, not 0 — upload it again from the start")
            fd, self._temp = tempfile.mkstemp(dir=self.store.tmp)
            self._file = os.fdopen(fd, "wb")
            self._blob, self._digest, self._offset = blob, hashlib.sha256(), 0
        assert self._file is not None
        if offset != self._offset:
            raise InvalidRequest(f"blob {blob}: part at offset {offset}, expected {self._offset}")
        if self._offset + len(data) > MAX_BLOB_BYTES:
            raise InvalidRequest(f"blob {blob} is larger than the limit of {MAX_BLOB_BYTES} bytes")
        self._file.write(data)
        self._digest.update(data)
        self._offset += len(data)
        if last:
            self._file.close()
            self._file = None
            actual = self._digest.hexdigest()
            if actual != blob:
                self.abort()
                raise InvalidRequest(
                    f"the bytes uploaded as blob {blob} hash to {actual} — the file changed while it was "
                    "uploaded, or the upload was corrupted; nothing was stored, sync again"
                )
            self.store._place(self._temp, blob)
            self.blobs += 1
            self.bytes += self._offset
            self._blob = None

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._temp:
            Path(self._temp).unlink(missing_ok=True)
        self._blob = None

    def finish(self) -> None:
        if self._blob is not None:
            blob = self._blob
            self.abort()
            raise InvalidRequest(f"the upload stream ended inside blob {blob} — upload it again")


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
