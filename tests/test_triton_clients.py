"""Triton's example clients' flows, unchanged but for the address and their TLS files, against models
shaped as Triton's examples expect (``simple``, ``simple_string``): authenticated by a client
certificate from `gpuport token create NAME --client-cert DIR` instead of a header.

Each flow does what tritonclient's published examples do (simple_http_infer_client.py,
simple_grpc_infer_client.py, simple_*_string_infer_client.py, simple_*_health_metadata.py,
simple_*_async_infer_client.py): their TLS options (``--ssl --key-file --cert-file --ca-certs`` over
HTTP; ``--ssl --private-key --certificate-chain --root-certificates`` over gRPC) are the only
credentials they send.
"""

from __future__ import annotations

import datetime
import queue
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

import gpuport
from tests._serving import simple
from tests.conftest import RunningServer, needs_users

# What a caller without credentials is told of a model that is not public, or not there (a pattern).
UNKNOWN_TO_ANONYMOUS = r"Request for unknown model: '%s' is not found — or it is not public"


def _pickled(folder: Path, model: object) -> Path:
    folder.mkdir()
    cloudpickle.register_pickle_by_value(simple)
    try:
        path = folder / "model.pkl"
        path.write_bytes(cloudpickle.dumps(model))
    finally:
        cloudpickle.unregister_pickle_by_value(simple)
    return path


@pytest.fixture(scope="module")
def models(server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``simple`` and ``simple_string``, deployed by the admin."""
    folder = tmp_path_factory.mktemp("simple")
    with server.connect() as gpu:
        gpu.deploy("simple", _pickled(folder / "simple", simple.Simple()), max_batch_size=8)
        gpu.deploy("simple_string", _pickled(folder / "simple_string", simple.SimpleString()))
        try:
            yield
        finally:
            gpu.undeploy("simple")
            gpu.undeploy("simple_string")


@pytest.fixture
def certificate(server: RunningServer, cli: Any, tmp_path: Path, models: None) -> Path:
    """A new user's client certificate, made as an admin would: `gpuport token create NAME --client-cert DIR`."""
    needs_users()
    assert cli("login", server.url, "--token", server.admin_token, "--yes").code == 0
    folder = tmp_path / "alice-cert"
    name = f"alice-{tmp_path.name[-12:]}".replace("_", "-")
    done = cli("token", "create", name, "--client-cert", str(folder))
    assert done.code == 0, done.stderr
    assert f"127.0.0.1:{server.cert_port}" in done.stderr and done.stdout.startswith("gp_")
    assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
    assert (folder / "key.pem").stat().st_mode & 0o077 == 0
    return folder


def _address(url: str) -> str:
    return url.removeprefix("https://").rstrip("/")


def _http_client(server: RunningServer, certs: Path, **kw: Any) -> triton_http.InferenceServerClient:
    """As simple_http_infer_client.py builds it with --ssl --key-file --cert-file --ca-certs."""
    ssl_options = {
        "keyfile": str(certs / "key.pem"),
        "certfile": str(certs / "cert.pem"),
        "ca_certs": str(certs / "ca.pem"),
    }
    return triton_http.InferenceServerClient(url=_address(server.http_url), ssl=True, ssl_options=ssl_options, **kw)


def _grpc_client(server: RunningServer, certs: Path) -> triton_grpc.InferenceServerClient:
    """As simple_grpc_infer_client.py builds it with --ssl --root-certificates --private-key
    --certificate-chain, at the server's port for client certificates."""
    return triton_grpc.InferenceServerClient(
        url=f"127.0.0.1:{server.cert_port}",
        ssl=True,
        root_certificates=str(certs / "ca.pem"),
        private_key=str(certs / "key.pem"),
        certificate_chain=str(certs / "cert.pem"),
    )


def _simple_inputs(module: Any, binary: bool = True) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """INPUT0 = 0..15 and INPUT1 = 1s, [1, 16] INT32, as the simple examples send them."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    if module is triton_http:
        inputs[0].set_data_from_numpy(a, binary_data=binary)
        inputs[1].set_data_from_numpy(b, binary_data=False)  # the example mixes binary and JSON
    else:
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def test_tritonclient_http_with_a_client_certificate(server: RunningServer, certificate: Path) -> None:
    """simple_http_infer_client.py, simple_http_health_metadata.py and simple_http_async_infer_client.py
    with --ssl --key-file --cert-file --ca-certs, no header."""
    with _http_client(server, certificate, concurrency=2) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("simple")
        metadata = client.get_model_metadata("simple")
        assert metadata["name"] == "simple" and [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
        assert client.get_server_metadata()["name"] == "gpuport"

        inputs, a, b = _simple_inputs(triton_http)
        outputs = [
            triton_http.InferRequestedOutput("OUTPUT0", binary_data=True),
            triton_http.InferRequestedOutput("OUTPUT1", binary_data=False),
        ]
        result = client.infer("simple", inputs, outputs=outputs)
        assert (result.as_numpy("OUTPUT0") == a + b).all() and (result.as_numpy("OUTPUT1") == a - b).all()

        pending = [client.async_infer("simple", _simple_inputs(triton_http)[0]) for _ in range(4)]
        for request in pending:
            assert (request.get_result().as_numpy("OUTPUT0") == a + b).all()

        # simple_http_string_infer_client.py: numbers as byte strings
        strings = [triton_http.InferInput(f"INPUT{i}", [1, 16], "BYTES") for i in (0, 1)]
        strings[0].set_data_from_numpy(np.array([str(x).encode() for x in a[0]], dtype=object).reshape(1, 16))
        strings[1].set_data_from_numpy(np.array([b"1"] * 16, dtype=object).reshape(1, 16), binary_data=False)
        result = client.infer("simple_string", strings)
        assert [int(x) for x in result.as_numpy("OUTPUT0")[0]] == list(a[0] + 1)

        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.get_model_metadata("nope")


def test_tritonclient_grpc_with_a_client_certificate(server: RunningServer, certificate: Path) -> None:
    """simple_grpc_infer_client.py, simple_grpc_health_metadata.py, simple_grpc_string_infer_client.py and
    simple_grpc_async_infer_client.py with --ssl --root-certificates --private-key --certificate-chain."""
    with _grpc_client(server, certificate) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
        assert client.get_model_metadata("simple").platform == "python"
        inputs, a, b = _simple_inputs(triton_grpc)
        outputs = [triton_grpc.InferRequestedOutput("OUTPUT0"), triton_grpc.InferRequestedOutput("OUTPUT1")]
        result = client.infer("simple", inputs, outputs=outputs)
        assert (result.as_numpy("OUTPUT0") == a + b).all() and (result.as_numpy("OUTPUT1") == a - b).all()

        done: queue.Queue[Any] = queue.Queue()
        client.async_infer("simple", inputs, lambda result, error: done.put((result, error)))
        result, error = done.get(timeout=30)
        assert error is None and (result.as_numpy("OUTPUT1") == a - b).all()

        strings = [triton_grpc.InferInput(f"INPUT{i}", [1, 16], np_to_triton_dtype(np.object_)) for i in (0, 1)]
        strings[0].set_data_from_numpy(np.array([str(x).encode() for x in a[0]], dtype=object).reshape(1, 16))
        strings[1].set_data_from_numpy(np.array([b"1"] * 16, dtype=object).reshape(1, 16))
        result = client.infer("simple_string", strings)
        assert [int(x) for x in result.as_numpy("OUTPUT1")[0]] == list(a[0] - 1)


def test_the_certificate_is_its_users_identity_on_the_rest_api(server: RunningServer, certificate: Path) -> None:
    """curl --cert cert.pem --key key.pem --cacert ca.pem https://.../v1/whoami: the token's user."""
    context = ssl.create_default_context(cafile=str(certificate / "ca.pem"))
    context.load_cert_chain(certificate / "cert.pem", certificate / "key.pem")
    with httpx.Client(verify=context, timeout=10) as http:
        reply = http.get(server.http_url + "/v1/whoami")
        assert reply.status_code == 200 and reply.json()["user"].startswith("alice-")
        assert reply.json()["admin"] is False
    # Without it, the same request has no credentials.
    assert server.rest("GET", "/v1/whoami").status_code == 401


def test_a_revoked_tokens_certificate_is_refused_on_both_ports(
    server: RunningServer, certificate: Path, admin: gpuport.Client
) -> None:
    with _http_client(server, certificate) as client:
        user = client.get_model_metadata("simple") and _whoami(server, certificate)
    admin.revoke_token(user)
    with _http_client(server, certificate) as client:
        with pytest.raises(InferenceServerException, match=f"client certificate of token '{user}' was revoked"):
            client.infer("simple", _simple_inputs(triton_http)[0])
    with _grpc_client(server, certificate) as client:
        with pytest.raises(InferenceServerException, match="was revoked") as raised:
            client.infer("simple", _simple_inputs(triton_grpc)[0])
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"


def _whoami(server: RunningServer, certs: Path) -> str:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(certs / "cert.pem", certs / "key.pem")
    with httpx.Client(verify=context, timeout=10) as http:
        return str(http.get(server.http_url + "/v1/whoami").json()["user"])


def _self_signed(folder: Path) -> Path:
    """A client certificate the server never signed, as someone who copied the subject would make."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "admin")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuport client CA")]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    folder.mkdir()
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder


def test_a_certificate_the_server_did_not_sign_is_refused(server: RunningServer, tmp_path: Path, models: None) -> None:
    forged = _self_signed(tmp_path / "forged")
    (forged / "ca.pem").write_bytes((server.state_dir / "tls" / "cert.pem").read_bytes())
    with _http_client(server, forged) as client:
        with pytest.raises(Exception):  # the TLS handshake fails: no answer at all
            client.infer("simple", _simple_inputs(triton_http)[0])
    with _grpc_client(server, forged) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer("simple", _simple_inputs(triton_grpc)[0])
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
    # Nor does the gRPC port for certificates take a token alone: it needs a certificate.
    server_cert = str(server.state_dir / "tls" / "cert.pem")
    with triton_grpc.InferenceServerClient(
        url=f"127.0.0.1:{server.cert_port}", ssl=True, root_certificates=server_cert
    ) as client:
        bearer = {"authorization": f"Bearer {server.admin_token}"}
        with pytest.raises(InferenceServerException) as raised:
            client.infer("simple", _simple_inputs(triton_grpc)[0], headers=bearer)
        assert raised.value.status() == "StatusCode.UNAVAILABLE"


# ---- Triton's extensions -------------------------------------------------------------------------------


def test_statistics_configuration_and_the_repository_index(server: RunningServer, certificate: Path) -> None:
    """get_inference_statistics, get_model_config and get_model_repository_index, over both protocols:
    the counts follow the predictions made; shared memory is refused by name."""
    with _http_client(server, certificate) as client:
        before = client.get_inference_statistics("simple")["model_stats"][0]
        for _ in range(3):
            client.infer("simple", _simple_inputs(triton_http)[0])
        with pytest.raises(InferenceServerException):  # a wrong shape fails before the batcher: not counted
            bad = triton_http.InferInput("INPUT0", [1, 3], "INT32")
            bad.set_data_from_numpy(np.zeros((1, 3), dtype=np.int32))
            client.infer("simple", [bad, _simple_inputs(triton_http)[0][1]])
        (stats,) = client.get_inference_statistics("simple")["model_stats"]
        assert stats["name"] == "simple" and stats["version"] == "1"
        success = stats["inference_stats"]["success"]
        assert success["count"] == before["inference_stats"]["success"]["count"] + 3 and success["ns"] > 0
        assert stats["inference_count"] >= 3 and stats["execution_count"] >= 1 and stats["last_inference"] > 0
        for part in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert stats["inference_stats"][part]["count"] >= 3, part
        assert any(b["batch_size"] == 1 and b["compute_infer"]["count"] >= 1 for b in stats["batch_stats"])
        every = client.get_inference_statistics()["model_stats"]
        assert {"simple", "simple_string"} <= {s["name"] for s in every}

        config = client.get_model_config("simple")
        assert config["name"] == "simple" and config["platform"] == "python"
        assert config["max_batch_size"] == 8 and config["dynamic_batching"]["max_queue_delay_microseconds"] > 0
        assert config["input"] == [
            {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ]
        index = client.get_model_repository_index()
        assert {"name": "simple", "version": "1", "state": "READY", "reason": ""} in index
        assert "statistics" in client.get_server_metadata()["extensions"]

        with pytest.raises(InferenceServerException, match="shared memory is refused"):
            client.register_system_shared_memory("region", "/key", 64)

    with _grpc_client(server, certificate) as client:
        (stats,) = client.get_inference_statistics("simple", as_json=True)["model_stats"]
        assert int(stats["inference_stats"]["success"]["count"]) >= 3
        config = client.get_model_config("simple", as_json=True)["config"]
        assert config["max_batch_size"] == 8 and [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
        index = client.get_model_repository_index(as_json=True)["models"]
        assert {"name": "simple", "version": "1", "state": "READY"} in index
        assert "model_configuration" in client.get_server_metadata().extensions
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.get_model_config("nope")


# ---- what needs no credentials -------------------------------------------------------------------------


def test_a_public_model_needs_no_credentials_and_health_none(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path, models: None
) -> None:
    """--public: predictions and metadata without credentials over both protocols (TLS still on);
    the other models still refuse such a caller. Health answers anyone."""
    admin.deploy("simple_public", _pickled(tmp_path / "m", simple.Simple()), public=True)
    try:
        assert admin.model("simple_public").public and not admin.model("simple").public
        root = str(server.state_dir / "tls" / "cert.pem")
        with triton_http.InferenceServerClient(
            url=_address(server.http_url), ssl=True, ssl_options={"ca_certs": root}
        ) as client:
            assert client.is_server_live() and client.get_server_metadata()["name"] == "gpuport"
            assert client.is_model_ready("simple_public") and client.get_model_metadata("simple_public")
            inputs, a, b = _simple_inputs(triton_http)
            assert (client.infer("simple_public", inputs).as_numpy("OUTPUT0") == a + b).all()
            # Another model is unknown to a caller without credentials, as a missing one is.
            for call in (lambda: client.infer("simple", inputs), lambda: client.get_model_metadata("simple")):
                with pytest.raises(InferenceServerException, match=UNKNOWN_TO_ANONYMOUS % "simple") as raised:
                    call()
                assert raised.value.status() == "404"
        with triton_grpc.InferenceServerClient(url=_address(server.url), ssl=True, root_certificates=root) as client:
            assert client.is_server_live()
            inputs, a, b = _simple_inputs(triton_grpc)
            assert (client.infer("simple_public", inputs).as_numpy("OUTPUT1") == a - b).all()
            for name in ("simple", "missing"):
                with pytest.raises(InferenceServerException, match=UNKNOWN_TO_ANONYMOUS % name) as raised:
                    client.infer(name, inputs)
                assert raised.value.status() == "StatusCode.NOT_FOUND"
        # TF Serving's REST predict, as curl would post it
        body = {"inputs": {"INPUT0": a.tolist(), "INPUT1": b.tolist()}}
        reply = server.rest("POST", "/v1/models/simple_public:predict", json=body)
        assert reply.status_code == 200 and reply.json()["outputs"]["OUTPUT0"] == (a + b).tolist()
        refused = server.rest("POST", "/v1/models/simple:predict", json=body)
        assert refused.status_code == 404 and refused.json()["error"].startswith("Request for unknown model: 'simple'")
        # A wrong token is refused as ever; routes that name no model, and deploying, still need a token.
        assert server.rest("POST", "/v1/models/simple:predict", token="gp_wrong", json=body).status_code == 401
        assert server.rest("GET", "/v2/models/stats").status_code == 401
        assert server.rest("GET", "/v1/status").status_code == 401
    finally:
        admin.undeploy("simple_public")


def _simple_http_infer_client(url: str, ca_certs: str) -> int:
    """simple_http_infer_client.py -u URL --ssl --ca-certs CERT, step by step (tritonclient's wheel does
    not ship its examples): its exit status. It asks model "simple" twice (with outputs requested and
    without), reads its statistics, then checks that a wrong model name is refused in Triton's words."""
    client = triton_http.InferenceServerClient(url=url, ssl=True, ssl_options={"ca_certs": ca_certs})
    a = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    b = np.full(shape=(1, 16), fill_value=-1, dtype=np.int32)

    def infer(model: str, outputs: bool) -> Any:
        inputs = [
            triton_http.InferInput("INPUT0", [1, 16], "INT32"),
            triton_http.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(a, binary_data=False)
        inputs[1].set_data_from_numpy(b, binary_data=True)
        wanted = [
            triton_http.InferRequestedOutput("OUTPUT0", binary_data=True),
            triton_http.InferRequestedOutput("OUTPUT1", binary_data=False),
        ]
        return client.infer(model, inputs, outputs=wanted if outputs else None, query_params={"test_1": 1, "test_2": 2})

    with client:
        for outputs in (True, False):
            results = infer("simple", outputs)
            if outputs and len(client.get_inference_statistics(model_name="simple")["model_stats"]) != 1:
                return 1  # "FAILED: Inference Statistics"
            if not ((results.as_numpy("OUTPUT0") == a + b).all() and (results.as_numpy("OUTPUT1") == a - b).all()):
                return 1  # "sync infer error: incorrect sum" (or difference)
        try:
            infer("wrong_model_name", True)
            return 1  # "expected error message for wrong model name"
        except InferenceServerException as ex:
            if not ex.message().startswith("Request for unknown model"):
                return 1  # "improper error message for wrong model name"
    return 0


def test_triton_simple_http_infer_client_with_ssl_against_a_public_model(tmp_path: Path) -> None:
    """Triton's simple_http_infer_client.py with --ssl and no credentials passes against a --public
    "simple", its wrong-model check included: to a caller without credentials a private model and a
    missing one are both unknown, in the same words; with a token, a private model answers and a
    missing one is unknown; a wrong token is refused."""
    from tests.conftest import start_server

    own = start_server(tmp_path / "state")
    try:
        root = str(own.state_dir / "tls" / "cert.pem")
        with own.connect() as admin:
            admin.deploy("simple", _pickled(tmp_path / "simple", simple.Simple()), public=True)
            admin.deploy("private", _pickled(tmp_path / "private", simple.Simple()))
        assert _simple_http_infer_client(_address(own.http_url), root) == 0

        inputs, a, b = _simple_inputs(triton_http)
        with triton_http.InferenceServerClient(_address(own.http_url), ssl=True, ssl_options={"ca_certs": root}) as c:
            said = {}
            for name in ("private", "missing"):
                with pytest.raises(InferenceServerException) as raised:
                    c.infer(name, inputs)
                assert raised.value.status() == "404"
                said[name] = raised.value.message().replace(name, "NAME")
            assert said["private"] == said["missing"] and said["private"].startswith("Request for unknown model")
            token = {"Authorization": f"Bearer {own.admin_token}"}
            assert (c.infer("private", inputs, headers=token).as_numpy("OUTPUT0") == a + b).all()
            with pytest.raises(InferenceServerException, match="gpuport models` lists the deployed ones") as raised:
                c.infer("missing", inputs, headers=token)
            assert raised.value.status() == "404"
            with pytest.raises(InferenceServerException, match="not known to this server") as raised:
                c.infer("private", inputs, headers={"Authorization": "Bearer gp_wrong"})
            assert raised.value.status() == "401"
    finally:
        own.stop()


def test_readiness_follows_the_deployments_and_a_failure_is_its_owners_to_read(tmp_path: Path, cli: Any) -> None:
    """/v2/health/ready and ServerReady are false while a deployment failed, true once it is gone;
    the loader's error reaches its owner and admins only (not another user, nor an anonymous status)."""
    from tests.conftest import start_server

    own = start_server(tmp_path / "state")
    try:
        root = str(own.state_dir / "tls" / "cert.pem")
        assert own.rest("GET", "/v2/health/ready").json() == {"ready": True}
        broken = tmp_path / "broken.onnx"
        broken.write_bytes(b"not an ONNX model")
        with own.connect() as admin:
            with pytest.raises(gpuport.ServerError, match="did not load"):
                admin.deploy("broken", broken)
            reply = own.rest("GET", "/v2/health/ready")
            assert reply.status_code == 400 and reply.json() == {"ready": False}
            with triton_grpc.InferenceServerClient(url=_address(own.url), ssl=True, root_certificates=root) as c:
                assert c.is_server_live() and not c.is_server_ready()
            assert "did not load" in admin.model("broken").message
            status = own.rest("GET", "/v1/models/broken").json()["model_version_status"][0]
            assert status["state"] == "END" and "did not load" not in status["status"]["error_message"]
            needs_users()
            other = admin.create_token("bob").token
            with own.connect(other) as bob:
                (seen,) = bob.models()
                assert seen.state == "failed" and "did not load" not in seen.message and "owner" in seen.message
            admin.undeploy("broken")
            assert own.rest("GET", "/v2/health/ready").json() == {"ready": True}
    finally:
        own.stop()


def test_byte_strings_cut_short_over_grpc_are_a_clear_invalid_argument(server: RunningServer, models: None) -> None:
    """raw_input_contents of a BYTES input whose last element is cut: INVALID_ARGUMENT naming it, the
    same codec and words as KServe's binary data over HTTP (not an internal error)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="simple_string")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="BYTES", shape=[1, 16])
    whole = b"".join(len(b"7").to_bytes(4, "little") + b"7" for _ in range(16))
    request.raw_input_contents.extend([whole, whole[:-3]])
    cert = (server.state_dir / "tls" / "cert.pem").read_bytes()
    with grpc.secure_channel(_address(server.url), grpc.ssl_channel_credentials(cert)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, metadata=(("authorization", f"Bearer {server.admin_token}"),), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents of BYTES input 'INPUT1'" in raised.value.details()


def test_tritonclient_aio_with_a_client_certificate(server: RunningServer, certificate: Path) -> None:
    """simple_http_aio_infer_client.py and simple_grpc_aio_infer_client.py: asyncio clients, with the
    same TLS files and no header."""
    import asyncio

    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http.aio as http_aio

    async def both() -> None:
        http = http_aio.InferenceServerClient(
            url=_address(server.http_url),
            ssl=True,
            ssl_context=_client_context(certificate),
        )
        try:
            assert await http.is_server_live() and await http.is_model_ready("simple")
            inputs, a, b = _simple_inputs(triton_http)
            result = await http.infer("simple", inputs)
            assert (result.as_numpy("OUTPUT0") == a + b).all()
        finally:
            await http.close()
        async with grpc_aio.InferenceServerClient(
            url=f"127.0.0.1:{server.cert_port}",
            ssl=True,
            root_certificates=str(certificate / "ca.pem"),
            private_key=str(certificate / "key.pem"),
            certificate_chain=str(certificate / "cert.pem"),
        ) as client:
            inputs, a, b = _simple_inputs(triton_grpc)
            results = await asyncio.gather(*(client.infer("simple", inputs) for _ in range(4)))
            assert all((r.as_numpy("OUTPUT1") == a - b).all() for r in results)

    asyncio.run(both())


def _client_context(certs: Path) -> ssl.SSLContext:
    """What simple_http_aio_infer_client.py builds from --ca-certs, --cert-file and --key-file."""
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(certs / "cert.pem", certs / "key.pem")
    return context
