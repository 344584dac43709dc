"""File helpers used by both the client and the server: writes a crash cannot leave half done, file
hashes, and reading what a job wrote without following its symlinks."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path`` with ``mode``, then rename it into place.

    ``durable`` also flushes it to disk before the rename (a crash then leaves the old or the new file).
    """
    import tempfile  # here: most commands write no file

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
    import hashlib  # here: reading a profile hashes nothing, and hashlib loads OpenSSL

    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO does not hang the open


def open_beneath(root: Path, relative: str) -> int | None:
    """Open ``root/relative`` (a file or a folder) without following a symlink at any component of
    ``relative``; returns the fd, or None where it is missing, a symlink, or neither a file nor a
    folder. For what a job wrote, which may hold links to anywhere (``a -> /`` in ``a/b``)."""
    parts = relative.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, part in enumerate(parts):
            try:
                inner = os.open(part, _NOFOLLOW, dir_fd=fd)
            except OSError:  # missing, or a symlink (ELOOP)
                return None
            os.close(fd)
            fd = inner
            kind = os.fstat(fd).st_mode
            if not (stat.S_ISDIR(kind) or index == len(parts) - 1 and stat.S_ISREG(kind)):
                return None
        opened, fd = fd, -1
        return opened
    finally:
        if fd >= 0:
            os.close(fd)


def open_nofollow(path: Path) -> BinaryIO:
    """Open the regular file at ``path`` for reading, where its last component must not be a symlink
    (a file in a folder a job may write); raises OSError otherwise (ELOOP for a link)."""
    opened = open_file_beneath(path.parent, path.name)
    if opened is None:
        raise FileNotFoundError(f"{path} is missing, a symlink, or not a regular file")
    return opened


def files_beneath(root: Path, relative: str = "") -> Iterator[str]:
    """The paths (relative to ``root``) of the regular files in the folder ``root/relative``, without
    following a symlink anywhere, ``relative`` included; nothing when that is not a folder."""
    fd = open_beneath(root, relative) if relative else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if fd is None:
        return
    try:
        for top, _, names, top_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in names:
                try:
                    info = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
                except OSError:  # gone meanwhile
                    continue
                if stat.S_ISREG(info.st_mode):
                    yield os.path.normpath(os.path.join(relative, top, name))
    finally:
        os.close(fd)


def open_file_beneath(root: Path, relative: str, owner: int | None = None) -> BinaryIO | None:
    """``open_beneath`` for a regular file, as a file object; None where it is not one, or where
    ``owner`` is given and does not own it (a hard link a job made to a file it could not read)."""
    fd = open_beneath(root, relative)
    if fd is None:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or owner is not None and info.st_uid != owner:
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def read_small_beneath(root: Path, relative: str, limit: int = 65536) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``root/relative``, opened as ``open_beneath``
    does (no symlink followed, a FIFO never waited on); None where it is not one."""
    opened = open_file_beneath(root, relative)
    if opened is None:
        return None
    with opened:
        return opened.read(limit)


def let_read(folder: Path) -> None:
    """Make the tree under ``folder`` readable by any uid that is shown it: folders 0755, regular
    files +r (the server's own, with one link: a blob's hard links stay as they are, 0444).

    Only on descriptors, from ``os.fwalk`` (which never follows a symlink, and checks each folder it
    enters is the one it listed): a tree a job can write, or could have written, may swap a folder
    for a symlink at any moment, and a ``chmod`` by path, as root, would then change a file of the
    host's."""
    for _, _, names, top_fd in os.fwalk(folder, follow_symlinks=False):
        os.fchmod(top_fd, 0o755)
        for name in names:
            try:  # O_PATH: opens even a FIFO or a device without touching it
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top_fd)
            except OSError:
                continue  # gone meanwhile
            try:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_uid == os.getuid():
                    os.chmod(f"/proc/self/fd/{fd}", info.st_mode & 0o777 | 0o044)  # that inode, not a path
            finally:
                os.close(fd)


def own_folder(folder: Path, uid: int) -> None:
    """Give the folder ``folder`` itself (not what is in it) to ``uid``, mode 0700, through a
    descriptor opened without following a symlink."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, uid, uid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def own_tree(folder: Path, uid: int) -> None:
    """Give everything under ``folder`` (and it) to ``uid``, without following a symlink (``lchown``
    of a link changes the link)."""
    for _, folders, names, top_fd in os.fwalk(folder, follow_symlinks=False):
        os.fchown(top_fd, uid, uid)
        for name in folders + names:  # a symlink to a folder is listed in ``folders``, not entered
            os.chown(name, uid, uid, dir_fd=top_fd, follow_symlinks=False)


def seal_tree(folder: Path) -> None:
    """Make the tree under ``folder`` read-only to everyone: folders 0555, files without their write
    bits (their execute bits kept). Through descriptors, without following a symlink; for a tree no
    other uid can change any more (an environment once built, see ``server/environments.py``)."""
    for _, folders, names, top_fd in os.fwalk(folder, follow_symlinks=False):
        for name in names:
            try:
                info = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                os.chmod(name, info.st_mode & 0o555 | 0o444, dir_fd=top_fd, follow_symlinks=False)
        del folders  # entered by fwalk in turn, and made read-only there
        os.fchmod(top_fd, 0o555)
