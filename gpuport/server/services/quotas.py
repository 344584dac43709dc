"""Quotas: the most GPUs and jobs a user may hold at once, the jobs they may have queued, and the
processes each job may run, set by an admin.

A quota for the user ``*`` applies to every user without one of their own. The scheduler reads them
on every pass (``all``); a job over its owner's quota waits, saying so. The queued cap always holds
(``queued_cap``: the user's, else ``*``'s, else ``DEFAULT_QUEUED_PER_USER``): a submit past it is refused.
The cap of processes (and threads) is never off: a quota set without one gets
``DEFAULT_PROCESSES_PER_JOB``, and the kernel enforces it where the server has cgroups
(``server/cgroups.py``); it applies to jobs started after. Storage (the blobs and logs a user keeps,
``services/storage.py``) is never unlimited either: the user's, else ``*``'s, else
``DEFAULT_STORAGE_SHARE`` of the state dir's filesystem. Shares weigh a user's use in the fair share
over weeks (``services/usage.py``): the user's, else ``*``'s, else ``DEFAULT_SHARES``.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from gpuport.defaults import (
    DEFAULT_PROCESSES_PER_JOB,
    DEFAULT_QUEUED_PER_USER,
    DEFAULT_STORAGE_SHARE,
    MAX_NAME_LENGTH,
)
from gpuport.protocol.errors import InvalidRequest, NotFound, PermissionDenied
from gpuport.server.scheduler import Quota
from gpuport.server.services.auth import Identity
from gpuport.server.store import Store

# The quota that applies to every user without one of their own.
DEFAULT_USER = "*"
# The fewest processes a job may be capped at: its sandbox's own (bubblewrap, setpriv, the shell)
# and a Python with a few threads.
MIN_PROCESSES = 16


@dataclass(frozen=True)
class QuotaRecord:
    user: str
    gpus: float | None  # None: no limit
    jobs: int | None
    updated_at: float
    queued: int | None = None  # None: the default's
    processes: int = DEFAULT_PROCESSES_PER_JOB  # each job's processes and threads at once
    storage: int | None = None  # bytes the user may keep (the one in force: the default's where unset)
    storage_used: int | None = None  # bytes the user keeps (None: the '*' quota, which is nobody's)
    shares: float | None = None  # their shares of the machine in the fair share; None: the default's


def _admin_only(caller: Identity) -> None:
    if not caller.admin:
        raise PermissionDenied(f"{caller.name} is not an admin: only an admin token can change or list quotas")


class QuotaService:
    def __init__(self, store: Store, root: Path | None = None) -> None:
        self.store = store
        self.root = root or store.path.parent  # storage's default is a share of this folder's filesystem
        self._storage: dict[str, int] | None = None  # user → storage quota set
        self.usage: Callable[[str], int] = lambda user: 0  # bytes a user keeps (services/storage.py)
        self._cache: dict[str, Quota] | None = None  # read on every scheduling pass: kept until changed
        self._queued: dict[str, int] | None = None  # user → queued cap, read on every submit: the same
        self._shares: dict[str, float] | None = None  # user → shares, read on every pass: the same
        self.on_change: Callable[[], None] = lambda: None  # the job service looks at its queue again

    def set(
        self,
        caller: Identity,
        user: str,
        gpus: float | None,
        jobs: int | None,
        queued: int | None = None,
        processes: int | None = None,
        storage: int | None = None,
        shares: float | None = None,
    ) -> QuotaRecord:
        """Set ``user``'s quota (admin only); None leaves that limit off (``queued``, ``storage``,
        ``shares``: the default's, ``processes``: the default)."""
        _admin_only(caller)
        if not user or len(user) > MAX_NAME_LENGTH or not user.isprintable():
            raise InvalidRequest(f"user {user[:80]!r}: give a token name, or '*' for every user")
        if gpus is not None and not (math.isfinite(gpus) and gpus >= 0):
            raise InvalidRequest(f"a GPU quota must be 0 or more, not {gpus}")
        if jobs is not None and jobs < 0:
            raise InvalidRequest(f"a job quota must be 0 or more, not {jobs}")
        if queued is not None and queued < 0:
            raise InvalidRequest(f"a queued-jobs cap must be 0 or more, not {queued}")
        if processes is not None and not MIN_PROCESSES <= processes < 2**31:
            raise InvalidRequest(f"a cap of processes per job must be {MIN_PROCESSES} or more, not {processes}")
        if storage is not None and not 0 <= storage < 2**63:
            raise InvalidRequest(f"a storage quota must be 0 bytes or more, not {storage}")
        if shares is not None and not (math.isfinite(shares) and 0 < shares <= 1e6):
            raise InvalidRequest(f"shares must be more than 0 (and at most 1,000,000), not {shares}")
        if all(v is None for v in (gpus, jobs, queued, processes, storage, shares)):
            raise InvalidRequest(
                "give --gpus, --jobs, --queued, --processes, --storage, --shares or several; "
                "`gpuport quota unset USER` removes a quota"
            )
        processes = DEFAULT_PROCESSES_PER_JOB if processes is None else processes
        now = time.time()
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO quotas (user, gpus, jobs, queued, processes, storage, shares, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(user) DO UPDATE SET gpus = excluded.gpus, jobs = excluded.jobs, "
                "queued = excluded.queued, processes = excluded.processes, storage = excluded.storage, "
                "shares = excluded.shares, updated_at = excluded.updated_at",
                (user, gpus, jobs, queued, processes, storage, shares, now),
            )
        self._cache = None
        self._queued = None
        self._storage = None
        self._shares = None
        self.on_change()
        used = None if user == DEFAULT_USER else self.usage(user)
        return QuotaRecord(user, gpus, jobs, now, queued, processes, self.storage(user), used, shares)

    def unset(self, caller: Identity, user: str) -> None:
        """Remove ``user``'s quota (admin only). Raises ``NotFound`` when there is none."""
        _admin_only(caller)
        with self.store.transaction() as db:
            if not db.execute("DELETE FROM quotas WHERE user = ?", (user[:MAX_NAME_LENGTH],)).rowcount:
                raise NotFound(f"no quota for {user[:80]!r} — `gpuport quota list` shows them")
        self._cache = None
        self._queued = None
        self._storage = None
        self._shares = None
        self.on_change()

    def list(self, caller: Identity) -> list[QuotaRecord]:
        """Every quota, with each user's storage use (admin only); a user sees their own and the
        default. A user who keeps storage without a quota of their own is listed with the default's
        limits and ``updated_at`` 0. Blocking (a stat per job log): run it in a thread."""
        rows = self.store.query("SELECT * FROM quotas ORDER BY user")
        records = {
            r["user"]: QuotaRecord(
                r["user"], r["gpus"], r["jobs"], r["updated_at"], r["queued"], r["processes"], shares=r["shares"]
            )
            for r in rows
            if caller.admin or r["user"] in (caller.name, DEFAULT_USER)
        }
        keeping = self.store.query("SELECT DISTINCT owner FROM blob_holders UNION SELECT DISTINCT owner FROM jobs")
        default = records.get(DEFAULT_USER) or QuotaRecord(DEFAULT_USER, None, None, 0.0)
        for row in keeping:
            user = row["owner"]
            if user not in records and (caller.admin or user == caller.name):
                records[user] = replace(default, user=user, updated_at=0.0)
        if caller.name not in records and not caller.admin:
            records[caller.name] = replace(default, user=caller.name, updated_at=0.0)
        return [
            replace(
                q, storage=self.storage(q.user), storage_used=None if q.user == DEFAULT_USER else self.usage(q.user)
            )
            for q in sorted(records.values(), key=lambda q: q.user)
        ]

    def storage(self, user: str) -> int:
        """The bytes ``user`` may keep: their quota's, else ``*``'s, else ``DEFAULT_STORAGE_SHARE``
        of the state dir's filesystem."""
        if self._storage is None:
            rows = self.store.query("SELECT user, storage FROM quotas WHERE storage IS NOT NULL")
            self._storage = {r["user"]: r["storage"] for r in rows}
        if user in self._storage:
            return self._storage[user]
        if DEFAULT_USER in self._storage:
            return self._storage[DEFAULT_USER]
        return int(shutil.disk_usage(self.root).total * DEFAULT_STORAGE_SHARE)

    def all(self) -> dict[str, Quota]:
        """user → quota, for the scheduler."""
        if self._cache is None:
            rows = self.store.query("SELECT user, gpus, jobs, processes FROM quotas")
            self._cache = {r["user"]: Quota(r["gpus"], r["jobs"], r["processes"]) for r in rows}
        return self._cache

    def shares(self) -> dict[str, float]:
        """user → shares set ('*': every user without their own), for the fair share."""
        if self._shares is None:
            rows = self.store.query("SELECT user, shares FROM quotas WHERE shares IS NOT NULL")
            self._shares = {r["user"]: r["shares"] for r in rows}
        return self._shares

    def of(self, user: str) -> Quota | None:
        quotas = self.all()
        return quotas.get(user, quotas.get(DEFAULT_USER))

    def queued_cap(self, user: str) -> int:
        """The most jobs ``user`` may have queued at once: their quota's, else ``*``'s, else the default."""
        if self._queued is None:
            rows = self.store.query("SELECT user, queued FROM quotas WHERE queued IS NOT NULL")
            self._queued = {r["user"]: r["queued"] for r in rows}
        return self._queued.get(user, self._queued.get(DEFAULT_USER, DEFAULT_QUEUED_PER_USER))

    def processes(self, user: str) -> int:
        """The cap of processes and threads of each of ``user``'s jobs."""
        quota = self.of(user)
        return quota.processes if quota is not None else DEFAULT_PROCESSES_PER_JOB
