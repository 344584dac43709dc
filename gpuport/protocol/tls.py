"""The server's TLS identity as both sides name it: ``sha256:<64 hex digits>`` of the DER certificate."""

from __future__ import annotations

import hashlib
import re

_FINGERPRINT_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def fingerprint(certificate: bytes | str) -> str:
    """Return the SHA-256 fingerprint of a certificate given as PEM (str or bytes) or DER bytes."""
    if isinstance(certificate, str):
        certificate = certificate.encode()
    if certificate.lstrip().startswith(b"-----BEGIN"):
        import ssl  # here: reading a saved profile's fingerprint needs no TLS

        certificate = ssl.PEM_cert_to_DER_cert(certificate.decode())
    return "sha256:" + hashlib.sha256(certificate).hexdigest()


def normalize_fingerprint(text: str) -> str | None:
    """Return ``text`` as a canonical ``sha256:...`` fingerprint, or None if it is not one.

    Accepts upper case and the colon-separated form that ``openssl x509 -fingerprint`` prints.
    """
    text = text.strip().lower()
    body = text.removeprefix("sha256:").replace(":", "")
    canonical = "sha256:" + body
    return canonical if _FINGERPRINT_RE.match(canonical) else None
