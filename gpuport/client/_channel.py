"""The client's one boundary with gRPC and sockets: URLs, TLS trust, channels, and error mapping.

Trust works like ssh's known_hosts: ``gpuport login`` reads the server's certificate and pins it
(after the user confirms its fingerprint); later connections accept that certificate and no other,
by making it the channel's only root. When a connection fails, ``diagnose`` looks at the socket
itself to tell the user which of "nothing there", "not TLS", "another certificate" or "not the gRPC
port" it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gpuport.defaults import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, MAX_MESSAGE_BYTES, STREAM_WINDOW_BYTES
from gpuport.protocol.errors import (
    ERROR_METADATA_KEY,
    AuthenticationError,
    ConfigError,
    FingerprintMismatch,
    GpuportError,
    ServerUnreachable,
    TLSError,
    error_from_status,
)
from gpuport.protocol.sockets import is_loopback
from gpuport.protocol.tls import wrap_socket

if TYPE_CHECKING:
    import grpc  # imported where a channel is made: URLs and profiles need none of it

# Every certificate a gpuport server makes names localhost, so a pinned one always passes gRPC's
# name check under this name; the pin, not the name, is what is trusted.
_PINNED_NAME = "localhost"


@dataclass(frozen=True)
class Target:
    """Where a server is: ``scheme://host:port``. Reached through SSH (``via`` an ``ssh://`` URL),
    ``host`` and ``port`` are the local end of the tunnel and ``forwards`` maps the box's ports to
    their local ends; ``url`` is then the ssh:// URL, as the user wrote it."""

    scheme: str
    host: str
    port: int
    via: str = ""
    forwards: tuple[tuple[int, int], ...] = ()

    @property
    def tls(self) -> bool:
        return self.scheme in ("https", "ssh")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.via or f"{self.scheme}://{self.address}"

    def local_port(self, port: int) -> int:
        """Where to connect for the server's ``port`` (another of its ports, such as the data port)."""
        return dict(self.forwards).get(port, port)


def reach(target: Target) -> Target:
    """``target`` ready to connect to: for an ``ssh://`` one, the local end of this process's tunnel."""
    if target.scheme != "ssh":
        return target
    from gpuport.client._ssh import parse_ssh_url, tunnel

    route = parse_ssh_url(target.via)
    made = tunnel(route)
    forwards = ((route.remote_port, made.grpc_port), (made.remote_data_port, made.data_port))
    return Target("https", "127.0.0.1", made.grpc_port, via=route.url, forwards=forwards)


def parse_url(url: str) -> Target:
    """Read a server URL (``https://gpubox:7600``; the port defaults to 7600). Raises ``ConfigError``."""
    if "://" not in url:
        raise ConfigError(f"server URL {url!r} has no scheme — write it like https://{url.strip('/')}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "ssh":
        from gpuport.client._ssh import parse_ssh_url

        route = parse_ssh_url(url)
        return Target("ssh", route.host, route.ssh_port or 22, via=route.url)
    if scheme not in ("https", "http"):
        raise ConfigError(
            f"server URL {url!r} uses {scheme}://; gpuport speaks https:// (or http:// to a server started "
            "with --insecure on this machine, or ssh://user@host through SSH)"
        )
    try:
        port = parts.port or DEFAULT_GRPC_PORT
    except ValueError:
        raise ConfigError(f"server URL {url!r} has an invalid port — use a number from 1 to 65535") from None
    if not parts.hostname:
        raise ConfigError(f"server URL {url!r} names no host — write it like https://gpubox:7600")
    if parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"server URL {url!r} has a path; give only scheme, host and port: https://gpubox:7600")
    target = Target(scheme, parts.hostname, port)
    if not target.tls and not is_loopback(target.host):
        raise ConfigError(
            f"http:// sends your token in clear, so it is only for a server on this machine started with "
            f"--insecure; use https://{target.address}"
        )
    return target


@dataclass(frozen=True)
class Probe:
    certificate: str | None  # PEM, when the server spoke TLS
    alpn: str | None  # "h2" on a gRPC port


def probe(target: Target, timeout: float) -> Probe:
    """Open a socket to ``target`` and, for https, read its certificate without trusting it.

    Raises ``ServerUnreachable`` when nothing answers and ``TLSError`` when it does not speak TLS.
    """
    import socket  # here and not above, as ssl: reading a profile needs neither
    import ssl

    try:
        sock = socket.create_connection((target.host, target.port), timeout=timeout)
    except socket.gaierror as e:
        raise ServerUnreachable(f"cannot reach {target.url}: unknown host {target.host!r} ({e.strerror})") from None
    except TimeoutError:
        raise ServerUnreachable(
            f"cannot reach {target.url}: no answer in {timeout:.0f}s — is the host up, and is the port open "
            "in its firewall?"
        ) from None
    except OSError as e:
        raise ServerUnreachable(
            f"cannot reach {target.url}: {e.strerror or e} — is `gpuport server` running there, "
            f"and is {target.port} its gRPC port (default {DEFAULT_GRPC_PORT})?"
        ) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we only read the certificate here; trust is decided by the pin
    context.set_alpn_protocols(["h2"])
    with sock:
        if not target.tls:
            try:
                with wrap_socket(context, sock, server_hostname=target.host):
                    pass
            except (OSError, ssl.SSLError):
                return Probe(None, None)
            raise TLSError(f"the server at {target.url} speaks TLS — use https://{target.address}")
        try:
            with wrap_socket(context, sock, server_hostname=target.host) as tls:
                der = tls.getpeercert(binary_form=True)
                alpn = tls.selected_alpn_protocol()
        except (OSError, ssl.SSLError) as e:
            raise TLSError(
                f"{target.url} does not complete a TLS handshake ({e}) — if that server was started with "
                f"--insecure, use http://{target.address}"
            ) from None
    return Probe(ssl.DER_cert_to_PEM_cert(der) if der else None, alpn)


def read_certificate(target: Target, timeout: float) -> tuple[str, str]:
    """Read the server's certificate, trusting nothing yet: returns (PEM, ``sha256:`` fingerprint)."""
    seen = probe(target, timeout)
    if not seen.certificate:
        raise TLSError(f"{target.url} completed a TLS handshake but presented no certificate")
    from gpuport.protocol.tls import fingerprint

    return seen.certificate, fingerprint(seen.certificate)


def mismatch_error(target: Target, pinned: str, presented: str) -> FingerprintMismatch:
    return FingerprintMismatch(
        f"the server at {target.url} presents certificate {presented}, but {pinned} was pinned when you "
        "logged in. Either its certificate was replaced (check with the server's admin: `gpuport server` "
        f"prints it), or someone is intercepting the connection: do not send it your token. To trust the "
        f"new certificate: gpuport login {target.url} --fingerprint {presented}",
        pinned=pinned,
        presented=presented,
    )


def open_channel(target: Target, certificate: str | None) -> grpc.Channel:
    """A channel to ``target`` that trusts exactly ``certificate`` (None: plaintext, loopback only)."""
    import grpc

    options: list[tuple[str, int | str]] = [
        ("grpc.use_local_subchannel_pool", 1),  # each client its own connection
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]
    if not target.tls:
        return grpc.insecure_channel(target.address, options=options)
    if certificate is None:
        raise TLSError(f"no certificate pinned for {target.url} — run `gpuport login {target.url}`")
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate.encode())
    options.append(("grpc.ssl_target_name_override", _PINNED_NAME))
    return grpc.secure_channel(target.address, credentials, options=options)


def diagnose(target: Target, pinned: str | None, details: str, timeout: float) -> GpuportError:
    """Explain a connection that failed: which of unreachable, not TLS, another certificate, wrong port."""
    seen = probe(target, timeout)  # raises ServerUnreachable / TLSError itself
    if target.tls and seen.certificate:
        from gpuport.protocol.tls import fingerprint

        presented = fingerprint(seen.certificate)
        if pinned and presented != pinned:
            return mismatch_error(target, pinned, presented)
    if seen.alpn != "h2" and target.tls:
        hint = (
            f" (that is gpuport's default HTTP port; the gRPC port is {DEFAULT_GRPC_PORT})"
            if target.port == DEFAULT_HTTP_PORT
            else ""
        )
        return ServerUnreachable(
            f"{target.url} answers, but not as a gpuport gRPC port{hint} — check the port in the URL "
            "against the `gRPC` line that `gpuport server` prints"
        )
    if target.tls:
        return TLSError(f"TLS with {target.url} failed: {details}")
    return ServerUnreachable(f"{target.url} does not answer as a gpuport server: {details}")


def map_rpc_error(error: grpc.RpcError, target: Target) -> GpuportError:
    """The one place where a gRPC error becomes a ``GpuportError``."""
    import grpc

    code = error.code()  # type: ignore[attr-defined]
    details = error.details() or ""  # type: ignore[attr-defined]
    name = None
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_METADATA_KEY:
            name = value
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(
            f"token rejected by {target.url}: {details} — run `gpuport login {target.url}` again or ask the "
            "server's admin for a new token"
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and name is None:
        return ServerUnreachable(f"lost the connection to {target.url}: {details}")
    return error_from_status(code, details, name)
