"""The GPUs' recent past, for the dashboard's charts: utilization and memory of each GPU, read every
``interval`` seconds and kept for ``span`` seconds (an hour by default), so memory stays bounded.

With a ``path`` the readings are also kept in that file (JSON, rewritten atomically after each
reading, as bounded as the readings themselves), so that a server restart does not blank the charts:
a new server reads it back, without what is older than ``span``."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuport._files import atomic_write
from gpuport.server.inventory import GpuInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    at: float  # seconds since the epoch
    utilization: int | None  # percent
    memory_used: int


class GpuHistory:
    def __init__(
        self,
        read: Callable[[], list[GpuInfo]],
        interval: float = 10.0,
        span: float = 3600.0,
        path: Path | None = None,
    ) -> None:
        self._read = read
        self.interval = interval
        self.span = span
        self.path = path
        self._keep = max(2, int(span / interval) + 1)
        self._readings: dict[str, collections.deque[Reading]] = {}
        self._task: asyncio.Task[None] | None = None
        if path is not None:
            self._load(path)

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

    def _load(self, path: Path) -> None:
        """The readings a previous run kept, but those older than the span; a file that cannot be
        read (missing, or cut by a crash of an older version) is an empty history, said in the log."""
        try:
            kept = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("the GPUs' history in %s cannot be read (%s): the charts start empty", path, e)
            return
        since = time.time() - self.span
        try:
            for key, rows in kept["gpus"].items():
                readings = collections.deque(
                    (Reading(float(at), None if u is None else int(u), int(m)) for at, u, m in rows if at >= since),
                    maxlen=self._keep,
                )
                if readings:
                    self._readings[str(key)] = readings
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._readings.clear()
            log.warning("the GPUs' history in %s is malformed (%s): the charts start empty", path, e)

    def _dump(self) -> bytes:
        gpus = {key: [[r.at, r.utilization, r.memory_used] for r in rows] for key, rows in self._readings.items()}
        return json.dumps({"gpus": gpus}, separators=(",", ":")).encode()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.record(await asyncio.to_thread(self._read))
                if self.path is not None:  # dumped here, on the loop that records; written in a thread
                    await asyncio.to_thread(atomic_write, self.path, self._dump(), durable=False)
            except Exception:  # a failed reading leaves a gap in the chart, not a dead sampler
                log.exception("reading the GPUs for their history (or keeping it) failed")
            await asyncio.sleep(self.interval)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
