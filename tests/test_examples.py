"""The main job: examples/keras_digits trained with real TensorFlow as a remote job, the model brought back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpuport

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "keras_digits"


def test_keras_digits_trains_remotely_and_the_model_comes_back(admin: gpuport.Client, tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    job = admin.submit(["python", "train.py", "--epochs", "3"], workdir=EXAMPLE, outputs=["model/"])
    lines = list(job.logs(follow=True))
    assert job.wait(120).exit_code == 0, "\n".join(lines)
    assert any(line.startswith("Epoch 3/3") for line in lines)
    job.download(tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    model = tf.keras.models.load_model(tmp_path / "model" / "digits.keras")
    assert model.output_shape == (None, 10)
    assert metrics["epochs"] == 3 and metrics["test_accuracy"] > 0.5
