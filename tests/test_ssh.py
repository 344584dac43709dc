"""ssh:// : a server reached through SSH port forwarding, the box's SSH port the only one used.

A real sshd on loopback (Debian's openssh-server, throwaway keys), the system's ssh client with a
config file of the test's (``GPUPORT_SSH="ssh -F ..."``), and a real gpuport server that
``gpuport login ssh://... --start`` starts on the "box" itself, listening on its loopback only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpuport
from tests._sshd import end_processes_of, sshd
from tests.conftest import needs_users, restartable_ports


def _servers_of(state: Path) -> set[int]:
    """The pids of the gpuport servers running on ``state``."""
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if str(state) in line and "gpuport server" in line:
            found.add(process.pid)
    return found


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """An sshd to reach the "box" through, and where a server started there keeps its state."""
    with sshd(tmp_path / "ssh") as config:
        monkeypatch.setenv("GPUPORT_SSH", f"ssh -F {config}")
        state = tmp_path / "box-state"
        try:
            yield {"config": config, "state": state, "port": restartable_ports(4)}
        finally:
            end_processes_of(state)


def test_login_start_and_work_through_ssh_only(box: dict[str, Any], cli: Any, tmp_path: Path) -> None:
    needs_users()
    port, state = box["port"], box["state"]
    url = f"ssh://gpubox?port={port}"
    server = f"{sys.executable} -m gpuport server --state-dir {state}"
    done = cli("login", url, "--start", server, "--yes")
    assert done.code == 0, done.stderr
    assert f"Logged in to {url} as admin" in done.stdout

    # Every command goes through the tunnel; the profile keeps the route.
    status = cli("status")
    assert status.code == 0 and status.stdout.startswith(f"{url}  gpuport "), status.stdout + status.stderr
    project = tmp_path / "project"
    project.mkdir()
    (project / "hello.py").write_text("print('hello through ssh', 6 * 7)\n")
    ran = cli("run", "--", "python", "hello.py", cwd=project)
    assert ran.code == 0 and "hello through ssh 42" in ran.stdout, ran.stdout + ran.stderr

    # A session's large value goes through the forwarded data port, not gRPC (which would warn).
    with gpuport.connect() as gpu:
        assert gpu.url == url
        with gpu.session() as s, warnings.catch_warnings():
            warnings.simplefilter("error")
            big = bytes(range(256)) * (32 * 1024)  # 8 MiB: past the 4 MiB that go through gRPC
            ref = s.put(big)
            assert s.get(ref) == big and s.call(len, ref) == len(big)

    # A second login with --start finds the server running and starts no other.
    servers = _servers_of(state)
    token = json.loads((tmp_path / "config" / "config.json").read_text())["profiles"]["default"]["token"]
    again = cli("login", url, "--start", server, "--token", token, "--yes", "--profile", "second")
    assert again.code == 0, again.stderr
    assert _servers_of(state) == servers


def test_ssh_that_cannot_log_in_says_so(box: dict[str, Any], cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPORT_SSH", f"ssh -F {box['config']} -o IdentityFile=/nonexistent -o IdentitiesOnly=yes")
    (box["config"].parent / "client_key").unlink()  # no key that the box takes
    done = cli("login", f"ssh://gpubox?port={box['port']}", "--token", "gp_x", "--yes")
    assert done.code == 1
    assert "ssh to ssh://gpubox" in done.stderr and "gpuport asks for no password" in done.stderr


def test_nothing_listening_on_the_box_is_a_clear_error(box: dict[str, Any], cli: Any) -> None:
    done = cli("login", f"ssh://gpubox?port={box['port']}", "--token", "gp_x", "--yes")
    assert done.code == 1 and "ssh://gpubox" in done.stderr, done.stderr


def test_with_ssh_connection_sharing(
    box: dict[str, Any], cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ControlMaster auto / ControlPersist (as the README suggests): the first ssh becomes the master
    and exits; later commands' forwards are the master's, and are taken back when they end."""
    needs_users()
    config = box["config"]
    shared = config.with_name("ssh_config_shared")
    control = Path(tempfile.mkdtemp(prefix="cm", dir="/tmp"))  # a socket's path: short, under 108 bytes
    shared.write_text(config.read_text() + f"  ControlMaster auto\n  ControlPath {control}/%C\n  ControlPersist 30\n")
    monkeypatch.setenv("GPUPORT_SSH", f"ssh -F {shared}")
    url = f"ssh://gpubox?port={box['port']}"
    server = f"{sys.executable} -m gpuport server --state-dir {box['state']}"
    try:
        assert cli("login", url, "--start", server, "--yes").code == 0
        for _ in range(2):
            status = cli("status")
            assert status.code == 0 and status.stdout.startswith(f"{url}  gpuport "), status.stderr
    finally:
        subprocess.run(["ssh", "-F", str(shared), "-O", "exit", "gpubox"], capture_output=True, timeout=30)
        shutil.rmtree(control, ignore_errors=True)
