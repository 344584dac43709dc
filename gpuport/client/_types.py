"""What the client's calls return: plain frozen dataclasses, never protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuport.protocol import gpuport_pb2 as pb


@dataclass(frozen=True)
class GpuProcess:
    """A process using a GPU: its pid, bytes of GPU memory, and gpuport job (empty if none)."""

    pid: int
    memory_used: int
    job_id: str = ""


@dataclass(frozen=True)
class GpuAllocation:
    """Part of a GPU held by a running job: the whole GPU (``memory`` 0) or a slice of ``memory``
    bytes, and what the job's processes use on it now (``memory_used``)."""

    job_id: str
    owner: str
    memory: int
    memory_used: int


@dataclass(frozen=True)
class GPU:
    """One GPU of the server, as read live when the call was answered."""

    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    memory_used: int  # bytes
    utilization: int | None  # percent; None when the inventory cannot tell
    processes: tuple[GpuProcess, ...] = ()
    jobs: tuple[str, ...] = ()  # gpuport jobs holding (part of) this GPU
    allocations: tuple[GpuAllocation, ...] = ()
    node: str = ""  # the node it is on: a cluster's, or the server's hostname

    @classmethod
    def _from_message(cls, m: pb.Gpu) -> GPU:
        return cls(
            index=m.index,
            uuid=m.uuid,
            name=m.name,
            memory_total=m.memory_total,
            memory_used=m.memory_used,
            utilization=None if m.utilization < 0 else m.utilization,
            processes=tuple(GpuProcess(p.pid, p.memory_used, p.job_id) for p in m.processes),
            jobs=tuple(m.jobs),
            allocations=tuple(GpuAllocation(a.job_id, a.owner, a.memory, a.memory_used) for a in m.allocations),
            node=m.node,
        )


@dataclass(frozen=True)
class ServerStatus:
    """The server, its machine and its GPUs. ``inventory`` is "nvml", "fake" or "cpu"."""

    url: str
    server_version: str
    python_version: str
    hostname: str
    started_at: float
    cpus: int
    memory_total: int
    memory_available: int
    inventory: str
    note: str  # why there are no GPUs, when there are none
    gpus: tuple[GPU, ...]
    user: str
    admin: bool


@dataclass(frozen=True)
class TokenInfo:
    """A token as an admin sees it: never the token itself, which is shown only at creation."""

    name: str
    admin: bool
    created_at: float
    revoked_at: float | None = None
    scrape: bool = False  # reads GET /metrics and nothing else

    @classmethod
    def _from_message(cls, m: pb.TokenInfo) -> TokenInfo:
        return cls(m.name, m.admin, m.created_at, m.revoked_at or None, m.scrape)


@dataclass(frozen=True)
class NewToken:
    """A token just created: ``token`` is the secret to hand to its user, shown this once."""

    name: str
    admin: bool
    token: str = field(repr=False)
    # With a client certificate (``create_token(..., client_cert=True)``): it and its key (PEM, the key
    # shown this once), the server's certificate to verify the server by, and the server's gRPC port
    # for certificates (its HTTP port takes them too).
    cert_pem: str = ""
    key_pem: str = field(default="", repr=False)
    server_cert_pem: str = ""
    cert_port: int = 0


@dataclass(frozen=True)
class QuotaInfo:
    """A user's quota: the most GPUs (slices count as their part) and jobs held at once; None: no
    limit. ``queued``: the most jobs queued at once; None: the default's. ``processes``: the
    processes and threads each of their jobs may run at once (None: a server that does not say).
    ``storage``: the bytes of blobs and logs they may keep, ``storage_used``: what they keep. The user
    ``*`` stands for everyone without a quota of their own."""

    user: str
    gpus: float | None
    jobs: int | None
    updated_at: float
    queued: int | None = None
    processes: int | None = None
    storage: int | None = None  # bytes the user may keep (None: a server that does not say)
    storage_used: int | None = None  # bytes they keep (None: the '*' quota)
    shares: float | None = None  # their shares in the fair share over weeks (None: the default's, 1)

    @classmethod
    def _from_message(cls, m: pb.QuotaInfo) -> QuotaInfo:
        return cls(
            m.user,
            m.gpus if m.HasField("gpus") else None,
            m.jobs if m.HasField("jobs") else None,
            m.updated_at,
            m.queued if m.HasField("queued") else None,
            m.processes if m.HasField("processes") else None,
            m.storage if m.HasField("storage") else None,
            m.storage_used if m.HasField("storage_used") else None,
            m.shares if m.HasField("shares") else None,
        )


@dataclass(frozen=True)
class UsageEntry:
    """What a user's work held over a span (``day``: one day of it, with ``by="day"``): GPU-seconds
    (whole GPUs, a slice as its part of its GPU), CPU-seconds reserved and used (where the server
    could tell), memory reserved (byte-seconds), and how many runs of jobs, sessions and models."""

    user: str
    day: str
    runs: int
    gpu_seconds: float
    cpu_seconds_reserved: float
    cpu_seconds_used: float
    memory_byte_seconds: float
    jobs: int
    sessions: int
    models: int


_USAGE_FIELDS = tuple(UsageEntry.__dataclass_fields__)


@dataclass(frozen=True)
class FairShareEntry:
    """A user's place in the fair share over weeks: their ``shares``, the part of the machine those
    entitle them to among the users who queue, run or used it recently (``effective_share``), and
    their use decayed with the server's half-life, in parts of the whole machine (``decayed_use``)."""

    user: str
    shares: float
    effective_share: float
    decayed_use: float


@dataclass(frozen=True)
class UsageReport:
    """``Client.usage``'s answer: the entries, each user's fair share, the half-life (seconds)."""

    entries: list[UsageEntry]
    fair_share: list[FairShareEntry]
    half_life: float

    @classmethod
    def _from_message(cls, m: pb.UsageReport) -> UsageReport:
        return cls(
            [UsageEntry(*(getattr(e, f) for f in _USAGE_FIELDS)) for e in m.entries],
            [FairShareEntry(f.user, f.shares, f.effective_share, f.decayed_use) for f in m.fair_share],
            m.half_life,
        )


@dataclass(frozen=True)
class Snapshot:
    """A folder as stored on the server: ``id`` (its content hash), and what its sync uploaded."""

    id: str
    name: str
    files: int
    bytes: int
    uploaded_files: int = 0
    uploaded_bytes: int = 0
