"""Model serving end to end: a Keras model trained by a gpuport job, deployed from the job's output,
and asked for predictions by the real clients of each protocol (tritonclient over HTTP and gRPC,
TensorFlow Serving's PredictionService stub, plain HTTP), all over TLS with Bearer tokens.

The clients are used as their own documentation shows, with only the address, the server's
certificate and the token changed. What the model should answer comes from the job itself
(``probe.npy``/``expected.npy``) and from its ``mlp.keras`` loaded here with Keras.
"""

from __future__ import annotations

import json
import queue
import shutil
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

import gpuport
from tests.conftest import RunningServer, wait_for

HERE = Path(__file__).parent
WRONG_TOKEN = "gp_" + "0" * 40  # well formed, never issued
ATOL = 1e-5

Predict = Callable[[np.ndarray], np.ndarray]


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
def deployed(server: RunningServer, trained: tuple[gpuport.Job, Path]) -> Iterator[dict[str, gpuport.ModelInfo]]:
    """Both models from the job's output, loading side by side: model/mlp.keras as ``mlp`` (version 1,
    batching up to 16 rows within 5 ms) and model/savedmodel as ``mlp-saved``."""
    job, _ = trained
    with server.connect() as gpu:
        loading = [
            gpu.deploy("mlp", job.output("model/mlp.keras"), max_batch_size=16, max_queue_delay="5ms", wait=False),
            gpu.deploy("mlp-saved", job.output("model/savedmodel"), wait=False),
        ]
        try:
            import tensorflow  # noqa: F401  (here, while the replicas load: it takes seconds)

            yield {info.name: _ready(gpu, info) for info in loading}
        finally:
            for info in loading:
                gpu.undeploy(info.name)


def _ready(gpu: gpuport.Client, info: gpuport.ModelInfo) -> gpuport.ModelInfo:
    wait_for(lambda: gpu.model(info.name, info.version).state != "loading", 120, f"{info.name} loaded")
    info = gpu.model(info.name, info.version)
    assert info.state == "ready", info.message
    return info


@pytest.fixture(scope="module")
def mlp(deployed: dict[str, gpuport.ModelInfo]) -> gpuport.ModelInfo:
    return deployed["mlp"]


@pytest.fixture(scope="module")
def saved(deployed: dict[str, gpuport.ModelInfo]) -> gpuport.ModelInfo:
    return deployed["mlp-saved"]


@pytest.fixture(scope="module")
def tf(deployed: dict[str, gpuport.ModelInfo]) -> Any:
    """TensorFlow (imported while the models loaded): the TF Serving client's tensor helpers, and Keras."""
    import tensorflow

    return tensorflow


@pytest.fixture(scope="module")
def keras_predict(trained: tuple[gpuport.Job, Path], tf: Any) -> Predict:
    """The trained model's own predictions, from mlp.keras as the job saved it, loaded here."""
    import keras

    _, out = trained
    model = keras.saving.load_model(next(out.rglob("mlp.keras")))
    return lambda x: np.asarray(model(x, training=False))


@pytest.fixture
def cert(server: RunningServer) -> Path:
    """The server's self-signed certificate (it names localhost and 127.0.0.1): what the clients trust."""
    return server.state_dir / "tls" / "cert.pem"


def _probe(trained: tuple[gpuport.Job, Path]) -> tuple[np.ndarray, np.ndarray]:
    _, out = trained
    folder = next(out.rglob("probe.npy")).parent
    return np.load(folder / "probe.npy"), np.load(folder / "expected.npy")


def _address(url: str) -> str:
    """``https://127.0.0.1:PORT`` as the clients take it: ``127.0.0.1:PORT``."""
    return url.removeprefix("https://").rstrip("/")


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _triton_http(server: RunningServer, cert: Path, **kw: Any) -> triton_http.InferenceServerClient:
    """tritonclient over HTTPS, verifying the server's certificate and host name against ``cert``."""
    return triton_http.InferenceServerClient(
        url=_address(server.http_url), ssl=True, ssl_options={"ca_certs": str(cert)}, **kw
    )


def _https(cert: Path) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=10)


def _output_name(model: gpuport.ModelInfo) -> str:
    (spec,) = model.outputs
    return spec.name


# ---- what gpuport says it deployed ---------------------------------------------------------------------


def test_a_model_from_a_jobs_output_is_deployed_with_its_signature(
    admin: gpuport.Client, mlp: gpuport.ModelInfo, trained: tuple[gpuport.Job, Path]
) -> None:
    """gpu.deploy of job:<id>:model/mlp.keras: ready, with the signature read from the model."""
    assert mlp.state == "ready" and mlp.format == "keras" and mlp.version == 1
    assert [(s.name, s.datatype, s.shape) for s in mlp.inputs] == [("features", "FP32", (-1, 8))]
    assert [(s.datatype, s.shape) for s in mlp.outputs] == [("FP32", (-1, 2))]
    assert mlp.max_batch_size == 16 and mlp.source == f"job:{trained[0].id}:model/mlp.keras"
    assert {("mlp", 1), ("mlp-saved", 1)} <= {(m.name, m.version) for m in admin.models()}


# ---- tritonclient -------------------------------------------------------------------------------------


def test_tritonclient_http_in_binary_and_json_modes(
    server: RunningServer,
    cert: Path,
    mlp: gpuport.ModelInfo,
    trained: tuple[gpuport.Job, Path],
    user_token: str,
) -> None:
    """tritonclient.http, as a user without admin rights: health, metadata, and predictions with
    the tensors in binary (the binary tensor data extension) and in JSON, both ways."""
    x, expected = _probe(trained)
    output = _output_name(mlp)
    headers = _bearer(user_token)  # infer() adds Inference-Header-Content-Length to its headers: a copy each
    with _triton_http(server, cert) as client:
        assert client.is_server_live(headers=headers)
        assert client.is_server_ready(headers=headers)
        assert client.get_server_metadata(headers=headers)["name"] == "gpuport"
        assert client.is_model_ready("mlp", headers=headers)
        assert client.is_model_ready("mlp", "1", headers=headers)
        metadata = client.get_model_metadata("mlp", headers=headers)
        assert metadata["name"] == "mlp" and metadata["versions"] == ["1"]
        assert metadata["platform"] == "tensorflow_keras"
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [("features", "FP32", [-1, 8])]
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [(output, "FP32", [-1, 2])]
        assert client.get_model_metadata("mlp", "1", headers=headers)["name"] == "mlp"

        for binary_in in (True, False):
            for binary_out in (True, False):
                tensor = triton_http.InferInput("features", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x, binary_data=binary_in)
                wanted = [triton_http.InferRequestedOutput(output, binary_data=binary_out)]
                result = client.infer("mlp", [tensor], outputs=wanted, headers=dict(headers), request_id="r1")
                got = result.as_numpy(output)
                assert got.dtype == np.float32 and got.shape == (4, 2), (binary_in, binary_out)
                assert np.allclose(got, expected, atol=ATOL), (binary_in, binary_out)
                assert result.get_response()["id"] == "r1"

        tensor = triton_http.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(  # no outputs named: all of them, in binary
            "mlp", [tensor], model_version="1", headers=dict(headers), response_compression_algorithm="gzip"
        )
        assert result.get_response()["model_version"] == "1"
        assert np.allclose(result.as_numpy(output), expected, atol=ATOL)


def test_tritonclient_http_compressed_requests(
    server: RunningServer, cert: Path, mlp: gpuport.ModelInfo, trained: tuple[gpuport.Job, Path], user_token: str
) -> None:
    """tritonclient.http's request_compression_algorithm: the body gzip- or deflate-compressed."""
    x, expected = _probe(trained)
    output = _output_name(mlp)
    with _triton_http(server, cert) as client:
        for algorithm, binary in (("gzip", True), ("deflate", False)):
            tensor = triton_http.InferInput("features", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("mlp", [tensor], headers=_bearer(user_token), request_compression_algorithm=algorithm)
            assert np.allclose(result.as_numpy(output), expected, atol=ATOL), algorithm


def test_tritonclient_grpc(
    server: RunningServer,
    cert: Path,
    mlp: gpuport.ModelInfo,
    trained: tuple[gpuport.Job, Path],
    user_token: str,
) -> None:
    """tritonclient.grpc over TLS, as a user without admin rights: the same checks as over HTTP."""
    x, expected = _probe(trained)
    output = _output_name(mlp)
    headers = {"authorization": f"Bearer {user_token}"}
    with triton_grpc.InferenceServerClient(url=_address(server.url), ssl=True, root_certificates=str(cert)) as client:
        assert client.is_server_live(headers=headers)
        assert client.is_server_ready(headers=headers)
        assert client.get_server_metadata(headers=headers).name == "gpuport"
        assert client.is_model_ready("mlp", headers=headers)
        assert client.is_model_ready("mlp", "1", headers=headers)
        metadata = client.get_model_metadata("mlp", headers=headers, as_json=True)
        assert metadata["name"] == "mlp" and metadata["versions"] == ["1"]
        assert metadata["platform"] == "tensorflow_keras"
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
            ("features", "FP32", ["-1", "8"])  # int64 in JSON from protobuf: strings
        ]
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [(output, "FP32", ["-1", "2"])]
        assert client.get_model_metadata("mlp", "1", headers=headers).name == "mlp"

        for version in ("", "1"):
            tensor = triton_grpc.InferInput("features", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            wanted = [triton_grpc.InferRequestedOutput(output)]
            result = client.infer(
                "mlp", [tensor], model_version=version, outputs=wanted, request_id="g1", headers=headers
            )
            got = result.as_numpy(output)
            assert got.dtype == np.float32 and got.shape == (4, 2)
            assert np.allclose(got, expected, atol=ATOL)
            response = result.get_response()
            assert response.id == "g1" and response.model_name == "mlp" and response.model_version == "1"


# ---- TensorFlow Serving's PredictionService ---------------------------------------------------------------


@pytest.fixture
def prediction_service(server: RunningServer, cert: Path) -> Iterator[Any]:
    """TensorFlow Serving's own stub over a TLS channel that trusts the server's certificate."""
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    channel = grpc.secure_channel(_address(server.url), grpc.ssl_channel_credentials(cert.read_bytes()))
    try:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)
    finally:
        channel.close()


def test_tensorflow_serving_prediction_service(
    prediction_service: Any,
    tf: Any,
    mlp: gpuport.ModelInfo,
    saved: gpuport.ModelInfo,
    trained: tuple[gpuport.Job, Path],
    user_token: str,
) -> None:
    """Predict and GetModelMetadata from tensorflow-serving-api's stub, for the .keras model and the
    SavedModel of the same training job (whose output is named output_0)."""
    from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2

    x, expected = _probe(trained)
    metadata = (("authorization", f"Bearer {user_token}"),)
    assert saved.state == "ready" and saved.format == "savedmodel"
    assert [(s.name, s.datatype, s.shape) for s in saved.outputs] == [("output_0", "FP32", (-1, 2))]

    for model, output in (("mlp", _output_name(mlp)), ("mlp-saved", "output_0")):
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        request.model_spec.signature_name = "serving_default"
        request.inputs["features"].CopyFrom(tf.make_tensor_proto(x))
        reply = prediction_service.Predict(request, timeout=30, metadata=metadata)
        assert list(reply.outputs) == [output], model
        got = tf.make_ndarray(reply.outputs[output])
        assert got.dtype == np.float32 and got.shape == (4, 2), model
        assert np.allclose(got, expected, atol=ATOL), model
        assert reply.model_spec.name == model and reply.model_spec.version.value == 1

        # By version, asking for the output by name, the values in float_val (a TensorProto built by hand).
        request.model_spec.version.value = 1
        request.output_filter.append(output)
        request.inputs["features"].Clear()
        request.inputs["features"].dtype = tf.float32.as_datatype_enum
        request.inputs["features"].tensor_shape.dim.add(size=4)
        request.inputs["features"].tensor_shape.dim.add(size=8)
        request.inputs["features"].float_val.extend(x.ravel().tolist())
        reply = prediction_service.Predict(request, timeout=30, metadata=metadata)
        assert np.allclose(tf.make_ndarray(reply.outputs[output]), expected, atol=ATOL), model

        asked = get_model_metadata_pb2.GetModelMetadataRequest()
        asked.model_spec.name = model
        asked.metadata_field.append("signature_def")
        answer = prediction_service.GetModelMetadata(asked, timeout=30, metadata=metadata)
        assert answer.model_spec.name == model and answer.model_spec.version.value == 1
        signatures = get_model_metadata_pb2.SignatureDefMap()
        assert answer.metadata["signature_def"].Unpack(signatures)
        signature = signatures.signature_def["serving_default"]
        assert signature.method_name == "tensorflow/serving/predict"
        for infos, shapes in ((signature.inputs, {"features": [-1, 8]}), (signature.outputs, {output: [-1, 2]})):
            assert {name: [d.size for d in info.tensor_shape.dim] for name, info in infos.items()} == shapes, model
            assert {info.dtype for info in infos.values()} == {tf.float32.as_datatype_enum}, model


# ---- plain HTTP ---------------------------------------------------------------------------------------


def test_kserve_rest_json_and_binary_by_hand(
    server: RunningServer,
    cert: Path,
    mlp: gpuport.ModelInfo,
    trained: tuple[gpuport.Job, Path],
    user_token: str,
) -> None:
    """The KServe v2 REST API as curl would use it: health, metadata, JSON tensors, and the binary
    tensor data extension (a JSON header, then the raw bytes; its length in a header)."""
    x, expected = _probe(trained)
    output = _output_name(mlp)

    assert server.rest("GET", "/v2", token=user_token).json()["name"] == "gpuport"
    assert "binary_tensor_data" in server.rest("GET", "/v2", token=user_token).json()["extensions"]
    assert server.rest("GET", "/v2/health/live", token=user_token).json() == {"live": True}
    assert server.rest("GET", "/v2/health/ready", token=user_token).json() == {"ready": True}
    for path in ("/v2/models/mlp", "/v2/models/mlp/versions/1"):
        reply = server.rest("GET", path, token=user_token)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {
            "name": "mlp",
            "versions": ["1"],
            "platform": "tensorflow_keras",
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}],
            "outputs": [{"name": output, "datatype": "FP32", "shape": [-1, 2]}],
        }
    for path in ("/v2/models/mlp/ready", "/v2/models/mlp/versions/1/ready"):
        reply = server.rest("GET", path, token=user_token)
        assert reply.status_code == 200 and reply.json()["ready"] is True, reply.text

    body = {
        "id": "j1",
        "inputs": [{"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
    }
    for path in ("/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer"):
        reply = server.rest("POST", path, token=user_token, json=body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["model_name"] == "mlp" and answer["model_version"] == "1" and answer["id"] == "j1"
        (out,) = answer["outputs"]
        assert (out["name"], out["datatype"], out["shape"]) == (output, "FP32", [4, 2])
        assert np.allclose(np.array(out["data"]).reshape(4, 2), expected, atol=ATOL)

    raw = x.astype("<f4").tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": output, "parameters": {"binary_data": True}}],
        }
    ).encode()
    with _https(cert) as http:
        reply = http.post(
            server.http_url + "/v2/models/mlp/infer",
            content=header + raw,
            headers={
                **_bearer(user_token),
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )
    assert reply.status_code == 200, reply.text
    length = int(reply.headers["Inference-Header-Content-Length"])
    answer = json.loads(reply.content[:length])
    (out,) = answer["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == (output, "FP32", [4, 2])
    assert out["parameters"]["binary_data_size"] == 4 * 2 * 4 == len(reply.content) - length
    assert "data" not in out
    got = np.frombuffer(reply.content[length:], dtype="<f4").reshape(4, 2)
    assert np.allclose(got, expected, atol=ATOL)


def test_tensorflow_serving_rest(
    server: RunningServer, mlp: gpuport.ModelInfo, trained: tuple[gpuport.Job, Path], user_token: str
) -> None:
    """TensorFlow Serving's REST API: status, metadata, and :predict in the row and columnar formats."""
    x, expected = _probe(trained)
    output = _output_name(mlp)

    for path in ("/v1/models/mlp", "/v1/models/mlp/versions/1"):
        reply = server.rest("GET", path, token=user_token)
        assert reply.status_code == 200, reply.text
        (status,) = reply.json()["model_version_status"]
        assert (status["version"], status["state"], status["status"]["error_code"]) == ("1", "AVAILABLE", "OK")

    reply = server.rest("GET", "/v1/models/mlp/metadata", token=user_token)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["model_spec"]["name"] == "mlp" and answer["model_spec"]["version"] == "1"
    signature = answer["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["method_name"] == "tensorflow/serving/predict"
    features = signature["inputs"]["features"]
    assert features["dtype"] == "DT_FLOAT"
    assert [d["size"] for d in features["tensor_shape"]["dim"]] == ["-1", "8"]
    assert [d["size"] for d in signature["outputs"][output]["tensor_shape"]["dim"]] == ["-1", "2"]

    rows = x.tolist()
    for path in ("/v1/models/mlp:predict", "/v1/models/mlp/versions/1:predict"):
        for body in ({"instances": rows}, {"signature_name": "serving_default", "instances": rows}):
            reply = server.rest("POST", path, token=user_token, json=body)
            assert reply.status_code == 200, reply.text
            assert np.allclose(np.array(reply.json()["predictions"]), expected, atol=ATOL), (path, body)
        reply = server.rest("POST", path, token=user_token, json={"instances": [{"features": r} for r in rows]})
        assert reply.status_code == 200, reply.text
        assert np.allclose(np.array(reply.json()["predictions"]), expected, atol=ATOL)
        for body in ({"inputs": {"features": rows}}, {"inputs": rows}):
            reply = server.rest("POST", path, token=user_token, json=body)
            assert reply.status_code == 200, reply.text
            assert np.allclose(np.array(reply.json()["outputs"]), expected, atol=ATOL), (path, body)


# ---- tokens ---------------------------------------------------------------------------------------------


def test_every_protocol_refuses_a_missing_or_wrong_token(
    server: RunningServer,
    cert: Path,
    prediction_service: Any,
    mlp: gpuport.ModelInfo,
    trained: tuple[gpuport.Job, Path],
) -> None:
    """A token the server never issued: 401 over HTTP, UNAUTHENTICATED over gRPC, through each client,
    with a message that says so. No credentials at all: a model that is not public is unknown, as a
    missing one is (404 / NOT_FOUND in Triton's words); a route that names no model is 401. (The tests
    above predict with a non-admin user's token.) Health answers anyone, as probes ask it."""
    from tensorflow_serving.apis import predict_pb2

    x, _ = _probe(trained)
    unknown = "Request for unknown model: 'mlp' is not found — or it is not public"
    says = {None: unknown, WRONG_TOKEN: "not known to this server"}
    status = {None: 404, WRONG_TOKEN: 401}

    for token, message in says.items():
        for method, path in (("GET", "/v2/models/mlp"), ("POST", "/v1/models/mlp:predict")):
            sent = {"json": {"instances": x.tolist()}} if method == "POST" else {}  # a GET with a body needs a token
            reply = server.rest(method, path, token=token, **sent)
            assert reply.status_code == status[token] and message in reply.json()["error"], (path, reply.text)
        body = {"inputs": [{"name": "features", "shape": [4, 8], "datatype": "FP32", "data": x.ravel().tolist()}]}
        reply = server.rest("POST", "/v2/models/mlp/infer", token=token, json=body)
        assert reply.status_code == status[token] and message in reply.json()["error"], reply.text
        reply = server.rest("GET", "/v2/models/stats", token=token)  # every model's: no model to be unknown
        assert reply.status_code == 401 and ("no token was sent" if token is None else message) in reply.json()["error"]

    tensor = triton_http.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with _triton_http(server, cert) as client:
        for headers, token in (({}, None), (_bearer(WRONG_TOKEN), WRONG_TOKEN)):
            assert client.is_server_live(headers=headers) and client.is_server_ready(headers=headers)
            with pytest.raises(InferenceServerException, match=says[token]) as refused:
                client.infer("mlp", [tensor], headers=dict(headers))
            assert refused.value.status() == str(status[token])
            with pytest.raises(InferenceServerException, match=says[token]):
                client.get_model_metadata("mlp", headers=headers)

    tensor = triton_grpc.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    code = {None: "StatusCode.NOT_FOUND", WRONG_TOKEN: "StatusCode.UNAUTHENTICATED"}
    with triton_grpc.InferenceServerClient(url=_address(server.url), ssl=True, root_certificates=str(cert)) as client:
        for headers, token in (({}, None), ({"authorization": f"Bearer {WRONG_TOKEN}"}, WRONG_TOKEN)):
            for call in (
                lambda: client.infer("mlp", [tensor], headers=headers),
                lambda: client.get_model_metadata("mlp", headers=headers),
            ):
                with pytest.raises(InferenceServerException, match=says[token]) as refused:
                    call()
                assert refused.value.status() == code[token]

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "mlp"
    request.inputs["features"].dtype = 1  # DT_FLOAT
    for metadata, token in ((None, None), ((("authorization", f"Bearer {WRONG_TOKEN}"),), WRONG_TOKEN)):
        with pytest.raises(grpc.RpcError) as refused:
            prediction_service.Predict(request, timeout=30, metadata=metadata)
        assert str(refused.value.code()) == code[token]
        assert says[token] in refused.value.details()


# ---- versions -------------------------------------------------------------------------------------------


def test_a_second_version_is_served_beside_the_first(
    server: RunningServer,
    admin: gpuport.Client,
    cert: Path,
    prediction_service: Any,
    mlp: gpuport.ModelInfo,
    trained: tuple[gpuport.Job, Path],
) -> None:
    """gpu.deploy of the same name again is version 2: both versions answer, by number, on every
    protocol; an unknown version is not found; undeploying version 2 leaves version 1."""
    from tensorflow_serving.apis import predict_pb2

    job, _ = trained
    x, expected = _probe(trained)
    output = _output_name(mlp)
    token = server.admin_token
    body = {"inputs": [{"name": "features", "shape": [4, 8], "datatype": "FP32", "data": x.ravel().tolist()}]}
    second = admin.deploy("mlp", job.output("model/mlp.keras"), max_batch_size=16, max_queue_delay="5ms", wait=False)
    try:
        # While version 2 loads (its replica imports TensorFlow: seconds), version 1 answers.
        assert second.version == 2 and second.state == "loading"
        reply = server.rest("GET", "/v2/models/mlp/versions/2/ready", token=token)
        assert reply.status_code == 400 and reply.json() == {"name": "mlp", "ready": False}, reply.text
        reply = server.rest("POST", "/v2/models/mlp/versions/2/infer", token=token, json=body)
        assert reply.status_code == 503 and "still loading" in reply.json()["error"], reply.text
        reply = server.rest("POST", "/v2/models/mlp/infer", token=token, json=body)
        assert reply.status_code == 200 and reply.json()["model_version"] == "1", reply.text
        states = server.rest("GET", "/v1/models/mlp", token=token).json()["model_version_status"]
        assert [(s["version"], s["state"]) for s in states] == [("2", "LOADING"), ("1", "AVAILABLE")]

        assert _ready(admin, second).version == 2
        assert server.rest("GET", "/v2/models/mlp", token=token).json()["versions"] == ["1", "2"]
        states = server.rest("GET", "/v1/models/mlp", token=token).json()["model_version_status"]
        assert [(s["version"], s["state"]) for s in states] == [("2", "AVAILABLE"), ("1", "AVAILABLE")]
        reply = server.rest("POST", "/v2/models/mlp/infer", token=token, json=body)
        assert reply.json()["model_version"] == "2", reply.text  # the newest ready version, when none is named
        for version in ("1", "2"):
            reply = server.rest("POST", f"/v2/models/mlp/versions/{version}/infer", token=token, json=body)
            assert reply.status_code == 200 and reply.json()["model_version"] == version, reply.text
            assert np.allclose(np.array(reply.json()["outputs"][0]["data"]).reshape(4, 2), expected, atol=ATOL)
            rows = {"instances": x.tolist()}
            reply = server.rest("POST", f"/v1/models/mlp/versions/{version}:predict", token=token, json=rows)
            assert reply.status_code == 200, reply.text
            assert np.allclose(np.array(reply.json()["predictions"]), expected, atol=ATOL)
        for path in ("/v2/models/mlp/versions/3", "/v2/models/mlp/versions/3/ready", "/v1/models/mlp/versions/3"):
            assert server.rest("GET", path, token=token).status_code == 404, path
        assert server.rest("POST", "/v2/models/mlp/versions/3/infer", token=token, json=body).status_code == 404

        headers = {"authorization": f"Bearer {token}"}
        tensor = triton_grpc.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        with triton_grpc.InferenceServerClient(url=_address(server.url), ssl=True, root_certificates=str(cert)) as c:
            assert c.get_model_metadata("mlp", headers=headers).versions == ["1", "2"]
            for version in ("1", "2"):
                assert c.is_model_ready("mlp", version, headers=headers)
                result = c.infer("mlp", [tensor], model_version=version, headers=headers)
                assert result.get_response().model_version == version
                assert np.allclose(result.as_numpy(output), expected, atol=ATOL)
            with pytest.raises(InferenceServerException) as missing:
                c.infer("mlp", [tensor], model_version="3", headers=headers)
            assert missing.value.status() == "StatusCode.NOT_FOUND"

        request = predict_pb2.PredictRequest()
        request.model_spec.name = "mlp"
        request.model_spec.version.value = 3
        with pytest.raises(grpc.RpcError) as missing:
            prediction_service.Predict(request, timeout=30, metadata=(("authorization", f"Bearer {token}"),))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        admin.undeploy("mlp", version=2)
    assert server.rest("GET", "/v2/models/mlp", token=token).json()["versions"] == ["1"]
    assert server.rest("GET", "/v2/models/mlp/versions/2", token=token).status_code == 404
    reply = server.rest("POST", "/v2/models/mlp/infer", token=token, json=body)
    assert reply.status_code == 200 and reply.json()["model_version"] == "1", reply.text


# ---- dynamic batching -------------------------------------------------------------------------------------


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(
    server: RunningServer,
    cert: Path,
    mlp: gpuport.ModelInfo,
    keras_predict: Predict,
    user_token: str,
) -> None:
    """16 requests in flight at once (tritonclient.http's async_infer, 16 connections; then the same
    over tritonclient.grpc), each with its own data and 1 to 3 rows: the batcher joins them into
    batches of up to 16 rows and splits the answers again; each request's answer is the model's
    prediction for its rows."""
    output = _output_name(mlp)
    rng = np.random.default_rng(7)
    inputs = [rng.normal(size=(1 + i % 3, 8)).astype(np.float32) for i in range(16)]
    expected = [keras_predict(x) for x in inputs]
    with server.connect() as gpu:
        before = gpu.model("mlp")
    with _triton_http(server, cert, concurrency=16) as client:
        pending = []
        for i, x in enumerate(inputs):
            tensor = triton_http.InferInput("features", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=i % 2 == 0)
            pending.append(client.async_infer("mlp", [tensor], request_id=str(i), headers=_bearer(user_token)))
        results = [p.get_result(timeout=60) for p in pending]
    for i, result in enumerate(results):
        assert result.get_response()["id"] == str(i)
        got = result.as_numpy(output)
        assert got.shape == (len(inputs[i]), 2), i
        assert np.allclose(got, expected[i], atol=ATOL), i

    answers: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    headers = {"authorization": f"Bearer {user_token}"}
    with triton_grpc.InferenceServerClient(url=_address(server.url), ssl=True, root_certificates=str(cert)) as client:
        for i, x in enumerate(inputs):
            tensor = triton_grpc.InferInput("features", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.async_infer(
                "mlp",
                [tensor],
                callback=lambda result, error, i=i: answers.put((i, result, error)),
                request_id=str(i),
                headers=headers,
            )
        for _ in inputs:
            i, result, error = answers.get(timeout=60)
            assert error is None, error
            assert result.get_response().id == str(i)
            assert np.allclose(result.as_numpy(output), expected[i], atol=ATOL), i

    # The model's counters (gpu.model, `gpuport models`) count each request and row once.
    with server.connect() as gpu:
        after = gpu.model("mlp")
    assert after.requests - before.requests == 32
    assert after.rows - before.rows == 2 * sum(len(x) for x in inputs)
    assert 1 <= after.batches - before.batches <= 32
    assert (after.failed_batches, after.queue_length) == (before.failed_batches, 0)
    assert after.mean_batch_size >= 1

    # The batch limit shows too: one request of more rows than a batch takes is refused, saying so.
    tensor = triton_http.InferInput("features", [17, 8], "FP32")
    tensor.set_data_from_numpy(np.zeros((17, 8), dtype=np.float32))
    with _triton_http(server, cert) as client:
        with pytest.raises(InferenceServerException, match=r"17 rows.*max_batch_size 16") as refused:
            client.infer("mlp", [tensor], headers=_bearer(user_token))
    assert refused.value.status() == "400"
