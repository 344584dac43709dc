"""The value codec: how a Python value becomes bytes to send, and back, with as few copies as possible.

``encode(value)`` returns an ``Encoded``: a small JSON ``header`` and a list of ``buffers``
(memoryviews of flat bytes). ``decode(header, buffers)`` rebuilds the value. How the header and the
buffers travel (gRPC chunks, a file, shared memory) is the transport's business, not this module's.

The header is compact JSON; ``v`` is the format version and ``kind`` says what follows::

    {"v":1,"kind":"numpy","dtype":"<f4","shape":[1024,1024]}             one buffer: the elements
    {"v":1,"kind":"numpy","dtype":">i8","shape":[3,4],"order":"F"}       ... in Fortran order
    {"v":1,"kind":"torch","dtype":"bfloat16","shape":[8],"device":"cuda:0"}
    {"v":1,"kind":"tensorflow","dtype":"float32","shape":[2,2],"device":"/job:localhost/.../CPU:0"}
    {"v":1,"kind":"tensorflow","dtype":"string","shape":[3],"device":"..."}  two buffers: lengths, bytes
    {"v":1,"kind":"jax","dtype":"float32","shape":[4],"device":"gpu:0"}
    {"v":1,"kind":"pickle","python":"3.11.7","cloudpickle":"3.1.2"}      buffers: the pickle, then
                                                                          its out-of-band buffers

Arrays (numpy, torch, TensorFlow, jax) travel as their raw elements with dtype and shape: never as
lists, never pickled. ``dtype`` is numpy's ``dtype.str`` (byte order included) for numpy, and the
library's own dtype name for the others, so dtypes numpy lacks (``bfloat16``, ``float8_e4m3fn``)
travel too. ``device`` records where a tensor was; it comes back on the CPU unless ``decode`` is
asked for ``device="gpu"``. Every other value is pickled with cloudpickle, protocol 5: the numpy
arrays (and torch tensors) inside it of 64 KiB or more leave the pickle as out-of-band buffers.

Zero-copy rules:

- encode: a C- or Fortran-contiguous numpy array is not copied: its buffer is a view of the array
  itself (so do not change the array until the buffers are sent). A non-contiguous array is copied
  once. A contiguous CPU torch tensor is not copied; a CUDA one is copied to the CPU. TensorFlow and
  jax tensors are read through ``.numpy()`` / ``np.asarray``, which copy only from a GPU.
- decode: a numpy array, a torch tensor and the arrays inside a pickle are built over the buffers
  given, without a copy, when those are writable (``bytearray``, or a memoryview of one): receive
  into ``bytearray``s to get there. Read-only buffers (``bytes``) are copied once, so that the
  value is writable like the one sent. TensorFlow and jax copy into their own memory anyway.

Only decode what an authenticated peer sent: unpickling can run any code the sender chose.

>>> encoded = encode({"weights": [1.0, 2.0]})
>>> decode(encoded.header, encoded.buffers)
{'weights': [1.0, 2.0]}
"""

from __future__ import annotations

import importlib
import io
import json
import math
import pickle
import platform
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import cloudpickle

from gpuport.protocol import refs
from gpuport.protocol.errors import InvalidRequest

__all__ = ["Buffer", "Encoded", "check_compatible", "decode", "encode"]

# What decode accepts as one buffer.
Buffer = bytes | bytearray | memoryview

# Version of the header format; a decoder refuses headers newer than the one it knows.
FORMAT_VERSION = 1
# Buffers inside a pickle smaller than this many bytes stay inside it: a separate buffer per small
# array would cost the transport more than the copy it saves.
_OUT_OF_BAND_MIN_BYTES = 64 * 1024
# numpy dtype kinds sent as raw elements: bool, ints, floats, complex, bytes, str, timedelta, datetime.
# Object arrays (pointers) and structured ones go through pickle.
_NUMPY_RAW_KINDS = frozenset("biufcSUmM")
_KINDS = ("numpy", "torch", "tensorflow", "jax", "pickle")
_DEVICES = ("cpu", "gpu")


@dataclass(frozen=True)
class Encoded:
    """A value ready to send: a compact JSON ``header`` and the ``buffers`` it describes.

    The buffers are flat byte memoryviews, often views of the value's own memory: send them before
    changing the value. ``decode(encoded.header, encoded.buffers)`` rebuilds the value.
    """

    header: bytes
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Total bytes in ``buffers`` (the header not included)."""
        return sum(buffer.nbytes for buffer in self.buffers)


def encode(value: object) -> Encoded:
    """Turn ``value`` into an ``Encoded`` header and buffers, copying as little as possible.

    numpy arrays, torch tensors, TensorFlow tensors and jax arrays become one raw buffer (two for a
    TensorFlow string tensor); anything else is pickled with cloudpickle (protocol 5), large arrays
    inside it leaving as out-of-band buffers. A library is imported here only when ``value`` comes
    from it. Raises ``InvalidRequest`` for a value that cannot be sent (it does not pickle, or it is
    a tensor whose dtype has no raw form), before anything is sent.

    >>> import numpy as np
    >>> encode(np.zeros((2, 3), np.float32)).header
    b'{"v":1,"kind":"numpy","dtype":"<f4","shape":[2,3]}'
    """
    kind = _array_kind(value)
    if kind == "numpy":
        return _encode_numpy(value)
    if kind == "torch":
        return _encode_torch(value)
    if kind == "tensorflow":
        return _encode_tensorflow(value)
    if kind == "jax":
        return _encode_jax(value)
    return _encode_pickle(value)


def decode(header: bytes | str, buffers: Sequence[Buffer], *, device: str | None = None) -> Any:
    """Rebuild the value that ``encode`` turned into ``header`` and ``buffers``.

    ``device="gpu"`` puts a torch, TensorFlow or jax tensor on the first GPU (numpy arrays and
    pickled values stay where they are); ``None`` or ``"cpu"`` keeps it on the CPU. Writable
    buffers are used in place (see the module docstring). Raises ``InvalidRequest`` for a header or
    buffers that do not fit together, a value this side cannot rebuild (a library or module that is
    missing here, another Python version), or ``device="gpu"`` where the library sees no GPU.
    """
    if device is not None and device not in _DEVICES:
        raise InvalidRequest(f"unknown device {device!r} — use 'gpu', 'cpu' or None (the CPU)")
    meta = _read_header(header)
    kind = meta["kind"]
    if kind == "pickle":
        return _decode_pickle(meta, buffers)
    if kind == "numpy":
        return _decode_numpy(meta, buffers)
    if kind == "torch":
        return _decode_torch(meta, buffers, device)
    if kind == "tensorflow":
        return _decode_tensorflow(meta, buffers, device)
    return _decode_jax(meta, buffers, device)


def check_compatible(
    python_version: str, cloudpickle_version: str, *, remote: str = "server", local: str = "client"
) -> str | None:
    """Say why pickles from a peer with these versions would not load here, or return ``None``.

    Pickled functions and classes carry bytecode, which changes between Python minor versions, and
    cloudpickle's format can change between its major versions. ``remote`` and ``local`` name the
    two sides in the message. Raises ``InvalidRequest`` for a version that cannot be read.

    >>> check_compatible(platform.python_version(), cloudpickle.__version__) is None
    True
    """
    theirs_py, ours_py = _minor(python_version), _minor(platform.python_version())
    theirs_cp, ours_cp = _major(cloudpickle_version), _major(cloudpickle.__version__)
    problems = []
    if theirs_py != ours_py:
        problems.append(
            f"the {remote} runs Python {theirs_py} and this {local} {ours_py}: pickled functions and objects "
            f"cannot cross minor versions — use the same Python minor version on both sides"
        )
    if theirs_cp != ours_cp:
        problems.append(
            f"the {remote} has cloudpickle {cloudpickle_version} and this {local} {cloudpickle.__version__}: "
            f"pickles do not cross cloudpickle major versions — install cloudpickle {ours_cp}.x on both sides"
        )
    return "; ".join(problems) or None


# ---------------------------------------------------------------------------------------------------
# Which kind a value is: by its type's module, and only through libraries already imported.


def _array_kind(value: object) -> str | None:
    root = type(value).__module__.partition(".")[0]
    if root == "numpy":
        np = sys.modules.get("numpy")
        if np is not None and type(value) is np.ndarray:
            dtype = value.dtype  # type: ignore[attr-defined]
            if dtype.kind in _NUMPY_RAW_KINDS and dtype.fields is None and dtype.itemsize > 0:
                return "numpy"
    elif root == "torch":
        torch = sys.modules.get("torch")
        # Subclasses (nn.Parameter ...) pickle, and their plain tensor inside still goes raw.
        if torch is not None and type(value) is torch.Tensor and _torch_is_plain(value):
            return "torch"
    elif root == "tensorflow":
        tf = sys.modules.get("tensorflow")
        if tf is not None and isinstance(value, tf.Tensor) and hasattr(value, "numpy"):
            return "tensorflow"  # an eager tensor; a symbolic one has no value to send
    elif root in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(value, jax.Array):
            return "jax"
    return None


def _torch_is_plain(tensor: Any) -> bool:
    """A dense tensor of real values: sparse, quantized and meta tensors keep torch's own pickling."""
    torch = sys.modules["torch"]
    return tensor.layout == torch.strided and not tensor.is_quantized and tensor.device.type != "meta"


# ---------------------------------------------------------------------------------------------------
# Encoding.


def _header(meta: dict[str, object]) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, **meta}, separators=(",", ":")).encode()


def _raw_bytes(array: Any) -> memoryview:
    """A flat byte view of a C-contiguous numpy array, without a copy (0-d and empty arrays too)."""
    np = sys.modules["numpy"]
    return memoryview(array.reshape(-1).view(np.uint8))


def _encode_numpy(array: Any) -> Encoded:
    np = sys.modules["numpy"]
    meta: dict[str, object] = {"kind": "numpy", "dtype": array.dtype.str, "shape": list(array.shape)}
    if array.flags.c_contiguous:
        flat = array
    elif array.flags.f_contiguous:
        flat = array.T  # C-contiguous over the same memory; decode transposes back
        meta["order"] = "F"
    else:
        flat = np.ascontiguousarray(array)
    return Encoded(_header(meta), [_raw_bytes(flat)])


def _torch_raw(tensor: Any) -> tuple[dict[str, object], memoryview]:
    """The header fields and raw bytes of a torch tensor; copies only from a GPU or a strided view."""
    torch = sys.modules["torch"]
    device = str(tensor.device)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    # Viewed as bytes, so that dtypes numpy lacks (bfloat16, float8 ...) travel as they are.
    raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"kind": "torch", "dtype": dtype, "shape": list(tensor.shape), "device": device}, raw


def _encode_torch(tensor: Any) -> Encoded:
    try:
        meta, raw = _torch_raw(tensor)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequest(f"cannot send a torch {tensor.dtype} tensor on {tensor.device}: {exc}") from exc
    return Encoded(_header(meta), [raw])


def _encode_tensorflow(tensor: Any) -> Encoded:
    np = _import("numpy")
    tf = sys.modules["tensorflow"]
    meta: dict[str, object] = {
        "kind": "tensorflow",
        "dtype": tensor.dtype.name,
        "shape": list(tensor.shape),
        "device": tensor.device,
    }
    if tensor.dtype == tf.string:
        # Each element's length, then all the bytes: variable-length strings without pickle.
        items = tensor.numpy().reshape(-1).tolist()
        lengths = np.fromiter((len(item) for item in items), dtype="<u8", count=len(items))
        return Encoded(_header(meta), [_raw_bytes(lengths), memoryview(b"".join(items))])
    if _tf_numpy_dtype(tf, tensor.dtype) is None:
        raise InvalidRequest(
            f"cannot send a TensorFlow {tensor.dtype.name} tensor: it has no value outside TensorFlow — "
            f"send the values it refers to instead"
        )
    return Encoded(_header(meta), [_raw_bytes(np.ascontiguousarray(tensor.numpy()))])


def _encode_jax(array: Any) -> Encoded:
    np = _import("numpy")
    devices = sorted(f"{d.platform}:{d.id}" for d in array.devices())
    host = np.ascontiguousarray(np.asarray(array))
    meta = {"kind": "jax", "dtype": host.dtype.name, "shape": list(host.shape), "device": ",".join(devices)}
    return Encoded(_header(meta), [_raw_bytes(host)])


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with torch tensors inside the value sent as raw buffers like top-level ones.

    torch pickles a tensor by writing its storage with ``torch.save`` into the pickle: two copies,
    and a CUDA tensor would need CUDA on the other side. Here it becomes a ``PickleBuffer`` that
    leaves the pickle out of band, and it comes back on the CPU.
    """

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and _torch_is_plain(obj):
            meta, raw = _torch_raw(obj)
            return _rebuild_torch, (meta, pickle.PickleBuffer(raw))
        return super().reducer_override(obj)


def _rebuild_torch(meta: dict[str, Any], data: Buffer) -> Any:
    """Unpickle a torch tensor that ``_Pickler`` sent raw (the name is part of the wire format)."""
    return _decode_torch(meta, [data], None)


def _encode_pickle(value: object) -> Encoded:
    out_of_band: list[memoryview] = []

    def keep_aside(buffer: pickle.PickleBuffer) -> bool:
        # Returning True keeps the buffer inside the pickle.
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: only a copy inside the pickle can hold it
            return True
        if raw.nbytes < _OUT_OF_BAND_MIN_BYTES:
            return True
        out_of_band.append(raw)
        return False

    stream = io.BytesIO()
    try:
        _Pickler(stream, protocol=5, buffer_callback=keep_aside).dump(value)
    except Exception as exc:
        raise InvalidRequest(
            f"cannot send {_describe(value)}: {type(exc).__name__}: {exc} — only values that pickle can "
            f"travel: open files, sockets, locks, generators and connections cannot; send what they are "
            f"made from (a path, a URL, a config) and open them on the other side"
        ) from exc
    meta = {"kind": "pickle", "python": platform.python_version(), "cloudpickle": cloudpickle.__version__}
    # getvalue(), not getbuffer(): it hands over BytesIO's own bytes without a copy, and a view kept
    # alive (a module constant) would make Python 3.13 print a BufferError when the BytesIO is freed.
    return Encoded(_header(meta), [memoryview(stream.getvalue()), *out_of_band])


def _describe(value: object) -> str:
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    own = getattr(value, "__qualname__", None)
    return f"{name} {own}" if isinstance(own, str) and not isinstance(value, type) else f"a {name}"


# ---------------------------------------------------------------------------------------------------
# Decoding.


def _read_header(header: bytes | str) -> dict[str, Any]:
    try:
        meta = json.loads(header)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the value's header is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("kind") not in _KINDS:
        kinds = ", ".join(_KINDS)
        raise InvalidRequest(f"the value's header names no known kind (one of {kinds}): {header[:200]!r}")
    version = meta.get("v")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise InvalidRequest(
            f"the value was encoded in format v{version}, newer than this gpuport reads "
            f"(v{FORMAT_VERSION}) — upgrade gpuport on this side"
        )
    return meta


def _import(library: str) -> ModuleType:
    """Import an array library the header names, or say how to get it."""
    try:
        return importlib.import_module(library)
    except ImportError as exc:
        from gpuport._packages import missing_package

        raise InvalidRequest(missing_package(exc, f"receiving a {library} array")) from exc


def _one_buffer(meta: dict[str, Any], buffers: Sequence[Buffer], count: int = 1) -> Sequence[Buffer]:
    if len(buffers) != count:
        raise InvalidRequest(f"a {meta['kind']} value comes in {count} buffer(s), got {len(buffers)}")
    return buffers


def _shape(meta: dict[str, Any]) -> tuple[int, ...]:
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise InvalidRequest(f"the value's header has no valid shape: {shape!r}")
    return tuple(shape)


def _flat(buffer: Buffer, *, writable: bool) -> memoryview:
    """``buffer`` as flat bytes; copied once when it is read-only and ``writable`` is asked for."""
    view = memoryview(buffer)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        if not view.c_contiguous:
            raise InvalidRequest("a value's buffer must be contiguous memory")
        view = view.cast("B")
    if writable and view.readonly:
        view = memoryview(bytearray(view))
    return view


def _check_size(meta: dict[str, Any], view: memoryview, shape: tuple[int, ...], itemsize: int) -> None:
    expected = math.prod(shape) * itemsize
    if view.nbytes != expected:
        raise InvalidRequest(
            f"a {meta['kind']} {meta.get('dtype')} array of shape {list(shape)} needs {expected} bytes, "
            f"but its buffer holds {view.nbytes}"
        )


def _numpy_array(np: ModuleType, meta: dict[str, Any], view: memoryview, dtype: Any) -> Any:
    """The array over ``view``, in the header's shape and order; copied only if misaligned."""
    if dtype.hasobject or dtype.itemsize == 0:
        raise InvalidRequest(f"dtype {meta.get('dtype')!r} cannot travel as raw bytes")
    shape = _shape(meta)
    _check_size(meta, view, shape, dtype.itemsize)
    array = np.frombuffer(view, dtype=dtype)
    array = array.reshape(shape[::-1]).T if meta.get("order") == "F" else array.reshape(shape)
    return array if array.flags.aligned else array.copy(order="K")


def _decode_numpy(meta: dict[str, Any], buffers: Sequence[Buffer]) -> Any:
    np = _import("numpy")
    try:
        dtype = np.dtype(meta.get("dtype"))
    except TypeError as exc:
        raise InvalidRequest(f"unknown numpy dtype {meta.get('dtype')!r}") from exc
    (data,) = _one_buffer(meta, buffers)
    return _numpy_array(np, meta, _flat(data, writable=True), dtype)


def _decode_torch(meta: dict[str, Any], buffers: Sequence[Buffer], device: str | None) -> Any:
    torch = _import("torch")
    if device == "gpu" and not torch.cuda.is_available():
        raise InvalidRequest(
            "asked to place the tensor on the GPU, but torch sees no CUDA device — decode with device=None "
            "to keep it on the CPU"
        )
    name = meta.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"unknown torch dtype {name!r} — is torch older here than on the other side?")
    shape = _shape(meta)
    (data,) = _one_buffer(meta, buffers)
    view = _flat(data, writable=True)
    _check_size(meta, view, shape, dtype.itemsize)
    if view.nbytes == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
        if raw.data_ptr() % dtype.itemsize:
            raw = raw.clone()  # misaligned for the dtype
        tensor = raw.view(dtype).reshape(shape)
    return tensor.cuda() if device == "gpu" else tensor


def _tf_numpy_dtype(tf: ModuleType, dtype: Any) -> Any:
    """The numpy dtype holding a TensorFlow dtype's elements, or None (resource, variant, string)."""
    np = sys.modules["numpy"]
    try:
        numpy_dtype = np.dtype(dtype.as_numpy_dtype)
    except (KeyError, TypeError):
        return None
    return None if numpy_dtype.hasobject else numpy_dtype


def _decode_tensorflow(meta: dict[str, Any], buffers: Sequence[Buffer], device: str | None) -> Any:
    tf = _import("tensorflow")
    np = _import("numpy")
    if device == "gpu" and not tf.config.list_physical_devices("GPU"):
        raise InvalidRequest(
            "asked to place the tensor on the GPU, but TensorFlow sees no GPU — decode with device=None "
            "to keep it on the CPU"
        )
    try:
        dtype = tf.dtypes.as_dtype(meta.get("dtype"))
    except TypeError as exc:
        raise InvalidRequest(f"unknown TensorFlow dtype {meta.get('dtype')!r}") from exc
    if dtype == tf.string:
        lengths_buffer, data = _one_buffer(meta, buffers, count=2)
        lengths = np.frombuffer(_flat(lengths_buffer, writable=False), dtype="<u8")
        shape = _shape(meta)
        blob = _flat(data, writable=False)
        if lengths.size != math.prod(shape) or int(lengths.sum()) != blob.nbytes:
            raise InvalidRequest("a TensorFlow string tensor's lengths do not match its shape and bytes")
        ends = np.cumsum(lengths).tolist()
        items = [bytes(blob[end - n : end]) for end, n in zip(ends, lengths.tolist())]
        array = np.array(items, dtype=object).reshape(shape)
    else:
        numpy_dtype = _tf_numpy_dtype(tf, dtype)
        if numpy_dtype is None:
            raise InvalidRequest(f"TensorFlow dtype {dtype.name!r} cannot travel as raw bytes")
        (data,) = _one_buffer(meta, buffers)
        array = _numpy_array(np, meta, _flat(data, writable=False), numpy_dtype)
    if device == "gpu":
        with tf.device("/GPU:0"):
            return tf.identity(tf.convert_to_tensor(array, dtype=dtype))
    return tf.convert_to_tensor(array, dtype=dtype)


def _decode_jax(meta: dict[str, Any], buffers: Sequence[Buffer], device: str | None) -> Any:
    jax = _import("jax")
    np = _import("numpy")
    name = meta.get("dtype")
    try:
        dtype = np.dtype(name)
    except TypeError:
        import ml_dtypes  # jax's own dependency; it registers bfloat16, float8_* ... with numpy

        try:
            dtype = np.dtype(getattr(ml_dtypes, str(name)))
        except (AttributeError, TypeError) as exc:
            raise InvalidRequest(f"unknown jax dtype {name!r}") from exc
    if device == "gpu":
        try:
            target = jax.devices("gpu")[0]
        except RuntimeError as exc:
            raise InvalidRequest(
                "asked to place the tensor on the GPU, but jax sees no GPU — decode with device=None "
                "to keep it on the CPU"
            ) from exc
    else:
        target = jax.devices("cpu")[0]
    (data,) = _one_buffer(meta, buffers)
    return jax.device_put(_numpy_array(np, meta, _flat(data, writable=False), dtype), target)


def _decode_pickle(meta: dict[str, Any], buffers: Sequence[Buffer]) -> Any:
    if not buffers:
        raise InvalidRequest("a pickled value comes in at least one buffer (the pickle), got none")
    data, *extra = buffers
    # Writable, so that the arrays rebuilt over them are writable (a read-only one sent stays so).
    out_of_band = [_flat(buffer, writable=True) for buffer in extra]
    try:
        return pickle.loads(data, buffers=out_of_band)
    except (InvalidRequest, refs.UnknownRef):  # a Ref the worker does not hold: its own error
        raise
    except Exception as exc:
        advice = _version_advice(meta) or "install the same packages, at the same versions, on both sides"
        raise InvalidRequest(f"cannot rebuild the value sent: {type(exc).__name__}: {exc} — {advice}") from exc


# ---------------------------------------------------------------------------------------------------
# Versions.

_MINOR_RE = re.compile(r"^\s*(\d+)\.(\d+)")
_MAJOR_RE = re.compile(r"^\s*(\d+)")


def _minor(version: str) -> str:
    match = _MINOR_RE.match(version)
    if not match:
        raise InvalidRequest(f"cannot read {version!r} as a Python version — expected one like 3.12.1")
    return f"{match.group(1)}.{match.group(2)}"


def _major(version: str) -> str:
    match = _MAJOR_RE.match(version)
    if not match:
        raise InvalidRequest(f"cannot read {version!r} as a cloudpickle version — expected one like 3.1.2")
    return match.group(1)


def _version_advice(meta: dict[str, Any]) -> str | None:
    """What ``check_compatible`` says about the sender of a pickle, if its header names readable versions."""
    try:
        return check_compatible(str(meta.get("python")), str(meta.get("cloudpickle")), remote="sender", local="side")
    except InvalidRequest:
        return None
