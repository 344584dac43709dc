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
        gpu.deploy("simple", _pickled(folder / "simple", simple.Simple()))
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
