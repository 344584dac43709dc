"""Connection and call overhead of gpuport against a raw gRPC unary call over TLS, in one run.

    make bench                      # or: .venv/bin/python bench/bench_connect.py [--fresh 50] [--calls 2000]

(a) fresh: connect + TLS handshake + an authenticated call on a new connection each time
    (gpuport.connect() with a saved profile, which makes the Hello call; then close), median of N;
(b) open: one no-op call on an open connection (Client.ping), median of N.
The anchor is a raw grpc.aio server on 127.0.0.1 with the same TLS certificate and a unary method
taking and returning a protobuf Empty, as Client.ping does: what gpuport adds on top is the token,
its check and the client API. The same call with bare bytes (no message encoding) is printed too.
Fresh connections alternate one by one; calls on open connections alternate in blocks of 100
(A×100, B×100, C×100, A×100 ...), so drift in machine speed hits all alike while each connection
stays warm as in real use. Goal: (b) at most 1.10x the raw call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
import _servers  # noqa: E402

import gpuport  # noqa: E402
from gpuport.protocol import gpuport_pb2 as pb  # noqa: E402


def raw_channel(address: str, cert: bytes) -> grpc.Channel:
    return grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=cert),
        options=[("grpc.ssl_target_name_override", "localhost"), ("grpc.use_local_subchannel_pool", 1)],
    )


def proto_call(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        _servers.PROTO_METHOD, request_serializer=pb.Empty.SerializeToString, response_deserializer=pb.Empty.FromString
    )


def interleave(n: int, *calls: Callable[[], object], block: int = 1) -> list[list[float]]:
    """Time ``n`` runs of each call, alternating between them every ``block`` runs."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(max(1, n // block)):
        for call, out in zip(calls, times, strict=True):
            for _ in range(block):
                t = time.perf_counter()
                call()
                out.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh", type=int, default=50, help="fresh connections to time (default 50)")
    parser.add_argument("--calls", type=int, default=2000, help="calls on an open connection (default 2000)")
    args = parser.parse_args()

    with _servers.workdir() as tmp:
        work = Path(tmp)
        os.environ["GPUPORT_CONFIG_DIR"] = str(work / "config")
        server = _servers.start_gpuport(work)
        cert_path, key_path = server.state_dir / "tls" / "cert.pem", server.state_dir / "tls" / "key.pem"
        raw = _servers.start_raw(cert_path, key_path)
        try:
            gpuport.login(server.url, server.token, fingerprint=server.fingerprint).close()
            cert = cert_path.read_bytes()
            request = pb.Empty()

            def fresh_gpuport() -> None:
                gpuport.connect().close()

            def fresh_raw() -> None:
                with raw_channel(raw.address, cert) as channel:
                    proto_call(channel)(request, timeout=10)

            interleave(5, fresh_gpuport, fresh_raw)  # warm-up
            fresh = interleave(args.fresh, fresh_gpuport, fresh_raw)

            with gpuport.connect() as client, raw_channel(raw.address, cert) as channel:
                ping_proto, ping_bytes = proto_call(channel), channel.unary_unary(_servers.RAW_METHOD)
                calls = (client.ping, lambda: ping_proto(request, timeout=10), lambda: ping_bytes(b"", timeout=10))
                interleave(300, *calls, block=100)  # warm-up
                opened = interleave(args.calls, *calls, block=100)
        finally:
            raw.stop()
            server.stop()

    print(
        f"gpuport {gpuport.__version__}, Python {sys.version.split()[0]}, grpcio {grpc.__version__}, "
        f"{os.cpu_count()} CPUs, TLS on 127.0.0.1"
    )
    print(f"{'figure (median)':<44} {'gpuport':>9} {'raw gRPC':>9} {'ratio':>6}   {'raw, bytes':>10} {'ratio':>6}")
    f_ours, f_raw = (statistics.median(t) for t in fresh)
    print(
        f"{f'fresh connect+TLS+auth call, of {args.fresh}':<44} {f_ours * 1e3:>7.3f}ms {f_raw * 1e3:>7.3f}ms "
        f"{f_ours / f_raw:>5.2f}x"
    )
    o_ours, o_raw, o_bytes = (statistics.median(t) for t in opened)
    print(
        f"{f'no-op call on open connection, of {args.calls}':<44} {o_ours * 1e3:>7.3f}ms {o_raw * 1e3:>7.3f}ms "
        f"{o_ours / o_raw:>5.2f}x   {o_bytes * 1e3:>8.3f}ms {o_ours / o_bytes:>5.2f}x"
    )
    print("goal: no-op call on an open connection at most 1.10x the raw gRPC call")


if __name__ == "__main__":
    main()
