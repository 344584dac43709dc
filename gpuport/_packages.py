"""Which pip extra brings which package, for errors that say how to install what is missing.

``gpuport`` alone is the laptop's client; ``gpuport[server]`` the GPU machine's daemon; ``[tf]``,
``[torch]``, ``[onnx]`` the frameworks that jobs, sessions and served models use; ``[ray]`` a server
in front of a Ray cluster, and its nodes. The table below
names, for each module gpuport imports only when a feature needs it, the distribution that provides
it and the extra that brings that distribution (a test checks it against ``pyproject.toml``).
"""

from __future__ import annotations

import importlib.metadata

# module → (distribution on PyPI, the gpuport extra that installs it)
BROUGHT_BY: dict[str, tuple[str, str]] = {
    "numpy": ("numpy", "server"),
    "cryptography": ("cryptography", "server"),
    "fastapi": ("fastapi", "server"),
    "uvicorn": ("uvicorn", "server"),
    "httptools": ("httptools", "server"),
    "uvloop": ("uvloop", "server"),
    "psutil": ("psutil", "server"),
    "pynvml": ("nvidia-ml-py", "server"),
    "prometheus_client": ("prometheus-client", "server"),
    "tensorflow": ("tensorflow-cpu", "tf"),
    "keras": ("tensorflow-cpu", "tf"),
    "torch": ("torch", "torch"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "ray": ("ray", "ray"),
}


def missing_package(error: ImportError, needed_for: str, where: str = "here") -> str:
    """Say what ``error`` (an import that failed) means for ``needed_for``, and how to mend it.

    A package that is not installed is named with the extra that brings it; one that is installed
    but does not import (a broken or mismatched install) is not sent back to the command that
    installed it, but named with its own error.

    >>> missing_package(ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime"), "serving ONNX")
    "serving ONNX needs onnxruntime, which is not installed here: pip install 'gpuport[onnx]'"
    """
    module = (error.name or "").partition(".")[0]
    if not module:
        return f"{needed_for} failed to import what it needs {where}: {error}"
    distribution, extra = BROUGHT_BY.get(module, (module, ""))
    # Whatever distribution provides the module counts (tensorflow as well as tensorflow-cpu).
    installed = importlib.metadata.packages_distributions().get(module)
    if installed:
        return (
            f"{needed_for} needs {installed[0]}, which is installed {where} but does not import: {error} "
            f"— reinstall it: pip install --force-reinstall {installed[0]}"
        )
    install = f"pip install 'gpuport[{extra}]'" if extra else f"pip install {distribution}"
    return f"{needed_for} needs {distribution}, which is not installed {where}: {install}"
