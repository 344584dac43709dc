"""TensorFlow's remote device through gpuport (``gpu.tensorflow()``) against TensorFlow reached directly.

    .venv/bin/python bench/bench_tf_remote.py [--ops 300] [--epochs 6] [--turns 4]

(a) per-op round trip: a scalar add placed on the remote CPU device and brought back (``.numpy()``),
    median of N after a warm-up: through gpuport's tunnel (TLS to the data port, which relays to a
    connection the session's worker handed it) against the same TF server reached directly (a
    ``tf.distribute.Server`` on 127.0.0.1 in a plain process, no TLS). Goal: at most 1.3x.
(b) a Keras epoch (20,000 x 64 floats, dense 256-256-1) under OneDeviceStrategy on the remote CPU
    device through gpuport against the same epoch in a local process, median of the epochs after the
    first.
TensorFlow's remote context is per process, so each side runs in a fresh process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _report  # noqa: E402
from _report import ROWS, Row, say  # noqa: E402

OPS = textwrap.dedent(
    """
    import json, statistics, sys, time
    import tensorflow as tf
    n, device = int(sys.argv[1]), "/job:worker/replica:0/task:0/device:CPU:0"

    def measure():
        one = tf.constant(1.0)
        for _ in range(20):  # warm-up: the first ops set up the remote context
            with tf.device(device):
                (one + 1.0).numpy()
        times = []
        for _ in range(n):
            started = time.perf_counter()
            with tf.device(device):
                (one + 1.0).numpy()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    if sys.argv[2] == "gpuport":
        import gpuport
        with gpuport.connect(sys.argv[3], sys.argv[4], fingerprint=sys.argv[5]) as gpu, gpu.tensorflow(cpus=1):
            print(json.dumps(measure()))
    else:
        tf.config.experimental_connect_to_host(sys.argv[3], job_name="worker")
        print(json.dumps(measure()))
    """
)

EPOCH = textwrap.dedent(
    """
    import json, statistics, sys, time
    import numpy as np
    import tensorflow as tf
    epochs = int(sys.argv[1])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20000, 64), dtype=np.float32), rng.standard_normal((20000, 1), dtype=np.float32)

    def measure(strategy):
        with strategy.scope():
            model = tf.keras.Sequential(
                [tf.keras.Input((64,)), tf.keras.layers.Dense(256, "relu"), tf.keras.layers.Dense(256, "relu"),
                 tf.keras.layers.Dense(1)]
            )
            model.compile("adam", "mse")
        times = []
        for _ in range(epochs):
            started = time.perf_counter()
            model.fit(x, y, batch_size=256, epochs=1, verbose=0)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    if sys.argv[2] == "gpuport":
        import gpuport
        with gpuport.connect(sys.argv[3], sys.argv[4], fingerprint=sys.argv[5]) as gpu, gpu.tensorflow() as remote:
            print(json.dumps(measure(tf.distribute.OneDeviceStrategy(remote.device("CPU:0")))))
    else:
        print(json.dumps(measure(tf.distribute.OneDeviceStrategy("/device:CPU:0"))))
    """
)

TF_SERVER = textwrap.dedent(
    """
    import sys, time
    import tensorflow as tf
    port = int(sys.argv[1])
    cluster = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}"]})
    tf.distribute.Server(cluster, job_name="worker", task_index=0, protocol="grpc", start=True)
    print("ready", flush=True)
    time.sleep(3600)
    """
)


def _run(script: str, *args: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise SystemExit(f"a measuring process failed:\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4, help="turns of each side, alternated (default 4)")
    args = parser.parse_args()
    import tensorflow as tf

    _report.banner(f"TensorFlow {tf.__version__}", quick=False)
    with _report.isolated_workdir() as work, _report.gpuport_server(work, "server") as server:
        port = _free_port()
        direct = subprocess.Popen(
            [sys.executable, "-c", TF_SERVER, str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        try:
            assert direct.stdout is not None and direct.stdout.readline().strip() == "ready"
            who = (server.url, server.token, server.fingerprint)
            ours, anchor = [], []
            for _ in range(args.turns):  # taken in turns: a slow spell of the machine hits both
                ours.append(_run(OPS, str(args.ops), "gpuport", *who))
                anchor.append(_run(OPS, str(args.ops), "direct", f"127.0.0.1:{port}"))
            best, base = min(ours), min(anchor)
            ROWS.append(
                Row(
                    "per-op round trip (scalar add)",
                    best,
                    base,
                    "the TF server directly",
                    "<= 1.3x",
                    best <= 1.3 * base,
                )
            )
            remote, local = [], []
            for _ in range(max(1, args.turns // 2)):
                remote.append(_run(EPOCH, str(args.epochs), "gpuport", *who))
                local.append(_run(EPOCH, str(args.epochs), "local"))
            remote_epoch, local_epoch = min(remote), min(local)
            ROWS.append(
                Row("Keras epoch on the remote CPU", remote_epoch, local_epoch, "the same epoch locally", "-", None)
            )
        finally:
            direct.kill()
            direct.wait(timeout=10)
    say(
        f"(per-op: the best of {args.turns} turns' medians of {args.ops}; epoch: the best of {max(1, args.turns // 2)} "
        f"turns' medians of {args.epochs - 1} epochs after the first)"
    )
    _report.print_table(
        ["per-op", "Keras"], 34, "ratio: through gpuport / anchor (lower is better); everything on 127.0.0.1"
    )


if __name__ == "__main__":
    main()
