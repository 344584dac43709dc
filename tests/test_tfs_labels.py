"""TensorFlow Serving's version labels: `gpuport deploy --label`, `gpuport label NAME LABEL VERSION`,
REST ``/v1/models/NAME/labels/LABEL[:predict|/metadata]`` and gRPC ``model_spec.version_label``, through
TensorFlow Serving's own stub. An unknown label is NOT_FOUND, never silently the latest version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import grpc
import numpy as np
import pytest

import gpuport
from tests._serving import simple
from tests.conftest import RunningServer


def _model(folder: Path, offset: int) -> Path:
    folder.mkdir()
    cloudpickle.register_pickle_by_value(simple)
    try:
        (folder / "model.pkl").write_bytes(cloudpickle.dumps(simple.SimpleOffset(offset)))
    finally:
        cloudpickle.unregister_pickle_by_value(simple)
    return folder / "model.pkl"


@pytest.fixture
def versions(server: RunningServer, admin: gpuport.Client, tmp_path: Path) -> Iterator[str]:
    """Model ``labelled``: version 1 (answers +100) labelled stable, version 2 (+200) labelled canary."""
    name = "labelled"
    admin.deploy(name, _model(tmp_path / "v1", 100), label="stable")
    admin.deploy(name, _model(tmp_path / "v2", 200), label="canary")
    try:
        yield name
    finally:
        admin.undeploy(name)


def _body() -> dict[str, Any]:
    return {"inputs": {"INPUT0": [[0] * 16], "INPUT1": [[1] * 16]}}


def _rest_output(server: RunningServer, path: str) -> Any:
    reply = server.rest("POST", path, token=server.admin_token, json=_body())
    return reply.status_code, reply.json()


def test_labels_over_rest_and_grpc(server: RunningServer, admin: gpuport.Client, cli: Any, versions: str) -> None:
    name = versions
    assert {m.version: m.labels for m in admin.models() if m.name == name} == {1: ("stable",), 2: ("canary",)}

    status, answer = _rest_output(server, f"/v1/models/{name}/labels/stable:predict")
    assert status == 200 and answer["outputs"]["OUTPUT0"] == [[101] * 16]
    status, answer = _rest_output(server, f"/v1/models/{name}/labels/canary:predict")
    assert status == 200 and answer["outputs"]["OUTPUT0"] == [[201] * 16]
    status, answer = _rest_output(server, f"/v1/models/{name}/labels/nope:predict")
    assert status == 404 and "no version labelled 'nope'" in answer["error"] and "canary, stable" in answer["error"]
    metadata = server.rest("GET", f"/v1/models/{name}/labels/stable/metadata", token=server.admin_token).json()
    assert metadata["model_spec"]["version"] == "1"
    status = server.rest("GET", f"/v1/models/{name}/labels/canary").json()["model_version_status"]
    assert [s["version"] for s in status] == ["2"]

    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    cert = (server.state_dir / "tls" / "cert.pem").read_bytes()
    metadata_token = (("authorization", f"Bearer {server.admin_token}"),)
    with grpc.secure_channel(server.url.removeprefix("https://"), grpc.ssl_channel_credentials(cert)) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

        def predict(label: str) -> Any:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = name
            request.model_spec.version_label = label
            for key, value in (("INPUT0", 0), ("INPUT1", 1)):
                request.inputs[key].dtype = 3  # DT_INT32
                request.inputs[key].tensor_shape.dim.add(size=1)
                request.inputs[key].tensor_shape.dim.add(size=16)
                request.inputs[key].int_val.extend([value] * 16)
            return stub.Predict(request, timeout=30, metadata=metadata_token)

        reply = predict("stable")
        assert reply.model_spec.version.value == 1
        assert np.frombuffer(reply.outputs["OUTPUT0"].tensor_content, dtype=np.int32).tolist() == [101] * 16
        with pytest.raises(grpc.RpcError) as raised:
            predict("nope")
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "no version labelled" in raised.value.details()

        # A label moves: the CLI points stable at version 2, and the next request goes there.
        assert cli("login", server.url, "--token", server.admin_token, "--yes").code == 0
        done = cli("label", name, "stable", "2")
        assert done.code == 0 and "stable is version 2" in done.stderr, done.stderr
        assert predict("stable").model_spec.version.value == 2
        assert "2 (canary, stable)" in cli("models").stdout

    # A label of an undeployed version is gone with it: NOT_FOUND, not the latest.
    admin.undeploy(name, 2)
    status, answer = _rest_output(server, f"/v1/models/{name}/labels/stable:predict")
    assert status == 404 and "its labels: none" in answer["error"]
    with pytest.raises(gpuport.InvalidRequest, match="version label"):
        admin.label(name, "1bad label", 1)
    with pytest.raises(gpuport.NotFound):
        admin.label(name, "stable", 7)
