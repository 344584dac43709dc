"""Jobs: a command + a snapshot + env + GPUs → detached processes on a node, a log, an exit code, outputs.

The job service holds a job's life: its states, the queue (``scheduler.py`` decides which job
starts, on which node and GPUs), launches, ends, retries and outputs. What a job may ask for is
checked before (``job_requests.py``). The database is the truth for every
job's state and placement. Where the job runs and what it leaves there (its folders, processes,
log, exit status, outputs) belong to the executor (``executors/``): this machine's, or a Ray
cluster's nodes.

A server that restarts (even after SIGKILL) finds each job where it was: running jobs are watched
again, jobs that ended meanwhile get their recorded exit code, and queued jobs start.

Arrays and sweeps: one submit queues many tasks, each an ordinary job of its owner (the fair queue,
quotas and the queued cap count each), with the id ``<array id>_<index>``; the array's ``%N`` is the
scheduler's to enforce. Dependencies (``after``): a queued job waits until the jobs or arrays it
names have succeeded (``ok``) or ended (``any``); under ``ok``, one that fails cancels it, saying
why. What a job waits for is stored with it, so a restarted server keeps the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shlex
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import psutil

from gpuport.defaults import (
    DEFAULT_CANCEL_GRACE,
    DEFAULT_PREEMPT_AFTER,
    DEFAULT_RETRY_BACKOFF,
    DEFAULT_RETRY_BACKOFF_MAX,
    ENV_ARRAY_COUNT,
    ENV_ARRAY_ID,
    ENV_ARRAY_INDEX,
    ENV_GPU_MEMORY,
    ENV_GPU_MEMORY_FRACTION,
    ENV_JOB_ID,
    LOG_CHUNK_BYTES,
    LOG_POLL_INTERVAL,
    MAX_NAME_LENGTH,
    OOM_EXIT_CODE,
)
from gpuport.protocol.arrays import parse_array, sweep_args, sweep_env_name, sweep_grid
from gpuport.protocol.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ResourceUnavailable,
)
from gpuport.protocol.units import format_duration, format_size
from gpuport.server.environments import BUILD_OWNER, BuildFailed, Built, Environments
from gpuport.server.executors.base import Executor, Files, JobLaunch, Node, NodeLost, Placement, Run
from gpuport.server.inventory import Inventory
from gpuport.server.isolation import Sandbox, UidMap
from gpuport.server.scheduler import (
    LOOK_AHEAD,
    REACH,
    Cluster,
    Decision,
    Holding,
    Pending,
    Request,
    Scheduler,
    could_start,
    plan,
    preempt,
    queue_order,
)
from gpuport.server.services.auth import Identity
from gpuport.server.services.job_requests import JOB_ID, Checked, JobRequest, RequestChecks, spec_size
from gpuport.server.services.quotas import QuotaService
from gpuport.server.services.snapshots import OverBudget, SnapshotRecord, SnapshotService
from gpuport.server.services.storage import StorageService, over_quota
from gpuport.server.services.usage import UsageService
from gpuport.server.store import Store

log = logging.getLogger(__name__)

_RECENT_SECONDS = 24 * 3600  # `gpuport jobs` without --all: active jobs and those of the last day
_LIST_LIMIT = 500
_MAX_DEPENDENCIES = 64
# The most bytes of command and spec the tasks of one array may store together (each task's copy).
_MAX_ARRAY_SPEC_BYTES = 64 * 1024 * 1024
_ACTIVE = "state IN ('queued', 'running')"
_COLUMNS = (
    "id, owner, name, state, command, gpus, gpu_indices, created_at, snapshot_id, outputs, spec, time_limit, "
    "gpu_memory, cpus, memory, priority, nprocs, kind, nodes, depends_on"
)
_VALUES = "?, ?, ?, 'queued', ?, ?, '[]', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?"
_INSERT = f"INSERT INTO jobs ({_COLUMNS}) VALUES ({_VALUES})"
_INSERT_TASK = f"INSERT INTO jobs ({_COLUMNS}, array_id, array_index) VALUES ({_VALUES}, ?, ?)"


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"  # stopped at its time limit
    KILLED = "killed"  # stopped by the server: over its GPU memory slice or its memory limit
    LOST = "lost"  # its supervisor vanished without recording an exit code

    def is_terminal(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


# A running job goes back to the queue only when a crash came between its start and its launch.
_MOVES = {
    JobState.QUEUED: {JobState.RUNNING, JobState.CANCELLED},
    JobState.RUNNING: {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.KILLED,
        JobState.LOST,
        JobState.QUEUED,
    },
}


def check_move(job_id: str, old: JobState, new: JobState) -> None:
    if new not in _MOVES.get(old, set()):
        raise Conflict(f"job {job_id} is {old.value}; it cannot become {new.value}")


@dataclass(frozen=True)
class JobRecord:
    id: str
    owner: str
    name: str
    state: JobState
    command: list[str]
    gpus: int
    gpu_indices: list[int]
    created_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    message: str
    snapshot_id: str
    output_snapshot_id: str
    outputs: list[str]
    log_bytes: int = 0
    time_limit: float = 0.0
    gpu_memory: int = 0
    cpus: float = 0.0
    memory: int = 0
    priority: int = 0
    nprocs: int = 1
    position: int = 0  # place in the queue while queued (1: next); 0 otherwise
    kind: str = "job"  # or "session": a session's worker
    node: str = ""  # where it runs or ran (rank 0's, for a job over several nodes)
    nodes: int = 1
    placement: list[tuple[str, list[int]]] = field(default_factory=list)  # several nodes: (node, GPUs) each
    array_id: str = ""  # the job array it is a task of
    array_index: int | None = None
    environment: str = ""  # the hash of the Python environment it runs in ("" : the box's own)
    preemptible: bool = False
    preemptions: int = 0  # times it was preempted and queued again
    retried: int = 0  # times it was queued again after a failure (its --retries)


@dataclass(frozen=True)
class ArrayRecord:
    """A job array or sweep: its tasks (jobs) in index order."""

    id: str
    owner: str
    name: str
    spec: str  # as given: "0-99%8"; a sweep's "%N" or ""
    max_running: int  # 0: no cap
    created_at: float
    sweep: dict[str, list[str]]  # a sweep's parameters and values; {} for an array
    tasks: list[JobRecord]

    def counts(self) -> Counter[str]:
        return Counter(t.state.value for t in self.tasks)


def exit_message(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}"


_FLOOR_RECHECK = 2.0  # seconds between looks at free memory while work waits for it
# A user's jobs being set up at once on this server (a sandbox's namespaces, its network, the first
# process): half the CPUs, at least one. A job's start waits for an earlier one of its owner's to be
# set up, not for other users': six launches of one user at once cost another user's launch what
# one would. The set-up's time is mostly CPU, charged to the owner's cpu group where there is one
# (bench/probe_launch_flood.py measured it: another user's launch beside six waited for a CPU, not
# on kernel locks). The wait ends when the job's supervisor says it started, or after _SETUP_WAIT seconds.
LAUNCHES_PER_USER = max(1, (os.cpu_count() or 1) // 2)
_SETUP_WAIT = 10.0
_SETUP_POLL = 0.005
_MEMORY_READ_FOR = 0.2  # seconds a look at free memory stands for the passes that follow it


def _files(snapshots: SnapshotService, record: SnapshotRecord) -> Files:
    return Files([(e.path, e.blob, e.size, e.mode, e.link) for e in snapshots.manifest(record)])


def rank_gpus(gpu_indices: list[int], nprocs: int) -> list[list[int]]:
    """The job's GPUs spread over its processes: an even block each, or shared round-robin when
    there are fewer GPUs than processes."""
    if not gpu_indices:
        return [[] for _ in range(nprocs)]
    if len(gpu_indices) >= nprocs:
        per = len(gpu_indices) // nprocs
        return [gpu_indices[r * per : (r + 1) * per] for r in range(nprocs)]
    return [[gpu_indices[r % len(gpu_indices)]] for r in range(nprocs)]


class JobService:
    def __init__(
        self,
        store: Store,
        snapshots: SnapshotService,
        inventory: Inventory,
        executor: Executor,
        quotas: QuotaService,
        sandbox: Sandbox,
        memory_floor: int = 0,
    ) -> None:
        self.store = store
        self.snapshots = snapshots
        self.inventory = inventory
        self.executor = executor
        self.quotas = quotas
        self.storage: StorageService | None = None  # set by the app: outputs count against their owner's storage
        self.sandbox = sandbox
        self.uids = UidMap(store, sandbox.uids)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._nodes: list[Node] = []
        self._cluster = Cluster(())
        self.scheduler = Scheduler()  # the queue, the last plan and what changed since
        self._schedule_pending = False
        self.quotas.on_change = self.reschedule  # a raised quota may let jobs start
        self.executor.on_change = self._nodes_changed  # a node that joins may let jobs start
        self.executor.on_run = self._run_timed  # a cluster that times its runs (Slurm's accounting)
        self.memory_floor = memory_floor  # bytes free below which work that reserves no memory waits
        self._floor_check: asyncio.TimerHandle | None = None
        self._launching: dict[str, asyncio.Semaphore] = {}  # owner → their jobs being set up now
        self._memory_read = (-1e9, 0)  # (when, bytes available) of the last look at free memory
        self._caps: dict[str, int] = {}  # job array → the most of its tasks running at once (%N)
        self._waiters: dict[str, set[str]] = {}  # job or array id → queued jobs waiting for it
        self.checks = RequestChecks(snapshots, inventory, executor, quotas, lambda: self.cluster)
        self.usage = UsageService(store)  # what each run held (the app sets its half-life and age weight)
        self.preempt_after = DEFAULT_PREEMPT_AFTER  # seconds a job waits before preemptible jobs make room
        self._preempting: set[str] = set()  # running jobs asked to stop for a preemption
        self._preempt_check: asyncio.TimerHandle | None = None

    @property
    def environments(self) -> Environments | None:
        """Where jobs' Python environments are built (set by the app; None: not on this server)."""
        return self.checks.environments

    @environments.setter
    def environments(self, environments: Environments | None) -> None:
        self.checks.environments = environments

    def check(self, caller: Identity, request: JobRequest) -> Checked:
        """Validate ``request`` as ``submit`` does, and ask the executor's cluster whether it takes the
        job: that may block (Slurm's ``sbatch --test-only``), so the API calls this on a thread of its
        own and hands the result to ``submit`` or ``submit_array``. Raises what ``submit`` raises."""
        return self.checks.check(caller, request)

    @property
    def cluster(self) -> Cluster:
        """The nodes the scheduler plans over, as the executor sees them now."""
        nodes = self.executor.nodes()
        if nodes != self._nodes:
            self._nodes = nodes
            self._cluster = Cluster(tuple((n.name, n.machine) for n in nodes))
        return self._cluster

    def submit(self, caller: Identity, request: JobRequest, checked: Checked | None = None) -> JobRecord:
        """Queue a job for ``caller``. Raises ``InvalidRequest``, ``NotFound`` (snapshot, or a job it
        is to wait for), ``Conflict`` (its name is taken; a job it is to wait for has already failed)
        or ``ResourceUnavailable``. ``checked``: what ``check`` gave for this request (else it is
        checked here, on the caller's thread)."""
        argv, snapshot, outputs, spec = checked or self.checks.check(caller, request)
        after = self._dependencies(caller, request.after)
        with self.store.transaction() as db:
            self._admit(db, caller, request, 1)
            job_id = self._new_id(db)
            seq = db.execute(
                _INSERT, self._row(caller, request, job_id, argv, snapshot, outputs, spec, after)
            ).lastrowid
        blocked = self._wait_for(job_id, after)
        resources = Request(request.gpus, request.gpu_memory, request.cpus, request.memory, request.nodes)
        pending = Pending(
            job_id, caller.name, resources, request.priority, seq or 0, blocked=blocked, created_at=time.time()
        )
        settled = self.scheduler.admit(pending, self.cluster, self._low_memory)
        log.info("job %s queued for %s: %s", job_id, caller.name, " ".join(argv)[:200])
        if not settled:  # at once, so that the reply says whether it started or why it waits
            self._schedule(explain=True)
        return self._load(job_id)

    def submit_array(
        self,
        caller: Identity,
        request: JobRequest,
        array: str = "",
        sweep: dict[str, list[str]] | None = None,
        checked: Checked | None = None,
    ) -> ArrayRecord:
        """Queue a job array (``array``: Slurm's syntax, "0-99%8") or a sweep (the grid of ``sweep``'s
        values; ``array`` then only "%N" or ""), one job per task, in one transaction: all of them or,
        on any error, none. Each task gets its index in GPUPORT_ARRAY_INDEX and SLURM_ARRAY_TASK_ID;
        a sweep's task its point as ``--name value`` arguments and GPUPORT_SWEEP_<NAME> variables.
        Raises what ``submit`` raises, and ``InvalidRequest`` for a malformed spec or too many tasks."""
        if sweep:
            grid: list[dict[str, str]] | None = sweep_grid(sweep)
            _, cap = parse_array(array, cap_only=True)
            indices = list(range(len(grid or ())))
        elif array.strip():
            grid = None
            indices, cap = parse_array(array)
        else:
            raise InvalidRequest("a job array needs its indices (array='0-99%8') or a sweep (sweep={'lr': [...]})")
        argv, snapshot, outputs, spec = checked or self.checks.check(caller, request)
        after = self._dependencies(caller, request.after)
        # Each task stores its own copy (a sweep's point twice: as arguments and as variables).
        each = spec_size(argv) + spec_size(spec) + 2 * max((spec_size(sweep_args(p)) for p in grid or ()), default=0)
        if each * len(indices) > _MAX_ARRAY_SPEC_BYTES:
            raise InvalidRequest(
                f"{len(indices)} tasks of {format_size(each)} of command and environment each are more than the "
                f"limit of {format_size(_MAX_ARRAY_SPEC_BYTES)} for one array: make the environment smaller, or "
                "split the array"
            )
        now = time.time()
        with self.store.transaction() as db:
            self._admit(db, caller, request, len(indices))
            array_id = self._new_id(db)
            db.execute(
                "INSERT INTO arrays (id, owner, name, spec, max_running, sweep, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (array_id, caller.name, request.name, array.strip(), cap, json.dumps(sweep) if sweep else "", now),
            )
            rows = []
            for n, index in enumerate(indices):
                task_env = {
                    ENV_ARRAY_INDEX: str(index),
                    ENV_ARRAY_ID: array_id,
                    ENV_ARRAY_COUNT: str(len(indices)),
                    "SLURM_ARRAY_TASK_ID": str(index),
                    "SLURM_ARRAY_JOB_ID": array_id,
                    "SLURM_ARRAY_TASK_COUNT": str(len(indices)),
                    "SLURM_ARRAY_TASK_MIN": str(indices[0]),
                    "SLURM_ARRAY_TASK_MAX": str(indices[-1]),
                }
                task_argv = argv
                if grid is not None:
                    point = grid[n]
                    task_env.update((sweep_env_name(k), v) for k, v in point.items())
                    if request.shell:  # appended to the command line: `sh -c LINE ARGS` would not pass them on
                        task_argv = [*argv[:2], argv[2] + " " + shlex.join(sweep_args(point))]
                    else:
                        task_argv = [*argv, *sweep_args(point)]
                task_spec = {**spec, "internal_env": {**spec["internal_env"], **task_env}}
                if grid is not None:
                    task_spec["sweep"] = grid[n]
                job_id = f"{array_id}_{index}"
                row = self._row(caller, request, job_id, task_argv, snapshot, outputs, task_spec, after)
                rows.append((*row, array_id, index))
            db.executemany(_INSERT_TASK, rows)
            seqs = db.execute("SELECT id, seq FROM jobs WHERE array_id = ?", (array_id,)).fetchall()
        if cap:
            self._caps[array_id] = cap
        resources = Request(request.gpus, request.gpu_memory, request.cpus, request.memory, request.nodes)
        now = time.time()
        for r in seqs:
            blocked = self._wait_for(r["id"], after)
            self.scheduler.put(Pending(
                r["id"], caller.name, resources, request.priority, r["seq"], group=array_id, blocked=blocked,
                created_at=now,
            ))  # fmt: skip
        log.info("array %s of %d tasks queued for %s: %s", array_id, len(indices), caller.name, " ".join(argv)[:200])
        self._schedule(explain=True)
        return self._array_record(self._array_row(array_id))

    def _new_id(self, db: Any) -> str:
        """A new id of the jobs' space (a job's or an array's), in the submit's transaction."""
        while True:
            new = "j-" + secrets.token_hex(4)
            taken = db.execute(
                "SELECT 1 FROM jobs WHERE id = ? UNION ALL SELECT 1 FROM arrays WHERE id = ?", (new, new)
            ).fetchone()
            if taken is None:
                return new

    def _admit(self, db: Any, caller: Identity, request: JobRequest, count: int) -> None:
        """Refuse, in the submit's transaction, ``count`` more queued jobs past the caller's queued
        cap, or a name one of their queued or running jobs (or arrays) holds."""
        cap = self.quotas.queued_cap(caller.name)
        (queued,) = db.execute(
            "SELECT COUNT(*) FROM jobs WHERE owner = ? AND state = 'queued'", (caller.name,)
        ).fetchone()
        if queued + count > cap:
            if count == 1:
                raise ResourceUnavailable(
                    f"{caller.name} has {queued} jobs queued, the most allowed at once is {cap}: wait for some "
                    "to start, cancel some (`gpuport cancel JOB`), or ask an admin to raise it "
                    f"(`gpuport quota set {caller.name} --queued N`)"
                )
            raise ResourceUnavailable(
                f"an array of {count} tasks would make {queued + count} jobs of {caller.name} queued; the most "
                f"allowed at once is {cap} ({queued} queued now): nothing was queued — submit a smaller array, "
                f"use fewer tasks at a time, or ask an admin to raise it (`gpuport quota set {caller.name} --queued N`)"
            )
        if request.name and request.kind == "job":  # checked in the insert's transaction: one submit wins
            holder = db.execute(
                f"SELECT id, state, array_id FROM jobs WHERE owner = ? AND name = ? AND kind = 'job' AND {_ACTIVE}",
                (caller.name, request.name),
            ).fetchone()
            if holder is not None:
                what = f"array {holder['array_id']}" if holder["array_id"] else f"job {holder['id']}"
                raise Conflict(
                    f"{what} of {caller.name} is named {request.name!r} and is {holder['state']}: "
                    "give this job another name, or wait for that one to end or cancel it "
                    f"(`gpuport cancel {holder['array_id'] or holder['id']}`)"
                )

    def _row(
        self,
        caller: Identity,
        request: JobRequest,
        job_id: str,
        argv: list[str],
        snapshot: str,
        outputs: list[str],
        spec: dict[str, Any],
        after: list[tuple[str, str]],
    ) -> tuple[Any, ...]:
        return (
            job_id,
            caller.name,
            request.name,
            json.dumps(argv),
            request.gpus,
            time.time(),
            snapshot,
            json.dumps(outputs),
            json.dumps(spec),
            request.time_limit,
            request.gpu_memory,
            request.cpus,
            request.memory,
            request.priority,
            request.nprocs,
            request.kind,
            request.nodes,
            json.dumps(after) if after else "",
        )

    def _load(self, job_id: str) -> JobRecord:
        row = self.store.query_one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if row is None:
            raise NotFound(f"no job {job_id}")
        return self._record(row)

    def _record(self, row: Any) -> JobRecord:
        # As last known: a listing never waits on a node for it (it runs on the event loop).
        log_bytes = self.executor.known_log_size(row["id"]) if row["state"] != JobState.QUEUED.value else 0
        message, position = row["message"], 0
        if row["state"] == JobState.QUEUED.value:
            if self.scheduler.plan is None:
                self._schedule(explain=True)
            plan = self.scheduler.plan
            if plan is not None and (decision := plan.get(row["id"])) is not None:
                message, position = decision.reason, decision.position
            elif plan is not None:  # past the jobs a pass looks at: none of them can start now
                message = f"waiting behind the first {len(plan)} jobs in the queue, none of which can start now"
        spec = json.loads(row["spec"])
        return JobRecord(
            id=row["id"],
            owner=row["owner"],
            name=row["name"],
            state=JobState(row["state"]),
            command=json.loads(row["command"]),
            gpus=row["gpus"],
            gpu_indices=json.loads(row["gpu_indices"]),
            created_at=row["created_at"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            exit_code=row["exit_code"],
            message=message,
            snapshot_id=row["snapshot_id"],
            output_snapshot_id=row["output_snapshot_id"],
            outputs=json.loads(row["outputs"]),
            log_bytes=log_bytes,
            time_limit=row["time_limit"],
            gpu_memory=row["gpu_memory"],
            cpus=row["cpus"],
            memory=row["memory"],
            priority=row["priority"],
            nprocs=row["nprocs"],
            position=position,
            kind=row["kind"],
            node=row["node"],
            nodes=row["nodes"],
            placement=[(node, gpus) for node, gpus in json.loads(row["placement"] or "[]")],
            array_id=row["array_id"],
            array_index=row["array_index"],
            environment=spec.get("environment", ""),
            preemptible=bool(spec.get("preemptible")),
            preemptions=spec.get("preempted", 0),
            retried=spec.get("tried", spec.get("lost", 0)),
        )

    def get(self, caller: Identity, job_id: str) -> JobRecord:
        """The job with this id, if ``caller`` owns it or is an admin; or the caller's job of this name
        (where ``job_id`` is not an id): the one queued or running, else the newest. ``NotFound``
        otherwise (it does not say whether another user's job has that id), and for an array's id or
        name (``array`` finds those)."""
        kind, row = self._find(caller, job_id)
        if kind == "array":
            count = self.store.query_one("SELECT COUNT(*) FROM jobs WHERE array_id = ?", (row["id"],))[0]
            raise NotFound(
                f"{row['id']} is a job array of {count} tasks, not a job: its tasks are {row['id']}_INDEX "
                "(`gpuport jobs` lists them)"
            )
        return self._record(row)

    def _find(self, caller: Identity, ref: str) -> tuple[str, Any]:
        """("job", its row) or ("array", its row) for a job's or an array's id, or for a name: the
        caller's job or array of that name that is queued or running, else the newest. ``NotFound``
        otherwise."""
        ref = ref[:64]
        mine = "" if caller.admin else " AND owner = ?"
        who = () if caller.admin else (caller.name,)
        row = self.store.query_one(f"SELECT * FROM jobs WHERE id = ?{mine}", (ref, *who))
        if row is not None:
            return "job", row
        row = self.store.query_one(f"SELECT * FROM arrays WHERE id = ?{mine}", (ref, *who))
        if row is not None:
            return "array", row
        if JOB_ID.fullmatch(ref):
            raise NotFound(f"no job {ref!r} — `gpuport jobs --all` lists yours")
        name = ref[:MAX_NAME_LENGTH]
        job = self.store.query_one(
            f"SELECT *, {_ACTIVE} AS active FROM jobs WHERE owner = ? AND name = ? AND kind = 'job' "
            "AND array_id = '' ORDER BY active DESC, seq DESC LIMIT 1",
            (caller.name, name),
        )
        array = self.store.query_one(
            f"SELECT a.*, EXISTS (SELECT 1 FROM jobs WHERE array_id = a.id AND {_ACTIVE}) AS active FROM arrays a "
            "WHERE owner = ? AND name = ? ORDER BY active DESC, seq DESC LIMIT 1",
            (caller.name, name),
        )
        if job is None and array is None:
            raise NotFound(
                f"no job named {name!r} and no job with that id — "
                "`gpuport jobs --all` lists yours with their ids and names"
            )
        if array is None or (
            job is not None and (job["active"], job["created_at"]) > (array["active"], array["created_at"])
        ):
            return "job", job
        return "array", array

    def array(self, caller: Identity, ref: str) -> ArrayRecord:
        """The job array with this id, or the caller's of this name (as ``get`` finds jobs); with
        its tasks. ``NotFound`` otherwise, and where ``ref`` finds a job."""
        kind, row = self._find(caller, ref)
        if kind != "array":
            raise NotFound(f"{row['id']} is a job, not a job array")
        return self._array_record(row)

    def _array_row(self, array_id: str) -> Any:
        row = self.store.query_one("SELECT * FROM arrays WHERE id = ?", (array_id,))
        if row is None:
            raise NotFound(f"no job array {array_id!r}")
        return row

    def _array_record(self, row: Any) -> ArrayRecord:
        tasks = self.store.query("SELECT * FROM jobs WHERE array_id = ? ORDER BY array_index", (row["id"],))
        return ArrayRecord(
            id=row["id"],
            owner=row["owner"],
            name=row["name"],
            spec=row["spec"],
            max_running=row["max_running"],
            created_at=row["created_at"],
            sweep=json.loads(row["sweep"]) if row["sweep"] else {},
            tasks=[self._record(t) for t in tasks],
        )

    def list_for(
        self,
        caller: Identity,
        *,
        all: bool = False,
        name: str = "",
        states: list[str] | tuple[str, ...] = (),
        user: str = "",
    ) -> list[JobRecord]:
        """The caller's active jobs and those ended in the last day, newest first; with ``all``, every
        one (every user's, for an admin). Every queued and running job, whatever their number (queued
        jobs are capped per user), then at most _LIST_LIMIT ended ones, the newest.

        Only those named ``name``, in one of ``states``, or of ``user`` (another's: admins only) where
        given. Raises ``InvalidRequest`` (an unknown state) or ``PermissionDenied``.
        """
        wanted = set()
        for state in states:
            try:
                wanted.add(JobState(state))
            except ValueError:
                raise InvalidRequest(
                    f"unknown job state {state[:80]!r}: the states are {', '.join(s.value for s in JobState)}"
                ) from None
        if user and user != caller.name and not caller.admin:
            raise PermissionDenied(
                f"only an admin can list another user's jobs; you are {caller.name} (leave out the user to list yours)"
            )
        where: list[str] = ["kind = 'job'"]  # sessions' workers are listed as sessions
        params: list[object] = []
        if user or not (all and caller.admin):
            where.append("owner = ?")
            params.append(user or caller.name)
        if name:
            where.append("name = ?")
            params.append(name)
        active_states = [s.value for s in JobState if not s.is_terminal() and (not wanted or s in wanted)]
        ended_states = [s.value for s in JobState if s.is_terminal() and (not wanted or s in wanted)]
        active: list[Any] = []
        ended: list[Any] = []
        if active_states:
            active = self.store.query(
                f"SELECT * FROM jobs WHERE {' AND '.join(where)} AND state IN ({', '.join('?' * len(active_states))})",
                [*params, *active_states],
            )
        if ended_states:
            where_ended = [*where, f"state IN ({', '.join('?' * len(ended_states))})"]
            ended_params = [*params, *ended_states]
            if not all:
                where_ended.append("created_at > ?")
                ended_params.append(time.time() - _RECENT_SECONDS)
            ended = self.store.query(
                f"SELECT * FROM jobs WHERE {' AND '.join(where_ended)} ORDER BY seq DESC LIMIT {_LIST_LIMIT}",
                ended_params,
            )
        rows = sorted([*active, *ended], key=lambda r: r["seq"], reverse=True)
        return [self._record(r) for r in rows]

    def running(self) -> list[Holding]:
        """The allocations of the running jobs, oldest first."""
        rows = self.store.query(
            "SELECT id, owner, gpus, gpu_memory, cpus, memory, gpu_indices, node, nodes, placement, array_id, "
            "priority, json_extract(spec, '$.preemptible') AS preemptible FROM jobs WHERE state = 'running' ORDER BY seq"
        )
        return [
            Holding(
                r["id"],
                r["owner"],
                Request(r["gpus"], r["gpu_memory"], r["cpus"], r["memory"], r["nodes"]),
                tuple(json.loads(r["gpu_indices"])),
                r["node"],
                tuple((node, tuple(gpus)) for node, gpus in json.loads(r["placement"] or "[]")),
                r["array_id"],
                r["priority"],
                bool(r["preemptible"]),
            )
            for r in rows
        ]

    def queue(self, caller: Identity) -> list[JobRecord]:
        """Every queued job (every user's: the queue is shared), in the order they get their turn.

        Other users' jobs show who submitted them and what they ask for, but not their command or name.
        """
        self._schedule(explain=True)
        rows = self.store.query("SELECT * FROM jobs WHERE state = 'queued'")
        records = [self._record(r) for r in rows]
        if self.executor.keeps_queue:  # handed over: the jobs the cluster's queue holds, with its reasons
            handed = self.store.query("SELECT * FROM jobs WHERE state = 'running' ORDER BY seq")
            reasons = self.executor.waiting([r["id"] for r in handed])
            records = [dataclasses.replace(j, position=n) for n, j in enumerate(records, 1)]
            held = [r for r in handed if r["id"] in reasons]
            records += [
                dataclasses.replace(self._record(r), state=JobState.QUEUED, message=reasons[r["id"]], position=n)
                for n, r in enumerate(held, len(records) + 1)
            ]
        if any(not j.position for j in records):  # a deep queue: the jobs a pass did not reach get theirs now
            cluster = self.cluster
            fair = self.usage.fair_share(cluster, self.quotas.shares())
            order = {
                p.job_id: n for n, p in enumerate(queue_order(self.scheduler.queue, self.running(), cluster, fair), 1)
            }
            records = [j if j.position else dataclasses.replace(j, position=order.get(j.id, 0)) for j in records]
        records.sort(key=lambda j: j.position or 1 << 30)
        return [
            j if j.owner == caller.name or caller.admin else dataclasses.replace(j, command=[], name="")
            for j in records
        ]

    def reachable(self, caller: Identity, job_id: str) -> JobRecord:
        """``caller``'s own running job ``job_id`` (an id or a name), to forward a port of or run a
        command in. Raises ``PermissionDenied`` for another user's job, an admin's too: reaching into
        a job acts as its owner, inside its sandbox; ``Conflict`` when it is not running."""
        row = self.store.query_one("SELECT owner FROM jobs WHERE id = ?", (job_id[:64],))
        if row is not None and row["owner"] != caller.name:
            raise PermissionDenied(
                f"job {job_id[:64]} is not yours: only its owner may forward its ports or run commands in it"
            )
        job = self.get(caller, job_id)
        if job.owner != caller.name:  # an admin's find by name finds only their own; kept for safety
            raise PermissionDenied(f"job {job.id} is not yours: only its owner may reach it")
        if job.state is not JobState.RUNNING:
            when = "once it runs" if job.state is JobState.QUEUED else "only while a job runs"
            raise Conflict(f"job {job.id} is {job.state.value}: it can be reached {when}")
        problem = self.executor.reach_problem()
        if problem:
            raise InvalidRequest(problem)
        return job

    def cancel(self, caller: Identity, job_id: str) -> JobRecord:
        """Cancel a queued job at once; ask a running one to stop (SIGTERM, then SIGKILL after the grace)."""
        job = self.get(caller, job_id)
        if job.state.is_terminal():
            raise Conflict(f"job {job.id} has already ended ({job.state.value}); there is nothing to cancel")
        if job.state is JobState.QUEUED:
            self._move(job.id, JobState.QUEUED, JobState.CANCELLED, ended_at=time.time(), message="cancelled")
            self.scheduler.drop(job.id)
            self._drop_checkpoint(job.id)
            self._announce_end(job.id)
            self._schedule_soon()  # it may have held the reservation, or been ahead of others
        else:
            with self.store.transaction() as db:
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job.id,))
            self.executor.cancel(job.id)
        log.info("job %s: cancel asked by %s", job.id, caller.name)
        return self._load(job.id)

    def cancel_array(self, caller: Identity, ref: str) -> ArrayRecord:
        """Cancel every task of a job array that has not ended: the queued ones at once, the running
        ones as ``cancel`` stops them. Raises ``Conflict`` when all have ended."""
        array = self.array(caller, ref)
        if all(t.state.is_terminal() for t in array.tasks):
            raise Conflict(f"every task of array {array.id} has ended; there is nothing to cancel")
        now = time.time()
        self.scheduler.changed(replan=True)
        with self.store.transaction() as db:
            queued = [
                r["id"] for r in db.execute("SELECT id FROM jobs WHERE array_id = ? AND state = 'queued'", (array.id,))
            ]
            db.execute(
                "UPDATE jobs SET state = 'cancelled', ended_at = ?, message = 'cancelled with its array' "
                "WHERE array_id = ? AND state = 'queued'",
                (now, array.id),
            )
            running = [
                r["id"] for r in db.execute("SELECT id FROM jobs WHERE array_id = ? AND state = 'running'", (array.id,))
            ]
            db.execute("UPDATE jobs SET cancel_requested = 1 WHERE array_id = ? AND state = 'running'", (array.id,))
        for job_id in queued:
            self.scheduler.drop(job_id)
            self._drop_checkpoint(job_id)
        for job_id in running:
            self.executor.cancel(job_id)
        for job_id in queued:
            self._announce_end(job_id)
        self._schedule_soon()
        log.info(
            "array %s: cancel asked by %s (%d queued, %d running)", array.id, caller.name, len(queued), len(running)
        )
        return self._array_record(self._array_row(array.id))

    # ---- dependencies ---------------------------------------------------------------------------

    def _dependencies(self, caller: Identity, refs: list[str]) -> list[tuple[str, str]]:
        """``JOB[:ok|:any]`` items (each may be a comma list; JOB an id, a name or an array) as
        (job or array id, "ok" | "any"). Raises ``InvalidRequest``, ``NotFound`` (no such job of the
        caller's), ``PermissionDenied`` (another user's) or ``Conflict`` (it has already failed: the
        job could never run)."""
        found: list[tuple[str, str]] = []
        for item in (part.strip() for text in refs for part in text.split(",")):
            if not item:
                raise InvalidRequest(
                    "--after: an empty item; give JOB, JOB:ok or JOB:any (JOB: an id, a name or an array)"
                )
            ref, mode = item, "ok"
            for suffix in (":ok", ":any"):
                if item.endswith(suffix):
                    ref, mode = item[: -len(suffix)], suffix[1:]
            try:
                _, row = self._find(caller, ref)
            except NotFound as e:
                raise NotFound(f"--after {item[:80]}: {e}") from None
            if row["owner"] != caller.name:
                raise PermissionDenied(
                    f"--after {item[:80]}: {row['id']} is {row['owner']}'s; a job may wait only for its own user's jobs"
                )
            if mode == "ok":
                failed = self.store.query_one(
                    "SELECT id, state FROM jobs WHERE (id = ? OR array_id = ?) AND state NOT IN "
                    "('queued', 'running', 'succeeded') LIMIT 1",
                    (row["id"], row["id"]),
                )
                if failed is not None:
                    raise Conflict(
                        f"--after {item[:80]}: {failed['id']} has already ended {failed['state']}, so this job "
                        f"could never run; wait for it with {row['id']}:any, or leave it out"
                    )
            if (row["id"], mode) not in found:
                found.append((row["id"], mode))
        if len(found) > _MAX_DEPENDENCIES:
            raise InvalidRequest(f"{len(found)} jobs to wait for; the most is {_MAX_DEPENDENCIES}")
        return found

    def _dependency_state(self, after: list[tuple[str, str]]) -> tuple[str, str]:
        """("met", ""), ("waits", why) or ("failed", why) for the jobs and arrays ``after`` names."""
        waits = []
        for ref, mode in after:
            rows = self.store.query("SELECT id, state FROM jobs WHERE id = ? OR array_id = ?", (ref, ref))
            if mode == "ok":
                failed = [r for r in rows if r["state"] not in ("queued", "running", "succeeded")]
                if failed:
                    what = f"{failed[0]['id']} ended {failed[0]['state']}"
                    if len(failed) > 1:
                        what += f" (and {len(failed) - 1} more of array {ref})"
                    return (
                        "failed",
                        f"cancelled: {what}, and this job was to run only once {ref} succeeded (after {ref}:ok)",
                    )
            left = [r for r in rows if r["state"] in ("queued", "running")]
            if left:
                what = (
                    ref
                    if len(rows) == 1 and rows[0]["id"] == ref
                    else f"array {ref} ({len(left)} of {len(rows)} tasks left)"
                )
                waits.append(f"waits for {what} to {'succeed' if mode == 'ok' else 'end'}")
        return ("waits", "; ".join(waits)) if waits else ("met", "")

    def _wait_for(self, job_id: str, after: list[tuple[str, str]]) -> str:
        """Why queued job ``job_id`` may not start yet for its dependencies ('' : it may), watching
        them until they are met. Checked when submitted: none has failed."""
        if not after:
            return ""
        state, why = self._dependency_state(after)
        if state == "met":
            return ""
        for ref, _ in after:
            self._waiters.setdefault(ref, set()).add(job_id)
        return why or "waits for its dependencies"

    def _dependency_ended(self, job_id: str) -> None:
        """A job has ended: look again at the queued jobs that wait for it or for its array."""
        if not self._waiters:
            return
        row = self.store.query_one("SELECT array_id FROM jobs WHERE id = ?", (job_id,))
        refs = [job_id, row["array_id"]] if row is not None and row["array_id"] else [job_id]
        waiting = set().union(*(self._waiters.get(ref, ()) for ref in refs))
        for waiter in sorted(waiting):
            self._recheck(waiter)

    def _recheck(self, job_id: str) -> None:
        """Start, keep waiting or cancel (a dependency failed under ``ok``) queued job ``job_id``."""
        row = self.store.query_one("SELECT state, depends_on FROM jobs WHERE id = ?", (job_id,))
        after = [(ref, mode) for ref, mode in json.loads(row["depends_on"] or "[]")] if row is not None else []
        pending = self.scheduler.queue.get(job_id)
        state, why = self._dependency_state(after) if pending is not None else ("gone", "")
        if state in ("met", "failed", "gone"):
            for ref, _ in after:
                waiters = self._waiters.get(ref)
                if waiters is not None:
                    waiters.discard(job_id)
                    if not waiters:
                        del self._waiters[ref]
        if pending is None:
            return
        self.scheduler.changed(replan=True)
        if state == "failed":
            log.info("job %s %s", job_id, why)
            self._move(job_id, JobState.QUEUED, JobState.CANCELLED, ended_at=time.time(), message=why)
            self.scheduler.drop(job_id)
            self._drop_checkpoint(job_id)
            self._announce_end(job_id)
        else:
            self.scheduler.update(job_id, blocked=why)
        self._schedule_soon()

    async def wait(self, caller: Identity, job_id: str, timeout: float) -> JobRecord:
        """The job once it has ended, or as it is when ``timeout`` seconds have passed."""
        job = self.get(caller, job_id)
        if not job.state.is_terminal():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended_event(job.id).wait(), timeout)
        return self._load(job.id)

    async def read_log(
        self, caller: Identity, job_id: str, offset: int, limit: int, tail: int | None = None
    ) -> tuple[JobRecord, int, bytes]:
        """The job (as it was before the read), and up to ``limit`` bytes of its log from ``offset``
        (or from the start of its last ``tail`` lines) with the offset they start at: further on,
        where ``offset`` lies in a part cut from a log that passed its limit (the bytes then start
        with the note of what was cut)."""
        job = self.get(caller, job_id)
        if offset < 0:
            raise InvalidRequest(f"log offset must be 0 or more, not {offset}")
        if tail is not None and tail < 0:
            raise InvalidRequest(f"the lines to show from the log's end must be 0 or more, not {tail}")
        if job.state is JobState.QUEUED:
            return job, 0 if tail is not None else offset, b""
        offset, data = await asyncio.to_thread(self._read_log_at, job.id, offset, limit, tail)  # it may ask a node
        return job, offset, data

    def _read_log_at(self, job_id: str, offset: int, limit: int, tail: int | None) -> tuple[int, bytes]:
        if tail is not None:
            offset = self.tail_offset(job_id, tail)
        data = self.executor.read_log(job_id, offset, max(0, min(limit, LOG_CHUNK_BYTES)))
        if not data:
            start = self.executor.log_data_offset(job_id, offset)
            if start != offset:
                return start, self.executor.read_log(job_id, start, max(0, min(limit, LOG_CHUNK_BYTES)))
        return offset, data

    def tail_offset(self, job_id: str, lines: int) -> int:
        """Where the last ``lines`` lines of the job's log start, found by reading back from its end
        (a log may be hundreds of MiB): never before a part cut from a log that passed its limit
        (the note of what was cut starts the tail then). Reads files: call it from a thread."""
        end = self.executor.log_size(job_id)
        if end == 0 or lines == 0:
            return end
        last = self.executor.read_log(job_id, end - 1, 1)
        newlines = lines + (last == b"\n")  # a last line without its newline counts too
        pos = end
        while pos > 0:
            start = max(0, pos - LOG_CHUNK_BYTES)
            data = self.executor.read_log(job_id, start, pos - start)
            if len(data) < pos - start:  # a hole (the part cut) ends in this stretch: read from its end
                start = self.executor.log_data_offset(job_id, start + len(data))
                data = self.executor.read_log(job_id, start, pos - start) if start < pos else b""
                pos = 0  # and no further back
            cut = len(data)
            while newlines and (cut := data.rfind(b"\n", 0, cut)) >= 0:
                newlines -= 1
                if not newlines:
                    return start + cut + 1
            pos = min(pos, start)
        return start

    async def logs(
        self, caller: Identity, job_id: str, offset: int, follow: bool, tail: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """(offset, bytes) chunks of the job's log from ``offset``; with ``follow``, until the job has ended.

        With ``tail``, from the start of its last ``tail`` lines instead: the first chunk then says
        where, with no bytes where there are none yet (a follower resumes from there).
        """
        job = self.get(caller, job_id)
        if offset < 0:
            raise InvalidRequest(f"log offset must be 0 or more, not {offset}")
        if tail is not None:
            if tail < 0:
                raise InvalidRequest(f"the lines to show from the log's end must be 0 or more, not {tail}")
            offset = 0
            if job.state is not JobState.QUEUED:
                offset = await asyncio.to_thread(self.tail_offset, job.id, tail)
            yield offset, b""
        ended = asyncio.Event() if job.state.is_terminal() else self._ended_event(job.id)
        if job.state.is_terminal():
            ended.set()
        read = self.executor.read_log
        while True:
            done = ended.is_set()  # looked at before reading, so the last bytes are never missed
            data = await asyncio.to_thread(read, job.id, offset, LOG_CHUNK_BYTES)
            if not data:  # at the end, or at a part cut from a log past its limit: then past it
                start = await asyncio.to_thread(self.executor.log_data_offset, job.id, offset)
                if start != offset:
                    offset = start
                    continue
            if data:
                yield offset, data
                offset += len(data)
                continue
            if done or not follow:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ended.wait(), LOG_POLL_INTERVAL)

    async def outputs(self, caller: Identity, job_id: str) -> tuple[JobRecord, str, list[str]]:
        """The job, its outputs as a snapshot id ('' for none) and the declared paths not found.

        An ended job's are those collected when it ended. A running job's are collected now, as
        they are (a file being written may be cut short), through the same checks as at its end;
        the snapshot is kept until the job ends or its outputs are collected again. Raises
        ``Conflict`` for a queued job, ``ResourceUnavailable`` past the owner's storage quota.
        """
        job = self.get(caller, job_id)
        if job.state is JobState.QUEUED:
            raise Conflict(f"job {job.id} is queued: it has no outputs until it runs")
        if job.state.is_terminal():
            return job, job.output_snapshot_id, []
        row = self.store.query_one("SELECT * FROM jobs WHERE id = ?", (job.id,))
        assert row is not None
        try:
            snapshot, missing = await asyncio.to_thread(self._collect_outputs, row)
        except (OSError, ResourceUnavailable):
            job = self._load(job.id)
            if job.state.is_terminal():  # it ended meanwhile, and its folders went
                return job, job.output_snapshot_id, []
            raise
        with self.store.transaction() as db:
            before = db.execute("SELECT live_outputs FROM jobs WHERE id = ?", (job.id,)).fetchone()
            running = db.execute(
                "UPDATE jobs SET live_outputs = ? WHERE id = ? AND state = 'running'", (snapshot, job.id)
            ).rowcount
        if not running:  # it ended meanwhile: its final outputs instead
            self._discard(job.owner, snapshot)
            job = self._load(job.id)
            return job, job.output_snapshot_id, []
        if before["live_outputs"] != snapshot:
            self._discard(job.owner, before["live_outputs"])
        return self._load(job.id), snapshot, missing

    def _drop_checkpoint(self, job_id: str) -> None:
        """Discard the checkpoint a job queued again kept for its next run: it ended while queued."""
        row = self.store.query_one("SELECT owner, spec FROM jobs WHERE id = ?", (job_id,))
        if row is not None:
            self._discard(row["owner"], json.loads(row["spec"] or "{}").get("checkpoint_snapshot", ""))

    def _discard(self, owner: str, snapshot: str) -> None:
        """Drop a snapshot of a running job's outputs once nothing else uses it."""
        if snapshot:
            self.snapshots.discard(owner, snapshot)

    # ---- life cycle -----------------------------------------------------------------------------

    def _ended_event(self, job_id: str) -> asyncio.Event:
        event = self._ended.get(job_id)
        if event is None:
            event = self._ended[job_id] = asyncio.Event()
        return event

    def _announce_end(self, job_id: str) -> None:
        """Wake whoever waits for the job or follows its log; later callers read the state from the store."""
        event = self._ended.pop(job_id, None)
        if event is not None:
            event.set()
        self._dependency_ended(job_id)

    def _move(self, job_id: str, old: JobState, new: JobState, **columns: Any) -> None:
        check_move(job_id, old, new)
        self.scheduler.changed()
        sets = ", ".join(f"{k} = ?" for k in columns)
        with self.store.transaction() as db:
            changed = db.execute(
                f"UPDATE jobs SET state = ?{', ' + sets if sets else ''} WHERE id = ? AND state = ?",
                (new.value, *columns.values(), job_id, old.value),
            ).rowcount
        if not changed:
            raise Conflict(f"job {job_id} is no longer {old.value}")

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Pick up where the last server left off, then start what can start."""
        self._loop = asyncio.get_running_loop()
        for row in self.store.query("SELECT id FROM jobs WHERE state = 'running' ORDER BY seq"):
            job_id = row["id"]
            if await asyncio.to_thread(self.executor.is_running, job_id):
                log.info("job %s is still running: watching it again", job_id)
                self.executor.reattach(job_id, self._exit_callback(job_id))
            elif await asyncio.to_thread(self.executor.was_started, job_id):
                self._spawn(self._finish(job_id))  # it ended while no server was watching
            else:  # the server stopped between granting GPUs and launching: launch it again
                log.info("job %s never launched: back to the queue", job_id)
                self._move(
                    job_id, JobState.RUNNING, JobState.QUEUED, gpu_indices="[]", node="", placement="", started_at=None
                )
                self.usage.end(job_id, time.time())
        rows = self.store.query(
            "SELECT id, owner, gpus, gpu_memory, cpus, memory, priority, seq, reserved_at, nodes, array_id, "
            "depends_on, created_at FROM jobs WHERE state = 'queued'"
        )
        self._caps = {
            r["id"]: r["max_running"]
            for r in self.store.query(
                f"SELECT id, max_running FROM arrays a WHERE max_running > 0 AND EXISTS "
                f"(SELECT 1 FROM jobs WHERE array_id = a.id AND {_ACTIVE})"
            )
        }
        self.scheduler = Scheduler(
            Pending(
                r["id"],
                r["owner"],
                Request(r["gpus"], r["gpu_memory"], r["cpus"], r["memory"], r["nodes"]),
                r["priority"],
                r["seq"],
                r["reserved_at"],
                r["array_id"],
                "waits for its dependencies" if r["depends_on"] else "",  # looked at below, before any pass
                r["created_at"],
            )
            for r in rows
        )
        for r in rows:  # what they wait for may have ended while no server was watching
            if r["depends_on"]:
                self._wait_for(r["id"], [(ref, mode) for ref, mode in json.loads(r["depends_on"])])
                self._recheck(r["id"])
        self._schedule()

    def reschedule(self) -> None:
        """Look at the queue again soon: something it depends on (a quota) has changed."""
        self.scheduler.changed(replan=True)
        self._schedule_soon()

    def _nodes_changed(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the server is stopping
                loop.call_soon_threadsafe(self.reschedule)

    def _schedule_soon(self) -> None:
        """One scheduling pass on the next turn of the loop, however many jobs end meanwhile."""
        if self._loop is None or self._schedule_pending:
            return
        self._schedule_pending = True
        self._loop.call_soon(self._schedule)

    def _schedule(self, explain: bool = False) -> None:
        """Start what can start now; remember why the rest waits (see scheduler.py for the rules).

        When nothing in the queue fits what is free, the pass is skipped (a deep queue would cost a
        full plan on every submit and every end) unless ``explain`` asks for the reasons.
        """
        self._schedule_pending = False
        if self._loop is None:
            return  # not started yet: start() schedules
        if self.executor.keeps_queue:
            self._hand_over()
            return
        running = self.running()
        queued = self.scheduler.queue
        low_memory = self._low_memory() if queued else ""
        if low_memory and self._floor_check is None and any(not r.memory for r in queued.kinds()):
            # Memory comes back without an event to say so: look again in a while.
            self._floor_check = self._loop.call_later(_FLOOR_RECHECK, self._recheck_floor)
        cluster = self.cluster
        if not explain and not could_start(queued.kinds(), running, cluster, low_memory):
            self.scheduler.skipped()
            self._preempt(running, cluster)
            return
        quotas = self.quotas.all()
        fair = self.usage.fair_share(cluster, self.quotas.shares()) if queued else None
        self._preempt(running, cluster, quotas, fair)
        decisions = (
            plan(queued, running, cluster, quotas, low_memory, LOOK_AHEAD, self._caps, fair=fair, reach=REACH)
            if queued
            else []
        )
        self.scheduler.planned(decisions, low_memory, cluster)
        for decision in decisions:
            pending = queued[decision.job_id]
            if decision.reserves and pending.reserved_at is None:
                now = time.time()
                with self.store.transaction() as db:  # the reservation sticks, across restarts too
                    db.execute("UPDATE jobs SET reserved_at = ? WHERE id = ?", (now, decision.job_id))
                self.scheduler.update(decision.job_id, reserved_at=now)
            if decision.gpu_indices is None:
                continue
            now = time.time()
            self._move(
                decision.job_id,
                JobState.QUEUED,
                JobState.RUNNING,
                gpu_indices=json.dumps(list(decision.gpu_indices)),
                node=decision.node,
                placement=json.dumps(decision.placement) if decision.placement else "",
                started_at=now,
                message="",
            )
            self._account(pending, decision, cluster, now)
            self.scheduler.drop(decision.job_id)
            self._spawn(self._launch(decision.job_id))

    def _hand_over(self) -> None:
        """Start every queued job nothing of gpuport's holds: the cluster's own queue orders them. An
        array's ``%N`` still holds its tasks here, N at a time (each task is a job of the cluster's)."""
        cluster = self.cluster
        caps = self._caps
        in_group = Counter(h.group for h in self.running() if h.group in caps) if caps else Counter()
        held: dict[str, Decision] = {}
        for pending in [p for p in self.scheduler.queue.values() if not p.blocked]:
            cap = caps.get(pending.group, 0) if pending.group else 0
            if cap and in_group[pending.group] >= cap:
                reason = f"array {pending.group} runs {in_group[pending.group]} of its tasks, the most at once (%{cap})"
                held[pending.job_id] = Decision(pending.job_id, len(held) + 1, None, reason)
                continue
            in_group[pending.group] += 1
            now = time.time()
            self._move(pending.job_id, JobState.QUEUED, JobState.RUNNING, started_at=now, message="")
            if not self.executor.times_runs:  # else its row opens when the cluster starts it (_run_timed)
                self._account(pending, Decision(pending.job_id, 0, ()), cluster, now)
            self.scheduler.drop(pending.job_id)
            self._spawn(self._launch(pending.job_id))
        self.scheduler.handed_over(held)

    def _preempt(self, running: list[Holding], cluster: Cluster, quotas: Any = None, fair: Any = None) -> None:
        """Stop the preemptible jobs that queued jobs have waited too long for (``scheduler.preempt``);
        look again when the next queued job will have waited long enough."""
        if self._preempt_check is not None:
            self._preempt_check.cancel()
            self._preempt_check = None
        queued = self.scheduler.queue
        if not queued or not any(h.preemptible and h.job_id not in self._preempting for h in running):
            return
        now = time.time()
        if quotas is None:
            quotas = self.quotas.all()
        if fair is None:
            fair = self.usage.fair_share(cluster, self.quotas.shares())
        victims = preempt(queued, running, cluster, now, self.preempt_after, fair, quotas, self._preempting)
        for victim, waiting in victims:
            self._preempting.add(victim)
            with self.store.transaction() as db:  # a server restarted meanwhile still knows why it ends
                db.execute("UPDATE jobs SET spec = json_set(spec, '$.preempting', 1) WHERE id = ?", (victim,))
            log.info("job %s: preempted for %s, which waited %s", victim, waiting, format_duration(self.preempt_after))
            self.executor.preempt(victim)
        soon = [
            p.created_at + self.preempt_after
            for p in queued.values()
            if p.created_at and p.created_at + self.preempt_after > now
        ]
        if soon and self._loop is not None:
            self._preempt_check = self._loop.call_later(min(soon) - now + 0.05, self.reschedule)

    def _account(self, job: Pending, decision: Decision, cluster: Cluster, at: float) -> None:
        """Open the usage row of a run just granted (services/usage.py)."""
        slice_of = 0
        if job.request.gpu_memory and decision.gpu_indices:
            sizes = cluster.machines.get(decision.node)
            if sizes is not None and decision.gpu_indices[0] < len(sizes.gpu_memory):
                slice_of = sizes.gpu_memory[decision.gpu_indices[0]]
        kind = self.store.query_one("SELECT kind FROM jobs WHERE id = ?", (job.job_id,))
        with self.store.transaction() as db:
            self.usage.begin(db, job.job_id, job.owner, kind["kind"] if kind else "job", job.request, slice_of, at)

    def _run_timed(self, job_id: str, run: Run) -> None:
        """The cluster reports a run's times (``Executor.times_runs``; from the executor's thread):
        its usage row takes them (services/usage.py)."""
        row = self.store.query_one("SELECT owner, kind, gpus, cpus, memory, nodes FROM jobs WHERE id = ?", (job_id,))
        if row is None:
            return
        if run.node:  # where the cluster runs it: its node, as `gpuport jobs` and `gpuport sessions` show it
            with self.store.transaction() as db:
                db.execute("UPDATE jobs SET node = ? WHERE id = ? AND node = ''", (run.node, job_id))
        n = row["nodes"]
        run = dataclasses.replace(
            run,
            gpus=row["gpus"] * n if run.gpus is None else run.gpus,
            cpus=row["cpus"] * n if run.cpus is None else run.cpus,
        )
        self.usage.record_run(job_id, row["owner"], row["kind"], run, row["memory"] * n)

    def _low_memory(self) -> str:
        """Why work that reserves no memory waits now ('' : it need not)."""
        if not self.memory_floor:
            return ""
        now = time.monotonic()
        if now - self._memory_read[0] > _MEMORY_READ_FOR:  # a burst of submits reads it once
            self._memory_read = (now, psutil.virtual_memory().available)
        available = self._memory_read[1]
        if available >= self.memory_floor:
            return ""
        return (
            f"the machine has {format_size(available)} of memory free, below the floor of "
            f"{format_size(self.memory_floor)}: work that reserves no memory waits (ask for some with --memory)"
        )

    def _recheck_floor(self) -> None:
        self._floor_check = None
        self.scheduler.changed(replan=True)
        self._schedule_soon()

    def _exit_callback(self, job_id: str) -> Any:
        loop = self._loop
        assert loop is not None

        def on_exit() -> None:
            try:
                loop.call_soon_threadsafe(self._spawn, self._finish(job_id))
            except RuntimeError:  # the server is stopping: its next start records how the job ended
                pass

        return on_exit

    async def _launch(self, job_id: str) -> None:
        row = self.store.query_one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        assert row is not None
        try:
            job = self._launch_of(row)
            flags = self.store.query_one("SELECT cancel_requested FROM jobs WHERE id = ?", (job_id,))
            if flags is not None and flags["cancel_requested"]:
                self._end(job_id, JobState.CANCELLED, None, "cancelled before it started")
                return
            gate = self._launching.setdefault(job.owner, asyncio.Semaphore(LAUNCHES_PER_USER))
            async with gate:
                await asyncio.to_thread(self.executor.start, job, self._exit_callback(job_id))
                await self._set_up(job_id)
        except BuildFailed as e:
            self._end(job_id, JobState.FAILED, None, f"its environment could not be built: {e}")
            return
        except NodeLost as e:  # not the job's doing: placed again on the nodes left
            log.warning("job %s: %s", job_id, e)
            row = self.store.query_one("SELECT * FROM jobs WHERE id = ?", (job_id,))
            if row is not None and row["state"] == JobState.RUNNING.value:
                self._requeue(row, json.loads(row["spec"]), str(e), retry=False)
            return
        except Exception as e:
            log.exception("job %s: preparing or starting it on %s failed", job_id, row["node"] or "this machine")
            self._end(job_id, JobState.FAILED, None, f"the server could not prepare the job: {e}")
            return
        flags = self.store.query_one("SELECT cancel_requested FROM jobs WHERE id = ?", (job_id,))
        if flags is not None and flags["cancel_requested"]:  # asked while it was being started
            self.executor.cancel(job_id)

    async def _set_up(self, job_id: str) -> None:
        """Until the job's supervisor has set it up and started it (or it ended), at most _SETUP_WAIT."""
        if not self.executor.runs_here:  # elsewhere: on other machines, their CPUs and kernels
            return
        deadline = time.monotonic() + _SETUP_WAIT
        while time.monotonic() < deadline:
            if await asyncio.to_thread(
                lambda: self.executor.was_started(job_id) or not self.executor.is_running(job_id)
            ):
                return
            await asyncio.sleep(_SETUP_POLL)

    def _launch_of(self, row: Any) -> JobLaunch:
        """The job as its executor starts it: its command, environment, files and processes."""
        owner = Identity(row["owner"], admin=False)
        workdir = None
        if row["snapshot_id"]:
            workdir = _files(self.snapshots, self.snapshots.resolve(owner, row["snapshot_id"]))
        spec = json.loads(row["spec"])
        if spec.get("checkpoint_snapshot"):  # what its last run saved, over the files it was submitted with
            folder = spec["checkpoint"] + "/"
            saved = _files(self.snapshots, self.snapshots.resolve(owner, spec["checkpoint_snapshot"]))
            kept = [e for e in saved.entries if e[0].startswith(folder)]
            given = [e for e in (workdir.entries if workdir else []) if not e[0].startswith(folder)]
            workdir = Files(given + kept)
        datasets = {
            name: _files(self.snapshots, self.snapshots.resolve(owner, snapshot))
            for name, snapshot in spec["datasets"].items()
        }
        env = dict(spec["env"])
        env.update(spec.get("internal_env") or {})
        env[ENV_JOB_ID] = row["id"]
        gpu_indices = json.loads(row["gpu_indices"])
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's numbering = NVML's = ours
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_indices))
        env.update(self._caps_env(row, gpu_indices))
        here = row["nprocs"] // row["nodes"]  # processes on each of its nodes
        if row["cpus"]:
            # As Ray does for its tasks: thread pools sized to the CPUs reserved, not to the machine
            # (OpenMP's, PyTorch's, and TensorFlow's, whose idle threads spin: a small model served on
            # 1 CPU used a quarter to a half more CPU time with a pool per core, on 2 cores).
            threads = str(max(1, int(row["cpus"] // here)))
            for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
                if name not in spec["env"]:
                    env[name] = threads
        tf_roles = spec.get("tf_roles")
        environment = spec.get("environment_request")
        return JobLaunch(
            job_id=row["id"],
            owner=row["owner"],
            placement=Placement(row["node"], tuple(gpu_indices)),
            argv=json.loads(row["command"]),
            env=env,
            user_env=frozenset(spec["env"]),
            # A cluster's nodes run jobs as a uid per user when they can, whatever this machine does.
            uid=self.uids.uid(row["owner"]) if self.sandbox.mode == "uids" or self.executor.uid_per_user else None,
            workdir=workdir,
            datasets=datasets,
            hyperparameters=spec["hyperparameters"],
            outputs=json.loads(row["outputs"]),
            folders=list(spec.get("folders") or ()),
            grace=DEFAULT_CANCEL_GRACE,
            time_limit=row["time_limit"],
            nprocs=row["nprocs"],
            tf_roles=[(role, count) for role, count in tf_roles] if tf_roles else None,
            rank_gpus=rank_gpus(gpu_indices, row["nprocs"]) if row["nprocs"] > 1 and row["nodes"] == 1 else None,
            parts=tuple(Placement(node, tuple(gpus)) for node, gpus in json.loads(row["placement"] or "[]")),
            memory=row["memory"],
            processes=self.quotas.processes(row["owner"]),
            environment=environment,
            build_uid=self.uids.uid(BUILD_OWNER) if environment is not None and self.sandbox.mode == "uids" else None,
            gpus=row["gpus"],
            gpu_memory=row["gpu_memory"],
            cpus=row["cpus"],
            partition=spec.get("partition", ""),
            batch_script=spec.get("batch_script", ""),
            nodes=row["nodes"],
            workers=row["kind"] != "job",
        )

    def record_environment(self, job_id: str, built: Built) -> None:
        """Note on the job the environment it runs in (from the thread that set the job up)."""
        with self.store.transaction() as db:
            db.execute("UPDATE jobs SET spec = json_set(spec, '$.environment', ?) WHERE id = ?", (built.hash, job_id))

    def environments_in_use(self) -> set[str]:
        """The environments of the running jobs: never evicted nor pruned."""
        rows = self.store.query(
            "SELECT DISTINCT json_extract(spec, '$.environment') AS env FROM jobs WHERE state = 'running'"
        )
        return {r["env"] for r in rows if r["env"]}

    def environment_jobs(self, running: bool = False) -> Counter[str]:
        """How many jobs (of every state; ``running``: running now) ran in each environment."""
        now = " AND state = 'running'" if running else ""
        rows = self.store.query(
            "SELECT json_extract(spec, '$.environment') AS env, COUNT(*) AS n FROM jobs "
            f"WHERE json_extract(spec, '$.environment') IS NOT NULL{now} GROUP BY 1"
        )
        return Counter({r["env"]: r["n"] for r in rows})

    def _caps_env(self, row: Any, gpu_indices: list[int]) -> dict[str, str]:
        """A slice's limit for each framework, read by the job's bootstrap or by the framework itself.

        The processes of a job share its slice evenly.
        """
        if not row["gpu_memory"] or not gpu_indices:
            return {}
        per_process = row["gpu_memory"] // row["nprocs"]
        machines = self.cluster.machines
        machine = machines.get(row["node"]) or next(iter(machines.values()))
        fraction = per_process / machine.gpu_memory[gpu_indices[0]]
        return {
            ENV_GPU_MEMORY: str(per_process),
            ENV_GPU_MEMORY_FRACTION: f"{fraction:.6f}",
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.6f}",
            "CUPY_GPU_MEMORY_LIMIT": str(per_process),
        }

    async def _finish(self, job_id: str) -> None:
        """The job's processes are gone: record how it ended, collect its outputs, free its GPUs."""
        row = self.store.query_one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        assert row is not None
        status = await asyncio.to_thread(self.executor.exit_status, job_id)
        spec = json.loads(row["spec"])
        self._preempting.discard(job_id)
        if spec.pop("preempting", None) and not row["cancel_requested"] and not (status or {}).get("killed"):
            # Stopped for a preemption (however it ended: saved and exited, or killed after its grace).
            spec["preempted"] = spec.get("preempted", 0) + 1
            await self._keep_checkpoint(row, spec)
            self._requeue(row, spec, f"it was preempted ({spec['preempted']}x)", retry=False)
            return
        try:
            outputs, missing = await asyncio.to_thread(self._collect_outputs, row)
            note = f"; outputs not found: {', '.join(missing)}" if missing else ""
        except ResourceUnavailable as e:  # over the storage quota: the job ends as it did, without outputs
            log.info("job %s: outputs not kept: %s", job_id, e)
            outputs, note = "", f"; outputs not kept: {e}"
        except Exception as e:
            log.exception("job %s: collecting outputs failed", job_id)
            outputs, note = "", f"; outputs not found: (collecting outputs failed: {e})"
        tried = spec.get("tried", spec.get("lost", 0)) + 1
        retry = tried <= spec.get("retries", 0) and not row["cancel_requested"]
        if status is None:
            state, code = JobState.LOST, None
            message = "its supervisor ended without recording an exit code (killed, or the machine restarted)"
            if retry:
                await self._keep_checkpoint(row, spec)
                self._requeue(row, spec, message)
                return
        elif status.get("lost"):  # its node left the cluster
            if retry:
                await self._keep_checkpoint(row, spec)
                self._requeue(row, spec, status["lost"])
                return
            state, code, message = JobState.FAILED, None, status["lost"]
        else:
            code = status["exit_code"]
            message = status.get("error") or exit_message(code)
            if status.get("failed_rank") is not None:
                message = f"rank {status['failed_rank']} {message}"
            if status.get("killed"):
                state, message = JobState.KILLED, status["killed"]
                if status.get("oom") and retry and OOM_EXIT_CODE in spec.get("retry_on_exit", ()):
                    await self._keep_checkpoint(row, spec)
                    self._requeue(row, spec, f"the kernel's OOM killer ended it ({message})", outputs=outputs)
                    return
            elif status.get("timed_out"):
                limit = format_duration(row["time_limit"])
                state, message = JobState.TIMEOUT, f"stopped at its time limit of {limit} ({message})"
            elif row["cancel_requested"] or status.get("cancelled"):
                state, message = JobState.CANCELLED, f"cancelled ({message})"
            else:
                state = JobState.SUCCEEDED if code == 0 else JobState.FAILED
                if state is JobState.FAILED and retry and code in spec.get("retry_on_exit", ()):
                    await self._keep_checkpoint(row, spec)
                    self._requeue(row, spec, f"it {message}", outputs=outputs)
                    return
            if status.get("process_cap"):  # a fork failed at the cap: likely why it ended so
                message += f" (it reached its cap of {status['process_cap']} processes and threads)"
        status = status or {}
        self._end(job_id, state, code, message + note, outputs, status.get("ended_at"), status.get("cpu_seconds"))
        await asyncio.to_thread(self.executor.tidy, job_id)

    async def _keep_checkpoint(self, row: Any, spec: dict[str, Any]) -> None:
        """Snapshot the job's --checkpoint folder (counted in its owner's storage) for its next run,
        in place of the one kept before; without one, or when it cannot be kept, the next run starts
        from what the last one kept."""
        if not spec.get("checkpoint"):
            return
        try:
            kept, missing = await asyncio.to_thread(self._collect_outputs, row, [spec["checkpoint"]])
        except (ResourceUnavailable, OSError) as e:  # over the storage quota, or unreadable: from the last one kept
            log.warning("job %s: its checkpoint folder %s was not kept: %s", row["id"], spec["checkpoint"], e)
            return
        if kept and not missing:
            self._discard(row["owner"], spec.get("checkpoint_snapshot", ""))
            spec["checkpoint_snapshot"] = kept
        else:
            self._discard(row["owner"], kept)

    def _requeue(self, row: Any, spec: dict[str, Any], why: str, retry: bool = True, outputs: str = "") -> None:
        """Queue a job again, keeping its place in the queue: after a failure not of its code's making
        (``retry``: its retries allow it; it waits a backoff first), or after it was preempted."""
        if retry:
            tried = spec["tried"] = spec.get("tried", spec.get("lost", 0)) + 1
            wait = min(DEFAULT_RETRY_BACKOFF * 2 ** (tried - 1), DEFAULT_RETRY_BACKOFF_MAX)
            message = f"queued again after {why} (retry {tried} of {spec['retries']}, after {format_duration(wait)})"
        else:
            wait, message = 0.0, f"queued again: {why}"
        live = self.store.query_one("SELECT live_outputs FROM jobs WHERE id = ?", (row["id"],))
        reserved_at = row["reserved_at"] if retry else None  # a preempted job does not keep a reservation
        self._move(
            row["id"], JobState.RUNNING, JobState.QUEUED,
            gpu_indices="[]", node="", placement="", started_at=None, spec=json.dumps(spec), message=message,
            live_outputs="", reserved_at=reserved_at,
        )  # fmt: skip
        if live is not None:  # it starts over: what it wrote before is gone
            self._discard(row["owner"], live["live_outputs"])
        self._discard(row["owner"], outputs)
        self.usage.end(row["id"], time.time())
        log.warning("job %s: %s", row["id"], message)
        resources = Request(row["gpus"], row["gpu_memory"], row["cpus"], row["memory"], row["nodes"])
        pending = Pending(
            row["id"], row["owner"], resources, row["priority"], row["seq"], reserved_at, row["array_id"],
            created_at=row["created_at"],
        )  # fmt: skip
        if wait and self._loop is not None:
            self.scheduler.put(dataclasses.replace(pending, blocked=f"waits {format_duration(wait)} to retry"))
            self._loop.call_later(wait, self._retry_due, pending)
        else:
            self.scheduler.put(pending)
        self.executor.tidy(row["id"])
        self.reschedule()

    def _retry_due(self, pending: Pending) -> None:
        """A job's backoff before its retry is over: it may start."""
        waiting = self.scheduler.queue.get(pending.job_id)
        if waiting is not None and waiting.blocked.startswith("waits "):
            self.scheduler.put(pending)
            self.reschedule()

    def _end(
        self,
        job_id: str,
        state: JobState,
        code: int | None,
        message: str,
        outputs: str = "",
        ended_at: float | None = None,
        cpu_used: float | None = None,
    ) -> None:
        live = self.store.query_one("SELECT owner, live_outputs, spec FROM jobs WHERE id = ?", (job_id,))
        ended_at = ended_at or time.time()
        self._move(
            job_id,
            JobState.RUNNING,
            state,
            exit_code=code,
            message=message,
            output_snapshot_id=outputs,
            ended_at=ended_at,
            live_outputs="",
        )
        self.usage.end(job_id, ended_at, cpu_used if isinstance(cpu_used, (int, float)) else None)
        if live is not None and live["live_outputs"] != outputs:
            self._discard(live["owner"], live["live_outputs"])
        if live is not None:  # a checkpoint kept for a rerun there will not be
            self._discard(live["owner"], json.loads(live["spec"]).get("checkpoint_snapshot", ""))
        log.info("job %s %s: %s", job_id, state.value, message)
        self._announce_end(job_id)
        self._schedule_soon()

    def _collect_outputs(self, row: Any, declared: list[str] | None = None) -> tuple[str, list[str]]:
        """Snapshot $GPUPORT_OUTPUT_DIR and the declared output paths (or ``declared``); return its id
        and the paths not found."""

        owner = row["owner"]
        budget = self.storage.left(owner) if self.storage is not None else None

        def ingest(files: Any) -> str:
            return self.snapshots.ingest_folder(owner, files, budget).id

        try:
            paths = json.loads(row["outputs"]) if declared is None else declared
            return self.executor.collect_outputs(row["id"], paths, ingest)
        except OverBudget as e:
            assert self.storage is not None
            used, quota = self.storage.used(owner), self.quotas.storage(owner)
            raise ResourceUnavailable(over_quota(owner, used, quota, e.total, "its outputs")) from None

    def kill(self, job_id: str, reason: str) -> None:
        """Stop a running job at once (SIGKILL) for ``reason``; it ends as ``killed`` with that message."""
        log.warning("job %s: killing it: %s", job_id, reason)
        self.executor.kill(job_id, reason)
