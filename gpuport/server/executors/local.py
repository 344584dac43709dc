"""The local executor: jobs run on this machine, a cluster of one node, in folders of the state dir."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil

from gpuport.server import cgroups as cgroups_
from gpuport.server.blobs import BlobStore
from gpuport.server.cgroups import Cgroups
from gpuport.server.environments import Environments
from gpuport.server.executors.base import Executor, FolderReads, Ingest, JobLaunch, Node, OnExit, Stream, Usage
from gpuport.server.executors.reach import Command, Dialer
from gpuport.server.executors.workspace import JobFolders
from gpuport.server.inventory import GpuInfo, Inventory
from gpuport.server.isolation import Sandbox
from gpuport.server.scheduler import Machine


def this_machine(inventory: Inventory) -> Machine:
    """What the scheduler shares out here: the inventory's GPUs, this machine's CPUs and RAM."""
    gpus = inventory.gpus()
    return Machine(tuple(g.memory_total for g in gpus), float(os.cpu_count() or 1), psutil.virtual_memory().total)


class LocalExecutor(FolderReads, Executor):
    kind = "local"

    def __init__(
        self,
        root: Path,
        blobs: BlobStore,
        sandbox: Sandbox,
        inventory: Inventory,
        cgroups: Cgroups = cgroups_.NONE,
        environments: Environments | None = None,
    ) -> None:
        self.name = socket.gethostname()
        self.folders = JobFolders(
            root, blobs, sandbox, inventory, node=self.name, cgroups=cgroups, environments=environments
        )
        self.inventory = inventory
        self._node = Node(self.name, this_machine(inventory), "127.0.0.1")

    def nodes(self) -> list[Node]:
        return [self._node]

    def gpus(self, job_ids: list[str]) -> dict[str, list[GpuInfo]]:
        return {self.name: self.folders.gpus(job_ids)}

    def start(self, job: JobLaunch, on_exit: OnExit) -> None:
        self.folders.start(job, on_exit)

    def is_running(self, job_id: str) -> bool:
        return self.folders.is_running(job_id)

    def reattach(self, job_id: str, on_exit: OnExit) -> None:
        self.folders.reattach(job_id, on_exit)

    def cancel(self, job_id: str) -> None:
        self.folders.cancel(job_id)

    def preempt(self, job_id: str) -> None:
        self.folders.preempt(job_id)

    def kill(self, job_id: str, reason: str) -> None:
        self.folders.kill(job_id, reason)

    def was_started(self, job_id: str) -> bool:
        return self.folders.was_started(job_id)

    def collect_outputs(self, job_id: str, declared: list[str], ingest: Ingest) -> tuple[str, list[str]]:
        return self.folders.collect_outputs(job_id, declared, ingest)

    def usage(self, job_ids: list[str]) -> dict[str, Usage]:
        return self.folders.usage(job_ids)

    def tidy(self, job_id: str) -> None:
        self.folders.tidy(job_id)

    def pids(self, job_id: str) -> list[int]:
        return self.folders.pids(job_id)

    def reach_problem(self) -> str:
        if self.folders.sandbox.mode == "sandbox":  # entering its namespaces takes root
            return (
                "this server runs jobs in sandboxes without root, and cannot enter them: run it as root (the "
                "systemd unit's way) to forward a job's ports or run commands in it"
            )
        return ""

    def dial_port(self, job_id: str, port: int) -> Dialer:
        return self.folders.dial_port(job_id, port)

    def run_command(self, job_id: str, argv: list[str], *, tty: bool, term: str, rows: int, cols: int) -> Command:
        return self.folders.run_command(job_id, argv, tty=tty, term=term, rows=rows, cols=cols)

    def workers_problem(self) -> str:
        return ""

    def connect(self, job_id: str, name: str, direct: bool = False) -> Stream:
        return self.folders.connect(job_id, name)

    def read_file(self, job_id: str, name: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        return self.folders.read_file(job_id, name, offset, limit)

    def file_size(self, job_id: str, name: str) -> int:
        return self.folders.file_size(job_id, name)
