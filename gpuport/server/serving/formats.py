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
dimension is the batch. This module is the contract; the loaders, one per format, are ``loaders.py``,
and each framework is imported only when a model of its format is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpuport._packages import missing_package
from gpuport.protocol.datatypes import datatype_of, numpy_dtype
from gpuport.protocol.errors import InvalidRequest

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
    from gpuport.server.serving.loaders import LOADERS  # each imports its framework when it loads

    loader = LOADERS[format]
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


# --- messages ---------------------------------------------------------------------------------


def _datatype_name(dtype: np.dtype) -> str:
    try:
        return datatype_of(dtype)
    except InvalidRequest:
        return dtype.name


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)
