"""Remote sessions of gpuport against their anchors, measured in the same run, on 127.0.0.1.

    .venv/bin/python bench/bench_sessions.py            # full sizes: about three minutes on 2 cores
    .venv/bin/python bench/bench_sessions.py --quick    # smaller sizes and fewer repeats: under a minute

(a) a no-op call on an open session: `s.call(noop)` (noop returns None), median of N (--calls,
    default 2,000); calls ride the session's channel on the data port (see gpuport/server/api/
    data_port.py). Against
    1. the floor: a raw gRPC unary call over TLS on the same loopback with the same certificate
       (bench/_servers.py's grpc.aio server, a protobuf Empty in and out, as bench_connect.py
       measures it). Alternated in blocks of 100 (A x100, B x100, ...), so drift hits both alike
       while each connection stays warm. Printed beside them: the bare-bytes raw call, the same
       `s.call(noop)` through gRPC (a second client with no data port, as behind a firewall) and
       `gpu.ping()` (client -> server and back over gRPC, without the worker).
       Goal: at most 1.10x the raw call.
    2. the peer: a Ray actor method call, `ray.get(actor.noop.remote())`, from a driver connected to
       a local Ray head (bench/_peers.py's, everything on 127.0.0.1), timed in that driver's
       process; alternated in blocks of 100 with `s.call(noop)` while the head runs, so Ray's idle
       daemons load the CPUs during both. Median of N (--ray-calls, default 1,000).
       Goal: faster than Ray. Skipped, with a line saying so, without `ray` (the bench extra).
(b) bulk values: `s.put` of a float32 numpy array of 1 GiB (256M elements; --size-mib) and `s.get`
    of it back, from the call until the value is there (the worker holds it / the array is here),
    against a raw TLS socket on 127.0.0.1 with the same certificate (Python's ssl module; a child
    process receives with recv_into into a buffer it allocated and wrote beforehand and confirms
    with one byte; to send, sendall of 1 MiB memoryview slices of the same array; back, the child
    sends from its buffer and this side receives with recv_into into a preallocated buffer). The
    raw socket's negotiated cipher is printed. Printed beside them, not anchors: the raw socket
    receiving into fresh memory (the child into a new memfd mapping, as the server receives a
    session's first large value; this side into a new numpy array), which is what first touching
    memory costs here. gpuport pays that on a first transfer of a size only: the timed ones reuse the
    memory the last one let go of (the put value deleted, the got array dropped), as a loop putting
    and getting batches would. The six transfers are alternated, the order rotating, R times
    (--reps, default 3) after one warm-up; the best is the figure (the median is printed too), with
    the CPU seconds each process spent per GB. Goal: at least 0.85x the raw socket, for put and for
    get. And values kept: `s.put` of the same array without deleting the last (each value arrives
    in memory the worker never touched: a loop keeping its batches), against the raw socket into
    fresh memory (a new memfd, as above), in the same rotation. Goal: at least 0.8x.
(c) Keras: 20 epochs (--epochs) of a small MLP (Dense(64, relu) -> Dense(10), softmax cross-entropy,
    adam, batch 256, seeded weights) on 50,000 x 100 float32 with random labels 0-9, built and fit
    by the same function (`fit_mlp`), which returns the final loss. Locally: in a child Python
    process that imported TensorFlow and made the data (same seed) first, timing the function in
    that process. In a session: the data put once beforehand (`s.put`), TensorFlow imported by a
    first call, then `s.call(fit_mlp, xref, yref, epochs)` timed here, from the call to its result.
    Neither side sets thread settings: the local child gets the worker's own values of OMP_*,
    TF_*, MKL_* and the like (none, unless the server sets some), which are printed with both
    sides' CPU affinity. Alternated, F fits each (--fits, default 5: one fit to the next swings by
    10-20% on a 2-core VM), median. Goal: at most 1.05x.

Sections run in the order (a1), (b), (c), (a2): Ray last, so that its idle daemons load no CPU during
the others; the table is printed in the order above. GB and MB are 10^9 and 10^6 bytes; GiB and
MiB are 2^30 and 2^20. Every server, child and Ray process runs in a temp dir removed at the end,
and is stopped in `finally`, by its pid; a process the gpuport server started that outlives it (a
session's worker) is named and killed by its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import select
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
import _peers  # noqa: E402
import _servers  # noqa: E402
from _report import (  # noqa: E402
    MB,
    ROWS,
    Row,
    banner,
    connect,
    gpuport_server,
    isolated_workdir,
    median,
    ms,
    print_table,
    rotate,
    say,
)

import gpuport  # noqa: E402
from gpuport.protocol import gpuport_pb2 as pb  # noqa: E402

GB = 1e9
GiB = 1 << 30
MiB = 1 << 20
BLOCK = 100  # calls in a row before switching to the other kind (a)
KERAS_ROWS, KERAS_FEATURES, KERAS_CLASSES, KERAS_SEED = 50_000, 100, 10, 0
# What is compared between the worker's environment and the local child's for (c): thread settings.
THREAD_ENV_PREFIXES = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "TF_", "GOTO_", "BLIS_", "NUMEXPR_", "CUDA_VISIBLE")


# ---- what runs on both sides -----------------------------------------------------------------------


def noop() -> None:
    return None


def import_tensorflow() -> str:
    import tensorflow as tf

    return str(tf.__version__)


def process_facts() -> dict[str, Any]:
    """Where this code runs: pid, CPU affinity, niceness and thread settings of its environment."""
    import os

    return {
        "pid": os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.nice(0),
        "env": {k: v for k, v in os.environ.items() if k.startswith(THREAD_ENV_PREFIXES)},
    }


def keras_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(KERAS_SEED)
    x = rng.standard_normal((KERAS_ROWS, KERAS_FEATURES), dtype=np.float32)
    y = rng.integers(0, KERAS_CLASSES, KERAS_ROWS, dtype=np.int64)
    return x, y


def fit_mlp(x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    """Build and fit the MLP of (c) on ``x``, ``y``; return the last epoch's loss."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=256, epochs=epochs, verbose=0)
    return float(history.history["loss"][-1])


# ---- children: the local Keras run and the Ray driver -------------------------------------------------


def _child_keras() -> None:
    """`bench_sessions.py --child-keras`: import TensorFlow, make the data, then run `fit EPOCHS`
    commands from stdin, answering each with a JSON line of the fit's seconds and loss."""
    facts = process_facts()  # before TensorFlow, which sets variables of its own (KMP_*)
    version = import_tensorflow()
    x, y = keras_data()
    print(json.dumps({"tensorflow": version, "facts": facts}), flush=True)
    for line in sys.stdin:
        epochs = int(line.split()[1])
        start = time.perf_counter()
        loss = fit_mlp(x, y, epochs)
        print(json.dumps({"s": time.perf_counter() - start, "loss": loss}), flush=True)


def _child_ray(address: str) -> None:
    """`bench_sessions.py --child-ray GCS_ADDRESS`: a Ray driver with one actor; each line N on stdin
    times N calls of ``ray.get(actor.noop.remote())`` and answers with a JSON list of seconds."""
    import ray

    ray.init(address=address, _node_ip_address=_peers.LOOPBACK, log_to_driver=False, logging_level=logging.ERROR)

    @ray.remote
    class Actor:
        def noop(self) -> None:
            return None

        def pid(self) -> int:
            return os.getpid()

    actor = Actor.remote()  # type: ignore[attr-defined]
    pid = ray.get(actor.pid.remote(), timeout=120)
    print(json.dumps({"ray": ray.__version__, "actor_pid": pid}), flush=True)
    for line in sys.stdin:
        n = int(line)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            ray.get(actor.noop.remote())
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)
    ray.shutdown()


class Child:
    """A child process of ``script`` (by default this one, with ``--child-...``) spoken to by lines on
    stdin and stdout; its stderr goes to a log file, whose tail is shown when it fails."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None, script: str = __file__) -> None:
        self.log, self.what = log, argv[0]
        with open(log, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, script, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )

    def tell(self, line: str) -> None:
        """Send ``line`` without waiting for an answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def ask(self, line: str | None = None, timeout: float = 600) -> Any:
        """Send ``line`` (if any), return the JSON of the child's next line (one line per request)."""
        if line is not None:
            self.tell(line)
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout)
        answer = stdout.readline() if ready else ""
        if not answer:
            if not ready:
                self.process.kill()
            self.process.wait(timeout=30)
            tail = self.log.read_text(errors="replace")[-3000:]
            why = f"gave no answer in {timeout:g}s" if not ready else f"exited with {self.process.returncode}"
            raise RuntimeError(f"the {self.what} child {why}:\n{tail}")
        return json.loads(answer)

    def stop(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # the child's loop ends
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


# ---- helpers ---------------------------------------------------------------------------------------


def blocks(n: int, calls: dict[str, Callable[[int], list[float]]]) -> dict[str, list[float]]:
    """Time ``n`` calls of each kind, ``BLOCK`` in a row per kind before switching: each entry of
    ``calls`` runs a block of that many calls and returns their times."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(1, n // BLOCK)):
        for name, run in calls.items():
            times[name].extend(run(BLOCK))
    return times


def timed_block(fn: Callable[[], object]) -> Callable[[int], list[float]]:
    def run(n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    return run


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def raw_channel(address: str, cert: bytes) -> grpc.Channel:
    return grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=cert),
        options=[("grpc.ssl_target_name_override", "localhost"), ("grpc.use_local_subchannel_pool", 1)],
    )


def tls_files(server: _servers.Gpuport) -> tuple[Path, Path]:
    return server.state_dir / "tls" / "cert.pem", server.state_dir / "tls" / "key.pem"


def tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and every live descendant of it."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class CpuMeter:
    """CPU seconds (user + system) spent by named groups of processes between start() and stop()."""

    def __init__(self, groups: dict[str, Callable[[], list[psutil.Process]]]) -> None:
        self.groups = groups
        self.before: dict[str, dict[int, float]] = {}

    @staticmethod
    def _read(procs: list[psutil.Process]) -> dict[int, float]:
        out = {}
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
        return out

    def start(self) -> None:
        self.before = {name: self._read(find()) for name, find in self.groups.items()}

    def stop(self) -> dict[str, float]:
        spent = {}
        for name, find in self.groups.items():
            after = self._read(find())
            spent[name] = sum(t - self.before[name].get(pid, 0.0) for pid, t in after.items())
        return spent


_STARTED: dict[int, psutil.Process] = {}  # processes gpuport started for this bench: checked at the end


def track(pid: int, stop_at: int) -> None:
    """Remember process ``pid`` and its ancestors below ``stop_at`` (the server): a session's worker
    and whatever runs it (a job's supervisor may outlive the server by design)."""
    with contextlib.suppress(psutil.Error):
        p: psutil.Process | None = psutil.Process(pid)
        while p is not None and p.pid not in (stop_at, 1, os.getpid()):
            _STARTED[p.pid] = p
            p = p.parent()


def track_worker(s: Any, server: _servers.Gpuport) -> int:
    """The host pid of session ``s``'s worker, tracked. Not ``s.call(os.getpid)``: in its sandbox a
    worker has a pid namespace of its own, and its pid there (2) is another process's here. Found
    below the process its job's supervisor.json names (bubblewrap's, or the worker itself), once
    a first call has shown the worker up."""
    s.call(os.getpid)
    job = json.loads((server.state_dir / "jobs" / s.info().job_id / "supervisor.json").read_text())
    top = psutil.Process(job["child"])
    for p in [top, *top.children(recursive=True)]:
        if "gpuport.server.worker.session" in " ".join(p.cmdline()):
            track(p.pid, server.process.pid)
            return p.pid
    raise RuntimeError(f"no session worker below pid {top.pid}")


@contextlib.contextmanager
def tracked(server: _servers.Gpuport) -> Iterator[None]:
    """Around a server's use: before it is stopped, every process below it is tracked too."""
    try:
        yield
    finally:
        for p in tree(server.process.pid)[1:]:
            _STARTED[p.pid] = p


def check_left() -> None:
    """Once the servers have stopped: no process they started may be left. Any that is (a session
    worker its server lost) is named and killed by its pid."""
    left = []
    for p in _STARTED.values():
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    if not left:
        say(f"  all {len(_STARTED)} processes the server started for this run have ended")
        return
    say(f"  WARNING: {len(left)} process(es) started by a stopped gpuport server still ran; killing them by pid:")
    for p in left:
        with contextlib.suppress(psutil.Error):
            say(f"    pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
    psutil.wait_procs(left, timeout=10)


# ---- (a) no-op calls ----------------------------------------------------------------------------------


def bench_calls(args: argparse.Namespace, gpu: gpuport.Client, server: _servers.Gpuport) -> None:
    say(f"== (a1) no-op call on an open session, s.call(noop), against a raw gRPC call over TLS; {args.calls:,} each")
    cert_path, key_path = tls_files(server)
    raw = _servers.start_raw(cert_path, key_path)
    try:
        start = time.perf_counter()
        with gpu.session() as s, connect(server) as through_grpc, through_grpc.session() as g:
            opened = time.perf_counter() - start
            start = time.perf_counter()
            s.call(noop)
            first = time.perf_counter() - start
            track_worker(s, server)
            track_worker(g, server)
            through_grpc.transport.data_port = 0  # as behind a firewall that lets only the gRPC port through
            with raw_channel(raw.address, cert_path.read_bytes()) as channel:
                proto = channel.unary_unary(
                    _servers.PROTO_METHOD,
                    request_serializer=pb.Empty.SerializeToString,
                    response_deserializer=pb.Empty.FromString,
                )
                bare = channel.unary_unary(_servers.RAW_METHOD)
                request = pb.Empty()
                calls = {
                    "session": timed_block(lambda: s.call(noop)),
                    "session, gRPC": timed_block(lambda: g.call(noop)),
                    "raw": timed_block(lambda: proto(request, timeout=10)),
                    "raw bytes": timed_block(lambda: bare(b"", timeout=10)),
                    "ping": timed_block(gpu.ping),
                }
                blocks(3 * BLOCK, calls)  # warm-up
                t = blocks(args.calls, calls)
    finally:
        raw.stop()
    ours, floor = median(t["session"]), median(t["raw"])
    ping, bare_s = median(t["ping"]), median(t["raw bytes"])
    say(f"  session opened in {ms(opened)}; its first call (function sent with it) {ms(first)}")
    say(
        f"  s.call(noop) median {us(ours)} (p10 {us(sorted(t['session'])[len(t['session']) // 10])}, "
        f"p90 {us(sorted(t['session'])[len(t['session']) * 9 // 10])}); raw gRPC (Empty) {us(floor)}, "
        f"raw gRPC (bare bytes) {us(bare_s)}"
    )
    say(
        f"  where it goes: a session's calls ride a channel on the data port, relayed by a server thread to the "
        f"worker; through gRPC instead (no data port) s.call(noop) takes {us(median(t['session, gRPC']))}, "
        f"and gpu.ping() (client -> server -> client over gRPC, no worker) {us(ping)}"
    )
    ROWS.append(
        Row(
            "no-op s.call vs raw gRPC",
            ours,
            floor,
            "raw gRPC unary call, TLS",
            "<= 1.10x",
            ours <= 1.10 * floor,
        )
    )


def loopback_only(pid: int) -> str:
    """Say whether every socket of process ``pid`` listens on, or connects to, 127.0.0.1 only."""
    conns = psutil.Process(pid).net_connections(kind="inet")
    other = {
        f"{c.laddr.ip if c.status == psutil.CONN_LISTEN else c.raddr.ip}"
        for c in conns
        if (c.status == psutil.CONN_LISTEN and not c.laddr.ip.startswith(("127.", "::ffff:127.")))
        or (c.raddr and not c.raddr.ip.startswith(("127.", "::ffff:127.")))
    }
    return f"{len(conns)} sockets, " + ("all on 127.0.0.1" if not other else f"NOT loopback: {sorted(other)}")


def bench_ray(args: argparse.Namespace, gpu: gpuport.Client, server: _servers.Gpuport, work: Path) -> None:
    say(
        "== (a2) no-op call: s.call(noop) against a Ray actor call, ray.get(actor.noop.remote()); "
        f"{args.ray_calls:,} each"
    )
    figure = "no-op s.call vs Ray actor"
    if _peers.ray_cli() is None:
        say("  ray: not installed (pip install -e '.[bench]'): skipped")
        ROWS.append(Row(figure, None, None, "ray: not installed", "faster than Ray", None))
        return
    start = time.perf_counter()
    try:
        head = _peers.start_ray(work)
    except Exception as e:  # noqa: BLE001 - say why and go on: Ray is the peer, not the subject
        say(f"  ray {_peers.ray_version()}: could not start a head here: {str(e)[-1500:]}")
        ROWS.append(Row(figure, None, None, "ray: failed to start", "faster than Ray", None))
        return
    driver: Child | None = None
    try:
        say(f"  ray {_peers.ray_version()} head up in {time.perf_counter() - start:.1f}s (GCS {head.gcs_address})")
        driver = Child(["--child-ray", head.gcs_address], work / "ray-driver.log", env=head.env)
        ready = driver.ask()
        say(f"  driver connected, actor in pid {ready['actor_pid']}")
        with gpu.session() as s:
            track_worker(s, server)
            assert driver is not None
            calls = {"session": timed_block(lambda: s.call(noop)), "ray": lambda n: driver.ask(str(n))}
            blocks(3 * BLOCK, calls)  # warm-up
            t = blocks(args.ray_calls, calls)
        say(f"  Ray: {head.check_loopback()}")
        say(f"  Ray driver (pid {driver.process.pid}): {loopback_only(driver.process.pid)}")
    finally:
        if driver is not None:
            driver.stop()
        head.stop()
        left = _peers.alive_in_session(head.process.pid)
        if left:
            say(f"  WARNING: Ray processes still alive after stop: {left}")
    ours, ray_s = median(t["session"]), median(t["ray"])
    say(
        f"  s.call(noop) median {us(ours)}, Ray actor call median {us(ray_s)} "
        f"(p90 {us(sorted(t['ray'])[len(t['ray']) * 9 // 10])}); alternated in blocks of {BLOCK}, Ray's daemons running"
    )
    ROWS.append(Row(figure, ours, ray_s, f"ray {_peers.ray_version()} actor call", "faster than Ray", ours < ray_s))


# ---- (b) put and get -----------------------------------------------------------------------------------


def data_port_cipher(gpu: gpuport.Client, cert: Path) -> str:
    """The cipher a TLS client with Python's defaults negotiates with the server's data port (as the
    gpuport client does), or why it is not known. A bad ticket: the port answers E and closes."""
    port = gpu.transport.data_port  # from the server's Hello
    if not port:
        return "not announced (values go through gRPC)"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(cert))
    context.check_hostname = False
    with context.wrap_socket(socket.create_connection((_peers.LOOPBACK, port), timeout=10)) as sock:
        name, version, bits = sock.cipher() or ("?", "?", 0)
        sock.sendall(b"0" * 64 + b"\n")
        sock.recv(200)
    return f"{name} ({version}, {bits}-bit)"


def say_cpu(name: str, cpu: list[dict[str, float]], times: list[float], size: int) -> None:
    """The CPU seconds per GB each process spent on transfer ``name`` (medians), and its wall time."""
    spent = {k: median([c[k] for c in cpu]) for k in cpu[0]}
    mine = ("client", "raw peer") if name.startswith("raw") else ("client", "server", "worker")
    parts = ", ".join(f"{k} {spent[k] / (size / GB):.2f}" for k in mine)
    say(f"    CPU seconds per GB, {name}: {parts} (wall {median(times) / (size / GB):.2f} s/GB)")


def bench_transfer(args: argparse.Namespace, gpu: gpuport.Client, server: _servers.Gpuport) -> None:
    size = args.size_mib * MiB
    label = f"{size / GiB:g} GiB" if size >= GiB else f"{args.size_mib} MiB"
    say(f"== (b) s.put / s.get of a {label} float32 array against a raw TLS socket; best of {args.reps} each")
    array = np.random.default_rng(1).random(size // 4, dtype=np.float32)  # every page written
    data = memoryview(array.data).cast("B")
    back = np.empty(size, np.uint8)
    back.fill(1)  # the raw receive's preallocated buffer, its pages touched
    into = memoryview(back.data)
    cert_path, key_path = tls_files(server)
    raw = _servers.start_raw_tls(cert_path, key_path)
    try:
        say(
            f"  raw socket: Python {platform.python_version()} ssl, {raw.cipher}, "
            f"{_servers.TLS_CHUNK // MiB} MiB slices; "
            f"gpuport's data port: {data_port_cipher(gpu, cert_path)}"
        )
        with gpu.session() as s:
            worker_pid = track_worker(s, server)
            meter = CpuMeter(
                {
                    "client": lambda: [psutil.Process()],
                    "server": lambda: [psutil.Process(server.process.pid)],
                    "worker": lambda: tree(worker_pid),
                    "raw peer": lambda: [psutil.Process(raw.process.pid)],
                }
            )
            state: dict[str, Any] = {}
            cpu: dict[str, list[dict[str, float]]] = {
                k: []
                for k in ("put", "get", "put, kept", "raw send", "raw receive", "raw send, fresh", "raw receive, fresh")
            }

            def measure(name: str, fn: Callable[[], object], prep: Callable[[], object] = noop) -> Callable[[], float]:
                def run() -> float:
                    raw.settle()  # not timed: the raw peer frees what a fresh receive made
                    prep()
                    meter.start()
                    start = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - start
                    cpu[name].append(meter.stop())
                    return elapsed

                return run

            def drop_ref() -> None:  # the worker holds one copy at a time
                if "ref" in state:
                    s.delete(state.pop("ref"))

            def put() -> None:
                state["ref"] = s.put(array)

            def put_kept() -> None:  # every value kept: each one arrives in memory never touched before
                state.setdefault("kept", []).append(s.put(array))

            def drop_got() -> None:  # the last one's memory goes before this one's is taken
                state["got"] = None

            def get() -> None:
                state["got"] = s.get(state["ref"])

            def drop_fresh() -> None:
                state.pop("fresh", None)

            def fresh_receive() -> None:
                state["fresh"] = np.empty(size, np.uint8)  # its pages are made as the bytes arrive
                raw.receive(memoryview(state["fresh"].data))

            ops = {
                "put": measure("put", put, drop_ref),
                "raw send": measure("raw send", lambda: raw.send(data)),
                "get": measure("get", get, drop_got),
                "raw receive": measure("raw receive", lambda: raw.receive(into)),
                # Not anchors, but what they leave out: gpuport receives into memory made for the value.
                "raw send, fresh": measure("raw send, fresh", lambda: raw.send(data, fresh=True)),
                "put, kept": measure("put, kept", put_kept),
                "raw receive, fresh": measure("raw receive, fresh", fresh_receive, drop_fresh),
            }
            rotate(1, ops)  # warm-up, then check what came back
            got = state["got"]
            if not (isinstance(got, np.ndarray) and got.dtype == array.dtype and np.array_equal(got, array)):
                raise RuntimeError(
                    f"s.get gave back {type(got).__name__} {getattr(got, 'shape', '')}, not the array put"
                )
            if not np.array_equal(back[: 1 << 16], data[: 1 << 16]):
                raise RuntimeError("the raw TLS socket sent back other bytes")
            state["got"] = got = None
            for values in cpu.values():
                values.clear()
            t = rotate(args.reps, ops)
            ref = state.pop("ref")
            say(f"  in the worker: {ref.type} {ref.summary}, and {len(state.get('kept', []))} values kept")
            for kept in state.pop("kept", []):
                s.delete(kept)
            say(f"  gpuport server (pid {server.process.pid}, data port included): {loopback_only(server.process.pid)}")
            s.delete(ref)
            state.clear()
    finally:
        raw.stop()
    ours, anchor = size / min(t["put, kept"]) / MB, size / min(t["raw send, fresh"]) / MB
    say(
        f"  s.put, values kept (fresh memory in the worker each time) best {ours / 1e3:.2f} GB/s (median "
        f"{size / median(t['put, kept']) / GB:.2f}); raw TLS send into fresh memory (a new memfd) best "
        f"{anchor / 1e3:.2f} GB/s"
    )
    for name in ("put, kept", "raw send, fresh"):
        say_cpu(name, cpu[name], t[name], size)
    ROWS.append(
        Row(
            f"s.put {label} float32, values kept",
            ours,
            anchor,
            "raw TLS socket, send into fresh memory",
            ">= 0.8x",
            ours >= 0.8 * anchor,
            unit="MB/s",
        )
    )
    for ours_name, raw_name, goal_name in (("put", "raw send", "s.put"), ("get", "raw receive", "s.get")):
        ours, anchor = size / min(t[ours_name]) / MB, size / min(t[raw_name]) / MB
        fresh = size / min(t[f"{raw_name}, fresh"]) / GB
        say(
            f"  {goal_name} best {ours / 1e3:.2f} GB/s (median {size / median(t[ours_name]) / GB:.2f}); "
            f"raw TLS {raw_name.split()[1]} best {anchor / 1e3:.2f} GB/s "
            f"(median {size / median(t[raw_name]) / GB:.2f}); "
            f"the raw socket into fresh memory ({'a new memfd' if ours_name == 'put' else 'a new numpy array'}) "
            f"best {fresh:.2f} GB/s"
        )
        for name in (ours_name, raw_name, f"{raw_name}, fresh"):
            say_cpu(name, cpu[name], t[name], size)
        ROWS.append(
            Row(
                f"{goal_name} {label} float32",
                ours,
                anchor,
                f"raw TLS socket, {raw_name.split()[1]}",
                ">= 0.85x",
                ours >= 0.85 * anchor,
                unit="MB/s",
            )
        )


# ---- (c) Keras -----------------------------------------------------------------------------------------


def bench_keras(args: argparse.Namespace, gpu: gpuport.Client, server: _servers.Gpuport, work: Path) -> None:
    say(
        f"== (c) Keras MLP, {args.epochs} epochs on {KERAS_ROWS:,} x {KERAS_FEATURES} float32: locally in a child "
        f"process against s.call(fit_mlp, xref, yref) in a session; {args.fits} fits each"
    )
    x, y = keras_data()
    local: Child | None = None
    try:
        with gpu.session() as s:
            track_worker(s, server)
            remote = s.call(process_facts)  # before TensorFlow, which sets variables of its own (KMP_*)
            start = time.perf_counter()
            xref, yref = s.put(x), s.put(y)
            say(f"  data put in {ms(time.perf_counter() - start)}: {xref.summary}, {yref.summary}")
            start = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()) as noise:  # TensorFlow's start-up lines, relayed
                version = s.call(import_tensorflow)
            say(
                f"  TensorFlow {version} imported in the worker in {ms(time.perf_counter() - start)} (warm-up; "
                f"its {len(noise.getvalue().splitlines())} lines on stderr left out here, as the local child's are)"
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith(THREAD_ENV_PREFIXES)}
            env.update(remote["env"])  # the same thread settings as the worker (none, unless it got some)
            local = Child(["--child-keras"], work / "keras-child.log", env=env)
            start = time.perf_counter()
            ready = local.ask()
            say(
                f"  local child: TensorFlow {ready['tensorflow']} imported and data made in "
                f"{ms(time.perf_counter() - start)}"
            )
            mine = ready["facts"]
            for side, facts in (("worker", remote), ("local", mine)):
                say(
                    f"  {side}: pid {facts['pid']}, CPUs {facts['affinity']}, nice {facts['nice']}, "
                    f"thread settings {facts['env'] or 'none'}"
                )
            if mine["env"] != remote["env"] or mine["affinity"] != remote["affinity"]:
                say("  NOTE: the two sides differ in thread settings or CPUs (above)")
            losses: dict[str, list[float]] = {"session": [], "local": []}

            def in_session() -> float:
                start = time.perf_counter()
                losses["session"].append(s.call(fit_mlp, xref, yref, args.epochs, timeout=1800))
                return time.perf_counter() - start

            def in_child() -> float:
                assert local is not None
                answer = local.ask(f"fit {args.epochs}")
                losses["local"].append(answer["loss"])
                return float(answer["s"])

            t = rotate(args.fits, {"session": in_session, "local": in_child})
    finally:
        if local is not None:
            local.stop()
    ours, anchor = median(t["session"]), median(t["local"])
    say(
        f"  session median {ours:.2f}s (all: {', '.join(f'{v:.2f}' for v in t['session'])}), "
        f"local median {anchor:.2f}s (all: {', '.join(f'{v:.2f}' for v in t['local'])}); "
        f"final losses {losses['session'][-1]:.4f} / {losses['local'][-1]:.4f}"
    )
    ROWS.append(
        Row(
            f"Keras MLP fit, {args.epochs} epochs",
            ours,
            anchor,
            "same fit in a local child process",
            "<= 1.05x",
            ours <= 1.05 * anchor,
        )
    )


# ---- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 epochs, fewer calls and repeats")
    parser.add_argument("--calls", type=int, help="no-op calls of each kind against raw gRPC (default 2000)")
    parser.add_argument("--ray-calls", type=int, help="no-op calls of each kind against Ray (default 1000)")
    parser.add_argument("--size-mib", type=int, help="size of the put/get array in MiB (default 1024)")
    parser.add_argument("--reps", type=int, help="timed repetitions of each transfer (default 3)")
    parser.add_argument("--epochs", type=int, help="Keras epochs per fit (default 20)")
    parser.add_argument("--fits", type=int, help="Keras fits of each kind (default 5)")
    parser.add_argument("--skip", action="append", default=[], choices=["calls", "ray", "transfer", "keras"])
    args = parser.parse_args()
    defaults = {"calls": (2000, 300), "ray_calls": (1000, 300), "size_mib": (1024, 256), "reps": (3, 3)}
    defaults |= {"epochs": (20, 3), "fits": (5, 2)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if not hasattr(gpuport.Client, "session"):
        raise SystemExit(f"gpuport {gpuport.__version__} has no sessions (Client.session): nothing to measure")

    ray = f"ray {_peers.ray_version()}" if _peers.ray_cli() else "no ray"
    banner(f"grpcio {grpc.__version__}, {ray}", args.quick)
    with isolated_workdir() as work:
        try:
            with gpuport_server(work, "server") as server, tracked(server), connect(server) as gpu:
                if "calls" not in args.skip:
                    bench_calls(args, gpu, server)
                if "transfer" not in args.skip:
                    bench_transfer(args, gpu, server)
                if "keras" not in args.skip:
                    bench_keras(args, gpu, server, work)
                if "ray" not in args.skip:
                    bench_ray(args, gpu, server, work)
        finally:
            check_left()
    say("load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print_table(
        ("no-op s.call vs raw", "no-op s.call vs Ray", "s.put", "s.get", "Keras"),  # the brief's order
        width=30,
        legend="ratio: gpuport / anchor (times: lower is better; MB/s: higher is better)",
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-keras"]:
        _child_keras()
    elif sys.argv[1:2] == ["--child-ray"]:
        _child_ray(sys.argv[2])
    else:
        main()
