"""The gpuport agent on each node of a Ray cluster: a detached, named Ray actor
(``gpuport-agent-<node id>``) that the Ray executor (``ray.py``, on the server) starts on every node
and calls by job id. It does there what the local executor does here (``workspace.py``): keeps a blob
store of its own, makes the job's folders, runs the job under the same supervisor and sandbox, and
answers for its log, exit status, outputs and usage, and for the endpoints and files of the workers
among its jobs (a session's), through the link of ``node_link.py``. A job's supervisor gets SIGUSR1 when the
agent's process ends, so a job never outlives its node's agent.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import queue
import shutil
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuport._files import atomic_write
from gpuport._packages import missing_package
from gpuport.protocol.errors import ConfigError
from gpuport.server.blobs import BlobStore, BlobWriter
from gpuport.server.executors.base import FolderReads, JobLaunch, Stream, Usage
from gpuport.server.inventory import GpuInfo

if TYPE_CHECKING:
    from gpuport.server.executors.node_link import NodeListener

log = logging.getLogger(__name__)

ENV_NODE_DIR = "GPUPORT_NODE_DIR"  # where an agent keeps its jobs and blobs (default: under Ray's temp dir)


def import_ray() -> Any:
    """The ``ray`` module; ``ConfigError`` saying what to install when it is missing."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(missing_package(e, "gpuport server --ray")) from None
    return ray


class NodeAgent(FolderReads):
    """gpuport on one node of the cluster: runs as a Ray actor there (see ``RayExecutor._agent``)."""

    def __init__(self, name: str, address: str) -> None:
        import psutil

        from gpuport.server import cgroups, isolation
        from gpuport.server.executors.local import this_machine
        from gpuport.server.executors.workspace import JobFolders
        from gpuport.server.inventory import FakeInventory, detect_inventory, memory_floor

        ray = import_ray()
        root = Path(os.environ.get(ENV_NODE_DIR) or Path(ray.get_runtime_context().get_temp_dir()) / "gpuport")
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.umask(0o077)
        inventory = detect_inventory()
        if isinstance(inventory, FakeInventory):
            inventory.usage_dir = root / "fake-gpus"
            inventory.usage_dir.mkdir(mode=0o700, exist_ok=True)
        self.name, self.address = name, address
        # Ray puts its driver's folders on its workers' sys.path: they are not this Python's, and a
        # job must not see them (the server's working folder, say). The paths come from a clean Python.
        sandbox = isolation.detect()
        paths, copied = isolation.clean_python_paths(), ()
        if sandbox.mode == "uids":  # as the server does: jobs' uids read all of it, or a copy
            paths, copied = isolation.readable_by_jobs(paths, root / "python")
        self.sandbox = dataclasses.replace(sandbox, python_paths=paths, python_copies=copied)
        self.blobs = BlobStore(root / "blobs")
        room = max(0, psutil.virtual_memory().total - memory_floor())
        limits = cgroups.detect(cgroups.server_key(root / "jobs"), room)
        self.folders = JobFolders(root / "jobs", self.blobs, self.sandbox, inventory, node=name, cgroups=limits)
        self.machine = this_machine(inventory)
        self.inventory = inventory
        self.received = 0  # blob bytes received: what crossed the network
        self._writers: dict[str, BlobWriter] = {}  # blob → the writer that has its first parts
        # Supervisors are started from this one thread, which lives as long as the agent: their
        # parent-death signal is tied to the thread that forked them.
        self._spawns: queue.Queue[tuple[JobLaunch, queue.Queue[BaseException | None]]] = queue.Queue()
        # Jobs asked to start and not yet launched: a server that died while asking must find them
        # running (not lost, not launched twice) when it comes back.
        self._launching: dict[str, threading.Event] = {}
        self._launching_lock = threading.Lock()
        self._listener: NodeListener | None = None  # the server's link to workers here (``open_link``)
        self._listener_lock = threading.Lock()
        threading.Thread(target=self._spawner, name="spawner", daemon=True).start()
        # Jobs of an agent that ended (its raylet died) were killed when it did; any left are ended now.
        for job_id in self.folders.kill_all(f"node lost: {name} (its gpuport agent ended)"):
            log.warning("job %s outlived this node's previous agent: killed", job_id)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "hostname": socket.gethostname(),
            "machine": self.machine,
            "sandbox": self.sandbox.describe(),
            "isolated": self.sandbox.isolated,
            "pid": os.getpid(),
        }

    def ping(self) -> bool:
        return True

    def free_ports(self, count: int) -> list[int]:
        """``count`` distinct TCP ports free on this node's address now (for a job's ranks to listen on)."""
        sockets = []
        try:
            for _ in range(count):
                sockets.append(socket.socket())
                sockets[-1].bind((self.address, 0))
            return [s.getsockname()[1] for s in sockets]
        finally:
            for s in sockets:
                s.close()

    # files
    def missing(self, blobs: list[str]) -> list[str]:
        sizes = self.blobs.sizes(blobs)
        return [b for b in blobs if sizes.get(b) is None]

    def write(self, parts: list[tuple[str, int, bytes, bool]]) -> int:
        """Whole blobs, or a blob's parts in order from its offset 0 (one call per blob at a time)."""
        writer = self._writers.get(parts[0][0]) if parts[0][1] else None
        if writer is None:
            writer = BlobWriter(self.blobs)
        for blob, offset, data, last in parts:
            writer.write([_Part(blob, offset, data, last)])
            self.received += len(data)
            if last:
                self._writers.pop(blob, None)
            else:
                self._writers[blob] = writer
        return self.received

    # processes
    def _spawner(self) -> None:
        while True:
            job, done = self._spawns.get()
            try:
                spec = self.folders.prepare(job)
                # Written now, read only if this agent's end kills the job (a deliberate kill rewrites it).
                reason = {"reason": f"node lost: {self.name} (its gpuport agent ended)"}
                atomic_write(self.folders.folder(job.job_id) / "kill.json", json.dumps(reason).encode(), 0o600)
                self.folders.launch(job.job_id, spec, lambda: None, preexec=_die_with_agent)
                done.put(None)
            except BaseException as e:  # said to the server
                done.put(e)
            finally:
                with self._launching_lock:
                    launching = self._launching.pop(job.job_id, None)
                if launching is not None:
                    launching.set()

    def start(self, job: JobLaunch) -> None:
        if job.uid is None and self.sandbox.mode == "uids":
            raise RuntimeError(f"node {self.name} runs jobs as a uid per user, and the server gave none")
        done: queue.Queue[BaseException | None] = queue.Queue()
        with self._launching_lock:
            self._launching[job.job_id] = threading.Event()
        self._spawns.put((job, done))
        error = done.get()
        if error is not None:
            raise error

    def _launched(self, job_id: str) -> None:
        """Block while the job is being launched here."""
        with self._launching_lock:
            launching = self._launching.get(job_id)
        if launching is not None:
            launching.wait()

    def wait(self, job_id: str) -> dict[str, Any] | None:
        self._launched(job_id)
        self.folders.wait(job_id)
        return self.folders.exit_status(job_id)

    def is_running(self, job_id: str) -> bool:
        with self._launching_lock:
            if job_id in self._launching:
                return True
        return self.folders.is_running(job_id)

    def cancel(self, job_id: str) -> None:
        self.folders.cancel(job_id)

    def kill(self, job_id: str, reason: str) -> None:
        self.folders.kill(job_id, reason)

    def was_started(self, job_id: str) -> bool:
        self._launched(job_id)
        return self.folders.was_started(job_id)

    def usage(self, job_ids: list[str]) -> dict[str, Usage]:
        return self.folders.usage(job_ids)

    def gpus(self, job_ids: list[str]) -> list[GpuInfo]:
        return self.folders.gpus(job_ids)

    def outputs(self, job_id: str, declared: list[str]) -> tuple[list[tuple[str, str, str, int]], list[str]]:
        """The job's output files, each as (path in the snapshot, "work" or "out", path below it, mode)."""
        found, missing = self.folders.output_files(job_id, declared)
        root = self.folders.folder(job_id)
        files = []
        for path, (base, below) in sorted(found.items()):
            f = self.folders.open_output(base, below)
            if f is not None:
                with f:
                    files.append((path, str(base.relative_to(root)), below, os.fstat(f.fileno()).st_mode))
        return files, missing

    def read_output(self, job_id: str, base: str, path: str, offset: int, size: int) -> bytes | None:
        """Bytes of an output file (None: it is no longer a regular file there)."""
        if base not in ("work", "out"):
            return None
        f = self.folders.open_output(self.folders.folder(job_id) / base, path)
        if f is None:
            return None
        with f:
            f.seek(offset)
            return f.read(size)

    # workers' endpoints and files
    def open_link(self, secret: str) -> dict[str, Any]:
        """Listen (once) for the server's connections to workers here, which must bring ``secret``
        (hex; the last one given): the port and the fingerprint of this node's certificate."""
        from gpuport.server.executors.node_link import NodeListener

        with self._listener_lock:
            if self._listener is None:
                self._listener = NodeListener(self.address, self._endpoint)
            return self._listener.open(secret)

    def _endpoint(self, job_id: str, name: str) -> Stream:
        """A worker's endpoint for the link; a tunnel's connection taken over here, where the worker
        can pass it (a descriptor does not cross the link)."""
        from gpuport.server.executors.node_link import node_endpoint

        return node_endpoint(self.folders.connect(job_id, name), name)

    def read_file(self, job_id: str, name: str, offset: int, limit: int) -> bytes:
        return self.folders.read_file(job_id, name, offset, limit)

    def file_size(self, job_id: str, name: str) -> int:
        return self.folders.file_size(job_id, name)

    def tidy(self, job_id: str, everything: bool = False) -> None:
        self.folders.tidy(job_id)
        if not everything:
            return
        # Its log and exit status are the server's now. A worker's files (a session's output, read
        # after its end as on one machine: the tail of a dead worker's stderr) stay, as they do there.
        folder = self.folders.folder(job_id)
        run = folder / "run"
        try:
            kept = run.is_dir() and not run.is_symlink() and any(run.iterdir())
        except OSError:
            kept = False
        if not kept:
            shutil.rmtree(folder, ignore_errors=True)
            return
        for child in folder.iterdir():
            if child.name != "run":
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)

    def stats(self) -> dict[str, int]:
        return {"received": self.received}


class _Part:
    __slots__ = ("blob", "data", "last", "offset")

    def __init__(self, blob: str, offset: int, data: bytes, last: bool) -> None:
        self.blob, self.offset, self.data, self.last = blob, offset, data, last


def _die_with_agent() -> None:
    """In a supervisor before it runs: SIGUSR1 (kill the job at once) when the agent's thread ends."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGUSR1)
