"""The executor seam: where a job runs, and everything about it that lives where it runs.

The job service owns the rules (states, the queue, quotas, what a job may ask for) and decides a
job's placement: a node of the executor's cluster and GPUs of that node. An executor owns the rest
of a job's life on that node: its workspace (the snapshot and datasets made into folders), its
processes (started under ``worker/supervisor.py``), its log, its exit status, its outputs, what it
uses now (for the watchdog) and its cancel. Jobs are named by their id; the job service never
touches a path or a process of a job.

Three executors: ``LocalExecutor`` (``local.py``) runs jobs on this machine, a cluster of one node;
``RayExecutor`` (``ray.py``) runs them on the nodes of a Ray cluster, each through a gpuport agent
on that node which does there what ``LocalExecutor`` does here (``workspace.py``, shared by all);
``SlurmExecutor`` (``slurm.py``) hands them to a Slurm cluster, whose own queue then decides
(``keeps_queue``: the job service places nothing, and asks it why jobs wait).

Workers the server talks to (a session's, a model replica) are jobs too. Each listens on named
endpoints and leaves named files in its run folder (``$GPUPORT_RUN_DIR``); the services reach them
only by job id and name: ``connect`` gives a byte stream to an endpoint, ``read_file`` a file's
bytes. Where the bytes travel (a Unix socket here, which also carries descriptors of shared memory;
on a Ray node, a TLS link to its agent, ``node_link.py``, which connects to the endpoint there; on a
Slurm node, the same link, started in the job's allocation, ``slurm_link.py``) and how an endpoint is
known to be the worker's own is the executor's.
"""

from __future__ import annotations

import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from gpuport.defaults import DEFAULT_PROCESSES_PER_JOB
from gpuport.protocol.errors import InvalidRequest

# A worker's endpoint or file name: what $GPUPORT_RUN_DIR/NAME(.sock) may be called.
ENDPOINT_NAME = re.compile(r"[a-z][a-z0-9-]{0,63}")
from gpuport.server.inventory import GpuInfo
from gpuport.server.scheduler import Machine

if TYPE_CHECKING:
    from gpuport.server.executors.reach import Command, Dialer
    from gpuport.server.executors.workspace import JobFolders

OnExit = Callable[[], None]
# What collecting outputs gives to the snapshot service: (path in the snapshot, open file) pairs.
Ingest = Callable[[Iterable[tuple[str, BinaryIO]]], str]


@dataclass(frozen=True)
class Node:
    """A machine of the cluster, as the scheduler plans over it."""

    name: str  # as `gpuport gpus` shows it, and as jobs find it in $GPUPORT_NODE
    machine: Machine
    address: str = ""  # its IP address, where other nodes reach its jobs


@dataclass(frozen=True)
class Placement:
    """Where a job runs: a node, and GPUs of that node (indices as its inventory numbers them)."""

    node: str
    gpu_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Files:
    """A snapshot to make into a folder: its manifest entries (path, blob, size, mode, link)."""

    entries: list[tuple[str, str, int, int, str]]


@dataclass(frozen=True)
class JobLaunch:
    """A job as the job service decided it, with nothing in it that depends on the node's disk."""

    job_id: str
    owner: str
    placement: Placement
    argv: list[str]
    env: dict[str, str]  # the job's environment, less the paths the executor adds
    user_env: frozenset[str] = frozenset()  # names the user set (HOME: the sandbox's own unless set)
    uid: int | None = None  # the uid of the job's processes (a sandbox with a uid per user)
    workdir: Files | None = None  # None: an empty workdir
    datasets: dict[str, Files] = field(default_factory=dict)  # name → read-only folder
    hyperparameters: Any = None  # written to work/hyperparameters.json when not None
    outputs: list[str] = field(default_factory=list)  # declared output paths below the workdir
    folders: list[str] = field(default_factory=list)  # of the server's (local only), writable by the job
    grace: float = 5.0  # seconds between SIGTERM and SIGKILL on cancel
    time_limit: float = 0.0  # seconds from the start; 0: none
    nprocs: int = 1
    tf_roles: list[tuple[str, int]] | None = None
    rank_gpus: list[list[int]] | None = None
    # A job over several nodes: each node rank's node and GPUs (``placement`` is node rank 0's); the
    # executor starts a part of ``nprocs // len(parts)`` processes on each.
    parts: tuple[Placement, ...] = ()
    # A part of such a job, as an executor hands it to its node: each process's environment to find
    # its peers on the other nodes, the global rank of its first process, and the node's network.
    rank_env: list[dict[str, str]] | None = None
    rank_base: int = 0
    host_network: bool = False
    memory: int = 0  # bytes of RAM it may use (its --memory); 0: the node's default (see server/cgroups.py)
    processes: int = DEFAULT_PROCESSES_PER_JOB  # processes and threads at once, where the kernel counts them
    # Its Python environment (``server/environments.py``): an ``EnvRequest`` as JSON, built on the node
    # as ``build_uid`` (None: the server's uid); None: the node's own environment.
    environment: dict[str, Any] | None = None
    build_uid: int | None = None
    # For a cluster with a queue of its own (``Executor.keeps_queue``), which places the job itself:
    # what it asks for, its partition ("": the executor's default), and a batch script of the
    # workdir whose own options the cluster honours (``argv``: the script and its arguments).
    gpus: int = 0
    gpu_memory: int = 0  # bytes of one GPU: a share of it
    cpus: float = 0.0
    partition: str = ""
    batch_script: str = ""
    nodes: int = 1  # a job over several nodes of such a cluster: ``nprocs // nodes`` processes on each
    # A worker the server talks to (a session's, a model replica): its endpoints must be reachable
    # through ``Executor.connect`` (on a Slurm node, over a link the job's supervisor starts).
    workers: bool = False


@dataclass(frozen=True)
class Ask:
    """What a job asks of a cluster with a queue of its own, as submitted (``Executor.admit``)."""

    gpus: int = 0
    cpus: float = 0.0
    memory: int = 0  # bytes
    time_limit: float = 0.0  # seconds; 0: none
    name: str = ""
    partition: str = ""
    batch_script: str = ""  # its path in the workdir
    script_text: str = ""  # its content (its own options are read from it)
    nodes: int = 1  # nodes it spans, ``nprocs // nodes`` processes on each
    nprocs: int = 1
    gpu_memory: int = 0  # bytes: a share of one GPU (``--gpu-memory``)


class NodeLost(Exception):
    """A node could not take the job it was given: it left the cluster, or its agent stopped answering
    while the job was started there. Not the job's doing: it goes back to the queue, to be placed
    again on the nodes left (``Executor.start`` raises it)."""


@dataclass
class Stream:
    """A byte stream to a worker's endpoint (``Executor.connect``): a blocking stream socket. With
    ``passes_fds``, descriptors travel along it (``SCM_RIGHTS``): the worker shares this machine's
    memory, and large values move as memfds instead of bytes."""

    sock: socket.socket
    passes_fds: bool = False
    # The node the worker runs on, where the connection says it before the cluster's queue has
    # (Slurm's job link names it: squeue is read every few seconds); "": not said.
    node: str = ""

    def close(self) -> None:
        self.sock.close()


def handed_over(worker: Stream, name: str) -> socket.socket:
    """The stream socket a worker passes on its tunnel endpoint ``name`` (``"F"`` and a descriptor,
    ``SCM_RIGHTS``): its connection to the server it runs there (TensorFlow's). Closes ``worker``.
    On a stream that passes no descriptors (a node's, through its agent), the agent took the
    handover already: the stream is the tunnel itself. Raises ``OSError`` when nothing came."""
    if not worker.passes_fds:
        return worker.sock
    with worker.sock:
        worker.sock.settimeout(30)
        said, fds, _, _ = socket.recv_fds(worker.sock, 1, 1)
    if said != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the worker's tunnel {name!r} passed no connection")
    try:
        stream = socket.socket(fileno=fds[0])
    except OSError:
        os.close(fds[0])
        raise  # not a socket
    if stream.type != socket.SOCK_STREAM:
        stream.close()
        raise OSError(f"the worker's tunnel {name!r} passed a socket that is not a stream")
    stream.settimeout(None)
    return stream


@dataclass(frozen=True)
class Usage:
    """What a running job's processes use now."""

    rss: int = 0  # bytes of resident memory, all its processes
    gpu_memory: int = 0  # bytes of GPU memory, all its processes on all GPUs
    memory_enforced: bool = False  # the kernel holds it to its memory limit (a cgroup): nothing to poll


@dataclass(frozen=True)
class Run:
    """One run of a job as its cluster's own accounting times it (``Executor.on_run``): the cluster's
    id for the run (a Slurm job id), when it started and ended (epoch seconds; None: it still runs),
    and the GPUs and CPUs it was allocated, all its nodes together (None: what the job asked for)."""

    run: str
    started_at: float
    ended_at: float | None
    gpus: float | None
    cpus: float | None
    node: str = ""  # where it runs, as the cluster names it (its node list, over several): "" when not said


class Executor(ABC):
    """Runs jobs on the nodes of a cluster. Methods may block (the job service calls them off its loop)."""

    kind: str = ""  # "local" or "ray", for the banner and `gpuport status`
    # Its nodes run jobs as a uid per user whatever this machine's sandbox does (a cluster's nodes).
    uid_per_user: bool = False
    # Several nodes: a job may span them (``JobLaunch.parts``).
    spans_nodes: bool = False
    # Its jobs run on this machine: starting one waits until the last is set up (their set-ups would
    # fight over this machine's CPUs).
    runs_here: bool = True
    # Called (from any thread) when the cluster's nodes change: the job service plans again.
    on_change: Callable[[], None] | None = None
    # The cluster has a queue of its own, which decides when and where jobs run: the job service
    # hands each job over as soon as nothing of gpuport's holds it (dependencies), plans nothing,
    # and asks ``waiting`` why the cluster holds them.
    keeps_queue: bool = False
    # The cluster times each run itself (its accounting; a queue of its own holds jobs before they run):
    # the job service opens no usage row when it hands a job over, and the executor reports each run's
    # start and end as the cluster recorded them, through ``on_run`` (called from any thread).
    times_runs: bool = False
    on_run: Callable[[str, Run], None] | None = None

    def admit(self, ask: Ask) -> None:
        """Refuse a job this executor cannot run, with the cluster's own words where it has a queue
        of its own. Raises ``InvalidRequest`` or ``Unsatisfiable``. Here: only partitions and batch
        scripts, which only such a cluster knows, are refused."""
        if ask.partition or ask.batch_script:
            what = "a batch script" if ask.batch_script else f"partition {ask.partition!r}"
            raise InvalidRequest(
                f"{what}: batch scripts and partitions are Slurm's, and this server runs jobs with its {self.kind} "
                "executor — start it in front of a Slurm cluster (gpuport server --slurm) or run the script as a "
                "command (gpuport run -- sh script.sh)"
            )

    def waiting(self, job_ids: list[str]) -> dict[str, str]:
        """Of the handed-over jobs ``job_ids``, those the cluster's queue still holds, each with the
        cluster's reason (``keeps_queue`` only; one look at the queue for all of them)."""
        return {}

    @abstractmethod
    def nodes(self) -> list[Node]:
        """The cluster's nodes now, each with its GPUs, CPUs and memory."""

    @abstractmethod
    def gpus(self, job_ids: list[str]) -> dict[str, list[GpuInfo]]:
        """Node → its GPUs read live, each GPU's processes labelled with the job of ``job_ids`` (the
        running ones) they belong to (``GpuProcess.job_id``)."""

    @abstractmethod
    def start(self, job: JobLaunch, on_exit: OnExit) -> None:
        """Make the job's workspace on its node and start it there, detached from the server; call
        ``on_exit`` (from any thread) when its processes are gone. Raises when it could not start."""

    @abstractmethod
    def is_running(self, job_id: str) -> bool:
        """Whether the job's processes still run (after a server restart, too)."""

    @abstractmethod
    def reattach(self, job_id: str, on_exit: OnExit) -> None:
        """Watch a job started by an earlier server; call ``on_exit`` when it has ended."""

    @abstractmethod
    def cancel(self, job_id: str) -> None:
        """Ask the job to stop: SIGTERM to its processes, SIGKILL after its grace period."""

    def preempt(self, job_id: str) -> None:
        """Ask the job to stop because the server preempts it: as ``cancel``, and where the executor can,
        first the file $GPUPORT_PREEMPTED_FILE that says so to the job (``gpuport.preempted()``)."""
        self.cancel(job_id)

    @abstractmethod
    def kill(self, job_id: str, reason: str) -> None:
        """Stop the job at once (SIGKILL); its exit status records ``reason`` as why it was killed."""

    @abstractmethod
    def read_log(self, job_id: str, offset: int, limit: int) -> bytes:
        """Up to ``limit`` bytes of the job's log from ``offset`` (b"" past its end, or before it exists)."""

    @abstractmethod
    def log_size(self, job_id: str) -> int:
        """The length of the job's log so far."""

    def known_log_size(self, job_id: str) -> int:
        """The length of the job's log as last known here, at once: it never waits on a node (listings
        call it on the server's event loop). Where logs are read here: ``log_size``."""
        return self.log_size(job_id)

    def log_data_offset(self, job_id: str, offset: int) -> int:
        """Where the job's log has bytes from ``offset`` on: past a part cut from a log that passed
        its limit (``read_log`` stops before one). Where logs are never cut: ``offset``."""
        return offset

    @abstractmethod
    def exit_status(self, job_id: str) -> dict[str, Any] | None:
        """What the job's supervisor recorded at its end (see ``worker/supervisor.py``); None when it
        recorded nothing (it never started, or was killed itself)."""

    @abstractmethod
    def was_started(self, job_id: str) -> bool:
        """Whether the job's supervisor ever started (a job that was not is queued again after a crash)."""

    @abstractmethod
    def collect_outputs(self, job_id: str, declared: list[str], ingest: Ingest) -> tuple[str, list[str]]:
        """Snapshot the job's output folder and the ``declared`` paths of its workdir through ``ingest``;
        return the snapshot's id ('' for none) and the declared paths not found."""

    @abstractmethod
    def usage(self, job_ids: list[str]) -> dict[str, Usage]:
        """What each running job of ``job_ids`` uses now."""

    @abstractmethod
    def tidy(self, job_id: str) -> None:
        """Drop an ended job's working copies (its workdir, outputs folder, datasets); its log stays."""

    def pids(self, job_id: str) -> list[int]:
        """The pids of the job's processes on this machine; [] for a job that runs on another."""
        return []

    def reach_problem(self) -> str:
        """Why a running job's port or a command in it cannot be reached here ("": they can)."""
        return f"jobs run by the {self.kind} executor cannot be reached from outside yet"

    def dial_port(self, job_id: str, port: int) -> Dialer:
        """What makes a connection to TCP ``port`` on the running job's own loopback, ready for it
        (``Dialer.connect``). Raises ``Conflict`` (not running), ``InvalidRequest``."""
        raise InvalidRequest(self.reach_problem())

    def run_command(self, job_id: str, argv: list[str], *, tty: bool, term: str, rows: int, cols: int) -> Command:
        """Start ``argv`` in the running job (its sandbox, uid, environment and workdir), on a new
        pseudo-terminal with ``tty``. Raises ``Conflict`` (not running), ``InvalidRequest``."""
        raise InvalidRequest(self.reach_problem())

    # ---- workers the server talks to --------------------------------------------------------------

    def workers_problem(self) -> str:
        """Why the server cannot reach the endpoints of workers here ("": it can)."""
        return f"this server places jobs on a {self.kind} cluster"

    def connect(self, job_id: str, name: str, direct: bool = False) -> Stream:
        """A byte stream to the endpoint ``name`` of the running job's worker, checked to be the
        worker's own (a job of another user must not pass for it). Raises ``ConnectionError`` or
        ``FileNotFoundError`` while nothing listens there (the worker is starting), ``PermissionError``
        for an endpoint that is not the worker's, ``InvalidRequest`` where workers cannot be reached.
        ``direct``: the caller only reads and writes the stream, blocking (no ``sendmsg``, no
        descriptors, no event loop), so a node's TLS link may be handed over as it is, with no relay
        thread between (``Stream.sock`` is then a TLS socket)."""
        raise InvalidRequest(self.workers_problem())

    def read_file(self, job_id: str, name: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to ``limit`` bytes from ``offset`` of the file ``name`` the job's worker left in its run
        folder (a negative ``offset`` counts from its end); b"" for none. Never follows a link the
        job put there. Raises ``InvalidRequest`` where workers cannot be reached."""
        raise InvalidRequest(self.workers_problem())

    def file_size(self, job_id: str, name: str) -> int:
        """The length of the file ``name`` in the job's run folder (0 for none)."""
        raise InvalidRequest(self.workers_problem())

    def close(self) -> None:
        """Let go of the cluster (the jobs keep running)."""


class FolderReads:
    """What an executor, or a node's agent, reads of its jobs straight from their folders
    (``self.folders``): their logs and exit statuses. A base of the local and Slurm executors' and of
    the Ray agent's, which all keep their jobs in ``JobFolders``."""

    folders: JobFolders

    def read_log(self, job_id: str, offset: int, limit: int) -> bytes:
        return self.folders.read_log(job_id, offset, limit)

    def log_size(self, job_id: str) -> int:
        return self.folders.log_size(job_id)

    def log_data_offset(self, job_id: str, offset: int) -> int:
        return self.folders.log_data_offset(job_id, offset)

    def exit_status(self, job_id: str) -> dict[str, Any] | None:
        return self.folders.exit_status(job_id)
