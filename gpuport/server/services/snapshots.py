"""Snapshots: a folder at one moment, as a manifest of path → blob (+ mode, or a symlink target).

A snapshot's id is the SHA-256 of its canonical manifest, so the same folder synced twice is the
same snapshot and a no-change re-sync costs one call. Snapshots belong to their owner; a name
given with ``gpuport push`` points at one of them (projects and datasets for later jobs).
"""

from __future__ import annotations

import bz2
import contextlib
import functools
import gzip
import json
import lzma
import os
import re
import stat
import struct
import tarfile
import threading
import time
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gpuport.defaults import (
    MAX_ARCHIVE_EXPANSION,
    MAX_ARCHIVE_MEMBERS,
    MAX_ARCHIVE_UNPACKED_BYTES,
    MAX_ARCHIVE_UNPACKED_FLOOR,
    MAX_BLOB_BYTES,
    MAX_NAME_LENGTH,
    MAX_PATH_BYTES,
    MAX_SNAPSHOT_FILES,
)
from gpuport.protocol.errors import InvalidRequest, NotFound, ResourceUnavailable
from gpuport.protocol.paths import check_entries, check_path, snapshot_id
from gpuport.protocol.units import format_size
from gpuport.server.blobs import BlobStore, Entry, check_hash, write_entries
from gpuport.server.services.auth import Identity
from gpuport.server.store import Store

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CACHED_MANIFESTS = 64
_SQL_CHUNK = 500  # blobs per `IN (...)` query: under SQLite's limit on bound parameters


@dataclass(frozen=True)
class SnapshotRecord:
    id: str
    owner: str
    name: str
    created_at: float
    files: int
    bytes: int


class OverBudget(ResourceUnavailable):
    """Files to keep add up to more than the bytes their owner may still keep."""

    def __init__(self, total: int) -> None:
        super().__init__(f"{total} bytes is more than the storage left")
        self.total = total  # bytes counted when the budget was passed


def check_snapshot_name(name: str) -> str:
    if len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"snapshot name {name[:80]!r} is not valid — use up to {MAX_NAME_LENGTH} letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return name


def check_manifest(entries: list[Entry]) -> list[Entry]:
    """Validate a manifest from a client; return it sorted by path. Raises ``InvalidRequest``."""
    if len(entries) > MAX_SNAPSHOT_FILES:
        raise InvalidRequest(f"the snapshot has {len(entries)} files; the limit is {MAX_SNAPSHOT_FILES}")
    check_entries(entries)
    for e in entries:
        if e.link:
            if e.blob:
                raise InvalidRequest(f"manifest entry {e.path!r} is both a symlink and a file")
            continue
        check_hash(e.blob)
        if not 0 <= e.size <= MAX_BLOB_BYTES:
            raise InvalidRequest(f"file {e.path!r} has size {e.size}, outside 0..{MAX_BLOB_BYTES}")
    return sorted(entries, key=lambda e: e.path)


class SnapshotService:
    def __init__(self, store: Store, blobs: BlobStore) -> None:
        self.store = store
        self.blobs = blobs
        self._manifests: OrderedDict[str, list[Entry]] = OrderedDict()
        self._cache_lock = threading.Lock()

    def create(self, caller: Identity, entries: list[Entry], name: str = "") -> tuple[SnapshotRecord | None, list[str]]:
        """Record the snapshot if every blob is present; else return the missing blobs and record nothing."""
        if name:
            check_snapshot_name(name)
        entries = check_manifest(entries)
        sid = snapshot_id(entries)
        if not self._owns(caller.name, sid):
            sizes = self.blobs.sizes(e.blob for e in entries if e.blob)
            missing = self.missing(caller, sizes)
            if missing:
                return None, missing
            # The blob's size is the truth; a manifest that lies about it would mislead downloads.
            for e in entries:
                if e.blob and sizes[e.blob] != e.size:
                    raise InvalidRequest(
                        f"file {e.path!r}: the manifest says {e.size} bytes, its blob has another size"
                    )
            self._insert(caller.name, sid, entries)
        self._name(caller.name, name, sid)
        return self._record(sid, caller.name, name), []

    def name(self, caller: Identity, sid: str, name: str) -> SnapshotRecord:
        """Name ``caller``'s snapshot ``sid`` ``name`` (none: nothing), as ``create`` does for a
        manifest it has; ``NotFound`` where the caller has no such snapshot."""
        if name:
            check_snapshot_name(name)
        if not self._owns(caller.name, sid):
            raise NotFound(f"you have no snapshot {sid[:80]!r} — send its manifest (Snapshots.Create)")
        self._name(caller.name, name, sid)
        return self._record(sid, caller.name, name)

    def _owns(self, owner: str, sid: str) -> bool:
        return self.store.query_one("SELECT 1 FROM snapshots WHERE id = ? AND owner = ?", (sid, owner)) is not None

    def _name(self, owner: str, name: str, sid: str) -> None:
        """Point ``owner``'s snapshot name ``name`` (none: nothing) at snapshot ``sid``."""
        if not name:
            return
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO snapshot_names (owner, name, snapshot_id, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (owner, name) DO UPDATE SET snapshot_id = excluded.snapshot_id, "
                "updated_at = excluded.updated_at",
                (owner, name, sid, time.time()),
            )

    def missing(self, caller: Identity, blobs: Iterable[str] | dict[str, int | None]) -> list[str]:
        """The blobs ``caller`` must upload: those the store lacks, and those it has from someone else.

        Answered per user, so that a hash tells nobody whether another user has that content, and a
        manifest cannot claim another user's file by its hash: a user holds a blob once they sent
        its bytes (``hold``) or a snapshot of theirs has it.
        """
        sizes = blobs if isinstance(blobs, dict) else self.blobs.sizes(blobs)
        present = [blob for blob, size in sizes.items() if size is not None]
        held: set[str] = set()
        for start in range(0, len(present), _SQL_CHUNK):
            chunk = present[start : start + _SQL_CHUNK]
            rows = self.store.query(
                f"SELECT blob FROM blob_holders WHERE owner = ? AND blob IN ({','.join('?' * len(chunk))})",
                (caller.name, *chunk),
            )
            held.update(row["blob"] for row in rows)
        return sorted(blob for blob in sizes if blob not in held)

    def hold(self, owner: str, blobs: Iterable[str]) -> None:
        """Record that ``owner`` has these blobs (they sent the bytes, or their job made them), and
        since now: the storage sweep spares a blob held lately, for the snapshot about to use it."""
        sizes = self.blobs.sizes(blobs)
        now = time.time()
        with self.store.transaction() as db:
            db.executemany(
                "INSERT INTO blob_holders (owner, blob, size, held_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (owner, blob) DO UPDATE SET size = excluded.size, held_at = excluded.held_at",
                ((owner, blob, size or 0, now) for blob, size in sizes.items()),
            )

    def new_bytes(self, owner: str, sizes: dict[str, int]) -> int:
        """The bytes of the blobs in ``sizes`` (blob → size) that ``owner`` does not hold yet: what
        holding them would add to their use."""
        held = set(sizes) - set(self.missing(Identity(owner, False), {b: 0 for b in sizes}))
        return sum(size for blob, size in sizes.items() if blob not in held)

    def remove(self, caller: Identity, name: str = "", sid: str = "") -> SnapshotRecord:
        """Drop the caller's snapshot named ``name`` (its name, and the snapshot unless another name,
        job, session or deployment of theirs uses it), or the snapshot ``sid`` (with every name
        pointing at it): its blobs are then collected by the storage sweep unless something else of
        the caller's holds them. Raises ``NotFound``, ``InvalidRequest`` (a snapshot still in use)."""
        record = self.resolve(caller, sid, name, owner=caller.name)
        with self.store.transaction() as db:
            if name:
                db.execute("DELETE FROM snapshot_names WHERE owner = ? AND name = ?", (caller.name, name))
            else:
                db.execute("DELETE FROM snapshot_names WHERE owner = ? AND snapshot_id = ?", (caller.name, record.id))
            named = db.execute(
                "SELECT 1 FROM snapshot_names WHERE owner = ? AND snapshot_id = ?", (caller.name, record.id)
            ).fetchone()
            used = db.execute(
                "SELECT 1 FROM jobs WHERE owner = ? AND state IN ('queued', 'running') "
                "AND (snapshot_id = ? OR spec LIKE ?) UNION ALL "
                "SELECT 1 FROM deployments WHERE owner = ? AND ended_at IS NULL AND snapshot_id = ?",
                (caller.name, record.id, f"%{record.id}%", caller.name, record.id),
            ).fetchone()
            if used is not None and not name:
                raise InvalidRequest(
                    f"snapshot {record.id[:12]} is in use by a queued or running job or a deployment — "
                    "remove it once they end"
                )
            if named is None and used is None:
                db.execute("DELETE FROM snapshots WHERE id = ? AND owner = ?", (record.id, caller.name))
                db.execute(
                    "UPDATE jobs SET output_snapshot_id = '' WHERE owner = ? AND output_snapshot_id = ?",
                    (caller.name, record.id),
                )
        return record

    def discard(self, owner: str, sid: str) -> None:
        """Drop ``owner``'s snapshot ``sid``, made for a moment (a running job's outputs as they were),
        unless a name, a job or a deployment of theirs uses it; the storage sweep then frees its blobs."""
        with self.store.transaction() as db:
            used = db.execute(
                "SELECT 1 FROM snapshot_names WHERE owner = ? AND snapshot_id = ? UNION ALL "
                "SELECT 1 FROM jobs WHERE owner = ? AND (output_snapshot_id = ? OR live_outputs = ?) UNION ALL "
                "SELECT 1 FROM jobs WHERE owner = ? AND state IN ('queued', 'running') "
                "AND (snapshot_id = ? OR spec LIKE ?) UNION ALL "
                "SELECT 1 FROM deployments WHERE owner = ? AND ended_at IS NULL AND snapshot_id = ?",
                (owner, sid, owner, sid, sid, owner, sid, f"%{sid}%", owner, sid),
            ).fetchone()
            if used is None:
                db.execute("DELETE FROM snapshots WHERE id = ? AND owner = ?", (sid, owner))

    def _insert(self, owner: str, sid: str, entries: list[Entry]) -> None:
        manifest = json.dumps([[e.path, e.blob, e.size, e.mode, e.link] for e in entries], separators=(",", ":"))
        self.hold(owner, {e.blob for e in entries if e.blob})
        with self.store.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO snapshots (id, owner, created_at, files, bytes, manifest) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (sid, owner, time.time(), len(entries), sum(e.size for e in entries), manifest),
            )

    def ingest_folder(
        self, owner: str, files: Iterable[tuple[str, BinaryIO]], budget: int | None = None
    ) -> SnapshotRecord:
        """Make a snapshot from files on the server's disk (a job's outputs): (snapshot path, open
        file) pairs, each read and closed here. A file read from elsewhere (another node) gives its
        mode as ``file_mode``. Past ``budget`` bytes (None: no limit), counted by each file's size
        before it is read (a sparse file at its full size), ``OverBudget``: nothing is recorded."""
        entries = []
        total = 0
        for path, file in files:
            with file:
                known = _size_of(file)
                if budget is not None and known is not None:
                    total += known
                    if total > budget:
                        raise OverBudget(total)
                blob, size = self.blobs.ingest(file)
                if budget is not None and known is None:  # its size known only once read (another node's)
                    total += size
                    if total > budget:
                        raise OverBudget(total)
                mode = getattr(file, "file_mode", None)
                if mode is None:
                    mode = os.fstat(file.fileno()).st_mode
                entries.append(Entry(path, blob, size, mode & 0o777))
        entries = check_manifest(entries)
        sid = snapshot_id(entries)
        self._insert(owner, sid, entries)
        return self._record(sid, owner, "")

    def record_archive(self, caller: Identity, entries: list[Entry], name: str = "") -> SnapshotRecord:
        """The snapshot of an archive's ``entries`` (from ``unpack_archive``), the caller's, named
        ``name`` when given: its blobs are in the store, and the caller now holds them."""
        if name:
            check_snapshot_name(name)
        entries = check_manifest(entries)
        sid = snapshot_id(entries)
        self._insert(caller.name, sid, entries)
        self._name(caller.name, name, sid)
        return self._record(sid, caller.name, name)

    def _record(self, sid: str, owner: str, name: str) -> SnapshotRecord:
        row = self.store.query_one(
            "SELECT created_at, files, bytes FROM snapshots WHERE id = ? AND owner = ?", (sid, owner)
        )
        assert row is not None
        return SnapshotRecord(sid, owner, name, row["created_at"], row["files"], row["bytes"])

    def resolve(
        self, caller: Identity, snapshot_id: str = "", name: str = "", owner: str | None = None
    ) -> SnapshotRecord:
        """The snapshot with this id, or under this name, owned by ``owner`` (default: the caller)."""
        owner = owner or caller.name
        if name:
            check_snapshot_name(name)
            row = self.store.query_one(
                "SELECT snapshot_id FROM snapshot_names WHERE owner = ? AND name = ?", (owner, name)
            )
            if row is None:
                raise NotFound(f"no snapshot named {name!r} — create it with `gpuport push DIR --name {name}`")
            snapshot_id = row["snapshot_id"]
        check_hash(snapshot_id)
        row = self.store.query_one("SELECT 1 FROM snapshots WHERE id = ? AND owner = ?", (snapshot_id, owner))
        if row is None and caller.admin:
            row = self.store.query_one("SELECT owner FROM snapshots WHERE id = ?", (snapshot_id,))
            if row is not None:
                owner = row["owner"]
        if row is None:
            raise NotFound(f"no snapshot {snapshot_id}")
        return self._record(snapshot_id, owner, name)

    def manifest(self, record: SnapshotRecord) -> list[Entry]:
        with self._cache_lock:  # also called from worker threads (a job's directory is made in one)
            cached = self._manifests.get(record.id)
            if cached is not None:
                self._manifests.move_to_end(record.id)
                return cached
        row = self.store.query_one(
            "SELECT manifest FROM snapshots WHERE id = ? AND owner = ?", (record.id, record.owner)
        )
        assert row is not None
        entries = [Entry(*item) for item in json.loads(row["manifest"])]
        with self._cache_lock:
            self._manifests[record.id] = entries
            if len(self._manifests) > _CACHED_MANIFESTS:
                self._manifests.popitem(last=False)
        return entries

    def named(self, caller: Identity) -> list[SnapshotRecord]:
        rows = self.store.query(
            "SELECT n.name, n.snapshot_id, s.created_at, s.files, s.bytes FROM snapshot_names n "
            "JOIN snapshots s ON s.id = n.snapshot_id AND s.owner = n.owner WHERE n.owner = ? ORDER BY n.name",
            (caller.name,),
        )
        return [
            SnapshotRecord(r["snapshot_id"], caller.name, r["name"], r["created_at"], r["files"], r["bytes"])
            for r in rows
        ]

    def materialize(self, record: SnapshotRecord, dest: Path, *, read_only: bool = False) -> None:
        """Write the snapshot's files under ``dest`` (copies; read-only hard links with ``read_only``)."""
        write_entries(self.manifest(record), self.blobs, dest, read_only=read_only)


def unpack_limit(archive_bytes: int) -> int:
    """The most bytes an archive of ``archive_bytes`` may unpack to: ``MAX_ARCHIVE_EXPANSION`` times
    its size, at least ``MAX_ARCHIVE_UNPACKED_FLOOR`` and at most ``MAX_ARCHIVE_UNPACKED_BYTES``. A
    project packs a few times smaller; a gzip of zeros (a bomb) a thousand times."""
    return min(MAX_ARCHIVE_UNPACKED_BYTES, max(MAX_ARCHIVE_UNPACKED_FLOOR, MAX_ARCHIVE_EXPANSION * archive_bytes))


def _too_many_members() -> InvalidRequest:
    return InvalidRequest(
        f"the archive has more than {MAX_ARCHIVE_MEMBERS} entries (files, folders and links count alike), "
        f"the limit — pack fewer, or push the folder with `gpuport push DIR`, where only files count "
        f"(up to {MAX_SNAPSHOT_FILES})"
    )


# An archive's members: (path, mode, symlink target or "", a function that opens a file's content).
_Member = tuple[str, int, str, Callable[[], BinaryIO]]
# Largest extended header (a long name, PAX records) a tar member may have: paths are short.
_MAX_TAR_EXTENSION = 1024 * 1024


class _Header(tarfile.TarInfo):
    """A tar header read within bounds: tarfile reads an extended header (a long name, PAX records)
    and a sparse file's map whole, so a bomb could make either gigabytes."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENSIONS and self.size > _MAX_TAR_EXTENSION:
            raise InvalidRequest(
                f"the archive has an extended tar header of {self.size} bytes; the limit is {_MAX_TAR_EXTENSION}"
            )
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _sparse(self.name)
        return super()._proc_member(tar)  # type: ignore[misc]

    def _proc_gnusparse_10(self, member: tarfile.TarInfo, pax_headers: dict[str, str], tar: tarfile.TarFile) -> None:
        raise _sparse(member.name)


_EXTENSIONS = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


def _sparse(name: str) -> InvalidRequest:
    return InvalidRequest(f"{name!r} in the archive is a sparse file: pack it without --sparse")


def _tar_members(archive: Path) -> Iterator[_Member]:
    try:
        with _decompressed(archive) as stream, tarfile.open(fileobj=stream, mode="r|", tarinfo=_Header) as tar:
            count = 0
            while (info := tar.next()) is not None:
                tar.members.clear()  # each header is read once and dropped: a stream holds none
                count += 1
                if count > MAX_ARCHIVE_MEMBERS:
                    raise _too_many_members()
                if info.isdir():
                    continue
                if info.issym():
                    yield info.name, 0, info.linkname, _no_content
                elif info.isfile():
                    yield info.name, info.mode, "", functools.partial(_tar_content, tar, info)
                else:
                    kind = "a hard link" if info.islnk() else "a device or FIFO"
                    raise InvalidRequest(
                        f"{info.name!r} in the archive is {kind}: only files, folders and symlinks are taken"
                    )
    except _UNREADABLE as e:
        raise InvalidRequest(f"the body is not a readable tar archive: {e}") from None


def _decompressed(archive: Path) -> BinaryIO:
    """The archive's bytes as a stream, unpacked by its first bytes (gzip, bzip2, xz; else as they
    are). These readers take concatenated streams, as ``tarfile``'s own stream mode does not."""
    with archive.open("rb") as file:
        magic = file.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(archive, "rb")  # type: ignore[return-value]
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(archive, "rb")  # type: ignore[return-value]
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(archive, "rb")  # type: ignore[return-value]
    return archive.open("rb")


def _tar_content(tar: tarfile.TarFile, info: tarfile.TarInfo) -> BinaryIO:
    file = tar.extractfile(info)
    assert file is not None  # a regular file's content
    return file  # type: ignore[return-value]


def _zip_members(archive: Path) -> Iterator[_Member]:
    try:
        with archive.open("rb") as raw:
            _count_zip_entries(raw)
            with zipfile.ZipFile(raw) as zipped:
                for info in zipped.infolist():
                    if info.is_dir():
                        continue
                    mode = info.external_attr >> 16
                    if stat.S_ISLNK(mode):
                        with zipped.open(info) as link:
                            target = link.read(MAX_PATH_BYTES + 1)  # a longer one is refused as too long
                        yield info.filename, 0, target.decode("utf-8", "surrogateescape"), _no_content
                    elif stat.S_IFMT(mode) and not stat.S_ISREG(mode):  # zips made elsewhere may give no type
                        raise InvalidRequest(f"{info.filename!r} in the archive is not a file, folder or symlink")
                    else:
                        yield info.filename, mode, "", functools.partial(zipped.open, info)
    except _UNREADABLE as e:
        raise InvalidRequest(f"the body is not a readable zip archive: {e}") from None


def _count_zip_entries(file: BinaryIO) -> None:
    """Refuse a zip whose central directory has more than ``MAX_ARCHIVE_MEMBERS`` entries, by
    walking it as ``zipfile`` will, before ``zipfile`` makes an object of each."""
    end = zipfile._EndRecData(file)  # type: ignore[attr-defined]
    if not end:
        return  # zipfile says what is wrong
    if end[zipfile._ECD_ENTRIES_TOTAL] > MAX_ARCHIVE_MEMBERS:  # type: ignore[attr-defined]
        raise _too_many_members()
    size, offset = end[zipfile._ECD_SIZE], end[zipfile._ECD_OFFSET]  # type: ignore[attr-defined]
    start = end[zipfile._ECD_LOCATION] - size  # type: ignore[attr-defined]
    if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:  # type: ignore[attr-defined]
        start -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator  # type: ignore[attr-defined]
    if start < 0 or offset < 0:
        return
    file.seek(start)
    walked = count = 0
    while walked < size:
        fixed = file.read(_ZIP_ENTRY.size)
        if len(fixed) < _ZIP_ENTRY.size:
            return
        count += 1
        if count > MAX_ARCHIVE_MEMBERS:
            raise _too_many_members()
        name, extra, comment = _ZIP_ENTRY.unpack(fixed)[-3:]
        file.seek(name + extra + comment, os.SEEK_CUR)
        walked += _ZIP_ENTRY.size + name + extra + comment


# A zip central directory entry's fixed part, up to the lengths of its name, extra field and comment.
_ZIP_ENTRY = struct.Struct("<28xHHH12x")
# What a damaged or hostile archive raises while read (gzip.BadGzipFile is an OSError).
_UNREADABLE = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError, NotImplementedError, ValueError)


def _no_content() -> BinaryIO:
    raise AssertionError("a symlink has no content")


class _Bounded:
    """An archive member's content, read up to ``left`` bytes (what remains of the archive's
    ``limit``): past it, InvalidRequest (a gzip or zip bomb); a damaged member is InvalidRequest too."""

    def __init__(self, file: BinaryIO, left: int, limit: int, kind: str) -> None:
        self.file, self.left, self.limit, self.kind = file, left, limit, kind

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > self.left + 1:
            size = self.left + 1
        try:
            data = self.file.read(size)
        except _UNREADABLE as e:
            raise InvalidRequest(f"the body is not a readable {self.kind} archive: {e}") from None
        self.left -= len(data)
        if self.left < 0:
            raise InvalidRequest(
                f"the archive unpacks to more than {format_size(self.limit)}, its limit: an archive may unpack "
                f"to {MAX_ARCHIVE_EXPANSION}x its size, at least {format_size(MAX_ARCHIVE_UNPACKED_FLOOR)} and "
                f"at most {format_size(MAX_ARCHIVE_UNPACKED_BYTES)} — send it uncompressed (application/x-tar) "
                "or push the folder with `gpuport push DIR`"
            )
        return data


def _size_of(file: BinaryIO) -> int | None:
    """The size of an open file on this machine (a sparse one's whole size); None for one read from
    elsewhere, which has no descriptor (``io.RawIOBase.fileno`` raises ``UnsupportedOperation``)."""
    try:
        return os.fstat(file.fileno()).st_size
    except (OSError, ValueError):
        return None


def unpack_archive(blobs: BlobStore, archive: Path, kind: str) -> list[Entry]:
    """The entries of a tar (``kind`` "tar", compressed or not) or zip (``kind`` "zip") archive on
    the server's disk, its files placed in ``blobs``, by the rules of a sync: relative, normalized
    paths, links that stay inside, only files, folders and symlinks, at most ``MAX_ARCHIVE_MEMBERS``
    entries of any kind, ``MAX_SNAPSHOT_FILES`` files and ``unpack_limit`` bytes unpacked. The
    archive is read as a stream, one member at a time. Raises ``InvalidRequest`` at the first member
    that breaks one (blobs already placed stay, as unreferenced blobs do). The server runs it in a
    process of its own (``server/unpacker.py``)."""
    limit = unpack_limit(archive.stat().st_size)
    entries: list[Entry] = []
    unpacked = 0
    with contextlib.closing(_tar_members(archive) if kind == "tar" else _zip_members(archive)) as members:
        for path, mode, link, opened in members:
            if len(entries) >= MAX_SNAPSHOT_FILES:
                raise InvalidRequest(
                    f"the archive has more than {MAX_SNAPSHOT_FILES} files, the limit — "
                    "split the project, or keep its many small files in fewer, larger ones"
                )
            path = check_path(path.removeprefix("./"), what="path in the archive")
            if link:
                entries.append(Entry(path, "", 0, 0o777, link))
                continue
            with opened() as file:
                blob, size = blobs.ingest(_Bounded(file, limit - unpacked, limit, kind))
            unpacked += size
            entries.append(Entry(path, blob, size, 0o755 if mode & 0o111 else 0o644))
    return check_manifest(entries)
