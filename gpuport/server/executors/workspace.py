"""Jobs' folders and processes on one machine: what an executor does where the job runs.

``JobFolders`` is used by the local executor on the server's machine, and by the gpuport agent of
each Ray node on that node (``executors/ray.py``). Layout of ``ROOT/<job id>/``::

    spec.marshal      what the supervisor runs           log          stdout + stderr, in order
    work/             the workdir, from the snapshot     exit.json    exit code and times (atomic)
    out/              $GPUPORT_OUTPUT_DIR                supervisor.lock  held while the job runs
    datasets/<name>/  read-only named snapshots          supervisor.json  its pid, once started
    run/              $GPUPORT_RUN_DIR: a worker's endpoints (NAME.sock) and the files the server reads

Each job runs under ``worker/supervisor.py`` in its own session, so it outlives the process that
started it (a server restarted, even after SIGKILL, finds it running): a thread per running job
waits for its end, on the supervisor process for jobs started here, on its lock for the others.
Where the machine has cgroups, each job runs in a group of its own, held to its memory limit and
its cap of processes (``server/cgroups.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import marshal
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from gpuport._files import (
    atomic_write,
    files_beneath,
    let_read,
    open_beneath,
    open_file_beneath,
    open_nofollow,
    own_folder,
    own_tree,
)
from gpuport.defaults import (
    DEFAULT_LOG_LIMIT,
    ENV_DATASETS_DIR,
    ENV_FAKE_GPU_DIR,
    ENV_NODE,
    ENV_OUTPUT_DIR,
    ENV_PREEMPTED_FILE,
    ENV_RUN_DIR,
)
from gpuport.server import cgroups as cgroups_
from gpuport.server.blobs import BlobStore, Entry, write_entries
from gpuport.server.cgroups import Cgroups
from gpuport.server.environments import Built, Environments, EnvRequest, say
from gpuport.server.executors import reach
from gpuport.server.executors.base import ENDPOINT_NAME, Files, JobLaunch, OnExit, Stream, Usage
from gpuport.server.executors.reach import Command
from gpuport.server.inventory import FakeInventory, GpuInfo, Inventory
from gpuport.server.isolation import Sandbox
from gpuport.server.worker import bootstrap, supervisor, wire

log = logging.getLogger(__name__)

_SUPERVISOR = [sys.executable, "-I", "-S", supervisor.__file__]
_BOOTSTRAP = Path(bootstrap.__file__).parent


def code_paths() -> list[str]:
    """What a job's Python needs on its path to run gpuport's workers: the bootstrap, and the folder
    that holds gpuport where this server found it on its own path (PYTHONPATH, or the folder it was
    started in) rather than in its environment, since the server's PYTHONPATH is not the job's."""
    paths = [str(_BOOTSTRAP)]
    holder = Path(bootstrap.__file__).resolve().parents[4]
    on_path = {os.path.realpath(p or os.curdir) for p in sys.path}
    if str(holder) in on_path and holder.name not in ("site-packages", "dist-packages"):
        paths.append(str(holder))
    return paths


_CODE_PATHS = code_paths()
# What a job gets of the server's environment, beside what its owner sent and gpuport's own
# variables: the locale, the time zone, and how to reach the GPUs. Nothing else: the admin's shell
# (tokens, cloud keys, proxies) stays with the server, and so does the engine's (a Ray node's token).
_SERVER_ENV = ("LANG", "LANGUAGE", "TZ")
_SERVER_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_")
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_ARCHIVES = (".whl", ".tar.gz", ".zip")  # a project's own packages, which its requirements may name


def base_env() -> dict[str, str]:
    """The environment a job starts from: ``PATH`` with this Python environment's programs first
    (where gpuport and the frameworks are installed), then the system's, and of this process's
    environment only ``_SERVER_ENV`` and the ``_SERVER_ENV_PREFIXES`` (documented in the README)."""
    env = {k: v for k, v in os.environ.items() if k in _SERVER_ENV or k.startswith(_SERVER_ENV_PREFIXES)}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), _SYSTEM_PATH])
    return env


def job_pids(job_dir: Path) -> list[int]:
    """The pids of the processes of the job in ``job_dir`` on this machine (each rank's, and their
    descendants), as its supervisor announced them."""
    try:
        info = json.loads((job_dir / "supervisor.json").read_text())
    except (OSError, ValueError):
        return []  # not started yet, or ended
    pids = []
    for child in info.get("children") or [info["child"]]:
        try:
            process = psutil.Process(child)
            pids += [child, *(p.pid for p in process.children(recursive=True))]
        except psutil.Error:
            continue  # that rank has ended
    return pids


def run_path(job_dir: Path, name: str) -> Path:
    """The path of the endpoint or file ``name`` in the job's run folder; ``ValueError`` for a name
    that is not one."""
    if not ENDPOINT_NAME.fullmatch(name):
        raise ValueError(f"{name[:40]!r} is not an endpoint's name")
    return job_dir / "run" / name


def connect_endpoint(job_dir: Path, name: str) -> Stream:
    """The worker's Unix socket ``run/NAME.sock`` of the job in ``job_dir``, refused
    (``PermissionError``) when the process listening on it is not one of the job's: the folder is the
    job's to write, so a job could put a link there to another worker's socket, which the server
    would follow. Used here (the local executor, a Ray node's agent) and by a Slurm job's link."""
    path = run_path(job_dir, name)
    return Stream(wire.connect(f"{path}.sock", lambda pid: pid in job_pids(job_dir)), passes_fds=True)


def _entries(files: Files) -> list[Entry]:
    return [Entry(*e) for e in files.entries]


class JobFolders:
    """The jobs of one machine, each in its folder under ``root``."""

    def __init__(
        self,
        root: Path,
        blobs: BlobStore,
        sandbox: Sandbox,
        inventory: Inventory,
        node: str = "",
        cgroups: Cgroups = cgroups_.NONE,
        environments: Environments | None = None,
    ) -> None:
        self.root = root
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.blobs = blobs
        self.sandbox = sandbox
        self.inventory = inventory
        self.node = node  # $GPUPORT_NODE of its jobs
        self.cgroups = cgroups  # where its jobs' groups are made (version 0: none)
        self.environments = environments  # where jobs' Python environments are built (None: not here)
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def folder(self, job_id: str) -> Path:
        return self.root / job_id

    # ---- start ------------------------------------------------------------------------------------

    def prepare(self, job: JobLaunch) -> dict[str, Any]:
        """Make the job's folder (workdir, outputs folder, datasets); return the supervisor's spec."""
        job_dir = self.folder(job.job_id)
        shutil.rmtree(job_dir, ignore_errors=True)
        job_dir.mkdir()
        work, out, run = job_dir / "work", job_dir / "out", job_dir / "run"
        out.mkdir()
        run.mkdir()
        write_entries(_entries(job.workdir) if job.workdir else [], self.blobs, work)
        built = self._environment(job, work, job_dir / "log")
        env = base_env()
        argv = list(job.argv)
        if built is not None:  # its programs first; gpuport's workers (the box's Python) run in it too
            env["PATH"] = os.pathsep.join([str(built.path / "bin"), env["PATH"]])
            env["VIRTUAL_ENV"] = str(built.path)
            if argv and argv[0] == sys.executable:
                argv[0] = built.python
        env.update(job.env)
        # Python jobs run worker/bootstrap/sitecustomize.py first: live, ordered and fast output.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*_CODE_PATHS, env.get("PYTHONPATH")) if p)
        if job.datasets:
            datasets = job_dir / "datasets"
            for name, files in job.datasets.items():
                write_entries(_entries(files), self.blobs, datasets / name, read_only=True)
            env[ENV_DATASETS_DIR] = str(datasets)
        if job.hyperparameters is not None:
            (work / "hyperparameters.json").write_text(json.dumps(job.hyperparameters, indent=2))
        env[ENV_OUTPUT_DIR] = str(out)
        env[ENV_RUN_DIR] = str(run)
        env[ENV_PREEMPTED_FILE] = str(run / "preempted")
        if self.node:
            env[ENV_NODE] = self.node
        if job.rank_env and job.nprocs == 1:  # one process of a job over several nodes: run direct
            env.update(job.rank_env[0])
        fake_gpus = None
        if isinstance(self.inventory, FakeInventory) and self.inventory.usage_dir:
            fake_gpus = self.inventory.usage_dir / job.job_id if self.sandbox.isolated else self.inventory.usage_dir
            env[ENV_FAKE_GPU_DIR] = str(fake_gpus)
        spec: dict[str, Any] = {
            "argv": argv,
            "cwd": str(work),
            "env": env,
            "grace": job.grace,
            "time_limit": job.time_limit,
            "log_limit": DEFAULT_LOG_LIMIT,
            "nprocs": job.nprocs,
            "tf_roles": job.tf_roles,
            "rank_gpus": job.rank_gpus,
            "sandbox": None,
            "network": None,
            "pidns_file": None,
            "cgroup": self.cgroups.make(job.job_id, job.memory, job.processes, job.owner),
        }
        if job.rank_env and job.nprocs > 1:
            spec["rank_env"], spec["rank_base"] = job.rank_env, job.rank_base
        if self.sandbox.isolated:
            spec.update(self._sandbox(job, work, out, env, fake_gpus, built))
        elif "HOME" not in job.user_env:  # no sandbox: the job runs as the server's user, at its home
            env["HOME"] = os.path.expanduser("~")
        return spec

    def _environment(self, job: JobLaunch, work: Path, log_path: Path) -> Built | None:
        """The job's Python environment, built here now where it is missing (its progress and uv's
        output go to the job's log); None: the node's own. Raises ``BuildFailed``."""
        if job.environment is None:
            return None
        with open(log_path, "ab", buffering=0) as log_file:
            if self.environments is None:
                say(log_file, "this node builds no environments: the job runs in the node's own")
                return None
            wheels = [f"{e[0]}:{e[1]}" for e in job.workdir.entries if e[0].endswith(_ARCHIVES)] if job.workdir else []
            request = EnvRequest.from_json(job.environment)
            built = self.environments.ensure(request, work, wheels, log_file, job.build_uid)
        if built is not None:
            self.environments.record(job.job_id, built)
        return built

    def _sandbox(
        self,
        job: JobLaunch,
        work: Path,
        out: Path,
        env: dict[str, str],
        fake_gpus: Path | None,
        built: Built | None = None,
    ) -> dict:
        """The sandbox a job runs in: only its own folders, its datasets read-only, as its owner's uid
        (when the server is root), which then owns what the job may write."""
        uid = job.uid if self.sandbox.mode == "uids" else None
        writable = [work, out, work.parent / "run", *(Path(folder) for folder in job.folders)]
        pidns_file = None
        if fake_gpus is not None:
            shutil.rmtree(fake_gpus, ignore_errors=True)  # made anew: an earlier run of the job wrote there
            fake_gpus.mkdir()
            writable.append(fake_gpus)
            pidns_file = str(fake_gpus / ".pidns")
        readable = [work.parent / "datasets"] if job.datasets else []
        for folder in readable:  # made for this job just now, and read-only to it
            let_read(folder)
        if built is not None:  # the server's, sealed: read-only to every job, bound read-only too
            readable.append(built.path)
        if uid is not None:
            for folder in (work, out):  # copies made for this job just now: the job's to change
                own_tree(folder, uid)
            # The folder only, never a walk of it: what the server put in it was made readable when it
            # was made, and whatever else is there now, a replica or worker of the job's may have put.
            for folder in writable[2:]:
                own_folder(folder, uid)
        if "HOME" not in job.user_env:
            env["HOME"] = "/tmp"  # the sandbox's own; the server's home is not there
        network = None
        if self.sandbox.slirp4netns and not job.host_network:
            network = [self.sandbox.slirp4netns, "--configure", "--mtu=65520", "--disable-host-loopback"]
        argv = self.sandbox.argv(
            uid=uid,
            writable=writable,
            readable=readable,
            cwd=work,
            host_network=job.host_network,
            tmpfs_size=job.memory,
        )
        return {"sandbox": argv, "network": network, "pidns_file": pidns_file, "uid": uid}

    def start(self, job: JobLaunch, on_exit: OnExit) -> None:
        spec = self.prepare(job)
        self.launch(job.job_id, spec, on_exit)

    def launch(
        self, job_id: str, spec: dict[str, Any], on_exit: OnExit, preexec: Callable[[], None] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start the supervisor of a prepared job (``preexec``: run in its process before it starts)."""
        job_dir = self.folder(job_id)
        # Not fsynced: a machine that crashes takes the job's processes with it anyway.
        # In marshal: the supervisor reads it without importing json (see its imports).
        atomic_write(job_dir / "spec.marshal", marshal.dumps(spec), 0o600, durable=False)
        with open(job_dir / "supervisor.log", "ab") as out:
            process = subprocess.Popen(
                [*_SUPERVISOR, str(job_dir)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a server killed with SIGKILL or Ctrl-C leaves its jobs running
                close_fds=True,
                preexec_fn=preexec,
            )
        _charge_to_owner(process.pid, spec)
        with self._lock:
            self._processes[job_id] = process

        def wait() -> None:
            process.wait()
            with self._lock:
                self._processes.pop(job_id, None)
            on_exit()

        threading.Thread(target=wait, name=f"job {job_id}", daemon=True).start()
        return process

    # ---- processes --------------------------------------------------------------------------------

    def is_running(self, job_id: str) -> bool:
        try:
            fd = os.open(self.folder(job_id) / "supervisor.lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the lock we may have taken
        return False

    def wait(self, job_id: str) -> None:
        """Block until the job's supervisor has ended."""
        with self._lock:
            process = self._processes.get(job_id)
        if process is not None:
            process.wait()
            return
        try:
            fd = os.open(self.folder(job_id) / "supervisor.lock", os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # granted when the supervisor exits
        finally:
            os.close(fd)

    def reattach(self, job_id: str, on_exit: OnExit) -> None:
        def wait() -> None:
            self.wait(job_id)
            on_exit()

        threading.Thread(target=wait, name=f"job {job_id}", daemon=True).start()

    def _supervisor_pid(self, job_id: str) -> int | None:
        """The running supervisor's pid, or None when it has ended."""
        with self._lock:
            process = self._processes.get(job_id)
        pid = process.pid if process else None
        if pid is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = int(json.loads((self.folder(job_id) / "supervisor.json").read_text())["pid"])
        if pid is None or not self.is_running(job_id) and process is None:
            return None
        return pid

    # A request is left as a file first, then signalled once the supervisor has said it listens
    # (supervisor.json): it reads the file after writing that, so one of the two always sees the
    # other, and a cancel sent as a job starts is never lost.

    def cancel(self, job_id: str) -> None:
        pid = self._supervisor_pid(job_id)
        if pid is not None:
            atomic_write(self.folder(job_id) / "cancel", b"", 0o600, durable=False)
            if (self.folder(job_id) / "supervisor.json").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)  # the supervisor passes it to the job's groups, then SIGKILLs

    def preempt(self, job_id: str) -> None:
        run = self.folder(job_id) / "run"
        if run.is_dir():  # before the SIGTERM, so that a job's handler finds it
            with contextlib.suppress(OSError):
                atomic_write(run / "preempted", b"1\n", 0o644, durable=False)
        self.cancel(job_id)

    def kill(self, job_id: str, reason: str) -> None:
        pid = self._supervisor_pid(job_id)
        if pid is not None:
            data = json.dumps({"reason": reason}).encode()
            atomic_write(self.folder(job_id) / "kill.json", data, 0o600, durable=False)
            atomic_write(self.folder(job_id) / "kill", b"", 0o600, durable=False)
            if (self.folder(job_id) / "supervisor.json").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)  # the supervisor reads kill.json and SIGKILLs the job's groups

    def kill_all(self, reason: str) -> list[str]:
        """Kill every job still running here (a node whose jobs the server gave up on); return their ids."""
        killed = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if folder.is_dir() and self.is_running(folder.name):
                self.kill(folder.name, reason)
                killed.append(folder.name)
        return killed

    def pids(self, job_id: str) -> list[int]:
        """The pids of the job's processes (each rank's, and their descendants)."""
        return job_pids(self.folder(job_id))

    def gpus(self, job_ids: list[str]) -> list[GpuInfo]:
        """The GPUs read now, each process labelled with the job of ``job_ids`` it belongs to."""
        gpus = self.inventory.gpus()
        owner_of = {pid: job_id for job_id in job_ids for pid in self.pids(job_id)}
        for gpu in gpus:
            for process in gpu.processes:
                process.job_id = owner_of.get(process.pid, "")
        return gpus

    def usage(self, job_ids: list[str]) -> dict[str, Usage]:
        used: dict[str, int] = {}
        gpus = self.gpus(job_ids) if job_ids and self.inventory.kind != "cpu" else []
        for gpu in gpus:
            for process in gpu.processes:
                if process.job_id:
                    used[process.job_id] = used.get(process.job_id, 0) + process.memory_used
        out = {}
        for job_id in job_ids:
            if self.cgroups.memory:  # held by the kernel; what its group is charged stands for its RSS
                out[job_id] = Usage(self.cgroups.memory_used(job_id) or 0, used.get(job_id, 0), memory_enforced=True)
                continue
            rss = 0
            for pid in self.pids(job_id):
                with contextlib.suppress(psutil.Error):  # ended meanwhile
                    rss += psutil.Process(pid).memory_info().rss
            out[job_id] = Usage(rss, used.get(job_id, 0))
        return out

    # ---- reaching a running job --------------------------------------------------------------------

    def dial_port(self, job_id: str, port: int) -> reach.Dialer:
        """What connects to TCP ``port`` on the running job's own loopback, ready (see ``reach.py``)."""
        sandboxed = self.sandbox.isolated
        return reach.dial_port(self.folder(job_id), job_id, port, sandboxed, lambda: self.is_running(job_id))

    def run_command(self, job_id: str, argv: list[str], *, tty: bool, term: str, rows: int, cols: int) -> Command:
        """Start ``argv`` in the running job's sandbox, as its uid, in its workdir (see ``reach.py``)."""
        uid = self._job_uid(job_id)
        running = lambda: self.is_running(job_id)
        kw = {"tty": tty, "term": term, "rows": rows, "cols": cols}
        return reach.run_command(self.folder(job_id), job_id, argv, uid=uid, running=running, **kw)

    def _job_uid(self, job_id: str) -> int | None:
        try:
            return marshal.loads((self.folder(job_id) / "spec.marshal").read_bytes()).get("uid")
        except (OSError, ValueError, EOFError):
            return None

    # ---- a worker's endpoints and files ------------------------------------------------------------

    def _run_path(self, job_id: str, name: str) -> Path:
        return run_path(self.folder(job_id), name)

    def connect(self, job_id: str, name: str) -> Stream:
        return connect_endpoint(self.folder(job_id), name)

    def read_file(self, job_id: str, name: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        try:
            with open_nofollow(self._run_path(job_id, name)) as f:  # the job's folder: no link followed
                f.seek(offset if offset >= 0 else max(0, os.fstat(f.fileno()).st_size + offset))
                return f.read(max(0, limit))
        except OSError:
            return b""

    def file_size(self, job_id: str, name: str) -> int:
        try:  # lstat: a link the job put there is not its file
            found = os.lstat(self._run_path(job_id, name))
        except OSError:
            return 0
        return found.st_size if stat.S_ISREG(found.st_mode) else 0

    # ---- what a job leaves ------------------------------------------------------------------------

    def read_log(self, job_id: str, offset: int, limit: int) -> bytes:
        """Up to ``limit`` bytes from ``offset``, never into a hole: where the log passed its limit,
        the part cut from its middle (see ``log_data_offset``)."""
        try:
            with open(self.folder(job_id) / "log", "rb") as f:
                with contextlib.suppress(OSError):  # ENXIO: at or past the end
                    limit = min(limit, os.lseek(f.fileno(), offset, os.SEEK_HOLE) - offset)
                f.seek(offset)
                return f.read(max(0, limit))
        except FileNotFoundError:
            return b""

    def log_data_offset(self, job_id: str, offset: int) -> int:
        """Where the log has bytes from ``offset`` on: ``offset`` itself, or the end of the hole it
        lies in (the note of what was cut starts there)."""
        try:
            with open(self.folder(job_id) / "log", "rb") as f:
                return max(offset, os.lseek(f.fileno(), offset, os.SEEK_DATA))
        except OSError:  # no log yet, or at or past its end (ENXIO)
            return offset

    def log_size(self, job_id: str) -> int:
        try:
            return (self.folder(job_id) / "log").stat().st_size
        except OSError:
            return 0

    def exit_status(self, job_id: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.folder(job_id) / "exit.json").read_text())
        except (OSError, ValueError):
            return None

    def was_started(self, job_id: str) -> bool:
        job_dir = self.folder(job_id)
        return (job_dir / "exit.json").exists() or (job_dir / "supervisor.json").exists()

    def output_files(self, job_id: str, declared: list[str]) -> tuple[dict[str, tuple[Path, str]], list[str]]:
        """The job's output files (path in the snapshot → (root, path below it)) and the declared
        paths not found: the declared files first, then the output folder's, then declared folders'.

        Nothing the job wrote is trusted as a path: every component is opened without following a
        symlink (an output ``a/b`` with ``a -> /`` is not found, rather than read from outside)."""
        job_dir = self.folder(job_id)
        work, out = job_dir / "work", job_dir / "out"
        found: dict[str, tuple[Path, str]] = {}
        missing, folders = [], []
        for path in declared:
            fd = open_beneath(work, path)
            if fd is None:
                missing.append(path)
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                found.setdefault(path, (work, path))
            else:
                folders.append(path)
            os.close(fd)
        for path in files_beneath(out) if out.is_dir() else ():
            found.setdefault(path, (out, path))
        for folder in folders:
            for path in files_beneath(work, folder):
                found.setdefault(path, (work, path))
        return found, missing

    def collect_outputs(self, job_id: str, declared: list[str], ingest: Callable[[Any], str]) -> tuple[str, list[str]]:
        found, missing = self.output_files(job_id, declared)
        if not found and not declared:
            return "", missing
        # Each file is opened only when it is read, one at a time.
        opened = ((path, self.open_output(*found[path])) for path in sorted(found))
        return ingest((path, f) for path, f in opened if f is not None), missing

    def open_output(self, root: Path, path: str) -> BinaryIO | None:
        """The job's file ``path`` under ``root`` (its work or output folder), read as root: only a
        file that the job's uid owns, as it owns those folders (never one of the host's that a hard
        link put there), and never through a link."""
        return open_file_beneath(root, path, owner=os.stat(root).st_uid)

    def tidy(self, job_id: str) -> None:
        job_dir = self.folder(job_id)
        for name in ("work", "out", "datasets"):
            shutil.rmtree(job_dir / name, ignore_errors=True)
        self.cgroups.remove(job_id)  # its supervisor removed them, unless it was killed itself
        if isinstance(self.inventory, FakeInventory) and self.inventory.usage_dir and self.sandbox.isolated:
            shutil.rmtree(self.inventory.usage_dir / job_id, ignore_errors=True)


def _charge_to_owner(pid: int, spec: dict[str, Any]) -> None:
    """cgroup v1: put a job's supervisor in its owner's cpu group as soon as it runs, not once its
    Python has started (about 40 ms of CPU, a third of a ``true`` job's): else each user's launches
    set themselves up on the host's share, outside the CPU divided by user, and one user's six
    launches at once took most of the CPU another user's launch needed (measured with
    ``bench/probe_launch_flood.py``). Its own write of "0" there, at its start, stays for a server that
    cannot write here. One thread: a thread's move takes no lock that waits for RCU (see the
    supervisor's ``_Groups._move``)."""
    cpu = (spec.get("cgroup") or {}).get("cpu")
    if cpu:
        with contextlib.suppress(OSError):  # gone already, or no right: it joins at its start
            cgroups_.write_tasks(cpu, pid)
