"""Folder sync by content hash: scan a folder, send its manifest, upload only the blobs the server lacks.

Scanning honours ``.gitignore`` and ``.gpuportignore`` files (in any folder, git's rules) and always
skips ``.git``, ``__pycache__``, virtualenvs (a folder holding ``pyvenv.cfg``) and the
``gpuport-outputs`` folder at the top. Hashes are cached per folder by (size, mtime, inode), so a
re-sync of an unchanged project reads no file and costs one call. Downloads go the other way and
fetch only files whose content differs from what is already there.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from gpuport._files import atomic_write, sha256_file
from gpuport.defaults import BLOB_BATCH_BYTES, DEFAULT_OUTPUT_DIR, ENV_CACHE_DIR, MAX_SNAPSHOT_FILES
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import ConnectionFailed, InvalidRequest
from gpuport.protocol.paths import check_link, check_path

if TYPE_CHECKING:
    import socket
    from concurrent.futures import Executor

    import pathspec

# progress(done_bytes, total_bytes)
Progress = Callable[[int, int], None]

_ALWAYS_SKIPPED = {".git", "__pycache__", ".hg", ".svn"}
_IGNORE_FILES = (".gitignore", ".gpuportignore")
# A hash is cached only for a file unchanged for this long: a write within the same mtime tick
# as the hashing would otherwise go unseen.
_SETTLED_NS = 2_000_000_000
_HASH_THREADS = 2
# Files are hashed in rounds this large; each round's missing blobs start uploading at once.
_ROUND_BYTES = 32 * 1024 * 1024
_ROUND_FILES = 512


@dataclass(slots=True)
class LocalFile:
    path: str  # snapshot path
    full: str  # where it is on disk
    size: int
    mode: int
    blob: str = ""
    link: str = ""
    mtime_ns: int = 0
    ino: int = 0


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE_DIR) or platformdirs.user_cache_dir("gpuport", appauthor=False))


class _Ignore:
    """The ignore files met on the way down, each applying below its own folder."""

    def __init__(self, specs: tuple[tuple[str, pathspec.PathSpec], ...] = ()) -> None:
        self.specs = specs

    def below(self, folder: str, full: str, names: set[str]) -> _Ignore:
        """The rules below ``folder`` (at ``full``, holding the files ``names``)."""
        lines: list[str] = []
        for name in _IGNORE_FILES:
            if name not in names:
                continue
            try:
                with open(os.path.join(full, name), encoding="utf-8", errors="replace") as f:
                    lines += f.read().splitlines()
            except OSError:
                continue
        if not lines:
            return self
        import pathspec  # here: most folders have no ignore file, and every command would pay for it

        return _Ignore((*self.specs, (folder, pathspec.GitIgnoreSpec.from_lines(lines))))

    def ignored(self, path: str, is_dir: bool) -> bool:
        verdict = False
        for base, spec in self.specs:  # deeper files come later and decide last, as in git
            relative = path[len(base) + 1 :] if base else path
            result = spec.check_file(relative + "/" if is_dir else relative)
            if result.include is not None:
                verdict = result.include
        return verdict


def scan(root: Path) -> list[LocalFile]:
    """Every file to sync under ``root``, unhashed. Raises ``InvalidRequest`` for a symlink leaving ``root``."""
    if not root.is_dir():
        raise InvalidRequest(f"workdir {root} is not a folder")
    real_root = os.path.realpath(root)
    found: list[LocalFile] = []

    def walk(folder: str, full: str, ignore: _Ignore) -> None:
        with os.scandir(full) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        ignore = ignore.below(folder, full, {e.name for e in entries})
        for entry in entries:
            path = f"{folder}/{entry.name}" if folder else entry.name
            if entry.name in _ALWAYS_SKIPPED or (not folder and entry.name == DEFAULT_OUTPUT_DIR):
                continue
            try:
                path.encode()
            except UnicodeEncodeError:
                raise InvalidRequest(
                    f"{os.path.join(root, path)!r}: the name is not valid UTF-8 — rename it, "
                    "or add it to .gpuportignore"
                ) from None
            is_link = entry.is_symlink()
            is_dir = not is_link and entry.is_dir()
            if ignore.ignored(path, is_dir):
                continue
            if is_link:
                found.append(_link(real_root, root, path, entry.path))
            elif is_dir:
                if os.path.exists(os.path.join(entry.path, "pyvenv.cfg")):
                    continue  # a virtualenv: rebuilt on the server, never copied
                walk(path, entry.path, ignore)
            elif entry.is_file():
                info = entry.stat()
                found.append(
                    LocalFile(
                        path,
                        entry.path,
                        info.st_size,
                        stat.S_IMODE(info.st_mode),
                        mtime_ns=info.st_mtime_ns,
                        ino=info.st_ino,
                    )
                )
            if len(found) > MAX_SNAPSHOT_FILES:
                raise InvalidRequest(
                    f"{root} holds more than {MAX_SNAPSHOT_FILES} files — add what the job does not need "
                    "to .gpuportignore, or push large data once as a dataset"
                )

    walk("", str(root), _Ignore())
    return found


def _link(real_root: str, root: Path, path: str, full: str) -> LocalFile:
    target = os.readlink(full)
    resolved = os.path.realpath(full)
    if resolved != real_root and not resolved.startswith(real_root + os.sep):
        raise InvalidRequest(
            f"{os.path.join(root, path)} is a symlink to {target}, outside the workdir {root} — nothing was "
            "uploaded. Copy what it points to into the workdir, or add the link to .gpuportignore"
        )
    link = os.path.relpath(resolved, os.path.dirname(os.path.join(real_root, path)))
    check_link(path, link)
    return LocalFile(path, full, 0, 0o777, link=link)


def _hash(f: LocalFile) -> str:
    try:
        return sha256_file(f.full)[0]
    except FileNotFoundError:
        raise InvalidRequest(f"{f.path} vanished while the folder was being synced — sync again") from None


class HashCache:
    """(size, mtime, inode) → SHA-256 of each file of one folder, kept between runs in the user's cache dir."""

    def __init__(self, root: Path) -> None:
        key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]
        self.path = cache_dir() / "hashes" / f"{key}.json"
        try:
            self.entries: dict[str, list[int | str]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def split(self, files: list[LocalFile]) -> tuple[list[LocalFile], list[LocalFile]]:
        """(files whose hash is known, with it; files to hash). Symlinks count as known."""
        known, unknown = [], []
        for f in files:
            cached = None if f.link else self.entries.get(f.path)
            if f.link:
                known.append(f)
            elif cached and cached[0] == f.size and cached[1] == f.mtime_ns and cached[2] == f.ino:
                f.blob = str(cached[3])
                known.append(f)
            else:
                unknown.append(f)
        return known, unknown

    def hash_files(self, files: list[LocalFile], pool: Executor) -> list[LocalFile]:
        """Hash ``files`` on ``pool`` (hashlib releases the GIL) and remember the settled ones."""
        now = time.time_ns()
        done = []
        for f, blob in zip(files, pool.map(_hash, files), strict=True):
            f.blob = blob
            done.append(f)
            if now - f.mtime_ns > _SETTLED_NS:
                self.entries[f.path] = [f.size, f.mtime_ns, f.ino, blob]
                self.changed = True
        return done

    def save(self) -> None:
        if self.changed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Renamed into place but not fsynced: a cache lost in a crash only costs a re-hash.
            atomic_write(self.path, json.dumps(self.entries, separators=(",", ":")).encode(), durable=False)


def manifest(files: Iterable[LocalFile]) -> list[pb.ManifestEntry]:
    return [pb.ManifestEntry(path=f.path, blob=f.blob, size=f.size, mode=f.mode, link=f.link) for f in files]


def rounds(files: list[LocalFile]) -> Iterator[list[LocalFile]]:
    """``files`` in groups of about _ROUND_BYTES or _ROUND_FILES, whichever comes first."""
    group: list[LocalFile] = []
    size = 0
    for f in files:
        group.append(f)
        size += f.size
        if size >= _ROUND_BYTES or len(group) >= _ROUND_FILES:
            yield group
            group, size = [], 0
    if group:
        yield group


class UploadQueue:
    """Files to upload, added while earlier ones are already on their way; ``close()`` ends the stream."""

    _END = None

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[LocalFile | None] = queue.SimpleQueue()
        self._queued: set[str] = set()
        self.files = 0
        self.bytes = 0
        self._ended = False  # its end was taken

    def add(self, f: LocalFile) -> None:
        if f.blob not in self._queued:
            self._queued.add(f.blob)
            self.files += 1
            self.bytes += f.size
            self._queue.put(f)

    def close(self) -> None:
        self._queue.put(self._END)

    def __iter__(self) -> Iterator[LocalFile]:
        if self._ended:
            return
        while (f := self._queue.get()) is not self._END:
            yield f
        self._ended = True

    def drain(self) -> None:
        """Take what is left, up to the end, so that whoever adds files never waits on a dead stream."""
        for _ in self:
            pass


def upload_batches(files: UploadQueue, progress: Progress | None) -> Iterator[pb.BlobBatch]:
    """The upload stream: each file's bytes as parts, packed into messages of about BLOB_BATCH_BYTES.

    Progress counts against the bytes queued so far (the queue grows while files are hashed).
    """
    done = 0
    batch = pb.BlobBatch()
    size = 0
    for f in files:
        with open(f.full, "rb", buffering=0) as src:
            offset = 0
            while True:
                data = src.read(BLOB_BATCH_BYTES - size if size else BLOB_BATCH_BYTES)
                last = offset + len(data) >= f.size or not data
                batch.parts.append(pb.BlobPart(blob=f.blob, offset=offset, data=data, last=last))
                offset += len(data)
                size += len(data) + 100
                done += len(data)
                if size >= BLOB_BATCH_BYTES:
                    yield batch
                    if progress:
                        progress(done, files.bytes)
                    batch, size = pb.BlobBatch(), 0
                if last:
                    break
    if batch.parts:
        yield batch
    if progress:
        progress(done, files.bytes)


_BLOB_HEAD = struct.Struct("<c64sQ")  # as the server's data port reads it: F or Z, blob id, size
_BLOBS_DONE = struct.Struct("<QQ")
_SEND_BYTES = 1024 * 1024  # small files are packed into sends of about this much
_READ_BYTES = 4 * 1024 * 1024  # a large file is sent in pieces of this much


def send_blobs(conn: socket.socket, files: UploadQueue, progress: Progress | None) -> tuple[int, int]:
    """Upload the queue's files on a data-port connection (its ticket sent) until the queue is
    closed: each a header and its bytes, small ones packed together. Returns what the server says
    it placed (blobs, bytes); raises ``InvalidRequest`` with its reason where it refused one."""
    said = _receive_exactly(conn, 1)
    if said != b"B":
        raise _refused(conn, said)
    done = told = 0
    packed = bytearray()
    piece = bytearray(_READ_BYTES)
    for f in files:
        with open(f.full, "rb", buffering=0) as src:
            if os.fstat(src.fileno()).st_size != f.size:
                raise _changed(f)
            packed += _BLOB_HEAD.pack(b"F", f.blob.encode(), f.size)
            if f.size <= _SEND_BYTES:
                data = src.read(f.size)
                if len(data) != f.size:
                    raise _changed(f)
                packed += data
            else:
                conn.sendall(packed)
                packed.clear()
                left = f.size
                with memoryview(piece) as view:
                    while left:
                        n = src.readinto(view[: min(left, _READ_BYTES)])
                        if not n:
                            raise _changed(f)
                        conn.sendall(view[:n])
                        left -= n
        done += f.size
        if len(packed) >= _SEND_BYTES:
            conn.sendall(packed)
            packed.clear()
        if progress and done - told >= _SEND_BYTES:
            progress(done, files.bytes)
            told = done
    conn.sendall(packed + _BLOB_HEAD.pack(b"Z", b"", 0))
    said = _receive_exactly(conn, 1)
    if said != b"K":
        raise _refused(conn, said)
    if progress:
        progress(done, files.bytes)
    placed, size = _BLOBS_DONE.unpack(_receive_exactly(conn, _BLOBS_DONE.size))
    return placed, size


def _changed(f: LocalFile) -> InvalidRequest:
    return InvalidRequest(f"{f.path} changed while the folder was being synced — sync again")


def _receive_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionFailed("the server's data port closed the connection during an upload — sync again")
        data += chunk
    return data


def _refused(conn: socket.socket, said: bytes) -> Exception:
    """The error the server answered with ``said`` (``E``, then why, one line)."""
    if said != b"E":
        return ConnectionFailed(f"the server's data port answered {said!r} to an upload — is it a gpuport server?")
    why = bytearray()
    while not why.endswith(b"\n") and len(why) < 4096 and (chunk := conn.recv(1)):
        why += chunk
    return InvalidRequest(why.decode("utf-8", "replace").strip() or "the server refused the upload")


def prefetched(batches: Iterator[pb.BlobBatch], depth: int = 2) -> Iterator[bytes]:
    """``batches``, encoded, made up to ``depth`` ahead in a thread of their own.

    gRPC sends one message at a time and waits for it to leave; meanwhile the next files are read
    and encoded here, instead of after.
    """
    ready: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(item: bytes | BaseException | None) -> bool:
        """Queue ``item`` unless the consumer has gone; say whether it was queued."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not offer(batch.SerializeToString()):
                    return
            offer(None)
        except BaseException as e:  # handed to the consumer
            offer(e)

    threading.Thread(target=produce, name="gpuport upload reader", daemon=True).start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def select(entries: Iterable[pb.ManifestEntry], path: str | None) -> list[pb.ManifestEntry]:
    """The entries at ``path`` or below it (all of them for None)."""
    if path is None or path.strip("/") in ("", "."):
        return list(entries)
    path = check_path(path, what="path")
    chosen = [e for e in entries if e.path == path or e.path.startswith(path + "/")]
    if not chosen:
        raise InvalidRequest(f"the outputs hold nothing at {path!r}")
    return chosen


def already_there(dest: Path, entry: pb.ManifestEntry) -> bool:
    target = dest / entry.path
    if entry.link:
        return target.is_symlink() and os.readlink(target) == entry.link
    try:
        info = target.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == entry.size and sha256_file(target)[0] == entry.blob


def place(
    dest: Path, entries: list[pb.ManifestEntry], blobs: Iterator[pb.BlobBatch], progress: Progress | None
) -> None:
    """Write ``entries`` under ``dest`` from a download stream of their blobs (each blob sent once)."""
    by_blob: dict[str, list[pb.ManifestEntry]] = {}
    for e in entries:
        if e.link:
            target = dest / e.path
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.exists():
                target.unlink()
            os.symlink(e.link, target)
        else:
            by_blob.setdefault(e.blob, []).append(e)
    total = sum(group[0].size for group in by_blob.values())
    done = 0
    current = None
    temp: Path | None = None
    digest = hashlib.sha256()
    try:
        for batch in blobs:
            for part in batch.parts:
                if part.blob not in by_blob:
                    raise InvalidRequest(f"the server sent blob {part.blob}, which was not asked for")
                if current is None:
                    first = by_blob[part.blob][0]
                    target = dest / first.path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    temp = target.with_name(f".{target.name}.gpuport-tmp")
                    current, digest = open(temp, "wb"), hashlib.sha256()
                data = part.data  # a copy out of the message: taken once
                current.write(data)
                digest.update(data)
                done += len(data)
                if part.last:
                    current.close()
                    current = None
                    assert temp is not None
                    if digest.hexdigest() != part.blob:
                        raise InvalidRequest(
                            f"blob {part.blob} arrived damaged (its hash does not match) — download again"
                        )
                    group = by_blob.pop(part.blob)
                    for e in group[1:]:  # the same content at other paths, maybe in other folders
                        (dest / e.path).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(temp, dest / e.path)
                        os.chmod(dest / e.path, e.mode & 0o777)
                    os.chmod(temp, group[0].mode & 0o777)
                    os.replace(temp, dest / group[0].path)
                    temp = None
            if progress:
                progress(done, total)
    finally:
        if current is not None:
            current.close()
        if temp is not None:
            temp.unlink(missing_ok=True)
    if by_blob:
        raise InvalidRequest(f"the download ended before {len(by_blob)} file(s) arrived — download again")
