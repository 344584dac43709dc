"""Request and response bodies of the two REST prediction protocols, to and from numpy arrays.

KServe v2 (the Open Inference Protocol), with Triton's binary tensor data extension: a JSON header,
optionally followed by the raw bytes of the inputs (or outputs) that say ``"binary_data_size"`` in
their parameters, in the order they are listed; the ``Inference-Header-Content-Length`` HTTP header
gives the JSON header's length. TensorFlow Serving's REST ``predict``: the row format
(``"instances"``) and the columnar format (``"inputs"``), binary strings as ``{"b64": "..."}``.

No web framework here: bytes in, arrays out, and back. Every malformed request raises
``InvalidRequest`` saying what was wrong and what was expected.

Choices where the protocols leave room, and what decided them:

- NaN and ±Infinity travel as the bare tokens ``NaN``, ``Infinity``, ``-Infinity``, both ways. Triton
  reads and writes them so (rapidjson's NaN/Inf flags, triton-inference-server/server#3870),
  tritonclient's parser (python-rapidjson) accepts them, and TF Serving's REST API documents them.
- FP16 and BF16 are accepted and written as JSON numbers. Triton refuses them in JSON; the KServe
  spec does not, and tritonclient's ``set_data_from_numpy(..., binary_data=False)`` sends FP16 so.
- BYTES outputs that are not valid UTF-8 cannot be JSON strings: such an output goes out as binary
  data whatever was asked (tritonclient reads a binary output whether or not it asked for one).
  Triton writes the raw bytes into the JSON, which its own client then fails to parse. TF Serving
  writes ``{"b64": ...}`` for string outputs whose name ends in ``_bytes``; here also for any string
  that is not valid UTF-8, for the same reason.
- JSON numbers are typed strictly, as Triton and TF Serving do: ``3.5`` or ``3.0`` for an integer
  input, ``true`` for a number, ``1`` for a boolean or a number out of the datatype's range is an error.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuport.protocol.datatypes import TF_ENUM, TF_NAMES, datatype_of, numpy_dtype
from gpuport.protocol.errors import InvalidRequest, ServerError
from gpuport.server.serving.tensors import pack_bytes, unpack_bytes

__all__ = [
    "InferInput",
    "InferRequest",
    "RequestedOutput",
    "form_kserve",
    "form_tfs_predict",
    "parse_kserve",
    "parse_tfs_predict",
    "tfs_error",
    "tfs_to_inputs",
]

# TF Serving: a binary string is the JSON object {"b64": "<base64>"}.
_B64 = "b64"
# TF Serving: string outputs whose name ends so are written as base64 objects.
_BYTES_SUFFIX = "_bytes"
_LITTLE_ENDIAN = sys.byteorder == "little"


# ---------------------------------------------------------------------------------------------------
# KServe v2


@dataclass
class InferInput:
    """One input tensor of a KServe v2 request.

    ``array`` has ``shape`` and the numpy dtype of ``datatype`` (BYTES: an object array of ``bytes``).
    An input sent as binary data is a read-only view into the request body where its bytes are
    aligned, a copy where they are not.
    """

    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestedOutput:
    """An output a KServe v2 request asks for; ``binary`` is None when the request does not say."""

    name: str
    binary: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """A parsed KServe v2 inference request. ``id`` is "" when the request has none."""

    id: str
    inputs: list[InferInput]
    outputs: list[RequestedOutput]
    parameters: dict[str, Any]

    def binary_output(self, name: str) -> bool:
        """Whether output ``name`` goes back as binary data, by Triton's precedence: the output's own
        ``binary_data`` parameter, else the request's ``binary_data_output`` parameter, else JSON."""
        for output in self.outputs:
            if output.name == name and output.binary is not None:
                return output.binary
        return bool(self.parameters.get("binary_data_output", False))


def parse_kserve(body: bytes, header_length: int | None) -> InferRequest:
    """Parse a KServe v2 inference request body.

    ``header_length`` is the ``Inference-Header-Content-Length`` HTTP header (None when absent): the
    length of the JSON header, which binary input data follows. Raises InvalidRequest for anything
    malformed: not JSON, a missing field, an unknown datatype, data that does not match its shape or
    datatype, binary sizes that do not add up to the body.

    >>> body = b'{"inputs": [{"name": "x", "shape": [2], "datatype": "INT32", "data": [1, 2]}]}'
    >>> parse_kserve(body, None).inputs[0].array
    array([1, 2], dtype=int32)
    """
    size = len(body)
    if header_length is None:
        end = size
    elif isinstance(header_length, bool) or not isinstance(header_length, int) or header_length <= 0:
        raise InvalidRequest(
            f"Inference-Header-Content-Length must be a positive integer (the length of the JSON header), "
            f"not {header_length!r}"
        )
    elif header_length > size:
        raise InvalidRequest(
            f"Inference-Header-Content-Length is {header_length} but the request body has only {size} bytes: "
            "it must give the length of the JSON header at the start of the body"
        )
    else:
        end = header_length
    header = _load_json(bytes(body[:end]) if end < size or not isinstance(body, bytes) else body, "request")
    if not isinstance(header, dict):
        raise InvalidRequest(
            f"the request must be a JSON object with 'inputs', not {_json_type(header)}: "
            'send {"inputs": [{"name": ..., "shape": [...], "datatype": ..., "data": [...]}]}'
        )
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest(f"the request's 'id' must be a string, not {_json_type(request_id)}")
    parameters = _parameters(header, "the request")
    if not isinstance(parameters.get("binary_data_output", False), bool):
        raise InvalidRequest("the request parameter 'binary_data_output' must be true or false")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidRequest(
            "the request has no 'inputs' list"
            if raw_inputs is None
            else f"the request's 'inputs' must be a list of tensors, not {_json_type(raw_inputs)}"
        )
    view = memoryview(body)
    offset = end
    inputs: list[InferInput] = []
    names: set[str] = set()
    for index, raw in enumerate(raw_inputs):
        item, offset = _parse_input(raw, index, view, offset, header_length is not None)
        if item.name in names:
            raise InvalidRequest(f"input '{item.name}' is given twice: send each input once")
        names.add(item.name)
        inputs.append(item)
    if offset != size:
        raise InvalidRequest(
            f"the request body has {size - offset} bytes after the last binary input: the inputs' "
            f"binary_data_size add up to {offset - end} bytes, but {size - end} follow the JSON header"
        )
    return InferRequest(request_id, inputs, _parse_outputs(header.get("outputs")), parameters)


def form_kserve(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: list[tuple[str, np.ndarray]],
    binary: Callable[[str], bool] | set[str] | bool,
    *,
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """Form a KServe v2 inference response body.

    ``binary`` says which outputs go as binary data: all (True), none (False), those named in a set,
    or those a predicate accepts (``InferRequest.binary_output``). A BYTES output that is not valid
    UTF-8 goes as binary data regardless. Returns the body and, when any output is binary, the JSON
    header's length for the ``Inference-Header-Content-Length`` HTTP header (else None). Raises
    ServerError for an output whose dtype has no KServe datatype.
    """
    wants_binary = _binary_predicate(binary)
    entries: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for name, value in outputs:
        array = np.asarray(value)
        try:
            datatype = datatype_of(array.dtype)
        except InvalidRequest as error:
            raise ServerError(f"output '{name}' of model '{model_name}': {error}") from None
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        data = None if wants_binary(name) else _kserve_json_data(array, datatype)
        if data is None:
            raw = _binary_data(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = data
        entries.append(entry)
    response: dict[str, Any] = {}
    if request_id:
        response["id"] = request_id
    response["model_name"] = model_name
    response["model_version"] = model_version
    if parameters:
        response["parameters"] = parameters
    response["outputs"] = entries
    header = _dump_json(response)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _parse_input(
    raw: Any, index: int, view: memoryview, offset: int, has_header_length: bool
) -> tuple[InferInput, int]:
    """One entry of 'inputs', and the body offset after its binary data (if any)."""
    if not isinstance(raw, dict):
        raise InvalidRequest(
            f"inputs[{index}] must be an object with 'name', 'shape', 'datatype' and 'data', not {_json_type(raw)}"
        )
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"inputs[{index}] has no 'name': give each input its name as a string")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidRequest(f"input '{name}' has no 'datatype': give it as a string such as \"FP32\"")
    try:
        dtype = numpy_dtype(datatype)
    except InvalidRequest as error:
        raise InvalidRequest(f"input '{name}': {error}") from None
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidRequest(
            f"input '{name}' has no valid 'shape' (got {_short(shape)}): give a list of non-negative integers"
        )
    count = math.prod(shape)
    parameters = _parameters(raw, f"input '{name}'")
    if "shared_memory_region" in parameters:
        raise InvalidRequest(f"input '{name}' is in shared memory, which this server does not support: send its data")
    size = parameters.get("binary_data_size")
    if size is not None and "data" in raw:
        raise InvalidRequest(f"input '{name}' has both 'data' and binary_data_size: send its data one way")
    if size is not None:
        if type(size) is not int or size < 0:
            raise InvalidRequest(f"input '{name}': binary_data_size must be a non-negative integer, not {size!r}")
        if not has_header_length:
            raise InvalidRequest(
                f"input '{name}' is sent as binary data but the request has no Inference-Header-Content-Length "
                "header: send the JSON header's length in it"
            )
        if offset + size > len(view):
            raise InvalidRequest(
                f"input '{name}' has binary_data_size {size} but only {len(view) - offset} bytes are left in "
                "the request body: binary inputs must follow the JSON header in the order they are listed"
            )
        array = _from_binary(view[offset : offset + size], name, datatype, dtype, shape, count)
        return InferInput(name, datatype, shape, array, parameters), offset + size
    if "data" not in raw:
        raise InvalidRequest(f"input '{name}' has no 'data' (and no binary_data_size parameter): send its values")
    data = raw["data"]
    if not isinstance(data, list):
        raise InvalidRequest(f"'data' of input '{name}' must be a list of values, not {_json_type(data)}")
    what = f"'data' of input '{name}'"
    array = _json_to_array(data, what, allow_b64=False)
    if array.ndim > 1 and list(array.shape) != shape:
        raise InvalidRequest(
            f"{what} is nested as {list(array.shape)} but the input's shape is {shape}: nest it as the shape "
            "or send it flat"
        )
    if array.size != count:
        raise InvalidRequest(f"{what} has {array.size} elements but shape {shape} needs {count}")
    array = _cast(array, dtype, what, datatype).reshape(shape)
    return InferInput(name, datatype, shape, array, parameters), offset


def _from_binary(
    chunk: memoryview, name: str, datatype: str, dtype: np.dtype, shape: list[int], count: int
) -> np.ndarray:
    """An input's array from its binary data: a view where it can be, BYTES unpacked."""
    if datatype == "BYTES":
        array = unpack_bytes(chunk, f"binary data of BYTES input '{name}'", count)
        if len(array) != count:
            raise InvalidRequest(
                f"binary data of BYTES input '{name}' holds {len(array)} elements but shape {shape} needs {count}"
            )
        return array.reshape(shape)
    expected = count * dtype.itemsize
    if len(chunk) != expected:
        raise InvalidRequest(
            f"input '{name}' has binary_data_size {len(chunk)} but shape {shape} of {datatype} needs {expected} "
            f"bytes ({count} elements of {dtype.itemsize})"
        )
    array = np.frombuffer(chunk, dtype=dtype if _LITTLE_ENDIAN else dtype.newbyteorder("<"))
    if not array.flags.aligned:
        array = array.copy()
    if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise InvalidRequest(f"binary data of BOOL input '{name}' has bytes other than 0 and 1")
    return array.reshape(shape)


def _parse_outputs(raw: Any) -> list[RequestedOutput]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest(f"the request's 'outputs' must be a list of objects, not {_json_type(raw)}")
    outputs: list[RequestedOutput] = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise InvalidRequest(f'outputs[{index}] must be an object with a \'name\': {{"name": "output0"}}')
        name = item["name"]
        if name in names:
            raise InvalidRequest(f"output '{name}' is requested twice: ask for each output once")
        names.add(name)
        parameters = _parameters(item, f"requested output '{name}'")
        if "shared_memory_region" in parameters:
            raise InvalidRequest(
                f"output '{name}' asks for shared memory, which this server does not support: leave it out"
            )
        if parameters.get("classification"):
            raise InvalidRequest(
                f"output '{name}' asks for the classification extension (class_count), which this server does not "
                "support: ask for the raw output and take its top classes"
            )
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidRequest(f"output '{name}': parameter 'binary_data' must be true or false, not {binary!r}")
        outputs.append(RequestedOutput(name, binary, parameters))
    return outputs


def _binary_predicate(binary: Callable[[str], bool] | set[str] | bool) -> Callable[[str], bool]:
    if isinstance(binary, bool):
        return lambda _name: binary
    if isinstance(binary, (set, frozenset)):
        return binary.__contains__
    return binary


def _kserve_json_data(array: np.ndarray, datatype: str) -> list[Any] | None:
    """An output's values as a flat JSON list; None for BYTES that are not valid UTF-8."""
    if datatype == "BYTES":
        return _texts(array.ravel())
    if datatype in ("FP16", "BF16"):
        return array.astype(np.float32).ravel().tolist()
    return array.ravel().tolist()


def _binary_data(array: np.ndarray, datatype: str) -> bytes | memoryview:
    """An output's binary data: little-endian, row-major; BYTES as length-prefixed elements."""
    if datatype == "BYTES":
        return pack_bytes(array)
    dtype = array.dtype if _LITTLE_ENDIAN else array.dtype.newbyteorder("<")
    return np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8).data


def _texts(flat: np.ndarray) -> list[str] | None:
    """Elements of a string tensor as text; None when one is bytes that are not valid UTF-8."""
    texts: list[str] = []
    for item in flat.tolist():
        if isinstance(item, bytes):
            try:
                texts.append(item.decode())
            except UnicodeDecodeError:
                return None
        else:
            texts.append(item if isinstance(item, str) else str(item))
    return texts


# ---------------------------------------------------------------------------------------------------
# TensorFlow Serving REST predict


def parse_tfs_predict(body: bytes) -> tuple[str, dict[str, np.ndarray] | np.ndarray, str]:
    """Parse a TF Serving REST ``predict`` request: ``(signature_name, inputs, style)``.

    ``signature_name`` is "" when the request names none (the default signature). ``inputs`` is a
    dict of named inputs, or one array when the request has a single unnamed input. ``style`` is
    ``"row"`` (``instances``) or ``"columnar"`` (``inputs``), for ``form_tfs_predict``. Arrays have
    JSON's own types (int64, float64, bool, objects of bytes for strings); ``tfs_to_inputs`` casts
    them to the signature's. Raises InvalidRequest when the body is not such a request, when it has
    both or neither of ``instances`` and ``inputs``, or when rows differ in shape.

    >>> parse_tfs_predict(b'{"instances": [1.0, 2.0, 5.0]}')
    ('', array([1., 2., 5.]), 'row')
    """
    request = _load_json(body, "request")
    if not isinstance(request, dict):
        raise InvalidRequest(
            f'the request must be a JSON object such as {{"instances": [...]}}, not {_json_type(request)}'
        )
    signature = request.get("signature_name", "")
    if not isinstance(signature, str):
        raise InvalidRequest(f"'signature_name' must be a string, not {_json_type(signature)}")
    if "instances" in request and "inputs" in request:
        raise InvalidRequest(
            "the request has both 'instances' and 'inputs': send one of them, 'instances' for the row "
            "format or 'inputs' for the columnar format"
        )
    if "instances" in request:
        return signature, _parse_instances(request["instances"]), "row"
    if "inputs" in request:
        return signature, _parse_columns(request["inputs"]), "columnar"
    raise InvalidRequest(
        "the request has neither 'instances' nor 'inputs': send the inputs in one of them, "
        '{"instances": [...]} (row format) or {"inputs": ...} (columnar format)'
    )


def tfs_to_inputs(raw: dict[str, np.ndarray] | np.ndarray, specs: list[tuple[str, np.dtype]]) -> dict[str, np.ndarray]:
    """Match what ``parse_tfs_predict`` read to a signature's inputs ``[(name, dtype), ...]``.

    A single unnamed input takes the name of the signature's only input. Each array is cast to its
    declared dtype. Raises InvalidRequest for missing or unknown input names, for an unnamed input
    when the signature takes several, and for values of the wrong kind or out of range.

    >>> tfs_to_inputs(np.array([1, 2]), [("x", np.dtype("float32"))])
    {'x': array([1., 2.], dtype=float32)}
    """
    names = [name for name, _ in specs]
    if isinstance(raw, np.ndarray):
        if len(specs) != 1:
            raise InvalidRequest(
                f"the request has one unnamed input but the signature takes {len(specs)} "
                f"({', '.join(names) or 'none'}): name them, with a list of objects in 'instances' "
                "or an object in 'inputs'"
            )
        named = {names[0]: raw}
    else:
        named = raw
        missing = [name for name in names if name not in named]
        if missing:
            raise InvalidRequest(f"missing input {', '.join(missing)}: the signature takes {', '.join(names)}")
        unknown = [name for name in named if name not in names]
        if unknown:
            raise InvalidRequest(f"unknown input {', '.join(unknown)}: the signature takes {', '.join(names)}")
    return {name: _cast(named[name], np.dtype(dtype), f"input '{name}'", _tf_name(dtype)) for name, dtype in specs}


def form_tfs_predict(outputs: dict[str, np.ndarray], style: str) -> bytes:
    """Form a TF Serving REST ``predict`` response for a request of ``style`` ("row" or "columnar").

    Row: ``{"predictions": [...]}``, one entry per row (the outputs' first dimension); with several
    outputs each entry is an object keyed by output name. Columnar: ``{"outputs": value}``, or an
    object keyed by output name with several outputs. Strings are JSON strings, except for outputs
    named ``*_bytes`` and bytes that are not valid UTF-8: ``{"b64": "..."}``. Raises InvalidRequest
    when row-format outputs do not share a first dimension (the columnar format has no such need),
    ServerError when there are no outputs.
    """
    if style not in ("row", "columnar"):
        raise ValueError(f"style must be 'row' or 'columnar', not {style!r}")
    if not outputs:
        raise ServerError("the model returned no outputs")
    arrays = {name: np.asarray(value) for name, value in outputs.items()}
    if style == "columnar":
        values = {name: _tfs_value(name, array) for name, array in arrays.items()}
        column = next(iter(values.values())) if len(values) == 1 else values
        return _dump_json({"outputs": column})
    batch = -1
    for name, array in arrays.items():
        if array.ndim == 0:
            raise InvalidRequest(
                f"output '{name}' is a scalar, which the row format cannot return: "
                'send the request in the columnar format ({"inputs": ...})'
            )
        if batch >= 0 and array.shape[0] != batch:
            raise InvalidRequest(
                f"output '{name}' has batch size {array.shape[0]}, expecting {batch}: the row format needs "
                "every output to share its first dimension; send the request in the columnar format "
                '({"inputs": ...})'
            )
        batch = array.shape[0]
    rows = {name: _tfs_value(name, array) for name, array in arrays.items()}
    if len(rows) == 1:
        predictions = next(iter(rows.values()))
    else:
        predictions = [{name: values[i] for name, values in rows.items()} for i in range(batch)]
    return _dump_json({"predictions": predictions})


def tfs_error(message: str) -> bytes:
    """A TF Serving error body: ``{"error": message}``."""
    return _dump_json({"error": message})


def _parse_instances(instances: Any) -> dict[str, np.ndarray] | np.ndarray:
    """The row format: a list of values (one unnamed input) or of objects (named inputs)."""
    if not isinstance(instances, list):
        raise InvalidRequest(f"'instances' must be a list with one entry per row, not {_json_type(instances)}")
    if not instances:
        raise InvalidRequest("'instances' is empty: send at least one row")
    if not _is_named(instances[0]):
        for index, row in enumerate(instances):
            if _is_named(row):
                raise InvalidRequest(
                    f"'instances' mixes values and objects: row 0 is a value, row {index} an object; "
                    "send all rows as values (one input) or all as objects (named inputs)"
                )
        return _rows_to_array(instances, "'instances'")
    keys = list(instances[0])
    for index, row in enumerate(instances):
        if not _is_named(row):
            raise InvalidRequest(
                f"'instances' mixes objects and values: row 0 is an object, row {index} is not; "
                "send every row as an object keyed by input name"
            )
        if row.keys() != instances[0].keys():
            raise InvalidRequest(
                f"row {index} of 'instances' has inputs {', '.join(sorted(row))} but row 0 has "
                f"{', '.join(sorted(keys))}: every row must name the same inputs"
            )
    return {key: _rows_to_array([row[key] for row in instances], f"input '{key}' in 'instances'") for key in keys}


def _rows_to_array(rows: list[Any], what: str) -> np.ndarray:
    """Stack one input's rows; rows of different shapes get TF Serving's complaint, naming the row."""
    try:
        return _json_to_array(rows, what, allow_b64=True)
    except InvalidRequest:
        first = _json_shape(rows[0])
        for index, row in enumerate(rows):
            shape = _json_shape(row)
            if shape != first:
                raise InvalidRequest(
                    f"row {index} of {what} has shape {shape} but row 0 has {first}: every row must have the "
                    "same shape (use the columnar format, 'inputs', for inputs that do not share a first "
                    "dimension)"
                ) from None
        raise


def _parse_columns(inputs: Any) -> dict[str, np.ndarray] | np.ndarray:
    """The columnar format: one value (one unnamed input) or an object of named inputs."""
    if _is_named(inputs):
        return {
            name: _json_to_array(value, f"input '{name}' in 'inputs'", allow_b64=True) for name, value in inputs.items()
        }
    return _json_to_array(inputs, "'inputs'", allow_b64=True)


def _is_named(value: Any) -> bool:
    """A JSON object of named inputs, as opposed to a value or a {"b64": ...} string."""
    return isinstance(value, dict) and not _is_b64(value)


def _is_b64(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(_B64), str)


def _json_shape(value: Any) -> list[int]:
    """Shape of a nested list by its first elements, as TF Serving reads it."""
    shape: list[int] = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _tfs_value(name: str, array: np.ndarray) -> Any:
    """An output as nested JSON values."""
    if array.dtype.kind in "OSU":
        as_b64 = name.endswith(_BYTES_SUFFIX)
        items: list[Any] = []
        for item in array.ravel().tolist():
            if isinstance(item, bytes):
                if not as_b64:
                    try:
                        items.append(item.decode())
                        continue
                    except UnicodeDecodeError:
                        pass
                items.append({_B64: base64.b64encode(item).decode()})
            else:
                text = item if isinstance(item, str) else str(item)
                items.append({_B64: base64.b64encode(text.encode()).decode()} if as_b64 else text)
        nested = np.empty(len(items), dtype=object)
        nested[:] = items
        return nested.reshape(array.shape).tolist()
    if array.dtype.kind == "V" or array.dtype == np.float16:  # bfloat16, float16: no JSON of their own
        return array.astype(np.float32).tolist()
    return array.tolist()


def _tf_name(dtype: np.dtype | type | str) -> str:
    """TF's name for a dtype in messages: DT_FLOAT, DT_STRING ..."""
    try:
        return TF_NAMES[TF_ENUM[datatype_of(dtype)]]
    except (InvalidRequest, KeyError):
        return np.dtype(dtype).name


# ---------------------------------------------------------------------------------------------------
# JSON values ↔ arrays, shared by both protocols


def _json_to_array(value: Any, what: str, *, allow_b64: bool) -> np.ndarray:
    """A nested JSON value as an array of JSON's own types: bool, int64 (uint64 above it), float64, or
    objects of bytes (strings UTF-8 encoded, ``{"b64": ...}`` decoded when ``allow_b64``).

    Goes through an object array to learn the element types before converting, so that mixed kinds
    are caught rather than coerced, and a string among numbers cannot make numpy allocate a
    fixed-width string array of (longest string × element count).
    """
    try:
        objects = np.array(value, dtype=object)
    except ValueError:
        raise InvalidRequest(f"{what} is not a rectangular tensor: its nested lists differ in length") from None
    flat = objects.reshape(-1)
    if not flat.size:
        return np.empty(objects.shape, dtype=np.float64)
    kinds = set(map(type, flat))
    if kinds <= {float, int}:
        if float in kinds:
            return flat.astype(np.float64).reshape(objects.shape)
        try:
            return flat.astype(np.int64).reshape(objects.shape)
        except OverflowError:
            try:
                return flat.astype(np.uint64).reshape(objects.shape)
            except OverflowError:
                raise InvalidRequest(
                    f"{what} has integers out of the 64-bit range (such as {_first_big_int(flat)})"
                ) from None
    if kinds == {bool}:
        return flat.astype(np.bool_).reshape(objects.shape)
    if kinds <= {str, dict}:
        return _strings(flat, what, allow_b64).reshape(objects.shape)
    if list in kinds:
        raise InvalidRequest(
            f"{what} is not a rectangular tensor: its nested lists differ in length (or nesting depth)"
        )
    if type(None) in kinds:
        raise InvalidRequest(f"{what} has null values: send numbers, true/false or strings")
    described = sorted({_KIND_NAMES.get(kind, kind.__name__) for kind in kinds})
    raise InvalidRequest(f"{what} mixes {' and '.join(described)}: a tensor holds values of one kind")


_KIND_NAMES = {bool: "booleans", int: "numbers", float: "numbers", str: "strings", dict: "objects"}


def _first_big_int(flat: np.ndarray) -> int:
    return next(int(x) for x in flat.tolist() if not -(2**63) <= x < 2**63)


def _strings(flat: np.ndarray, what: str, allow_b64: bool) -> np.ndarray:
    """Strings (and base64 objects) as an object array of bytes."""
    out = np.empty(flat.size, dtype=object)
    for index, item in enumerate(flat.tolist()):
        if isinstance(item, str):
            try:
                out[index] = item.encode()
            except UnicodeEncodeError:
                raise InvalidRequest(f"{what} has a string that is not valid Unicode (a lone surrogate)") from None
        elif allow_b64 and _is_b64(item):
            try:
                out[index] = base64.b64decode(item[_B64], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f'{what} has a {{"b64": ...}} value that is not valid base64') from None
        else:
            expected = 'strings or {"b64": "<base64>"} objects' if allow_b64 else "strings"
            raise InvalidRequest(f"{what} has the object {_short(item)} where it expects {expected}")
    return out


def _cast(array: np.ndarray, dtype: np.dtype, what: str, label: str) -> np.ndarray:
    """Cast an array of JSON's types to ``dtype``, refusing values of the wrong kind or out of range."""
    if array.dtype == dtype:
        return array
    if not array.size:
        return np.empty(array.shape, dtype=dtype)
    source = array.dtype.kind
    received = {"b": "true/false", "i": "whole numbers", "u": "whole numbers", "f": "decimal numbers"}.get(
        source, "strings"
    )
    if dtype.kind == "O":
        if source != "O":
            raise InvalidRequest(f"{what} must hold strings for {label}, received {received}")
        return array
    if source == "O":
        raise InvalidRequest(f"{what} must hold {_expected(dtype)} for {label}, received strings")
    if dtype.kind == "b":
        if source != "b":
            raise InvalidRequest(f"{what} must hold true/false for {label}, received {received}")
        return array.astype(dtype)
    if source == "b":
        raise InvalidRequest(f"{what} must hold {_expected(dtype)} for {label}, received true/false")
    if dtype.kind in "iu":
        if source == "f":
            flat = array.reshape(-1)
            fractional = np.flatnonzero(flat != np.floor(flat))
            example = flat[fractional[0] if fractional.size else 0].item()
            raise InvalidRequest(
                f"{what} must hold whole numbers for {label}, received decimal numbers (such as {example!r}): "
                "send integers without a decimal point"
            )
        if not np.can_cast(array.dtype, dtype):
            info = np.iinfo(dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise InvalidRequest(f"{what} holds {bad}, outside the range of {label} ({info.min} to {info.max})")
        return array.astype(dtype)
    with np.errstate(over="ignore"):
        cast = array.astype(dtype)
    overflow = np.isinf(cast)
    if overflow.any():
        if source == "f":
            overflow &= ~np.isinf(array)
        if overflow.any():
            bad = array.reshape(-1)[np.flatnonzero(overflow.reshape(-1))[0]].item()
            raise InvalidRequest(f"{what} holds {bad!r}, beyond the range of {label}")
    return cast


def _expected(dtype: np.dtype) -> str:
    return "whole numbers" if dtype.kind in "iu" else "numbers"


def _parameters(holder: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = holder.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"'parameters' of {what} must be an object, not {_json_type(parameters)}")
    return parameters


def _load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise InvalidRequest(f"the {what} body is nested too deeply to parse") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequest(f"the {what} body is not valid JSON ({error}): send a JSON object") from None


def _dump_json(value: Any) -> bytes:
    # allow_nan: NaN/Infinity as bare tokens, as Triton and TF Serving write them.
    return json.dumps(value, allow_nan=True, separators=(",", ":")).encode()


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
