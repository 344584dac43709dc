"""The daemon itself: first start, restart, TLS, state dir safety, --insecure, shutdown."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

import gpuport
from gpuport.protocol.tls import fingerprint

from .conftest import RunningServer, server_env, start_server


def test_first_start_creates_a_private_state_dir(server: RunningServer) -> None:
    state = server.state_dir
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "tls").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "tls" / "key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "gpuport.db").stat().st_mode) == 0o600


def test_certificate_is_ecdsa_p256_covering_the_bound_address(server: RunningServer) -> None:
    pem = (server.state_dir / "tls" / "cert.pem").read_bytes()
    cert = x509.load_pem_x509_certificate(pem)
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert cert.issuer == cert.subject
    assert server.fingerprint == fingerprint(pem)


def test_banner_shows_urls_fingerprint_and_the_admin_token_once(server: RunningServer) -> None:
    assert server.url.startswith("https://127.0.0.1:")
    assert server.http_url.startswith("https://127.0.0.1:")
    assert server.fingerprint.startswith("sha256:")
    assert server.admin_token.startswith("gp_")
    assert "2 (Fake GPU 16GiB, Fake GPU 16GiB)" in server.banner


def test_database_is_wal_and_keeps_only_token_hashes(server: RunningServer, admin: gpuport.Client) -> None:
    new = admin.create_token("hash-check")
    db = sqlite3.connect(server.state_dir / "gpuport.db")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        stored = [row[0] for row in db.execute("SELECT hash FROM tokens")]
    finally:
        db.close()
    raw = b"".join(p.read_bytes() for p in server.state_dir.glob("gpuport.db*"))
    assert new.token.encode() not in raw and server.admin_token.encode() not in raw
    assert len(stored) >= 2 and all(len(h) == 64 for h in stored)


def test_restart_keeps_certificate_and_tokens_and_prints_no_new_admin_token(tmp_path: Path) -> None:
    first = start_server(tmp_path / "state")
    with first.connect() as admin:
        alice = admin.create_token("alice").token
    assert first.stop() == 0
    second = start_server(tmp_path / "state")
    try:
        assert second.fingerprint == first.fingerprint
        assert second.admin_token == "" and "admin token" not in second.banner
        with gpuport.connect(second.url, alice, fingerprint=second.fingerprint) as client:
            assert client.user == "alice" and not client.admin
    finally:
        second.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stops_gracefully_on_signal(tmp_path: Path, sig: int) -> None:
    running = start_server(tmp_path / "state")
    assert running.stop(sig) == 0
    assert running.output[-2:] == ["stopping", "stopped"]


def test_unsafe_state_dir_is_refused_and_left_untouched(tmp_path: Path) -> None:
    state = tmp_path / "open"
    state.mkdir()
    os.chmod(state, 0o755)
    refused = start_server(state, expect_ready=False)
    assert refused.process.returncode == 1
    assert "unsafe permissions 0755" in refused.banner and f"chmod 700 {state}" in refused.banner
    assert list(state.iterdir()) == []


def test_insecure_is_refused_off_loopback(tmp_path: Path) -> None:
    env = server_env()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuport",
            "server",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(tmp_path / "state"),
            "--insecure",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1
    assert "--insecure is refused on 0.0.0.0" in done.stderr and "loopback" in done.stderr
    assert not (tmp_path / "state").exists()


def test_insecure_on_loopback_serves_plain_http(tmp_path: Path) -> None:
    running = start_server(tmp_path / "state", "--insecure")
    try:
        assert running.url.startswith("http://127.0.0.1:") and running.fingerprint == ""
        with gpuport.connect(running.url, running.admin_token) as client:
            assert client.user == "admin" and client.fingerprint is None
    finally:
        running.stop()


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        refused = start_server(tmp_path / "state", "--http-port", str(port), expect_ready=False)
    assert refused.process.returncode == 1
    assert f"cannot listen for HTTP on 127.0.0.1:{port}" in refused.banner
    # The failed first start did not use up the admin token: the next start still shows it.
    started = start_server(tmp_path / "state")
    try:
        assert started.admin_token
        with started.connect() as admin:
            assert admin.admin
    finally:
        started.stop()


def test_new_admin_token_is_the_way_back_in(tmp_path: Path) -> None:
    first = start_server(tmp_path / "state")
    first.stop()
    again = start_server(tmp_path / "state", "--new-admin-token")
    try:
        assert again.admin_token and again.admin_token != first.admin_token
        with again.connect() as admin:
            assert admin.user == "admin-2" and admin.admin
            assert {t.name for t in admin.tokens()} == {"admin", "admin-2"}
    finally:
        again.stop()


def test_bad_fake_gpu_list_is_refused(tmp_path: Path) -> None:
    refused = start_server(tmp_path / "state", env=server_env(GPUPORT_FAKE_GPUS="lots"), expect_ready=False)
    assert refused.process.returncode == 1
    assert "GPUPORT_FAKE_GPUS='lots' is not a GPU list" in refused.banner


def test_default_state_dir_is_the_user_data_dir_unless_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpuport.server.state import default_state_dir

    monkeypatch.delenv("GPUPORT_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_state_dir() == tmp_path / "data" / "gpuport"
    monkeypatch.setenv("GPUPORT_STATE_DIR", str(tmp_path / "elsewhere"))
    assert default_state_dir() == tmp_path / "elsewhere"


def test_server_without_state_dir_uses_the_default(tmp_path: Path) -> None:
    env = server_env(GPUPORT_FAKE_GPUS="1x8GiB", XDG_DATA_HOME=str(tmp_path / "data"))
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuport", "server", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    with process.stdout:
        first = process.stdout.readline()
        state_line = process.stdout.readline()
        process.terminate()
        process.wait(timeout=20)
    assert first.startswith("gpuport server")
    assert state_line.split() == ["state", "dir", str(tmp_path / "data" / "gpuport")]
    assert stat.S_IMODE((tmp_path / "data" / "gpuport").stat().st_mode) == 0o700
