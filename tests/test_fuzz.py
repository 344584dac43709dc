"""Hypothesis against the path rules and the manifests a client sends: whatever comes, the server
refuses it with ``InvalidRequest``, or what it writes from it stays inside the folder it writes to,
as the kernel resolves it (``os.path.realpath`` of every entry after a real ``materialize``)."""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuport.protocol.errors import InvalidRequest
from gpuport.protocol.paths import check_path
from gpuport.server.blobs import BlobStore
from gpuport.server.services.auth import Identity
from gpuport.server.services.snapshots import Entry, SnapshotService
from gpuport.server.store import Store

# Few names, so that the examples meet: the same folder, a file that is also a folder, a link and a
# path through it; targets climb with '..' and stay with '.'.
_NAME = st.sampled_from(["a", "b", "c", "a b", "é"])
_PATH = st.one_of(
    st.lists(_NAME, min_size=1, max_size=3).map("/".join),
    st.lists(st.sampled_from(["a", "b", ".", "..", ""]), min_size=1, max_size=4).map("/".join),
    st.text(max_size=12),
)
_TARGET = st.one_of(st.lists(st.sampled_from(["a", "b", "c", ".", ".."]), min_size=1, max_size=5).map("/".join), _PATH)
_MANIFEST = st.lists(st.tuples(_PATH, st.one_of(st.none(), _TARGET)), max_size=6)
_SETTINGS = settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
USER = Identity("fuzz", admin=False)
CONTENT = b"a file's bytes"


def _inside(folder: Path, path: Path) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root + os.sep)


@_SETTINGS
@given(_PATH)
def test_a_path_is_refused_or_normal_and_inside(path: str) -> None:
    try:
        checked = check_path(path)
    except InvalidRequest:
        return
    assert checked == posixpath.normpath(checked) and not checked.startswith("/")
    with tempfile.TemporaryDirectory() as folder:
        assert _inside(Path(folder), Path(folder) / checked)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SnapshotService, str, Path]]:
    root = tmp_path_factory.mktemp("fuzz")
    store = Store(root / "state.db")
    blobs = BlobStore(root / "blobs")
    service = SnapshotService(store, blobs)
    blob, _ = blobs.ingest(io.BytesIO(CONTENT))
    assert blob == hashlib.sha256(CONTENT).hexdigest()
    service.hold(USER.name, [blob])
    yield service, blob, root
    store.close()


@_SETTINGS
@given(manifest=_MANIFEST)
def test_a_manifest_is_refused_or_written_inside_its_folder(
    snapshots: tuple[SnapshotService, str, Path], manifest: list[tuple[str, str | None]]
) -> None:
    service, blob, root = snapshots
    entries = [
        Entry(path, "" if link is not None else blob, 0 if link is not None else len(CONTENT), 0o644, link or "")
        for path, link in manifest
    ]
    try:
        record, missing = service.create(USER, entries)
    except InvalidRequest:
        return
    assert record is not None and not missing
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        work = Path(scratch) / "work"
        service.materialize(record, work)  # an accepted manifest is one the server can write
        for entry in entries:
            assert _inside(work, work / entry.path), (entry, os.path.realpath(work / entry.path))
            if not entry.link:
                assert (work / entry.path).read_bytes() == CONTENT
