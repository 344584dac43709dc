"""The GPU inventory: what GPUs this machine has, read live.

Three kinds behind one interface: ``NvmlInventory`` (real NVIDIA GPUs through NVML),
``FakeInventory`` (``GPUPORT_FAKE_GPUS=2x16GiB``, for tests and demos on machines without a GPU)
and ``CpuInventory`` (no GPU: jobs run on the CPU). ``detect_inventory`` picks one.
"""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from gpuport._files import read_small_beneath
from gpuport._packages import missing_package
from gpuport.defaults import DEFAULT_MEMORY_FLOOR_FRACTION, DEFAULT_MEMORY_FLOOR_MAX, ENV_FAKE_GPUS
from gpuport.protocol.errors import ConfigError, InvalidRequest
from gpuport.protocol.units import parse_size

log = logging.getLogger(__name__)


@dataclass
class GpuProcess:
    pid: int
    memory_used: int
    job_id: str = ""


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization: int | None  # percent, None when unknown
    power: float | None = None  # watts drawn, None when unknown
    temperature: int | None = None  # degrees C, None when unknown
    processes: list[GpuProcess] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    node: str = ""  # the node it is on, set by the executor that read it


class Inventory(ABC):
    """A source of live GPU readings."""

    kind: str
    note: str = ""  # said when there are no GPUs, to tell the user why

    @abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """Read every GPU now."""

    def close(self) -> None:
        """Release what the inventory holds."""


class CpuInventory(Inventory):
    kind = "cpu"

    def __init__(self, note: str) -> None:
        self.note = note

    def gpus(self) -> list[GpuInfo]:
        return []


class FakeInventory(Inventory):
    """GPUs that exist only on paper, with the sizes given.

    A process "uses" fake GPU memory by writing ``GPU_INDEX BYTES`` to a file named by its pid in
    ``usage_dir`` (jobs find it in ``$GPUPORT_FAKE_GPU_DIR``): the inventory reports it as NVML
    would report a real process, so the watchdog and ``gpuport gpus`` can be tested without a GPU.
    """

    kind = "fake"

    def __init__(self, sizes: list[int]) -> None:
        self._sizes = sizes
        self.usage_dir: Path | None = None  # set by the server: a folder of its state dir

    @classmethod
    def parse(cls, spec: str) -> FakeInventory:
        """``"2x16GiB"``, ``"16GiB,24GiB"`` or ``"1x80GiB,2x16GiB"``."""
        sizes: list[int] = []
        for part in spec.split(","):
            match = re.fullmatch(r"\s*(?:(\d+)\s*[xX]\s*)?(\S+)\s*", part)
            try:
                if not match:
                    raise InvalidRequest(part)
                count = int(match.group(1) or 1)
                size = parse_size(match.group(2))
            except InvalidRequest:
                raise ConfigError(
                    f"{ENV_FAKE_GPUS}={spec!r} is not a GPU list — write it like 2x16GiB or 16GiB,24GiB"
                ) from None
            sizes += [size] * count
        return cls(sizes)

    def gpus(self) -> list[GpuInfo]:
        gpus = [
            GpuInfo(index=i, uuid=f"GPU-fake-{i}", name="Fake GPU", memory_total=size, memory_used=0, utilization=0)
            for i, size in enumerate(self._sizes)
        ]
        for pid, index, used in self._declared():
            if 0 <= index < len(gpus):
                gpus[index].processes.append(GpuProcess(pid, used))
                gpus[index].memory_used += used
        return gpus

    def _declared(self) -> list[tuple[int, int, int]]:
        """(pid, GPU index, bytes) declared by live processes; files of ended ones are removed."""
        if self.usage_dir is None or not self.usage_dir.is_dir():
            return []
        declared = []
        for file in self.usage_dir.iterdir():
            if file.is_dir():  # a sandboxed job's, whose files are named by pids of its own namespace
                declared += _declared_in_sandbox(file)
                continue
            try:
                pid = int(file.name)
                os.kill(pid, 0)
                index, used = map(int, (read_small_beneath(self.usage_dir, file.name, 256) or b"").split())
            except ProcessLookupError:
                file.unlink(missing_ok=True)
                continue
            except (ValueError, OSError):
                continue  # not one of ours, or half written
            declared.append((pid, index, used))
        return declared


def _declared_in_sandbox(folder: Path) -> list[tuple[int, int, int]]:
    """(host pid, GPU index, bytes) declared in a sandboxed job's folder: its supervisor wrote the
    job's pid namespace to ``.pidns``, where each process's NSpid maps its inner pid to the host's."""
    # The folder is the job's to write: no file there is read through a link, nor waited on (a FIFO).
    try:
        namespace = (read_small_beneath(folder, ".pidns", 256) or b"").decode()
    except (OSError, UnicodeDecodeError):
        return []
    if not namespace:
        return []
    hosts = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.readlink(proc / "ns" / "pid") != namespace:
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    hosts[int(line.split()[-1])] = int(proc.name)
        except (OSError, ValueError):
            continue  # ended meanwhile
    declared = []
    try:
        files = list(folder.iterdir())
    except OSError:  # the job ended and its folder went meanwhile
        return []
    for file in files:
        try:
            host = hosts[int(file.name)]
            index, used = map(int, (read_small_beneath(folder, file.name, 256) or b"").split())
        except (KeyError, ValueError, OSError):
            continue  # a dotfile, a process that ended, a file half written
        declared.append((host, index, used))
    return declared


class NvmlInventory(Inventory):
    kind = "nvml"

    def __init__(self, nvml) -> None:  # type: ignore[no-untyped-def]
        self._nvml = nvml

    def gpus(self) -> list[GpuInfo]:
        nvml = self._nvml
        out = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization: int | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except nvml.NVMLError:
                utilization = None
            try:
                power: float | None = nvml.nvmlDeviceGetPowerUsage(handle) / 1000  # milliwatts
            except nvml.NVMLError:
                power = None
            try:
                temperature: int | None = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            except nvml.NVMLError:
                temperature = None
            try:
                running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError:
                running = []
            name = nvml.nvmlDeviceGetName(handle)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            out.append(
                GpuInfo(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    name=name.decode() if isinstance(name, bytes) else name,
                    memory_total=int(memory.total),
                    memory_used=int(memory.used),
                    utilization=utilization,
                    power=power,
                    temperature=temperature,
                    processes=[GpuProcess(p.pid, int(p.usedGpuMemory or 0)) for p in running],
                )
            )
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def detect_inventory() -> Inventory:
    """``GPUPORT_FAKE_GPUS`` if set; else NVML if it finds GPUs; else the CPU, saying why."""
    fake = os.environ.get(ENV_FAKE_GPUS)
    if fake:
        return FakeInventory.parse(fake)
    try:
        import pynvml
    except ImportError as e:
        return CpuInventory(f"no GPU support: {missing_package(e, 'reading the GPUs')}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return CpuInventory(f"no NVIDIA GPU found (NVML: {e}); jobs run on the CPU")
    if pynvml.nvmlDeviceGetCount() == 0:
        pynvml.nvmlShutdown()
        return CpuInventory("NVML found no GPU; jobs run on the CPU")
    return NvmlInventory(pynvml)


def memory_floor(setting: int | None = None) -> int:
    """The memory floor in bytes: ``setting``, or by default 5% of the machine's memory, at most 2 GiB."""
    if setting is not None:
        return setting
    import psutil

    total = psutil.virtual_memory().total
    return min(int(total * DEFAULT_MEMORY_FLOOR_FRACTION), DEFAULT_MEMORY_FLOOR_MAX)
