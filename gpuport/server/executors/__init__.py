"""Where jobs run: ``Executor`` is the seam, ``LocalExecutor`` the default, ``RayExecutor`` a Ray cluster,
``SlurmExecutor`` a Slurm cluster."""

from gpuport.server.executors.base import Ask, Executor, JobLaunch, Node, Placement, Usage
from gpuport.server.executors.local import LocalExecutor

__all__ = ["Ask", "Executor", "JobLaunch", "LocalExecutor", "Node", "Placement", "Usage"]
