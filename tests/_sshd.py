"""A throwaway OpenSSH server on 127.0.0.1 for the ssh:// tests: its own host key, one client key
authorized, no passwords; and a client config (``ssh -F CONFIG gpubox``) that reaches it."""

from __future__ import annotations

import contextlib
import getpass
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

if TYPE_CHECKING:
    from tests._link import Host


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(address: str, port: int, host: Host | None) -> bool:
    if host is None:
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
            return True
        return False
    probe = host.command(["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"])
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


@contextlib.contextmanager
def sshd(folder: Path, host: Host | None = None) -> Iterator[Path]:
    """Run sshd on a free loopback port (or on port 22 of ``host``, a test host of ``tests/_link.py``);
    yields the path of an ssh client config naming it ``gpubox``."""
    binary = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)
    if binary is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("openssh-server is not installed: apt-get install openssh-server (make test installs it as root)")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True, timeout=30
        )
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    (folder / "authorized_keys").chmod(0o600)
    address, port = (host.address, 22) if host else ("127.0.0.1", _free_port())
    config = folder / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {folder / 'host_key'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPidFile {folder / 'sshd.pid'}\n"
        "StrictModes no\nPermitRootLogin prohibit-password\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nAllowTcpForwarding yes\nLogLevel ERROR\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    argv = [binary, "-D", "-e", "-f", str(config)]
    process = subprocess.Popen(host.command(argv) if host else argv, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            if _listening(address, port, host):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                said = process.stderr.read() if process.stderr and process.poll() is not None else ""
                pytest.fail(f"sshd did not start: {said}")
            time.sleep(0.05)
        client = folder / "ssh_config"
        client.write_text(
            f"Host gpubox\n  HostName {address}\n  Port {port}\n  User {getpass.getuser()}\n"
            f"  IdentityFile {folder / 'client_key'}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        )
        yield client
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        if process.poll() is None:
            process.kill()
        if process.stderr is not None:
            process.stderr.close()


def end_processes_of(state: Path) -> None:
    """End the server --start made (and what it runs), found by its state dir: processes we started."""
    found = [p for p in psutil.process_iter(["cmdline"]) if str(state) in " ".join(p.info["cmdline"] or [])]
    for process in found:
        with contextlib.suppress(psutil.Error):
            for child in process.children(recursive=True):
                child.kill()
            process.terminate()
    psutil.wait_procs(found, timeout=10)
