"""A deployment as the serving protocols describe it (KServe v2, Triton's repository and config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuport.server.serving.batcher import BatcherStats


@dataclass(frozen=True)
class DeploymentRecord:
    """One version of a deployed model: its source, format, state, tensors, replicas' jobs and batcher counters."""

    id: str
    name: str
    version: int
    owner: str
    source: str
    format: str
    state: str  # loading, ready, failed
    message: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    spec: dict[str, Any]
    jobs: list[str]
    created_at: float
    stats: BatcherStats  # its batcher's counters (all 0 while it loads, or once it failed)
    labels: list[str] = field(default_factory=list)  # the version labels that name this version
    nodes: list[str] = field(default_factory=list)  # each replica's node, as ``jobs`` ("": not running yet)
