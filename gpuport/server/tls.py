"""The server's TLS identity: an ECDSA P-256 self-signed certificate made on first start.

Clients pin its fingerprint (``gpuport login``), so it is made once and kept: a later start on
another address warns rather than quietly replacing the certificate and breaking every pin.

Beside it, the client CA: the authority that signs users' client certificates (``gpuport token
create NAME --client-cert DIR``), for clients that speak TLS options but no header, such as Triton's
examples. It signs nothing else, and the server's certificate is not under it, so pins are unchanged.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import socket
import subprocess
import sys
from dataclasses import dataclass, field
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
    from cryptography.hazmat.primitives import hashes
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
    cert = (
        _builder(subject, subject, key)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_pair(cert, key)


def _builder(subject, issuer, key, not_after=None):  # type: ignore[no-untyped-def]
    """A certificate of ``key``'s public half for ``subject``, by ``issuer``, from yesterday to
    ``not_after`` (default: ``DEFAULT_CERT_VALID_YEARS`` from now), with a random serial."""
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(not_after or now + datetime.timedelta(days=365 * DEFAULT_CERT_VALID_YEARS))
    )


def _pem_pair(cert, key) -> tuple[bytes, bytes]:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _make_client_ca() -> tuple[bytes, bytes]:
    """A CA certificate (and its key) that may sign end-entity certificates only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuport client CA")])
    usage = dict.fromkeys(
        ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement"), False
    )
    cert = (
        _builder(subject, subject, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**usage, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_pair(cert, key)


def _make_client_certificate(ca_cert_pem: bytes, ca_key_pem: bytes, user: str) -> tuple[bytes, bytes]:
    """A client certificate for ``user`` (its common name), signed by the client CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, user)])
    cert = (
        _builder(subject, ca_cert.subject, key, ca_cert.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return _pem_pair(cert, key)


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


def _write_missing(key_path: Path, cert_path: Path, ca_key_path: Path, ca_path: Path, host: str) -> None:
    if not (cert_path.exists() and key_path.exists()):
        cert_pem, key_pem = _make_certificate(_names_for(host))
        atomic_write(key_path, key_pem, mode=0o600)
        atomic_write(cert_path, cert_pem, mode=0o644)
    if not (ca_path.exists() and ca_key_path.exists()):
        cert_pem, key_pem = _make_client_ca()
        atomic_write(ca_key_path, key_pem, mode=0o600)
        atomic_write(ca_path, cert_pem, mode=0o644)


def _run_child(action: str, *args: str) -> str:
    """Run this module as a child process (see the end of the file) and return what it printed.

    Certificates are made by a child process: a daemon that imported cryptography would hold its
    9 MB (a ninth of its memory) for as long as it runs, for a few uses in its life."""
    done = subprocess.run([sys.executable, "-m", __name__, action, *args], capture_output=True, text=True)
    if done.returncode:
        raise ServerError(f"could not make a TLS certificate: {done.stderr.strip()[-2000:]}")
    return done.stdout


@dataclass(frozen=True)
class ClientCertificate:
    """A user's client certificate and its key, PEM; ``fingerprint`` is the certificate's."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    fingerprint: str


def issue_client_certificate(state: StateDir, user: str) -> ClientCertificate:
    """A new key and a certificate for ``user`` signed by the server's client CA. Blocks about 0.2 s."""
    made = json.loads(_run_child("client", str(state.client_ca_key_path), str(state.client_ca_path), user))
    cert_pem = made["cert"].encode()
    return ClientCertificate(cert_pem, made["key"].encode(), fingerprint(cert_pem))


def load_or_create_identity(state: StateDir, host: str) -> tuple[TLSIdentity, bool]:
    """Return the server's TLS identity, creating it (and the client CA) on first start; the bool
    says the identity was created."""
    created = not (state.cert_path.exists() and state.key_path.exists())
    if created or not (state.client_ca_path.exists() and state.client_ca_key_path.exists()):
        paths = (state.key_path, state.cert_path, state.client_ca_key_path, state.client_ca_path)
        _run_child("identity", *map(str, paths), host)
    cert_pem = state.cert_path.read_bytes()
    identity = TLSIdentity(
        cert_pem=cert_pem,
        key_pem=state.key_path.read_bytes(),
        fingerprint=fingerprint(cert_pem),
    )
    return identity, created


def link_certificate(address: str) -> tuple[bytes, bytes]:
    """A fresh self-signed certificate and its key (PEM) for a node's link at ``address``: its
    agent makes it (in a child process, as ``_run_child`` says why), and the server pins its
    fingerprint (``executors/node_link.py``)."""
    made = json.loads(_run_child("link", address))
    return made["cert"].encode(), made["key"].encode()


if __name__ == "__main__":  # the child process of _run_child
    if sys.argv[1] == "identity":  # KEY CERT CA_KEY CA_CERT HOST
        _write_missing(*map(Path, sys.argv[2:6]), sys.argv[6])
    elif sys.argv[1] == "client":  # CA_KEY CA_CERT USER: prints {"cert": PEM, "key": PEM}
        ca_key, ca_cert = Path(sys.argv[2]).read_bytes(), Path(sys.argv[3]).read_bytes()
        cert, key = _make_client_certificate(ca_cert, ca_key, sys.argv[4])
        print(json.dumps({"cert": cert.decode(), "key": key.decode()}))
    elif sys.argv[1] == "link":  # ADDRESS: prints {"cert": PEM, "key": PEM}
        cert, key = _make_certificate({sys.argv[2]})
        print(json.dumps({"cert": cert.decode(), "key": key.decode()}))
