"""The watchdog: no job uses more GPU memory than its slice, or more RAM than it asked for.

The job's bootstrap caps each framework at the slice, but a process can still allocate around it
(CUDA directly, a library with its own pool, a framework the bootstrap does not know). So every
``DEFAULT_WATCHDOG_INTERVAL`` the watchdog reads what each GPU's processes use (NVML, or the fake
inventory), adds it up per job (a job's processes are its ranks and their descendants), and kills a
job over its limit at once: it ends as ``killed``, with "exceeded its GPU memory slice of 8GiB
(used 9.1GiB)" in its status and at the end of its log. RAM (``memory=``) is checked the same way,
against the resident memory of the job's processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import psutil

from gpuport.defaults import DEFAULT_WATCHDOG_INTERVAL
from gpuport.protocol.units import format_size
from gpuport.server.inventory import GpuInfo, Inventory
from gpuport.server.scheduler import Holding
from gpuport.server.services.jobs import JobService

log = logging.getLogger(__name__)


def gpu_use(gpus: Iterable[GpuInfo], jobs: JobService, holdings: Iterable[Holding]) -> dict[str, int]:
    """Job id → bytes of GPU memory its processes use now; each GPU process is labelled with its job."""
    owner_of: dict[int, str] = {}
    for holding in holdings:
        if holding.gpu_indices:
            for pid in jobs.pids(holding.job_id):
                owner_of[pid] = holding.job_id
    used: dict[str, int] = {}
    for gpu in gpus:
        for process in gpu.processes:
            job_id = owner_of.get(process.pid)
            if job_id:
                process.job_id = job_id
                used[job_id] = used.get(job_id, 0) + process.memory_used
    return used


def _rss(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue  # ended meanwhile
    return total


class Watchdog:
    def __init__(self, jobs: JobService, inventory: Inventory, interval: float = DEFAULT_WATCHDOG_INTERVAL) -> None:
        self.jobs = jobs
        self.inventory = inventory
        self.interval = interval
        self._killed: set[str] = set()  # asked to die already: not again on the next round

    async def run(self) -> None:
        """Check every ``interval`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await asyncio.to_thread(self.check)
            except Exception:  # a failed reading must not stop the watch
                log.exception("the watchdog's check failed")

    def check(self) -> None:
        """Kill every running job over its GPU slice or its memory limit."""
        limited = [h for h in self.jobs.running() if h.request.gpu_memory or h.request.memory]
        self._killed &= {h.job_id for h in limited}
        if not limited:
            return
        sliced = [h for h in limited if h.request.gpu_memory]
        used = gpu_use(self.inventory.gpus(), self.jobs, sliced) if sliced else {}
        for holding in limited:
            if holding.job_id in self._killed:
                continue
            reason = ""
            slice_ = holding.request.gpu_memory
            if slice_ and used.get(holding.job_id, 0) > slice_:
                reason = (
                    f"exceeded its GPU memory slice of {format_size(slice_)} (used {format_size(used[holding.job_id])})"
                )
            elif holding.request.memory:
                rss = _rss(self.jobs.pids(holding.job_id))
                if rss > holding.request.memory:
                    reason = (
                        f"exceeded its memory limit of {format_size(holding.request.memory)} (used {format_size(rss)})"
                    )
            if reason:
                self._killed.add(holding.job_id)
                self.jobs.kill(holding.job_id, reason)
