"""The serving bench's callers: tritonclient clients sending 1-row requests back to back.

    python bench/_callers.py KIND     # KIND: greenlets or threads

One process of callers. It reads one JSON line, ``{"target": {...Target...}, "count": N}``, makes N
callers (gevent greenlets, or threads), each with a client and a connection of its own, has each make
one request, and answers ``{"ready": PID}``. It then reads "START STOP" (``time.monotonic()`` times,
the same clock in every process of the bench) and answers, once every caller is done, one JSON line:
the latencies of the requests that ended inside that window, the errors, and the first error's text.

Greenlets are how tritonclient.http is meant to run many requests at once: it is built on gevent
(geventhttpclient; its own ``async_infer`` is a gevent pool). For them this module patches the
standard library with gevent's before it imports anything else, so that TLS and the sockets wait on
gevent's loop rather than block the process; tritonclient.grpc then needs grpc's gevent mode, which
is set up too. Threads, on the other hand, suit tritonclient.grpc, whose C core does the I/O outside
the GIL.

bench_serving.py imports this file too (Target, make_infer and the constants), unpatched.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["greenlets"]:
    from gevent import monkey

    monkey.patch_all()  # before anything imports socket, ssl or threading

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

FEATURES, CLASSES, SEED = 784, 10, 0
KINDS = ("greenlets", "threads")


@dataclass
class Target:
    """What a caller needs to reach a model."""

    protocol: str  # http or grpc
    address: str  # 127.0.0.1:PORT, HTTP or gRPC as ``protocol`` says
    cert: str
    token: str
    model: str
    input: str
    output: str


def make_infer(target: Target) -> Callable[[], None]:
    """A new tritonclient client (its own connection) for ``target``, and a function that sends one
    1-row request with it and checks the result."""
    x = np.random.default_rng(SEED).random((1, FEATURES), dtype=np.float32)
    headers = {"authorization": f"Bearer {target.token}"}  # lower case: gRPC metadata keys must be
    if target.protocol == "http":
        import tritonclient.http as triton_http

        client: Any = triton_http.InferenceServerClient(
            target.address,
            ssl=True,
            ssl_options={"ca_certs": target.cert},  # geventhttpclient hands it to the default context's factory
            concurrency=1,
        )
        inputs: list[Any] = [triton_http.InferInput(target.input, [1, FEATURES], "FP32")]
        inputs[0].set_data_from_numpy(x, binary_data=True)
        outputs: list[Any] = [triton_http.InferRequestedOutput(target.output, binary_data=True)]
    else:
        import tritonclient.grpc as triton_grpc

        client = triton_grpc.InferenceServerClient(
            target.address,
            ssl=True,
            root_certificates=target.cert,
            channel_args=[("grpc.use_local_subchannel_pool", 1)],  # a connection of its own, not a shared one
        )
        inputs = [triton_grpc.InferInput(target.input, [1, FEATURES], "FP32")]
        inputs[0].set_data_from_numpy(x)
        outputs = [triton_grpc.InferRequestedOutput(target.output)]

    def infer() -> None:
        result = client.infer(target.model, inputs, outputs=outputs, headers=headers)
        y = result.as_numpy(target.output)
        if y is None or y.shape != (1, CLASSES):
            raise RuntimeError(f"{target.model} answered {None if y is None else y.shape}, not (1, {CLASSES})")

    return infer


def call_loop(infer: Callable[[], None], window: tuple[float, float]) -> dict[str, Any]:
    """Send requests back to back until the window (START, STOP) ends; return the latencies of those
    that ended inside it, the errors, and the first error's text. Requests before START are the
    warm-up."""
    start_at, stop_at = window
    latencies: list[float] = []
    errors, first_error = 0, ""
    while True:
        begin = time.monotonic()
        if begin >= stop_at:
            break
        try:
            infer()
        except Exception as e:  # noqa: BLE001 - counted and shown: a failed request is a finding
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"[:500]
            time.sleep(0.01)  # no tight loop of failures
            continue
        end = time.monotonic()
        if start_at <= end <= stop_at:
            latencies.append(end - begin)
    return {"latencies": latencies, "errors": errors, "first_error": first_error}


def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "latencies": [t for r in results for t in r["latencies"]],
        "errors": sum(r["errors"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), ""),
    }


def main(kind: str) -> None:
    order = json.loads(sys.stdin.readline())
    target, count = Target(**order["target"]), int(order["count"])
    if kind == "greenlets" and target.protocol == "grpc":
        import grpc.experimental.gevent as grpc_gevent

        grpc_gevent.init_gevent()
    infers: list[Callable[[], None] | None] = [None] * count
    errors: list[str] = []

    def connect(i: int) -> None:
        try:
            infers[i] = make_infer(target)
            infers[i]()  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - answered below, then this process ends
            errors.append(f"{type(e).__name__}: {e}"[:500])

    def all_of(work: Callable[[int], Any]) -> None:
        if kind == "greenlets":
            import gevent

            gevent.joinall([gevent.spawn(work, i) for i in range(count)], raise_error=True)
        else:
            threads = [threading.Thread(target=work, args=(i,), name=f"caller {i}") for i in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    all_of(connect)
    if errors:
        print(json.dumps({"failed": errors[0]}), flush=True)
        return
    print(json.dumps({"ready": os.getpid()}), flush=True)
    start_at, stop_at = map(float, sys.stdin.readline().split())
    results: list[dict[str, Any]] = [{}] * count

    def run(i: int) -> None:
        infer = infers[i]
        assert infer is not None
        results[i] = call_loop(infer, (start_at, stop_at))

    all_of(run)
    print(json.dumps(merged(results)), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in KINDS:
        raise SystemExit(f"usage: python {sys.argv[0]} {{{','.join(KINDS)}}}")
    main(sys.argv[1])
