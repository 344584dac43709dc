"""Accounting: what each job, session worker and model replica held, for how long, and whose.

One row per run (``usage`` in the store): a job queued again (its node lost, preempted) runs anew and
gets a row of its own. A row opens when the scheduler grants the allocation and closes when the run
ends; an open row counts until now. A cluster that times its runs itself (Slurm:
``Executor.times_runs``) gives the row its own figures instead: it opens when the cluster starts the
run, not when gpuport hands it over (a wait in the cluster's queue is not usage), and closes with the
start, elapsed seconds and allocated GPUs and CPUs of the cluster's accounting (``sacct``), which are
the truth for it. Everything that reports use reads these rows — ``gpuport usage``, ``GET
/v1/usage``, the Prometheus counter ``gpuport_gpu_seconds_total`` and the decayed fair share the
scheduler orders users by — so they cannot disagree. GPU-seconds count whole GPUs, and a slice as
its part of the GPU it is on.

The fair share's decayed use of a run holding a part ``d`` of the machine (its dominant share, as
the scheduler counts a running job) from ``s`` to ``e`` is ``d * (2**-((now - e) / h) - 2**-((now -
s) / h))`` for the half-life ``h``: the integral of its decayed share over time, divided by the
decay's mean life, so that holding all of the machine for ever counts 1.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuport.defaults import DEFAULT_AGE_WEIGHT, DEFAULT_FAIRSHARE_HALF_LIFE
from gpuport.protocol.errors import InvalidRequest, PermissionDenied
from gpuport.server.executors.base import Run
from gpuport.server.scheduler import Cluster, FairShare, Request
from gpuport.server.services.auth import Identity
from gpuport.server.store import Store

# How the report groups rows.
BY = ("user", "day")
# A pass reads the decayed use at most this often (seconds): it moves slowly.
_FAIR_CACHE_SECONDS = 10.0
# Runs that ended this many half-lives ago count less than 2**-20: left out of the fair share.
_FORGET_HALF_LIVES = 20


@dataclass(frozen=True)
class UsageRow:
    """Use over a span: a user's (``by="user"``) or a day's for a user (``by="day"``)."""

    user: str
    day: str  # YYYY-MM-DD (UTC) with by="day"; '' with by="user"
    runs: int  # runs that held something during the span (a job queued again counts each run)
    gpu_seconds: float  # whole GPUs, slices as their part of their GPU
    cpu_seconds_reserved: float
    cpu_seconds_used: float  # where the supervisor could tell (runs of the local executor)
    memory_byte_seconds: float  # reserved
    jobs: int  # runs of jobs, sessions' workers and model replicas, each
    sessions: int
    models: int


class UsageService:
    """Records runs and reports them. ``clock`` is injected so a test can move through a week."""

    def __init__(
        self,
        store: Store,
        half_life: float = DEFAULT_FAIRSHARE_HALF_LIFE,
        age_weight: float = DEFAULT_AGE_WEIGHT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (math.isfinite(half_life) and half_life > 0):
            raise InvalidRequest(f"the fair share's half-life must be more than 0 seconds, not {half_life}")
        if not (math.isfinite(age_weight) and age_weight >= 0):
            raise InvalidRequest(f"the age weight must be 0 or more, not {age_weight}")
        self.store = store
        self.half_life = half_life
        self.age_weight = age_weight
        self.clock = clock
        self._fair: tuple[float, Cluster, dict[str, float]] | None = None  # (when, over, used)

    # ---- recording --------------------------------------------------------------------------------

    def begin(
        self, db: sqlite3.Connection, job_id: str, owner: str, kind: str, request: Request, slice_of: int, at: float
    ) -> None:
        """Open the row of a run granted ``request`` at ``at``, in the caller's transaction ``db``."""
        n = request.nodes
        db.execute(
            "INSERT INTO usage (job_id, owner, kind, started_at, gpus, slice_bytes, slice_of, cpus, memory) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job_id, owner, kind, at, request.gpus * n, request.gpu_memory * n, slice_of, request.cpus * n,
             request.memory * n),
        )  # fmt: skip

    def end(self, job_id: str, at: float, cpu_used: float | None = None) -> None:
        """Close the open row of ``job_id``'s run (none open: nothing to do)."""
        with self.store.transaction() as db:
            db.execute(
                "UPDATE usage SET ended_at = MAX(started_at, ?), cpu_used = ? WHERE job_id = ? AND ended_at IS NULL",
                (at, cpu_used, job_id),
            )
        self._fair = None

    def record_run(self, job_id: str, owner: str, kind: str, run: Run, memory: int) -> None:
        """Record a run as its cluster's accounting timed it (``Executor.times_runs``): the row of
        ``run.run`` takes the cluster's start, end, GPUs and CPUs (a row for it opens if it has none;
        an end not known yet leaves the row's end as it is). Reported again, it changes nothing."""
        with self.store.transaction() as db:
            found = db.execute(
                # its own row, else one the front door opened for it (a server before accounting was the
                # cluster's handed it over)
                "SELECT id FROM usage WHERE job_id = ? AND run IN (?, '') ORDER BY run = '', id DESC LIMIT 1",
                (job_id, run.run),
            ).fetchone()
            if found is None:
                db.execute(
                    "INSERT INTO usage (job_id, owner, kind, started_at, ended_at, gpus, slice_bytes, slice_of, cpus, "
                    "memory, run) VALUES (?, ?, ?, ?, ?, ?, 0, 0, ?, ?, ?)",
                    (job_id, owner, kind, run.started_at, run.ended_at, run.gpus, run.cpus, memory, run.run),
                )
            else:
                db.execute(
                    "UPDATE usage SET started_at = ?, ended_at = COALESCE(?, ended_at), gpus = ?, cpus = ?, run = ? "
                    "WHERE id = ?",
                    (run.started_at, run.ended_at, run.gpus, run.cpus, run.run, found["id"]),
                )
        self._fair = None

    # ---- reading ----------------------------------------------------------------------------------

    def gpu_seconds(self, largest: int) -> dict[str, float]:
        """GPU-seconds each user's runs have held until now (``largest``: the bytes of a slice's GPU
        where not recorded); the Prometheus counter's values."""
        return {r.user: r.gpu_seconds for r in self._rows(0.0, None, "user", largest) if r.gpu_seconds}

    def report(
        self, caller: Identity, since: float = 0.0, user: str | None = None, by: str = "user", largest: int = 0
    ) -> list[UsageRow]:
        """Use from ``since`` (epoch seconds) until now, by user or by day and user: a user's own,
        an admin's everyone's (or ``user``'s). Raises ``PermissionDenied`` for a user asking for
        another's, ``InvalidRequest`` for an unknown ``by``."""
        if by not in BY:
            raise InvalidRequest(f"usage by {by!r}: give one of {', '.join(BY)}")
        if user and user != caller.name and not caller.admin:
            raise PermissionDenied(f"{caller.name} is not an admin: a user sees their own usage only")
        if not caller.admin:
            user = caller.name
        return self._rows(since, user or None, by, largest)

    def _rows(self, since: float, user: str | None, by: str, largest: int) -> list[UsageRow]:
        now = self.clock()
        since = min(since, now)
        start = f"MAX(started_at, {float(since)!r})"
        end = f"MIN(COALESCE(ended_at, {float(now)!r}), {float(now)!r})"
        span = f"MAX(0, {end} - {start})"
        # A run's CPU-seconds used are counted in whole for the day it ended in, or the span it ends in.
        day = f"date({start}, 'unixepoch')" if by == "day" else "''"
        where = "COALESCE(ended_at, ?1) >= ?2 AND started_at <= ?1" + (" AND owner = ?3" if user else "")
        params: tuple[object, ...] = (now, since, user) if user else (now, since)
        rows = self.store.query(
            f"SELECT owner, {day} AS day, COUNT(*) AS runs, "
            f"SUM((gpus + CASE WHEN slice_bytes > 0 THEN slice_bytes * 1.0 / "
            f"  (CASE WHEN slice_of > 0 THEN slice_of ELSE {max(largest, 1)} END) ELSE 0 END) * {span}) AS gpu, "
            f"SUM(cpus * {span}) AS cpu, SUM(CASE WHEN ended_at >= ?2 THEN COALESCE(cpu_used, 0) ELSE 0 END) AS used, "
            f"SUM(memory * {span}) AS mem, SUM(kind = 'job') AS jobs, SUM(kind = 'session') AS sessions, "
            f"SUM(kind = 'model') AS models FROM usage WHERE {where} GROUP BY 1, 2 ORDER BY 1, 2",
            params,
        )
        return [
            UsageRow(
                r["owner"],
                r["day"],
                r["runs"],
                r["gpu"] or 0.0,
                r["cpu"] or 0.0,
                r["used"] or 0.0,
                r["mem"] or 0.0,
                r["jobs"],
                r["sessions"],
                r["models"],
            )
            for r in rows
        ]

    def fair_share(self, cluster: Cluster, shares: Mapping[str, float]) -> FairShare:
        """The scheduler's view over weeks now: each user's decayed use of ``cluster``, their
        ``shares``, the clock and the age weight."""
        now = self.clock()
        cached = self._fair
        if cached is None or cached[1] != cluster or not 0 <= now - cached[0] < _FAIR_CACHE_SECONDS:
            cached = self._fair = (now, cluster, self.decayed(cluster, now))
        return FairShare(cached[2], shares, now, self.age_weight)

    def decayed(self, cluster: Cluster, now: float) -> dict[str, float]:
        """Each user's use of ``cluster`` decayed to ``now``, in parts of the whole machine (see the
        module's docstring)."""
        h = self.half_life
        rows = self.store.query(
            "SELECT owner, gpus, slice_bytes, slice_of, cpus, memory, started_at, ended_at FROM usage "
            "WHERE ended_at IS NULL OR ended_at >= ?",
            (now - _FORGET_HALF_LIVES * h,),
        )
        total = cluster.total
        largest, count = total.largest_gpu, len(total.gpu_memory)
        used: dict[str, float] = {}
        for r in rows:
            size = r["slice_of"] or largest
            gpus = r["gpus"] + (r["slice_bytes"] / size if size else 0.0)
            share = max(  # its dominant share, as the scheduler counts a running job
                gpus / count if count else 0.0,
                r["cpus"] / total.cpus if total.cpus else 0.0,
                r["memory"] / total.memory if total.memory else 0.0,
            )
            end = min(now, r["ended_at"] if r["ended_at"] is not None else now)
            start = min(r["started_at"], end)
            part = share * (2 ** (-(now - end) / h) - 2 ** (-(now - start) / h))
            used[r["owner"]] = used.get(r["owner"], 0.0) + part
        return used

    def fair_view(
        self, caller: Identity, cluster: Cluster, shares: Mapping[str, float], active: set[str]
    ) -> list[FairShareRow]:
        """Each user's place in the fair share now: those with work queued or running (``active``)
        and those whose use still counts (within 20 half-lives), the caller's own only unless an admin. A user's
        effective share is their shares over the shares of all of these users."""
        fair = self.fair_share(cluster, shares)
        users = active | {u for u, used in fair.used.items() if used > 0}
        total = sum(fair.shares_of(u) for u in users) or 1.0
        return [
            FairShareRow(u, fair.shares_of(u), fair.shares_of(u) / total, fair.used.get(u, 0.0))
            for u in sorted(users)
            if caller.admin or u == caller.name
        ]


@dataclass(frozen=True)
class FairShareRow:
    """A user's standing in the fair share over weeks."""

    user: str
    shares: float
    effective_share: float  # their shares over those of every user who queues, runs or used recently
    decayed_use: float  # parts of the whole machine (see the module's docstring)
