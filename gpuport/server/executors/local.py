"""The local executor: each job runs under ``worker/supervisor.py`` on this machine, in its own session.

A thread per running job waits for its end: on the supervisor process for jobs this server
started, on the supervisor's lock for jobs it found running after a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import marshal
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from gpuport._files import atomic_write
from gpuport.server.executors.base import Executor, Launch, OnExit
from gpuport.server.worker import supervisor

log = logging.getLogger(__name__)

_SUPERVISOR = [sys.executable, "-I", "-S", supervisor.__file__]


class LocalExecutor(Executor):
    def __init__(self) -> None:
        self._processes: dict[Path, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def start(self, launch: Launch, on_exit: OnExit) -> None:
        spec = {
            "argv": launch.argv,
            "cwd": str(launch.cwd),
            "env": launch.env,
            "grace": launch.grace,
            "time_limit": launch.time_limit,
            "nprocs": launch.nprocs,
            "tf_roles": launch.tf_roles,
            "rank_gpus": launch.rank_gpus,
            "sandbox": launch.sandbox,
            "network": launch.network,
            "pidns_file": launch.pidns_file,
        }
        # Not fsynced: a machine that crashes takes the job's processes with it anyway.
        # In marshal: the supervisor reads it without importing json (see its imports).
        atomic_write(launch.job_dir / "spec.marshal", marshal.dumps(spec), 0o600, durable=False)
        with open(launch.job_dir / "supervisor.log", "ab") as out:
            process = subprocess.Popen(
                [*_SUPERVISOR, str(launch.job_dir)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a server killed with SIGKILL or Ctrl-C leaves its jobs running
                close_fds=True,
            )
        with self._lock:
            self._processes[launch.job_dir] = process

        def wait() -> None:
            process.wait()
            with self._lock:
                self._processes.pop(launch.job_dir, None)
            on_exit()

        threading.Thread(target=wait, name=f"job {launch.job_dir.name}", daemon=True).start()

    def is_running(self, job_dir: Path) -> bool:
        try:
            fd = os.open(job_dir / "supervisor.lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the lock we may have taken
        return False

    def reattach(self, job_dir: Path, on_exit: OnExit) -> None:
        def wait() -> None:
            fd = os.open(job_dir / "supervisor.lock", os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # granted when the supervisor exits
            finally:
                os.close(fd)
            on_exit()

        threading.Thread(target=wait, name=f"job {job_dir.name}", daemon=True).start()

    def _supervisor_pid(self, job_dir: Path) -> int | None:
        """The running supervisor's pid, or None when it has ended."""
        with self._lock:
            process = self._processes.get(job_dir)
        pid = process.pid if process else None
        if pid is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = int(json.loads((job_dir / "supervisor.json").read_text())["pid"])
        if pid is None or not self.is_running(job_dir) and process is None:
            return None
        return pid

    def cancel(self, job_dir: Path) -> None:
        pid = self._supervisor_pid(job_dir)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # the supervisor passes it to the job's groups, then SIGKILLs

    def kill(self, job_dir: Path, reason: str) -> None:
        pid = self._supervisor_pid(job_dir)
        if pid is not None:
            atomic_write(job_dir / "kill.json", json.dumps({"reason": reason}).encode(), 0o600, durable=False)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)  # the supervisor reads kill.json and SIGKILLs the job's groups

    def pids(self, job_dir: Path) -> list[int]:
        try:
            info = json.loads((job_dir / "supervisor.json").read_text())
        except (OSError, ValueError):
            return []  # not started yet, or ended
        pids = []
        for child in info.get("children") or [info["child"]]:
            try:
                process = psutil.Process(child)
                pids += [child, *(p.pid for p in process.children(recursive=True))]
            except psutil.Error:
                continue  # that rank has ended
        return pids
