"""Deployments: a trained model loaded by replica workers, answering predictions in dynamic batches.

A deployment is a model's files (a snapshot: uploaded from a local path, named, or a job's output),
loaded by ``replicas`` worker processes, each a job of kind "model" (``worker/model.py``): they
queue, hold their GPU slice, are capped and watched like any job, and they outlive a server restart
like any job. On a server whose jobs run here the files are written once under
``STATE_DIR/models/<id>/files``, a folder every replica reads; where jobs run on other machines (a
Ray cluster's nodes), each replica gets them as its workdir, a snapshot shipped to its node as a
job's code is. Either way the server reaches a replica only through the executor (``connect``,
``read_file``). This service keeps what is a deployment's own: its name and version, its state, the
connections to its replicas and the batcher in front of them, which feeds the replicas wherever they
run. A replica whose job ends (it crashed, its node was lost) is started again where the queue
places it. Every live deployment is picked up again when the server starts.

Names are the server's, not a user's: ``/v2/models/digits`` has no owner in it. Anyone with a token
can ask for predictions; the owner (or an admin) deploys new versions and undeploys.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import logging
import posixpath
import re
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from gpuport._files import let_read
from gpuport.defaults import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE_DELAY, MAX_SERVING_QUEUE
from gpuport.protocol.errors import (
    Conflict,
    GpuportError,
    InvalidRequest,
    NotFound,
    NotReady,
    PermissionDenied,
    ServerError,
    error_from_name,
)
from gpuport.protocol.paths import check_path
from gpuport.protocol.units import format_duration
from gpuport.server.blobs import Entry
from gpuport.server.environments import EnvRequest
from gpuport.server.services.auth import Identity
from gpuport.server.services.job_requests import JobRequest
from gpuport.server.services.jobs import JobRecord, JobService, JobState
from gpuport.server.services.snapshots import SnapshotService
from gpuport.server.serving import formats
from gpuport.server.serving.batcher import Batcher, BatcherStats, Timings
from gpuport.server.serving.records import DeploymentRecord
from gpuport.server.store import Store
from gpuport.server.worker import wire
from gpuport.server.worker.model import (
    ENV_MODEL_DIR,
    ENV_MODEL_REPLICA,
    LOAD_FAILED,
    decode_tensors,
    encode_tensors,
)

log = logging.getLogger(__name__)

_WORKER = [sys.executable, "-m", "gpuport.server.worker.model"]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_CONNECT_TIMEOUT = 300.0  # seconds from a replica's start to its socket accepting (a model loading)
_WATCH_EVERY = 0.2
_RESTARTS = 5  # a replica that crashes this many times within _RESTART_WINDOW seconds fails the deployment
_RESTART_WINDOW = 60.0
_MAX_REPLICAS = 64
_MAX_BATCH = 1 << 20


@dataclass(frozen=True)
class DeploySpec:
    name: str
    source: str
    version: int = 0  # 0: the next one
    format: str = ""
    gpus: int = 0
    gpu_memory: int = 0
    cpus: float = 0.0
    memory: int = 0
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay: float = DEFAULT_MAX_QUEUE_DELAY
    replicas: int = 1
    public: bool = False  # predictions and metadata need no credentials
    label: str = ""  # a version label (TensorFlow Serving's) given to the new version once deployed
    requirements: str = ""  # its replicas' Python environment, as text; "": the box's own


@dataclass(frozen=True)
class Endpoint:
    """Where a prediction goes: a deployed model's name and version (a number, never 0), and its
    inputs as it published them. What the prediction paths look up once per request, lighter than a
    record; ``infer`` takes it back, without a second lookup."""

    name: str
    version: int
    inputs: list[dict[str, Any]]
    public: bool = False  # its predictions need no credentials
    deployment: Any = field(repr=False, compare=False, default=None)  # the live _Deployment


_NOT_SERVING = BatcherStats(batches=0, requests=0, rows=0, failed_batches=0, mean_batch_size=0.0, queue_length=0)


@dataclass
class _Replica:
    index: int
    job_id: str
    link: wire.Link | None = None
    node: str = ""  # where its worker runs, once connected to ("": not yet, or restarting)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    crashes: list[float] = field(default_factory=list)


@dataclass
class _Deployment:
    id: str
    name: str
    version: int
    owner: str
    source: str
    format: str
    spec: dict[str, Any]
    folder: Path
    created_at: float
    replicas: list[_Replica]
    state: str = "loading"
    message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    batcher: Batcher | None = None
    watcher: asyncio.Task[None] | None = None
    snapshot_id: str = ""  # the model's files, and its path in them
    path: str = ""
    workspace: str = ""  # the snapshot replicas on other machines get as their workdir (``_workspace``)

    @functools.cached_property
    def signature(self) -> Any:
        """The model's published inputs, as ``formats.check_inputs`` takes them (once it is ready)."""
        inputs = [formats.TensorSpec(s["name"], s["datatype"], tuple(s["shape"])) for s in self.metadata["inputs"]]
        return SimpleNamespace(inputs=inputs)


def message_for(d: DeploymentRecord, caller: Identity | None) -> str:
    """Why ``d`` failed as ``caller`` may read it: the loader's words for its owner and admins (they
    may show the model's code and files), only that it failed for anyone else."""
    if d.state != "failed" or (caller is not None and (caller.admin or caller.name == d.owner)):
        return d.message
    return "the model failed to load or crashed; its owner or an admin sees why with `gpuport models`"


_LABEL = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def _check_label(label: str) -> None:
    if not _LABEL.fullmatch(label):
        raise InvalidRequest(
            f"version label {label[:80]!r}: use letters, digits, '_', '.' and '-' (up to 64), starting with a letter"
        )


def version_number(text: str) -> int:
    """A model version as a URL or request writes it: 0 (the newest ready one) when it names none."""
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise NotFound(f"model version {text[:40]!r}: versions are numbers from 1")
    return int(text)


class ServingService:
    def __init__(self, store: Store, jobs: JobService, snapshots: SnapshotService, root: Path) -> None:
        self.store = store
        self.jobs = jobs
        self.snapshots = snapshots
        self.root = root
        self.root.mkdir(exist_ok=True)
        self._live: dict[str, _Deployment] = {}  # by id

    async def start(self) -> None:
        """Pick up the deployments a previous server left: their replicas (jobs) may still run."""
        for row in self.store.query("SELECT * FROM deployments WHERE ended_at IS NULL ORDER BY seq"):
            spec = json.loads(row["spec"])
            jobs = json.loads(row["jobs"])
            d = _Deployment(
                id=row["id"],
                name=row["name"],
                version=row["version"],
                owner=row["owner"],
                source=row["source"],
                format=row["format"],
                spec=spec,
                folder=self.root / row["id"],
                created_at=row["created_at"],
                replicas=[_Replica(i, job_id) for i, job_id in enumerate(jobs)],
                state="loading" if row["state"] != "failed" else "failed",
                message=row["message"],
                metadata=json.loads(row["metadata"] or "{}"),
                snapshot_id=row["snapshot_id"],
                path=row["path"] or "",
            )
            self._live[d.id] = d
            if d.state != "failed":
                d.watcher = asyncio.create_task(self._watch(d))

    def stop(self) -> None:
        """Let go of the replicas (they run on, as jobs do, and the next server picks them up)."""
        for d in self._live.values():
            if d.watcher is not None:
                d.watcher.cancel()
            for r in d.replicas:
                if r.link is not None:
                    r.link.close()

    # ---- deploying --------------------------------------------------------------------------------

    def deploy(self, caller: Identity, spec: DeploySpec) -> DeploymentRecord:
        executor = self.jobs.executor
        problem = executor.workers_problem()
        if problem:
            raise InvalidRequest(
                f"models are served by replicas this server reaches, and {problem} — deploy on a server "
                "that runs its workers itself (one machine, --ray or --slurm)"
            )
        self._check(spec)
        snapshot, path = self._source(caller, spec.source)
        owners = {
            row["owner"]
            for row in self.store.query(
                "SELECT owner FROM deployments WHERE name = ? AND ended_at IS NULL", (spec.name,)
            )
        }
        if owners and caller.name not in owners and not caller.admin:
            raise PermissionDenied(f"model name {spec.name!r} is another user's: pick another name")
        row = self.store.query_one("SELECT MAX(version) AS v FROM deployments WHERE name = ?", (spec.name,))
        version = spec.version or ((row["v"] or 0) + 1 if row is not None else 1)
        if self._find(spec.name, version, live_only=False) is not None:
            raise Conflict(
                f"model {spec.name} version {version} is deployed already: `gpuport undeploy {spec.name} "
                f"--version {version}` first, or deploy another version"
            )
        deployment_id = "d-" + secrets.token_hex(4)
        folder = self.root / deployment_id
        stored = {
            "gpus": spec.gpus,
            "gpu_memory": spec.gpu_memory,
            "cpus": spec.cpus,
            "memory": spec.memory,
            "max_batch_size": spec.max_batch_size,
            "max_queue_delay": spec.max_queue_delay,
            "replicas": spec.replicas,
            "public": spec.public,
            "requirements": spec.requirements,
        }
        try:
            if executor.runs_here:  # one folder of this machine's, which every replica reads
                self.snapshots.materialize(snapshot, folder / "files", read_only=True)
                model_path = Path("files") / path if path else Path("files")
                if not (folder / model_path).exists():
                    raise NotFound(f"{spec.source}: no {path!r} in it")
                (folder / "deployment.json").write_bytes(_deployment_json(str(model_path), spec.format))
                let_read(folder)  # now, before any replica runs: the folder is then theirs to write
            d = _Deployment(
                id=deployment_id,
                name=spec.name,
                version=version,
                owner=caller.name,
                source=spec.source,
                format=spec.format,
                spec=stored,
                folder=folder,
                created_at=time.time(),
                replicas=[],
                snapshot_id=snapshot.id,
                path=path,
            )
            d.replicas = [_Replica(i, self._start_replica(d, i).id) for i in range(spec.replicas)]
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO deployments (id, name, version, owner, source, snapshot_id, path, format, spec, state, "
                "jobs, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'loading', ?, ?)",
                (
                    d.id,
                    d.name,
                    d.version,
                    d.owner,
                    d.source,
                    snapshot.id,
                    path,
                    d.format,
                    json.dumps(stored),
                    json.dumps([r.job_id for r in d.replicas]),
                    d.created_at,
                ),
            )
        self._live[d.id] = d
        d.watcher = asyncio.create_task(self._watch(d))
        log.info("model %s v%d (%s) deploying from %s for %s", d.name, d.version, d.id, d.source, d.owner)
        if spec.label:
            self._set_label(d.name, spec.label, d.version)
        return self._record(d)

    def _check(self, spec: DeploySpec) -> None:
        if not _NAME.fullmatch(spec.name):  # not match(): its $ also matches before a final newline
            raise InvalidRequest(
                f"model name {spec.name[:80]!r}: use letters, digits, '_', '.' and '-' (up to 128), starting with a "
                "letter or digit"
            )
        if spec.version < 0:
            raise InvalidRequest(f"version must be 1 or more, not {spec.version}")
        if not 1 <= spec.replicas <= _MAX_REPLICAS:
            raise InvalidRequest(f"replicas must be 1 to {_MAX_REPLICAS}, not {spec.replicas}")
        if not 0 <= spec.max_batch_size <= _MAX_BATCH:
            raise InvalidRequest(f"max batch size must be 0 (no batching) to {_MAX_BATCH}, not {spec.max_batch_size}")
        if not 0 <= spec.max_queue_delay <= 10:
            raise InvalidRequest(f"max queue delay must be 0 to 10 s, not {spec.max_queue_delay:g} s")
        if spec.label:
            _check_label(spec.label)

    # ---- version labels (TensorFlow Serving's) -----------------------------------------------------

    def label(self, caller: Identity, name: str, label: str, version: int) -> DeploymentRecord:
        """Point ``label`` of model ``name`` at its live ``version`` (its owner or an admin); returns
        that version. A label moves: requests that name it go to the new version at once."""
        _check_label(label)
        d = self._find(name, version) if version else None
        if d is None:
            raise NotFound(self._unknown(name, version) if version else "give the version the label names (from 1)")
        if d.owner != caller.name and not caller.admin:
            raise PermissionDenied(f"model {name} is {d.owner}'s: only they or an admin can label its versions")
        self._set_label(name, label, d.version)
        return self._record(d)

    def _set_label(self, name: str, label: str, version: int) -> None:
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO model_labels (name, label, version, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name, label) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at",
                (name, label, version, time.time()),
            )

    def labelled(self, name: str, label: str) -> int:
        """The version ``label`` of model ``name`` names; NotFound for a label it does not have (never
        the latest instead)."""
        row = self.store.query_one("SELECT version FROM model_labels WHERE name = ? AND label = ?", (name, label))
        if row is None or self._find(name, row["version"]) is None:
            if not any(d.name == name for d in self._live.values()):
                raise NotFound(self._unknown(name, 0))
            have = ", ".join(sorted(self._labels(name))) or "none"
            raise NotFound(f"model '{name}' has no version labelled {label!r} (its labels: {have})")
        return int(row["version"])

    def _labels(self, name: str, version: int = 0) -> dict[str, int]:
        rows = self.store.query("SELECT label, version FROM model_labels WHERE name = ?", (name,))
        return {r["label"]: r["version"] for r in rows if not version or r["version"] == version}

    def _source(self, caller: Identity, source: str) -> tuple[Any, str]:
        """The snapshot holding the model, and the model's path inside it."""
        if source.startswith("job:"):
            parts = source.split(":", 2)
            if len(parts) != 3 or not parts[1]:
                raise InvalidRequest(
                    f"source {source!r}: write a job's output as job:<job id>:<path>, e.g. job:j-1a2b:model/"
                )
            job = self.jobs.get(caller, parts[1])
            if not job.state.is_terminal():
                raise Conflict(f"job {job.id} is {job.state.value}: deploy its output once it has ended")
            if not job.output_snapshot_id:
                raise NotFound(f"job {job.id} left no outputs (declare them: outputs=['model/'])")
            snapshot = self.snapshots.resolve(caller, snapshot_id=job.output_snapshot_id, owner=job.owner)
            path = check_path(parts[2].rstrip("/"), what="model path") if parts[2].strip("/") else ""
            return snapshot, path
        if source.startswith("snapshot:"):
            _, _, rest = source.partition(":")
            snapshot_id, _, path = rest.partition(":")
            snapshot = self.snapshots.resolve(caller, snapshot_id=snapshot_id)
            return snapshot, check_path(path.rstrip("/"), what="model path") if path.strip("/") else ""
        name, _, path = source.partition(":")
        snapshot = self.snapshots.resolve(caller, name=name)
        return snapshot, check_path(path.rstrip("/"), what="model path") if path.strip("/") else ""

    def _start_replica(self, d: _Deployment, index: int) -> JobRecord:
        spec = d.spec
        if self.jobs.executor.runs_here:  # the deployment's folder here, shared by the replicas
            where: dict[str, Any] = {"folders": [str(d.folder)]}
            model_dir = str(d.folder)
        else:  # the model as the replica's workdir, on whichever node it is placed
            where = {"snapshot_id": self._workspace(d)}
            model_dir = "."  # its workdir: the job's working folder on its node
        return self.jobs.submit(
            Identity(d.owner, admin=False),
            JobRequest(
                command=list(_WORKER),
                gpus=spec["gpus"],
                gpu_memory=spec["gpu_memory"],
                cpus=spec["cpus"],
                memory=spec["memory"],
                name=f"model {d.name} v{d.version} replica {index}",
                kind="model",
                internal_env={ENV_MODEL_DIR: model_dir, ENV_MODEL_REPLICA: str(index)},
                environment=EnvRequest(spec["requirements"]) if spec.get("requirements") else None,
                **where,
            ),
        )

    def _workspace(self, d: _Deployment) -> str:
        """The snapshot a replica on another machine gets as its workdir, laid out as the deployment's
        folder is here: the model's files under ``files/`` (only those at its path) and
        ``deployment.json``. Its owner's, made at the first replica's start; its id is its content's, so
        a restarted server makes the same one again. Raises ``NotFound`` when the path has no files."""
        if d.workspace:
            return d.workspace
        source = self.snapshots.resolve(Identity(d.owner, admin=True), snapshot_id=d.snapshot_id)
        below = d.path + "/"
        entries = [
            Entry(posixpath.join("files", e.path), e.blob, e.size, e.mode, e.link)
            for e in self.snapshots.manifest(source)
            if not d.path or e.path == d.path or e.path.startswith(below)
        ]
        if not entries:
            raise NotFound(f"{d.source}: no {d.path!r} in it")
        model_path = posixpath.join("files", d.path) if d.path else "files"
        blob, size = self.snapshots.blobs.ingest(io.BytesIO(_deployment_json(model_path, d.format)))
        entries.append(Entry("deployment.json", blob, size, 0o644))
        d.workspace = self.snapshots.record_archive(Identity(d.owner, admin=False), entries).id
        return d.workspace

    def undeploy(self, caller: Identity, name: str, version: int = 0) -> list[DeploymentRecord]:
        """End the live versions of ``name`` (or just ``version``); returns them as they were."""
        found = [d for d in self._live.values() if d.name == name and (not version or d.version == version)]
        if not found:
            raise NotFound(self._unknown(name, version))
        for d in found:
            if d.owner != caller.name and not caller.admin:
                raise PermissionDenied(f"model {name} is {d.owner}'s: only they or an admin can undeploy it")
        records = [self._record(d) for d in found]
        for d in found:
            self._end(d)
        with self.store.transaction() as db:  # a label of an ended version names nothing: it goes too
            for d in found:
                db.execute("DELETE FROM model_labels WHERE name = ? AND version = ?", (d.name, d.version))
        return records

    def _end(self, d: _Deployment) -> None:
        self._live.pop(d.id, None)
        with self.store.transaction() as db:
            db.execute("UPDATE deployments SET ended_at = ? WHERE id = ?", (time.time(), d.id))
        if d.watcher is not None:
            d.watcher.cancel()
        if d.batcher is not None:
            asyncio.get_running_loop().create_task(d.batcher.close())
        for r in d.replicas:
            if r.link is not None:
                r.link.close()
            with contextlib.suppress(Conflict, NotFound):
                self.jobs.cancel(Identity(d.owner, admin=True), r.job_id)
        shutil.rmtree(d.folder, ignore_errors=True)
        log.info("model %s v%d undeployed", d.name, d.version)

    # ---- looking up -------------------------------------------------------------------------------

    def _find(self, name: str, version: int = 0, live_only: bool = True) -> _Deployment | None:
        versions = [d for d in self._live.values() if d.name == name]
        if version:
            return next((d for d in versions if d.version == version), None)
        ready = [d for d in versions if d.state == "ready"] if live_only else versions
        return max(ready or versions, key=lambda d: d.version, default=None)

    def _unknown(self, name: str, version: int) -> str:
        # The words Triton says, which its clients and their users look for.
        what = f"'{name}'" + (f" version {version}" if version else "")
        return f"Request for unknown model: {what} is not found — `gpuport models` lists the deployed ones"

    def unknown_to_anonymous(self, name: str) -> NotFound:
        """What a caller without credentials is told of model ``name`` when it is not public: the same
        whether it is private or missing (its name stays private), in the words Triton says of a
        missing model, which Triton's clients check for."""
        return NotFound(
            f"Request for unknown model: '{name}' is not found — or it is not public: the other models "
            "answer callers with credentials only (a token, or a client certificate)"
        )

    def find(self, name: str, version: int = 0) -> DeploymentRecord:
        d = self._find(name, version)
        if d is None:
            raise NotFound(self._unknown(name, version))
        return self._record(d)

    def endpoint(self, name: str, version: int = 0) -> Endpoint:
        """The deployment a prediction for ``name`` goes to (``version`` 0: the newest ready one), as
        ``find`` finds it; raises the same NotFound."""
        d = self._find(name, version)
        if d is None:
            raise NotFound(self._unknown(name, version))
        return Endpoint(d.name, d.version, d.metadata.get("inputs", []), bool(d.spec.get("public")), d)

    def statistics(self, name: str = "", version: int = 0) -> list[tuple[DeploymentRecord, Timings]]:
        """Each live deployment's record and its batcher's timings: every version of ``name`` (or
        only ``version``), or every model without a name. Raises NotFound for an unknown name."""
        found = [d for d in self._live.values() if not name or (d.name == name and version in (0, d.version))]
        if name and not found:
            raise NotFound(self._unknown(name, version))
        found.sort(key=lambda d: (d.name, d.version))
        return [(self._record(d), d.batcher.timings if d.batcher is not None else Timings()) for d in found]

    def is_public(self, name: str, version: int = 0) -> bool:
        """Whether the deployment that ``name`` (and ``version``) reaches was deployed ``public``:
        its predictions and metadata then need no credentials."""
        d = self._find(name, version)
        return d is not None and bool(d.spec.get("public"))

    def all_ready(self) -> bool:
        """Whether every deployment is ready (none loading or failed): a server's readiness."""
        return all(d.state == "ready" for d in self._live.values())

    def versions(self, name: str) -> list[int]:
        return sorted(d.version for d in self._live.values() if d.name == name)

    def list(self) -> list[DeploymentRecord]:
        return [self._record(d) for d in sorted(self._live.values(), key=lambda d: (d.name, d.version))]

    def _record(self, d: _Deployment) -> DeploymentRecord:
        return DeploymentRecord(
            id=d.id,
            name=d.name,
            version=d.version,
            owner=d.owner,
            source=d.source,
            format=d.metadata.get("format", d.format),
            state=d.state,
            message=d.message,
            inputs=d.metadata.get("inputs", []),
            outputs=d.metadata.get("outputs", []),
            spec=d.spec,
            jobs=[r.job_id for r in d.replicas],
            nodes=[r.node for r in d.replicas],
            created_at=d.created_at,
            stats=d.batcher.stats if d.batcher is not None else _NOT_SERVING,
            labels=sorted(self._labels(d.name, d.version)),
        )

    # ---- predicting -------------------------------------------------------------------------------

    async def infer(self, endpoint: Endpoint, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a prediction on the deployment ``endpoint`` (from ``endpoint()``) found."""
        d: _Deployment = endpoint.deployment
        name = d.name
        if d.state != "ready" or d.batcher is None:
            if d.state == "failed":
                raise NotReady(
                    f"model {name} version {d.version} failed, and serves nothing until it is deployed again "
                    "(its owner sees why with `gpuport models`)"
                )
            raise NotReady(f"model {name} version {d.version} is still loading; try again shortly")
        # Checked here against what the model published, so that a bad request fails alone, at once,
        # and only here: the batcher then takes the rows as checked.
        checked = formats.check_inputs(d.signature, inputs)
        ranks = {array.ndim for array in checked.values()}
        rows = next(iter(checked.values())).shape[0] if checked and 0 not in ranks else None
        return await d.batcher.infer(checked, rows_checked=rows)

    # ---- replicas ---------------------------------------------------------------------------------

    async def _watch(self, d: _Deployment) -> None:
        """Bring the replicas up, publish the model's metadata, then restart any replica that dies."""
        try:
            await asyncio.gather(*(self._connect(d, r) for r in d.replicas))
            first = d.replicas[0]
            assert first.link is not None
            await first.link.send({"op": "metadata"})
            frame = await first.link.recv()
            d.metadata = frame.header
            d.batcher = Batcher(
                [self._runner(d, r) for r in d.replicas],
                max_batch_size=d.spec["max_batch_size"],
                max_queue_delay=d.spec["max_queue_delay"],
                max_queue=MAX_SERVING_QUEUE,
                name=d.name,
            )
            d.batcher.start()
            self._set_state(d, "ready", "")
            log.info(
                "model %s v%d ready (%s, %d replicas)", d.name, d.version, d.metadata.get("format"), len(d.replicas)
            )
            # Each replica that ends is restarted by a task of its own: one waiting in the queue for
            # room (its node lost, the cluster full) holds no other's restart.
            restarts: dict[int, asyncio.Task[None]] = {}
            try:
                while True:
                    await asyncio.sleep(_WATCH_EVERY)
                    for index, task in list(restarts.items()):
                        if task.done():
                            del restarts[index]
                            task.result()  # raises _Failed: the deployment fails
                    for r in d.replicas:
                        if r.index in restarts:
                            continue
                        job = self.jobs.get(Identity(d.owner, admin=True), r.job_id)
                        if job.state.is_terminal():
                            restarts[r.index] = asyncio.create_task(self._restart(d, r, job))
            finally:
                for task in restarts.values():
                    task.cancel()
        except _Failed as failed:
            self._set_state(d, "failed", str(failed))
            log.warning("model %s v%d failed: %s", d.name, d.version, failed)
            for r in d.replicas:
                with contextlib.suppress(Conflict, NotFound):
                    self.jobs.cancel(Identity(d.owner, admin=True), r.job_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("watching model %s v%d failed", d.name, d.version)
            self._set_state(d, "failed", f"internal error: {e}")

    async def _connect(self, d: _Deployment, r: _Replica) -> None:
        """Wait for the replica's worker to load the model and listen, then connect to it."""
        owner = Identity(d.owner, admin=True)
        started: float | None = None
        while True:
            job = self.jobs.get(owner, r.job_id)
            if job.state.is_terminal():
                raise _Failed(await asyncio.to_thread(self._why_ended, d, r, job))
            if job.state is JobState.RUNNING:
                started = started or time.monotonic()
                with contextlib.suppress(FileNotFoundError, ConnectionError):
                    stream = await asyncio.to_thread(self.jobs.executor.connect, r.job_id, "replica")
                    # Its node as the job's record has it, else as its connection says: a Slurm
                    # job's record learns it from squeue, seconds after its worker listens.
                    r.link, r.node = wire.Link(stream.sock), job.node or stream.node
                    if d.batcher is not None:  # a restarted replica: it takes batches again
                        d.batcher.resume(r.index)
                    return
                if time.monotonic() - started > _CONNECT_TIMEOUT:
                    raise _Failed(
                        f"replica {r.index} did not load the model within {format_duration(_CONNECT_TIMEOUT)}"
                    )
            await asyncio.sleep(0.05 if job.state is JobState.RUNNING else 0.2)

    def _why_ended(self, d: _Deployment, r: _Replica, job: JobRecord) -> str:
        if job.exit_code == LOAD_FAILED:
            error = self.jobs.executor.read_file(job.id, "error", 0, 65536)
            if error:
                return f"the model did not load: {error.decode(errors='replace').strip()}"
        return f"its worker (replica {r.index}) {job.message or 'ended'}"

    async def _restart(self, d: _Deployment, r: _Replica, job: JobRecord) -> None:
        now = time.monotonic()
        r.crashes = [t for t in r.crashes if now - t < _RESTART_WINDOW] + [now]
        self._lose_link(d, r)
        r.node = ""
        if len(r.crashes) >= _RESTARTS:
            last = await asyncio.to_thread(self._why_ended, d, r, job)
            raise _Failed(f"replica {r.index} crashed {len(r.crashes)} times in a minute; last: {last}")
        log.warning("model %s v%d: replica %d ended (%s); restarting it", d.name, d.version, r.index, job.message)
        r.job_id = self._start_replica(d, r.index).id
        with self.store.transaction() as db:
            db.execute(
                "UPDATE deployments SET jobs = ? WHERE id = ?", (json.dumps([x.job_id for x in d.replicas]), d.id)
            )
        await self._connect(d, r)

    def _runner(self, d: _Deployment, r: _Replica) -> Any:
        async def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            async with r.lock:
                link = r.link
                if link is None:
                    raise NotReady(f"model {d.name}: replica {r.index} is restarting; try again shortly")
                what = "crashed"
                if r.node and self.jobs.executor.spans_nodes:
                    what = f"on node {r.node} crashed, or its node was lost,"
                heads, buffers = encode_tensors(inputs)
                try:
                    await link.send({"op": "predict", "tensors": heads}, buffers)
                    frame = await link.recv()  # no quick-reply wait: the loop takes requests meanwhile
                except (EOFError, OSError):
                    # Its worker ended, or its node was lost (the watcher closed the link on seeing the
                    # job end): this batch fails now, and the next go to the other replicas.
                    if r.link is link:
                        self._lose_link(d, r)
                    raise ServerError(
                        f"model {d.name}: replica {r.index} {what} during this batch; it is being restarted — "
                        "retry the request"
                    ) from None
            if "error" in frame.header:
                kind, message = frame.header["error"]
                raise error_from_name(kind, message)
            return decode_tensors(frame.header["tensors"], frame.buffers)

        return run

    def _lose_link(self, d: _Deployment, r: _Replica) -> None:
        """Close the replica's connection (a batch waiting on it fails at once) and give it no more
        batches while another replica takes them, until it is connected to again."""
        if r.link is not None:
            r.link.close()
            r.link = None
        if d.batcher is not None:
            d.batcher.pause(r.index)

    def _set_state(self, d: _Deployment, state: str, message: str) -> None:
        # Server paths stay out of what users read: the model's folder is the model, the state dir
        # is the server's.
        message = message.replace(str(d.folder), "<model>").replace(str(self.root.parent), "<server>")
        d.state, d.message = state, message
        with self.store.transaction() as db:
            db.execute(
                "UPDATE deployments SET state = ?, message = ?, metadata = ? WHERE id = ?",
                (state, message, json.dumps(d.metadata), d.id),
            )


class _Failed(GpuportError):
    pass


def _deployment_json(model_path: str, format: str) -> bytes:
    """What a replica reads first (``worker/model.py``): the model's path in its folder, and its format."""
    return json.dumps({"path": model_path, "format": format}).encode()
