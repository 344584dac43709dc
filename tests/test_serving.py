"""Model serving end to end: a Keras model trained by a gpuport job, deployed from the job's output,
and asked for predictions by the real clients of each protocol (tritonclient over HTTP and gRPC,
TensorFlow Serving's PredictionService stub, plain HTTP), all over TLS with Bearer tokens."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import gpuport
from tests.conftest import RunningServer

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def trained(server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[gpuport.Job, Path]:
    """The training job (its output holds model/mlp.keras and model/savedmodel) and its outputs here."""
    work = tmp_path_factory.mktemp("train")
    shutil.copy(HERE / "_serving" / "train.py", work / "train.py")
    with server.connect() as gpu:
        job = gpu.submit(["python", "train.py"], workdir=work, outputs=["model/"], name="train mlp")
        info = job.wait(300).info
        assert info.state == "succeeded", "\n".join(job.logs())
        job.download(work / "out")
    return job, work / "out"


@pytest.fixture(scope="module")
def mlp(server: RunningServer, trained: tuple[gpuport.Job, Path]) -> Iterator[gpuport.ModelInfo]:
    job, _ = trained
    with server.connect() as gpu:
        info = gpu.deploy("mlp", job.output("model/mlp.keras"), max_batch_size=16, max_queue_delay="5ms")
        yield info
        gpu.undeploy("mlp")


def _probe(trained: tuple[gpuport.Job, Path]) -> tuple[np.ndarray, np.ndarray]:
    _, out = trained
    folder = next(out.rglob("probe.npy")).parent
    return np.load(folder / "probe.npy"), np.load(folder / "expected.npy")


def test_a_model_from_a_jobs_output_is_deployed_with_its_signature(
    admin: gpuport.Client, mlp: gpuport.ModelInfo
) -> None:
    assert mlp.state == "ready" and mlp.format == "keras" and mlp.version == 1
    assert [(s.name, s.datatype, s.shape) for s in mlp.inputs] == [("features", "FP32", (-1, 8))]
    assert [(s.datatype, s.shape) for s in mlp.outputs] == [("FP32", (-1, 2))]
    assert [m.name for m in admin.models()] == ["mlp"]


def test_kserve_rest_json_predicts_what_the_model_predicts(
    server: RunningServer, mlp: gpuport.ModelInfo, trained: tuple[gpuport.Job, Path]
) -> None:
    x, expected = _probe(trained)
    body = {"inputs": [{"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    reply = server.rest("POST", "/v2/models/mlp/infer", token=server.admin_token, json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()["outputs"][0]
    assert out["shape"] == [4, 2]
    assert np.allclose(np.array(out["data"]).reshape(4, 2), expected, atol=1e-5)
