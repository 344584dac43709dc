"""Hold each deep-learning framework a job imports to the job's slice of GPU memory.

The server gives a job that holds a slice of a GPU two settings (without them this does nothing):

- ``GPUPORT_GPU_MEMORY``: whole bytes the process may use on each GPU it sees;
- ``GPUPORT_GPU_MEMORY_FRACTION``: the same as a fraction, in (0, 1], of the GPU's total memory.

A value that does not parse is ignored with a one-line message on stderr.

JAX and CuPy read limits of their own from the environment when they start, so they need no hook:
``XLA_PYTHON_CLIENT_PREALLOCATE``, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and ``CUPY_GPU_MEMORY_LIMIT``
are set from the slice, with ``TF_FORCE_GPU_ALLOW_GROWTH``, unless the job set them itself. The
server sets them too; setting them here keeps a process that was started some other way the same.

TensorFlow and PyTorch take their limit from a call. Importing a framework is the job's choice, and
costs seconds, so nothing here imports one: a finder at the front of ``sys.meta_path`` wraps the
loader of the top-level module (``import torch.nn`` imports ``torch`` first), makes the call right
after the module's own code has run, and leaves ``sys.meta_path`` once every hook has run.

- TensorFlow: each GPU becomes one logical device with ``memory_limit`` (MiB) set, which TensorFlow
  accepts only before it starts; growth comes from ``TF_FORCE_GPU_ALLOW_GROWTH``. TensorFlow refuses
  ``set_memory_growth`` on a device configured so, and most TensorFlow scripts call it, so for the
  devices capped here that call is accepted and does nothing.
- PyTorch: ``torch.cuda.set_per_process_memory_fraction`` on every device. Calling it at import would
  start CUDA in every job that imports torch, and a process with CUDA started cannot fork workers
  that use it (DataLoader, multiprocessing), so the call is queued with ``torch.cuda._lazy_call`` and
  runs when torch starts CUDA itself. Setting the fraction makes a CUDA context on the device, so
  every device the process sees gets one at that moment, not only those it goes on to use.

A cap that fails prints ``gpuport: could not cap <framework> at <size>: <error>`` to stderr and the
import goes on; an exception raised during torch's CUDA start-up would leave CUDA unusable. What was
applied is in ``caps``, also reachable as ``sitecustomize.caps``:

    {"tensorflow": {"devices": 0, "memory_limit_mib": 8192},
     "torch": {"fraction": 0.5, "memory": 8589934592, "deferred": True}}

Standard library only: this runs at the start of every Python process of a job.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing costs milliseconds to import; type checkers read this name as True
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

ENV_MEMORY = "GPUPORT_GPU_MEMORY"
ENV_FRACTION = "GPUPORT_GPU_MEMORY_FRACTION"

_MIB = 2**20

caps: dict[str, dict[str, object]] = {}
"""What each framework was capped at, by the name of its top-level module (see the module docstring)."""


class Slice:
    """The GPU memory a job may use on each GPU: ``memory`` in bytes, ``fraction`` of the total."""

    def __init__(self, memory: int | None, fraction: float | None) -> None:
        self.memory = memory
        self.fraction = fraction

    def __str__(self) -> str:
        """``8GiB``, or ``50%`` where only the fraction is known."""
        if self.memory is not None:
            return _format_size(self.memory)
        assert self.fraction is not None
        return f"{self.fraction * 100:.4g}%"

    def per_gpu(self) -> str:
        """``8GiB per GPU``, or ``50% of each GPU``."""
        return f"{self} per GPU" if self.memory is not None else f"{self} of each GPU"


def read_slice(environ: Mapping[str, str]) -> Slice | None:
    """The slice the environment gives, or None for no cap; a value that does not parse is ignored."""
    memory: int | None = None
    fraction: float | None = None
    text = environ.get(ENV_MEMORY, "").strip()
    if text:
        if text.isascii() and text.isdigit() and int(text) > 0:
            memory = int(text)
        else:
            _say(f"gpuport: ignoring {ENV_MEMORY}={text!r}: expected a whole number of bytes above 0")
    text = environ.get(ENV_FRACTION, "").strip()
    if text:
        try:
            fraction = float(text)
        except ValueError:
            pass
        if fraction is None or not 0 < fraction <= 1:  # NaN too
            fraction = None
            _say(f"gpuport: ignoring {ENV_FRACTION}={text!r}: expected a number in (0, 1]")
    if memory is None and fraction is None:
        return None
    return Slice(memory, fraction)


def install() -> None:
    """Read the slice from the environment; set the variables JAX, CuPy and TensorFlow read, and hook
    the TensorFlow and PyTorch imports. Without a slice: nothing."""
    limit = read_slice(os.environ)
    if limit is None:
        return
    _set_environment(limit)
    hooks = {
        "tensorflow": _guarded("TensorFlow", "tensorflow", limit, _cap_tensorflow),
        "torch": _guarded("PyTorch", "torch", limit, _cap_torch),
    }
    # A .pth file may have imported a framework before this runs; cap it now.
    for name in [name for name in hooks if name in sys.modules]:
        hooks.pop(name)(sys.modules[name])
    if hooks:
        sys.meta_path.insert(0, CapOnImport(hooks))


def _set_environment(limit: Slice) -> None:
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if limit.fraction is not None:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", repr(limit.fraction))
    # Bytes, or a percentage of each GPU ("25%"): CuPy reads both.
    os.environ.setdefault("CUPY_GPU_MEMORY_LIMIT", str(limit.memory) if limit.memory is not None else str(limit))


class CapOnImport:
    """A ``sys.meta_path`` finder that runs ``hooks[name](module)`` right after top-level module
    ``name`` has been executed, then forgets the hook; it removes itself when none is left.

    It finds nothing itself: it asks the finders behind it and wraps the loader of what they found.
    """

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self._hooks = hooks

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        hook = self._hooks.get(name)  # submodules have dotted names, never keys here
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CapAfterExec(spec.loader, name, hook, self)  # type: ignore[assignment]
        return spec

    def _done(self, name: str) -> None:
        self._hooks.pop(name, None)
        if not self._hooks and self in sys.meta_path:
            sys.meta_path.remove(self)


class _CapAfterExec:
    """A module's own loader, and its hook run once the module's code has run without an error."""

    def __init__(self, loader: Loader, name: str, hook: Callable[[ModuleType], None], finder: CapOnImport) -> None:
        self._loader = loader
        self._name = name
        self._hook = hook
        self._finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # The module sees, and keeps, its own loader: importlib.resources and the like ask it.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._finder._done(self._name)
        self._hook(module)

    def __getattr__(self, name: str) -> object:
        if name == "_loader":  # not set yet (copy, pickle): no endless recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


def _guarded(
    label: str, name: str, limit: Slice, cap: Callable[[ModuleType, Slice], None]
) -> Callable[[ModuleType], None]:
    """``cap`` made harmless: what it raises becomes one line on stderr and an ``error`` in ``caps``."""

    def hook(module: ModuleType) -> None:
        try:
            cap(module, limit)
        except Exception as error:
            _could_not(label, name, limit, error)

    return hook


def _could_not(label: str, name: str, limit: Slice, error: BaseException) -> None:
    text = str(error).strip().splitlines()
    reason = text[0] if text else type(error).__name__
    caps.setdefault(name, {})["error"] = reason
    _say(f"gpuport: could not cap {label} at {limit}: {reason}")


def _cap_tensorflow(tf: ModuleType, limit: Slice) -> None:
    gpus = tf.config.list_physical_devices("GPU")  # lists devices; TensorFlow has not started yet
    mib = None if limit.memory is None else limit.memory // _MIB
    if not gpus:
        caps["tensorflow"] = {"devices": 0, "memory_limit_mib": mib}
        return
    if mib is None:
        raise ValueError(f"TensorFlow takes its limit in MiB, from {ENV_MEMORY}, and only the fraction is set")
    if mib == 0:
        raise ValueError(f"{ENV_MEMORY} is under the 1MiB TensorFlow can take")
    configuration = [tf.config.LogicalDeviceConfiguration(memory_limit=mib)]
    for gpu in gpus:
        tf.config.set_logical_device_configuration(gpu, configuration)
    _accept_memory_growth(configuration)
    caps["tensorflow"] = {"devices": len(gpus), "memory_limit_mib": mib}
    growth = os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true"
    note = " (memory growth on)" if growth else ""
    _say(f"gpuport: TensorFlow limited to {_format_size(mib * _MIB)} per GPU{note}")


def _accept_memory_growth(configuration: list[object]) -> None:
    """Let ``set_memory_growth`` pass on devices that carry ``configuration``, where TensorFlow refuses it.

    Growth is on there already (TF_FORCE_GPU_ALLOW_GROWTH); a device the job configured itself keeps
    TensorFlow's own answer.
    """
    from tensorflow.python.eager import context  # imported by tensorflow already

    refusing = context.Context.set_memory_growth

    def set_memory_growth(self: object, dev: object, enable: bool) -> None:
        if getattr(self, "_virtual_device_map", {}).get(dev) is configuration:
            return
        refusing(self, dev, enable)

    set_memory_growth.__doc__ = refusing.__doc__
    context.Context.set_memory_growth = set_memory_growth


def _cap_torch(torch: ModuleType, limit: Slice) -> None:
    cuda = torch.cuda
    record: dict[str, object] = {"fraction": limit.fraction, "memory": limit.memory}
    record["deferred"] = not cuda.is_initialized()
    caps["torch"] = record

    def cap_torch_at_cuda_start() -> None:
        # Runs inside torch.cuda._lazy_init, where torch's own calls do not start CUDA again; what it
        # raises there would leave CUDA unusable, so nothing leaves it.
        try:
            record["devices"] = _set_torch_fractions(cuda, limit)
        except Exception as error:
            _could_not("PyTorch", "torch", limit, error)
        else:
            _say(f"gpuport: PyTorch limited to {limit.per_gpu()}")

    # At once if CUDA has started already, else when it starts.
    cuda._lazy_call(cap_torch_at_cuda_start)


def _set_torch_fractions(cuda: ModuleType, limit: Slice) -> int:
    count = cuda.device_count()
    current = cuda.current_device()
    # The current device last: some torch versions leave the last device set as the current one.
    for device in [d for d in range(count) if d != current] + [current]:
        if limit.fraction is not None:
            fraction = limit.fraction
        else:
            assert limit.memory is not None
            fraction = min(1.0, limit.memory / cuda.get_device_properties(device).total_memory)
        cuda.set_per_process_memory_fraction(float(fraction), device)
    return count


def _format_size(n: int) -> str:
    # As gpuport.protocol.units.format_size prints sizes; not imported: stdlib only, and cheap.
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def _say(line: str) -> None:
    stream = sys.stderr
    if stream is not None:
        try:
            stream.write(line + "\n")
        except (OSError, ValueError):  # closed or gone: the message has nowhere to go
            pass
