"""The systemd unit that runs ``gpuport server`` as a service on a shared GPU machine.

``gpuport server [OPTIONS] --print-systemd-unit`` prints it, with the same options, this Python
environment's interpreter and the state dir the unit manages (``/var/lib/gpuport`` unless given).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# Made by systemd's StateDirectory= (0700, root's).
DEFAULT_SERVICE_STATE_DIR = Path("/var/lib/gpuport/state")

_UNIT = """\
# gpuport server as a systemd service. Install it (as root) with:
#   {print_command} > /etc/systemd/system/gpuport.service
#   systemctl daemon-reload && systemctl enable --now gpuport
#   journalctl -u gpuport          # the URL, fingerprint and (first start only) the admin token
# The server runs as root so that each user's jobs run as a uid of their own (--job-uids), in a
# sandbox (bubblewrap: apt-get install bubblewrap slirp4netns); the Python environment it runs,
# {prefix}, is shown to jobs read-only.
[Unit]
Description=gpuport server: GPU over IP for Python deep learning
Documentation=https://github.com/gpuport/gpuport#readme
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
User=root
ExecStart={exec_start}
{state_directory}Environment=PYTHONUNBUFFERED=1
# Jobs and sessions run detached (their own process session, a supervisor writing their log and exit
# status), so that a restart of the daemon does not end them: stop only the daemon itself.
KillMode=process
# The unit's cgroup is the server's to manage: on cgroup v2, each job gets a group of its own below
# it, held to its memory and processes (gpuport/server/cgroups.py), and the server runs in server/
# (DelegateSubgroup, systemd 254 and later; with an older one, jobs on cgroup v2 get no group).
Delegate=yes
{delegate_subgroup}TimeoutStopSec=30
Restart=on-failure
RestartSec=5
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""


def _systemd_version() -> int:
    """This machine's systemd version (``systemctl --version``); a large number when unknown (a unit
    printed for another machine: the keys of a current systemd)."""
    try:
        done = subprocess.run(["systemctl", "--version"], capture_output=True, text=True, timeout=10, check=False)
        return int(done.stdout.split()[1])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return 1 << 16


def systemd_unit(server_args: list[str], state_dir: Path | None) -> str:
    """The unit's text: ``gpuport server SERVER_ARGS --state-dir STATE_DIR`` run by this interpreter.

    ``server_args`` are the server's options as given, without ``--state-dir`` (added here) and
    without ``--print-systemd-unit``. The folder under /var/lib that holds the state dir is made
    by systemd (mode 0700); a state dir elsewhere is made by the server.
    """
    given = ["--state-dir", str(state_dir)] if state_dir else []
    state_dir = (state_dir or DEFAULT_SERVICE_STATE_DIR).absolute()
    interpreter = os.path.abspath(sys.executable)  # not resolved: a venv's python is a symlink out of it
    command = [interpreter, "-m", "gpuport", "server", *server_args, "--state-dir", str(state_dir)]
    var_lib = Path("/var/lib")
    managed = state_dir.is_relative_to(var_lib) and state_dir != var_lib
    top = state_dir.relative_to(var_lib).parts[0] if managed else ""
    state_directory = f"StateDirectory={top}\nStateDirectoryMode=0700\n" if managed else ""
    return _UNIT.format(
        delegate_subgroup="DelegateSubgroup=server\n" if _systemd_version() >= 254 else "",
        prefix=sys.prefix,
        print_command=shlex.join(["gpuport", "server", *server_args, *given, "--print-systemd-unit"]),
        exec_start=shlex.join(command),
        state_directory=state_directory,
    )
