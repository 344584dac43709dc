"""The tunnels' byte relay (``gpuport/protocol/relay.py``) against the same TLS connection with no relay.

    .venv/bin/python bench/bench_relay.py [--rounds 2000] [--mib 256]

(a) round trip of a 64-byte message: a TLS client -> relay -> a socketpair whose far end echoes,
    median of N, against the same TLS client echoed by a thread that reads the TLS socket itself
    (the anchor: one hop less). The relay's cost per RPC is the difference.
(b) MiB/s one way: N MiB through the relay against N MiB over the bare TLS connection.
(c) both ways at once through two relays in a row (TLS -> relay -> socketpair -> relay -> TLS ->
    an echoing socket), as a tunnel through a node's agent: MiB/s, or "stuck" after 30 s.
With ``--old REV`` (a git revision, e.g. ``0216077~1``: before the relay became non-blocking),
(a)-(c) are measured for that revision's relay too, in the same run.
Everything on 127.0.0.1, one run; the ratios compare numbers taken in that run.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from gpuport.protocol import relay as current
from gpuport.server.tls import _make_certificate

MESSAGE = b"x" * 64
relay = current.relay  # the relay measured: this tree's, or --old's


def _relay_at(revision: str) -> types.ModuleType:
    """relay.py as it was at ``revision``."""
    source = subprocess.run(
        ["git", "show", f"{revision}:gpuport/protocol/relay.py"],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    ).stdout
    module = types.ModuleType("old_relay")
    exec(compile(source, f"{revision}:relay.py", "exec"), module.__dict__)  # noqa: S102 (our own file, at a commit)
    return module


def _contexts(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = _make_certificate({"127.0.0.1"})
    (folder / "cert.pem").write_bytes(cert)
    (folder / "key.pem").write_bytes(key)
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return serving, ssl.create_default_context(cafile=folder / "cert.pem")


@contextlib.contextmanager
def _tls_pair(serving: ssl.SSLContext, calling: ssl.SSLContext) -> Iterator[tuple[ssl.SSLSocket, ssl.SSLSocket]]:
    """(the client's TLS socket, the server's), connected on 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted: list[ssl.SSLSocket] = []
        thread = threading.Thread(
            target=lambda: accepted.append(serving.wrap_socket(listener.accept()[0], server_side=True))
        )
        thread.start()
        client = calling.wrap_socket(socket.create_connection(listener.getsockname()), server_hostname="127.0.0.1")
        thread.join()
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    accepted[0].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield client, accepted[0]
    finally:
        client.close()
        accepted[0].close()


def _echo(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := sock.recv(1 << 20):
            sock.sendall(data)


def _drain(sock: socket.socket, size: int) -> None:
    got = 0
    while got < size and (data := sock.recv(1 << 20)):
        got += len(data)


def _round_trip(client: socket.socket, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        client.sendall(MESSAGE)
        _drain(client, len(MESSAGE))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _one_way(client: socket.socket, far: socket.socket, mib: int) -> float:
    block = b"\0" * (1 << 20)
    reader = threading.Thread(target=_drain, args=(far, mib << 20))
    started = time.perf_counter()
    reader.start()
    for _ in range(mib):
        client.sendall(block)
    reader.join()
    return mib / (time.perf_counter() - started)


def _relayed(
    serving: ssl.SSLContext, calling: ssl.SSLContext, measure: Callable[[socket.socket, socket.socket], float]
) -> float:
    with _tls_pair(serving, calling) as (client, server_end):
        near, far = socket.socketpair()
        thread = threading.Thread(target=relay, args=(server_end, near), daemon=True)
        thread.start()
        try:
            return measure(client, far)
        finally:
            client.close()
            thread.join(10)
            near.close()
            far.close()


def _both_ways(serving: ssl.SSLContext, calling: ssl.SSLContext, mib: int) -> float | None:
    """Through two relays to an echoing socket, sending and reading at once: MiB/s, None when stuck."""
    with _tls_pair(serving, calling) as (client, first), _tls_pair(serving, calling) as (second_in, second):
        near, far = socket.socketpair()  # the first relay's far side feeds the second TLS link
        worker, worker_far = socket.socketpair()
        relays = [
            threading.Thread(target=relay, args=(first, near), daemon=True),
            threading.Thread(target=relay, args=(second_in, far), daemon=True),
            threading.Thread(target=relay, args=(second, worker), daemon=True),
            threading.Thread(target=_echo, args=(worker_far,), daemon=True),
        ]
        for thread in relays:
            thread.start()
        block = b"\1" * (1 << 20)

        def send() -> None:
            with contextlib.suppress(OSError):  # stuck: the reader gives up, and this sender with it
                for _ in range(mib):
                    client.sendall(block)

        sender = threading.Thread(target=send, daemon=True)
        client.settimeout(30)
        started = time.perf_counter()
        sender.start()
        try:
            _drain(client, mib << 20)
        except TimeoutError:
            return None
        finally:
            for end in (client, near, far, worker, worker_far):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
        return mib / (time.perf_counter() - started)


def _measure(serving: ssl.SSLContext, calling: ssl.SSLContext, rounds: int, mib: int) -> dict[str, float | None]:
    def relayed_rtt(client: socket.socket, far: socket.socket) -> float:
        threading.Thread(target=_echo, args=(far,), daemon=True).start()
        return _round_trip(client, rounds)

    return {
        "rtt": _relayed(serving, calling, relayed_rtt),
        "rate": _relayed(serving, calling, lambda client, far: _one_way(client, far, mib)),
        "both": _both_ways(serving, calling, mib),
    }


def main() -> None:
    global relay
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--old", default="", help="a git revision whose relay is measured too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        serving, calling = _contexts(Path(folder))
        with _tls_pair(serving, calling) as (client, server_end):
            threading.Thread(target=_echo, args=(server_end,), daemon=True).start()
            direct_rtt = _round_trip(client, args.rounds)
        with _tls_pair(serving, calling) as (client, server_end):
            direct_rate = _one_way(client, server_end, args.mib)
        runs = {"this tree": _measure(serving, calling, args.rounds, args.mib)}
        if args.old:
            relay = _relay_at(args.old).relay
            runs[args.old] = _measure(serving, calling, args.rounds, args.mib)
            relay = current.relay

    print(
        f"direct TLS, no relay (the anchor): 64 B round trip {direct_rtt * 1e6:.0f} us, "
        f"{args.mib} MiB one way {direct_rate:.0f} MiB/s"
    )
    for name, run in runs.items():
        rtt, rate, both = run["rtt"], run["rate"], run["both"]
        assert rtt is not None and rate is not None
        print(f"relay of {name}:")
        print(f"  (a) 64 B round trip {rtt * 1e6:.0f} us -> {rtt / direct_rtt:.2f}x the anchor")
        print(f"  (b) {args.mib} MiB one way {rate:.0f} MiB/s -> {rate / direct_rate:.2f}x the anchor")
        print(
            f"  (c) {args.mib} MiB both ways at once through two relays: " + (f"{both:.0f} MiB/s" if both else "stuck")
        )


if __name__ == "__main__":
    main()
