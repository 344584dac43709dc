"""Triton's example models as Python classes, pickled by value for `gpuport deploy`: ``simple``
(INPUT0 + INPUT1 and INPUT0 - INPUT1 of two INT32 [-1, 16] tensors) and ``simple_string`` (the
same on numbers written as byte strings), the models Triton's example clients expect."""

from __future__ import annotations

import numpy as np


class Simple:
    inputs = [("INPUT0", "INT32", (-1, 16)), ("INPUT1", "INT32", (-1, 16))]
    outputs = [("OUTPUT0", "INT32", (-1, 16)), ("OUTPUT1", "INT32", (-1, 16))]

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a, b = batch["INPUT0"], batch["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}


class SimpleString:
    inputs = [("INPUT0", "BYTES", (-1, 16)), ("INPUT1", "BYTES", (-1, 16))]
    outputs = [("OUTPUT0", "BYTES", (-1, 16)), ("OUTPUT1", "BYTES", (-1, 16))]

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a = np.vectorize(int)(batch["INPUT0"]).astype(np.int64)
        b = np.vectorize(int)(batch["INPUT1"]).astype(np.int64)
        as_bytes = np.vectorize(lambda n: str(n).encode(), otypes=[object])
        return {"OUTPUT0": as_bytes(a + b), "OUTPUT1": as_bytes(a - b)}


class SimpleOffset(Simple):
    """``simple`` whose OUTPUT0 is INPUT0 + INPUT1 + ``offset``: which version answered shows."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().predict(batch)
        return {**out, "OUTPUT0": out["OUTPUT0"] + self.offset}
