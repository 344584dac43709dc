"""Storage quotas: what a user keeps counts against them; past the quota nothing is kept; the sweep
removes blobs nobody keeps, and `gpuport snapshots rm` lets a user free their space."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuport
from tests.conftest import RunningServer, client_env, data_port_unreachable, needs_users, start_server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of its own that removes unreferenced blobs at once (``--blob-grace 0s``)."""
    needs_users()
    running = start_server(tmp_path_factory.mktemp("state") / "gpuport", "--blob-grace", "0s")
    yield running
    running.stop()


@pytest.fixture
def user(box: RunningServer) -> Iterator[tuple[str, str, gpuport.Client]]:
    """A fresh user: (name, token, client)."""
    name = f"u-{uuid.uuid4().hex[:8]}"
    with box.connect() as admin:
        token = admin.create_token(name).token
    with box.connect(token) as client:
        yield name, token, client


def _folder(root: Path, size: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "data.bin").write_bytes(os.urandom(size))
    return root


def _use(client: gpuport.Client, name: str) -> int:
    (mine,) = [q for q in client.quotas() if q.user == name]
    assert mine.storage_used is not None and mine.storage is not None
    return mine.storage_used


def _held(box: RunningServer, name: str) -> int:
    import sqlite3

    with sqlite3.connect(box.state_dir / "gpuport.db") as db:
        return int(db.execute("SELECT COUNT(*) FROM blob_holders WHERE owner = ?", (name,)).fetchone()[0])


def test_quota_list_shows_the_use_after_a_push(box: RunningServer, user: tuple, tmp_path: Path, cli: object) -> None:
    name, token, client = user
    assert _use(client, name) == 0
    client.push(_folder(tmp_path / "p", 300 * 1024), "proj")
    assert _use(client, name) >= 300 * 1024
    shown = cli("quota", "list", **client_env(box, token))  # type: ignore[operator]
    assert shown.code == 0, shown.output
    assert "USED" in shown.stdout and "STORAGE" in shown.stdout
    assert name in shown.stdout and "300" in shown.stdout  # 300.0 KiB, however it is rounded


def test_a_push_over_the_quota_is_refused_and_nothing_is_stored(
    box: RunningServer, user: tuple, tmp_path: Path, cli: object
) -> None:
    name, token, client = user
    set_quota = cli("quota", "set", name, "--storage", "1MiB", **client_env(box))  # type: ignore[operator]
    assert set_quota.code == 0, set_quota.output
    with pytest.raises(gpuport.ResourceUnavailable) as refused:
        client.push(_folder(tmp_path / "big", 2 * MiB), "big")
    message = str(refused.value)
    assert "storage quota exceeded" in message and f"gpuport quota set {name} --storage" in message
    assert client.snapshots() == []
    assert _held(box, name) == 0 and _use(client, name) == 0
    # the same through the REST archive upload: unpacked, then refused before it is recorded
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w") as tar:
        tar.add(tmp_path / "big" / "data.bin", "data.bin")
    answer = box.rest(
        "POST", "/v1/snapshots?name=big", token, content=body.getvalue(), headers={"content-type": "application/x-tar"}
    )
    assert answer.status_code >= 400 and "storage quota exceeded" in answer.text, answer.text
    assert client.snapshots() == [] and _held(box, name) == 0
    # what fits is kept
    client.push(_folder(tmp_path / "small", 100 * 1024), "small")
    assert [s.name for s in client.snapshots()] == ["small"]


@pytest.mark.parametrize("door", ["data port", "gRPC"])
def test_an_upload_past_the_quota_is_refused_even_unannounced(
    box: RunningServer, user: tuple, tmp_path: Path, door: str
) -> None:
    """A client that does not say its sizes when it asks what is missing (an older one) is stopped
    by the upload itself, and none of what it sent is the sender's."""
    name, _, client = user
    with box.connect() as admin:
        admin.set_quota(name, storage="1MiB")
    if door == "gRPC":
        data_port_unreachable(client)
    missing = client.transport.snapshots.Missing
    client.transport.snapshots.Missing = lambda request, **kw: missing(  # type: ignore[method-assign]
        type(request)(blobs=request.blobs), **kw
    )
    with contextlib.ExitStack() as stack:
        if door == "gRPC":
            stack.enter_context(pytest.warns(UserWarning, match="cannot reach the server's data port"))
        with pytest.raises(gpuport.GpuportError, match="storage quota exceeded"):
            client.push(_folder(tmp_path / "big", 2 * MiB), "big")
    assert client.snapshots() == [] and _held(box, name) == 0


def test_a_sparse_output_over_the_quota_is_not_kept(box: RunningServer, user: tuple) -> None:
    name, _, client = user
    with box.connect() as admin:
        admin.set_quota(name, storage="1MiB")
    script = "import os; open(os.environ['GPUPORT_OUTPUT_DIR'] + '/big', 'wb').truncate(2 << 30)"
    job = client.submit(["python", "-c", script], workdir=None).wait(timeout=120).info
    assert job.exit_code == 0, job.message
    assert job.state == "succeeded", job.message  # the job keeps its state
    assert "outputs not kept" in job.message and "storage quota exceeded" in job.message, job.message
    assert "would add 2GiB" in job.message, job.message
    assert job.output_snapshot_id == ""
    assert _held(box, name) == 0


def test_removing_a_snapshot_frees_its_storage_and_the_sweep_removes_its_blobs(
    box: RunningServer, user: tuple, tmp_path: Path, cli: object
) -> None:
    name, token, client = user
    snapshot = client.push(_folder(tmp_path / "d", 200 * 1024), "mydata")
    assert _use(client, name) >= 200 * 1024
    (blob,) = [e.blob for e in client.transport.call(client.transport.snapshots.Get, _ref(snapshot.id)).entries]
    path = box.state_dir / "blobs" / blob[:2] / blob[2:]
    assert path.exists()
    removed = cli("snapshots", "rm", "mydata", **client_env(box, token))  # type: ignore[operator]
    assert removed.code == 0, removed.output
    assert client.snapshots() == []
    # a user may not sweep; an admin may, and the grace here is 0 s
    assert box.rest("POST", "/v1/storage/sweep", token).status_code == 403
    swept = box.rest("POST", "/v1/storage/sweep", box.admin_token)
    assert swept.status_code == 200, swept.text
    assert swept.json()["blobs"] >= 1
    assert not path.exists()
    assert _use(client, name) == 0 and _held(box, name) == 0
    with pytest.raises(gpuport.NotFound):
        client.remove_snapshot("mydata")


def _ref(snapshot_id: str) -> object:
    from gpuport.protocol import gpuport_pb2 as pb

    return pb.SnapshotRef(snapshot_id=snapshot_id)
