"""Deployed models as the client sees them (``gpu.deploy``, ``gpu.models``, ``gpuport models``)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuport.protocol import gpuport_pb2 as pb


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2: FP32, INT64, BYTES, ...
    shape: tuple[int, ...]  # -1: any size; the first dimension is the batch


@dataclass(frozen=True)
class ModelInfo:
    """A deployment: ``state`` is loading, ready or failed (``message`` says why). Another user's
    deployment comes without its ``source``, ``jobs`` and ``nodes`` (empty), and without why it
    failed, unless the caller is an admin."""

    id: str
    name: str
    version: int
    owner: str
    source: str
    format: str
    state: str
    message: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    max_queue_delay: float
    replicas: int
    gpus: int
    gpu_memory: int
    jobs: list[str]
    created_at: float
    # What its batcher did since the server started serving it: requests and rows sent to its
    # replicas in how many batches (failed ones among them), and the requests waiting now.
    requests: int = 0
    batches: int = 0
    rows: int = 0
    failed_batches: int = 0
    queue_length: int = 0
    public: bool = False  # predictions and metadata need no credentials
    labels: tuple[str, ...] = ()  # the version labels (TensorFlow Serving's) that name this version
    nodes: tuple[str, ...] = ()  # where each of ``jobs`` runs ("" while it starts): a cluster's node

    @property
    def mean_batch_size(self) -> float:
        """Rows per batch so far (0 before the first): how well batching fills at this load."""
        return self.rows / self.batches if self.batches else 0.0

    @classmethod
    def from_message(cls, m: pb.ModelInfo) -> ModelInfo:
        def specs(items: list[pb.TensorSpec]) -> list[TensorSpec]:
            return [TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in items]

        return cls(
            id=m.id,
            name=m.name,
            version=m.version,
            owner=m.owner,
            source=m.source,
            format=m.format,
            state=m.state,
            message=m.message,
            inputs=specs(list(m.inputs)),
            outputs=specs(list(m.outputs)),
            max_batch_size=m.max_batch_size,
            max_queue_delay=m.max_queue_delay,
            replicas=m.replicas,
            gpus=m.gpus,
            gpu_memory=m.gpu_memory,
            jobs=list(m.jobs),
            created_at=m.created_at,
            requests=m.requests,
            batches=m.batches,
            rows=m.rows,
            failed_batches=m.failed_batches,
            queue_length=m.queue_length,
            public=m.public,
            labels=tuple(m.labels),
            nodes=tuple(m.nodes),
        )
