"""Socket helpers that client, server and workers share: what counts as a loopback address, and
reading an exact number of bytes from a stream."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets or a zone, IPv4 mapped
    into IPv6 as a dual-stack socket shows it) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1
    return address.is_loopback


def recv_exact(sock: socket.socket, view: memoryview, peer: str = "the other side") -> None:
    """Fill ``view`` from ``sock``. Raises ``EOFError`` (naming ``peer``) when it closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError(f"{peer} closed the connection")
        got += n
