"""The client side: ``connect`` and ``login`` make a ``Client``; nothing here imports the server.

Each name is imported when first used (PEP 562): a command that only reads the saved profiles does
not pay for gRPC, protobuf and cloudpickle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuport.client._client import Client, connect
    from gpuport.client._config import config_path, load_profiles, remove_profile
    from gpuport.client._jobs import ArrayInfo, Job, JobArray, JobInfo
    from gpuport.client._login import login
    from gpuport.client._models import ModelInfo, TensorSpec
    from gpuport.client._sessions import Ref, RemoteFunction, Session, SessionInfo
    from gpuport.client._types import (
        GPU,
        GpuAllocation,
        GpuProcess,
        NewToken,
        QuotaInfo,
        ServerStatus,
        Snapshot,
        TokenInfo,
        UsageReport,
    )

# name → the module that defines it
_WHERE = {
    "Client": "_client",
    "connect": "_client",
    "config_path": "_config",
    "load_profiles": "_config",
    "remove_profile": "_config",
    "ArrayInfo": "_jobs",
    "Job": "_jobs",
    "JobArray": "_jobs",
    "JobInfo": "_jobs",
    "login": "_login",
    "ModelInfo": "_models",
    "TensorSpec": "_models",
    "Ref": "_sessions",
    "RemoteFunction": "_sessions",
    "Session": "_sessions",
    "SessionInfo": "_sessions",
    "GPU": "_types",
    "GpuAllocation": "_types",
    "GpuProcess": "_types",
    "NewToken": "_types",
    "QuotaInfo": "_types",
    "UsageReport": "_types",
    "ServerStatus": "_types",
    "Snapshot": "_types",
    "TokenInfo": "_types",
}

__all__ = [
    "GPU",
    "ArrayInfo",
    "Client",
    "GpuAllocation",
    "GpuProcess",
    "Job",
    "JobArray",
    "JobInfo",
    "ModelInfo",
    "NewToken",
    "QuotaInfo",
    "Ref",
    "RemoteFunction",
    "ServerStatus",
    "Session",
    "SessionInfo",
    "Snapshot",
    "TensorSpec",
    "TokenInfo",
    "UsageReport",
    "config_path",
    "connect",
    "load_profiles",
    "login",
    "remove_profile",
]
assert set(__all__) == set(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuport.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gpuport.client.{module}"), name)
    globals()[name] = value  # found once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
