"""Across a network: the laptop and the GPU box are two hosts (network namespaces) joined by a link of
2 ms round trip and 1 Gbit/s (``tests/_link.py``). The server listens only on the box; every client
here runs on the laptop, in processes of its namespace: TensorFlow's tunnel, a notebook's kernel, and
the system's ssh for ssh://, which is the only port the last test uses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import _link
from tests._sshd import end_processes_of, sshd
from tests.conftest import RunningServer, needs_users, server_env, start_server

pytestmark = pytest.mark.skipif(bool(_link.missing()), reason=_link.missing() or "")


@pytest.fixture(scope="module")
def hosts() -> Iterator[_link.Link]:
    with _link.link(rtt=0.002, gbits=1.0) as made:
        yield made


@pytest.fixture(scope="module")
def box_server(hosts: _link.Link, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server on the box, listening on the box's address: the laptop reaches it over the link."""
    state = tmp_path_factory.mktemp("box") / "gpuport"
    running = start_server(state, "--host", hosts.box.address, wrapper=tuple(hosts.box.command([])))
    yield running
    running.stop()


def _on_laptop(hosts: _link.Link, server: RunningServer, script: str, *args: str, timeout: float = 300) -> Any:
    """Run ``script`` in a Python process on the laptop, pointed at ``server``; what it printed last, as JSON."""
    env = server_env(GPUPORT_URL=server.url, GPUPORT_TOKEN=server.admin_token, GPUPORT_FINGERPRINT=server.fingerprint)
    argv = hosts.laptop.command([sys.executable, "-c", textwrap.dedent(script), *args])
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_box_is_reached_only_over_the_link(hosts: _link.Link, box_server: RunningServer) -> None:
    """The server's address exists on the box alone: the laptop's route to it is the link."""
    assert hosts.box.address in box_server.url
    seen = _on_laptop(
        hosts,
        box_server,
        """
        import json, socket, time, gpuport
        with gpuport.connect() as gpu:
            rtt = min(gpu.ping() for _ in range(20))
            print(json.dumps({"user": gpu.user, "rtt": rtt}))
        """,
    )
    assert seen["user"] == "admin"
    assert seen["rtt"] >= 0.002  # a round trip of the link at least: the link is really there


TENSORFLOW = """
import json, numpy as np, gpuport, tensorflow as tf
with gpuport.connect() as gpu, gpu.tensorflow(cpus=1) as remote:
    with tf.device(remote.device("CPU:0")):
        y = tf.matmul(tf.ones((2, 3)), tf.ones((3, 2)))
    strategy = tf.distribute.OneDeviceStrategy(remote.device("CPU:0"))
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    loss = model.fit(np.ones((32, 4), "float32"), np.ones((32, 1), "float32"), epochs=2, verbose=0).history["loss"]
    print(json.dumps({"device": y.device, "y": y.numpy().tolist(), "loss": loss,
                      "weights": model.weights[0].value.device, "url": gpu.url}))
"""


def test_tensorflow_remote_device_over_the_link(hosts: _link.Link, box_server: RunningServer) -> None:
    pytest.importorskip("tensorflow")
    seen = _on_laptop(hosts, box_server, TENSORFLOW)
    assert seen["device"].startswith("/job:worker/replica:0/task:0/device:CPU:0"), seen
    assert seen["y"] == [[3.0, 3.0], [3.0, 3.0]]
    assert seen["weights"].startswith("/job:worker/"), seen
    assert len(seen["loss"]) == 2 and hosts.box.address in seen["url"]


NOTEBOOK = """
import json, sys, nbclient, nbformat
cells = [
    "%load_ext gpuport",
    "%%gpuport --session link-notebook\\nimport os\\nx = [1, 2, 3]\\nprint('on the box', sum(x), flush=True)",
    "%%gpuport --session link-notebook\\nx.append(4)\\nlen(x)",
    "%gpuport_pull x\\nprint('here', x)",
    "%gpuport_close link-notebook",
]
notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
nbclient.NotebookClient(notebook, timeout=180, kernel_name="python3", allow_errors=True).execute()
outputs = [[o.get("text") or o.get("data", {}).get("text/plain") or o.get("evalue") for o in c.outputs]
           for c in notebook.cells]
print(json.dumps(outputs))
"""


def test_a_notebook_over_the_link(hosts: _link.Link, box_server: RunningServer) -> None:
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    outputs = _on_laptop(hosts, box_server, NOTEBOOK)
    assert "on the box 6" in "".join(outputs[1]), outputs
    assert outputs[2] == ["4"], outputs
    assert "here [1, 2, 3, 4]" in "".join(outputs[3]), outputs


SESSION = """
import json, warnings, gpuport
warnings.simplefilter("error")  # a value falling back to gRPC would warn: the data port must be reached
with gpuport.connect() as gpu, gpu.session() as s:
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB, through the forwarded data port
    ref = s.put(big)
    print(json.dumps({"same": s.get(ref) == big, "len": s.call(len, ref), "url": gpu.url}))
"""


def test_ssh_is_the_only_port_over_the_link(hosts: _link.Link, cli: Any, tmp_path: Path) -> None:
    """sshd on the box's address; the server started through it listens on the box's loopback,
    which the laptop cannot reach but through ssh's forwards."""
    needs_users()
    state = tmp_path / "box-state"
    with sshd(tmp_path / "ssh", host=hosts.box) as config:
        ssh = {"GPUPORT_SSH": f"ssh -F {config}"}
        try:
            start = f"{sys.executable} -m gpuport server --state-dir {state}"
            on = hosts.laptop.command([])
            done = cli("login", "ssh://gpubox", "--start", start, "--yes", on=on, **ssh)
            assert done.code == 0, done.output
            status = cli("status", on=on, **ssh)
            assert status.code == 0 and status.stdout.startswith("ssh://gpubox  gpuport "), status.output
            project = tmp_path / "project"
            project.mkdir()
            (project / "hello.py").write_text("print('hello across the link', 6 * 7)\n")
            ran = cli("run", "--", "python", "hello.py", cwd=project, on=on, **ssh)
            assert ran.code == 0 and "hello across the link 42" in ran.stdout, ran.output
            env = {**server_env(), "GPUPORT_CONFIG_DIR": str(tmp_path / "config"), **ssh}
            argv = hosts.laptop.command([sys.executable, "-c", textwrap.dedent(SESSION)])
            session = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
            assert session.returncode == 0, session.stdout + session.stderr
            seen = json.loads(session.stdout.strip().splitlines()[-1])
            assert seen == {"same": True, "len": 8 * 1024 * 1024, "url": "ssh://gpubox"}
        finally:
            end_processes_of(state)
