"""The framework loaders behind ``formats.load``: each format's model loaded with its own framework
(TensorFlow, Keras, torch, onnxruntime, cloudpickle, imported only when a model of its format is
loaded), its tensors described as ``TensorSpec`` and its outputs conformed to what it publishes.
The contract they meet (``TensorSpec``, ``Model``, the spec file, ``check_inputs``) is ``formats.py``'s.
"""

from __future__ import annotations

import abc
import re
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpuport.protocol.datatypes import datatype_of, numpy_dtype
from gpuport.protocol.errors import InvalidRequest, RemoteError
from gpuport.server.serving.formats import (
    SPEC_FILE,
    TensorSpec,
    _check_unique,
    _datatype_name,
    _declare,
    _Declared,
    _quoted,
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


LOADERS: dict[str, Callable[[Path, _Declared, str], _Loaded]] = {
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


def _natural(name: str) -> list[Any]:
    """A sort key that puts output_2 before output_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _names(specs: list[TensorSpec]) -> list[str]:
    return [s.name for s in specs]


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
