"""The GPUs' recent past, for the dashboard's charts: utilization and memory of each GPU, read every
``interval`` seconds and kept for ``span`` seconds (an hour by default), so memory stays bounded."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuport.server.inventory import GpuInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    at: float  # seconds since the epoch
    utilization: int | None  # percent
    memory_used: int


class GpuHistory:
    def __init__(self, read: Callable[[], list[GpuInfo]], interval: float = 10.0, span: float = 3600.0) -> None:
        self._read = read
        self.interval = interval
        self._keep = max(2, int(span / interval) + 1)
        self._readings: dict[str, collections.deque[Reading]] = {}
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def key(gpu: GpuInfo) -> str:
        """A GPU's name in the history: its node and index (``"0"`` on a single machine)."""
        return f"{gpu.node}/{gpu.index}" if gpu.node else str(gpu.index)

    def record(self, gpus: list[GpuInfo], at: float | None = None) -> None:
        now = time.time() if at is None else at
        for gpu in gpus:
            readings = self._readings.setdefault(self.key(gpu), collections.deque(maxlen=self._keep))
            readings.append(Reading(now, gpu.utilization, gpu.memory_used))

    def get(self) -> dict[str, list[Reading]]:
        return {key: list(readings) for key, readings in self._readings.items()}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.record(await asyncio.to_thread(self._read))
            except Exception:  # a failed reading leaves a gap in the chart, not a dead sampler
                log.exception("reading the GPUs for their history failed")
            await asyncio.sleep(self.interval)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
