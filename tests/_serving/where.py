"""A model as a Python class, pickled by value for `gpuport deploy`: it says which node answered.
Each row is [seconds, value]: the worker first sleeps the batch's longest seconds (a request held in
flight), then answers ``y`` = value * 2 and ``node``, its node's name (``GPUPORT_NODE``)."""

from __future__ import annotations

import os
import time
from typing import ClassVar

import numpy as np


class Where:
    inputs: ClassVar[list[tuple[str, str, tuple[int, ...]]]] = [("x", "FP32", (-1, 2))]
    outputs: ClassVar[list[tuple[str, str, tuple[int, ...]]]] = [("y", "FP32", (-1, 1)), ("node", "BYTES", (-1, 1))]

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = batch["x"]
        if len(x):
            time.sleep(float(x[:, 0].max()))
        node = os.environ.get("GPUPORT_NODE", "").encode()
        return {"y": x[:, 1:] * 2, "node": np.full((len(x), 1), node, dtype=object)}
