"""Model serving with dynamic batching against without, on one gpuport server on 127.0.0.1.

    .venv/bin/python bench/bench_serving.py            # 3 rounds of 5 s per model: about 4 minutes on 2 cores
    .venv/bin/python bench/bench_serving.py --quick    # 1 round of 3 s per model: about a minute

The model: a Keras MLP, Input(784) -> Dense(256, relu) -> Dense(256, relu) -> Dense(10), weights
seeded (not trained: training changes no timing), saved as a .keras file in the temp dir by a child
process, which also times the model alone: `predict_on_batch` of 1, 16 and 64 rows, median of 300
after 50 warm-ups, on this machine while nothing else of the bench runs.

The server: a fresh `gpuport server` (temp state dir, TLS on, 127.0.0.1, port 0), with the model
deployed twice by `gpu.deploy(name, path)`, one replica each, on the CPU: "mlp-batched" with
max_batch_size 64 and max_queue_delay 2 ms (--delay), and "mlp-single" with max_batch_size 0 (each
request goes to the worker alone). The server runs through a launcher in this
file (`--child-server`) that changes nothing in it but keeps a reference to each `Batcher` it makes
and writes their `stats` (batches, requests, rows) to a file on SIGUSR2: the mean batch size the
server formed is read from there, as the counters' difference over the measured window.

Why 2 ms: it is gpuport's default (what a user gets), and near the model's own time for a full
batch (1.3-1.5 ms for 64 rows), as Triton advises. With 16 callers and max_batch_size 64 no batch
ever fills, so every batch waits out the delay from its oldest request: the delay trades latency for
batch size. Swept once with --quick over gRPC (with the callers as threads, see below): 0.5 ms gave
batches of 2.0 rows and 1.2x; 2 ms 4.3 rows and 1.8x; 5 ms 7.7 rows and 2.1x; 10 ms 15 rows and 2.2x
with p50 up from 16 to 20 ms. Over HTTP with the callers as greenlets, --quick: 0 ms 5.5 rows and
2.2x, 1 ms 6.5 rows and 2.4x, 2 ms 8.7 rows and 2.3x, 5 ms 15.8 rows and 2.6x; runs of the same
settings differ by as much. --max-batch-size 16 (the callers' number) with a delay of 10 ms makes
every batch full: it goes as soon as the last caller's request is in, 15.9 rows and 2.6x.

The load: 16 callers (--callers), each with a tritonclient client of its own (its own connection),
each sending 1-row requests (784 float32, the same seeded row) back to back, a closed loop: KServe
v2 over HTTPS with `tritonclient.http` (inputs and outputs as binary data, the extension tritonclient
uses by default for numpy), then over gRPC with `tritonclient.grpc` (`raw_input_contents`; each client
on its own channel and connection). Both trust the server's certificate (`STATE_DIR/tls/cert.pem`)
and send the admin token as `Authorization: Bearer`. Every caller first makes one request (its
connection and TLS handshake), then all warm up for W s (--warmup, 2 s; 1 s with --quick) and are
measured for D s (--duration, 5 s; 3 s with --quick): throughput is the requests that completed in
the window over its length, latency is each of those requests' time from `infer()` called to the
numpy result in hand, in the caller. Per protocol, R rounds (--rounds, 3; 1 with --quick) each
measure both models, unbatched first in odd rounds and batched first in even ones: a model's
throughput is the median of its rounds', its p50 and p99 are over all callers' requests of all its
rounds. On this VM two runs of the same code differed by up to 30% in throughput (the machine has
slow spells: the model alone then takes 0.6 ms instead of 0.5); rounds in turns put both models
into the same spells. Before them, one caller alone sends 50 requests to mlp-single (after 5
unmeasured), whose median and fastest latency show what a request costs without any queue.

The callers run in processes of bench/_callers.py, 16 split evenly among them: over HTTP as gevent
greenlets in 2 processes (--http-callers greenlets:2), over gRPC as threads of 1 process
(--grpc-callers threads:1). tritonclient.http is built on gevent (its own async_infer is a gevent
pool), and as greenlets its callers cost far less: against the ceiling's server below, 16 threads
in one process reached 1,900-2,300 req/s at 0.47 ms of caller CPU a request, with that process at
one core, its GIL the bottleneck (the figures of earlier versions of this bench, which ran the
callers that way, measured the callers as much as the server); 16 greenlets in one process 4,100
req/s at 0.24 ms, in 2 processes 4,800-5,500 req/s at 0.26-0.29 ms, in 4 processes 4,900 at 0.30.
tritonclient.grpc does its I/O in grpc's C core, outside the GIL: 16 threads in one process reached
2,900 req/s at 0.29 ms, in 2 or 4 processes 2,450 at 0.36 ms, greenlets (grpc's gevent mode) in 2
processes 2,400 at 0.45 ms. KIND:PROCESSES, KIND greenlets or threads, picks another way.
On 2 cores the callers' CPU competes with the server's: the CPU seconds (user + system) of the server
process, of the model's worker process (the replica's job) and of the callers over the window are
printed per request, with the ceiling they set (cores / CPU per request), and the rest of the
machine's busy time ("other work": another program, or the hypervisor's steal) beside them.

The ceiling: after both models, per protocol, the same callers run the same way against a server
that answers every request at once with a canned result (`--child-ceiling`: uvicorn with httptools
and uvloop, and grpc.aio, as gpuport serves, TLS with the server's own certificate; no model, no
batching, no token check). Its throughput over the unbatched one is the most that batching could
show on this machine: no server that does any work per request can beat it, since the callers'
own CPU and the protocols' do not shrink with batching. --skip-ceiling leaves it out.

The figures, each against its anchor measured in the same run: "throughput, batched vs unbatched"
(requests/s of mlp-batched against mlp-single; goal >= 3x, Triton publishes 3.3x for its dynamic
batcher) and "p99/p50, batched" (p99 latency of mlp-batched against its p50; goal <= 2x).

Everything runs on 127.0.0.1 in a temp dir removed at the end. Caller processes are stopped by their
pids in `finally`; the two deployments are undeployed before the server stops, and any process the
server started that is still alive after that (a model worker, its supervisor) is named and killed by
its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
import _servers  # noqa: E402
import bench_sessions  # noqa: E402 - its process helpers: Child, CpuMeter, tree, track, check_left
from _callers import CLASSES, FEATURES, KINDS, SEED, Target, make_infer  # noqa: E402
from _report import ROWS, Row, banner, connect, isolated_workdir, print_table, say  # noqa: E402

import gpuport  # noqa: E402

HIDDEN = 256
MAX_BATCH = 64  # mlp-batched's max_batch_size by default
MODEL_BATCHES = (1, 16, 64)  # batch sizes the model alone is timed at
BATCHED, SINGLE = "mlp-batched", "mlp-single"
PROTOCOLS = {"http": "tritonclient.http", "grpc": "tritonclient.grpc"}
STATS_SIGNAL = signal.SIGUSR2  # the launcher writes the batchers' counters when it gets this
CALLERS = Path(__file__).with_name("_callers.py")
DEFAULT_CALLERS_IN = {"http": "greenlets:2", "grpc": "threads:1"}


@dataclass(frozen=True)
class CallersIn:
    """How the callers run: as ``kind`` (greenlets or threads) in ``processes`` processes."""

    kind: str
    processes: int

    @classmethod
    def parse(cls, text: str) -> CallersIn:
        kind, _, count = text.partition(":")
        if kind not in KINDS or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected KIND:PROCESSES, KIND one of {', '.join(KINDS)}, e.g. greenlets:2"
            )
        return cls(kind, int(count))

    def __str__(self) -> str:
        return f"{self.kind} in {self.processes} process{'es' if self.processes > 1 else ''}"


# ---- children: the model, the server's launcher, a caller -------------------------------------------


def _child_model(folder: str) -> None:
    """`bench_serving.py --child-model DIR`: build and save the MLP as DIR/mlp.keras, time
    predict_on_batch at each of MODEL_BATCHES rows, print one JSON line."""
    import keras

    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,), name="x"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    path = Path(folder) / "mlp.keras"
    model.save(path)
    rng = np.random.default_rng(SEED)
    times = {}
    for rows in MODEL_BATCHES:
        x = rng.random((rows, FEATURES), dtype=np.float32)
        for _ in range(50):
            model.predict_on_batch(x)
        spent = []
        for _ in range(300):
            start = time.perf_counter()
            model.predict_on_batch(x)
            spent.append(time.perf_counter() - start)
        times[rows] = float(np.median(spent))
    print(json.dumps({"path": str(path), "keras": keras.__version__, "predict": times}), flush=True)


def _child_server(stats_file: str, argv: list[str]) -> None:
    """`bench_serving.py --child-server STATS_FILE ARGS...`: `gpuport ARGS...` as `python -m gpuport`
    runs it, with every Batcher it makes remembered and their counters written to STATS_FILE (as JSON,
    by model name, through a temporary file renamed into place) on STATS_SIGNAL."""
    from gpuport.server.serving.batcher import Batcher

    made: list[tuple[str, Batcher]] = []
    original = Batcher.__init__

    def remember(self: Batcher, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append((str(kwargs.get("name", "")), self))

    def write(signum: int, frame: object) -> None:
        counters = {name: vars(batcher.stats) for name, batcher in made}
        tmp = stats_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(counters, f)
        os.replace(tmp, stats_file)

    Batcher.__init__ = remember  # type: ignore[method-assign]
    signal.signal(STATS_SIGNAL, write)
    sys.argv = ["gpuport", *argv]
    from gpuport.cli.main import main

    main()


def _child_ceiling(tls_dir: str, output: str) -> None:
    """`bench_serving.py --child-ceiling TLS_DIR OUTPUT`: a server that answers every KServe v2 infer
    at once with the same canned result (1 x CLASSES float32 zeros as output OUTPUT, binary over HTTP,
    raw_output_contents over gRPC), reading each request but doing nothing with it: no model, no
    batching, no token check. Served the way gpuport serves: uvicorn (httptools, uvloop) and grpc.aio,
    TLS with the certificate and key in TLS_DIR, on 127.0.0.1, ports picked by the kernel and printed
    as one JSON line. What the callers reach against it is the ceiling this machine puts on any such
    server. Ends on SIGTERM."""
    import socket

    import grpc
    import uvicorn

    from gpuport.cli.main import run_loop
    from gpuport.protocol.serving import KSERVE_SERVICE, kserve

    y = np.zeros((1, CLASSES), np.float32)
    described = {"name": output, "datatype": "FP32", "shape": list(y.shape)}
    head = json.dumps(
        {
            "model_name": "ceiling",
            "model_version": "1",
            "outputs": [{**described, "parameters": {"binary_data_size": y.nbytes}}],
        }
    ).encode()
    answer = head + y.tobytes()
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(len(answer)).encode()),
        (b"inference-header-content-length", str(len(head)).encode()),
    ]

    async def http(scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    reply = kserve.ModelInferResponse(
        model_name="ceiling",
        model_version="1",
        outputs=[kserve.ModelInferResponse.InferOutputTensor(**described)],
        raw_output_contents=[y.tobytes()],
    ).SerializeToString()

    async def infer(request: bytes, context: Any) -> bytes:
        return reply

    async def main() -> None:
        folder = Path(tls_dir)
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(infer)  # no (de)serializers: bytes in, bytes out
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(KSERVE_SERVICE, {"ModelInfer": handler}),)
        )
        key, cert = (folder / "key.pem").read_bytes(), (folder / "cert.pem").read_bytes()
        grpc_port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
        await server.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            http,
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
            proxy_headers=False,
            ssl_certfile=str(folder / "cert.pem"),
            ssl_keyfile=str(folder / "key.pem"),
        )
        print(json.dumps({"http": sock.getsockname()[1], "grpc": grpc_port}), flush=True)
        await uvicorn.Server(config).serve(sockets=[sock])  # until SIGTERM
        await server.stop(None)

    run_loop(main())


# ---- the callers --------------------------------------------------------------------------------


class Callers:
    """``n`` callers of ``target`` in ``processes`` processes of bench/_callers.py, as ``kind``
    (greenlets or threads), spread evenly: ``start()`` has each make its client and one request,
    ``go(start_at, stop_at)`` starts their loops, ``results()`` waits for them. ``processes()`` are
    what their CPU is counted on."""

    def __init__(self, n: int, target: Target, how: CallersIn, work: Path) -> None:
        self.n, self.target, self.how, self.work = n, target, how, work
        self.children: list[bench_sessions.Child] = []

    def processes(self) -> list[psutil.Process]:
        found = []
        for child in self.children:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(child.process.pid))
        return found

    def start(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        k = min(self.how.processes, self.n)
        for i in range(k):  # all start at once, then each answers
            child = bench_sessions.Child([self.how.kind], self.work / f"callers-{i}.log", script=str(CALLERS))
            self.children.append(child)
            child.tell(json.dumps({"target": vars(self.target), "count": self.n // k + (i < self.n % k)}))
        for i, child in enumerate(self.children):
            answer = child.ask(timeout=max(0.0, deadline - time.monotonic()))
            if "ready" not in answer:
                raise RuntimeError(f"caller process {i} (pid {child.process.pid}) could not reach the server: {answer}")

    def go(self, start_at: float, stop_at: float) -> None:
        for child in self.children:
            child.tell(f"{start_at!r} {stop_at!r}")

    def results(self, deadline: float) -> list[dict[str, Any]]:
        return [child.ask(timeout=max(0.0, deadline - time.monotonic())) for child in self.children]

    def stop(self) -> None:
        for child in self.children:
            child.stop()


# ---- the server ----------------------------------------------------------------------------------


@dataclass
class Server:
    gpuport: _servers.Gpuport
    http_address: str  # 127.0.0.1:PORT
    grpc_address: str
    stats_file: Path

    def batcher_stats(self, timeout: float = 10) -> dict[str, dict[str, float]]:
        """The server's batchers' counters now, by model name (see _child_server)."""
        self.stats_file.unlink(missing_ok=True)
        os.kill(self.gpuport.process.pid, STATS_SIGNAL)
        deadline = time.monotonic() + timeout
        while not self.stats_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server wrote no batcher counters in {timeout:g}s")
            time.sleep(0.002)
        return dict(json.loads(self.stats_file.read_text()))


def start_server(work: Path) -> Server:
    """A gpuport server as _servers.start_gpuport starts it (fake GPUs, loopback, port 0, a fresh state
    dir), through the launcher above."""
    folder = work / "server"
    folder.mkdir()
    stats = folder / "batchers.json"
    served = _servers.start_gpuport(folder, launcher=[sys.executable, __file__, "--child-server", str(stats)])
    return Server(served, host_port(served.http_url), host_port(served.url), stats)


def host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


@contextlib.contextmanager
def running_server(work: Path) -> Iterator[Server]:
    server = start_server(work)
    try:
        yield server
    finally:
        for p in bench_sessions.tree(server.gpuport.process.pid)[1:]:
            bench_sessions._STARTED[p.pid] = p  # checked by check_left once the server has stopped
        try:
            server.gpuport.stop()
        finally:
            if server.gpuport.process.poll() is None:
                server.gpuport.process.kill()
                server.gpuport.process.wait(timeout=10)


@dataclass
class Ceiling:
    """The ceiling's server (see _child_ceiling): its process and its ports by protocol."""

    process: psutil.Process
    ports: dict[str, int]


@contextlib.contextmanager
def running_ceiling(tls_dir: Path, output: str, work: Path) -> Iterator[Ceiling]:
    with open(work / "ceiling.log", "wb") as err:
        child = subprocess.Popen(
            [sys.executable, __file__, "--child-ceiling", str(tls_dir), output],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60)
        line = child.stdout.readline() if ready else ""
        if not line:
            tail = (work / "ceiling.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the ceiling's server (pid {child.pid}) did not start:\n{tail}")
        yield Ceiling(psutil.Process(child.pid), dict(json.loads(line)))
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)


def worker_of(server: Server, deployment_id: str) -> psutil.Process:
    """The model worker process of deployment ``deployment_id`` (its one replica), tracked."""
    for p in bench_sessions.tree(server.gpuport.process.pid):
        with contextlib.suppress(psutil.Error):
            if "gpuport.server.worker.model" in " ".join(p.cmdline()) and deployment_id in p.environ().get(
                "GPUPORT_MODEL_DIR", ""
            ):
                bench_sessions.track(p.pid, server.gpuport.process.pid)
                return p
    raise RuntimeError(f"no model worker of deployment {deployment_id} below the server")


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent on anything but idling, all cores together, since boot."""
    t = psutil.cpu_times()._asdict()
    # guest and guest_nice are counted in user and nice already; steal is busy: the hypervisor's other work
    return sum(t.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


# ---- one measurement -----------------------------------------------------------------------------


@dataclass
class Measured:
    model: str
    protocol: str
    requests: int
    errors: int
    first_error: str
    seconds: float
    p50: float
    p90: float
    p99: float
    worst: float
    cpu: dict[str, float]  # CPU seconds over the window: server, worker, callers, others (the rest of the machine)
    batches: int | None  # formed by the server's batcher over the window
    rows: int | None
    latencies: np.ndarray  # of every request that ended in the window, sorted

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    @property
    def mean_batch(self) -> float | None:
        return self.rows / self.batches if self.batches and self.rows is not None else None


def measure(
    args: argparse.Namespace,
    how: CallersIn,
    target: Target,
    server: psutil.Process,
    worker: psutil.Process | None,
    stats: Callable[[], dict[str, dict[str, float]]] | None,
    work: Path,
) -> Measured:
    """``args.callers`` callers of ``target``, run as ``how`` says, over a warm-up and a measured
    window: their latencies, the CPU seconds of ``server``, ``worker`` (None: none) and the callers,
    and the batches formed (from ``stats``: Server.batcher_stats, None where there is no batcher)."""
    callers = Callers(args.callers, target, how, work)
    meter = bench_sessions.CpuMeter(
        {"server": lambda: [server], "worker": lambda: [worker] if worker else [], "callers": callers.processes}
    )
    try:
        callers.start()
        start_at = time.monotonic() + args.warmup
        stop_at = start_at + args.duration
        callers.go(start_at, stop_at)
        time.sleep(max(0.0, start_at - time.monotonic()))
        meter.start()
        machine = busy_seconds()
        before = stats().get(target.model) if stats else None
        time.sleep(max(0.0, stop_at - time.monotonic()))
        cpu = meter.stop()
        cpu["others"] = max(0.0, busy_seconds() - machine - sum(cpu.values()))
        after = stats().get(target.model) if stats else None
        results = callers.results(stop_at + 60)
    finally:
        callers.stop()
    latencies = np.array(sorted(t for r in results for t in r["latencies"]))
    if not len(latencies):
        raise RuntimeError(f"{target.model} over {target.protocol}: no request succeeded: {results[0]['first_error']}")
    batches = rows = None
    if before is not None and after is not None:
        batches, rows = int(after["batches"] - before["batches"]), int(after["rows"] - before["rows"])
    return Measured(
        model=target.model,
        protocol=target.protocol,
        requests=len(latencies),
        errors=sum(r["errors"] for r in results),
        first_error=next((r["first_error"] for r in results if r["first_error"]), ""),
        seconds=stop_at - start_at,
        p50=float(np.percentile(latencies, 50)),
        p90=float(np.percentile(latencies, 90)),
        p99=float(np.percentile(latencies, 99)),
        worst=float(latencies[-1]),
        cpu=cpu,
        batches=batches,
        rows=rows,
        latencies=latencies,
    )


@dataclass
class Summary:
    """A model's rounds together: the median of their throughputs, latencies over all their requests."""

    throughputs: list[float]
    p50: float
    p99: float

    @property
    def throughput(self) -> float:
        return float(np.median(self.throughputs))

    @classmethod
    def of(cls, rounds: list[Measured]) -> Summary:
        latencies = np.concatenate([m.latencies for m in rounds])
        return cls(
            [m.throughput for m in rounds], float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))
        )


def show(m: Measured, cores: int, how: CallersIn) -> None:
    per = {k: v / m.requests * 1e3 for k, v in m.cpu.items()}
    total = per["server"] + per["worker"] + per["callers"]
    ours = m.cpu["server"] + m.cpu["worker"] + m.cpu["callers"]
    batch = f"{m.mean_batch:.1f} rows ({m.batches:,} batches)" if m.mean_batch is not None else "-"
    say(
        f"  {m.model:<12} {m.throughput:7.0f} req/s   p50 {m.p50 * 1e3:6.2f} ms  p90 {m.p90 * 1e3:6.2f} ms  "
        f"p99 {m.p99 * 1e3:6.2f} ms  max {m.worst * 1e3:6.1f} ms   mean batch {batch}"
        + (f"   {m.errors} ERRORS, first: {m.first_error}" if m.errors else "")
    )
    say(
        f"  {'':<12} CPU ms per request: server {per['server']:.3f}, worker {per['worker']:.3f}, "
        f"callers {per['callers']:.3f}; total {total:.3f} -> at most {cores / total * 1e3:.0f} req/s on "
        f"{cores} cores; busy: this bench {ours / m.seconds / cores:.0%} of the cores, other work "
        f"{m.cpu['others'] / m.seconds / cores:.0%}"
        + f"; the callers' processes {m.cpu['callers'] / m.seconds / how.processes:.0%} of a core each"
    )


def bench_protocol(
    args: argparse.Namespace,
    server: Server,
    ceiling: Ceiling | None,
    protocol: str,
    infos: dict[str, Any],
    workers: dict[str, Any],
    work: Path,
) -> None:
    address = server.http_address if protocol == "http" else server.grpc_address
    how: CallersIn = getattr(args, f"{protocol}_callers")
    say(
        f"== {PROTOCOLS[protocol]}: {args.callers} callers ({how}), 1-row requests in a closed loop, "
        f"{args.rounds} round(s) of {args.warmup:g} s warm-up and {args.duration:g} s measured per model"
    )
    cert = str(server.gpuport.state_dir / "tls" / "cert.pem")

    def target(model: str) -> Target:
        info = infos[model]
        return Target(protocol, address, cert, server.gpuport.token, model, info.inputs[0].name, info.outputs[0].name)

    alone = make_infer(target(SINGLE))
    for _ in range(5):
        alone()
    times = []
    for _ in range(50):
        start = time.perf_counter()
        alone()
        times.append(time.perf_counter() - start)
    say(f"  one caller alone, {SINGLE}: median {np.median(times) * 1e3:.2f} ms, fastest {min(times) * 1e3:.2f} ms")
    found: dict[str, list[Measured]] = {SINGLE: [], BATCHED: []}
    process = psutil.Process(server.gpuport.process.pid)
    for i in range(args.rounds):
        if args.rounds > 1:
            say(f"  round {i + 1} of {args.rounds}:")
        for model in (SINGLE, BATCHED) if i % 2 == 0 else (BATCHED, SINGLE):  # each goes first in turn
            m = measure(args, how, target(model), process, workers[model], server.batcher_stats, work)
            found[model].append(m)
            show(m, os.cpu_count() or 1, how)
    batched, single = Summary.of(found[BATCHED]), Summary.of(found[SINGLE])
    label = "HTTP" if protocol == "http" else "gRPC"
    ratio = batched.throughput / single.throughput
    if args.rounds > 1:
        for model, summary in ((SINGLE, single), (BATCHED, batched)):
            rounds = ", ".join(f"{t:.0f}" for t in summary.throughputs)
            say(
                f"  {model:<12} median {summary.throughput:7.0f} req/s (rounds: {rounds}); over all rounds "
                f"p50 {summary.p50 * 1e3:.2f} ms, p99 {summary.p99 * 1e3:.2f} ms"
            )
    say(f"  batched / unbatched throughput {ratio:.2f}x; batched p99 / p50 {batched.p99 / batched.p50:.2f}x")
    if ceiling is not None:
        address = f"127.0.0.1:{ceiling.ports[protocol]}"
        unmodelled = dataclasses.replace(target(SINGLE), address=address, model="ceiling")
        m = measure(args, how, unmodelled, ceiling.process, None, None, work)
        show(m, os.cpu_count() or 1, how)
        say(
            f"  the ceiling: these callers against a server that answers at once, {m.throughput:.0f} req/s, "
            f"{m.throughput / single.throughput:.2f}x the unbatched throughput: no server that works per request "
            "could beat it on this machine"
        )
        ROWS.append(
            Row(
                f"ceiling: a server that answers at once ({label})",
                m.throughput,
                single.throughput,
                "unbatched, as above",
                "(what this machine allows)",
                None,
                unit="jobs/s",
            )
        )
    ROWS.append(
        Row(
            f"throughput, batched vs unbatched ({label})",
            batched.throughput,
            single.throughput,
            "same model, max_batch_size 0",
            ">= 3x (Triton: 3.3x)",
            ratio >= 3,
            unit="jobs/s",
        )
    )
    ROWS.append(
        Row(
            f"p99/p50, batched ({label})",
            batched.p99,
            batched.p50,
            "its own p50",
            "<= 2x",
            batched.p99 <= 2 * batched.p50,
        )
    )


# ---- main ----------------------------------------------------------------------------------------


def build_model(work: Path) -> dict[str, Any]:
    """Build, save and time the model in a child process (TensorFlow stays out of this one)."""
    result = subprocess.run(
        [sys.executable, __file__, "--child-model", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"building the model failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, 3 s measured per model, 1 s warm-up")
    parser.add_argument("--duration", type=float, help="seconds measured per model and round (default 5)")
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds per protocol, each measuring both models, in turns (default 3; 1 with --quick)",
    )
    parser.add_argument("--warmup", type=float, help="seconds of warm-up before each (default 2)")
    parser.add_argument("--callers", type=int, default=16, help="concurrent callers (default 16)")
    for protocol, default in DEFAULT_CALLERS_IN.items():
        parser.add_argument(
            f"--{protocol}-callers",
            type=CallersIn.parse,
            default=CallersIn.parse(default),
            metavar="KIND:PROCESSES",
            help=f"how the {PROTOCOLS[protocol]} callers run: greenlets or threads, in how many processes "
            f"(default {default})",
        )
    parser.add_argument("--delay", type=float, default=0.002, help="mlp-batched's max_queue_delay, s (default 0.002)")
    parser.add_argument(
        "--max-batch-size", type=int, default=MAX_BATCH, help=f"mlp-batched's max_batch_size (default {MAX_BATCH})"
    )
    parser.add_argument("--protocols", default="http,grpc", help="of http, grpc (default both)")
    parser.add_argument(
        "--skip-ceiling", action="store_true", help="leave out the ceiling (the callers against a server doing nothing)"
    )
    parser.add_argument(
        "--cpus",
        type=float,
        default=0.0,
        help="CPUs reserved per replica, which also sets its OMP_NUM_THREADS (default 0: the framework's own "
        "threads; on a many-core machine PyTorch's then spin on every core)",
    )
    args = parser.parse_args()
    if args.duration is None:
        args.duration = 3.0 if args.quick else 5.0
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.warmup is None:
        args.warmup = 1.0 if args.quick else 2.0
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise SystemExit(f"--protocols: {', '.join(unknown) or 'none'} unknown; valid: {', '.join(PROTOCOLS)}")

    import importlib.util
    from importlib.metadata import version

    missing = [m for m in ("tritonclient", "geventhttpclient", "keras") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"this bench needs {', '.join(missing)}: `make .venv/.dev` installs them (Keras via the tf extra)"
        )
    banner(f"tritonclient {version('tritonclient')}", args.quick)
    with isolated_workdir() as work:
        built = build_model(work)
        path = Path(built["path"])
        predict = {int(k): v for k, v in built["predict"].items()}
        say(
            f"== the model alone (Keras {built['keras']}, {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}): predict_on_batch "
            + ", ".join(f"{rows} rows {t * 1e3:.2f} ms ({t / rows * 1e6:.0f} us a row)" for rows, t in predict.items())
        )
        try:
            with running_server(work) as server, connect(server.gpuport) as gpu:
                start = time.perf_counter()
                infos = {
                    BATCHED: gpu.deploy(
                        BATCHED, path, max_batch_size=args.max_batch_size, max_queue_delay=args.delay, cpus=args.cpus
                    ),
                    SINGLE: gpu.deploy(SINGLE, path, max_batch_size=0, cpus=args.cpus),
                }
                workers = {name: worker_of(server, info.id) for name, info in infos.items()}
                say(
                    f"  deployed {BATCHED} (max_batch_size {args.max_batch_size}, max_queue_delay "
                    f"{args.delay * 1e3:g} ms) and {SINGLE} (max_batch_size 0) in {time.perf_counter() - start:.1f}s; "
                    "workers " + ", ".join(f"{name} pid {w.pid}" for name, w in workers.items())
                )
                try:
                    with contextlib.ExitStack() as stack:
                        ceiling = None
                        if not args.skip_ceiling:
                            tls = server.gpuport.state_dir / "tls"
                            ceiling = stack.enter_context(running_ceiling(tls, infos[SINGLE].outputs[0].name, work))
                        for protocol in protocols:
                            bench_protocol(args, server, ceiling, protocol, infos, workers, work)
                finally:
                    for name in infos:
                        with contextlib.suppress(gpuport.GpuportError):
                            gpu.undeploy(name)
                    psutil.wait_procs(list(workers.values()), timeout=20)
        finally:
            bench_sessions.check_left()
    say("load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print_table(
        (
            "throughput, batched vs unbatched (HTTP)",
            "p99/p50, batched (HTTP)",
            "ceiling: a server that answers at once (HTTP)",
            "throughput",
            "p99/p50",
            "ceiling",
        ),
        width=46,
        legend="ratio: gpuport / anchor (throughput: higher is better; p99/p50: lower is better; ceiling: the most "
        "a server doing any work could reach over unbatched)",
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-model"]:
        _child_model(sys.argv[2])
    elif sys.argv[1:2] == ["--child-server"]:
        _child_server(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["--child-ceiling"]:
        _child_ceiling(sys.argv[2], sys.argv[3])
    else:
        main()
