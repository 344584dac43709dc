from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("client_version", "python_version", "cloudpickle_version")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOUDPICKLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    python_version: str
    cloudpickle_version: str
    def __init__(self, client_version: _Optional[str] = ..., python_version: _Optional[str] = ..., cloudpickle_version: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("server_version", "python_version", "hostname", "user", "admin", "cloudpickle_version", "data_port")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CLOUDPICKLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    python_version: str
    hostname: str
    user: str
    admin: bool
    cloudpickle_version: str
    data_port: int
    def __init__(self, server_version: _Optional[str] = ..., python_version: _Optional[str] = ..., hostname: _Optional[str] = ..., user: _Optional[str] = ..., admin: _Optional[bool] = ..., cloudpickle_version: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "memory_used", "job_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    memory_used: int
    job_id: str
    def __init__(self, pid: _Optional[int] = ..., memory_used: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class GpuAllocation(_message.Message):
    __slots__ = ("job_id", "owner", "memory", "memory_used")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    owner: str
    memory: int
    memory_used: int
    def __init__(self, job_id: _Optional[str] = ..., owner: _Optional[str] = ..., memory: _Optional[int] = ..., memory_used: _Optional[int] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total", "memory_used", "utilization", "processes", "jobs", "allocations", "node")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization: int
    processes: _containers.RepeatedCompositeFieldContainer[GpuProcess]
    jobs: _containers.RepeatedScalarFieldContainer[str]
    allocations: _containers.RepeatedCompositeFieldContainer[GpuAllocation]
    node: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_used: _Optional[int] = ..., utilization: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[GpuProcess, _Mapping]]] = ..., jobs: _Optional[_Iterable[str]] = ..., allocations: _Optional[_Iterable[_Union[GpuAllocation, _Mapping]]] = ..., node: _Optional[str] = ...) -> None: ...

class GpuList(_message.Message):
    __slots__ = ("inventory", "note", "gpus")
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    inventory: str
    note: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, inventory: _Optional[str] = ..., note: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("server_version", "hostname", "started_at", "cpus", "memory_total", "memory_available", "gpus", "user", "admin", "python_version")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    hostname: str
    started_at: float
    cpus: int
    memory_total: int
    memory_available: int
    gpus: GpuList
    user: str
    admin: bool
    python_version: str
    def __init__(self, server_version: _Optional[str] = ..., hostname: _Optional[str] = ..., started_at: _Optional[float] = ..., cpus: _Optional[int] = ..., memory_total: _Optional[int] = ..., memory_available: _Optional[int] = ..., gpus: _Optional[_Union[GpuList, _Mapping]] = ..., user: _Optional[str] = ..., admin: _Optional[bool] = ..., python_version: _Optional[str] = ...) -> None: ...

class DashboardLink(_message.Message):
    __slots__ = ("code", "expires_in", "http_port")
    CODE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    code: str
    expires_in: float
    http_port: int
    def __init__(self, code: _Optional[str] = ..., expires_in: _Optional[float] = ..., http_port: _Optional[int] = ...) -> None: ...

class EnvironmentsRequest(_message.Message):
    __slots__ = ("prune",)
    PRUNE_FIELD_NUMBER: _ClassVar[int]
    prune: bool
    def __init__(self, prune: _Optional[bool] = ...) -> None: ...

class Environment(_message.Message):
    __slots__ = ("hash", "size", "python_version", "created_at", "last_used", "jobs", "layered", "packages")
    HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    LAYERED_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    hash: str
    size: int
    python_version: str
    created_at: float
    last_used: float
    jobs: int
    layered: bool
    packages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hash: _Optional[str] = ..., size: _Optional[int] = ..., python_version: _Optional[str] = ..., created_at: _Optional[float] = ..., last_used: _Optional[float] = ..., jobs: _Optional[int] = ..., layered: _Optional[bool] = ..., packages: _Optional[_Iterable[str]] = ...) -> None: ...

class EnvironmentList(_message.Message):
    __slots__ = ("environments", "removed")
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[Environment]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, environments: _Optional[_Iterable[_Union[Environment, _Mapping]]] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenInfo(_message.Message):
    __slots__ = ("name", "admin", "created_at", "revoked_at", "scrape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    admin: bool
    created_at: float
    revoked_at: float
    scrape: bool
    def __init__(self, name: _Optional[str] = ..., admin: _Optional[bool] = ..., created_at: _Optional[float] = ..., revoked_at: _Optional[float] = ..., scrape: _Optional[bool] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("name", "admin", "client_cert", "scrape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CERT_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    admin: bool
    client_cert: bool
    scrape: bool
    def __init__(self, name: _Optional[str] = ..., admin: _Optional[bool] = ..., client_cert: _Optional[bool] = ..., scrape: _Optional[bool] = ...) -> None: ...

class CreateTokenReply(_message.Message):
    __slots__ = ("info", "token", "cert_pem", "key_pem", "server_cert_pem", "cert_port")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    SERVER_CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    CERT_PORT_FIELD_NUMBER: _ClassVar[int]
    info: TokenInfo
    token: str
    cert_pem: str
    key_pem: str
    server_cert_pem: str
    cert_port: int
    def __init__(self, info: _Optional[_Union[TokenInfo, _Mapping]] = ..., token: _Optional[str] = ..., cert_pem: _Optional[str] = ..., key_pem: _Optional[str] = ..., server_cert_pem: _Optional[str] = ..., cert_port: _Optional[int] = ...) -> None: ...

class ListTokensRequest(_message.Message):
    __slots__ = ("include_revoked",)
    INCLUDE_REVOKED_FIELD_NUMBER: _ClassVar[int]
    include_revoked: bool
    def __init__(self, include_revoked: _Optional[bool] = ...) -> None: ...

class TokenList(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class RevokeTokenRequest(_message.Message):
    __slots__ = ("name", "end_work")
    NAME_FIELD_NUMBER: _ClassVar[int]
    END_WORK_FIELD_NUMBER: _ClassVar[int]
    name: str
    end_work: bool
    def __init__(self, name: _Optional[str] = ..., end_work: _Optional[bool] = ...) -> None: ...

class ManifestEntry(_message.Message):
    __slots__ = ("path", "blob", "size", "mode", "link")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    path: str
    blob: str
    size: int
    mode: int
    link: str
    def __init__(self, path: _Optional[str] = ..., blob: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., link: _Optional[str] = ...) -> None: ...

class CreateSnapshotRequest(_message.Message):
    __slots__ = ("entries", "name")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ManifestEntry]
    name: str
    def __init__(self, entries: _Optional[_Iterable[_Union[ManifestEntry, _Mapping]]] = ..., name: _Optional[str] = ...) -> None: ...

class NameSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "name")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    name: str
    def __init__(self, snapshot_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class CreateSnapshotReply(_message.Message):
    __slots__ = ("snapshot_id", "missing", "files", "bytes")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    missing: _containers.RepeatedScalarFieldContainer[str]
    files: int
    bytes: int
    def __init__(self, snapshot_id: _Optional[str] = ..., missing: _Optional[_Iterable[str]] = ..., files: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class SnapshotRef(_message.Message):
    __slots__ = ("snapshot_id", "name")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    name: str
    def __init__(self, snapshot_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("snapshot_id", "name", "created_at", "files", "bytes", "entries")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    name: str
    created_at: float
    files: int
    bytes: int
    entries: _containers.RepeatedCompositeFieldContainer[ManifestEntry]
    def __init__(self, snapshot_id: _Optional[str] = ..., name: _Optional[str] = ..., created_at: _Optional[float] = ..., files: _Optional[int] = ..., bytes: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[ManifestEntry, _Mapping]]] = ...) -> None: ...

class SnapshotList(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[Snapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[Snapshot, _Mapping]]] = ...) -> None: ...

class BlobPart(_message.Message):
    __slots__ = ("blob", "offset", "data", "last")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    blob: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, blob: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class BlobBatch(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[BlobPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[BlobPart, _Mapping]]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("blobs", "bytes")
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blobs: int
    bytes: int
    def __init__(self, blobs: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("snapshot_id", "blobs")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    blobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, snapshot_id: _Optional[str] = ..., blobs: _Optional[_Iterable[str]] = ...) -> None: ...

class BlobList(_message.Message):
    __slots__ = ("blobs", "sizes")
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    blobs: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, blobs: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("command", "shell", "snapshot_id", "project", "datasets", "gpus", "env", "outputs", "name", "hyperparameters_json", "time_limit", "gpu_memory", "cpus", "memory", "priority", "nprocs", "tf_roles", "retries", "nodes", "nprocs_per_node", "after", "requirements", "env_groups", "python", "isolated_env", "environment", "preemptible", "checkpoint", "retry_on_exit", "partition", "batch_script")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TfRolesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NPROCS_FIELD_NUMBER: _ClassVar[int]
    TF_ROLES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NPROCS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    ENV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_ENV_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RETRY_ON_EXIT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SCRIPT_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    snapshot_id: str
    project: str
    datasets: _containers.RepeatedScalarFieldContainer[str]
    gpus: int
    env: _containers.ScalarMap[str, str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    name: str
    hyperparameters_json: str
    time_limit: float
    gpu_memory: int
    cpus: float
    memory: int
    priority: int
    nprocs: int
    tf_roles: _containers.ScalarMap[str, int]
    retries: int
    nodes: int
    nprocs_per_node: int
    after: _containers.RepeatedScalarFieldContainer[str]
    requirements: str
    env_groups: _containers.RepeatedScalarFieldContainer[str]
    python: str
    isolated_env: bool
    environment: str
    preemptible: bool
    checkpoint: str
    retry_on_exit: _containers.RepeatedScalarFieldContainer[int]
    partition: str
    batch_script: str
    def __init__(self, command: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., project: _Optional[str] = ..., datasets: _Optional[_Iterable[str]] = ..., gpus: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., outputs: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., hyperparameters_json: _Optional[str] = ..., time_limit: _Optional[float] = ..., gpu_memory: _Optional[int] = ..., cpus: _Optional[float] = ..., memory: _Optional[int] = ..., priority: _Optional[int] = ..., nprocs: _Optional[int] = ..., tf_roles: _Optional[_Mapping[str, int]] = ..., retries: _Optional[int] = ..., nodes: _Optional[int] = ..., nprocs_per_node: _Optional[int] = ..., after: _Optional[_Iterable[str]] = ..., requirements: _Optional[str] = ..., env_groups: _Optional[_Iterable[str]] = ..., python: _Optional[str] = ..., isolated_env: _Optional[bool] = ..., environment: _Optional[str] = ..., preemptible: _Optional[bool] = ..., checkpoint: _Optional[str] = ..., retry_on_exit: _Optional[_Iterable[int]] = ..., partition: _Optional[str] = ..., batch_script: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "name", "owner", "state", "command", "gpus", "gpu_indices", "created_at", "started_at", "ended_at", "has_exit_code", "exit_code", "message", "snapshot_id", "output_snapshot_id", "outputs", "log_bytes", "time_limit", "gpu_memory", "cpus", "memory", "priority", "nprocs", "position", "node", "array_id", "array_index", "environment", "preemptible", "preemptions", "retried")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NPROCS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ARRAY_ID_FIELD_NUMBER: _ClassVar[int]
    ARRAY_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RETRIED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    owner: str
    state: str
    command: _containers.RepeatedScalarFieldContainer[str]
    gpus: int
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    created_at: float
    started_at: float
    ended_at: float
    has_exit_code: bool
    exit_code: int
    message: str
    snapshot_id: str
    output_snapshot_id: str
    outputs: _containers.RepeatedScalarFieldContainer[str]
    log_bytes: int
    time_limit: float
    gpu_memory: int
    cpus: float
    memory: int
    priority: int
    nprocs: int
    position: int
    node: str
    array_id: str
    array_index: int
    environment: str
    preemptible: bool
    preemptions: int
    retried: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., state: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., gpus: _Optional[int] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., has_exit_code: _Optional[bool] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., output_snapshot_id: _Optional[str] = ..., outputs: _Optional[_Iterable[str]] = ..., log_bytes: _Optional[int] = ..., time_limit: _Optional[float] = ..., gpu_memory: _Optional[int] = ..., cpus: _Optional[float] = ..., memory: _Optional[int] = ..., priority: _Optional[int] = ..., nprocs: _Optional[int] = ..., position: _Optional[int] = ..., node: _Optional[str] = ..., array_id: _Optional[str] = ..., array_index: _Optional[int] = ..., environment: _Optional[str] = ..., preemptible: _Optional[bool] = ..., preemptions: _Optional[int] = ..., retried: _Optional[int] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("job_id", "port", "exec")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EXEC_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    port: int
    exec: bool
    def __init__(self, job_id: _Optional[str] = ..., port: _Optional[int] = ..., exec: _Optional[bool] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("all", "name", "states", "user")
    ALL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    all: bool
    name: str
    states: _containers.RepeatedScalarFieldContainer[str]
    user: str
    def __init__(self, all: _Optional[bool] = ..., name: _Optional[str] = ..., states: _Optional[_Iterable[str]] = ..., user: _Optional[str] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("job_id", "offset", "follow", "tail")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    follow: bool
    tail: int
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ..., follow: _Optional[bool] = ..., tail: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class JobOutputs(_message.Message):
    __slots__ = ("job", "snapshot_id", "missing")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    job: JobInfo
    snapshot_id: str
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[_Union[JobInfo, _Mapping]] = ..., snapshot_id: _Optional[str] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class ArraySpec(_message.Message):
    __slots__ = ("job", "array", "sweep")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    job: JobSpec
    array: str
    sweep: _containers.RepeatedCompositeFieldContainer[SweepParameter]
    def __init__(self, job: _Optional[_Union[JobSpec, _Mapping]] = ..., array: _Optional[str] = ..., sweep: _Optional[_Iterable[_Union[SweepParameter, _Mapping]]] = ...) -> None: ...

class SweepParameter(_message.Message):
    __slots__ = ("name", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., values: _Optional[_Iterable[str]] = ...) -> None: ...

class ArrayInfo(_message.Message):
    __slots__ = ("array_id", "name", "owner", "spec", "max_running", "created_at", "sweep", "tasks")
    ARRAY_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    array_id: str
    name: str
    owner: str
    spec: str
    max_running: int
    created_at: float
    sweep: _containers.RepeatedCompositeFieldContainer[SweepParameter]
    tasks: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, array_id: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., spec: _Optional[str] = ..., max_running: _Optional[int] = ..., created_at: _Optional[float] = ..., sweep: _Optional[_Iterable[_Union[SweepParameter, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("job_id", "timeout")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    timeout: float
    def __init__(self, job_id: _Optional[str] = ..., timeout: _Optional[float] = ...) -> None: ...

class QuotaInfo(_message.Message):
    __slots__ = ("user", "gpus", "jobs", "updated_at", "queued", "processes", "storage", "storage_used", "shares")
    USER_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_USED_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    user: str
    gpus: float
    jobs: int
    updated_at: float
    queued: int
    processes: int
    storage: int
    storage_used: int
    shares: float
    def __init__(self, user: _Optional[str] = ..., gpus: _Optional[float] = ..., jobs: _Optional[int] = ..., updated_at: _Optional[float] = ..., queued: _Optional[int] = ..., processes: _Optional[int] = ..., storage: _Optional[int] = ..., storage_used: _Optional[int] = ..., shares: _Optional[float] = ...) -> None: ...

class QuotaList(_message.Message):
    __slots__ = ("quotas",)
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    quotas: _containers.RepeatedCompositeFieldContainer[QuotaInfo]
    def __init__(self, quotas: _Optional[_Iterable[_Union[QuotaInfo, _Mapping]]] = ...) -> None: ...

class QuotaRef(_message.Message):
    __slots__ = ("user",)
    USER_FIELD_NUMBER: _ClassVar[int]
    user: str
    def __init__(self, user: _Optional[str] = ...) -> None: ...

class UsageQuery(_message.Message):
    __slots__ = ("since", "user", "by")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    since: float
    user: str
    by: str
    def __init__(self, since: _Optional[float] = ..., user: _Optional[str] = ..., by: _Optional[str] = ...) -> None: ...

class UsageEntry(_message.Message):
    __slots__ = ("user", "day", "runs", "gpu_seconds", "cpu_seconds_reserved", "cpu_seconds_used", "memory_byte_seconds", "jobs", "sessions", "models")
    USER_FIELD_NUMBER: _ClassVar[int]
    DAY_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
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
    def __init__(self, user: _Optional[str] = ..., day: _Optional[str] = ..., runs: _Optional[int] = ..., gpu_seconds: _Optional[float] = ..., cpu_seconds_reserved: _Optional[float] = ..., cpu_seconds_used: _Optional[float] = ..., memory_byte_seconds: _Optional[float] = ..., jobs: _Optional[int] = ..., sessions: _Optional[int] = ..., models: _Optional[int] = ...) -> None: ...

class FairShareEntry(_message.Message):
    __slots__ = ("user", "shares", "effective_share", "decayed_use")
    USER_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_SHARE_FIELD_NUMBER: _ClassVar[int]
    DECAYED_USE_FIELD_NUMBER: _ClassVar[int]
    user: str
    shares: float
    effective_share: float
    decayed_use: float
    def __init__(self, user: _Optional[str] = ..., shares: _Optional[float] = ..., effective_share: _Optional[float] = ..., decayed_use: _Optional[float] = ...) -> None: ...

class UsageReport(_message.Message):
    __slots__ = ("entries", "fair_share", "half_life")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_FIELD_NUMBER: _ClassVar[int]
    HALF_LIFE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[UsageEntry]
    fair_share: _containers.RepeatedCompositeFieldContainer[FairShareEntry]
    half_life: float
    def __init__(self, entries: _Optional[_Iterable[_Union[UsageEntry, _Mapping]]] = ..., fair_share: _Optional[_Iterable[_Union[FairShareEntry, _Mapping]]] = ..., half_life: _Optional[float] = ...) -> None: ...

class SessionSpec(_message.Message):
    __slots__ = ("name", "gpus", "gpu_memory", "cpus", "memory", "priority", "idle_timeout", "env", "python_version", "cloudpickle_version", "requirements")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOUDPICKLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    gpus: int
    gpu_memory: int
    cpus: float
    memory: int
    priority: int
    idle_timeout: float
    env: _containers.ScalarMap[str, str]
    python_version: str
    cloudpickle_version: str
    requirements: str
    def __init__(self, name: _Optional[str] = ..., gpus: _Optional[int] = ..., gpu_memory: _Optional[int] = ..., cpus: _Optional[float] = ..., memory: _Optional[int] = ..., priority: _Optional[int] = ..., idle_timeout: _Optional[float] = ..., env: _Optional[_Mapping[str, str]] = ..., python_version: _Optional[str] = ..., cloudpickle_version: _Optional[str] = ..., requirements: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "name", "owner", "state", "job_id", "gpus", "gpu_memory", "cpus", "memory", "gpu_indices", "created_at", "last_call_at", "idle_timeout", "message", "refs", "attached", "position", "reattached", "node")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_AT_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    owner: str
    state: str
    job_id: str
    gpus: int
    gpu_memory: int
    cpus: float
    memory: int
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    created_at: float
    last_call_at: float
    idle_timeout: float
    message: str
    refs: int
    attached: int
    position: int
    reattached: bool
    node: str
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., state: _Optional[str] = ..., job_id: _Optional[str] = ..., gpus: _Optional[int] = ..., gpu_memory: _Optional[int] = ..., cpus: _Optional[float] = ..., memory: _Optional[int] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., created_at: _Optional[float] = ..., last_call_at: _Optional[float] = ..., idle_timeout: _Optional[float] = ..., message: _Optional[str] = ..., refs: _Optional[int] = ..., attached: _Optional[int] = ..., position: _Optional[int] = ..., reattached: _Optional[bool] = ..., node: _Optional[str] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SessionList(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("header", "buffers", "staged", "sizes", "follows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    staged: str
    sizes: _containers.RepeatedScalarFieldContainer[int]
    follows: bool
    def __init__(self, header: _Optional[bytes] = ..., buffers: _Optional[_Iterable[bytes]] = ..., staged: _Optional[str] = ..., sizes: _Optional[_Iterable[int]] = ..., follows: _Optional[bool] = ...) -> None: ...

class RefInfo(_message.Message):
    __slots__ = ("ref_id", "name", "type", "summary")
    REF_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ref_id: str
    name: str
    type: str
    summary: str
    def __init__(self, ref_id: _Optional[str] = ..., name: _Optional[str] = ..., type: _Optional[str] = ..., summary: _Optional[str] = ...) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("session_id", "op", "value", "function", "function_pickle", "keep", "ref_name", "ref_ids", "device", "timeout", "results_follow")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CALL: _ClassVar[CallRequest.Op]
        PUT: _ClassVar[CallRequest.Op]
        GET: _ClassVar[CallRequest.Op]
        DELETE: _ClassVar[CallRequest.Op]
        REFS: _ClassVar[CallRequest.Op]
    CALL: CallRequest.Op
    PUT: CallRequest.Op
    GET: CallRequest.Op
    DELETE: CallRequest.Op
    REFS: CallRequest.Op
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_PICKLE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    REF_NAME_FIELD_NUMBER: _ClassVar[int]
    REF_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    op: CallRequest.Op
    value: Value
    function: str
    function_pickle: bytes
    keep: bool
    ref_name: str
    ref_ids: _containers.RepeatedScalarFieldContainer[str]
    device: str
    timeout: float
    results_follow: bool
    def __init__(self, session_id: _Optional[str] = ..., op: _Optional[_Union[CallRequest.Op, str]] = ..., value: _Optional[_Union[Value, _Mapping]] = ..., function: _Optional[str] = ..., function_pickle: _Optional[bytes] = ..., keep: _Optional[bool] = ..., ref_name: _Optional[str] = ..., ref_ids: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., timeout: _Optional[float] = ..., results_follow: _Optional[bool] = ...) -> None: ...

class RemoteFailure(_message.Message):
    __slots__ = ("kind", "type", "message", "traceback", "exception", "has_exit_code", "exit_code", "stderr_tail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    type: str
    message: str
    traceback: str
    exception: bytes
    has_exit_code: bool
    exit_code: int
    stderr_tail: str
    def __init__(self, kind: _Optional[str] = ..., type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., exception: _Optional[bytes] = ..., has_exit_code: _Optional[bool] = ..., exit_code: _Optional[int] = ..., stderr_tail: _Optional[str] = ...) -> None: ...

class CallReply(_message.Message):
    __slots__ = ("value", "ref", "refs", "failure", "unknown_function", "stdout_offset", "stderr_offset", "download")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    value: Value
    ref: RefInfo
    refs: _containers.RepeatedCompositeFieldContainer[RefInfo]
    failure: RemoteFailure
    unknown_function: bool
    stdout_offset: int
    stderr_offset: int
    download: str
    def __init__(self, value: _Optional[_Union[Value, _Mapping]] = ..., ref: _Optional[_Union[RefInfo, _Mapping]] = ..., refs: _Optional[_Iterable[_Union[RefInfo, _Mapping]]] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ..., unknown_function: _Optional[bool] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ..., download: _Optional[str] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("session_id", "size", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    size: int
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Staged(_message.Message):
    __slots__ = ("staged",)
    STAGED_FIELD_NUMBER: _ClassVar[int]
    staged: str
    def __init__(self, staged: _Optional[str] = ...) -> None: ...

class DownloadChunkRequest(_message.Message):
    __slots__ = ("session_id", "staged")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    staged: str
    def __init__(self, session_id: _Optional[str] = ..., staged: _Optional[str] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session_id", "channel", "tunnel", "blobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    channel: bool
    tunnel: str
    blobs: bool
    def __init__(self, session_id: _Optional[str] = ..., channel: _Optional[bool] = ..., tunnel: _Optional[str] = ..., blobs: _Optional[bool] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("ticket", "port")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    port: int
    def __init__(self, ticket: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class OutputRequest(_message.Message):
    __slots__ = ("session_id", "stdout_offset", "stderr_offset")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stdout_offset: int
    stderr_offset: int
    def __init__(self, session_id: _Optional[str] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("fd", "offset", "data", "state", "job_id")
    FD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    fd: int
    offset: int
    data: bytes
    state: str
    job_id: str
    def __init__(self, fd: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., state: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class DeployRequest(_message.Message):
    __slots__ = ("name", "source", "version", "format", "gpus", "gpu_memory", "cpus", "memory", "max_batch_size", "max_queue_delay", "replicas", "public", "label", "requirements")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    version: int
    format: str
    gpus: int
    gpu_memory: int
    cpus: float
    memory: int
    max_batch_size: int
    max_queue_delay: float
    replicas: int
    public: bool
    label: str
    requirements: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., version: _Optional[int] = ..., format: _Optional[str] = ..., gpus: _Optional[int] = ..., gpu_memory: _Optional[int] = ..., cpus: _Optional[float] = ..., memory: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_queue_delay: _Optional[float] = ..., replicas: _Optional[int] = ..., public: _Optional[bool] = ..., label: _Optional[str] = ..., requirements: _Optional[str] = ...) -> None: ...

class LabelRequest(_message.Message):
    __slots__ = ("name", "label", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    label: str
    version: int
    def __init__(self, name: _Optional[str] = ..., label: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "name", "version", "owner", "source", "format", "state", "message", "inputs", "outputs", "max_batch_size", "max_queue_delay", "replicas", "gpus", "gpu_memory", "jobs", "created_at", "requests", "batches", "rows", "failed_batches", "queue_length", "public", "labels", "nodes")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FAILED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    version: int
    owner: str
    source: str
    format: str
    state: str
    message: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    max_batch_size: int
    max_queue_delay: float
    replicas: int
    gpus: int
    gpu_memory: int
    jobs: _containers.RepeatedScalarFieldContainer[str]
    created_at: float
    requests: int
    batches: int
    rows: int
    failed_batches: int
    queue_length: int
    public: bool
    labels: _containers.RepeatedScalarFieldContainer[str]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[int] = ..., owner: _Optional[str] = ..., source: _Optional[str] = ..., format: _Optional[str] = ..., state: _Optional[str] = ..., message: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., max_queue_delay: _Optional[float] = ..., replicas: _Optional[int] = ..., gpus: _Optional[int] = ..., gpu_memory: _Optional[int] = ..., jobs: _Optional[_Iterable[str]] = ..., created_at: _Optional[float] = ..., requests: _Optional[int] = ..., batches: _Optional[int] = ..., rows: _Optional[int] = ..., failed_batches: _Optional[int] = ..., queue_length: _Optional[int] = ..., public: _Optional[bool] = ..., labels: _Optional[_Iterable[str]] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ModelList(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
