"""A model as a Python class, pickled by value for `gpuport deploy`: doubles its input. A row whose
first value is -999 makes the worker process die, as a crashing model would."""

from __future__ import annotations

import os

import numpy as np


class Doubler:
    inputs = [("x", "FP32", (-1, 4))]
    outputs = [("y", "FP32", (-1, 4))]

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = batch["x"]
        if (x[:, 0] == -999).any():
            os._exit(7)  # a crash: the worker is gone without a word
        return {"y": x * 2}
