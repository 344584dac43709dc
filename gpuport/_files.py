"""File helpers used by both the client and the server: writes a crash cannot leave half done, file hashes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path`` with ``mode``, then rename it into place.

    ``durable`` also flushes it to disk before the rename (a crash then leaves the old or the new file).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: Path | str) -> tuple[str, int]:
    """SHA-256 hex and size of the file at ``path`` (a file's blob id, on either side)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
