"""TensorFlow Serving's REST ``predict`` bodies, to and from numpy arrays: the row format
(``"instances"``) and the columnar format (``"inputs"``), binary strings as ``{"b64": "..."}``.

No web framework here: bytes in, arrays out, and back. Every malformed request raises
``InvalidRequest`` saying what was wrong and what was expected (JSON values: ``json_values``).

TF Serving writes ``{"b64": ...}`` for string outputs whose name ends in ``_bytes``; here also for
any string that is not valid UTF-8, which cannot be a JSON string.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from gpuport.protocol.datatypes import TF_ENUM, TF_NAMES, datatype_of
from gpuport.protocol.errors import InvalidRequest, ServerError
from gpuport.server.serving.json_values import B64, cast, dump_json, is_b64, json_to_array, json_type, load_json

__all__ = ["form_tfs_predict", "parse_tfs_predict", "tfs_error", "tfs_to_inputs"]

# String outputs whose name ends so are written as base64 objects.
_BYTES_SUFFIX = "_bytes"


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
    request = load_json(body, "request")
    if not isinstance(request, dict):
        raise InvalidRequest(
            f'the request must be a JSON object such as {{"instances": [...]}}, not {json_type(request)}'
        )
    signature = request.get("signature_name", "")
    if not isinstance(signature, str):
        raise InvalidRequest(f"'signature_name' must be a string, not {json_type(signature)}")
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
    return {name: cast(named[name], np.dtype(dtype), f"input '{name}'", _tf_name(dtype)) for name, dtype in specs}


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
        return dump_json({"outputs": column})
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
    return dump_json({"predictions": predictions})


def tfs_error(message: str) -> bytes:
    """A TF Serving error body: ``{"error": message}``."""
    return dump_json({"error": message})


def _parse_instances(instances: Any) -> dict[str, np.ndarray] | np.ndarray:
    """The row format: a list of values (one unnamed input) or of objects (named inputs)."""
    if not isinstance(instances, list):
        raise InvalidRequest(f"'instances' must be a list with one entry per row, not {json_type(instances)}")
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
        return json_to_array(rows, what, allow_b64=True)
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
            name: json_to_array(value, f"input '{name}' in 'inputs'", allow_b64=True) for name, value in inputs.items()
        }
    return json_to_array(inputs, "'inputs'", allow_b64=True)


def _is_named(value: Any) -> bool:
    """A JSON object of named inputs, as opposed to a value or a {"b64": ...} string."""
    return isinstance(value, dict) and not is_b64(value)


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
                items.append({B64: base64.b64encode(item).decode()})
            else:
                text = item if isinstance(item, str) else str(item)
                items.append({B64: base64.b64encode(text.encode()).decode()} if as_b64 else text)
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
