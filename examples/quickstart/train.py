"""The quick start's job: a small classifier trained with numpy alone, so that it runs on a server
installed with just `pip install '.[server]'` (no framework). It prints its progress, writes the
weights to model/ and its metrics to $GPUPORT_OUTPUT_DIR, which gpuport brings back.

    gpuport run --gpus 1 --output model/ -- python train.py --epochs 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def make_data(rng: np.random.Generator, rows: int, features: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Two Gaussian clouds, one per class, partly overlapping."""
    y = rng.integers(0, 2, rows)
    x = rng.normal(size=(rows, features)) + (y[:, None] * 2 - 1) * 0.6
    return x.astype(np.float32), y.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    gpus = os.environ.get("CUDA_VISIBLE_DEVICES") or "none"
    print(f"numpy {np.__version__} on {platform.node()}, GPUs: {gpus}")
    rng = np.random.default_rng(0)
    x_train, y_train = make_data(rng, 4000)
    x_test, y_test = make_data(rng, 1000)
    w, b = np.zeros(x_train.shape[1], np.float32), np.float32(0)

    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        p = 1 / (1 + np.exp(-(x_train @ w + b)))
        loss = -np.mean(y_train * np.log(p + 1e-7) + (1 - y_train) * np.log(1 - p + 1e-7))
        w -= args.lr * x_train.T @ (p - y_train) / len(y_train)
        b -= args.lr * np.mean(p - y_train)
        print(f"epoch {epoch}/{args.epochs}: loss {loss:.4f}")
    accuracy = float(np.mean(((x_test @ w + b) > 0) == y_test))
    print(f"trained in {time.perf_counter() - started:.2f}s; test accuracy {accuracy:.4f}")

    Path("model").mkdir(exist_ok=True)
    np.savez("model/weights.npz", w=w, b=b)
    outputs = Path(os.environ.get("GPUPORT_OUTPUT_DIR", "."))
    (outputs / "metrics.json").write_text(json.dumps({"test_accuracy": accuracy, "epochs": args.epochs}))


if __name__ == "__main__":
    main()
