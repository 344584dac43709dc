"""TLS as both sides use it: the server's identity, ``sha256:<64 hex digits>`` of the DER
certificate, and a socket wrapped in TLS that is closed whenever the wrapping fails."""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket
    import ssl

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


def wrap_socket(context: ssl.SSLContext, sock: socket.socket, **options: Any) -> ssl.SSLSocket:
    """``context.wrap_socket(sock, **options)``, which leaves no socket open when it raises.

    When the peer resets the connection before the handshake (a server killed as it accepted),
    Python's own ``wrap_socket`` raises without closing the ``SSLSocket`` it made: ``sock`` has
    handed that socket its descriptor by then, so nothing closes it until the garbage collector,
    with a ``ResourceWarning`` (CPython gh-113280, fixed upstream in 2024, after Python 3.11.7). That
    socket is the ``self`` of a frame of the failed call: found there, it is closed here.
    """
    import ssl  # here: reading a saved profile's fingerprint needs no TLS

    try:
        return context.wrap_socket(sock, **options)
    except BaseException as e:
        sock.close()  # detached already, unless the wrapping failed before it took the descriptor
        step = e.__traceback__
        while step is not None:
            made = step.tb_frame.f_locals.get("self")
            if isinstance(made, ssl.SSLSocket):
                made.close()
            step = step.tb_next
        raise
