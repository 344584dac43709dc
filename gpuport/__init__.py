"""gpuport: GPU over IP for Python deep learning.

>>> import gpuport
>>> with gpuport.connect() as gpu:       # the profile saved by `gpuport login`
...     for g in gpu.gpus():
...         print(g.index, g.name, g.memory_used, g.memory_total)
"""

import os as _os

# gRPC's C core logs connection failures to stderr on its own; gpuport turns them into errors
# that say what to do, so the raw lines are only noise. Set GRPC_VERBOSITY to see them.
_os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from gpuport._preemption import on_preempt, preempted
from gpuport._version import __version__
from gpuport.protocol import errors as _errors
from gpuport.protocol.errors import *
from gpuport.protocol.units import format_duration, format_size, parse_duration, parse_size

# typing's constant, without importing typing (every command loads this module); deleted below:
# not a public name.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any as _Any

    from gpuport.client import (
        GPU,
        ArrayInfo,
        Client,
        GpuAllocation,
        GpuProcess,
        Job,
        JobArray,
        JobInfo,
        ModelInfo,
        NewToken,
        QuotaInfo,
        Ref,
        RemoteFunction,
        ServerStatus,
        Session,
        SessionInfo,
        Snapshot,
        TokenInfo,
        UsageReport,
        connect,
        login,
    )
del TYPE_CHECKING

__all__ = [
    "__version__",
    "connect",
    "login",
    "Client",
    "Job",
    "JobArray",
    "JobInfo",
    "ArrayInfo",
    "ModelInfo",
    "Snapshot",
    "GPU",
    "GpuAllocation",
    "GpuProcess",
    "NewToken",
    "QuotaInfo",
    "UsageReport",
    "Ref",
    "RemoteFunction",
    "ServerStatus",
    "Session",
    "SessionInfo",
    "TokenInfo",
    "parse_size",
    "format_size",
    "parse_duration",
    "format_duration",
    "load_ipython_extension",
    "preempted",
    "on_preempt",
    *_errors.__all__,
]


# The client's names are imported when first used (PEP 562): `gpuport --version` and the errors do
# not pay for gRPC, protobuf and cloudpickle. They are the names of ``__all__`` not defined here
# (``_CLIENT_NAMES``, at the end of the module).


def __getattr__(name: str) -> "_Any":
    if name not in _CLIENT_NAMES:
        raise AttributeError(f"module 'gpuport' has no attribute {name!r}")
    import gpuport.client

    value = getattr(gpuport.client, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT_NAMES)


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext gpuport`` in Jupyter or IPython: cells that run on the GPU machine (``%%gpuport``),
    with ``%gpuport_pull``, ``%gpuport_push`` and ``%gpuport_close``; see the README's Notebooks."""
    from gpuport._notebook import load_ipython_extension as load

    load(ipython)


_CLIENT_NAMES = frozenset(__all__) - set(globals())
