"""The executor seam: how a job's processes are started, watched and stopped.

An executor launches a prepared job directory and calls back when the job's processes are gone;
the job service owns every rule (states, allocation, outputs) and never touches processes itself.
The local executor (``local.py``) runs a supervisor per job on this machine; a Ray executor (a
later issue) places the same launch on a Ray cluster.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

OnExit = Callable[[], None]


@dataclass(frozen=True)
class Launch:
    """What to run: argv in ``cwd`` with ``env``; its log, exit status and lock live in ``job_dir``."""

    job_dir: Path
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    grace: float = 5.0  # seconds between SIGTERM and SIGKILL on cancel
    time_limit: float = 0.0  # seconds from the start; past it, stopped as on cancel. 0: none
    nprocs: int = 1  # processes of the job, each with its rank's environment when more than one
    tf_roles: list[tuple[str, int]] | None = None  # TF_CONFIG roles in rank order; None: all workers
    rank_gpus: list[list[int]] | None = None  # each rank's CUDA_VISIBLE_DEVICES; None: the env's for all
    sandbox: list[str] | None = None  # the command prefix of the job's sandbox (server/isolation.py)
    network: list[str] | None = None  # a command (+ the sandbox's pid) giving the sandbox a way out
    pidns_file: str | None = None  # where the supervisor writes the job's pid namespace (fake GPUs)


class Executor(ABC):
    @abstractmethod
    def start(self, launch: Launch, on_exit: OnExit) -> None:
        """Start the job detached from the server; call ``on_exit`` (from any thread) when it has ended."""

    @abstractmethod
    def is_running(self, job_dir: Path) -> bool:
        """Whether the job's processes still run (after a server restart, too)."""

    @abstractmethod
    def reattach(self, job_dir: Path, on_exit: OnExit) -> None:
        """Watch a job started by an earlier server; call ``on_exit`` when it has ended."""

    @abstractmethod
    def cancel(self, job_dir: Path) -> None:
        """Ask the job to stop: SIGTERM to its processes, SIGKILL after the launch's grace period."""

    @abstractmethod
    def kill(self, job_dir: Path, reason: str) -> None:
        """Stop the job at once (SIGKILL); its exit status records ``reason`` as why it was killed."""

    @abstractmethod
    def pids(self, job_dir: Path) -> list[int]:
        """The pids of the job's processes on this machine (each rank's, and their descendants)."""
