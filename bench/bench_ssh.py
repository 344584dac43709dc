"""`gpuport status` as a whole command through an ssh:// route against the same command direct.

    .venv/bin/python bench/bench_ssh.py [--runs 20]       # needs Debian's openssh-server (sshd)

A real sshd on 127.0.0.1 (throwaway keys, tests/_sshd.py), one gpuport server on 127.0.0.1, and
three profiles of it: https:// (the anchor), ssh:// with a new ssh connection per command, and
ssh:// with OpenSSH's connection sharing (ControlMaster auto, ControlPersist), which the README
recommends. Each is `gpuport --profile P status` as a whole process, runs rotated, median of N.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _report  # noqa: E402
from _report import ROWS, Row, median, say  # noqa: E402


def _command(profile: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gpuport", "--profile", profile, "status"], capture_output=True, text=True, env=env
    )
    elapsed = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"gpuport --profile {profile} status failed: {done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    if not (shutil.which("sshd") or Path("/usr/sbin/sshd").exists()):
        say("sshd not found: the ssh:// figures are skipped (apt-get install openssh-server)")
        return
    from tests._sshd import sshd

    _report.banner(subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip(), quick=False)
    with (
        _report.isolated_workdir() as work,
        _report.gpuport_server(work, "server") as server,
        sshd(work / "ssh") as config,
    ):
        shared = work / "ssh" / "ssh_config_shared"
        shared.write_text(
            config.read_text() + f"  ControlMaster auto\n  ControlPath {work / 'ssh'}/cm-%C\n  ControlPersist 60\n"
        )
        try:
            port = int(server.url.rsplit(":", 1)[1])
            # Each command in its own process (no CLI helper): what the route costs, start included.
            alone = {**os.environ, "GPUPORT_AGENT": "0"}
            envs = {
                "direct": alone,
                "ssh": {**alone, "GPUPORT_SSH": f"ssh -F {config}"},
                "ssh-shared": {**alone, "GPUPORT_SSH": f"ssh -F {shared}"},
            }
            urls = {"direct": server.url, "ssh": f"ssh://gpubox?port={port}", "ssh-shared": f"ssh://gpubox?port={port}"}
            for profile, url in urls.items():
                login = [sys.executable, "-m", "gpuport", "login", url, "--token", server.token]
                login += ["--fingerprint", server.fingerprint, "--profile", profile]
                done = subprocess.run(login, capture_output=True, text=True, env=envs[profile])
                if done.returncode:
                    raise SystemExit(f"gpuport login {url} failed: {done.stderr}")
            _command("ssh-shared", envs["ssh-shared"])  # the shared connection's first login
            times = _report.rotate(args.runs, {p: (lambda p=p: _command(p, envs[p])) for p in urls})
            direct = median(times["direct"])
            for profile, label in (("ssh", "a new ssh login each"), ("ssh-shared", "ControlMaster")):
                ROWS.append(
                    Row(
                        f"gpuport status via ssh:// ({label})",
                        median(times[profile]),
                        direct,
                        "https:// direct",
                        "-",
                        None,
                    )
                )
        finally:  # the shared master connection, which outlives its ssh commands
            subprocess.run(["ssh", "-F", str(shared), "-O", "exit", "gpubox"], capture_output=True)
    _report.print_table(
        ["gpuport status via ssh:// (a new", "gpuport status via ssh:// (Control"],
        48,
        f"ratio: through ssh / direct, whole `gpuport status` processes, median of {args.runs}",
    )


if __name__ == "__main__":
    main()
