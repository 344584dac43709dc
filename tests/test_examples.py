"""The main job: examples/keras_digits trained with real TensorFlow as a remote job, the model brought back."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpuport

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "keras_digits"


def test_keras_digits_trains_remotely_and_the_model_comes_back(admin: gpuport.Client, tmp_path: Path) -> None:
    for module in ("tensorflow", "sklearn"):  # looked up, not imported: the job and a child process import them
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    job = admin.submit(["python", "train.py", "--epochs", "3"], workdir=EXAMPLE, outputs=["model/"])
    lines = list(job.logs(follow=True))
    assert job.wait(120).exit_code == 0, "\n".join(lines)
    assert any(line.startswith("Epoch 3/3") for line in lines)
    job.download(tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # Loaded in a process of its own: TensorFlow's C++ does not share a process well with other tests.
    check = "import sys, tensorflow as tf; print(tf.keras.models.load_model(sys.argv[1]).output_shape)"
    shape = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path / "model" / "digits.keras")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert shape.strip() == "(None, 10)"
    assert metrics["epochs"] == 3 and metrics["test_accuracy"] > 0.5
