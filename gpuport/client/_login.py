"""``login``: pin a server's certificate on first use, check the token, save the profile."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from gpuport.client._channel import Target, mismatch_error, parse_url, reach, read_certificate
from gpuport.client._client import Client
from gpuport.client._config import Profile, Settings, load_profiles, save_profile
from gpuport.defaults import DEFAULT_CONNECT_TIMEOUT, DEFAULT_PROFILE, ENV_TOKEN
from gpuport.protocol.errors import AuthenticationError, ConfigError, ServerUnreachable, TLSError
from gpuport.protocol.tls import normalize_fingerprint

# Asked to trust a certificate: (target, presented fingerprint, fingerprint pinned before or None) → yes?
Confirm = Callable[[Target, str, "str | None"], bool]


def login(
    url: str,
    token: str | None = None,
    *,
    fingerprint: str | None = None,
    profile: str = DEFAULT_PROFILE,
    confirm: Confirm | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    start: str | None = None,
) -> Client:
    """Pin ``url``'s certificate, check ``token`` against it, and save both as profile ``profile``.

    The certificate is trusted when its fingerprint equals ``fingerprint``, equals the one this
    profile already pinned for that URL, or ``confirm`` says yes. Otherwise nothing is saved and
    ``TLSError`` (or ``FingerprintMismatch``) is raised. Returns the connected client.

    An ``ssh://[user@]host[:port]`` URL reaches the server through SSH (see ``_ssh``); with
    ``start`` (the command, e.g. ``"gpuport server"``) the server is started on the box when none
    answers there, and its first admin token is used when no token is given.

    >>> gpuport.login("https://gpubox:7600", token="gp_...", fingerprint="sha256:...")
    """
    target = parse_url(url)
    if start is not None:
        token = _start(target, start, token, timeout) or token
    target = reach(target)
    token = token or os.environ.get(ENV_TOKEN)
    if not token:
        raise AuthenticationError(f"no token given for {target.url} — pass --token gp_... (the server's admin has it)")
    profiles = load_profiles()  # a corrupted config stops us before anything is done
    previous = profiles.get(profile)
    pinned_before = previous.fingerprint if previous and previous.url == target.url else None

    certificate = presented = None
    if target.tls:
        certificate, presented = read_certificate(target, timeout)
        if fingerprint is not None:
            expected = normalize_fingerprint(fingerprint)
            if expected is None:
                raise ConfigError(f"{fingerprint!r} is not a fingerprint: expected sha256: and 64 hex digits")
            if expected != presented:
                raise mismatch_error(target, expected, presented)
        elif presented != pinned_before and not (confirm and confirm(target, presented, pinned_before)):
            raise TLSError(
                f"the certificate of {target.url} ({presented}) was not trusted, so nothing was saved — "
                "pass --fingerprint with the value `gpuport server` printed, or --yes to trust it"
            )
    client = Client(Settings(target.url, token, presented, certificate, profile), timeout=timeout)
    save_profile(profile, Profile(target.url, token, presented, certificate))
    return client


def _start(target: Target, command: str, token: str | None, timeout: float) -> str | None:
    """Start the server on an ssh:// target's box when nothing answers there; its first admin token."""
    if target.scheme != "ssh":
        raise ConfigError(f"--start starts a server through SSH: give an ssh:// URL, not {target.url}")
    from gpuport.client._channel import probe
    from gpuport.client._ssh import parse_ssh_url, start_server

    with contextlib.suppress(ServerUnreachable, TLSError):
        probe(reach(target), timeout)
        return None  # one runs there already
    return start_server(parse_ssh_url(target.url), command)
