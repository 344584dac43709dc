"""The main job: examples/keras_digits trained with real TensorFlow as a remote job, the model brought back,
then deployed as the README's serving section says and asked for predictions by examples/serving/predict.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

import gpuport
from tests.conftest import RunningServer, client_env

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "keras_digits"
PREDICT = EXAMPLE.parent / "serving" / "predict.py"


def test_keras_digits_trains_remotely_and_the_model_comes_back(
    server: RunningServer, admin: gpuport.Client, cli: Any, tmp_path: Path
) -> None:
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

    # Served as the README says (its 450 test rows are more than a batch), and asked by predict.py.
    name = f"digits-{uuid.uuid4().hex[:6]}"
    deploy = ("deploy", name, f"job:{job.id}:model/digits.keras", "--gpu-memory", "2GiB", "--max-batch-size", "64")
    deployed = cli(*deploy, "--max-queue-delay", "2ms", **client_env(server))
    assert deployed.code == 0, deployed.output
    try:
        cert = str(server.state_dir / "tls" / "cert.pem")
        predicted = subprocess.run(
            [sys.executable, str(PREDICT), server.http_url, server.admin_token, cert, name],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=PREDICT.parent,
        )
        assert predicted.returncode == 0, predicted.stdout + predicted.stderr
        assert f"{name}: 450 digits in 8 requests over KServe v2 REST, accuracy" in predicted.stdout
        accuracy = float(predicted.stdout.split("accuracy")[-1])
        assert accuracy == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    finally:
        admin.undeploy(name)
