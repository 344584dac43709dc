"""Tensor element types as the prediction protocols name them, and as numpy does.

KServe v2 (the Open Inference Protocol) names them with strings ("FP32", "BYTES"); TensorFlow
Serving with the ``tensorflow.DataType`` enum of ``types.proto`` (DT_FLOAT = 1, ...). BYTES /
DT_STRING hold variable-length byte strings: numpy ``object`` arrays of ``bytes``.
"""

from __future__ import annotations

import numpy as np

from gpuport.protocol.errors import InvalidRequest

# KServe v2 datatype → numpy dtype (BF16 has no numpy dtype of its own: ml_dtypes' where installed).
_KSERVE: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "object",
}

# tensorflow.DataType enum values (tensorflow/core/framework/types.proto) → KServe v2 datatype.
TF_DATATYPES: dict[int, str] = {
    1: "FP32",  # DT_FLOAT
    2: "FP64",  # DT_DOUBLE
    3: "INT32",  # DT_INT32
    4: "UINT8",  # DT_UINT8
    5: "INT16",  # DT_INT16
    6: "INT8",  # DT_INT8
    7: "BYTES",  # DT_STRING
    9: "INT64",  # DT_INT64
    10: "BOOL",  # DT_BOOL
    14: "BF16",  # DT_BFLOAT16
    17: "UINT16",  # DT_UINT16
    19: "FP16",  # DT_HALF
    22: "UINT32",  # DT_UINT32
    23: "UINT64",  # DT_UINT64
}
TF_ENUM: dict[str, int] = {name: number for number, name in TF_DATATYPES.items()}
TF_NAMES: dict[int, str] = {
    1: "DT_FLOAT",
    2: "DT_DOUBLE",
    3: "DT_INT32",
    4: "DT_UINT8",
    5: "DT_INT16",
    6: "DT_INT8",
    7: "DT_STRING",
    9: "DT_INT64",
    10: "DT_BOOL",
    14: "DT_BFLOAT16",
    17: "DT_UINT16",
    19: "DT_HALF",
    22: "DT_UINT32",
    23: "DT_UINT64",
}


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a KServe v2 datatype; InvalidRequest naming the known ones otherwise."""
    if datatype == "BF16":
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidRequest("datatype BF16 needs the ml_dtypes package on the server") from None
        return np.dtype(ml_dtypes.bfloat16)
    name = _KSERVE.get(datatype)
    if name is None:
        raise InvalidRequest(f"unknown datatype {datatype!r}: use one of {', '.join([*_KSERVE, 'BF16'])}")
    return np.dtype(name)


_BY_DTYPE: dict[np.dtype, str] = {np.dtype(name): datatype for datatype, name in _KSERVE.items()}


def datatype_of(dtype: np.dtype | type | str) -> str:
    """The KServe v2 datatype of a numpy dtype (strings and bytes: BYTES)."""
    dtype = np.dtype(dtype)
    found = _BY_DTYPE.get(dtype)
    if found is not None:
        return found
    if dtype.kind in "OSU":
        return "BYTES"
    if dtype.name == "bfloat16":
        return "BF16"
    for datatype, name in _KSERVE.items():  # the same type in the other byte order
        if dtype.name == name:
            return datatype
    raise InvalidRequest(f"numpy dtype {dtype.name} has no KServe v2 datatype")


def tf_enum(datatype: str) -> int:
    """The tensorflow.DataType enum value of a KServe v2 datatype."""
    if datatype not in TF_ENUM:
        raise InvalidRequest(f"datatype {datatype} has no TensorFlow Serving equivalent")
    return TF_ENUM[datatype]


def from_tf_enum(number: int) -> str:
    """The KServe v2 datatype of a tensorflow.DataType enum value."""
    if number not in TF_DATATYPES:
        raise InvalidRequest(
            f"TensorFlow dtype {number} is not supported: use one of {', '.join(TF_NAMES[n] for n in sorted(TF_NAMES))}"
        )
    return TF_DATATYPES[number]
