"""The watchdog: no job uses more GPU memory than its slice, or more RAM than it asked for.

Where jobs run in cgroups with a memory limit (``server/cgroups.py``), the kernel holds each job to
its RAM, and the watchdog looks only at GPU memory; the poll of resident memory below is for
machines without cgroups the server may use.

The job's bootstrap caps each framework at the slice, but a process can still allocate around it
(CUDA directly, a library with its own pool, a framework the bootstrap does not know). So every
``DEFAULT_WATCHDOG_INTERVAL`` the watchdog asks the executor what each limited job uses now (on
its node: the GPU memory of the job's processes, read from NVML or the fake inventory, and their
resident memory), and kills a job over its limit at once: it ends as ``killed``, with "exceeded
its GPU memory slice of 8GiB (used 9.1GiB)" in its status and at the end of its log.
"""

from __future__ import annotations

import asyncio
import logging

from gpuport.defaults import DEFAULT_WATCHDOG_INTERVAL
from gpuport.protocol.units import format_size
from gpuport.server.services.jobs import JobService

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, jobs: JobService, interval: float = DEFAULT_WATCHDOG_INTERVAL) -> None:
        self.jobs = jobs
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
        limited = [h for h in limited if h.job_id not in self._killed]
        if not limited:
            return
        usage = self.jobs.executor.usage([h.job_id for h in limited])
        for holding in limited:
            used = usage.get(holding.job_id)
            if used is None:
                continue
            reason = ""
            slice_, memory = holding.request.gpu_memory, holding.request.memory
            if slice_ and used.gpu_memory > slice_:
                reason = f"exceeded its GPU memory slice of {format_size(slice_)} (used {format_size(used.gpu_memory)})"
            elif memory and used.rss > memory and not used.memory_enforced:
                reason = f"exceeded its memory limit of {format_size(memory)} (used {format_size(used.rss)})"
            if reason:
                self._killed.add(holding.job_id)
                self.jobs.kill(holding.job_id, reason)
