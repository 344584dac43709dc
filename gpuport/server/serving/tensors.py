"""Byte-string tensors (BYTES) as every binary path carries them: each element a 4-byte
little-endian length, then its bytes. KServe's binary tensor data, Triton's gRPC
``raw_input_contents`` and ``raw_output_contents``, and the frames between the server and its
model workers all use this one codec."""

from __future__ import annotations

import struct

import numpy as np

from gpuport.protocol.errors import InvalidRequest

_LENGTH = struct.Struct("<I")


def pack_bytes(array: np.ndarray) -> bytes:
    """``array``'s elements, row-major, each as its length and its bytes (a str as UTF-8)."""
    parts: list[bytes] = []
    for item in np.asarray(array).ravel().tolist():
        data = item if isinstance(item, bytes) else str(item).encode()
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def unpack_bytes(data: bytes | memoryview, what: str, count: int | None = None) -> np.ndarray:
    """The elements of ``data`` as a 1-D object array of bytes; ``what`` names the tensor in errors.
    With ``count``, reading stops past that many elements (the caller compares the count). Raises
    ``InvalidRequest`` for data cut inside an element or its length."""
    view = memoryview(data).cast("B")
    items: list[bytes] = []
    position, end = 0, len(view)
    while position < end and (count is None or len(items) <= count):
        if position + 4 > end:
            raise InvalidRequest(f"{what} ends inside an element's 4-byte length (at byte {position} of {end})")
        (length,) = _LENGTH.unpack_from(view, position)
        position += 4
        if position + length > end:
            raise InvalidRequest(f"{what}: element {len(items)} says {length} bytes but only {end - position} are left")
        items.append(bytes(view[position : position + length]))
        position += length
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
