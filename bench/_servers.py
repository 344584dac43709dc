"""Servers the benchmarks measure against, all on 127.0.0.1: a real `gpuport server`, a raw gRPC
server over TLS with the same certificate (the floor: gRPC with nothing of gpuport's on top), and a
raw TLS socket with that certificate (the floor for bulk bytes: no gRPC, no framing)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
RAW_METHOD = "/bench.Raw/Ping"  # bytes in, bytes out: no message encoding at all
PROTO_METHOD = "/bench.Raw/PingProto"  # a protobuf Empty in and out, as a plain gRPC service does


@dataclass
class Gpuport:
    process: subprocess.Popen[str]
    url: str
    token: str
    fingerprint: str
    state_dir: Path
    http_url: str = ""
    banner: str = ""  # what it printed before "ready"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=20)


def start_gpuport(workdir: Path, launcher: Sequence[str] = (), options: Sequence[str] = ()) -> Gpuport:
    """``gpuport server`` on 127.0.0.1 (port 0, fake GPUs, state in ``workdir/state``); ``launcher``
    replaces ``python -m gpuport`` (a bench's own wrapper around the server's entry point);
    ``options`` are more of the server's options."""
    from gpuport.server.daemon import parse_banner  # here, not above: the raw server's process stays bare

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env.update(PYTHONUNBUFFERED="1", GPUPORT_FAKE_GPUS="2x16GiB")
    state = workdir / "state"
    loopback = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--log-level", "warning"]
    process = subprocess.Popen(
        [*(launcher or [sys.executable, "-m", "gpuport"]), "server", *loopback, *options, "--state-dir", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line or line.strip() == "ready":
            break
        lines.append(line)
    try:
        banner = parse_banner("".join(lines))
    except ValueError as e:
        process.kill()
        process.wait(timeout=10)
        raise SystemExit(f"gpuport server did not start: {e}") from None
    assert banner.fingerprint and banner.admin_token
    return Gpuport(
        process, banner.grpc_url, banner.admin_token, banner.fingerprint, state, banner.http_url, "".join(lines)
    )


def _serve_raw(cert: Path, key: Path) -> None:
    """In a child process: a grpc.aio server with one no-op unary method, TLS with the given identity."""
    import grpc

    from gpuport.protocol import gpuport_pb2 as pb

    async def main() -> None:
        server = grpc.aio.server()

        async def ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return b""

        async def ping_proto(request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.Empty:
            return pb.Empty()

        handler = grpc.method_handlers_generic_handler(
            "bench.Raw",
            {
                "Ping": grpc.unary_unary_rpc_method_handler(ping),
                "PingProto": grpc.unary_unary_rpc_method_handler(
                    ping_proto, request_deserializer=pb.Empty.FromString, response_serializer=pb.Empty.SerializeToString
                ),
            },
        )
        server.add_generic_rpc_handlers([handler])
        port = server.add_secure_port(
            "127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        )
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


@dataclass
class Raw:
    process: subprocess.Popen[str]
    address: str

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def start_raw(cert: Path, key: Path) -> Raw:
    process = subprocess.Popen([sys.executable, __file__, str(cert), str(key)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    port = process.stdout.readline().strip()
    if not port:
        raise SystemExit("the raw gRPC server did not start")
    return Raw(process, f"127.0.0.1:{port}")


# ---- raw TLS socket ------------------------------------------------------------------------------

TLS_CHUNK = 1 << 20  # each sendall() gets a memoryview slice this big; recv_into() asks for as much
# An operation and a byte count: b"r" receive into the buffer, b"f" receive into fresh shared memory
# (a new memfd, as a gpuport server receives a value for its worker), b"s" send, b"q" quit.
_TLS_HEADER = struct.Struct("!cQ")


def _recv_exact(sock: ssl.SSLSocket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, TLS_CHUNK))
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += n


def _send_all(sock: ssl.SSLSocket, view: memoryview) -> None:
    for start in range(0, len(view), TLS_CHUNK):
        sock.sendall(view[start : start + TLS_CHUNK])


def _serve_tls(cert: Path, key: Path) -> None:
    """In a child process: one TLS connection on 127.0.0.1 that receives into, or sends from, a buffer
    allocated (and written, so its pages exist) before the first transfer of that size; or receives
    into a fresh memfd mapping, whose pages are made as the bytes arrive."""
    import mmap

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with socket.create_server((LOOPBACK, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
    with contextlib.suppress(OSError), context.wrap_socket(conn, server_side=True) as tls:
        # OSError (ConnectionError too): the bench went away mid-transfer (Ctrl-C); so does this child.
        buffer = bytearray()
        header = memoryview(bytearray(_TLS_HEADER.size))
        while True:
            _recv_exact(tls, header)
            op, size = _TLS_HEADER.unpack(header)
            if op == b"q":
                return
            if op == b"f":
                fd = os.memfd_create("bench")
                try:
                    os.ftruncate(fd, size)
                    with mmap.mmap(fd, size) as mapped, memoryview(mapped) as fresh:
                        _recv_exact(tls, fresh)
                        tls.sendall(b"k")  # before the memory is freed, which is not the transfer's
                finally:
                    os.close(fd)
                tls.sendall(b"d")  # freed: the next transfer finds this side idle
                continue
            if len(buffer) < size:
                buffer = bytearray(size)  # zero-filled: every page is touched here, not while timed
            view = memoryview(buffer)[:size]
            if op == b"r":
                _recv_exact(tls, view)
                tls.sendall(b"k")  # all of it arrived
            else:
                _send_all(tls, view)


@dataclass
class RawTls:
    """The client end of a raw TLS socket to the peer of ``start_raw_tls``, on 127.0.0.1."""

    process: subprocess.Popen[str]
    sock: ssl.SSLSocket
    _freeing: bool = False  # the peer is freeing the fresh memory of the last send: settle() waits for it

    @property
    def cipher(self) -> str:
        name, version, bits = self.sock.cipher() or ("?", "?", 0)
        return f"{name} ({version}, {bits}-bit)"

    def send(self, data: memoryview, fresh: bool = False) -> float:
        """Send ``data`` (bytes, ``sendall`` of ``TLS_CHUNK`` slices) until the peer has it all; return
        seconds. The peer receives into its buffer, or with ``fresh`` into a new memfd mapping."""
        self.settle()
        start = time.perf_counter()
        self.sock.sendall(_TLS_HEADER.pack(b"f" if fresh else b"r", len(data)))
        _send_all(self.sock, data)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the raw TLS peer did not confirm the bytes")
        self._freeing = fresh
        return time.perf_counter() - start

    def settle(self) -> None:
        """Wait until the peer has freed the fresh memory of the last send, if any (not a transfer's time)."""
        if self._freeing:
            if self.sock.recv(1) != b"d":
                raise ConnectionError("the raw TLS peer did not say it freed the memory")
            self._freeing = False

    def receive(self, into: memoryview) -> float:
        """Have the peer send ``len(into)`` bytes, received with ``recv_into`` into ``into``; return seconds."""
        self.settle()
        start = time.perf_counter()
        self.sock.sendall(_TLS_HEADER.pack(b"s", len(into)))
        _recv_exact(self.sock, into)
        return time.perf_counter() - start

    def stop(self) -> None:
        try:
            self.settle()
            self.sock.sendall(_TLS_HEADER.pack(b"q", 0))
            self.sock.close()
            self.process.wait(timeout=10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)


def start_raw_tls(cert: Path, key: Path) -> RawTls:
    """A child process with one raw TLS socket (Python's ssl, the given identity), connected to here."""
    process = subprocess.Popen(
        [sys.executable, __file__, "tls", str(cert), str(key)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        port = process.stdout.readline().strip()
        if not port:
            raise SystemExit("the raw TLS socket server did not start")
        context = ssl.create_default_context(cafile=str(cert))  # the certificate names localhost
        sock = context.wrap_socket(socket.create_connection((LOOPBACK, int(port))), server_hostname="localhost")
    except BaseException:
        process.kill()
        process.wait(timeout=10)
        raise
    return RawTls(process, sock)


def workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="gpuport-bench-")


if __name__ == "__main__":  # a raw server's own process: _servers.py CERT KEY, or _servers.py tls CERT KEY
    if sys.argv[1] == "tls":
        _serve_tls(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        _serve_raw(Path(sys.argv[1]), Path(sys.argv[2]))
