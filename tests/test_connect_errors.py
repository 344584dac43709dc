"""Four ways a connection fails, four errors, four messages that say what to do."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import gpuport

from .conftest import RunningServer, start_server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server(server: RunningServer) -> None:
    url = f"https://127.0.0.1:{_closed_port()}"
    with pytest.raises(gpuport.ServerUnreachable, match="is `gpuport server` running there") as caught:
        gpuport.connect(url, server.admin_token, fingerprint=server.fingerprint)
    assert url in str(caught.value)


def test_tls_failure_when_the_server_does_not_speak_tls(tmp_path: Path) -> None:
    plain = start_server(tmp_path / "state", "--insecure")
    try:
        https_url = plain.url.replace("http://", "https://")
        with pytest.raises(gpuport.TLSError, match="does not complete a TLS handshake") as caught:
            gpuport.connect(https_url, plain.admin_token, fingerprint="sha256:" + "0" * 64)
        assert not isinstance(caught.value, gpuport.FingerprintMismatch)
        assert "use http://" in str(caught.value)
    finally:
        plain.stop()


def test_tls_failure_when_plaintext_meets_a_tls_server(server: RunningServer) -> None:
    with pytest.raises(gpuport.TLSError, match="speaks TLS — use https://"):
        gpuport.connect(server.url.replace("https://", "http://"), server.admin_token)


def test_changed_fingerprint(server: RunningServer) -> None:
    pinned = "sha256:" + "12" * 32
    with pytest.raises(gpuport.FingerprintMismatch) as caught:
        gpuport.connect(server.url, server.admin_token, fingerprint=pinned)
    error = caught.value
    assert error.pinned == pinned and error.presented == server.fingerprint
    assert f"gpuport login {server.url} --fingerprint {server.fingerprint}" in str(error)


def test_rejected_token(server: RunningServer) -> None:
    with pytest.raises(gpuport.AuthenticationError, match="ask the server's admin for a new token"):
        gpuport.connect(server.url, "gp_rejected", fingerprint=server.fingerprint)


def test_the_http_port_is_not_the_grpc_port(server: RunningServer) -> None:
    with pytest.raises(gpuport.ServerUnreachable, match="not as a gpuport gRPC port"):
        gpuport.connect(server.http_url, server.admin_token, fingerprint=server.fingerprint)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://127.0.0.1:7600", "uses ftp://"),
        ("127.0.0.1:7600", "has no scheme"),
        ("https://127.0.0.1:99999", "invalid port"),
        ("https://127.0.0.1:7600/v1", "has a path"),
        ("http://192.0.2.1:7600", "sends your token in clear"),
    ],
)
def test_bad_urls(url: str, message: str, cli) -> None:
    with pytest.raises(gpuport.ConfigError, match=message):
        gpuport.connect(url, "gp_x", fingerprint="sha256:" + "0" * 64)
    done = cli("gpus", GPUPORT_URL=url, GPUPORT_TOKEN="gp_x")
    assert done.code == 1 and message in done.stderr


def test_cli_reports_each_connection_error_on_one_line(server: RunningServer, cli) -> None:
    cases = {
        "is `gpuport server` running there": {"GPUPORT_URL": f"https://127.0.0.1:{_closed_port()}"},
        "speaks TLS": {"GPUPORT_URL": server.url.replace("https://", "http://")},
        "was pinned when you logged in": {"GPUPORT_FINGERPRINT": "sha256:" + "34" * 32},
        "not known to this server": {"GPUPORT_TOKEN": "gp_wrong"},
    }
    for message, env in cases.items():
        full = {
            "GPUPORT_URL": server.url,
            "GPUPORT_TOKEN": server.admin_token,
            "GPUPORT_FINGERPRINT": server.fingerprint,
            **env,
        }
        done = cli("status", **full)
        assert done.code == 1, done.output
        assert message in done.stderr and done.stderr.startswith("error:") and "Traceback" not in done.stderr
