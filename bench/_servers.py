"""Servers the benchmarks measure against, all on 127.0.0.1: a real `gpuport server`, and a raw
gRPC server over TLS with the same certificate (the floor: gRPC with nothing of gpuport's on top)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RAW_METHOD = "/bench.Raw/Ping"  # bytes in, bytes out: no message encoding at all
PROTO_METHOD = "/bench.Raw/PingProto"  # a protobuf Empty in and out, as a plain gRPC service does


@dataclass
class Gpuport:
    process: subprocess.Popen[str]
    url: str
    token: str
    fingerprint: str
    state_dir: Path

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=20)


def start_gpuport(workdir: Path) -> Gpuport:
    from gpuport.server.daemon import parse_banner  # here, not above: the raw server's process stays bare

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env.update(PYTHONUNBUFFERED="1", GPUPORT_FAKE_GPUS="2x16GiB")
    state = workdir / "state"
    loopback = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--log-level", "warning"]
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuport", "server", *loopback, "--state-dir", str(state)],
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
        raise SystemExit(f"gpuport server did not start: {e}") from None
    assert banner.fingerprint and banner.admin_token
    return Gpuport(process, banner.grpc_url, banner.admin_token, banner.fingerprint, state)


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


def workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="gpuport-bench-")


if __name__ == "__main__":  # the raw server's own process: _servers.py CERT KEY
    _serve_raw(Path(sys.argv[1]), Path(sys.argv[2]))
