"""The only way out of an environment build's sandbox: an HTTP proxy, on a Unix socket the sandbox
is shown, that lets through only the package index the box is configured for.

A build whose index is not on this machine's disk runs in a network namespace of its own with only
loopback; ``_index_bridge.py`` carries 127.0.0.1:PORT there to this proxy, and uv is told to use it
(``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``). It allows ``CONNECT host:port`` and plain-HTTP
requests to the hosts of the index, its extra indexes and its find-links (PyPI's two hosts where
none is set), through the admin's own proxy where one is set; anything else gets a 403 that says
why, and is noted for the build's log. A package's build script that opens a socket elsewhere
finds nothing listening, or this refusal.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gpuport.server.worker.wire import _reachable

PYPI_HOSTS = (("pypi.org", 443), ("files.pythonhosted.org", 443))  # uv's default index and its files
BRIDGE_PORT = 3128  # where uv finds the proxy in a build's own network namespace (nothing else is there)
_MAX_HEAD = 64 * 1024  # bytes of a request's head
_TIMEOUT = 60.0  # seconds to reach the index, or for its proxy to answer
_MAX_NOTED = 20  # refusals listed in a build's log: a build script could try thousands


def _host_port(url: str) -> tuple[str, int] | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return parts.hostname.lower(), port


def _config_urls(path: str) -> tuple[list[str], bool]:
    """The index URLs a ``uv.toml`` names (at its top and under ``[pip]``), and whether one of them
    takes PyPI's place as the default index."""
    try:
        text = Path(path).read_text()
    except (OSError, ValueError):
        return [], False
    try:
        import tomllib  # Python 3.11 on
    except ImportError:  # 3.10: the URLs of its index keys, by a pattern
        keys = r"(?m)^\s*(?:index-url|extra-index-url|find-links|url)\s*=\s*\[?([^\n]*)"
        urls = [u for line in re.findall(keys, text) for u in re.findall(r"[\"']([^\"']+)[\"']", line)]
        return urls, bool(re.search(r"(?m)^\s*(index-url\s*=|default\s*=\s*true)", text))
    try:
        data = tomllib.loads(text)
    except ValueError:
        return [], False
    urls: list[str] = []
    default = False
    for table in (data, data.get("pip") or {}):
        if not isinstance(table, dict):
            continue
        default = default or isinstance(table.get("index-url"), str)
        for key in ("index-url", "extra-index-url", "find-links"):
            value = table.get(key)
            urls += [value] if isinstance(value, str) else [v for v in value or () if isinstance(v, str)]
        for index in table.get("index") or ():
            if isinstance(index, dict) and isinstance(index.get("url"), str):
                urls.append(index["url"])
                default = default or index.get("default") is True
    return urls, default


def index_hosts(args: tuple[str, ...], env: dict[str, str]) -> frozenset[tuple[str, int]]:
    """The (host, port) pairs that uv's index arguments ``args`` and ``env`` (its ``UV_CONFIG_FILE``)
    name; PyPI's too where none of them takes its place as the default index."""
    urls = [value for flag, value in itertools.pairwise(args) if flag.endswith(("-url", "find-links"))]
    default = "--index-url" in args
    if env.get("UV_CONFIG_FILE"):
        found, replaced = _config_urls(env["UV_CONFIG_FILE"])
        urls, default = urls + found, default or replaced
    hosts = {found for url in urls if (found := _host_port(url))}
    if not default:
        hosts.update(PYPI_HOSTS)
    return frozenset(hosts)


def _bypassed(host: str, no_proxy: str) -> bool:
    for entry in no_proxy.replace(",", " ").split():
        entry = entry.lower().lstrip(".").split(":")[0]
        if entry == "*" or host == entry or host.endswith("." + entry):
            return True
    return False


class IndexProxy:
    """A proxy for one build (a thread on a Unix socket at ``path``) that reaches only ``hosts``,
    through the admin's proxy (``env``'s ``HTTPS_PROXY``/``HTTP_PROXY``, less ``NO_PROXY``) where set.
    ``refused``: a line for each connection it refused, for the build's log. Use it with ``with``."""

    def __init__(self, path: Path, hosts: frozenset[tuple[str, int]], env: dict[str, str]) -> None:
        self.path = path
        self.hosts = hosts
        self.refused: list[str] = []
        self._upstream = {
            scheme: env.get(f"{scheme.upper()}_PROXY") or env.get(f"{scheme}_proxy") or ""
            for scheme in ("https", "http")
        }
        self._no_proxy = env.get("NO_PROXY") or env.get("no_proxy") or ""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> IndexProxy:  # noqa: PYI034 (Self is Python 3.11's)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with _reachable(str(self.path)) as address:  # a long state dir's path, through its folder's fd
            self._listener.bind(address)
        os.chmod(self.path, 0o666)  # for the build's uid; the folder that holds it is the server's alone
        self._listener.listen(64)
        threading.Thread(target=self._serve, name="gpuport-index-proxy", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            for conn in list(self._open):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def describe(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in sorted(self.hosts))

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        with self._lock:
            self._open.add(client)
        upstream: socket.socket | None = None
        try:
            client.settimeout(_TIMEOUT)
            head = _read_head(client)
            if head is None:
                return
            line, _, rest = head.partition(b"\r\n")
            method, target, version = (line.decode("latin-1").split(" ") + ["", ""])[:3]
            if method == "CONNECT":
                host, _, port_text = target.rpartition(":")
                host, scheme = host.strip("[]").lower(), "https"
            else:
                parts = urlsplit(target)
                host, scheme = (parts.hostname or "").lower(), parts.scheme
                port_text = str(parts.port or 80) if scheme == "http" else ""
            port = int(port_text) if port_text.isdigit() else 0
            if (host, port) not in self.hosts:
                self._refuse(client, f"{target[:200]}", host, port)
                return
            upstream = self._connect(host, port, scheme)
            with self._lock:
                self._open.add(upstream)
            if method == "CONNECT":
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.sendall(self._plain_request(method, target, version, rest))
            client.settimeout(None)
            upstream.settimeout(None)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError):
                _answer(client, 502, f"gpuport: the package index could not be reached: {e}\n")
        finally:
            for conn in (client, upstream):
                if conn is not None:
                    with self._lock:
                        self._open.discard(conn)
                    conn.close()

    def _refuse(self, client: socket.socket, target: str, host: str, port: int) -> None:
        why = (
            f"gpuport: {host or target}:{port} refused: an environment build reaches only the package index "
            f"this server is configured for ({self.describe()})"
        )
        if len(self.refused) < _MAX_NOTED:
            self.refused.append(why)
        elif len(self.refused) == _MAX_NOTED:
            self.refused.append("gpuport: more connections refused, not listed")
        _answer(client, 403, why + "\n")

    def _connect(self, host: str, port: int, scheme: str) -> socket.socket:
        """A connection to ``host:port``: straight, or a tunnel through the admin's proxy."""
        proxy = self._upstream.get(scheme) or ""
        if not proxy or _bypassed(host, self._no_proxy):
            return socket.create_connection((host, port), timeout=_TIMEOUT)
        parts = urlsplit(proxy if "://" in proxy else "http://" + proxy)
        conn = socket.create_connection((parts.hostname or "", parts.port or 80), timeout=_TIMEOUT)
        if scheme == "http":
            return conn  # a plain request goes to the admin's proxy as it came (absolute form)
        request = f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        if parts.username:
            login = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            request += f"Proxy-Authorization: Basic {base64.b64encode(login).decode()}\r\n"
        conn.sendall((request + "\r\n").encode())
        answer = _read_head(conn)
        if answer is None or answer.split(b" ", 2)[1:2] != [b"200"]:
            conn.close()
            raise OSError(f"the proxy {parts.hostname}:{parts.port} refused {host}:{port}")
        return conn

    def _plain_request(self, method: str, target: str, version: str, rest: bytes) -> bytes:
        """A plain-HTTP request for the index: in origin form (or as it came, for the admin's proxy),
        its connection closed after the answer (a kept one could carry a request for another host)."""
        headers = [
            h
            for h in rest.split(b"\r\n")
            if h and h.split(b":", 1)[0].strip().lower() not in (b"connection", b"proxy-connection", b"keep-alive")
        ]
        host = (urlsplit(target).hostname or "").lower()
        if not (self._upstream["http"] and not _bypassed(host, self._no_proxy)):
            parts = urlsplit(target)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"{method} {target} {version}".encode()
        return b"\r\n".join([head, *headers, b"Connection: close", b"", b""])


def _read_head(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk or len(data) > _MAX_HEAD:
            return None
        data += chunk
    head, _, extra = data.partition(b"\r\n\r\n")
    if extra:  # a request's body, or bytes past a proxy's answer: none is expected
        raise ValueError("unexpected bytes after the request's head")
    return head


def _answer(client: socket.socket, status: int, text: str) -> None:
    body = text.encode()
    reason = {403: "Forbidden", 502: "Bad Gateway"}[status]
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    client.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
