"""What a job may ask for: a request as submitted (``JobRequest``), checked before anything is
stored (``RequestChecks``): its command, environment, outputs, resources against the largest node and
the owner's quota, processes and nodes, snapshots and datasets, its Python environment, and, for a
cluster with a queue of its own, that cluster's word (``Executor.admit``). Nothing here changes state;
``JobService`` stores what passed (services/jobs.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpuport.defaults import MAX_NAME_LENGTH, MAX_SPEC_BYTES, MAX_TIME_LIMIT
from gpuport.protocol.errors import InvalidRequest, NotFound, PermissionDenied, ResourceUnavailable, Unsatisfiable
from gpuport.protocol.paths import check_path
from gpuport.protocol.units import format_duration, format_size
from gpuport.server.environments import Environments, EnvRequest, check_request
from gpuport.server.executors.base import Ask, Executor
from gpuport.server.inventory import Inventory
from gpuport.server.scheduler import Cluster, Request
from gpuport.server.services.auth import Identity
from gpuport.server.services.quotas import QuotaService
from gpuport.server.services.snapshots import SnapshotService, check_snapshot_name

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED_ENV = ("GPUPORT_", "CUDA_VISIBLE_DEVICES")
_MAX_OUTPUTS = 100
_MAX_DATASETS = 16
_MAX_NPROCS = 64
_MAX_RETRIES = 100
_MAX_NODES = 64
_TF_ROLES = ("chief", "worker", "ps")  # in rank order
_PRIORITIES = range(-100, 101)
JOB_ID = re.compile(r"j-[0-9a-f]{8}(?:_[0-9]+)?")  # as submit makes them (an array's task: _index); else a name
_SCRIPT_HEADER_BYTES = 1 << 20  # bytes of a batch script read for its own options


@dataclass(frozen=True)
class JobRequest:
    """A job as submitted, before it is checked. ``command`` is argv; ``shell`` a /bin/sh command line."""

    command: list[str] = field(default_factory=list)
    shell: str = ""
    snapshot_id: str = ""
    project: str = ""
    datasets: list[str] = field(default_factory=list)
    gpus: int = 0
    env: dict[str, str] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    name: str = ""
    hyperparameters: dict[str, Any] | None = None
    time_limit: float = 0.0  # seconds; 0: none
    gpu_memory: int = 0  # bytes: a slice of one GPU
    cpus: float = 0.0
    memory: int = 0  # bytes of RAM
    priority: int = 0
    nprocs: int = 1
    tf_roles: list[tuple[str, int]] | None = None  # TF_CONFIG roles of the processes, in rank order
    retries: int = 0  # times it is queued again after a failure not of its code's making (see _finish)
    retry_on_exit: list[int] = field(default_factory=list)  # exit codes that count as such a failure too
    preemptible: bool | None = None  # None: when its priority is below 0
    checkpoint: str = ""  # a folder of its workdir, kept when it is preempted and put back when it runs again
    nodes: int = 1  # a gang over this many nodes of a cluster: nprocs spread evenly, gpus etc. per node
    after: list[str] = field(default_factory=list)  # JOB[:ok|:any] each (or comma lists): what it waits for
    # Set by the server only (never from a request): a session's worker is a job of kind "session",
    # with settings of gpuport's own (GPUPORT_SESSION_DIR) in its environment.
    kind: str = "job"
    internal_env: dict[str, str] = field(default_factory=dict)
    folders: list[str] = field(default_factory=list)  # of the server's, which the job's processes may write
    environment: EnvRequest | None = None  # its Python environment's requirements; None: the box's own
    # For a cluster with a queue of its own (Slurm): a partition ("": the server's default), and a
    # batch script of the workdir (``command``: it and its arguments) run with its own options.
    partition: str = ""
    batch_script: str = ""


class Checked(NamedTuple):
    """A request as ``RequestChecks.check`` found it: the command, workdir snapshot, outputs and spec to store."""

    argv: list[str]
    snapshot: str
    outputs: list[str]
    spec: dict[str, Any]


def spec_size(value: Any) -> int:
    return len(json.dumps(value))


def tf_roles(counts: dict[str, int]) -> list[tuple[str, int]] | None:
    """Role → count (from the wire or a request body) as the ordered list a ``JobRequest`` holds;
    None for none. Raises ``InvalidRequest`` for an unknown role."""
    if not counts:
        return None
    unknown = sorted(set(counts) - set(_TF_ROLES))
    if unknown:
        raise InvalidRequest(f"unknown TensorFlow role {unknown[0]!r}: the roles are {', '.join(_TF_ROLES)}")
    return [(role, counts[role]) for role in _TF_ROLES if counts.get(role)]


class RequestChecks:
    """Checks a job request against the server: its nodes as the executor sees them now (``cluster``),
    quotas, snapshots and environments. Raises; never changes anything."""

    def __init__(
        self,
        snapshots: SnapshotService,
        inventory: Inventory,
        executor: Executor,
        quotas: QuotaService,
        cluster: Callable[[], Cluster],
    ) -> None:
        self.snapshots = snapshots
        self.inventory = inventory
        self.executor = executor
        self.quotas = quotas
        self.cluster = cluster
        self.environments: Environments | None = None  # set by the app: where jobs' environments are built

    def check(self, caller: Identity, request: JobRequest) -> Checked:
        """Validate ``request``; the command, workdir snapshot, outputs and spec to store. Raises
        ``InvalidRequest``, ``NotFound`` (a snapshot, dataset or environment), ``PermissionDenied``,
        ``ResourceUnavailable``, ``Unsatisfiable``, or the cluster's refusal (``admit``)."""
        if bool(request.command) == bool(request.shell):
            raise InvalidRequest("give a command (argv) or a shell command line, and not both")
        argv = ["/bin/sh", "-c", request.shell] if request.shell else list(request.command)
        if any(not isinstance(a, str) or "\0" in a for a in argv):
            raise InvalidRequest("every command argument must be a string without NUL bytes")
        if spec_size(argv) > MAX_SPEC_BYTES:
            raise InvalidRequest(f"the command is larger than the limit of {format_size(MAX_SPEC_BYTES)}")
        if request.name and (len(request.name) > MAX_NAME_LENGTH or not request.name.isprintable()):
            raise InvalidRequest(f"job name {request.name[:80]!r}: use up to {MAX_NAME_LENGTH} printable characters")
        if JOB_ID.fullmatch(request.name):
            raise InvalidRequest(f"job name {request.name!r} looks like a job id; pick a name that does not")
        for key, value in request.env.items():
            if not _ENV_NAME.fullmatch(key):
                raise InvalidRequest(f"environment variable name {key[:80]!r} is not valid (letters, digits, '_')")
            if key.startswith(_RESERVED_ENV):
                raise InvalidRequest(f"environment variable {key} is set by gpuport for each job; pick another name")
            if "\0" in value:
                raise InvalidRequest(f"environment variable {key} contains a NUL byte")
        if spec_size(request.env) > MAX_SPEC_BYTES:
            raise InvalidRequest(f"the environment is larger than the limit of {format_size(MAX_SPEC_BYTES)}")
        if request.hyperparameters is not None and spec_size(request.hyperparameters) > MAX_SPEC_BYTES:
            raise InvalidRequest(f"the hyperparameters are larger than the limit of {format_size(MAX_SPEC_BYTES)}")
        if len(request.outputs) > _MAX_OUTPUTS:
            raise InvalidRequest(f"{len(request.outputs)} outputs declared; the limit is {_MAX_OUTPUTS}")
        outputs = [check_path(p, what="output path") for p in request.outputs]
        if not 0 <= request.time_limit <= MAX_TIME_LIMIT:
            raise InvalidRequest(
                f"time limit {request.time_limit:g}s is outside 0 (none) .. {format_duration(MAX_TIME_LIMIT)}"
            )
        self._check_resources(caller, request)
        if request.snapshot_id and request.project:
            raise InvalidRequest("give a snapshot id or a project name, not both")
        snapshot = ""
        if request.snapshot_id or request.project:
            snapshot = self.snapshots.resolve(caller, request.snapshot_id, request.project).id
        if not 0 <= request.retries <= _MAX_RETRIES:
            raise InvalidRequest(f"retries must be 0 .. {_MAX_RETRIES}, not {request.retries}")
        if len(request.retry_on_exit) > 255 or any(not 1 <= c <= 255 for c in request.retry_on_exit):
            raise InvalidRequest(
                f"retry-on-exit codes must be 1 .. 255, not {','.join(map(str, request.retry_on_exit))[:200]}"
            )
        if request.retry_on_exit and not request.retries:
            raise InvalidRequest("--retry-on-exit needs --retries N: how many times the job is queued again")
        checkpoint = check_path(request.checkpoint, what="checkpoint folder") if request.checkpoint else ""
        preemptible = request.priority < 0 if request.preemptible is None else request.preemptible
        if checkpoint and not preemptible and not request.retries:
            raise InvalidRequest(
                "--checkpoint is kept when the job is preempted or retried: give --preemptible or --retries N too"
            )
        if len(request.datasets) > _MAX_DATASETS:
            raise InvalidRequest(f"{len(request.datasets)} datasets; the limit is {_MAX_DATASETS}")
        datasets = {}
        for name in request.datasets:
            datasets[check_snapshot_name(name)] = self.snapshots.resolve(caller, name=name).id
        spec = {
            "env": request.env,
            "datasets": datasets,
            "hyperparameters": request.hyperparameters,
            "tf_roles": request.tf_roles,
            "internal_env": request.internal_env,
            "folders": request.folders,
            "retries": request.retries,
            "retry_on_exit": sorted(set(request.retry_on_exit)),
            "preemptible": preemptible,
            "checkpoint": checkpoint,
        }
        if request.environment is not None:
            check_request(request.environment)
            if request.environment.python and self.environments is not None:
                self.environments.python_for(request.environment.python)  # the box has it, or a clear error
            if request.environment.hash and self.environments is not None:
                if self.environments.meta(request.environment.hash) is None:
                    raise NotFound(
                        f"environment {request.environment.hash} is not on this server (`gpuport envs` lists "
                        "those it has): run with the project's requirements to build it"
                    )
            spec["environment_request"] = request.environment.to_json()
        self._admit_to_cluster(caller, request, argv, snapshot)
        if request.partition or request.batch_script:
            spec.update(partition=request.partition, batch_script=request.batch_script)
        return Checked(argv, snapshot, outputs, spec)

    def _admit_to_cluster(self, caller: Identity, request: JobRequest, argv: list[str], snapshot: str) -> None:
        """Ask the executor whether its cluster takes the job (one with a queue of its own answers in its words)."""
        if not (self.executor.keeps_queue or request.partition or request.batch_script):
            return
        text = ""
        if request.batch_script:
            script = check_path(request.batch_script, what="batch script")
            if not snapshot or argv[:1] != [script]:
                raise InvalidRequest(f"batch script {script!r}: give it with the folder it is in, as the command")
            record = self.snapshots.resolve(caller, snapshot)
            entry = next((e for e in self.snapshots.manifest(record) if e.path == script and e.blob), None)
            if entry is None:
                raise InvalidRequest(f"batch script {script!r} is not a file of the job's folder")
            with self.snapshots.blobs.open(entry.blob) as f:
                text = f.read(_SCRIPT_HEADER_BYTES).decode(errors="replace")
        ask = Ask(request.gpus, request.cpus, request.memory, request.time_limit, request.name, request.partition)
        ask = dataclasses.replace(
            ask,
            batch_script=request.batch_script,
            script_text=text,
            nodes=request.nodes,
            nprocs=request.nprocs,
            gpu_memory=request.gpu_memory,
        )
        self.executor.admit(ask)  # may block: the API runs ``check`` off the event loop

    def _check_resources(self, caller: Identity, request: JobRequest) -> None:
        """Refuse what no machine state could ever grant: more than a node has, or than the quota allows."""
        cluster = self.cluster()
        machine = cluster.most()
        for name, value in (("gpus", request.gpus), ("gpu_memory", request.gpu_memory), ("cpus", request.cpus)):
            if not (value >= 0 and math.isfinite(value)):
                raise InvalidRequest(f"{name} must be 0 or more, not {value}")
        if request.memory < 0:
            raise InvalidRequest(f"memory must be 0 or more, not {request.memory}")
        if request.gpus and request.gpu_memory:
            raise InvalidRequest("ask for whole GPUs (gpus=N) or for a slice of one GPU (gpu_memory=...), not both")
        if self.executor.keeps_queue:  # its cluster's queue says what it can grant (``admit``)
            machine = dataclasses.replace(machine, gpu_memory=(0,) * max(request.gpus, 1), cpus=1e9, memory=1 << 62)
        where = "this server has" if len(cluster.nodes) <= 1 else "the largest node has"
        have = f"{where} {machine.describe_gpus()}"
        if not machine.gpu_memory and (request.gpus or request.gpu_memory):
            have += f" ({self.inventory.note})" if self.inventory.note else ""
        if request.gpus > len(machine.gpu_memory):
            raise Unsatisfiable(f"asked for {request.gpus} GPU{'s' if request.gpus > 1 else ''}; {have}")
        if request.gpu_memory > max(machine.gpu_memory, default=0) and not self.executor.keeps_queue:
            raise Unsatisfiable(f"asked for a {format_size(request.gpu_memory)} slice of a GPU; {have}")
        if request.cpus > machine.cpus:
            raise Unsatisfiable(f"asked for {request.cpus:g} CPUs; {where} {machine.cpus:g}")
        if request.memory > machine.memory:
            raise Unsatisfiable(
                f"asked for {format_size(request.memory)} of memory; {where} {format_size(machine.memory)}"
            )
        if request.priority not in _PRIORITIES:
            raise InvalidRequest(f"priority {request.priority} is outside -100 .. 100")
        if request.priority > 0 and not caller.admin:
            raise PermissionDenied(
                f"priority {request.priority}: only an admin can put a job ahead of others; "
                "a negative priority lets yours yield to them"
            )
        self._check_processes(request)
        quota = self.quotas.of(caller.name)
        wanted = cluster.gpu_share(Request(request.gpus, request.gpu_memory, nodes=request.nodes))
        if quota is not None and quota.gpus is not None and wanted > quota.gpus + 1e-9:
            raise ResourceUnavailable(
                f"asked for {wanted:g} GPUs; the quota of {caller.name} is {quota.gpus:g} at once — "
                "an admin can raise it with `gpuport quota set`"
            )
        if quota is not None and quota.jobs == 0:
            raise ResourceUnavailable(f"the quota of {caller.name} allows no jobs — ask an admin to raise it")

    def _check_nodes(self, request: JobRequest) -> None:
        if request.nodes == 1:
            return
        if not 1 <= request.nodes <= _MAX_NODES:
            raise InvalidRequest(f"nodes must be 1 .. {_MAX_NODES}, not {request.nodes}")
        if not self.executor.spans_nodes:
            raise InvalidRequest(
                f"a job over {request.nodes} nodes needs a server in front of a cluster (gpuport server --ray or --slurm); "
                "this one runs jobs on one machine — use --nprocs for several processes here"
            )
        if request.nprocs % request.nodes:
            raise InvalidRequest(f"{request.nprocs} processes do not spread evenly over {request.nodes} nodes")
        if request.gpu_memory:
            raise InvalidRequest("a job over several nodes takes whole GPUs (--gpus-per-node), not a slice")
        count = len(self.cluster().nodes)
        if request.nodes > count:
            raise ResourceUnavailable(
                f"asked for {request.nodes} nodes; the cluster has {count} that gpuport can use now"
            )

    def _check_processes(self, request: JobRequest) -> None:
        self._check_nodes(request)
        if not 1 <= request.nprocs <= _MAX_NPROCS:
            raise InvalidRequest(f"nprocs must be 1 .. {_MAX_NPROCS}, not {request.nprocs}")
        if request.tf_roles is not None:
            for role, count in request.tf_roles:
                if role not in _TF_ROLES or count < 0:
                    raise InvalidRequest(
                        f"TensorFlow role {role}={count}: roles are {', '.join(_TF_ROLES)}, each with a count >= 0"
                    )
            total = sum(count for _, count in request.tf_roles)
            if total != request.nprocs:
                raise InvalidRequest(
                    f"the TensorFlow roles add up to {total} processes, but nprocs is {request.nprocs}"
                )
        per_node = request.nprocs // max(1, request.nodes)
        if request.gpus > per_node and request.gpus % per_node:
            raise InvalidRequest(
                f"{request.gpus} GPUs do not spread evenly over {per_node} processes: give a multiple "
                f"of {per_node}, or fewer GPUs than processes (they then share)"
            )
