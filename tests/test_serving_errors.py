"""Serving under bad input and failure: wrong shapes and dtypes, unknown models, a model that does
not load, a payload over the limit, a model worker that crashes, a server restart; and the formats
deployed from local files (a pickled class, TorchScript, ONNX)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import gpuport
from gpuport.defaults import MAX_INFER_BYTES
from gpuport.protocol import gpuport_pb2 as pb
from tests._serving import doubler
from tests.conftest import RunningServer, start_server, wait_for


def _doubler_file(folder: Path) -> Path:
    cloudpickle.register_pickle_by_value(doubler)
    try:
        path = folder / "model.pkl"
        path.write_bytes(cloudpickle.dumps(doubler.Doubler()))
    finally:
        cloudpickle.unregister_pickle_by_value(doubler)
    return path


@pytest.fixture(scope="module")
def doubled(server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[gpuport.ModelInfo]:
    with server.connect() as gpu:
        info = gpu.deploy("doubler", _doubler_file(tmp_path_factory.mktemp("doubler")), max_queue_delay=0.001)
        yield info
        gpu.undeploy("doubler")


def _infer(server: RunningServer, name: str, x: np.ndarray, datatype: str = "FP32", path: str = "") -> object:
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}]}
    return server.rest("POST", path or f"/v2/models/{name}/infer", token=server.admin_token, json=body)


def test_a_pickled_class_is_served_and_its_spec_published(server: RunningServer, doubled: gpuport.ModelInfo) -> None:
    assert doubled.format == "python"
    assert [(s.name, s.datatype, s.shape) for s in doubled.inputs] == [("x", "FP32", (-1, 4))]
    reply = _infer(server, "doubler", np.arange(8, dtype=np.float32).reshape(2, 4))
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [float(v * 2) for v in range(8)]


def test_wrong_shapes_and_dtypes_are_400_naming_expected_and_received(
    server: RunningServer, doubled: gpuport.ModelInfo
) -> None:
    reply = _infer(server, "doubler", np.zeros((2, 3), dtype=np.float32))
    assert reply.status_code == 400
    assert "[-1, 4]" in reply.json()["error"] and "[2, 3]" in reply.json()["error"]
    reply = _infer(server, "doubler", np.zeros((2, 4), dtype=np.int64), datatype="INT64")
    assert reply.status_code == 400
    assert "FP32" in reply.json()["error"] and "INT64" in reply.json()["error"]
    body = {"instances": [[1.0, 2.0, 3.0]]}  # TensorFlow Serving's REST API: three values for four
    reply = server.rest("POST", "/v1/models/doubler:predict", token=server.admin_token, json=body)
    assert reply.status_code == 400 and "[-1, 4]" in reply.json()["error"]
    reply = server.rest("POST", "/v2/models/doubler/infer", token=server.admin_token, content=b"{not json")
    assert reply.status_code == 400


def test_unknown_models_and_versions_are_404(server: RunningServer, doubled: gpuport.ModelInfo) -> None:
    x = np.zeros((1, 4), dtype=np.float32)
    for path in ("/v2/models/nope/infer", "/v2/models/doubler/versions/9/infer", "/v2/models/doubler/versions/x/infer"):
        reply = _infer(server, "", x, path=path)
        assert reply.status_code == 404, path
        assert "gpuport models" in reply.json()["error"] or "version" in reply.json()["error"]
    assert server.rest("GET", "/v1/models/nope", token=server.admin_token).status_code == 404
    reply = server.rest("POST", "/v1/models/nope:predict", token=server.admin_token, json={"instances": [[1]]})
    assert reply.status_code == 404 and "error" in reply.json()


def test_a_payload_over_the_limit_is_413_with_the_limit(server: RunningServer, doubled: gpuport.ModelInfo) -> None:
    reply = server.rest(
        "POST",
        "/v2/models/doubler/infer",
        token=server.admin_token,
        content=b"x" * (MAX_INFER_BYTES + 1),
    )
    assert reply.status_code == 413
    assert str(MAX_INFER_BYTES) in reply.json()["error"]


def test_a_client_that_hangs_up_mid_body_leaves_the_server_serving(
    server: RunningServer, doubled: gpuport.ModelInfo
) -> None:
    """A prediction whose client sends part of its body and goes is answered to no one, and
    the next request is served. Other methods on a prediction's path are refused, not served."""
    import socket
    import ssl
    from urllib.parse import urlsplit

    address = urlsplit(server.http_url)
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    with socket.create_connection((address.hostname, address.port), timeout=10) as raw:
        with trust.wrap_socket(raw, server_hostname=address.hostname) as conn:
            conn.sendall(
                b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\n"
                + f"Authorization: Bearer {server.admin_token}\r\n".encode()
                + b"Content-Length: 100000\r\n\r\n"
                + b'{"inputs": [{"name": "x", '
            )
    reply = _infer(server, "doubler", np.ones((1, 4), dtype=np.float32))
    assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [2.0] * 4
    reply = server.rest("GET", "/v2/models/doubler/infer", token=server.admin_token)
    assert reply.status_code in (404, 405)
    reply = server.rest("PUT", "/v1/models/doubler:predict", token=server.admin_token, json={"instances": [[1] * 4]})
    assert reply.status_code in (404, 405)
    reply = server.rest("POST", "/v1/models/doubler:classify", token=server.admin_token, json={"instances": [[1] * 4]})
    assert reply.status_code == 404 and ":predict" in reply.json()["error"]


def test_model_names_that_do_not_fit_a_url_are_refused(admin: gpuport.Client, tmp_path: Path) -> None:
    before = [(m.name, m.version) for m in admin.models()]
    for name in ("doubler\n", "two words", "-dash", "a/b"):
        with pytest.raises(gpuport.InvalidRequest, match="model name"):
            admin.deploy(name, _doubler_file(tmp_path))
    assert [(m.name, m.version) for m in admin.models()] == before


def test_other_users_see_a_model_without_its_source_and_replicas(
    server: RunningServer, admin: gpuport.Client, doubled: gpuport.ModelInfo, user_token: str, tmp_path: Path
) -> None:
    """Listing and getting: another user's deployment shows no snapshot id, job id or replica job id
    of its owner's; its owner and admins see them."""
    assert doubled.source.startswith("snapshot:") and doubled.jobs
    with server.connect(user_token) as user:
        (seen,) = [m for m in user.models() if m.name == "doubler"]
        assert (seen.owner, seen.state, seen.source, seen.jobs) == ("admin", "ready", "", [])
        assert [(s.name, s.shape) for s in seen.inputs] == [("x", (-1, 4))]  # what a caller needs to predict
        got = user.transport.call(user.transport.models.Get, pb.ModelRef(name="doubler"))
        assert (got.source, list(got.jobs)) == ("", [])
        mine = user.deploy("user-doubler", _doubler_file(tmp_path))
        try:
            (own,) = [m for m in user.models() if m.name == "user-doubler"]
            assert own.source.startswith("snapshot:") and own.jobs == mine.jobs and len(own.jobs) == 1
            (as_admin,) = [m for m in admin.models() if m.name == "user-doubler"]
            assert (as_admin.source, as_admin.jobs) == (own.source, own.jobs)
        finally:
            user.undeploy("user-doubler")
    (as_admin,) = [m for m in admin.models() if m.name == "doubler"]
    assert (as_admin.source, as_admin.jobs) == (doubled.source, doubled.jobs)


def test_a_model_that_does_not_load_shows_failed_with_the_loaders_error(
    server: RunningServer, admin: gpuport.Client, doubled: gpuport.ModelInfo, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"this is not an ONNX model")
    with pytest.raises(gpuport.ServerError, match="did not load") as raised:
        admin.deploy("broken", broken)
    assert "broken.onnx" in str(raised.value) or "Protobuf" in str(raised.value)
    (failed,) = [m for m in admin.models() if m.name == "broken"]
    assert failed.state == "failed" and "did not load" in failed.message
    assert str(server.state_dir) not in failed.message  # no server paths
    reply = _infer(server, "broken", np.zeros((1, 4), dtype=np.float32))
    assert reply.status_code == 503 and "failed" in reply.json()["error"]
    assert "did not load" not in reply.json()["error"]  # the loader's words are for its owner and admins
    assert _infer(server, "doubler", np.ones((1, 4), dtype=np.float32)).status_code == 200  # the others serve on
    admin.undeploy("broken")


def test_a_crashed_model_worker_fails_its_requests_and_is_restarted(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path
) -> None:
    admin.deploy("crasher", _doubler_file(tmp_path))
    try:
        first = admin.model("crasher").jobs
        reply = _infer(server, "crasher", np.full((1, 4), -999, dtype=np.float32))
        assert reply.status_code >= 500 and "crashed" in reply.json()["error"]
        wait_for(lambda: admin.model("crasher").jobs != first, timeout=30, what="a new worker")

        def answers() -> bool:
            return _infer(server, "crasher", np.ones((1, 4), dtype=np.float32)).status_code == 200

        wait_for(answers, timeout=60, what="the restarted worker answering")
    finally:
        admin.undeploy("crasher")


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_other_formats_deploy_from_local_files(server: RunningServer, admin: gpuport.Client, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    scripted = torch.jit.script(Scale())
    scripted.save(str(tmp_path / "scale.pt"))
    spec = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
    }
    (tmp_path / "gpuport-model.json").write_text(json.dumps(spec))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    _scale_onnx(onnx_dir / "scale.onnx")
    try:
        info = admin.deploy("scale-ts", tmp_path / "scale.pt")
        assert info.format == "torchscript"
        reply = _infer(server, "scale-ts", x)
        assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == (x * 3).ravel().tolist()
        info = admin.deploy("scale-onnx", onnx_dir)  # a folder holding one model
        assert info.format == "onnx" and [(s.name, s.shape) for s in info.inputs] == [("x", (-1, 4))]
        reply = _infer(server, "scale-onnx", x)
        assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == (x * 3).ravel().tolist()
    finally:
        for name in ("scale-ts", "scale-onnx"):
            if any(m.name == name for m in admin.models()):
                admin.undeploy(name)


def _scale_onnx(path: Path) -> None:
    """An ONNX model computing y = x * 3 for x of shape [batch, 4], built with onnx's own helpers."""
    import onnx
    from onnx import TensorProto, helper

    three = helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "three"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[three],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_replicas_hold_gpu_slices_and_share_one_queue(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path
) -> None:
    info = admin.deploy("sliced", _doubler_file(tmp_path), gpu_memory="1GiB", replicas=2)
    try:
        assert len(info.jobs) == 2 and info.replicas == 2
        held = {a.job_id: a.memory for g in admin.gpus() for a in g.allocations}
        assert all(held.get(job) == 1 << 30 for job in info.jobs)  # each replica holds its slice, as a job does
        x = np.ones((1, 4), dtype=np.float32)
        assert all(_infer(server, "sliced", x).status_code == 200 for _ in range(5))
    finally:
        admin.undeploy("sliced")
    wait_for(lambda: not {a.job_id for g in admin.gpus() for a in g.allocations} & set(info.jobs), what="slices freed")


def test_deployments_are_served_again_after_a_server_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_server(state)
    try:
        with first.connect() as gpu:
            gpu.deploy("durable", _doubler_file(tmp_path))
    finally:
        first.stop()
    second = start_server(state)
    second.admin_token = first.admin_token  # printed on the first start only
    try:
        with second.connect() as gpu:
            wait_for(lambda: gpu.model("durable").state == "ready", timeout=60, what="the model ready again")
            reply = _infer(second, "durable", np.ones((1, 4), dtype=np.float32))
            assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [2.0] * 4
            gpu.undeploy("durable")
    finally:
        second.stop()


def test_the_cli_deploys_lists_and_undeploys(server: RunningServer, cli: object, tmp_path: Path) -> None:
    from tests.conftest import client_env

    run = cli  # type: ignore[assignment]
    env = client_env(server)
    model = _doubler_file(tmp_path)
    deployed = run("deploy", "cli-doubler", str(model), "--max-batch-size", "8", "--max-queue-delay", "1ms", **env)
    assert deployed.code == 0, deployed.stderr
    assert "cli-doubler version 1 ready (python)" in deployed.stderr and "input  x: FP32 [-1, 4]" in deployed.stderr
    table = run("models", **env)
    row = next(line for line in table.stdout.splitlines() if line.startswith("cli-doubler"))
    assert "ready" in row and "python" in row and "8 / 1ms" in row
    x = np.ones((3, 4), dtype=np.float32)
    assert _infer(server, "cli-doubler", x).status_code == 200  # 3 rows: the table counts them
    row = next(line for line in run("models", **env).stdout.splitlines() if line.startswith("cli-doubler"))
    assert row.split()[-2:] == ["1", "3.0"], row  # requests, rows per batch
    (listed,) = [m for m in json.loads(run("models", "--json", **env).stdout) if m["name"] == "cli-doubler"]
    assert (listed["version"], listed["state"], listed["max_batch_size"]) == (1, "ready", 8)
    missing = run("deploy", "cli-doubler", str(tmp_path / "nothing-here.keras"), **env)
    assert missing.code != 0 and "no such file or folder" in missing.stderr
    undeployed = run("undeploy", "cli-doubler", **env)
    assert undeployed.code == 0 and "cli-doubler version 1 undeployed" in undeployed.stderr
    again = run("undeploy", "cli-doubler", **env)
    assert again.code != 0 and "gpuport models" in again.stderr


def test_compressed_bodies_are_inflated_within_the_limit(server: RunningServer, doubled: gpuport.ModelInfo) -> None:
    import gzip

    x = np.ones((1, 4), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x.ravel().tolist()}]})
    headers = {"Authorization": f"Bearer {server.admin_token}", "Content-Encoding": "gzip"}
    reply = server.rest("POST", "/v2/models/doubler/infer", content=gzip.compress(body.encode()), headers=headers)
    assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [2.0] * 4
    bomb = gzip.compress(b" " * (MAX_INFER_BYTES + 1024))  # small on the wire, over the limit once inflated
    reply = server.rest("POST", "/v2/models/doubler/infer", content=bomb, headers=headers)
    assert reply.status_code == 413 and str(MAX_INFER_BYTES) in reply.json()["error"]
    headers["Content-Encoding"] = "br"
    reply = server.rest("POST", "/v2/models/doubler/infer", content=body.encode(), headers=headers)
    assert reply.status_code == 415 and "gzip, deflate" in reply.json()["error"]
    classify = {
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
        "outputs": [{"name": "y", "parameters": {"classification": 2}}],
    }
    reply = server.rest("POST", "/v2/models/doubler/infer", token=server.admin_token, json=classify)
    assert reply.status_code == 400 and "classification" in reply.json()["error"]


def test_grpc_clients_get_invalid_argument_and_not_found(server: RunningServer, doubled: gpuport.ModelInfo) -> None:
    triton_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    cert = server.state_dir / "tls" / "cert.pem"
    address = server.url.removeprefix("https://")
    headers = {"authorization": f"Bearer {server.admin_token}"}
    with triton_grpc.InferenceServerClient(url=address, ssl=True, root_certificates=str(cert)) as client:
        tensor = triton_grpc.InferInput("x", [2, 3], "FP32")
        tensor.set_data_from_numpy(np.zeros((2, 3), dtype=np.float32))
        with pytest.raises(InferenceServerException) as raised:
            client.infer("doubler", [tensor], headers=headers)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "[-1, 4]" in raised.value.message() and "[2, 3]" in raised.value.message()
        tensor = triton_grpc.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
        for model, version in (("nope", ""), ("doubler", "7")):
            with pytest.raises(InferenceServerException) as raised:
                client.infer(model, [tensor], model_version=version, headers=headers)
            assert raised.value.status() == "StatusCode.NOT_FOUND", (model, version)
        assert client.infer("doubler", [tensor], headers=headers).as_numpy("y").tolist() == [[0.0] * 4]
