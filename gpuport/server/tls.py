"""The server's TLS identity: an ECDSA P-256 self-signed certificate made on first start.

Clients pin its fingerprint (``gpuport login``), so it is made once and kept: a later start on
another address warns rather than quietly replacing the certificate and breaking every pin.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpuport._files import atomic_write
from gpuport.defaults import DEFAULT_CERT_VALID_YEARS
from gpuport.protocol.errors import ServerError
from gpuport.protocol.tls import fingerprint
from gpuport.server.state import StateDir

log = logging.getLogger(__name__)

_WILDCARDS = {"", "0.0.0.0", "::"}
# Names every certificate this server makes carries (see _names_for).
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class TLSIdentity:
    cert_pem: bytes
    key_pem: bytes
    fingerprint: str

    def covers(self, host: str) -> bool:
        """Whether the certificate names ``host`` (any address does for a wildcard bind)."""
        # Only another address needs the certificate read: cryptography costs the server 9 MB of
        # memory for as long as it runs, and binding loopback or every interface needs none of it.
        if host in _WILDCARDS or _canonical(host) in _LOOPBACK:
            return True
        return _canonical(host) in _names_in(self.cert_pem)


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower()


def _names_for(host: str) -> set[str]:
    """Every name a client might reach this machine by: loopback, host names, interface addresses."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname().lower(), socket.getfqdn().lower()}
    if host not in _WILDCARDS:
        names.add(_canonical(host))
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                names.add(_canonical(address.address.split("%")[0]))
    return {n for n in names if n}


def _make_certificate(names: set[str]) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuport server")])
    alt_names: list[x509.GeneralName] = []
    for name in sorted(names):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365 * DEFAULT_CERT_VALID_YEARS))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _names_in(cert_pem: bytes) -> frozenset[str]:
    """DNS names and IP addresses the certificate covers."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    dns = san.get_values_for_type(x509.DNSName)
    ips = san.get_values_for_type(x509.IPAddress)
    return frozenset([d.lower() for d in dns] + [str(ip) for ip in ips])


def _write_identity(key_path: Path, cert_path: Path, host: str) -> None:
    cert_pem, key_pem = _make_certificate(_names_for(host))
    atomic_write(key_path, key_pem, mode=0o600)
    atomic_write(cert_path, cert_pem, mode=0o644)


def load_or_create_identity(state: StateDir, host: str) -> tuple[TLSIdentity, bool]:
    """Return the server's TLS identity, creating it on first start; the bool says it was created."""
    created = False
    if not (state.cert_path.exists() and state.key_path.exists()):
        # Made by a child process: a daemon that imported cryptography would hold its 9 MB (a
        # ninth of its memory) for as long as it runs, for one use on its first start.
        command = [sys.executable, "-m", __name__, str(state.key_path), str(state.cert_path), host]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise ServerError(f"could not make the server's TLS certificate: {done.stderr.strip()[-2000:]}")
        created = True
    cert_pem = state.cert_path.read_bytes()
    identity = TLSIdentity(
        cert_pem=cert_pem,
        key_pem=state.key_path.read_bytes(),
        fingerprint=fingerprint(cert_pem),
    )
    return identity, created


if __name__ == "__main__":  # python -m gpuport.server.tls KEY_PATH CERT_PATH HOST (see load_or_create_identity)
    _write_identity(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
