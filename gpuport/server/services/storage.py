"""Storage: what each user keeps on the server, against their storage quota, and the sweep that
removes what nobody keeps.

A user's use is the size of every blob they hold (``blob_holders``: the blobs of their snapshots,
datasets, job outputs and uploads; each holder is charged a blob's full size, even where another
user holds the same content) and the on-disk size of their jobs' logs. Bytes are refused before they
are kept where the size is known first: a push (``Snapshots.Missing`` with sizes, then each upload
stream), a job's outputs (their sizes, sparse files at their full size) and an archive (after it is
unpacked, before it is recorded). Over the quota, nothing of it is kept: its blobs are held by nobody
and the sweep removes them.

The sweep (on start, then every ``DEFAULT_SWEEP_INTERVAL``, in a thread) drops holdings that no
snapshot of their owner refers to and that are older than the grace period (an upload in flight
becomes a snapshot within it), then blob files that nobody holds and that were written before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuport.defaults import DEFAULT_BLOB_GRACE, DEFAULT_SWEEP_INTERVAL
from gpuport.protocol.errors import ResourceUnavailable
from gpuport.protocol.units import format_size
from gpuport.server.blobs import BlobStore
from gpuport.server.services.quotas import QuotaService
from gpuport.server.store import Store

log = logging.getLogger(__name__)
_BATCH = 500  # blob files checked and removed per transaction


@dataclass(frozen=True)
class Swept:
    holdings: int  # (user, blob) holdings dropped
    blobs: int  # blob files removed
    bytes: int  # their size


class StorageService:
    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        quotas: QuotaService,
        log_size: Callable[[str], int],
        grace: float = DEFAULT_BLOB_GRACE,
        interval: float = DEFAULT_SWEEP_INTERVAL,
    ) -> None:
        self.store, self.blobs, self.quotas = store, blobs, quotas
        self.log_size = log_size  # a job's log's bytes on disk (the executor's)
        self.grace, self.interval = grace, interval
        self._sweeping: asyncio.Task[None] | None = None
        quotas.usage = self.used

    def used(self, user: str) -> int:
        """The bytes ``user`` keeps: the blobs they hold and their jobs' logs (a stat per job)."""
        row = self.store.query_one("SELECT COALESCE(SUM(size), 0) AS used FROM blob_holders WHERE owner = ?", (user,))
        jobs = self.store.query("SELECT id FROM jobs WHERE owner = ?", (user,))
        return int(row["used"] if row else 0) + sum(self.log_size(r["id"]) for r in jobs)

    def check(self, user: str, adding: int, what: str) -> None:
        """Raise ``ResourceUnavailable`` where keeping ``adding`` more bytes (``what``) would take
        ``user`` past their storage quota."""
        if adding <= 0:
            return
        quota = self.quotas.storage(user)
        used = self.used(user)
        if used + adding > quota:
            raise ResourceUnavailable(over_quota(user, used, quota, adding, what))

    def left(self, user: str) -> int:
        """The bytes ``user`` may still keep (0 when over their quota already)."""
        return max(0, self.quotas.storage(user) - self.used(user))

    def sweep(self, grace: float | None = None) -> Swept:
        """Drop holdings no snapshot of their owner refers to, older than ``grace`` seconds (default:
        the server's), then the blob files nobody holds written before then. Blocking: run it in a thread."""
        before = time.time() - (self.grace if grace is None else grace)
        with self.store.transaction() as db:
            db.execute("DROP TABLE IF EXISTS temp.referenced")
            db.execute(
                "CREATE TEMP TABLE referenced AS SELECT DISTINCT s.owner AS owner, json_extract(e.value, '$[1]') AS blob "
                "FROM snapshots s, json_each(s.manifest) e WHERE json_extract(e.value, '$[1]') != ''"
            )
            db.execute("CREATE INDEX temp.referenced_key ON referenced(owner, blob)")
            holdings = db.execute(
                "DELETE FROM blob_holders WHERE held_at < ? AND NOT EXISTS "
                "(SELECT 1 FROM referenced r WHERE r.owner = blob_holders.owner AND r.blob = blob_holders.blob)",
                (before,),
            ).rowcount
            db.execute("DROP TABLE temp.referenced")
        removed = freed = 0
        candidates: list[tuple[str, str, int]] = []
        for blob, path, size in self._old_files(before):
            candidates.append((blob, path, size))
            if len(candidates) >= _BATCH:
                n, b = self._remove_unheld(candidates, before)
                removed, freed, candidates = removed + n, freed + b, []
        n, b = self._remove_unheld(candidates, before)
        swept = Swept(holdings, removed + n, freed + b)
        if swept.holdings or swept.blobs:
            log.info(
                "storage sweep: %d holdings dropped, %d blobs (%s) removed",
                swept.holdings, swept.blobs, format_size(swept.bytes),
            )  # fmt: skip
        return swept

    def _old_files(self, before: float) -> list[tuple[str, str, int]]:
        """(blob, path, size) of the store's blob files last written before ``before``."""
        found = []
        root = str(self.blobs.root)
        for folder in os.scandir(root):
            if len(folder.name) != 2 or not folder.is_dir():
                continue  # "incoming": files in the making
            for entry in os.scandir(folder.path):
                if entry.name.startswith("."):
                    continue  # an upload in flight
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_mtime < before:
                        found.append((folder.name + entry.name, entry.path, st.st_size))
        return found

    def _remove_unheld(self, candidates: list[tuple[str, str, int]], before: float) -> tuple[int, int]:
        """Remove those of ``candidates`` nobody holds: checked and removed in one transaction, so
        that a holding recorded meanwhile (a new upload of the same content) keeps its blob."""
        if not candidates:
            return 0, 0
        removed = freed = 0
        with self.store.transaction() as db:
            blobs = [c[0] for c in candidates]
            held = {
                r[0]
                for r in db.execute(
                    f"SELECT DISTINCT blob FROM blob_holders WHERE blob IN ({','.join('?' * len(blobs))})", blobs
                )
            }
            for blob, path, size in candidates:
                if blob in held:
                    continue
                try:
                    if os.stat(path).st_mtime >= before:
                        continue  # written again meanwhile: an upload placing the same content
                    self.blobs.forget(blob)
                    os.unlink(path)
                except OSError:
                    continue
                removed += 1
                freed += size
        return removed, freed

    def start(self) -> None:
        """Sweep now, then every ``interval`` seconds, in a thread."""
        self._sweeping = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except Exception:
                log.exception("the storage sweep failed")
            await asyncio.sleep(self.interval)

    def stop(self) -> None:
        if self._sweeping is not None:
            self._sweeping.cancel()


def over_quota(user: str, used: int, quota: int, adding: int, what: str) -> str:
    """What a caller is told when ``what`` (``adding`` bytes) would take ``user`` past their quota."""
    return (
        f"storage quota exceeded: {what} would add {format_size(adding)}, and {user} keeps "
        f"{format_size(used)} of {format_size(quota)} — nothing of it was stored; remove snapshots "
        f"or outputs you no longer need (`gpuport snapshots rm NAME_OR_ID`), or ask an admin to run "
        f"`gpuport quota set {user} --storage SIZE`"
    )
