"""The server's OpenAPI document, as a client generator reads it: openapi-python-client builds a
client from the running server's /openapi.json with no endpoint skipped, and that generated client
uploads a project, runs a job, downloads its output and asks a model for predictions over both
protocols, with nothing written by hand but the calls."""

from __future__ import annotations

import importlib
import io
import re
import ssl
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import gpuport
from tests._serving import simple
from tests.conftest import RunningServer

_METHODS = ("get", "put", "post", "delete", "patch")


def _generator() -> list[str]:
    found = Path(sys.executable).with_name("openapi-python-client")
    if not found.exists():
        pytest.skip("openapi-python-client is not installed (the dev extra installs it: make test)")
    return [str(found)]


@pytest.fixture(scope="module")
def generated(server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The package openapi-python-client generated from the server's /openapi.json, imported."""
    folder = tmp_path_factory.mktemp("openapi")
    document = server.rest("GET", "/openapi.json")
    assert document.status_code == 200
    (folder / "openapi.json").write_bytes(document.content)
    (folder / "config.yaml").write_text("project_name_override: gpuport_rest\npost_hooks: []\n")
    done = subprocess.run(
        [*_generator(), "generate", "--path", "openapi.json", "--meta", "none", "--config", "config.yaml"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "will not be generated" not in said, said  # no endpoint skipped
    operations = [
        (path, method) for path, ops in document.json()["paths"].items() for method in ops if method in _METHODS
    ]
    modules = [p for p in (folder / "gpuport_rest" / "api").rglob("*.py") if p.name != "__init__.py"]
    assert len(modules) == len(operations), (sorted(p.stem for p in modules), operations)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("gpuport_rest")
    finally:
        sys.path.remove(str(folder))
        for name in [n for n in sys.modules if n == "gpuport_rest" or n.startswith("gpuport_rest.")]:
            del sys.modules[name]


def _api(package: Any, tag: str, operation: str) -> Any:
    return importlib.import_module(f"gpuport_rest.api.{tag}.{operation}")


def test_the_document_declares_every_path_parameter_and_the_bearer_scheme(server: RunningServer) -> None:
    document = server.rest("GET", "/openapi.json").json()
    assert document["components"]["securitySchemes"]["HTTPBearer"] == {"type": "http", "scheme": "bearer"}
    for path, operations in document["paths"].items():
        declared = set(re.findall(r"{([^}]+)}", path))
        for method, operation in operations.items():
            named = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert named == declared, (method, path)
            assert "422" not in operation["responses"], (method, path)  # gpuport answers bad input with 400
    infer = document["paths"]["/v2/models/{name}/infer"]["post"]
    assert infer["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/InferRequest"
    }
    assert "/v1/models/{name}/labels/{label}:predict" in document["paths"]


def test_the_generated_client_runs_a_job_and_asks_for_predictions(
    server: RunningServer, admin: gpuport.Client, user_token: str, generated: Any, tmp_path: Path
) -> None:
    from gpuport_rest import AuthenticatedClient
    from gpuport_rest.models import InferInput, InferRequest, JobCreate, PredictRequest
    from gpuport_rest.types import File

    (tmp_path / "m").mkdir()
    cloudpickle.register_pickle_by_value(simple)
    try:
        (tmp_path / "m" / "model.pkl").write_bytes(cloudpickle.dumps(simple.Simple()))
    finally:
        cloudpickle.unregister_pickle_by_value(simple)
    admin.deploy("openapi-simple", tmp_path / "m" / "model.pkl")
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    client = AuthenticatedClient(base_url=server.http_url, token=user_token, verify_ssl=trust)
    try:
        assert _api(generated, "default", "whoami_v1_whoami_get").sync(client=client) is not None

        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            data = b"import os\nos.makedirs('out', exist_ok=True)\nopen('out/a.txt', 'w').write('made')\n"
            info = tarfile.TarInfo("run.py")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        upload = _api(generated, "default", "upload_snapshot_v1_snapshots_post")
        made = upload.sync_detailed(
            client=client, body=File(payload=io.BytesIO(archive.getvalue()), file_name="p.tgz"), name="openapi-p"
        )
        assert made.status_code == 201, made.content

        submit = _api(generated, "default", "submit_job_v1_jobs_post")
        job = submit.sync_detailed(
            client=client, body=JobCreate(script="run.py", project="openapi-p", outputs=["out/"])
        )
        assert job.status_code == 201, job.content
        job_id = job.parsed.additional_properties["job_id"]
        get_job = _api(generated, "default", "get_job_v1_jobs_job_id_get")
        deadline = time.monotonic() + 60
        while get_job.sync(job_id, client=client).additional_properties["state"] in ("queued", "running"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        output = _api(generated, "default", "job_output_v1_jobs_job_id_outputs_path_get")
        assert output.sync_detailed(job_id, "out/a.txt", client=client).content == b"made"

        infer = _api(generated, "k_serve_v_2", "predict_v2_models_name_infer")
        inputs = [
            InferInput(name=f"INPUT{i}", shape=[1, 16], datatype="INT32", data=list(range(16)) if i == 0 else [1] * 16)
            for i in (0, 1)
        ]
        answer = infer.sync("openapi-simple", client=client, body=InferRequest(inputs=inputs))
        by_name = {o.name: o.data for o in answer.outputs}
        assert by_name["OUTPUT0"] == [x + 1 for x in range(16)] and by_name["OUTPUT1"] == [x - 1 for x in range(16)]

        metadata = _api(generated, "k_serve_v_2", "model_metadata_v2_models_name_get").sync(
            "openapi-simple", client=client
        )
        assert metadata.platform == "python" and [i.name for i in metadata.inputs] == ["INPUT0", "INPUT1"]
        stats = _api(generated, "k_serve_v_2", "model_statistics_v2_models_name_stats_get")
        assert stats.sync("openapi-simple", client=client).model_stats[0].inference_stats.success.count >= 1

        predict = _api(generated, "tensor_flow_serving", "predict_v1_models_name_predict")
        rows = PredictRequest(instances=[{"INPUT0": [0] * 16, "INPUT1": [2] * 16}])
        assert predict.sync("openapi-simple", client=client, body=rows).predictions[0]["OUTPUT0"] == [2] * 16
    finally:
        client.get_httpx_client().close()
        admin.undeploy("openapi-simple")
