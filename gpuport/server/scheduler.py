"""Which queued jobs start now, and on which GPUs.

For now a simple first-come allocator: jobs start in submission order; a job that needs GPUs
waits while an earlier GPU job waits (so a large request is never overtaken forever), while jobs
that need no GPU start at once. The fair-share scheduler of a later issue replaces this function.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    job_id: str
    gpus: int


@dataclass(frozen=True)
class Decision:
    job_id: str
    gpu_indices: tuple[int, ...] | None  # None: it waits
    reason: str = ""  # why it waits


def first_come(queued: Sequence[Pending], gpu_count: int, busy: Iterable[int]) -> list[Decision]:
    """Decide for each queued job, in order: start it on the lowest free GPUs, or say why it waits."""
    free = sorted(set(range(gpu_count)) - set(busy))
    decisions = []
    ahead = 0  # GPU jobs waiting before this one
    for job in queued:
        if job.gpus == 0:
            decisions.append(Decision(job.job_id, ()))
        elif ahead == 0 and job.gpus <= len(free):
            decisions.append(Decision(job.job_id, tuple(free[: job.gpus])))
            free = free[job.gpus :]
        else:
            reason = f"waiting for {job.gpus} GPU{'s' if job.gpus > 1 else ''} ({len(free)} free"
            reason += f", {ahead} GPU job{'s' if ahead > 1 else ''} ahead)" if ahead else ")"
            decisions.append(Decision(job.job_id, None, reason))
            ahead += 1
    return decisions
