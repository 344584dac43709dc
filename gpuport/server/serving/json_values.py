"""JSON values to and from numpy arrays, as both REST prediction protocols read and write them
(``kserve_rest`` and ``tfs_rest``); every malformed value raises ``InvalidRequest`` saying what was
wrong and what was expected.

Choices where the protocols leave room, and what decided them:

- NaN and ±Infinity travel as the bare tokens ``NaN``, ``Infinity``, ``-Infinity``, both ways. Triton
  reads and writes them so (rapidjson's NaN/Inf flags, triton-inference-server/server#3870),
  tritonclient's parser (python-rapidjson) accepts them, and TF Serving's REST API documents them.
- JSON numbers are typed strictly, as Triton and TF Serving do: ``3.5`` or ``3.0`` for an integer
  input, ``true`` for a number, ``1`` for a boolean or a number out of the datatype's range is an error.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np

from gpuport.protocol.errors import InvalidRequest

__all__ = ["B64", "cast", "dump_json", "is_b64", "json_to_array", "json_type", "load_json", "parameters_of", "short"]

# TF Serving: a binary string is the JSON object {"b64": "<base64>"} (KServe sends raw bytes).
B64 = "b64"


def json_to_array(value: Any, what: str, *, allow_b64: bool) -> np.ndarray:
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
        elif allow_b64 and is_b64(item):
            try:
                out[index] = base64.b64decode(item[B64], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f'{what} has a {{"b64": ...}} value that is not valid base64') from None
        else:
            expected = 'strings or {"b64": "<base64>"} objects' if allow_b64 else "strings"
            raise InvalidRequest(f"{what} has the object {short(item)} where it expects {expected}")
    return out


def cast(array: np.ndarray, dtype: np.dtype, what: str, label: str) -> np.ndarray:
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


def parameters_of(holder: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = holder.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"'parameters' of {what} must be an object, not {json_type(parameters)}")
    return parameters


def load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise InvalidRequest(f"the {what} body is nested too deeply to parse") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequest(f"the {what} body is not valid JSON ({error}): send a JSON object") from None


def dump_json(value: Any) -> bytes:
    # allow_nan: NaN/Infinity as bare tokens, as Triton and TF Serving write them.
    return json.dumps(value, allow_nan=True, separators=(",", ":")).encode()


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_b64(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(B64), str)
