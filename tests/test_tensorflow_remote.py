"""TensorFlow's own remote device through gpuport: ops placed with ``tf.device(remote.device(...))``
run in the session's worker on the server, a Keras model trains under OneDeviceStrategy there, and
the TF server is reachable only through its owner's tunnel.

TensorFlow's remote context is process-wide (``experimental_connect_to_host``), so each client runs
in a process of its own here: the test process's TensorFlow stays local for the other tests."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gpuport
from tests.conftest import RunningServer, needs_users, server_env

pytest.importorskip("tensorflow")

CLIENT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import gpuport
    import tensorflow as tf

    url, token, fingerprint, report = sys.argv[1:5]
    out = {}
    with gpuport.connect(url, token, fingerprint=fingerprint) as gpu:
        with gpu.tensorflow(cpus=1) as remote:
            out["address"], out["devices"], out["session"] = remote.address, remote.devices, remote.session.id
            with tf.device(remote.device("CPU:0")):
                y = tf.constant([1.0, 2.0]) * 3
                status = tf.io.read_file("/proc/self/status")  # read by the process that runs the op
            out["op"] = [y.device, y.numpy().tolist()]
            uid = [line.split()[1] for line in status.numpy().decode().splitlines() if line.startswith("Uid:")]
            out["remote_uid"], out["local_uid"] = int(uid[0]), os.getuid()
            strategy = tf.distribute.OneDeviceStrategy(remote.device("CPU:0"))
            with strategy.scope():
                model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
                model.compile("sgd", "mse")
            history = model.fit(np.ones((64, 4), "float32"), np.ones((64, 2), "float32"), epochs=2, verbose=0)
            out["fit"] = [history.history["loss"], model.weights[0].value.device]
            with open(report, "w") as f:  # while the server still runs: the isolation check reads it
                json.dump(out, f)
            sys.stdin.readline()  # until the test has tried to reach it from another user's job
        out["sessions_after"] = [s.id for s in gpu.sessions()]
    with open(report, "w") as f:
        json.dump(out, f)
    """
)


def test_ops_and_a_keras_fit_run_on_the_remote_device(
    server: RunningServer, admin: gpuport.Client, user_token: str, tmp_path: Path
) -> None:
    needs_users()
    report = tmp_path / "report.json"
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen(
        [sys.executable, str(script), server.url, user_token, server.fingerprint, str(report)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=server_env(),
    )
    try:
        for _ in range(1800):  # up to 3 minutes: TensorFlow starts on both ends
            if report.exists() or client.poll() is not None:
                break
            time.sleep(0.1)
        assert report.exists(), client.communicate(timeout=30)[0]
        seen = json.loads(report.read_text())
        assert seen["devices"][0] == "CPU:0"
        assert seen["op"] == ["/job:worker/replica:0/task:0/device:CPU:0", [3.0, 6.0]]
        # The file op ran in the worker, as the user's own uid (the client runs as root here).
        assert seen["remote_uid"] >= 61000 and seen["remote_uid"] != seen["local_uid"]
        losses, weights_device = seen["fit"]
        assert len(losses) == 2 and losses[1] < losses[0] and weights_device.startswith("/job:worker/")

        # Another user's job on the same box cannot reach that TF server: it listens on its worker's
        # own loopback, in a network namespace of its own.
        port = seen["address"].rsplit(":", 1)[1]
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"
        job = admin.submit(["python", "-c", probe], workdir=None).wait(60)
        assert job.info.state == "failed" and any("ConnectionRefusedError" in line for line in job.logs())
    finally:
        if client.poll() is None:
            client.stdin.write("\n")  # type: ignore[union-attr]
            client.stdin.flush()  # type: ignore[union-attr]
        said = client.communicate(timeout=60)[0]
    assert client.returncode == 0, said
    seen = json.loads(report.read_text())
    assert seen["session"] not in seen["sessions_after"]  # the allocation is freed with the block
