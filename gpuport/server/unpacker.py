"""Unpacks one archive posted over REST into the blob store, in a process of its own.

A hostile archive (a million folder headers, a gzip bomb) then costs the server neither memory nor
its interpreter's lock, and, run at a lower CPU priority (nice 10), other users' launches and calls
go first on a busy machine. The server starts at most ``DEFAULT_ARCHIVE_PROCESSES`` at once::

    python -m gpuport.server.unpacker BLOBS_DIR ARCHIVE KIND    # KIND: tar or zip

It writes ``{"entries": [[path, blob, size, mode, link], ...]}`` on stdout, or ``{"error": [class,
message]}`` for an archive that breaks a rule (``unpack_archive`` in services/snapshots.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

from gpuport.protocol.errors import GpuportError, ServerError, error_from_name
from gpuport.server.services.snapshots import Entry

_NICE = 10  # the unpacker's CPU priority below the server's


async def unpack(blobs: Path, archive: Path, kind: str) -> list[Entry]:
    """The entries of ``archive``, its files placed in the store at ``blobs``, from a process of
    its own; raises the archive's error (``InvalidRequest``) as the unpacker said it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpuport.server.unpacker",
        str(blobs),
        str(archive),
        kind,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await process.communicate()
    except BaseException:  # the request was cancelled (its client went): so is the unpacking
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    try:
        said = json.loads(out)
    except ValueError:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {process.returncode}"]
        raise ServerError(f"unpacking the archive failed: {last[0][:300]}") from None
    if "error" in said:
        raise error_from_name(*said["error"])
    return [Entry(*entry) for entry in said["entries"]]


def main(argv: list[str]) -> int:
    from gpuport.server.blobs import BlobStore
    from gpuport.server.services.snapshots import unpack_archive

    os.nice(_NICE)
    blobs, archive, kind = argv
    try:
        entries = unpack_archive(BlobStore(Path(blobs), tidy=False), Path(archive), kind)
    except GpuportError as e:
        said: dict = {"error": [type(e).__name__, str(e)]}
    else:
        said = {"entries": [dataclasses.astuple(e) for e in entries]}
    sys.stdout.write(json.dumps(said))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
