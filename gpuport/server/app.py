"""``ServerApp``: the services of one server, wired to one store and one GPU inventory.

Both doors (``api/grpc_api.py`` and ``api/http_api.py``) call into this object and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

import psutil

from gpuport._version import __version__
from gpuport.defaults import (
    DEFAULT_AGE_WEIGHT,
    DEFAULT_ARCHIVE_PROCESSES,
    DEFAULT_BLOB_GRACE,
    DEFAULT_FAIRSHARE_HALF_LIFE,
    DEFAULT_PREEMPT_AFTER,
)
from gpuport.protocol.errors import AuthenticationError, GpuportError, InvalidRequest, PermissionDenied
from gpuport.server import cgroups as cgroups_
from gpuport.server.blobs import BlobStore
from gpuport.server.cgroups import Cgroups
from gpuport.server.environments import Environments, env_cache_default
from gpuport.server.executors import Executor, LocalExecutor
from gpuport.server.history import GpuHistory
from gpuport.server.inventory import FakeInventory, GpuInfo, Inventory
from gpuport.server.isolation import Sandbox
from gpuport.server.metrics import Metrics, Transfers
from gpuport.server.services.auth import AuthService, Identity, LoginCodes, TokenRecord
from gpuport.server.services.jobs import JobService
from gpuport.server.services.quotas import QuotaService
from gpuport.server.services.serving import ServingService
from gpuport.server.services.sessions import SessionService
from gpuport.server.services.snapshots import SnapshotService
from gpuport.server.services.storage import StorageService
from gpuport.server.services.usage import FairShareRow, UsageRow, UsageService
from gpuport.server.state import StateDir
from gpuport.server.store import Store
from gpuport.server.tls import ClientCertificate, issue_client_certificate
from gpuport.server.watchdog import Watchdog

T = TypeVar("T")
_HISTORY = Identity("history", admin=True)  # the GPUs' history reads them as the server does


@dataclass(frozen=True)
class GpuAllocation:
    """Part of a GPU held by a running job: all of it (``memory`` 0) or a slice of ``memory`` bytes."""

    job_id: str
    owner: str
    memory: int
    memory_used: int  # what the job's processes use on this GPU now (NVML)


@dataclass(frozen=True)
class GpuListing:
    inventory: str  # "nvml", "fake" or "cpu"
    note: str
    gpus: list[GpuInfo]
    allocations: dict[int, list[GpuAllocation]] = field(default_factory=dict)  # place in ``gpus`` → its holders


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
    def __init__(
        self,
        state: StateDir,
        inventory: Inventory,
        sandbox: Sandbox,
        executor: Executor | None = None,
        memory_floor: int = 0,
        cgroups: Cgroups = cgroups_.NONE,
        blob_grace: float = DEFAULT_BLOB_GRACE,
        env_cache: int | None = None,
        fairshare_half_life: float = DEFAULT_FAIRSHARE_HALF_LIFE,
        age_weight: float = DEFAULT_AGE_WEIGHT,
        preempt_after: float = DEFAULT_PREEMPT_AFTER,
    ) -> None:
        self.state = state
        self.sandbox = sandbox
        self.store = Store(state.db_path)
        self.auth = AuthService(self.store, "" if sandbox.isolated else sandbox.why)
        self.login_codes = LoginCodes(self.auth)  # the dashboard's one-time login links
        self.inventory = inventory
        self.blobs = BlobStore(state.blobs_dir)
        self.snapshots = SnapshotService(self.store, self.blobs)
        self.quotas = QuotaService(self.store, state.root)
        if isinstance(inventory, FakeInventory):
            inventory.usage_dir = state.root / "fake-gpus"
            inventory.usage_dir.mkdir(mode=0o700, exist_ok=True)
        # Python environments are built where jobs run: here, for the local executor (a Ray cluster's
        # nodes run jobs in their own environment).
        self.environments = None
        if executor is None:
            limit = env_cache if env_cache is not None else env_cache_default(state.root)
            self.environments = Environments(state.envs_dir, sandbox, limit)
        self.executor = executor or LocalExecutor(
            state.jobs_dir, self.blobs, sandbox, inventory, cgroups, environments=self.environments
        )
        self.jobs = JobService(
            self.store,
            self.snapshots,
            inventory,
            self.executor,
            self.quotas,
            sandbox,
            memory_floor,
        )
        self.usage = self.jobs.usage = UsageService(self.store, fairshare_half_life, age_weight)
        self.jobs.preempt_after = preempt_after
        if self.environments is not None:
            self.jobs.environments = self.environments
            self.environments.record = self.jobs.record_environment
            self.environments.in_use = self.jobs.environments_in_use
        self.storage = StorageService(self.store, self.blobs, self.quotas, self.executor.known_log_size, blob_grace)
        self.jobs.storage = self.storage
        self.sessions = SessionService(self.store, self.jobs)
        self.serving = ServingService(self.store, self.jobs, self.snapshots, state.models_dir)
        self.watchdog = Watchdog(self.jobs)
        self.transfers = Transfers()  # bytes in and out, counted where they move
        # Archives posted over REST unpack in processes of their own (server/unpacker.py), a few at
        # a time: a queue of hostile ones waits its turn, and takes none of the server's threads.
        self.unpackers = asyncio.Semaphore(DEFAULT_ARCHIVE_PROCESSES)
        # The dashboard's charts, kept in the state dir across restarts.
        self.gpu_history = GpuHistory(lambda: self.gpus(_HISTORY).gpus, path=state.gpu_history_path)
        self.metrics = Metrics(self)
        self._watching: asyncio.Task[None] | None = None
        self._revoked: dict[str, asyncio.Event] = {}  # user → set when their token goes (streams wait on it)
        self.auth.revoked_hooks.append(self._end_streams)
        self.cert_port = 0  # the gRPC port for client certificates, once listening (0: none, without TLS)
        self.http_port = 0  # the HTTP port (REST, dashboard), once listening
        self.started_at = time.time()
        self.hostname = socket.gethostname()
        self.python_version = platform.python_version()

    async def start(self) -> None:
        """Start the services that run in the background (the job queue, the watchdog), picking up a
        previous run's jobs."""
        await self.jobs.start()
        await self.sessions.start()
        await self.serving.start()
        self._watching = asyncio.create_task(self.watchdog.run())
        self.storage.start()
        self.gpu_history.start()

    async def until_revoked(self, name: str, replies: AsyncIterator[T]) -> AsyncIterator[T]:
        """The replies of a stream that ``name`` follows (logs, a session's output), ended with
        ``AuthenticationError`` as soon as their token is revoked, even while no reply comes."""
        revoked = asyncio.ensure_future(self._revoked.setdefault(name, asyncio.Event()).wait())
        replies = aiter(replies)
        try:
            while True:
                step = asyncio.ensure_future(anext(replies))
                await asyncio.wait({step, revoked}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    raise AuthenticationError(f"the token of '{name}' was revoked")
                try:
                    yield step.result()
                except StopAsyncIteration:
                    return
        finally:
            revoked.cancel()

    def _end_streams(self, name: str) -> None:
        event = self._revoked.pop(name, None)
        if event is not None:
            event.set()

    async def create_token(
        self, caller: Identity, name: str, admin: bool, client_cert: bool = False, scrape: bool = False
    ) -> tuple[TokenRecord, str, ClientCertificate | None]:
        """A token for user ``name`` and, with ``client_cert``, a client certificate that stands for
        it (made by a child process, off the event loop); the token and the key are shown once. A
        ``scrape`` token reads ``GET /metrics`` and nothing else."""
        scope = "metrics" if scrape else ""
        if not client_cert:
            return *self.auth.create(caller, name, admin, scope=scope), None
        if scrape:
            raise InvalidRequest("a scrape token is sent as a header by Prometheus: it takes no client certificate")
        self.auth.check_create(caller, name, admin)
        if not self.cert_port:
            raise InvalidRequest("this server runs without TLS (--insecure), so it takes no client certificates")
        certificate = await asyncio.to_thread(issue_client_certificate, self.state, name)
        return *self.auth.create(caller, name, admin, certificate.fingerprint), certificate

    def revoke_token(self, caller: Identity, name: str, end_work: bool = False) -> TokenRecord:
        """Revoke ``name``'s token (what it holds open closes: see ``AuthService.revoked_hooks``);
        with ``end_work`` also cancel their queued and running jobs and close their sessions."""
        record = self.auth.revoke(caller, name)
        if end_work:
            self._end_work(name)
        return record

    def _end_work(self, name: str) -> None:
        owner = Identity(name, admin=True)
        sessions = [s for s in self.sessions.list_for(owner) if s.owner == name]
        for session in sessions:
            with contextlib.suppress(GpuportError):  # it ended meanwhile
                self.sessions.close(owner, session.id, reason=f"the token of {name} was revoked")
        rows = self.store.query(
            "SELECT id FROM jobs WHERE owner = ? AND kind = 'job' AND state IN ('queued', 'running')", (name,)
        )
        for row in rows:
            with contextlib.suppress(GpuportError):
                self.jobs.cancel(owner, row["id"])

    def usage_report(
        self, caller: Identity, since: float = 0.0, user: str | None = None, by: str = "user"
    ) -> tuple[list[UsageRow], list[FairShareRow]]:
        """What ``caller`` may see of the usage accounting (their own; an admin's: everyone's, or
        ``user``'s) from ``since``, by user or day, and each user's place in the fair share now."""
        cluster = self.jobs.cluster
        entries = self.usage.report(caller, since, user, by, cluster.total.largest_gpu)
        active = {
            r["owner"] for r in self.store.query("SELECT DISTINCT owner FROM jobs WHERE state IN ('queued', 'running')")
        }
        fair = self.usage.fair_view(caller, cluster, self.quotas.shares(), active)
        if user:
            fair = [f for f in fair if f.user == user]
        return entries, fair

    def gpus(self, caller: Identity) -> GpuListing:
        """Every GPU read live, with the jobs holding it: whole or by slices, and what each uses."""
        holdings = self.jobs.running()
        gpus = []
        for node, found in self.executor.gpus([h.job_id for h in holdings]).items():
            for gpu in found:
                gpu.node = node
                gpus.append(gpu)
        allocations: dict[int, list[GpuAllocation]] = {}
        for place, gpu in enumerate(gpus):
            for holding in holdings:
                if holding.node in ("", gpu.node) and gpu.index in holding.gpu_indices:
                    used = sum(p.memory_used for p in gpu.processes if p.job_id == holding.job_id)
                    allocations.setdefault(place, []).append(
                        GpuAllocation(holding.job_id, holding.owner, holding.request.gpu_memory, used)
                    )
            gpu.jobs = [a.job_id for a in allocations.get(place, [])]
        return GpuListing(self.inventory.kind, self.inventory.note, gpus, allocations)

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

    def list_environments(self, caller: Identity, prune: bool = False) -> tuple[list[dict], list[str]]:
        """The environments built here, each with how many jobs ran in it (``jobs``) and run in it now
        (``running``); ``prune`` (admins only) removes first those no running job uses. Raises
        ``PermissionDenied``."""
        if prune and not caller.admin:
            raise PermissionDenied("only an admin prunes environments (they are shared by every user)")
        if self.environments is None:
            return [], []
        removed = []
        if prune:
            in_use = self.jobs.environments_in_use()
            removed = [m["hash"] for m in self.environments.listing() if m["hash"] not in in_use]
            removed = [name for name in removed if self.environments.remove(name)]
        counts, running = self.jobs.environment_jobs(), self.jobs.environment_jobs(running=True)
        listing = [
            {**m, "jobs": counts.get(m["hash"], 0), "running": running.get(m["hash"], 0)}
            for m in self.environments.listing()
        ]
        return listing, removed

    def close(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        self.storage.stop()
        self.gpu_history.stop()
        self.sessions.stop()
        self.serving.stop()
        self.executor.close()
        self.inventory.close()
        self.store.close()
