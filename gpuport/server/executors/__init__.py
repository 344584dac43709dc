"""Where jobs run: ``Executor`` is the seam, ``LocalExecutor`` the default, ``RayExecutor`` a Ray cluster."""

from gpuport.server.executors.base import Executor, JobLaunch, Node, Placement, Usage
from gpuport.server.executors.local import LocalExecutor

__all__ = ["Executor", "JobLaunch", "LocalExecutor", "Node", "Placement", "Usage"]
