"""Loading a deployed model, whatever its format, and describing its inputs and outputs.

A model worker calls ``load(path)`` once, publishes ``model.inputs`` / ``model.outputs`` as the
prediction protocols' metadata, and then, for every batch, ``model.predict(check_inputs(model, batch))``.
The formats, and what names their tensors get:

- ``savedmodel``: a TensorFlow SavedModel folder (``saved_model.pb``; Keras 3's ``model.export``
  writes one). Its ``serving_default`` signature: inputs and outputs named as the signature names
  them (for an exported Keras model: the input layers' names, and ``output_0``, ``output_1`` ...).
- ``keras``: a Keras 3 ``.keras`` file. Inputs are named after the model's input layers
  (``model.inputs[i].name``, the ``name=`` given to ``keras.Input``), which is also what
  ``model.export`` calls them. Outputs are named after the layers that produce them
  (``model.output_names``), or the keys of the model's output dict when it returns a dict.
  ``Input(shape=(8,), name="features") → Dense(4, name="scores")`` serves input ``features``
  [-1, 8] FP32 and output ``scores`` [-1, 4] FP32.
- ``torchscript``: a ``.pt`` / ``.pth`` / ``.torchscript`` file ``torch.jit.load`` reads. It names
  nothing, so it needs a spec file beside it (below); inputs are passed to ``forward`` positionally
  in the declared order.
- ``onnx``: a ``.onnx`` file, run by onnxruntime, named as the graph names its inputs and outputs.
- ``python``: ``model.pkl``, a cloudpickle of an object with ``predict(batch) -> dict``, ``inputs``
  and ``outputs`` (lists of ``TensorSpec``, of ``(name, datatype, shape)`` tuples or of dicts), and
  optionally ``load(self)``, called once after unpickling (to open its weights, say).

A spec file, ``gpuport-model.json`` beside the model (or inside a SavedModel folder), declares the
tensors for any format and overrides what the model says about itself::

    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
     "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}

Datatypes are KServe v2's ("FP32", "INT64", "BYTES" ...); -1 is a variable dimension, and the first
dimension is the batch. Each framework is imported only when a model of its format is loaded.
"""

from __future__ import annotations

import abc
import json
import re
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpuport._packages import missing_package
from gpuport.protocol.datatypes import datatype_of, numpy_dtype
from gpuport.protocol.errors import InvalidRequest, RemoteError

__all__ = ["FORMATS", "SPEC_FILE", "Model", "TensorSpec", "check_inputs", "detect", "load"]

# The declared spec of a model, beside it: {"inputs": [...], "outputs": [...]}.
SPEC_FILE = "gpuport-model.json"
# The formats load() knows, by the name a deployment gives them.
FORMATS = ("savedmodel", "keras", "torchscript", "onnx", "python")
# The file a pickled Python model must be called.
PYTHON_FILE = "model.pkl"
# File suffix → format, for the formats that are one file.
_SUFFIXES = {
    ".keras": "keras",
    ".onnx": "onnx",
    ".pt": "torchscript",
    ".pth": "torchscript",
    ".torchscript": "torchscript",
}
_ACCEPTED = (
    "a SavedModel folder (with saved_model.pb), a Keras .keras file, an ONNX .onnx file, a TorchScript "
    ".pt/.pth/.torchscript file, a pickled Python model named model.pkl, or a folder holding exactly one of these"
)
# ONNX Runtime's tensor element types → KServe v2 datatype.
_ONNX_TYPES = {
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(float16)": "FP16",
    "tensor(bfloat16)": "BF16",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(bool)": "BOOL",
    "tensor(string)": "BYTES",
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model: its name, KServe v2 datatype and shape (-1: variable).

    >>> TensorSpec("x", "FP32", (-1, 8)).as_dict()
    {'name': 'x', 'datatype': 'FP32', 'shape': [-1, 8]}
    """

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    def as_dict(self) -> dict[str, Any]:
        """The spec as KServe v2 metadata publishes it."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def parse(cls, value: object, where: str) -> TensorSpec:
        """A spec from a ``TensorSpec`` (or anything with name, datatype and shape), a ``(name,
        datatype, shape)`` tuple or a dict; InvalidRequest naming ``where`` when it is not one.

        Declared shapes start with -1, the batch dimension.
        """
        if isinstance(value, Mapping):
            unknown = set(value) - {"name", "datatype", "shape"}
            if unknown:
                raise InvalidRequest(
                    f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}: give name, datatype and shape"
                )
            name, datatype, shape = value.get("name"), value.get("datatype"), value.get("shape")
        elif isinstance(value, (tuple, list)) and len(value) == 3:
            name, datatype, shape = value
        elif all(hasattr(value, key) for key in ("name", "datatype", "shape")):
            name, datatype, shape = value.name, value.datatype, value.shape  # type: ignore[attr-defined]
        else:
            raise InvalidRequest(f"{where}: expected a (name, datatype, shape) tuple or a dict, got {value!r}")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}: the name must be a non-empty string, got {name!r}")
        if not isinstance(datatype, str):
            raise InvalidRequest(f'{where} ({name!r}): the datatype must be a string such as "FP32", got {datatype!r}')
        try:
            numpy_dtype(datatype)
        except InvalidRequest as e:
            raise InvalidRequest(f"{where} ({name!r}): {e}") from None
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= -1 for d in shape):
            raise InvalidRequest(
                f"{where} ({name!r}): the shape must be a list of sizes (-1 where any size goes), got {shape!r}"
            )
        if not shape or shape[0] != -1:
            raise InvalidRequest(
                f"{where} ({name!r}): the shape must start with -1, the batch dimension, got {list(shape)}"
            )
        return cls(name, datatype, tuple(shape))


class Model(Protocol):
    """A loaded model, whatever its format.

    ``predict`` takes a batch (every array's first dimension is its rows, checked by
    ``check_inputs``) and returns one array per declared output, of its declared datatype. It raises
    what the framework or the user's code raises, and ``RemoteError`` when the model's outputs are not
    the ones it declares.
    """

    format: str
    device: str  # where it runs: "gpu", or "cpu" (also when asked for a GPU the framework does not see)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def detect(path: Path) -> str:
    """The format of the model at ``path`` (one of ``FORMATS``).

    A folder with ``saved_model.pb`` is a SavedModel; a file is known by its suffix (``model.pkl``
    by its name); a folder holding exactly one model is that model's format. Raises InvalidRequest
    saying what was found and what is accepted.
    """
    return _locate(Path(path), None)[1]


def load(path: Path, format: str | None = None, *, device: str = "cpu") -> Model:
    """Load the model at ``path``: a model file or folder, or a folder holding exactly one.

    ``format`` (one of ``FORMATS``) is detected when None. ``device="gpu"`` places the model on the
    first GPU where its framework sees one, and on the CPU where it sees none. Raises InvalidRequest
    when there is no model, it does not load (with the loader's own message), or its spec file is
    wrong.
    """
    if format is not None and format not in FORMATS:
        raise InvalidRequest(f"unknown model format {format!r}: use one of {', '.join(FORMATS)}")
    if device not in ("cpu", "gpu"):
        raise InvalidRequest(f"unknown device {device!r}: use cpu or gpu")
    path, format = _locate(Path(path), format)
    declared = _read_spec_file(path)
    loader: Callable[[Path, _Declared, str], _Loaded] = _LOADERS[format]
    try:
        return loader(path, declared, device)
    except ImportError as e:  # the framework itself, imported by the loader
        raise InvalidRequest(missing_package(e, f"serving a {format} model", where="where the server runs")) from None


def check_inputs(model: Model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The request's arrays, checked against ``model.inputs`` and ready for ``model.predict``.

    Every declared input must be there and nothing else; each of its declared datatype (no casts:
    "input 'x': expected FP32, received FP64"), rank and fixed dimensions ("input 'x': expected shape
    [-1, 8], received [2, 7]"); all with the same number of rows. Byte strings (BYTES) may come as
    numpy bytes or str arrays and are returned as object arrays. Raises InvalidRequest.
    """
    expected = [spec.name for spec in model.inputs]
    missing = [name for name in expected if name not in inputs]
    if missing:
        raise InvalidRequest(f"missing input(s) {_quoted(missing)}: the model takes {_quoted(expected)}")
    unknown = [name for name in inputs if name not in expected]
    if unknown:
        raise InvalidRequest(f"unknown input(s) {_quoted(unknown)}: the model takes {_quoted(expected)}")
    checked: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}
    for spec in model.inputs:
        array = np.asarray(inputs[spec.name])
        if spec.datatype == "BYTES" and array.dtype.kind in "OSU":
            array = array.astype(object) if array.dtype.kind != "O" else array
        elif array.dtype != numpy_dtype(spec.datatype):
            raise InvalidRequest(
                f"input {spec.name!r}: expected {spec.datatype}, received {_datatype_name(array.dtype)}"
            )
        if array.ndim != len(spec.shape) or any(d not in (-1, n) for d, n in zip(spec.shape, array.shape)):
            raise InvalidRequest(
                f"input {spec.name!r}: expected shape {list(spec.shape)}, received {list(array.shape)}"
            )
        if array.ndim:
            rows[spec.name] = array.shape[0]
        checked[spec.name] = np.ascontiguousarray(array)
    if len(set(rows.values())) > 1:
        counts = ", ".join(f"{name!r} {n}" for name, n in rows.items())
        raise InvalidRequest(f"the inputs differ in their number of rows (the first dimension): {counts}")
    return checked


# --- finding the model ------------------------------------------------------------------------


def _kind_of(path: Path) -> str | None:
    """The format ``path`` is by its name (a folder: by its saved_model.pb), or None."""
    if path.is_dir():
        return "savedmodel" if (path / "saved_model.pb").is_file() else None
    if path.name == PYTHON_FILE:
        return "python"
    return _SUFFIXES.get(path.suffix.lower())


def _locate(path: Path, format: str | None) -> tuple[Path, str]:
    """The model file or folder at ``path`` (or the one inside it) and its format."""
    if not path.exists():
        raise InvalidRequest(f"no model at {path}: no such file or folder")
    kind = _kind_of(path)
    if kind is not None and format in (None, kind):
        return path, kind
    if path.is_file():
        if format is not None:  # named by the deployment: the loader says whether it is right
            return path, format
        raise InvalidRequest(
            f"cannot tell the format of {path.name}: deploy {_ACCEPTED}, or name its format ({', '.join(FORMATS)})"
        )
    entries = sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.name != SPEC_FILE)
    models = [(p, k) for p in entries if (k := _kind_of(p)) is not None and format in (None, k)]
    if len(models) == 1:
        return models[0]
    if models:
        raise InvalidRequest(
            f"{path} holds several models ({_listing([p for p, _ in models])}): "
            "deploy one file, or a folder holding only one model"
        )
    found = f"found {_listing(entries)}" if entries else "it is empty"
    what = f"{format} model" if format else "model"
    raise InvalidRequest(f"no {what} in {path} ({found}): deploy {_ACCEPTED}")


def _listing(paths: Sequence[Path], most: int = 10) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in paths[:most]]
    more = f" and {len(paths) - most} more" if len(paths) > most else ""
    return ", ".join(names) + more


# --- the spec file ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Declared:
    """What a spec file declares; None where it says nothing (no file, or no such key)."""

    inputs: list[TensorSpec] | None = None
    outputs: list[TensorSpec] | None = None


def _read_spec_file(model: Path) -> _Declared:
    """The spec file inside a model folder, else beside the model; an empty ``_Declared`` when none."""
    candidates = ([model / SPEC_FILE] if model.is_dir() else []) + [model.parent / SPEC_FILE]
    file = next((c for c in candidates if c.is_file()), None)
    if file is None:
        return _Declared()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"{SPEC_FILE} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f'{SPEC_FILE} must hold an object with "inputs" and "outputs" lists')
    unknown = set(data) - {"inputs", "outputs"}
    if unknown:
        raise InvalidRequest(f'{SPEC_FILE}: unknown key(s) {_quoted(sorted(unknown))}: use "inputs" and "outputs"')
    lists: dict[str, list[TensorSpec] | None] = {}
    for key in ("inputs", "outputs"):
        entries = data.get(key)
        if entries is None:
            lists[key] = None
            continue
        if not isinstance(entries, list) or not entries:
            raise InvalidRequest(f'{SPEC_FILE}: "{key}" must be a non-empty list of {{name, datatype, shape}}')
        specs = [TensorSpec.parse(entry, f"{SPEC_FILE} {key}[{i}]") for i, entry in enumerate(entries)]
        _check_unique(specs, f"{SPEC_FILE} {key}")
        lists[key] = specs
    return _Declared(lists["inputs"], lists["outputs"])


def _check_unique(specs: list[TensorSpec], where: str) -> None:
    names = [s.name for s in specs]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise InvalidRequest(f"{where}: {_quoted(doubled)} named more than once")


def _declare(
    found: list[TensorSpec], declared: list[TensorSpec] | None, kind: str, unranked: set[str]
) -> list[TensorSpec]:
    """The published specs of the model's tensors ``found``, in their order, with the spec file's
    declarations over them: by name where the spec file names the same tensors, else in order."""
    if declared is None:
        if unranked:
            raise InvalidRequest(
                f"the model does not fix the rank of its {kind} {_quoted(sorted(unranked))}: "
                f"declare their shapes in {SPEC_FILE} beside it"
            )
        return found
    if len(declared) != len(found):
        raise InvalidRequest(
            f"{SPEC_FILE} declares {len(declared)} {kind} but the model has {len(found)}: "
            f"{_quoted([s.name for s in found])}"
        )
    by_name = {s.name: s for s in declared}
    if set(by_name) == {s.name for s in found}:
        return [by_name[s.name] for s in found]
    return list(declared)


# --- the loaded models ------------------------------------------------------------------------


class _Loaded(abc.ABC):
    """A loaded model. Subclasses load it and run it on ``_run`` (arrays in and out by the names
    the model itself uses); this class maps those to the published names and datatypes."""

    format = ""

    def __init__(
        self,
        found_inputs: list[TensorSpec],
        found_outputs: list[TensorSpec],
        declared: _Declared,
        device: str,
        unranked: frozenset[str] = frozenset(),
    ) -> None:
        self.device = device
        self._native_inputs = found_inputs
        self._native_outputs = found_outputs
        self.inputs = _declare(
            found_inputs, declared.inputs, "inputs", {n for n in unranked if n in _names(found_inputs)}
        )
        self.outputs = _declare(
            found_outputs, declared.outputs, "outputs", {n for n in unranked if n in _names(found_outputs)}
        )
        # Inputs whose declared datatype differs from the model's: cast on the way in.
        self._casts = {
            public.name: numpy_dtype(native.datatype)
            for public, native in zip(self.inputs, self._native_inputs)
            if public.datatype != native.datatype
        }

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for a batch checked by ``check_inputs``."""
        feed = {}
        for public, native in zip(self.inputs, self._native_inputs):
            array = inputs[public.name]
            if public.name in self._casts:
                array = array.astype(self._casts[public.name])
            feed[native.name] = array
        result = self._run(feed)
        return {
            public.name: _conform(result, native.name, public)
            for public, native in zip(self.outputs, self._native_outputs)
        }

    @abc.abstractmethod
    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        """The framework's own call: native input names in, native output names to values out."""

    def __repr__(self) -> str:
        return f"<{self.format} model on {self.device}: {_names(self.inputs)} → {_names(self.outputs)}>"


def _conform(result: dict[str, Any], name: str, spec: TensorSpec) -> np.ndarray:
    """The output ``name`` of a model's ``result``, as an array of its published datatype."""
    if name not in result:
        raise RemoteError(f"the model returned no output {name!r} (it returned {_quoted(list(result))})")
    array = np.asarray(result[name])
    if spec.datatype == "BYTES":
        if array.dtype.kind not in "OSU":
            raise RemoteError(f"output {spec.name!r}: declared BYTES, but the model returned {array.dtype.name} values")
        return array if array.dtype.kind == "O" else array.astype(object)
    dtype = numpy_dtype(spec.datatype)
    if array.dtype != dtype:
        if not np.can_cast(array.dtype, dtype, "same_kind"):
            raise RemoteError(
                f"output {spec.name!r}: declared {spec.datatype}, "
                f"but the model returned {_datatype_name(array.dtype)} values"
            )
        array = array.astype(dtype)
    return array


def _outputs_by_name(value: Any, natives: list[TensorSpec], what: str) -> dict[str, Any]:
    """A framework's result (one array, a sequence of them in declared order, or a dict) by output name."""
    names = _names(natives)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise RemoteError(f"{what} returned {len(value)} outputs but declares {len(names)}: {_quoted(names)}")
        return dict(zip(names, value))
    if len(names) != 1:
        raise RemoteError(f"{what} returned one output but declares {len(names)}: {_quoted(names)}")
    return {names[0]: value}


class _SavedModel(_Loaded):
    format = "savedmodel"

    def __init__(self, path: Path, declared: _Declared, device: str) -> None:
        import tensorflow as tf

        self._tf = tf
        on_gpu = device == "gpu" and bool(tf.config.list_physical_devices("GPU"))
        self._where = "/GPU:0" if on_gpu else "/CPU:0"
        try:
            with tf.device(self._where):
                self._saved = tf.saved_model.load(str(path))  # kept: the signature holds only weak references
        except Exception as e:
            raise InvalidRequest(f"cannot load the SavedModel {path.name}: {_message(e)}") from None
        signatures = dict(self._saved.signatures)
        if "serving_default" not in signatures:
            raise InvalidRequest(
                f"the SavedModel {path.name} has no serving_default signature (it has: "
                f"{_quoted(list(signatures)) or 'none'}): save it with Keras' model.export(path), or "
                "tf.saved_model.save(obj, path, signatures={'serving_default': ...})"
            )
        self._signature = signatures["serving_default"]
        args, kwargs = self._signature.structured_input_signature
        if args:
            raise InvalidRequest(
                f"the SavedModel {path.name}'s serving_default signature takes positional "
                "arguments: serving signatures take named tensors"
            )
        outputs_struct = self._signature.structured_outputs
        if not isinstance(outputs_struct, Mapping):
            outputs_struct = {"output_0": outputs_struct}
        # A signature's tensors are named, in no order of their own: published as a, b ... output_0, output_1 ...
        unranked: set[str] = set()
        inputs = [self._spec(name, kwargs[name], unranked) for name in sorted(kwargs, key=_natural)]
        outputs = [self._spec(name, outputs_struct[name], unranked) for name in sorted(outputs_struct, key=_natural)]
        super().__init__(inputs, outputs, declared, "gpu" if on_gpu else "cpu", frozenset(unranked))

    def _spec(self, name: str, spec: Any, unranked: set[str]) -> TensorSpec:
        try:
            datatype = datatype_of(np.dtype(spec.dtype.as_numpy_dtype))
        except (InvalidRequest, TypeError) as e:
            raise InvalidRequest(
                f"the SavedModel's tensor {name!r} is a {spec.dtype.name}, which the prediction "
                f"protocols cannot carry ({e})"
            ) from None
        if spec.shape.rank is None:
            unranked.add(name)
            return TensorSpec(name, datatype, (-1,))
        return TensorSpec(name, datatype, tuple(-1 if d is None else d for d in spec.shape.as_list()))

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        tf = self._tf
        with tf.device(self._where):
            result = self._signature(**{name: tf.constant(array) for name, array in feed.items()})
        return {
            name: tensor.numpy()
            for name, tensor in _outputs_by_name(result, self._native_outputs, "the SavedModel").items()
        }


class _KerasModel(_Loaded):
    format = "keras"

    def __init__(self, path: Path, declared: _Declared, device: str) -> None:
        import keras

        on_gpu = device == "gpu" and bool(keras.distribution.list_devices("gpu"))
        self._keras = keras
        self._where = "gpu:0" if on_gpu else "cpu:0"
        try:
            with keras.device(self._where):
                # safe_mode=False: Lambda layers load too; the deployer can run code on this server anyway.
                model = keras.saving.load_model(path, compile=False, safe_mode=False)
        except Exception as e:
            raise InvalidRequest(f"cannot load the Keras model {path.name}: {_message(e)}") from None
        # XLA would compile the model anew for every batch size the batcher makes.
        model.jit_compile = False
        self._model = model
        self._input_keys: list[str] | None = None  # the model takes a dict with these keys (in input order)
        tensors = getattr(model, "inputs", None)
        if tensors:  # a functional or sequential model: named by its input layers
            inputs = [_keras_spec(t.name, t) for t in tensors]
            structure = _keras_structure(model, "input")
            if isinstance(structure, Mapping):
                key_of = {id(t): key for key, t in structure.items()}
                self._input_keys = [key_of.get(id(t), t.name) for t in tensors]
        elif declared.inputs is not None:  # a subclassed model: named only by the spec file
            inputs = declared.inputs
        else:
            raise InvalidRequest(
                f"the Keras model {path.name} (a subclassed model) names no inputs: declare them "
                f"in {SPEC_FILE} beside it, e.g. {_EXAMPLE}"
            )
        outputs_tensors = getattr(model, "outputs", None)
        if outputs_tensors:
            structure = _keras_structure(model, "output")
            if isinstance(structure, Mapping):
                outputs = [_keras_spec(str(key), t) for key, t in structure.items()]
            else:
                names = list(
                    getattr(model, "output_names", None) or [t._keras_history.operation.name for t in outputs_tensors]
                )
                outputs = [_keras_spec(n, t) for n, t in zip(_unique(names), outputs_tensors)]
        elif declared.outputs is not None:
            outputs = declared.outputs
        else:
            raise InvalidRequest(
                f"the Keras model {path.name} (a subclassed model) names no outputs: declare them "
                f"in {SPEC_FILE} beside it, e.g. {_EXAMPLE}"
            )
        super().__init__(inputs, outputs, declared, "gpu" if on_gpu else "cpu")

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        arrays = [feed[spec.name] for spec in self._native_inputs]
        x: Any
        if self._input_keys is not None:
            x = dict(zip(self._input_keys, arrays))
        else:
            x = arrays[0] if len(arrays) == 1 else arrays
        # predict_on_batch runs the model's compiled predict function: ~0.5 ms a small batch on a
        # CPU, where model(x, training=False) runs it eagerly in ~1.2 ms.
        with self._keras.device(self._where):
            result = self._model.predict_on_batch(x)
        return _outputs_by_name(result, self._native_outputs, "the Keras model")


def _keras_structure(model: Any, which: str) -> Any:
    """``model.input`` / ``model.output`` (a tensor, list or dict), or None where Keras has none."""
    try:
        return getattr(model, which)
    except (AttributeError, ValueError):
        return None


def _keras_spec(name: str, tensor: Any) -> TensorSpec:
    return TensorSpec(name, datatype_of(np.dtype(tensor.dtype)), tuple(-1 if d is None else d for d in tensor.shape))


class _TorchScriptModel(_Loaded):
    format = "torchscript"

    def __init__(self, path: Path, declared: _Declared, device: str) -> None:
        import torch

        self._torch = torch
        self._where = "cuda:0" if device == "gpu" and torch.cuda.is_available() else "cpu"
        try:
            with warnings.catch_warnings():
                # TorchScript is the format deployed here; torch's advice to move off it is for the author.
                warnings.filterwarnings(
                    "ignore", message=r"`torch\.jit\.load` is deprecated", category=DeprecationWarning
                )
                self._module = torch.jit.load(str(path), map_location=self._where)
        except Exception as e:
            raise InvalidRequest(f"cannot load the TorchScript model {path.name}: {_message(e)}") from None
        self._module.eval()
        arguments = self._forward_arguments()
        if declared.inputs is None or declared.outputs is None:
            raise InvalidRequest(
                f"a TorchScript model does not name its inputs and outputs: declare them in {SPEC_FILE} beside "
                f"{path.name}, inputs in the order forward() takes them, -1 for the batch and any variable "
                f"dimension, e.g. {_example(arguments)}"
            )
        bytes_inputs = [s.name for s in declared.inputs if s.datatype == "BYTES"]
        if bytes_inputs:
            raise InvalidRequest(
                f"{SPEC_FILE} declares BYTES input(s) {_quoted(bytes_inputs)}: TorchScript takes numeric tensors only"
            )
        if arguments is not None:
            required, everything = arguments
            if not len(required) <= len(declared.inputs) <= len(everything):
                raise InvalidRequest(
                    f"{SPEC_FILE} declares {len(declared.inputs)} inputs but {path.name}'s forward() "
                    f"takes {_quoted(everything)}"
                )
        super().__init__(declared.inputs, declared.outputs, _Declared(), "gpu" if self._where != "cpu" else "cpu")

    def _forward_arguments(self) -> tuple[list[str], list[str]] | None:
        """forward()'s (required, all) argument names, or None where the module does not say."""
        try:
            arguments = self._module.forward.schema.arguments[1:]  # [0] is self
        except (AttributeError, RuntimeError):
            return None
        return [a.name for a in arguments if not a.has_default_value()], [a.name for a in arguments]

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        torch = self._torch
        # torch.from_numpy shares memory and warns for read-only arrays (the worker's request buffers).
        tensors = [
            torch.from_numpy(a if a.flags.writeable else a.copy()).to(self._where)
            for a in (feed[s.name] for s in self._native_inputs)
        ]
        with torch.inference_mode():
            result = self._module(*tensors)
        by_name = _outputs_by_name(result, self._native_outputs, "the TorchScript model")
        return {name: t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t for name, t in by_name.items()}


class _OnnxModel(_Loaded):
    format = "onnx"

    def __init__(self, path: Path, declared: _Declared, device: str) -> None:
        import onnxruntime

        providers = ["CPUExecutionProvider"]
        if device == "gpu" and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self._session = onnxruntime.InferenceSession(str(path), providers=providers)
        except Exception as e:
            raise InvalidRequest(f"cannot load the ONNX model {path.name}: {_message(e)}") from None
        unranked: set[str] = set()
        inputs = [_onnx_spec(arg, unranked) for arg in self._session.get_inputs()]
        outputs = [_onnx_spec(arg, unranked) for arg in self._session.get_outputs()]
        on_gpu = "CUDAExecutionProvider" in self._session.get_providers()
        super().__init__(inputs, outputs, declared, "gpu" if on_gpu else "cpu", frozenset(unranked))
        self._output_names = _names(self._native_outputs)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        return dict(zip(self._output_names, self._session.run(self._output_names, feed)))


def _onnx_spec(arg: Any, unranked: set[str]) -> TensorSpec:
    datatype = _ONNX_TYPES.get(arg.type)
    if datatype is None:
        raise InvalidRequest(
            f"the ONNX model's tensor {arg.name!r} is a {arg.type}, which the prediction protocols "
            f"cannot carry: serve models whose inputs and outputs are tensors"
        )
    if arg.shape is None:
        unranked.add(arg.name)
        return TensorSpec(arg.name, datatype, (-1,))
    return TensorSpec(arg.name, datatype, tuple(d if isinstance(d, int) else -1 for d in arg.shape))


class _PythonModel(_Loaded):
    format = "python"

    def __init__(self, path: Path, declared: _Declared, device: str) -> None:
        import cloudpickle

        try:
            with open(path, "rb") as file:
                self._object = cloudpickle.load(file)
        except Exception as e:
            raise InvalidRequest(f"cannot unpickle {path.name}: {_message(e)}") from None
        kind = type(self._object).__name__
        if not callable(getattr(self._object, "predict", None)):
            raise InvalidRequest(f"{path.name} holds a {kind} without a predict(batch) method")
        specs: dict[str, list[TensorSpec]] = {}
        for which in ("inputs", "outputs"):
            value = getattr(self._object, which, None)
            if value is None:
                if getattr(declared, which) is None:
                    raise InvalidRequest(
                        f"{path.name} holds a {kind} without an {which!r} attribute: give it a list of "
                        f"(name, datatype, shape), or declare them in {SPEC_FILE}"
                    )
                specs[which] = getattr(declared, which)
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
                raise InvalidRequest(
                    f"{kind}.{which} must be a non-empty list of (name, datatype, shape), got {value!r}"
                )
            specs[which] = [TensorSpec.parse(item, f"{kind}.{which}[{i}]") for i, item in enumerate(value)]
            _check_unique(specs[which], f"{kind}.{which}")
        hook = getattr(self._object, "load", None)
        if callable(hook):
            try:
                hook()
            except Exception:  # the user's own code: its traceback is theirs to see
                raise InvalidRequest(f"{kind}.load() failed:\n{traceback.format_exc(limit=-8)}") from None
        super().__init__(specs["inputs"], specs["outputs"], declared, device)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        result = self._object.predict(feed)
        if not isinstance(result, Mapping):
            raise RemoteError(
                f"{type(self._object).__name__}.predict returned a {type(result).__name__}, "
                "not a dict of output name → array"
            )
        return dict(result)


_LOADERS: dict[str, Callable[[Path, _Declared, str], _Loaded]] = {
    "savedmodel": _SavedModel,
    "keras": _KerasModel,
    "torchscript": _TorchScriptModel,
    "onnx": _OnnxModel,
    "python": _PythonModel,
}


# --- messages ---------------------------------------------------------------------------------

_EXAMPLE = (
    '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}], '
    '"outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}'
)


def _example(arguments: tuple[list[str], list[str]] | None) -> str:
    """An example spec file, with forward()'s own argument names where known."""
    names = (arguments[1] if arguments else None) or ["x"]
    inputs = ", ".join(f'{{"name": "{n}", "datatype": "FP32", "shape": [-1, 8]}}' for n in names)
    return f'{{"inputs": [{inputs}], "outputs": [{{"name": "y", "datatype": "FP32", "shape": [-1, 4]}}]}}'


def _message(error: BaseException) -> str:
    """A loader's exception as one message: its text, or its type where it has none."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _datatype_name(dtype: np.dtype) -> str:
    try:
        return datatype_of(dtype)
    except InvalidRequest:
        return dtype.name


def _natural(name: str) -> list[Any]:
    """A sort key that puts output_2 before output_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _names(specs: list[TensorSpec]) -> list[str]:
    return [s.name for s in specs]


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _unique(names: list[str]) -> list[str]:
    """``names``, with a ``_1``, ``_2`` ... suffix on repeats (a layer with several outputs)."""
    out: list[str] = []
    for name in names:
        candidate, n = name, 0
        while candidate in out:
            n += 1
            candidate = f"{name}_{n}"
        out.append(candidate)
    return out
