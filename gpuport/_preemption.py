"""Inside a job: whether the server preempted it, and what to run when it does (a job that saves a
checkpoint then, to its ``--checkpoint`` folder, resumes from it when it runs again)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from gpuport.defaults import ENV_PREEMPTED_FILE

_callbacks: list[Callable[[], Any]] = []
_previous: Any = None


def preempted() -> bool:
    """Whether the server has preempted this job: it is asked to stop (SIGTERM, then SIGKILL after
    its grace period) and will be queued again. False outside a gpuport job."""
    path = os.environ.get(ENV_PREEMPTED_FILE)
    if not path:
        return False
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def on_preempt(callback: Callable[[], Any]) -> None:
    """Call ``callback()`` (in the main thread) when the job is preempted, at its SIGTERM; then the
    SIGTERM goes on as before (by default it ends the process). A SIGTERM that is not a preemption
    (a cancel) runs no callback."""
    global _previous
    if not _callbacks:
        _previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _callbacks.append(callback)


def _on_sigterm(signum: int, frame: Any) -> None:
    if preempted():
        for callback in _callbacks:
            callback()
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
