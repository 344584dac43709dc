"""How an allocation becomes processes: ``Executor`` is the seam, ``LocalExecutor`` the default."""

from gpuport.server.executors.base import Executor, Launch
from gpuport.server.executors.local import LocalExecutor

__all__ = ["Executor", "Launch", "LocalExecutor"]
