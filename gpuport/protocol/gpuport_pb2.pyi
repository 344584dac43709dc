from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("client_version", "python_version")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    python_version: str
    def __init__(self, client_version: _Optional[str] = ..., python_version: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("server_version", "python_version", "hostname", "user", "admin")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    python_version: str
    hostname: str
    user: str
    admin: bool
    def __init__(self, server_version: _Optional[str] = ..., python_version: _Optional[str] = ..., hostname: _Optional[str] = ..., user: _Optional[str] = ..., admin: _Optional[bool] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "memory_used", "job_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    memory_used: int
    job_id: str
    def __init__(self, pid: _Optional[int] = ..., memory_used: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total", "memory_used", "utilization", "processes", "jobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization: int
    processes: _containers.RepeatedCompositeFieldContainer[GpuProcess]
    jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_used: _Optional[int] = ..., utilization: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[GpuProcess, _Mapping]]] = ..., jobs: _Optional[_Iterable[str]] = ...) -> None: ...

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

class TokenInfo(_message.Message):
    __slots__ = ("name", "admin", "created_at", "revoked_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    admin: bool
    created_at: float
    revoked_at: float
    def __init__(self, name: _Optional[str] = ..., admin: _Optional[bool] = ..., created_at: _Optional[float] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("name", "admin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    admin: bool
    def __init__(self, name: _Optional[str] = ..., admin: _Optional[bool] = ...) -> None: ...

class CreateTokenReply(_message.Message):
    __slots__ = ("info", "token")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    info: TokenInfo
    token: str
    def __init__(self, info: _Optional[_Union[TokenInfo, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
