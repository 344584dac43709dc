"""Two hosts on one machine, a laptop and a GPU box, joined by a link with a round trip and a rate.

Each host is a network namespace (``ip netns add``) with one TUN interface; a forwarder process
(``python tests/_link.py``) holds both TUN devices and carries every IP packet from one to the
other after the one-way delay, no faster than the link's rate, dropping what overflows its queue.
This stands in for a veth pair with ``tc netem``: this machine's kernel has no netem qdisc
("Specified qdisc kind is unknown"). The addresses (10.77.N.1 for the laptop, 10.77.N.2 for the
box) exist only inside the two namespaces; nothing is routed anywhere else.

The MTU is 9000 bytes (jumbo frames, as between machines in one rack): a forwarder in Python moves
the 14,000 such packets a second of 1 Gbit/s, not the 83,000 of Ethernet's 1500. (At 64,000 bytes,
TCP's window often stalled at two segments, and a transfer ran at half the link's rate.)

Used by the tests (``tests/test_link.py``) and by ``bench/bench_link.py``. Needs root and ``ip``.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MTU = 9000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_QUEUE_BYTES = 1024 * 1024  # a switch port's buffer (8 ms at 1 Gbit/s): what waits beyond it is dropped


def missing() -> str:
    """Why no link can be made here ("" when one can)."""
    if os.geteuid() != 0:
        return "the two-host link needs root (network namespaces and TUN devices)"
    if shutil.which("ip") is None:
        return "the two-host link needs `ip` (apt-get install iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "the two-host link needs /dev/net/tun"
    return ""


@dataclass(frozen=True)
class Host:
    """One end of the link: a network namespace and its address in it."""

    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class Link:
    laptop: Host
    box: Host
    rtt: float  # seconds
    rate: float  # bytes a second, each way

    def describe(self) -> str:
        return f"{self.rtt * 1000:g} ms round trip, {self.rate * 8 / 1e9:g} Gbit/s each way (MTU {MTU})"


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")


@contextlib.contextmanager
def link(rtt: float = 0.002, gbits: float = 1.0) -> Iterator[Link]:
    """Make the two hosts and the link between them; remove them all on exit."""
    why = missing()
    if why:
        raise RuntimeError(why)
    tag = f"{os.getpid() % 100000}"
    net = 1 + os.getpid() % 250
    laptop = Host(f"gp-laptop-{tag}", f"10.77.{net}.1")
    box = Host(f"gp-box-{tag}", f"10.77.{net}.2")
    the_link = Link(laptop, box, rtt, gbits * 1e9 / 8)
    made: list[str] = []
    forwarder = None
    try:
        for host in (laptop, box):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        forwarder = subprocess.Popen(
            [sys.executable, __file__, laptop.namespace, box.namespace, str(rtt / 2), str(the_link.rate)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert forwarder.stdout is not None
        ready = forwarder.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the link's forwarder did not start: {ready or forwarder.wait()}")
        for host, peer in ((laptop, box), (box, laptop)):
            device = "gplink"
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/32", "peer", f"{peer.address}/32", "dev", device)
            _ip("-n", host.namespace, "link", "set", device, "mtu", str(MTU), "up")
        yield the_link
    finally:
        if forwarder is not None:
            forwarder.send_signal(signal.SIGTERM)
            try:
                forwarder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                forwarder.kill()
                forwarder.wait()
            if forwarder.stdout is not None:
                forwarder.stdout.close()
        for namespace in made:
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", namespace)


# ---- the forwarder (its own process) ---------------------------------------------------------------


def _open_tun(namespace: str) -> int:
    """A TUN device named ``gplink`` made in ``namespace`` (entered by this thread for the call)."""
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(there)
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", b"gplink", _IFF_TUN | _IFF_NO_PI))
        return fd
    finally:
        _setns(here)
        os.close(here)
        os.close(there)


def _setns(fd: int) -> None:
    """Move this thread into the network namespace ``fd`` (``os.setns`` is Python 3.12's)."""
    if hasattr(os, "setns"):
        os.setns(fd, os.CLONE_NEWNET)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "setns")


def _carry(source: int, sink: int, delay: float, rate: float) -> None:
    """One way of the link, in one thread of its own process: each packet read from ``source`` is
    written to ``sink`` ``delay`` seconds after it left a queue that drains at ``rate`` bytes a
    second. Due times only grow, so the queue is a FIFO."""
    os.set_blocking(source, False)
    due: collections.deque[tuple[float, bytes]] = collections.deque()
    queued = 0
    free_at = 0.0  # when the wire is free again
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        readable, _, _ = select.select([source], [], [], wait)
        if readable:
            now = time.monotonic()
            while True:
                try:
                    packet = os.read(source, MTU + 64)
                except BlockingIOError:
                    break
                if queued + len(packet) > _QUEUE_BYTES:
                    continue  # the queue is full: dropped, as a switch would
                free_at = max(free_at, now) + len(packet) / rate
                due.append((free_at + delay, packet))
                queued += len(packet)
        now = time.monotonic()
        while due and due[0][0] <= now:
            packet = due.popleft()[1]
            queued -= len(packet)
            with contextlib.suppress(OSError):
                os.write(sink, packet)


def _forward(laptop: str, box: str, delay: float, rate: float) -> None:
    """Carry both ways, each in a process of its own (no lock shared between the two directions)."""
    ends = _open_tun(laptop), _open_tun(box)
    child = os.fork()
    if child == 0:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the parent
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        _carry(ends[1], ends[0], delay, rate)
    threading.Thread(target=_carry, args=(*ends, delay, rate), daemon=True).start()
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    _forward(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
