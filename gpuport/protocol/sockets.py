"""Socket helpers that client, server and workers share: what counts as a loopback address,
reading an exact number of bytes from a stream, and a private Unix socket listening under a name."""

from __future__ import annotations

import contextlib
import ipaddress
import os
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


def listen(folder: str, name: str, backlog: int = 4) -> socket.socket:
    """A Unix socket listening as ``folder/name``, private to this uid (0600). It appears under that
    name only once it accepts connections (bound as ``name.new``, then renamed), and is bound by its
    relative name: the folder's path may be longer than a socket's address allows."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name + ".new")
        listener.bind(name + ".new")
        os.chmod(name + ".new", 0o600)
        listener.listen(backlog)
        os.replace(name + ".new", name)
    except BaseException:
        listener.close()
        raise
    finally:
        os.chdir(cwd)
    return listener
