"""Files over plain HTTP, for users who post JSON and nothing else: a project or dataset uploaded as
one archive (``POST /v1/snapshots``), and a job's outputs listed and downloaded, one file or all of
them as one ``.tar.gz``, streamed (by the REST API, and by the dashboard with its login)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import tarfile
import tempfile
import threading
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from gpuport.defaults import MAX_ARCHIVE_BYTES
from gpuport.protocol.errors import Conflict, InvalidRequest, NotFound
from gpuport.protocol.paths import check_path
from gpuport.server.blobs import BlobStore
from gpuport.server.services.auth import Identity
from gpuport.server.services.snapshots import Entry

if TYPE_CHECKING:
    from gpuport.server.app import ServerApp
    from gpuport.server.metrics import Transfers

# Content types of an archive body, and how it is read.
ARCHIVE_TYPES = {
    "application/x-tar": "tar",
    "application/tar": "tar",
    "application/gzip": "tar",
    "application/x-gzip": "tar",
    "application/x-compressed-tar": "tar",
    "application/zip": "zip",
    "application/x-zip-compressed": "zip",
    "application/octet-stream": "",  # found from its first bytes
}
_CHUNK = 1 << 20  # bytes of a .tar.gz handed to the connection at once


class TooLarge(InvalidRequest):
    """Answered 413."""


def archive_kind(request: Request) -> str:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    kind = ARCHIVE_TYPES.get(content_type)
    if kind is None:
        raise InvalidRequest(
            f"content type {content_type[:60]!r}: post the archive as application/x-tar, application/gzip "
            "(a .tar.gz) or application/zip (or application/octet-stream)"
        )
    return kind


async def receive_archive(request: Request, folder: Path) -> Path:
    """The request's body, written to a new file in ``folder`` as it arrives, within
    ``MAX_ARCHIVE_BYTES``; the caller removes the file."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_ARCHIVE_BYTES:
        raise TooLarge(f"an archive of {int(length)} bytes is over the limit of {MAX_ARCHIVE_BYTES}")
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix=".archive.", suffix=".part")
    size = 0
    try:
        with os.fdopen(fd, "wb") as file:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_ARCHIVE_BYTES:
                    raise TooLarge(f"the archive is over the limit of {MAX_ARCHIVE_BYTES} bytes")
                file.write(chunk)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    if not size:
        Path(name).unlink(missing_ok=True)
        raise InvalidRequest("the body is empty: post the archive itself")
    return Path(name)


def sniffed(kind: str, archive: Path) -> str:
    """``kind``, or for an octet stream what its first bytes say: a zip ("PK\\3\\4"), else a tar."""
    if kind:
        return kind
    with archive.open("rb") as file:
        return "zip" if file.read(4) == b"PK\x03\x04" else "tar"


def job_outputs(app: ServerApp, caller: Identity, job_id: str) -> list[Entry]:
    """A job's outputs as its output snapshot lists them; NotFound or Conflict while there are none."""
    job = app.jobs.get(caller, job_id)
    if not job.output_snapshot_id:
        if not job.state.is_terminal():
            raise Conflict(f"job {job.id} is {job.state.value}: its outputs are collected when it ends")
        raise NotFound(f"job {job.id} left no outputs (declare them at submit: outputs=['model/'])")
    record = app.snapshots.resolve(caller, snapshot_id=job.output_snapshot_id, owner=job.owner)
    return app.snapshots.manifest(record)


def archive_response(app: ServerApp, caller: Identity, job_id: str, headers: dict[str, str]) -> StreamingResponse:
    """All of a job's outputs as one .tar.gz, streamed; ``headers`` besides its own."""
    entries = job_outputs(app, caller, job_id)
    return StreamingResponse(
        _counted(tar_chunks(entries, app.blobs), app.transfers),
        media_type="application/gzip",
        headers={**headers, "content-disposition": attachment(f"{job_id}-outputs.tar.gz")},
    )


def file_response(
    app: ServerApp, caller: Identity, job_id: str, path: str, headers: dict[str, str]
) -> StreamingResponse:
    """One output file of a job, streamed; ``headers`` besides its own."""
    found = entry(job_outputs(app, caller, job_id), check_path(path, what="output path"))
    if found.link:
        raise InvalidRequest(f"output {path!r} is a symlink to {found.link!r}: download that path")
    return StreamingResponse(
        _counted(file_chunks(app.blobs, found.blob), app.transfers),
        media_type="application/octet-stream",
        headers={
            **headers,
            "content-length": str(found.size),
            "content-disposition": attachment(found.path.rsplit("/", 1)[-1]),
        },
    )


async def _counted(chunks: AsyncIterator[bytes], transfers: Transfers) -> AsyncIterator[bytes]:
    """``chunks``, counted as REST bytes out as they go."""
    async for chunk in chunks:
        transfers.add("rest", "out", len(chunk))
        yield chunk


def listing(entries: list[Entry]) -> list[dict[str, Any]]:
    return [
        {"path": e.path, "size": e.size, "mode": f"{e.mode & 0o777:o}", **({"link": e.link} if e.link else {})}
        for e in entries
    ]


def attachment(filename: str) -> str:
    """A ``Content-Disposition`` for a download saved as ``filename`` (RFC 6266): the name itself,
    percent-encoded UTF-8 in ``filename*``, and for clients that know only ``filename`` an ASCII
    stand-in in which anything that is not printable ASCII, and ``"``, ``\\`` and ``%`` (which some
    clients decode), is ``_``. A name never reaches the header as it is: a quote would end the
    parameter, a line break the header."""
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\%' else "_" for c in filename)
    encoded = urllib.parse.quote(filename.encode("utf-8", "surrogateescape"), safe="")
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"


def entry(entries: list[Entry], path: str) -> Entry:
    for e in entries:
        if e.path == path:
            return e
    raise NotFound(f"no output {path!r} — GET .../outputs lists them")


async def file_chunks(blobs: BlobStore, blob: str) -> AsyncIterator[bytes]:
    """A blob's bytes, read off the event loop."""
    file = await asyncio.to_thread(blobs.open, blob)
    try:
        while chunk := await asyncio.to_thread(file.read, _CHUNK):
            yield chunk
    finally:
        file.close()


class _Queued:
    """A file object whose writes go, in chunks of about ``_CHUNK`` bytes, to a bounded queue."""

    def __init__(self, chunks: queue.Queue[bytes | None], stop: threading.Event) -> None:
        self.chunks, self.stop = chunks, stop
        self.pending = bytearray()

    def write(self, data: bytes) -> int:
        self.pending += data
        if len(self.pending) >= _CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        while self.pending:
            if self.stop.is_set():
                raise OSError("the client went away")
            with contextlib.suppress(queue.Full):
                self.chunks.put(bytes(self.pending), timeout=0.5)
                self.pending.clear()


def _write_tar(entries: list[Entry], blobs: BlobStore, out: _Queued) -> None:
    with tarfile.open(fileobj=out, mode="w|gz") as tar:  # type: ignore[call-overload]
        for e in entries:
            info = tarfile.TarInfo(e.path)
            if e.link:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, e.link, 0o777
                tar.addfile(info)
                continue
            info.size, info.mode = e.size, e.mode & 0o777
            with blobs.open(e.blob) as file:
                tar.addfile(info, file)
    out.flush()


async def tar_chunks(entries: list[Entry], blobs: BlobStore) -> AsyncIterator[bytes]:
    """``entries`` as one .tar.gz, made by a thread as it is sent: at most a few chunks ahead of the
    connection; a client that goes away stops it."""
    chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            _write_tar(entries, blobs, _Queued(chunks, stop))
        except BaseException as e:  # reported by the reader; a client gone is no error
            failed.append(e)
        finally:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    chunks.put(None, timeout=0.5)
                    return

    thread = threading.Thread(target=run, name="outputs.tar.gz", daemon=True)
    thread.start()
    try:
        while True:
            try:  # with a timeout: a read left waiting when the client goes is a thread held
                chunk = await asyncio.to_thread(chunks.get, True, 1.0)
            except queue.Empty:
                continue
            if chunk is None:
                break
            yield chunk
        if failed:
            raise failed[0]
    finally:
        stop.set()
