"""What one hostile user costs everyone else: floods against another user's launches and session calls.

    .venv/bin/python bench/bench_hostile.py [--quick]

One server on 127.0.0.1 with fake GPUs, sandboxing its jobs. A second user, the victim, times in
each turn: a job launch (`true`, submit to end, as the client sees it), opening a session (open and
its first call: the worker starts, a channel opens at the data port) and calls on a session it
opened at the start (`abs(-1)`, each call timed). Turns alternate, quiet, flood, quiet, flood...;
each flood's figures are set against the quiet turns on either side of its own, so a load that
comes and goes on the machine hits both alike. The floods, each from processes of its own:
(a) plain TCP connections at the data port from 127.0.0.2, opened as fast as two threads can and
    never sending a byte (no TLS, no ticket); each thread keeps its newest 200 open.
(b) one user's dashboard logins with their own token, back to back: batches of 200 requests
    pipelined over one TLS connection (the server does all the work, the client only writes).
(c) six archive bombs at once, posted over REST by one user: .tar.gz archives of 1,000,000 folder
    headers in about 5 MB each (refused at the entry limit); meanwhile the server's RSS is sampled.
(d) one user's job launches, six at once, again and again.
Goals: the victim's medians under each flood <= 2x the quiet ones; the server's peak memory under
the bombs at most +128 MiB over its RSS just before them. Then the sandbox's launch overhead:
the same launch against a second server started with --no-sandbox, in turns (bench_isolation's
figure, the sandbox as this server runs it). Goal: at most 20 ms more.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import re
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gpuport

sys.path.insert(0, str(Path(__file__).parent))

BOMBS = 6
FOLDERS = 1_000_000
FLOOD_SOURCE = "127.0.0.2"  # the bare connections' own loopback address
LOGIN_BATCH = 200  # logins pipelined per batch over one connection
LAUNCHERS = 6  # the launch flood's jobs at once


# ---- the floods, each in a process of its own: bench_hostile.py --flood KIND ARGS ----------------


def _flood_tcp(port: str, stop: threading.Event, counts: dict[str, int]) -> None:
    def one(index: int) -> None:
        mine: collections.deque[socket.socket] = collections.deque()
        while not stop.is_set():
            bare = socket.socket()
            bare.settimeout(1)
            bare.bind((FLOOD_SOURCE, 0))
            try:
                bare.connect(("127.0.0.1", int(port)))
            except OSError:
                bare.close()
                counts["refused"] += 1
                continue
            mine.append(bare)
            counts["opened"] += 1
            if len(mine) > 200:  # the server pushed these out long ago, or will: let go
                mine.popleft().close()
        for bare in mine:
            bare.close()

    _run_threads([threading.Thread(target=one, args=(i,)) for i in range(2)], stop)


def _flood_logins(http_url: str, cert: str, stop: threading.Event, counts: dict[str, int]) -> None:
    token = os.environ["BENCH_FLOOD_TOKEN"]
    host, port = http_url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
    body = json.dumps({"token": token}).encode()
    request = (
        f"POST /ui/login HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    trust = ssl.create_default_context(cafile=cert)

    def batches() -> None:
        with socket.create_connection((host, int(port))) as raw, trust.wrap_socket(raw, server_hostname=host) as tls:
            replies = tls.makefile("rb")
            while not stop.is_set():
                sender = threading.Thread(target=tls.sendall, args=(request * LOGIN_BATCH,), daemon=True)
                sender.start()
                for _ in range(LOGIN_BATCH):
                    status, length = replies.readline(), 0
                    if b" 200 " not in status:
                        raise SystemExit(f"a login was answered {status!r}")
                    while (line := replies.readline()) != b"\r\n":
                        name, _, value = line.partition(b":")
                        if name.lower() == b"content-length":
                            length = int(value)
                    replies.read(length)
                    counts["logins"] += 1
                sender.join()

    _run_threads([threading.Thread(target=batches)], stop)


def _flood_launches(url: str, fingerprint: str, stop: threading.Event, counts: dict[str, int]) -> None:
    import gpuport

    token = os.environ["BENCH_FLOOD_TOKEN"]

    def loop() -> None:
        with gpuport.connect(url, token, fingerprint=fingerprint) as client:
            while not stop.is_set():
                job = client.submit(["true"], workdir=None).wait(300)
                counts["launches" if job.exit_code == 0 else "failed"] += 1

    _run_threads([threading.Thread(target=loop) for _ in range(LAUNCHERS)], stop)


def _run_threads(threads: list[threading.Thread], stop: threading.Event) -> None:
    for thread in threads:
        thread.daemon = True
        thread.start()
    while not stop.is_set() and all(thread.is_alive() for thread in threads):
        stop.wait(0.1)
    stop.set()
    for thread in threads:
        thread.join(30)


def _flood_main(kind: str, args: list[str]) -> None:
    """A flood's process: say ``going`` once under way, stop on SIGTERM, print its counts as JSON."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    counts: collections.Counter[str] = collections.Counter()
    floods: dict[str, Callable[..., None]] = {"tcp": _flood_tcp, "logins": _flood_logins, "launches": _flood_launches}
    worker = threading.Thread(target=floods[kind], args=(*args, stop, counts), daemon=True)
    started = time.monotonic()
    worker.start()
    while sum(counts.values()) < 1 and worker.is_alive():
        time.sleep(0.01)
    print("going", flush=True)
    worker.join()
    print(json.dumps({**counts, "seconds": round(time.monotonic() - started, 2)}), flush=True)


@contextlib.contextmanager
def flood(kind: str, *args: str, token: str = "") -> Iterator[dict[str, float]]:
    """A flood's process, under way while the block runs; then its counts in the yielded dict.
    Ended by its pid (SIGTERM, then SIGKILL after 30 s)."""
    env = {**os.environ, "BENCH_FLOOD_TOKEN": token}
    process = subprocess.Popen(
        [sys.executable, __file__, "--flood", kind, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    counts: dict[str, float] = {}
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "going":
            raise SystemExit(f"the {kind} flood did not start")
        yield counts
    finally:
        process.terminate()
        try:
            out, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate(timeout=10)
        with contextlib.suppress(ValueError):
            counts.update(json.loads(out.strip().splitlines()[-1]))


def folders_bomb(count: int) -> bytes:
    """A .tar.gz of ``count`` folder headers: 1,000 distinct ones gzipped once and repeated."""
    block = b""
    for i in range(1000):
        info = tarfile.TarInfo(f"d{i:06d}")
        info.type = tarfile.DIRTYPE
        block += info.tobuf(format=tarfile.USTAR_FORMAT)
    return gzip.compress(block, mtime=0) * (count // 1000) + gzip.compress(b"\0" * 1024, mtime=0)


# ---- the victim --------------------------------------------------------------------------------

MEASURES = {"launch": "job launch", "open": "session open + 1st call", "call": "session call"}


@dataclass
class Turn:
    kind: str  # "quiet" or a flood's name
    times: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MEASURES})


class Victim:
    """Another user of the server: times launches, session opens and calls, in cycles."""

    def __init__(self, client: gpuport.Client, calls: int) -> None:
        self.client = client
        self.calls = calls
        self.session = client.session()
        self.session.call(abs, -1)  # its worker is up and its channel open before anything is timed

    def cycle(self, turn: Turn) -> None:
        """One launch, one session opened (and its first call), ``calls`` calls on the open session."""
        start = time.perf_counter()
        job = self.client.submit(["true"], workdir=None).wait(300)
        turn.times["launch"].append(time.perf_counter() - start)
        assert job.exit_code == 0, list(job.logs())
        start = time.perf_counter()
        with self.client.session() as fresh:
            assert fresh.call(abs, -1) == 1
            turn.times["open"].append(time.perf_counter() - start)
        for _ in range(self.calls):
            start = time.perf_counter()
            assert self.session.call(abs, -1) == 1
            turn.times["call"].append(time.perf_counter() - start)

    def close(self) -> None:
        self.session.close()


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def main() -> None:
    import httpx
    import psutil
    from _report import MB, ROWS, Row, banner, connect, gpuport_server, isolated_workdir, median, print_table, say
    from bench_isolation import _limits, launch_overhead

    import gpuport

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns, one wave of bombs (about 2 minutes)")
    args = parser.parse_args()
    banner("floods and archive bombs vs a quiet server", args.quick)
    rounds, cycles, waves = (2, 2, 1) if args.quick else (4, 3, 2)
    calls = 20
    bomb = folders_bomb(FOLDERS)
    turns: list[Turn] = []
    growth: list[tuple[int, int]] = []  # (RSS before a wave, its peak during it)
    said: dict[str, list[str]] = collections.defaultdict(list)
    with isolated_workdir() as work, gpuport_server(work, "hostile") as server, connect(server) as admin:
        isolation = re.search(r"^  isolation\s+(.+)$", server.banner, re.MULTILINE)
        data_port = re.search(r"^  data port\s+(\d+)", server.banner, re.MULTILINE)
        assert isolation and data_port, server.banner
        say(f"isolation: {isolation[1]}")
        mallory = admin.create_token("mallory").token
        victim_token = admin.create_token("victim").token
        cert = str(server.state_dir / "tls" / "cert.pem")
        process = psutil.Process(server.process.pid)
        with gpuport.connect(server.url, victim_token, fingerprint=server.fingerprint) as client:
            # The sandbox's launch overhead first, on a quiet machine: against a --no-sandbox server.
            with gpuport_server(work, "open", ["--no-sandbox", "--no-cgroups"]) as open_, connect(open_) as outside:
                limits = _limits(server)
                say(f"limits: {limits}")
                figure = "sandbox launch overhead" + (
                    " with its cgroup" if "cgroup v" in limits else " (no cgroup here)"
                )
                ROWS.append(launch_overhead(client, outside, 10 if args.quick else 30, figure))
            victim = Victim(client, calls)
            victim.cycle(Turn("warm"))

            def quiet() -> None:
                turn = Turn("quiet")
                for _ in range(cycles):
                    victim.cycle(turn)
                turns.append(turn)

            def flooded(kind: str, *args: str, token: str = "") -> None:
                turn = Turn(kind)
                with flood(kind, *args, token=token) as counts:
                    for _ in range(cycles):
                        victim.cycle(turn)
                turns.append(turn)
                said[kind].append(", ".join(f"{k} {v:,}" for k, v in counts.items()))

            def bombs() -> None:
                turn = Turn("bombs")
                trust = ssl.create_default_context(cafile=cert)
                answers: list[int] = []

                def post() -> None:
                    with httpx.Client(verify=trust, timeout=600) as http:
                        answer = http.post(
                            f"{server.http_url}/v1/snapshots",
                            content=bomb,
                            headers={"authorization": f"Bearer {mallory}", "content-type": "application/gzip"},
                        )
                        answers.append(answer.status_code)

                before = peak = process.memory_info().rss
                posts = [threading.Thread(target=post) for _ in range(BOMBS)]
                started = time.perf_counter()
                for thread in posts:
                    thread.start()
                sampling = True

                def sample() -> None:
                    nonlocal peak
                    while sampling:
                        peak = max(peak, process.memory_info().rss)
                        time.sleep(0.02)

                sampler = threading.Thread(target=sample)
                sampler.start()
                while any(thread.is_alive() for thread in posts):
                    victim.cycle(turn)
                took = time.perf_counter() - started
                sampling = False
                sampler.join()
                for thread in posts:
                    thread.join()
                turns.append(turn)
                growth.append((before, peak))
                said["bombs"].append(
                    f"answered {sorted(answers)} in {took:.1f} s, RSS {before / MB:.0f} -> {peak / MB:.0f} MB"
                )

            floods: dict[str, Callable[[], None]] = {
                "tcp": lambda: flooded("tcp", data_port[1]),
                "logins": lambda: flooded("logins", server.http_url, cert, token=mallory),
                "launches": lambda: flooded("launches", server.url, server.fingerprint, token=mallory),
            }
            for i in range(rounds):
                for run in floods.values():
                    quiet()
                    run()
                if i < waves:
                    quiet()
                    bombs()
            quiet()
            victim.close()
    say(f"{BOMBS} bombs of {len(bomb) / MB:.1f} MB ({FOLDERS:,} folder headers each) a wave")
    for kind, lines in said.items():
        for line in lines:
            say(f"  {kind}: {line}")
    names = {"tcp": "bare TCP from 127.0.0.2", "logins": "one user's logins", "bombs": f"{BOMBS} archive bombs",
             "launches": f"{LAUNCHERS} launches at once"}  # fmt: skip
    for kind, name in names.items():
        for measure, label in MEASURES.items():
            ours: list[float] = []
            anchor: list[float] = []
            for i, turn in enumerate(turns):
                if turn.kind == kind:
                    ours += turn.times[measure]
                    anchor += turns[i - 1].times[measure] + turns[i + 1].times[measure]
            if not ours:
                continue
            mine, theirs = median(ours), median(anchor)
            ROWS.append(Row(f"{label} | {name}", mine, theirs, "quiet, turns beside", "<= 2x", mine <= 2 * theirs,
                            note=f"p90 {p90(ours) * 1e3:.1f}/{p90(anchor) * 1e3:.1f} ms, n={len(ours)}"))  # fmt: skip
    before, peak = max(growth, key=lambda g: g[1] - g[0])
    ROWS.append(Row(f"server memory growth, {BOMBS} archive bombs", peak - before, None, "-", "<= +134 MB (128 MiB)",
                    peak - before <= 128 * 1024**2, unit="MB", note=f"{before / MB:.0f} -> {peak / MB:.0f} MB"))  # fmt: skip
    print_table(
        [*MEASURES.values(), "server memory", "sandbox"],
        52,
        "times: medians (p90 under the flood / quiet in the note); ratio: under the flood / the quiet turns beside it",
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--flood":
        _flood_main(sys.argv[2], sys.argv[3:])
    else:
        main()
