"""KServe v2 (the Open Inference Protocol) request and response bodies, to and from numpy arrays,
with Triton's binary tensor data extension: a JSON header, optionally followed by the raw bytes of
the inputs (or outputs) that say ``"binary_data_size"`` in their parameters, in the order they are
listed; the ``Inference-Header-Content-Length`` HTTP header gives the JSON header's length.

No web framework here: bytes in, arrays out, and back. Every malformed request raises
``InvalidRequest`` saying what was wrong and what was expected (JSON values: ``json_values``).

Choices where the protocol leaves room, and what decided them:

- FP16 and BF16 are accepted and written as JSON numbers. Triton refuses them in JSON; the KServe
  spec does not, and tritonclient's ``set_data_from_numpy(..., binary_data=False)`` sends FP16 so.
- BYTES outputs that are not valid UTF-8 cannot be JSON strings: such an output goes out as binary
  data whatever was asked (tritonclient reads a binary output whether or not it asked for one).
  Triton writes the raw bytes into the JSON, which its own client then fails to parse.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuport.protocol.datatypes import datatype_of, numpy_dtype
from gpuport.protocol.errors import InvalidRequest, ServerError
from gpuport.server.serving.json_values import (
    cast,
    dump_json,
    json_to_array,
    json_type,
    load_json,
    parameters_of,
    short,
)
from gpuport.server.serving.tensors import pack_bytes, unpack_bytes

__all__ = ["InferInput", "InferRequest", "RequestedOutput", "form_kserve", "parse_kserve"]

_LITTLE_ENDIAN = sys.byteorder == "little"


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
    header = load_json(bytes(body[:end]) if end < size or not isinstance(body, bytes) else body, "request")
    if not isinstance(header, dict):
        raise InvalidRequest(
            f"the request must be a JSON object with 'inputs', not {json_type(header)}: "
            'send {"inputs": [{"name": ..., "shape": [...], "datatype": ..., "data": [...]}]}'
        )
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest(f"the request's 'id' must be a string, not {json_type(request_id)}")
    parameters = parameters_of(header, "the request")
    if not isinstance(parameters.get("binary_data_output", False), bool):
        raise InvalidRequest("the request parameter 'binary_data_output' must be true or false")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidRequest(
            "the request has no 'inputs' list"
            if raw_inputs is None
            else f"the request's 'inputs' must be a list of tensors, not {json_type(raw_inputs)}"
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
    header = dump_json(response)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _parse_input(
    raw: Any, index: int, view: memoryview, offset: int, has_header_length: bool
) -> tuple[InferInput, int]:
    """One entry of 'inputs', and the body offset after its binary data (if any)."""
    if not isinstance(raw, dict):
        raise InvalidRequest(
            f"inputs[{index}] must be an object with 'name', 'shape', 'datatype' and 'data', not {json_type(raw)}"
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
            f"input '{name}' has no valid 'shape' (got {short(shape)}): give a list of non-negative integers"
        )
    count = math.prod(shape)
    parameters = parameters_of(raw, f"input '{name}'")
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
        raise InvalidRequest(f"'data' of input '{name}' must be a list of values, not {json_type(data)}")
    what = f"'data' of input '{name}'"
    array = json_to_array(data, what, allow_b64=False)
    if array.ndim > 1 and list(array.shape) != shape:
        raise InvalidRequest(
            f"{what} is nested as {list(array.shape)} but the input's shape is {shape}: nest it as the shape "
            "or send it flat"
        )
    if array.size != count:
        raise InvalidRequest(f"{what} has {array.size} elements but shape {shape} needs {count}")
    array = cast(array, dtype, what, datatype).reshape(shape)
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
        raise InvalidRequest(f"the request's 'outputs' must be a list of objects, not {json_type(raw)}")
    outputs: list[RequestedOutput] = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise InvalidRequest(f'outputs[{index}] must be an object with a \'name\': {{"name": "output0"}}')
        name = item["name"]
        if name in names:
            raise InvalidRequest(f"output '{name}' is requested twice: ask for each output once")
        names.add(name)
        parameters = parameters_of(item, f"requested output '{name}'")
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
