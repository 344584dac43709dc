"""The Slurm executor: gpuport as the front door of an existing Slurm cluster (``gpuport server --slurm``).

Each gpuport job becomes one Slurm batch job (``sbatch --parsable``), whose queue then decides when
and where it runs: the job service hands every job over at once (``keeps_queue``) and asks
``waiting`` why Slurm holds them (one ``squeue`` for all). Submit, check, queue, cancel and nodes go
through a ``SlurmClient`` (slurm_rest.py): Slurm's commands, or slurmrestd's REST API where the
server is given one (``--slurm-rest``). The job's workspace is made with
``JobFolders`` under ``--shared-dir``, a folder the compute nodes share (NFS on a real cluster),
and the batch script runs gpuport's own supervisor there, inside the allocation: log, exit status,
cancel with a grace period and outputs behave as on the local executor. Layout of a job's folder,
beside ``JobFolders``'::

    slurm.sh      the batch script: its #SBATCH lines (gpuport's, then a user's script's), the supervisor
    slurm.id      the Slurm job id, written as soon as sbatch answers (a restarted server watches it again)
    slurm.out     what Slurm itself writes for the batch step (its errors: cancelled, time limit)
    slurm.done    written by the batch script once the supervisor has ended
    slurm-outputs.json  a batch script's --output/--error files, brought back as outputs
    link.secret   a worker's (a session's): the secret its link asks of the server, until the link read it
    link.json     a worker's: where its link listens on its node, signed with that secret (``slurm_link.py``)

The supervisor gets the allocation's ``CUDA_VISIBLE_DEVICES`` and ``SLURM_*`` (its spec's
``inherit``). A thread watches the handed-over jobs: a job has ended when its ``slurm.done``
appears, or when Slurm no longer lists it (cancelled while pending, killed with its node).

A job over N nodes (``--nodes N --nprocs-per-node M``) is one Slurm job of N nodes and M tasks on
each (gres per node). The supervisor runs on its first node and starts each rank through ``srun``
on its node, with the rank variables the Ray executor gives (the spec's ``srun``; see the
supervisor). Its cancel goes to the batch shell alone, which passes it to the supervisor, which
stops the ranks through Slurm: a SIGTERM to srun itself would kill its rank at once.

Workers the server talks to (a session's: ``JobLaunch.workers``) are Slurm jobs too, holding their
allocation until the session ends (then ``cancel``: scancel). The shared folder is NFS on a real
cluster, where a Unix socket of one node cannot be reached from another: the job's supervisor
starts, before anything of the job runs, a TLS listener on the node's address (``slurm_link.py``,
on ``node_link.py``'s listener, relay and pinned certificate) that connects to the worker's
endpoints as the local executor does (the socket must be one of the job's processes'). ``connect``
reads where it listens from ``link.json``, checks its HMAC under the job's secret and dials it,
pinning its certificate. The secret is the HMAC of the job id under a key of the server's
(``key_file``, in its state dir, not the shared one): the server writes it to ``link.secret`` for
the link, which removes it before the job starts, and derives it again after a restart.

Usage is Slurm's (``times_runs``): a job's usage row opens when squeue first shows it running, from
Slurm's start time, not when gpuport hands it over, and once the job has ended one ``sacct`` for all
the ended jobs (every DEFAULT_SACCT_INTERVAL) gives each row Slurm's start, elapsed seconds and
allocated CPUs and GPUs (AllocTRES' gres/gpu where the cluster accounts it, else the gres squeue
showed). ``sacct`` reads the cluster's database (slurmdbd) or, with ``JobCompType=jobcomp/filetxt``,
its completion records (``sacct --completion``). Slurm times to the second, and these figures are
the truth: ``gpuport usage`` matches sacct's elapsed × GPUs. A run sacct has not recorded within
DEFAULT_SACCT_WAIT, or a cluster without accounting, counts from squeue's start to the supervisor's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import marshal
import math
import os
import pwd
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpuport._files import atomic_write
from gpuport.protocol.errors import ConfigError, InvalidRequest, Unsatisfiable
from gpuport.protocol.units import format_size
from gpuport.server.blobs import BlobStore
from gpuport.server.executors.base import (
    ENDPOINT_NAME,
    Ask,
    Executor,
    FolderReads,
    Ingest,
    JobLaunch,
    Node,
    OnExit,
    Run,
    Stream,
    Usage,
)
from gpuport.server.executors.node_link import dial
from gpuport.server.executors.slurm_link import LINK_FILE, SECRET_FILE, verified
from gpuport.server.executors.slurm_rest import SlurmClient, SlurmCommands, slurm_epoch
from gpuport.server.executors.workspace import JobFolders, code_paths
from gpuport.server.inventory import GpuInfo, Inventory
from gpuport.server.isolation import Sandbox
from gpuport.server.scheduler import Machine
from gpuport.server.worker import supervisor

log = logging.getLogger(__name__)

DEFAULT_SLURM_POLL = 0.1  # seconds between looks for the ended jobs' slurm.done
DEFAULT_SQUEUE_INTERVAL = 1.0  # seconds between the watcher's looks at Slurm's queue (jobs gone from it)
# Seconds a look at Slurm's queue answers whether a job still runs (a restart's checks, on threads).
# `gpuport queue` takes the watcher's last look, whatever its age: the event loop never waits on squeue.
DEFAULT_SQUEUE_FRESH = 2.0
DEFAULT_SLURM_KILL_MARGIN = 5.0  # seconds after a cancel's grace before Slurm is asked to SIGKILL
DEFAULT_SACCT_INTERVAL = 2.0  # seconds between looks at Slurm's accounting for the runs that ended
DEFAULT_SACCT_WAIT = 60.0  # seconds an ended run waits for Slurm's accounting before the supervisor's clock counts
_NODES_FRESH = 10.0  # seconds between the watcher's looks at the node list (sinfo)
_INHERIT = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURM_")
_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SBATCH = re.compile(r"#SBATCH\s+(.*)")
_GRES_GPUS = re.compile(r"gpu(?::[^:(,]+)?:(\d+)")
_TRES_GPUS = re.compile(r"gres/gpu=(\d+)")
_GRES_SHARDS = re.compile(r"(?:^|,)shard(?::[^:(,]+)?:[1-9]")  # GPUs shared: gres/shard (Slurm 22.05 on)
_SACCT_FIELDS = "JobIDRaw,Start,ElapsedRaw,AllocCPUS,NNodes,AllocTRES,State"


def sbatch_lines(text: str) -> list[str]:
    """A batch script's own options, as sbatch reads them: the ``#SBATCH`` lines before its first
    command (blank lines and other comments may come between)."""
    lines = []
    for n, line in enumerate(text.splitlines()):
        stripped = line.strip()
        if n == 0 and stripped.startswith("#!"):
            continue
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        found = _SBATCH.match(stripped)
        if found is None:
            break
        lines.append(found.group(1).split(" #")[0].strip())
    return lines


def script_outputs(options: list[str]) -> list[str]:
    """The files a script's ``--output``/``--error`` (``-o``/``-e``) name, relative to its workdir."""
    found = []
    for line in options:
        words = shlex.split(line, comments=False)
        for i, word in enumerate(words):
            value = None
            if word.startswith(("--output=", "--error=")):
                value = word.split("=", 1)[1]
            elif word in ("--output", "--error", "-o", "-e") and i + 1 < len(words):
                value = words[i + 1]
            elif word.startswith(("-o", "-e")) and len(word) > 2 and not word.startswith("--"):
                value = word[2:]
            if value and not value.startswith("/") and ".." not in value.split("/"):
                found.append(value)
    return found


def _interpreter(text: str) -> list[str]:
    first = text.split("\n", 1)[0]
    return shlex.split(first[2:]) if first.startswith("#!") and first[2:].strip() else ["/bin/sh"]


def _gpus_of(gres: str) -> int:
    return sum(int(n) for n in _GRES_GPUS.findall(gres))


def asked_gpus(options: list[str]) -> tuple[int, int]:
    """The GPUs per node and the nodes a job's #SBATCH options ask for (the last of each wins)."""
    gpus, nodes = 0, 1
    for line in options:
        words = shlex.split(line, comments=False)
        for i, word in enumerate(words):
            value = words[i + 1] if i + 1 < len(words) else ""
            if word.startswith("--gres="):
                gpus = _gpus_of(word.split("=", 1)[1])
            elif word == "--gres":
                gpus = _gpus_of(value)
            elif word.startswith("--nodes=") or word in ("--nodes", "-N") or (word.startswith("-N") and len(word) > 2):
                found = word.split("=", 1)[1] if "=" in word else value if word in ("--nodes", "-N") else word[2:]
                with contextlib.suppress(ValueError):
                    nodes = int(found.split("-")[0])
    return gpus, nodes


def _link_key(path: Path) -> bytes:
    """The server's key for its jobs' link secrets: read from ``path``, or made there (0600)."""
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = b""
    if len(key) < 32:
        key = secrets.token_bytes(32)
        atomic_write(path, key, 0o600)
    return key


class SlurmExecutor(FolderReads, Executor):
    """Jobs as Slurm batch jobs, in workspaces under ``shared_dir`` (see the module's docstring),
    submitted, listed and cancelled through ``client`` (None: Slurm's commands; ``SlurmRest``:
    slurmrestd, see slurm_rest.py). Raises ``ConfigError`` when Slurm does not answer."""

    kind = "slurm"
    keeps_queue = True
    times_runs = True
    runs_here = False
    spans_nodes = True

    def __init__(
        self,
        shared_dir: Path,
        blobs: BlobStore,
        inventory: Inventory,
        partition: str = "",
        key_file: Path | None = None,
        client: SlurmClient | None = None,
    ) -> None:
        if partition and not _PARTITION.fullmatch(partition):
            raise ConfigError(f"--slurm-partition {partition!r}: a Slurm partition's name (letters, digits, _.-)")
        self._key = _link_key(key_file or blobs.root.parent / "slurm-link.key")
        self.shared_dir = shared_dir
        self.partition = partition
        sandbox = Sandbox("none", "jobs run in Slurm's allocations, as Slurm runs them")
        self.folders = JobFolders(shared_dir / "jobs", blobs, sandbox, inventory)
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[str, OnExit, float]] = {}  # job id → (Slurm id, on_exit, since)
        self._slurm_ids: dict[str, str] = {}  # job id → Slurm id, of the jobs handed over
        self._queue: tuple[float, dict[str, tuple[str, str]]] = (-1e9, {})  # (when, Slurm id → (state, reason))
        self._started: dict[str, Run] = {}  # Slurm id → its run as squeue last showed it running
        self._unaccounted: dict[str, tuple[str, float]] = {}  # job id → (Slurm id, ended since), for sacct
        self._reported: set[str] = set()  # Slurm ids whose start was reported (on_run)
        self._nodes: tuple[float, list[Node]] = (-1e9, [])
        self._shards = False  # its nodes offer GPU shards (gres/shard): a --gpu-memory job takes one
        self.commands = SlurmCommands()  # scontrol, sacct and srun: on the commands whatever the client
        self.client = client or self.commands
        try:
            found = self.client.partitions()
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            where = self.client.path
            raise ConfigError(f"--slurm: Slurm does not answer through {where} ({e}); is SLURM_CONF right?") from None
        self.address = f"partitions {', '.join(found)}, through {self.client.path}"
        self._sacct = self._accounting()
        self._read_nodes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="slurm watcher", daemon=True)
        self._thread.start()

    # ---- Slurm ------------------------------------------------------------------------------------

    def _run(self, argv: list[str], stdin: str | None = None, standard_time: bool = False) -> str:
        """A Slurm command's output (see ``SlurmCommands.run``): scontrol and sacct, which no client replaces."""
        return self.commands.run(argv, stdin, standard_time)

    def _accounting(self) -> list[str]:
        """How this cluster's accounting is read: ``sacct`` (a database, slurmdbd), ``sacct -c`` (the
        completion records of jobcomp/filetxt), or [] where Slurm keeps none (see ``_account``)."""
        try:
            config = self._run(["scontrol", "show", "config"])
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            log.warning("scontrol show config failed: %s", e)
            return []
        pairs = (line.partition("=") for line in config.splitlines())
        found = {key.strip(): value.strip() for key, _, value in pairs}
        if found.get("AccountingStorageType", "accounting_storage/none") != "accounting_storage/none":
            return ["sacct"]
        if found.get("JobCompType") == "jobcomp/filetxt":
            return ["sacct", "--completion"]
        log.warning(
            "Slurm keeps no accounting here (AccountingStorageType and JobCompType none): usage counts from "
            "squeue's start to the supervisor's end"
        )
        return []

    def _squeue(self, fresh: float) -> dict[str, tuple[str, str]] | None:
        """Slurm id → (state, reason) of this server's user's jobs Slurm still lists, read at most
        ``fresh`` seconds ago; None when squeue fails."""
        when, queue = self._queue
        if time.monotonic() - when <= fresh:
            return queue
        taken = time.monotonic()
        try:
            listed = self.client.queue(self.user)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            log.warning("Slurm's queue could not be read: %s", e)
            return None
        queue = {}
        with self._lock:
            ours = set(self._slurm_ids.values())
        for job in listed:
            slurm_id = job.slurm_id
            queue[slurm_id] = (job.state, job.reason)
            started = job.started if job.state in ("RUNNING", "COMPLETING") else None
            if started is not None and slurm_id in ours and slurm_id not in self._started:
                gpus = _gpus_of(job.gres) * job.nodes
                self._started[slurm_id] = Run(slurm_id, started, None, float(gpus), float(job.cpus), job.where)
        self._queue = (taken, queue)
        return queue

    def _slurm_id(self, job_id: str) -> str:
        with self._lock:
            found = self._slurm_ids.get(job_id, "")
        if not found:
            with contextlib.suppress(OSError):
                found = (self.folders.folder(job_id) / "slurm.id").read_text().strip()
            if found:
                with self._lock:
                    self._slurm_ids[job_id] = found
        return found

    # ---- what a job asks ----------------------------------------------------------------------------

    def _options(self, ask: Ask) -> list[str]:
        """The #SBATCH options of gpuport's own for a job (a script's own lines come after, and win)."""
        options = []
        per_task = 1  # processes of each Slurm task: all of them, but on several nodes one task per process
        if ask.nodes > 1:
            per_task = max(1, ask.nprocs // ask.nodes)
            options += [f"--nodes={ask.nodes}", f"--ntasks-per-node={per_task}"]
        if ask.gpus:  # on each node
            options.append(f"--gres=gpu:{ask.gpus}")
        elif ask.gpu_memory:  # a share of a GPU: one of the shards the cluster's admin cut its GPUs into
            options.append("--gres=shard:1")
        if ask.cpus:  # on each node
            options.append(f"--cpus-per-task={max(1, math.ceil(ask.cpus / per_task))}")
        if ask.memory:
            options.append(f"--mem={max(1, math.ceil(ask.memory / (1 << 20)))}M")
        if ask.time_limit:  # the supervisor stops it at its limit; Slurm's is a backstop past the grace
            options.append(f"--time={math.ceil(ask.time_limit / 60) + 1}")
        partition = ask.partition or self.partition
        if partition:
            options.append(f"--partition={partition}")
        return options

    def admit(self, ask: Ask) -> None:
        # Blocks on sbatch for as long as slurmctld takes to answer: the job service calls this from
        # ``JobService.check``, which the API runs on a thread, never on the server's event loop.
        if ask.partition and not _PARTITION.fullmatch(ask.partition):
            raise InvalidRequest(f"partition {ask.partition[:80]!r}: a Slurm partition's name (letters, digits, _.-)")
        if ask.gpu_memory and not self._shards:
            self._read_nodes()  # the nodes as they are now (sinfo): an admin may have added shards
        if ask.gpu_memory and not self._shards:
            raise Unsatisfiable(
                f"asked for a {format_size(ask.gpu_memory)} slice of a GPU; this Slurm cluster shares no GPU "
                "(no gres/shard in its slurm.conf): ask for whole GPUs (--gpus N)"
            )
        if ask.batch_script and ask.nodes > 1:
            raise InvalidRequest(
                f"batch script {ask.batch_script!r} over {ask.nodes} nodes: give the nodes in its own #SBATCH lines "
                "(--nodes, --ntasks-per-node) and start its steps with srun, as on Slurm"
            )
        header = self._options(ask) + (sbatch_lines(ask.script_text) if ask.batch_script else [])
        try:
            self.client.test(header)
        except OSError as e:
            raise InvalidRequest(f"Slurm did not answer the job's check through {self.client.path}: {e}") from None
        except RuntimeError as e:
            raise InvalidRequest(f"Slurm refused the job: {e}") from None

    # ---- start and watch ------------------------------------------------------------------------------

    def start(self, job: JobLaunch, on_exit: OnExit) -> None:
        # Slurm gives the job its GPUs; an empty CUDA_VISIBLE_DEVICES of gpuport's would hide them.
        job = dataclasses.replace(job, env={k: v for k, v in job.env.items() if k != "CUDA_VISIBLE_DEVICES"})
        spec = self.folders.prepare(job)
        spec["env"].pop("CUDA_VISIBLE_DEVICES", None)  # the server's own, if it has one
        spec["inherit"] = list(_INHERIT)
        job_dir = self.folders.folder(job.job_id)
        work = job_dir / "work"
        ask = Ask(job.gpus, job.cpus, job.memory, job.time_limit, partition=job.partition)
        ask = dataclasses.replace(ask, nodes=job.nodes, nprocs=job.nprocs, gpu_memory=job.gpu_memory)
        if job.workers:  # reached over its node's network, through a link of its own (``slurm_link.py``)
            atomic_write(job_dir / SECRET_FILE, self._secret(job.job_id).encode(), 0o600, durable=False)
            paths = os.pathsep.join(code_paths()[1:])
            spec["link"] = {
                "argv": [sys.executable, "-m", "gpuport.server.executors.slurm_link", str(job_dir)],
                "env": {"PYTHONPATH": paths} if paths else {},
            }
        if job.nodes > 1:
            commands = {name: shutil.which(name) or name for name in ("srun", "scontrol", "scancel")}
            spec["srun"] = {**commands, "per_node": job.nprocs // job.nodes, "gpus": job.gpus}
        options = [f"--job-name=gpuport-{job.job_id}", f"--output={job_dir / 'slurm.out'}", f"--chdir={work}"]
        options += self._options(ask)
        outputs: list[str] = []
        if job.batch_script:
            text = (work / job.batch_script).read_text(errors="replace")
            own = sbatch_lines(text)
            options += own
            outputs = script_outputs(own)
            spec["argv"] = [*_interpreter(text), job.batch_script, *job.argv[1:]]
        atomic_write(job_dir / "spec.marshal", marshal.dumps(spec), 0o600, durable=False)
        atomic_write(job_dir / "slurm-outputs.json", json.dumps(outputs).encode(), 0o600, durable=False)
        q = shlex.quote
        copies = "".join(
            f"cat {q(str(job_dir / 'log'))} > {q(path.replace('%j', '$SLURM_JOB_ID'))}\n" for path in outputs
        )
        run = (
            f"{q(sys.executable)} -I -S {q(supervisor.__file__)} {q(str(job_dir))} "
            f">> {q(str(job_dir / 'supervisor.log'))} 2>&1"
        )
        if job.nodes > 1:  # a cancel reaches this shell alone (scancel --batch): it passes it on
            run = f"trap 'kill -TERM $pid' TERM\n{run} &\npid=$!\nwhile kill -0 $pid 2>/dev/null; do wait $pid; done\n"
        else:
            run = f"trap : TERM\n{run}\n"  # the shell waits for the supervisor, which passes a cancel on
        script = (
            "#!/bin/sh\n"
            + "".join(f"#SBATCH {line}\n" for line in options)
            + run
            + copies
            + f": > {q(str(job_dir / 'slurm.done'))}\n"
        )
        atomic_write(job_dir / "slurm.sh", script.encode(), 0o700, durable=False)
        submitted = time.monotonic()
        try:
            slurm_id = self.client.submit(job_dir / "slurm.sh", options)
        except (RuntimeError, InvalidRequest) as e:
            raise RuntimeError(f"Slurm refused the job: {e}") from None
        atomic_write(job_dir / "slurm.id", slurm_id.encode(), 0o600)
        log.info("job %s is Slurm job %s", job.job_id, slurm_id)
        with self._lock:
            self._slurm_ids[job.job_id] = slurm_id
            self._watched[job.job_id] = (slurm_id, on_exit, submitted)

    def _watch(self) -> None:
        next_look = next_sacct = 0.0
        while not self._stop.wait(DEFAULT_SLURM_POLL):
            if self._unaccounted and time.monotonic() >= next_sacct:
                next_sacct = time.monotonic() + DEFAULT_SACCT_INTERVAL
                self._account()
            if time.monotonic() - self._nodes[0] >= _NODES_FRESH:
                self._read_nodes()
            with self._lock:
                watched = dict(self._watched)
            if not watched:
                continue
            # Only a job Slurm last listed as started (or not at all) can have ended: no look at the
            # shared folder for each of a thousand pending ones, ten times a second.
            listed = self._queue[1]
            started = [j for j, (slurm_id, _, _) in watched.items() if listed.get(slurm_id, ("",))[0] != "PENDING"]
            ended = [j for j in started if (self.folders.folder(j) / "slurm.done").exists()]
            if time.monotonic() >= next_look:
                began = time.monotonic()
                queue = self._squeue(0.0)
                taken = self._queue[0]
                # A slow look is not repeated at once: slurmrestd lists every job Slurm keeps as JSON
                # (seconds for thousands, on slurmctld's and this server's CPUs), and the watcher asks
                # for at most half of their time.
                next_look = time.monotonic() + max(DEFAULT_SQUEUE_INTERVAL, time.monotonic() - began)
                if queue is not None:
                    self._report_started(watched)
                    for job_id, (slurm_id, _, since) in watched.items():
                        if slurm_id not in queue and taken > since and job_id not in ended:
                            ended.append(job_id)
            for job_id in ended:
                with self._lock:
                    entry = self._watched.pop(job_id, None)
                if entry is not None:
                    try:
                        entry[1]()
                    except Exception:
                        log.exception("job %s: its end could not be reported", job_id)

    # ---- accounting (services/usage.py: the rows of the runs the cluster timed) --------------------------

    def _report(self, job_id: str, run: Run) -> None:
        if self.on_run is None:
            return
        try:
            self.on_run(job_id, run)
        except Exception:
            log.exception("job %s: its run's times could not be recorded", job_id)

    def _report_started(self, watched: dict[str, tuple[str, OnExit, float]]) -> None:
        """Open the usage row of each watched job squeue shows running for the first time, from Slurm's
        start: the time it waited in Slurm's queue is not usage."""
        for job_id, (slurm_id, _, _) in watched.items():
            run = self._started.get(slurm_id)
            if run is not None and slurm_id not in self._reported:
                self._reported.add(slurm_id)
                self._report(job_id, run)

    def _account(self) -> None:
        """Close the usage rows of the runs that ended with Slurm's own figures: one ``sacct`` for all
        of them, its start, elapsed seconds and allocated CPUs, and GPUs from its AllocTRES where the
        cluster accounts gres/gpu, else from squeue's gres while it ran (or the batch script's). A run
        sacct has not recorded within DEFAULT_SACCT_WAIT, or on a cluster without accounting, counts
        from squeue's start (else the supervisor's) to the supervisor's end."""
        with self._lock:
            waiting = dict(self._unaccounted)
        found: dict[str, Run] = {}
        if self._sacct:
            ids = ",".join(sorted({slurm_id for slurm_id, _ in waiting.values()}))
            argv = [*self._sacct, "-n", "-P", "-X", "-S", "now-30days", "-E", "now", "-j", ids, "-o", _SACCT_FIELDS]
            try:
                out = self._run(argv, standard_time=True)
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                log.warning("sacct failed: %s", e)
                out = ""
            for line in out.splitlines():
                slurm_id, start, elapsed, cpus, nodes, tres, state = (line.split("|") + [""] * 7)[:7]
                started = slurm_epoch(start)
                if started is None or state.split(" ")[0] in ("PENDING", "RUNNING", "SUSPENDED", "REQUEUED"):
                    continue  # not ended yet, as the accounting has it
                with contextlib.suppress(ValueError):
                    gpus = _TRES_GPUS.search(tres)
                    seen = self._started.get(slurm_id)
                    if gpus is not None:
                        count: float | None = float(gpus.group(1))
                    elif seen is not None:
                        count = seen.gpus
                    else:
                        job_id = next((j for j, (s, _) in waiting.items() if s == slurm_id), "")
                        count = self._asked_gpus(job_id, int(nodes or 1))
                    found[slurm_id] = Run(slurm_id, started, started + int(elapsed), count, float(cpus))
        now = time.monotonic()
        for job_id, (slurm_id, since) in waiting.items():
            run = found.get(slurm_id)
            if run is None and self._sacct and now - since < DEFAULT_SACCT_WAIT:
                continue  # Slurm records a job's end a moment after it ends
            if run is None:
                run = self._clocked(job_id, slurm_id)
            with self._lock:
                self._unaccounted.pop(job_id, None)
            if run is not None and ((run.ended_at or 0.0) > run.started_at or slurm_id in self._reported):
                self._report(job_id, run)  # (a job cancelled while it waited held nothing)
            self._started.pop(slurm_id, None)
            self._reported.discard(slurm_id)

    def _clocked(self, job_id: str, slurm_id: str) -> Run | None:
        """A run's times without Slurm's accounting: squeue's start, else the supervisor's, to its end."""
        status = self.folders.exit_status(job_id) or {}
        seen = self._started.get(slurm_id)
        start = seen.started_at if seen is not None else status.get("started_at")
        end = status.get("ended_at")
        if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
            return None
        if seen is not None:
            return dataclasses.replace(seen, ended_at=max(start, end))
        return Run(slurm_id, start, max(start, end), self._asked_gpus(job_id, 0), None)

    def _asked_gpus(self, job_id: str, nodes: int) -> float | None:
        """The GPUs the job's batch script asks for, all ``nodes`` together (0: as many as it asks);
        None where it cannot be read."""
        try:
            text = (self.folders.folder(job_id) / "slurm.sh").read_text(errors="replace")
        except OSError:
            return None
        gpus, asked_nodes = asked_gpus(sbatch_lines(text))
        return float(gpus * (nodes or asked_nodes))

    def is_running(self, job_id: str) -> bool:
        slurm_id = self._slurm_id(job_id)
        if not slurm_id or (self.folders.folder(job_id) / "slurm.done").exists():
            return False
        queue = self._squeue(DEFAULT_SQUEUE_FRESH)
        return queue is None or slurm_id in queue  # Slurm not answering: still its, for now

    def reattach(self, job_id: str, on_exit: OnExit) -> None:
        slurm_id = self._slurm_id(job_id)
        with self._lock:
            self._watched[job_id] = (slurm_id, on_exit, time.monotonic())

    def waiting(self, job_ids: list[str]) -> dict[str, str]:
        # The watcher's last look (it looks every second while jobs are handed over): `gpuport queue`
        # runs on the server's event loop, which must not wait on squeue.
        queue = self._queue[1]
        out = {}
        for job_id in job_ids:
            state, reason = queue.get(self._slurm_id(job_id), ("", ""))
            if state == "PENDING":
                out[job_id] = f"Slurm: {reason}"
        return out

    # ---- stop -------------------------------------------------------------------------------------

    def cancel(self, job_id: str) -> None:
        slurm_id = self._slurm_id(job_id)
        if not slurm_id:
            return
        job_dir = self.folders.folder(job_id)
        atomic_write(job_dir / "cancel", b"", 0o600, durable=False)  # the supervisor reads it as it starts
        # Slurm's commands on a thread of their own: the caller is the server's event loop.
        threading.Thread(target=self._cancel, args=(job_id, slurm_id), name=f"cancel {job_id}", daemon=True).start()

    def _cancel(self, job_id: str, slurm_id: str) -> None:
        job_dir = self.folders.folder(job_id)
        state = (self._squeue(0.0) or {}).get(slurm_id, ("", ""))[0]
        if state == "PENDING":  # never ran: it ends here, cancelled
            with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                self.client.cancel(slurm_id)
            if not (job_dir / "exit.json").exists():
                now = time.time()
                status = {"started_at": now, "ended_at": now, "exit_code": -15, "cancelled": True}
                atomic_write(job_dir / "exit.json", json.dumps(status).encode(), 0o600, durable=False)
            return
        spec = self._spec(job_id)
        # Over several nodes, srun would kill its rank at once on a SIGTERM of its own: the batch
        # shell alone gets it, and the supervisor stops the ranks through Slurm (see the supervisor).
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            self.client.cancel(slurm_id, "TERM", batch_only=bool(spec.get("srun")))
        grace = float(spec.get("grace", 5.0)) + DEFAULT_SLURM_KILL_MARGIN
        timer = threading.Timer(grace, self._kill_if_running, (job_id, slurm_id))
        timer.daemon = True
        timer.start()

    def _spec(self, job_id: str) -> dict[str, Any]:
        try:
            spec = marshal.loads((self.folders.folder(job_id) / "spec.marshal").read_bytes())
        except (OSError, ValueError, EOFError):
            return {}
        return spec if isinstance(spec, dict) else {}

    def _kill_if_running(self, job_id: str, slurm_id: str) -> None:
        if self.is_running(job_id):
            self._scancel_kill(slurm_id)

    def kill(self, job_id: str, reason: str) -> None:
        slurm_id = self._slurm_id(job_id)
        if not slurm_id:
            return
        job_dir = self.folders.folder(job_id)
        atomic_write(job_dir / "kill.json", json.dumps({"reason": reason}).encode(), 0o600, durable=False)
        atomic_write(job_dir / "kill", b"", 0o600, durable=False)
        threading.Thread(target=self._scancel_kill, args=(slurm_id,), name=f"kill {job_id}", daemon=True).start()

    def _scancel_kill(self, slurm_id: str) -> None:
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            self.client.cancel(slurm_id, "KILL")

    # ---- what a job leaves (in the shared folder) -----------------------------------------------------

    def known_log_size(self, job_id: str) -> int:
        with self._lock:
            slurm_id = self._slurm_ids.get(job_id, "")
        if self._queue[1].get(slurm_id, ("",))[0] == "PENDING":
            return 0  # not started: no log yet, and no look at the shared folder for each of a long queue
        return self.folders.log_size(job_id)

    def was_started(self, job_id: str) -> bool:
        return bool(self._slurm_id(job_id)) or self.folders.was_started(job_id)

    def collect_outputs(self, job_id: str, declared: list[str], ingest: Ingest) -> tuple[str, list[str]]:
        try:
            extra = json.loads((self.folders.folder(job_id) / "slurm-outputs.json").read_text())
        except (OSError, ValueError):
            extra = []
        extra = [path.replace("%j", self._slurm_id(job_id)) for path in extra]
        return self.folders.collect_outputs(job_id, [*declared, *(p for p in extra if p not in declared)], ingest)

    def usage(self, job_ids: list[str]) -> dict[str, Usage]:
        return {job_id: Usage() for job_id in job_ids}  # Slurm holds them to what they asked for

    def tidy(self, job_id: str) -> None:
        # Called once a run has ended and its end is recorded: the watcher closes its usage row with
        # Slurm's figures (``_account``).
        slurm_id = self._slurm_id(job_id)
        if slurm_id:
            with self._lock:
                self._unaccounted[job_id] = (slurm_id, time.monotonic())
        self.folders.tidy(job_id)

    # ---- the cluster ------------------------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        # Read by the watcher every _NODES_FRESH seconds: the scheduler asks on the server's event loop.
        return self._nodes[1]

    def _read_nodes(self) -> None:
        try:
            listed = self.client.nodes()
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            log.warning("Slurm's nodes could not be read: %s", e)
            self._nodes = (time.monotonic(), self._nodes[1])
            return
        found: dict[str, Node] = {}
        shards = False
        for node in listed:
            shards = shards or bool(_GRES_SHARDS.search(node.gres))
            machine = Machine((0,) * _gpus_of(node.gres), node.cpus, node.memory_mb << 20)
            found.setdefault(node.name, Node(node.name, machine))
        self._nodes = (time.monotonic(), list(found.values()))
        self._shards = shards

    def gpus(self, job_ids: list[str]) -> dict[str, list[GpuInfo]]:
        return {}  # read on the compute nodes, by Slurm

    # ---- workers the server talks to (see the module's docstring) --------------------------------------

    def _secret(self, job_id: str) -> str:
        return hmac.new(self._key, job_id.encode(), "sha256").hexdigest()

    def workers_problem(self) -> str:
        return ""

    def connect(self, job_id: str, name: str, direct: bool = False) -> Stream:
        if not ENDPOINT_NAME.fullmatch(name):
            raise InvalidRequest(f"{name[:40]!r} is not an endpoint's name")
        try:
            data = (self.folders.folder(job_id) / LINK_FILE).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"job {job_id} has no link yet (Slurm has not started it)") from None
        secret = self._secret(job_id)
        info = verified(secret, job_id, data)
        stream = dial(str(info["address"]), int(info["port"]), str(info["fingerprint"]), secret, job_id, name, direct)
        stream.node = str(info.get("node") or "")
        return stream

    def read_file(self, job_id: str, name: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        return self.folders.read_file(job_id, name, offset, limit)

    def file_size(self, job_id: str, name: str) -> int:
        return self.folders.file_size(job_id, name)

    def close(self) -> None:
        self._stop.set()
