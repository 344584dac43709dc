"""How a pushed folder's files reach the server: on the data port (plain bytes over TLS), its
refusals, and gRPC where that port cannot be reached."""

from __future__ import annotations

import hashlib
import socket
import ssl
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest

import gpuport
from gpuport.client import _sync
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.server.services.auth import Identity
from gpuport.server.services.staging import Staging
from tests.conftest import RunningServer, data_port_unreachable, wait_for

HEAD = struct.Struct("<c64sQ")  # as api/data_port.py reads a blob's header
END = HEAD.pack(b"Z", b"", 0)


def _project(root: Path) -> Path:
    """Three files, two of them new to the server (their content names the folder)."""
    (root / "src").mkdir(parents=True)
    (root / "train.py").write_text(f"print({str(root)!r})\n")
    (root / "src" / "big.bin").write_bytes(str(root).encode() + bytes(range(256)) * 12_000)  # 3 MB: in pieces
    (root / "empty").write_bytes(b"")
    return root


def _count_grpc_uploads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = _sync.upload_batches

    def counted(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(_sync, "upload_batches", counted)
    return calls


def _pulled_back(gpu: gpuport.Client, snapshot: gpuport.Snapshot, dest: Path) -> dict[str, bytes]:
    gpu.transport.download(snapshot.id, dest, None, None)
    return {str(p.relative_to(dest)): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def test_a_push_goes_through_the_data_port(
    admin: gpuport.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path / "project")
    grpc_uploads = _count_grpc_uploads(monkeypatch)
    snapshot = admin.push(project, name="through-data-port")
    assert snapshot.files == 3 and snapshot.uploaded_files >= 2  # the empty file may be there already
    assert grpc_uploads == []
    files = _pulled_back(admin, snapshot, tmp_path / "back")
    assert files == {p: (project / p).read_bytes() for p in ("empty", "src/big.bin", "train.py")}


def test_without_the_data_port_a_push_goes_through_grpc(
    admin: gpuport.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path / "project")
    grpc_uploads = _count_grpc_uploads(monkeypatch)
    data_port_unreachable(admin)
    with pytest.warns(UserWarning, match="data port"):
        snapshot = admin.push(project, name="through-grpc")
    assert snapshot.uploaded_files >= 2 and grpc_uploads == [1]
    assert _pulled_back(admin, snapshot, tmp_path / "back")["src/big.bin"] == (project / "src/big.bin").read_bytes()


def _connect(server: RunningServer, admin: gpuport.Client) -> ssl.SSLSocket:
    """A data-port connection whose blob ticket is sent and answered ``B``."""
    ticket = admin.transport.call(admin.transport.sessions.Transfer, pb.TransferRequest(blobs=True))
    context = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    context.check_hostname = False
    conn = context.wrap_socket(socket.create_connection(("127.0.0.1", ticket.port), timeout=30))
    conn.sendall(ticket.ticket.encode() + b"\n")
    said = conn.recv(1)
    if said != b"B":
        said += conn.recv(1000)
        conn.close()
        raise AssertionError(f"the data port answered {said!r}")
    return conn


def _answer(conn: ssl.SSLSocket) -> bytes:
    """The server's answer: ``K`` and two counts, or ``E`` and why, one line (the server reads on
    until the sender closes, as a sender reads the answer only once it has sent everything)."""
    answer = conn.recv(1)
    while answer and not (answer.startswith(b"K") and len(answer) == 17 or answer.endswith(b"\n")):
        if not (chunk := conn.recv(4096)):
            break
        answer += chunk
    return answer


def _blob(data: bytes) -> tuple[str, bytes]:
    blob = hashlib.sha256(data).hexdigest()
    return blob, HEAD.pack(b"F", blob.encode(), len(data)) + data


def _stored(server: RunningServer, blob: str) -> bool:
    return (server.state_dir / "blobs" / blob[:2] / blob[2:]).exists()


def test_a_blob_whose_bytes_do_not_match_is_refused_and_the_ones_before_it_stay(
    server: RunningServer, admin: gpuport.Client
) -> None:
    good, good_frame = _blob(b"the good file")
    claimed = hashlib.sha256(b"the real content").hexdigest()
    with _connect(server, admin) as conn:
        conn.sendall(good_frame + HEAD.pack(b"F", claimed.encode(), 14) + b"something else" + END)
        answer = _answer(conn)
    assert answer.startswith(b"Ethe bytes uploaded as blob " + claimed.encode() + b" hash to")
    assert not _stored(server, claimed) and _stored(server, good)
    entries = [
        pb.ManifestEntry(path="good", blob=good, size=13, mode=0o644),
        pb.ManifestEntry(path="bad", blob=claimed, size=16, mode=0o644),
    ]
    reply = admin.transport.call(admin.transport.snapshots.Create, pb.CreateSnapshotRequest(entries=entries))
    assert list(reply.missing) == [claimed]  # the good one is the sender's already


def test_blobs_are_the_senders_once_the_answer_says_they_were_placed(
    server: RunningServer, admin: gpuport.Client
) -> None:
    """The sender's next call after the answer (its snapshot) finds them held: the answer came
    before they were recorded as held, and on a busy machine a push's snapshot found its file
    missing and sent it again. So with an upload refused at a later blob: the answer that says so
    comes after the ones before it are the sender's."""
    bad = HEAD.pack(b"F", hashlib.sha256(b"the real content").hexdigest().encode(), 14) + b"something else"
    for n in range(40):
        blob, frame = _blob(f"{uuid.uuid4()} {n}".encode())
        with _connect(server, admin) as conn:
            conn.sendall(frame + (bad if n % 2 else b"") + END)
            assert _answer(conn).startswith(b"E" if n % 2 else b"K")
            missing = admin.transport.call(admin.transport.snapshots.Missing, pb.BlobList(blobs=[blob]))
            assert list(missing.blobs) == [], n


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (HEAD.pack(b"F", b"not-a-hash".ljust(64, b"x"), 1) + b"x", b"is not a blob id"),
        (HEAD.pack(b"Q", b"a" * 64, 1), b"where a blob's header was expected"),
        (HEAD.pack(b"F", b"a" * 64, (64 << 30) + 1), b"is larger than the limit"),
    ],
    ids=["bad-id", "bad-kind", "too-large"],
)
def test_a_malformed_blob_upload_is_refused_with_the_reason(
    server: RunningServer, admin: gpuport.Client, frame: bytes, problem: bytes
) -> None:
    with _connect(server, admin) as conn:
        conn.sendall(frame + END)
        answer = _answer(conn)
    assert answer.startswith(b"E") and problem in answer, answer


def test_a_blob_ticket_is_used_once_and_a_cut_upload_leaves_nothing(
    server: RunningServer, admin: gpuport.Client
) -> None:
    ticket = admin.transport.call(admin.transport.sessions.Transfer, pb.TransferRequest(blobs=True))
    context = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    context.check_hostname = False
    with context.wrap_socket(socket.create_connection(("127.0.0.1", ticket.port), timeout=30)) as conn:
        conn.sendall(ticket.ticket.encode() + b"\n")
        assert conn.recv(1) == b"B"
        data = b"y" * 3_000_000
        blob = hashlib.sha256(data).hexdigest()
        conn.sendall(HEAD.pack(b"F", blob.encode(), len(data)) + data[:1_500_000])
        folder = server.state_dir / "blobs" / blob[:2]
        wait_for(lambda: folder.exists() and any(p.name.endswith(".part") for p in folder.iterdir()), what="a part")
    wait_for(lambda: not any(p.name.endswith(".part") for p in folder.iterdir()), what="the part removed")
    assert not _stored(server, blob)
    with context.wrap_socket(socket.create_connection(("127.0.0.1", ticket.port), timeout=30)) as again:
        again.sendall(ticket.ticket.encode() + b"\n")
        assert _answer(again).startswith(b"Ethis ticket is unknown")
    assert admin.ping() > 0  # the server is fine


@pytest.mark.parametrize("data_port", [True, False], ids=["data-port", "grpc"])
def test_a_file_changed_after_it_was_hashed_fails_the_push_with_the_servers_reason(
    admin: gpuport.Client, tmp_path: Path, data_port: bool
) -> None:
    project = _project(tmp_path / "project")
    if not data_port:
        admin.transport.data_port = 0
    original = admin.transport._send

    def changed_first(*args: Any) -> Any:
        (project / "train.py").write_text((project / "train.py").read_text().upper())  # same size
        return original(*args)

    admin.transport._send = changed_first  # type: ignore[method-assign]
    with pytest.raises(gpuport.InvalidRequest, match="hash to .* the file changed while it was uploaded"):
        admin.push(project, name="changed")
    assert "changed" not in [s.name for s in admin.snapshots()]


def test_a_revoked_tokens_upload_is_cut_at_once(server: RunningServer, admin: gpuport.Client) -> None:
    name = f"dave-{uuid.uuid4().hex[:8]}"
    with server.connect(admin.create_token(name).token) as dave, _connect(server, dave) as conn:
        data = b"z" * 3_000_000
        blob = hashlib.sha256(data).hexdigest()
        conn.sendall(HEAD.pack(b"F", blob.encode(), len(data)) + data[:1_500_000])  # past the first 1 MiB buffer
        folder = server.state_dir / "blobs" / blob[:2]
        wait_for(lambda: folder.exists() and any(p.name.endswith(".part") for p in folder.iterdir()), what="a part")
        admin.revoke_token(name)
        conn.settimeout(10)
        try:
            said = conn.recv(100)
        except OSError:  # the TLS end cut short
            said = b""
        assert said == b""
    wait_for(lambda: not any(p.name.endswith(".part") for p in folder.iterdir()), what="the part removed")
    assert not _stored(server, blob)


def test_tickets_for_blobs_channels_and_tunnels_outlive_the_drop_of_staged_values() -> None:
    staging = Staging()
    caller = Identity("erin", admin=False)
    tickets = {kind: staging.ticket("", kind, caller) for kind in ("blobs", "channel", "tunnel:tf")}
    staging.drop(older_than=0)  # what a session's end and the server's sweep do
    for kind, ticket in tickets.items():
        found = staging.redeem(ticket)
        assert found is not None and found.kind == kind and found.caller == caller
