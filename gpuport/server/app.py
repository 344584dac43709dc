"""``ServerApp``: the services of one server, wired to one store and one GPU inventory.

Both doors (``api/grpc_api.py`` and ``api/http_api.py``) call into this object and nothing else.
"""

from __future__ import annotations

import platform
import socket
import time
from dataclasses import dataclass

import psutil

from gpuport._version import __version__
from gpuport.server.executors import Executor, LocalExecutor
from gpuport.server.inventory import GpuInfo, Inventory
from gpuport.server.services.auth import AuthService, Identity
from gpuport.server.services.blobs import BlobStore
from gpuport.server.services.jobs import JobService
from gpuport.server.services.snapshots import SnapshotService
from gpuport.server.state import StateDir
from gpuport.server.store import Store


@dataclass(frozen=True)
class GpuListing:
    inventory: str  # "nvml", "fake" or "cpu"
    note: str
    gpus: list[GpuInfo]


@dataclass(frozen=True)
class ServerStatus:
    server_version: str
    python_version: str
    hostname: str
    started_at: float
    cpus: int
    memory_total: int
    memory_available: int
    gpus: GpuListing
    user: str
    admin: bool


class ServerApp:
    def __init__(self, state: StateDir, inventory: Inventory, executor: Executor | None = None) -> None:
        self.state = state
        self.store = Store(state.db_path)
        self.auth = AuthService(self.store)
        self.inventory = inventory
        self.blobs = BlobStore(state.blobs_dir)
        self.snapshots = SnapshotService(self.store, self.blobs)
        self.jobs = JobService(self.store, self.snapshots, inventory, state.jobs_dir, executor or LocalExecutor())
        self.started_at = time.time()
        self.hostname = socket.gethostname()
        self.python_version = platform.python_version()

    async def start(self) -> None:
        """Start the services that run in the background (the job queue), picking up a previous run's jobs."""
        await self.jobs.start()

    def gpus(self, caller: Identity) -> GpuListing:
        gpus = self.inventory.gpus()
        holders = self.jobs.running_on_gpus()
        for gpu in gpus:
            gpu.jobs = holders.get(gpu.index, [])
        return GpuListing(self.inventory.kind, self.inventory.note, gpus)

    def status(self, caller: Identity) -> ServerStatus:
        memory = psutil.virtual_memory()
        return ServerStatus(
            server_version=__version__,
            python_version=self.python_version,
            hostname=self.hostname,
            started_at=self.started_at,
            cpus=psutil.cpu_count() or 1,
            memory_total=memory.total,
            memory_available=memory.available,
            gpus=self.gpus(caller),
            user=caller.name,
            admin=caller.admin,
        )

    def close(self) -> None:
        self.inventory.close()
        self.store.close()
