"""Four ways a connection fails, four errors, four messages that say what to do."""

from __future__ import annotations

import errno
import gc
import socket
import ssl
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import gpuport
from gpuport.protocol.tls import wrap_socket

from .conftest import RunningServer, start_server, wait_for


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


# A server that resets each connection it accepts, as a server SIGKILLed then does. In a process of
# its own, and each time a little later (0 to 2 ms): some reset comes after the client's connect
# returned and before its TLS handshake began, however fast each side is scheduled.
_RESETTER = """
import socket, struct, time
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
for n in range(1_000_000):
    conn, _ = listener.accept()
    time.sleep((n % 20) / 10_000)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
"""


def test_a_connection_reset_before_the_handshake_leaves_no_socket_open() -> None:
    """The reset is an error that says so, and the TLS socket made for the connection is closed,
    not left to the garbage collector with a ResourceWarning (which once failed test_durability,
    from a burst of submits a SIGKILL cut off)."""
    resetter = subprocess.Popen([sys.executable, "-c", _RESETTER], stdout=subprocess.PIPE, text=True)
    try:
        assert resetter.stdout is not None
        url = f"https://127.0.0.1:{int(resetter.stdout.readline())}"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(40):
                with pytest.raises((gpuport.TLSError, gpuport.ServerUnreachable), match="reset by peer|[Bb]roken pipe"):
                    gpuport.connect(url, "gp_x", fingerprint="sha256:" + "0" * 64)
            gc.collect()  # what was left open is found here, if not when its error was let go
    finally:
        resetter.kill()
        resetter.wait()
        if resetter.stdout:
            resetter.stdout.close()
    left_open = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert not left_open, left_open


def test_wrapping_a_connection_already_reset_closes_it() -> None:
    """``protocol.tls.wrap_socket`` closes the TLS socket that Python made for a connection reset
    before the handshake, which Python's own ``SSLContext.wrap_socket`` leaves open (CPython
    gh-113280) on the Python this project runs on."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()) as conn:
        accepted, _ = listener.accept()
        accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        accepted.close()
        wait_for(lambda: _reset(conn), 10, "the reset to arrive")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ConnectionResetError):
                wrap_socket(context, conn, server_hostname="127.0.0.1")
            gc.collect()
    left_open = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert not left_open, left_open


def _reset(conn: socket.socket) -> bool:
    """Whether ``conn``'s peer has reset it (asked without reading, which would take the error)."""
    try:
        conn.getpeername()
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


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
