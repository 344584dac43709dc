"""``ssh://``: a server reached through SSH port forwarding, for a box whose only open port is SSH's.

``gpuport login ssh://user@gpubox[:22]`` keeps the route in the profile. Each process that connects
starts the system's ``ssh`` (its config, keys and agent; ``GPUPORT_SSH`` replaces the command, e.g.
``ssh -F ~/.ssh/lab_config``) with two local forwards, on loopback ports chosen here: one to the
server's gRPC port on the box's loopback (7600 unless the URL says ``?port=N``) and one to its data
port (the gRPC port + 2). TLS still runs end to end, with the pinned certificate: SSH only carries
it. The ``ssh`` process ends with the client's process.

``--start`` (``start_server``) runs ``gpuport server --host 127.0.0.1`` on the box, detached, when
nothing answers there, and reads its first admin token from its log when none was given.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from gpuport.defaults import DEFAULT_GRPC_PORT
from gpuport.protocol.errors import ConfigError, ServerUnreachable

ENV_SSH = "GPUPORT_SSH"
_READY_TIMEOUT = 30.0  # seconds for ssh to log in and listen
# Where --start leaves the server's output on the box (its first start prints the admin token).
REMOTE_LOG = ".gpuport-server.log"


@dataclass(frozen=True)
class SshRoute:
    user: str
    host: str
    ssh_port: int | None
    remote_port: int  # the server's gRPC port on the box's loopback

    @property
    def url(self) -> str:
        who = f"{self.user}@" if self.user else ""
        where = f"{self.host}:{self.ssh_port}" if self.ssh_port else self.host
        port = f"?port={self.remote_port}" if self.remote_port != DEFAULT_GRPC_PORT else ""
        return f"ssh://{who}{where}{port}"

    def command(self, *remote: str, options: Sequence[str] = ()) -> list[str]:
        """``ssh`` (or ``GPUPORT_SSH``) with ``options`` to the box, running ``remote`` there (if any)."""
        base = shlex.split(os.environ.get(ENV_SSH, "ssh"))
        fixed = ["-o", "BatchMode=yes", "-o", "ServerAliveInterval=15"]
        fixed += ["-p", str(self.ssh_port)] if self.ssh_port else []
        return [*base, *fixed, *options, f"{self.user}@{self.host}" if self.user else self.host, *remote]


def parse_ssh_url(url: str) -> SshRoute:
    """Read ``ssh://[user@]host[:ssh port][?port=gRPC port]``. Raises ``ConfigError``."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ConfigError(f"server URL {url!r} names no host — write it like ssh://me@gpubox")
    if parts.path not in ("", "/"):
        raise ConfigError(f"server URL {url!r} has a path; write ssh://[user@]host[:port][?port=GRPC_PORT]")
    try:
        ssh_port = parts.port
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
        remote = int(query.pop("port", [str(DEFAULT_GRPC_PORT)])[0])
    except ValueError:
        raise ConfigError(f"server URL {url!r} has an invalid port — use numbers from 1 to 65535") from None
    if query:
        raise ConfigError(f"server URL {url!r}: unknown option {sorted(query)[0]!r} (only ?port=N is taken)")
    if not 0 < remote < 65536:
        raise ConfigError(f"server URL {url!r}: the gRPC port {remote} is not a port")
    return SshRoute(parts.username or "", parts.hostname, ssh_port, remote)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Tunnel:
    """An ``ssh -N`` process forwarding two loopback ports here to the box's gRPC and data ports."""

    def __init__(self, route: SshRoute) -> None:
        self.route = route
        self.grpc_port, self.data_port = _free_port(), _free_port()
        self.remote_data_port = route.remote_port + 2
        self.forwards = [
            "-L",
            f"127.0.0.1:{self.grpc_port}:127.0.0.1:{route.remote_port}",
            "-L",
            f"127.0.0.1:{self.data_port}:127.0.0.1:{self.remote_data_port}",
        ]
        command = route.command(options=["-N", "-T", "-o", "ExitOnForwardFailure=yes", *self.forwards])
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        except OSError as e:
            raise ServerUnreachable(f"cannot run {command[0]!r} for {route.url}: {e.strerror or e}") from None
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1):
                return
            # An ssh that shares a connection (ControlMaster) hands the forwards to its master and
            # exits 0: the master listens for us then.
            if self.process.poll() is not None and self.process.returncode != 0:
                said = (self.process.stderr.read() if self.process.stderr else b"").decode(errors="replace")
                raise ServerUnreachable(
                    f"ssh to {self.route.url} failed (exit code {self.process.returncode}): {said.strip()[-500:]} "
                    f"— check that `{shlex.join(self.route.command('true'))}` works (keys in your agent or "
                    "~/.ssh/config; gpuport asks for no password)"
                )
            time.sleep(0.05)
        self.close()
        raise ServerUnreachable(f"ssh to {self.route.url} did not set up its forwarding in {_READY_TIMEOUT:g} s")

    def local_port(self, remote_port: int) -> int | None:
        """The local end of the forward to ``remote_port`` on the box, or None when none goes there."""
        return {self.route.remote_port: self.grpc_port, self.remote_data_port: self.data_port}.get(remote_port)

    def close(self) -> None:
        if self.process.poll() == 0:  # the forwards are a shared master's: take them back from it
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                cancel = self.route.command(options=["-O", "cancel", *self.forwards])
                subprocess.run(cancel, capture_output=True, timeout=10)
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        if self.process.poll() is None:
            self.process.kill()
        if self.process.stderr:
            self.process.stderr.close()


_tunnels: dict[SshRoute, Tunnel] = {}
_lock = threading.Lock()


def tunnel(route: SshRoute) -> Tunnel:
    """This process's tunnel for ``route``, started on first use and ended when the process ends."""
    with _lock:
        found = _tunnels.get(route)
        if found is not None and found.process.poll() is None:
            return found
        made = _tunnels[route] = Tunnel(route)
        return made


@atexit.register
def _close_all() -> None:
    for made in list(_tunnels.values()):
        made.close()
    _tunnels.clear()


def start_server(route: SshRoute, server_command: str, timeout: float = 60.0) -> str | None:
    """Start ``server_command`` (``gpuport server``) on the box on its loopback at the route's port,
    detached, with its output in ``~/.gpuport-server.log``; wait until it is ready. Returns the admin
    token its first start printed, or None when it printed none (a state dir made before)."""
    port = route.remote_port
    remote = (
        f"nohup {server_command} --host 127.0.0.1 --port {port} --http-port {port + 1} "
        f"> {REMOTE_LOG} 2>&1 < /dev/null & echo started"
    )
    done = subprocess.run(route.command(remote), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or "started" not in done.stdout:
        raise ServerUnreachable(
            f"could not start `{server_command}` on {route.url}: {(done.stderr or done.stdout).strip()[-500:]}"
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = subprocess.run(route.command(f"cat {REMOTE_LOG}"), capture_output=True, text=True, timeout=timeout)
        if re.search(r"^ready$", log.stdout, re.MULTILINE):
            token = re.search(r"^  admin token  (\S+)", log.stdout, re.MULTILINE)
            return token[1] if token else None
        if "Error" in log.stdout and "Traceback" in log.stdout or re.search(r"^Error: ", log.stdout, re.MULTILINE):
            raise ServerUnreachable(f"`{server_command}` on {route.url} did not start:\n{log.stdout.strip()[-1500:]}")
        time.sleep(0.3)
    raise ServerUnreachable(f"`{server_command}` on {route.url} was not ready in {timeout:g} s (see ~/{REMOTE_LOG})")
