"""The client side: ``connect`` and ``login`` make a ``Client``; nothing here imports the server."""

from gpuport.client._client import Client, connect
from gpuport.client._config import config_path, load_profiles, remove_profile
from gpuport.client._jobs import Job, JobInfo
from gpuport.client._login import login
from gpuport.client._models import ModelInfo, TensorSpec
from gpuport.client._sessions import Ref, RemoteFunction, Session, SessionInfo
from gpuport.client._types import GPU, GpuAllocation, GpuProcess, NewToken, QuotaInfo, ServerStatus, Snapshot, TokenInfo

__all__ = [
    "GPU",
    "Client",
    "GpuAllocation",
    "GpuProcess",
    "Job",
    "JobInfo",
    "NewToken",
    "QuotaInfo",
    "Ref",
    "RemoteFunction",
    "ServerStatus",
    "Session",
    "SessionInfo",
    "ModelInfo",
    "TensorSpec",
    "Snapshot",
    "TokenInfo",
    "config_path",
    "connect",
    "load_profiles",
    "login",
    "remove_profile",
]
