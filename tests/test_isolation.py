"""Attacks by a user with an ordinary token, each asserted by what it could not do.

What holds today: the blob store answers per user (a hash is no oracle and no key), and outputs are
collected without following a job's symlinks and copied into the store, never hard-linked.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest

import gpuport
from gpuport.protocol import gpuport_pb2 as pb
from tests.conftest import RunningServer


@pytest.fixture
def alice(admin: gpuport.Client, server: RunningServer) -> gpuport.Client:
    with server.connect(admin.create_token(f"alice-{uuid.uuid4().hex[:8]}").token) as client:
        yield client


@pytest.fixture
def bob(admin: gpuport.Client, server: RunningServer) -> gpuport.Client:
    with server.connect(admin.create_token(f"bob-{uuid.uuid4().hex[:8]}").token) as client:
        yield client


def test_a_hash_neither_tells_nor_hands_out_another_users_content(
    alice: gpuport.Client, bob: gpuport.Client, tmp_path: Path
) -> None:
    secret = f"alice's API key {uuid.uuid4()}\n".encode()
    blob = hashlib.sha256(secret).hexdigest()
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "key.txt").write_bytes(secret)
    alice.push(tmp_path / "alice", "keys")

    # Bob guesses the content: the server answers as if nobody had it.
    assert list(bob._call(bob._snapshots.Missing, pb.BlobList(blobs=[blob])).blobs) == [blob]
    # A manifest naming it makes no snapshot of it for him.
    entry = pb.ManifestEntry(path="stolen.txt", blob=blob, size=len(secret), mode=0o644)
    reply = bob._call(bob._snapshots.Create, pb.CreateSnapshotRequest(entries=[entry], name="stolen"))
    assert list(reply.missing) == [blob] and not reply.snapshot_id
    assert "stolen" not in [s.name for s in bob.snapshots()]

    # Sending the bytes proves he has them: then the snapshot is his, and he sent them all.
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "key.txt").write_bytes(secret)
    pushed = bob.push(tmp_path / "bob", "mine")
    assert pushed.uploaded_files == 1 and pushed.uploaded_bytes == len(secret)
    # Alice, who holds it, uploads nothing on her next push.
    again = alice.push(tmp_path / "alice", "keys")
    assert again.uploaded_files == 0


def test_outputs_are_collected_without_following_the_jobs_symlinks(admin: gpuport.Client, tmp_path: Path) -> None:
    script = """
import os
out = os.environ["GPUPORT_OUTPUT_DIR"]
os.symlink("/etc", "up")                       # work/up -> /etc
os.makedirs("results")
os.symlink("/etc/passwd", "results/passwd")
open("results/real.txt", "w").write("mine")
os.symlink("/etc/passwd", out + "/passwd")     # in $GPUPORT_OUTPUT_DIR too
os.symlink("/", out + "/root")
open(out + "/kept.txt", "w").write("kept")
"""
    job = admin.submit(["python", "-c", script], workdir=None, outputs=["up/hostname", "up", "results"]).wait(60)
    assert job.exit_code == 0, list(job.logs())
    assert "up/hostname" in job.info.message and "up" in job.info.message  # declared, but not found
    files = job.download(tmp_path, ".")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in files) == ["kept.txt", "results/real.txt"]


def test_an_output_enters_the_store_as_a_copy_the_job_cannot_change_later(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path
) -> None:
    keep = tmp_path / "kept-link"
    script = f"""
import os
path = os.environ["GPUPORT_OUTPUT_DIR"] + "/weights.bin"
open(path, "w").write("trained weights {uuid.uuid4()}")
os.link(path, {str(keep)!r})                    # a second name for the same inode, outside the job
"""
    job = admin.submit(["python", "-c", script], workdir=None).wait(60)
    assert job.exit_code == 0, list(job.logs())
    original = keep.read_text()
    keep.write_text("poisoned")  # the inode the job made, changed after the job ended
    (downloaded,) = job.download(tmp_path / "out", ".")
    assert downloaded.read_text() == original
    blob = hashlib.sha256(original.encode()).hexdigest()
    assert (server.state_dir / "blobs" / blob[:2] / blob[2:]).read_text() == original
