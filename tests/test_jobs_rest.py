"""The REST door for jobs, and bad input through all three doors (Python, CLI, REST): a clear
error, and nothing changed."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuport
from gpuport.protocol import gpuport_pb2 as pb
from tests.conftest import RunningServer, client_env, rest_job_ended, wait_for


def _rest_job(server: RunningServer, token: str, body: dict[str, object]) -> dict[str, object]:
    created = server.rest("POST", "/v1/jobs", token, json=body)
    assert created.status_code == 201, created.text
    return rest_job_ended(server, token, created.json()["job_id"], timeout=30)


@pytest.mark.parametrize("use_sdk", [True, False], ids=["python", "rest"])
def test_submit_wait_and_read_logs_through_either_door(server: RunningServer, user_token: str, use_sdk: bool) -> None:
    command = ["python", "-c", "import os; print('hi', os.environ['GREETING'])"]
    if use_sdk:
        with server.connect(user_token) as gpu:
            job = gpu.submit(command, workdir=None, env={"GREETING": "there"}).wait(30)
            state, code, text = job.info.state, job.info.exit_code, "\n".join(job.logs()) + "\n"
    else:
        info = _rest_job(server, user_token, {"command": command, "env": {"GREETING": "there"}})
        state, code = info["state"], info["exit_code"]
        text = server.rest("GET", f"/v1/jobs/{info['job_id']}/logs", user_token).json()["data"]
    assert (state, code, text) == ("succeeded", 0, "hi there\n")


def test_script_with_hyperparameters_in_a_pushed_project(
    server: RunningServer, user_token: str, tmp_path: Path
) -> None:
    (tmp_path / "fit.py").write_text(
        "import json, sys\nprint(sys.argv[1:])\nprint(json.load(open('hyperparameters.json')))\n"
    )
    with server.connect(user_token) as gpu:
        gpu.push(tmp_path, "rest-project")
    assert "rest-project" in [s["name"] for s in server.rest("GET", "/v1/snapshots", user_token).json()]
    body = {
        "script": "fit.py",
        "hyperparameters": {"epochs": 3, "lr": 0.01, "optimizer": "adam"},
        "project": "rest-project",
    }
    info = _rest_job(server, user_token, body)
    assert info["state"] == "succeeded", info
    logs = server.rest("GET", f"/v1/jobs/{info['job_id']}/logs", user_token).json()
    assert logs["complete"] is True
    assert logs["data"].splitlines() == [
        "['--epochs', '3', '--lr', '0.01', '--optimizer', 'adam']",
        "{'epochs': 3, 'lr': 0.01, 'optimizer': 'adam'}",
    ]
    assert info["job_id"] in [j["job_id"] for j in server.rest("GET", "/v1/jobs", user_token).json()]


def test_rest_logs_by_offset_and_cancel(server: RunningServer, user_token: str) -> None:
    script = "import time\nprint('é' * 3000, flush=True)\ntime.sleep(60)"
    created = server.rest("POST", "/v1/jobs", user_token, json={"command": ["python", "-c", script]}).json()
    job_id = created["job_id"]
    path = f"/v1/jobs/{job_id}/logs"
    wait_for(lambda: server.rest("GET", path, user_token).json()["next_offset"] > 0, what="the job's output")
    first = server.rest("GET", path, user_token, params={"offset": 0, "limit": 1001}).json()
    assert first["next_offset"] == 1000  # never half a character
    rest = server.rest("GET", path, user_token, params={"offset": first["next_offset"]}).json()
    assert first["data"] + rest["data"] == "é" * 3000 + "\n" and rest["complete"] is False
    cancelled = server.rest("POST", f"/v1/jobs/{job_id}/cancel", user_token)
    assert cancelled.status_code == 200
    wait_for(lambda: server.rest("GET", f"/v1/jobs/{job_id}", user_token).json()["state"] == "cancelled", what="cancel")
    again = server.rest("POST", f"/v1/jobs/{job_id}/cancel", user_token)
    assert again.status_code == 409 and "already ended" in again.json()["error"]["message"]


def test_openapi_docs_list_the_job_routes(server: RunningServer) -> None:
    paths = server.rest("GET", "/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/logs", "/v1/jobs/{job_id}/cancel"} <= set(paths)
    # No pages that load script from a CDN into the dashboard's origin.
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert server.rest("GET", page, server.admin_token).status_code == 404


# ---- bad input: a clear error, and nothing changes ------------------------------------------------------


def _job_count(admin: gpuport.Client) -> int:
    return len(admin.jobs(all=True))


def test_another_users_job_is_not_found_through_every_door(
    server: RunningServer, admin: gpuport.Client, user_token: str, cli: object
) -> None:
    job = admin.submit(["true"], workdir=None).wait(30)
    with server.connect(user_token) as gpu:
        with pytest.raises(gpuport.NotFound, match=f"no job '{job.id}'"):
            gpu.job(job.id)
        assert job.id not in [j.id for j in gpu.jobs(all=True)]
    for method, path in [("GET", ""), ("GET", "/logs"), ("POST", "/cancel")]:
        response = server.rest(method, f"/v1/jobs/{job.id}{path}", user_token)
        assert response.status_code == 404 and response.json()["error"]["type"] == "NotFound"
    result = cli("logs", job.id, **client_env(server, user_token))  # type: ignore[operator]
    assert result.code == 1 and f"no job '{job.id}'" in result.stderr
    assert admin.job(job.id).status == "succeeded"  # untouched


def test_unknown_job_through_every_door(server: RunningServer, user_token: str, cli: object) -> None:
    with server.connect(user_token) as gpu, pytest.raises(gpuport.NotFound):
        gpu.job("j-00000000")
    assert server.rest("GET", "/v1/jobs/j-00000000", user_token).status_code == 404
    result = cli("wait", "j-00000000", **client_env(server, user_token))  # type: ignore[operator]
    assert result.code == 1 and "no job 'j-00000000'" in result.stderr


def test_more_gpus_than_the_server_has_through_every_door(
    server: RunningServer, admin: gpuport.Client, cli: object, tmp_path: Path
) -> None:
    before = _job_count(admin)
    message = "asked for 3 GPUs; this server has 2 x 16GiB"
    # Unsatisfiable: no wait would grant it, so not 429 (which clients retry); still a ResourceUnavailable.
    with pytest.raises(gpuport.Unsatisfiable, match=message) as raised:
        admin.submit(["true"], workdir=None, gpus=3)
    assert isinstance(raised.value, gpuport.ResourceUnavailable) and isinstance(raised.value, gpuport.InvalidRequest)
    response = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": ["true"], "gpus": 3})
    assert response.status_code == 422 and response.json()["error"] == {"type": "Unsatisfiable", "message": message}
    result = cli("run", "--gpus", "3", "--", "true", cwd=tmp_path, **client_env(server))  # type: ignore[operator]
    assert result.code == 1 and message in result.stderr
    assert _job_count(admin) == before


def test_a_symlink_leaving_the_workdir_is_refused_before_upload(
    server: RunningServer, admin: gpuport.Client, cli: object, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print(1)")
    os.symlink("/etc/hostname", project / "host")
    before = _job_count(admin)
    with pytest.raises(gpuport.InvalidRequest, match=r"host is a symlink to /etc/hostname, outside the workdir"):
        admin.submit(["python", "train.py"], workdir=project)
    result = cli("run", "--", "python", "train.py", cwd=project, **client_env(server))  # type: ignore[operator]
    assert result.code == 1 and "host is a symlink to /etc/hostname, outside the workdir" in result.stderr
    assert _job_count(admin) == before


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (pb.ManifestEntry(path="/etc/passwd", blob="a" * 64, size=1, mode=0o644), "is absolute"),
        (pb.ManifestEntry(path="../../.ssh/authorized_keys", blob="a" * 64, size=1, mode=0o644), "contains '..'"),
        (pb.ManifestEntry(path="a/../b", blob="a" * 64, size=1, mode=0o644), "contains '..'"),
        (pb.ManifestEntry(path="evil", link="../../../etc", mode=0o777), "outside the workdir"),
        (pb.ManifestEntry(path="evil", link="/etc", mode=0o777), "outside the workdir"),
        (pb.ManifestEntry(path="x", blob="not-a-hash", size=1, mode=0o644), "not a blob id"),
    ],
)
def test_the_server_refuses_bad_manifest_paths(admin: gpuport.Client, entry: pb.ManifestEntry, problem: str) -> None:
    request = pb.CreateSnapshotRequest(entries=[entry], name="evil")
    with pytest.raises(gpuport.InvalidRequest, match=problem):
        admin.transport.call(admin.transport.snapshots.Create, request)
    assert "evil" not in [s.name for s in admin.snapshots()]


def test_a_blob_whose_bytes_do_not_match_its_hash_is_refused(admin: gpuport.Client, server: RunningServer) -> None:
    claimed = hashlib.sha256(b"the real content").hexdigest()
    batch = pb.BlobBatch(parts=[pb.BlobPart(blob=claimed, offset=0, data=b"something else", last=True)])
    with pytest.raises(gpuport.InvalidRequest, match=f"uploaded as blob {claimed} hash to"):
        admin.transport.call(admin.transport.snapshots.Upload, iter([batch]))
    assert not (server.state_dir / "blobs" / claimed[:2] / claimed[2:]).exists()
    entry = pb.ManifestEntry(path="f", blob=claimed, size=16, mode=0o644)
    reply = admin.transport.call(admin.transport.snapshots.Create, pb.CreateSnapshotRequest(entries=[entry]))
    assert list(reply.missing) == [claimed] and not reply.snapshot_id


def test_requests_over_the_size_limits_are_refused(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path
) -> None:
    before = _job_count(admin)
    with pytest.raises(gpuport.InvalidRequest, match="environment is larger than the limit"):
        admin.submit(["true"], workdir=None, env={"BIG": "x" * 300_000})
    big = server.rest("POST", "/v1/jobs", server.admin_token, content=json.dumps({"command": ["x" * 2_000_000]}))
    assert big.status_code == 413 and "over the limit" in big.json()["error"]["message"]
    with pytest.raises(gpuport.InvalidRequest, match="is longer than 1024 bytes"):
        admin.submit(["true"], workdir=None, outputs=["d/" * 600])
    assert _job_count(admin) == before


def test_malformed_requests_say_what_is_wrong(server: RunningServer, admin: gpuport.Client) -> None:
    before = _job_count(admin)
    for body, problem in [
        ({"command": ["true"], "script": "x.py"}, "either `command` or `script`"),
        ({}, "either `command` or `script`"),
        ({"command": ["true"], "gpus": "many"}, "gpus"),
        ({"script": "../up.py"}, "contains '..'"),
        ({"script": "-c", "hyperparameters": {"x": 1}}, "would read as an option"),
        ({"command": ["true"], "env": {"GPUPORT_JOB_ID": "x"}}, "set by gpuport"),
        ({"command": ["true"], "project": "nope"}, "no snapshot named 'nope'"),
    ]:
        response = server.rest("POST", "/v1/jobs", server.admin_token, json=body)
        assert response.status_code in (400, 404), response.text
        assert problem in response.json()["error"]["message"], response.text
    with pytest.raises(gpuport.InvalidRequest, match="not valid"):
        admin.submit(["true"], workdir=None, env={"1BAD": "x"})
    assert _job_count(admin) == before


def test_upload_without_a_valid_token_is_refused(server: RunningServer) -> None:
    with server.connect() as gpu:
        gpu.transport.metadata = (("authorization", "Bearer gp_wrong"),)
        with pytest.raises(gpuport.AuthenticationError):
            gpu.transport.call(gpu.transport.snapshots.Upload, iter([pb.BlobBatch()]))


def test_a_client_that_vanishes_mid_upload_leaves_nothing_behind(admin: gpuport.Client, server: RunningServer) -> None:
    blob = hashlib.sha256(b"x" * 2_000_000).hexdigest()
    sent, released = threading.Event(), threading.Event()

    def parts() -> Iterator[pb.BlobBatch]:
        yield pb.BlobBatch(parts=[pb.BlobPart(blob=blob, offset=0, data=b"x" * 1_000_000, last=False)])
        sent.set()
        released.wait(30)  # the client goes silent, then away

    call = admin.transport.snapshots.Upload.future(parts(), metadata=admin.transport.metadata)
    try:
        assert sent.wait(10)
        folder = server.state_dir / "blobs" / blob[:2]
        wait_for(lambda: folder.exists() and any(p.name.endswith(".part") for p in folder.iterdir()), what="a part")
        call.cancel()
        wait_for(lambda: not any(p.name.endswith(".part") for p in folder.iterdir()), what="the part removed")
    finally:
        released.set()
    assert not (folder / blob[2:]).exists()
    with server.connect() as gpu:  # the server is fine
        assert gpu.ping() > 0


def test_a_route_that_does_not_exist_answers_in_gpuport_s_error_format(server: RunningServer) -> None:
    """FastAPI's own 404 and 405 come in the API's error format, never as {"detail": ...}; on the
    prediction protocols' paths, as theirs: {"error": "..."}."""
    missing = server.rest("GET", "/v1/no-such-thing", server.admin_token)
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "type": "NotFound",
            "message": "no such route: GET /v1/no-such-thing — the REST API is listed at /openapi.json",
        }
    }
    wrong = server.rest("DELETE", "/v1/health", server.admin_token)
    assert wrong.status_code == 405
    assert wrong.json() == {"error": {"type": "MethodNotAllowed", "message": "/v1/health does not take DELETE"}}
    assert "GET" in wrong.headers["allow"]
    on_v2 = server.rest("DELETE", "/v2/health/live", server.admin_token)
    assert on_v2.status_code == 405 and on_v2.json() == {"error": "/v2/health/live does not take DELETE"}
