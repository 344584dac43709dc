"""The client's saved profiles (``config.json`` in the user config dir, mode 0600), and how the
settings of one connection are chosen from arguments, ``GPUPORT_*`` variables and a profile."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuport._files import atomic_write
from gpuport.client._channel import parse_url
from gpuport.defaults import DEFAULT_PROFILE, ENV_CONFIG_DIR, ENV_FINGERPRINT, ENV_PROFILE, ENV_TOKEN, ENV_URL
from gpuport.protocol.errors import AuthenticationError, ConfigError
from gpuport.protocol.tls import normalize_fingerprint


@dataclass(frozen=True)
class Profile:
    """One saved server: its URL, the token, and the certificate pinned at login."""

    url: str
    token: str
    fingerprint: str | None = None  # None for an http:// (insecure, loopback) server
    certificate: str | None = None  # the pinned certificate, PEM


@dataclass(frozen=True)
class Settings:
    """What one connection uses, once arguments, environment and profile are merged."""

    url: str
    token: str
    fingerprint: str | None
    certificate: str | None
    profile: str | None  # the profile it came from, if any


def config_path() -> Path:
    """``$GPUPORT_CONFIG_DIR/config.json``, else ``config.json`` in the platform's user config dir."""
    import platformdirs

    folder = os.environ.get(ENV_CONFIG_DIR) or platformdirs.user_config_dir("gpuport", appauthor=False)
    return Path(folder) / "config.json"


def load_profiles(path: Path | None = None) -> dict[str, Profile]:
    """Read every saved profile. A missing file is no profiles; a broken one raises ``ConfigError``."""
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read the gpuport config {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
        profiles = {name: Profile(**fields) for name, fields in data["profiles"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"the gpuport config {path} is corrupted ({type(e).__name__}: {e}) — fix it, or delete it "
            "and run `gpuport login` again"
        ) from None
    return profiles


def save_profile(name: str, profile: Profile, path: Path | None = None) -> Path:
    """Add or replace profile ``name``, keeping the others; the file is written 0600, atomically."""
    path = path or config_path()
    profiles = load_profiles(path)
    profiles[name] = profile
    _write(path, profiles)
    return path


def remove_profile(name: str, path: Path | None = None) -> bool:
    """Forget profile ``name``; returns False when there was none."""
    path = path or config_path()
    profiles = load_profiles(path)
    if profiles.pop(name, None) is None:
        return False
    _write(path, profiles)
    return True


def _write(path: Path, profiles: dict[str, Profile]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {"profiles": {n: asdict(p) for n, p in sorted(profiles.items())}}
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode(), mode=0o600)


def resolve_settings(
    url: str | None = None,
    token: str | None = None,
    profile: str | None = None,
    fingerprint: str | None = None,
) -> Settings:
    """Merge, in this order of precedence: arguments, ``GPUPORT_*`` variables, the saved profile.

    The profile's token and pinned certificate are used only for the profile's own URL.
    """
    url = url or os.environ.get(ENV_URL) or None
    token = token or os.environ.get(ENV_TOKEN) or None
    fingerprint = fingerprint or os.environ.get(ENV_FINGERPRINT) or None
    named = profile or os.environ.get(ENV_PROFILE) or None
    if fingerprint is not None:
        given = fingerprint
        fingerprint = normalize_fingerprint(given)
        if fingerprint is None:
            raise ConfigError(f"{given!r} is not a certificate fingerprint: expected sha256: and 64 hex digits")

    saved: Profile | None = None
    if named or not (url and token and fingerprint):
        profiles = load_profiles()
        saved = profiles.get(named or DEFAULT_PROFILE)
        if named and saved is None:
            known = ", ".join(sorted(profiles)) or "none yet"
            raise ConfigError(
                f"no profile named '{named}' in {config_path()} (saved: {known}) — "
                f"run `gpuport login URL --profile {named}`"
            )
    if url:
        url = parse_url(url).url  # canonical: https://gpubox and https://gpubox:7600 are one server
    if saved is not None and url and url != saved.url:
        saved = None  # another server: none of the profile's secrets apply
    if saved is not None:
        url = url or saved.url
        token = token or saved.token
        fingerprint = fingerprint or saved.fingerprint
    if not url:
        raise ConfigError(
            "no gpuport server configured — run `gpuport login https://HOST:7600 --token gp_...`, "
            f"or set {ENV_URL} and {ENV_TOKEN}"
        )
    if not token:
        raise AuthenticationError(
            f"no token for {url} — pass one with --token, set {ENV_TOKEN}, or run `gpuport login {url}`"
        )
    certificate = saved.certificate if saved and saved.fingerprint == fingerprint else None
    return Settings(url, token, fingerprint, certificate, (named or DEFAULT_PROFILE) if saved else None)
