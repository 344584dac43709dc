"""A real 2-node Ray cluster on this machine, for the scale-out tests and benchmarks.

Each node is a `ray start --block` in its own session, with its own loopback address (127.0.0.2,
127.0.0.3: Ray replaces 127.0.0.1 by the machine's network address, so it is not used), its own
temp dir, 2 fake GPUs (the fake inventory, per node), little object store memory and no
dashboard, and Ray's token authentication. Ended by killing each node's processes by pid: never
`ray stop`, which would end every Ray process on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
NODE_START_TIMEOUT = 90.0


@dataclass
class RayNode:
    name: str
    address: str  # its IP address
    process: subprocess.Popen[bytes]
    root: Path  # its temp dir; the gpuport agent's folder is root / "gpuport"

    def processes(self) -> list[psutil.Process]:
        """`ray start` and everything below it (the raylet, its workers, their jobs)."""
        try:
            top = psutil.Process(self.process.pid)
            return [top, *top.children(recursive=True)]
        except psutil.Error:
            return []

    def running(self, word: str) -> list[psutil.Process]:
        """Its processes whose command line has ``word`` (those ending meanwhile left out)."""
        found = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):  # ended, or a zombie until its parent reaps it
                if word in " ".join(p.cmdline()):
                    found.append(p)
        return found

    def raylet(self) -> psutil.Process:
        return next(p for p in self.processes() if p.name() == "raylet")

    def kill(self) -> None:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


@dataclass
class RayCluster:
    address: str  # the head's GCS, host:port
    token: str  # "": a cluster without authentication (what gpuport must refuse)
    base: Path
    nodes: list[RayNode] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GPUPORT_"))}
        env.update(RAY_USAGE_STATS_ENABLED="0", **extra)
        if self.token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        else:
            env.update(RAY_AUTH_MODE="disabled")
        return env

    def start_node(self, name: str, address: str, *, head: bool = False, gpus: str = "2x16GiB") -> RayNode:
        root = self.base / name
        root.mkdir(parents=True, exist_ok=True)
        count = sum(int(part.split("x")[0]) if "x" in part else 1 for part in gpus.split(",")) if gpus else 0
        args = [RAY, "start", "--block", "--node-ip-address", address, "--node-name", name]
        args += ["--num-cpus", "2", "--num-gpus", str(count), "--object-store-memory", str(80 << 20)]
        args += ["--disable-usage-stats", "--temp-dir", str(root)]
        if head:
            args += ["--head", "--port", "0", "--include-dashboard", "false"]
        else:
            args += ["--address", self.address]
        env = self.env(GPUPORT_FAKE_GPUS=gpus) if gpus else self.env()
        log = open(root / "ray-start.log", "ab")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        node = RayNode(name, address, process, root)
        self.nodes.append(node)
        return node

    def wait_ready(self, node: RayNode) -> None:
        deadline = time.monotonic() + NODE_START_TIMEOUT
        log = node.root / "ray-start.log"
        while time.monotonic() < deadline:
            if node.process.poll() is not None:
                raise RuntimeError(f"ray start of {node.name} ended:\n{log.read_text()[-3000:]}")
            if "Ray runtime started" in log.read_text(errors="replace"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"ray start of {node.name} not ready in {NODE_START_TIMEOUT}s:\n{log.read_text()[-3000:]}")

    def join(self, name: str, address: str, *, tries: int = 3) -> RayNode:
        """A node other than the head, started and ready; started again when its ``ray start`` gave up:
        Ray waits a fixed 30 s for a new raylet to register with the head, which a machine loaded many
        times over (a full test run beside others) has exceeded."""
        while True:
            node = self.start_node(name, address)
            try:
                self.wait_ready(node)
                return node
            except RuntimeError:
                node.kill()
                self.nodes.remove(node)
                tries -= 1
                if not tries:
                    raise

    def close(self) -> None:
        for node in reversed(self.nodes):
            node.kill()


def _read_when_written(path: Path) -> str:
    """Ray writes the head's address after it prints that it started (a CI run read it first once)."""
    deadline = time.monotonic() + NODE_START_TIMEOUT
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if text := path.read_text().strip():
                return text
        time.sleep(0.1)
    raise RuntimeError(f"ray start did not write {path} in {NODE_START_TIMEOUT}s")


def start_cluster(
    base: Path, names: tuple[str, ...] = ("node-a", "node-b"), *, authenticated: bool = True
) -> RayCluster:
    """A head and more nodes, each with 2 fake GPUs; ready when this returns."""
    cluster = RayCluster("", secrets.token_hex(16) if authenticated else "", base)
    try:
        head = cluster.start_node(names[0], "127.0.0.2", head=True)
        cluster.wait_ready(head)
        cluster.address = _read_when_written(head.root / "ray_current_cluster")
        for i, name in enumerate(names[1:]):
            cluster.join(name, f"127.0.0.{3 + i}")
    except BaseException:
        cluster.close()
        raise
    return cluster
