"""Sessions on the nodes of a real Slurm cluster (`gpuport server --slurm`).

The cluster (tests/_slurm.py) is two slurmd on this machine, this machine's name and node2, each a
node of its own with 2 fake GPUs as gres; the shared directory is a local folder. A session's worker
is a Slurm job holding its allocation; the server reaches it over TCP through the link its
supervisor starts on the node (executors/slurm_link.py), never through the shared folder's socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuport
from gpuport.server.blobs import BlobStore
from gpuport.server.executors.node_link import dial
from gpuport.server.executors.slurm import SlurmExecutor
from gpuport.server.inventory import CpuInventory
from tests._serving.ask import answer, ask, where_model
from tests._slurm import SlurmCluster, missing, start_cluster
from tests._terminal import Command
from tests.conftest import CLIENT_ENV, RunningServer, client_env, server_env, start_server, wait_for

pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "Slurm is here")

np = pytest.importorskip("numpy")

# A plain job that listens on a worker's endpoint of its own, to pass for another job's worker.
IMPOSTOR = """import os, socket, time
path = os.path.join(os.environ["GPUPORT_RUN_DIR"], "worker.sock")
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
print("listening", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def slurm_server(
    cluster: SlurmCluster, shared: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    env = server_env(SLURM_CONF=str(cluster.conf))
    running = start_server(tmp_path_factory.mktemp("state"), "--slurm", "--shared-dir", str(shared), env=env)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _released(cluster: SlurmCluster) -> Iterator[None]:
    yield
    cluster.cancel_all()


def _node() -> str:
    return os.environ["SLURM_JOB_NODELIST"]


def _gpus() -> tuple[str, str]:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), os.environ["SLURM_JOB_NODELIST"]


def _total(values: Any) -> float:
    return float(values.sum())


def _twice(values: Any) -> Any:
    return values * 2


def _fail(message: str) -> None:
    raise ValueError(message)


def _slurm_id(shared: Path, job_id: str) -> str:
    return wait_for(lambda: _read(shared / "jobs" / job_id / "slurm.id"), 30, f"job {job_id}'s Slurm id")  # type: ignore[return-value]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _listed(cluster: SlurmCluster) -> set[str]:
    return set(cluster.run("squeue", "-h", "-o", "%i").stdout.split())


def _cli(server: RunningServer, *args: str) -> str:
    env = {**os.environ, **client_env(server), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "gpuport", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_session_puts_calls_gets_and_raises_as_on_one_machine_and_closing_ends_its_slurm_job(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path
) -> None:
    with slurm_server.connect() as gpu:
        with gpu.session() as session:
            assert session.call(_node) in cluster.nodes
            info = session.info()
            assert info.state == "running", info
            slurm_id = _slurm_id(shared, info.job_id)
            assert slurm_id in _listed(cluster)
            ref = session.put(np.arange(10))
            assert session.call(_total, ref) == 45.0  # the Ref is resolved in the worker, on its node
            doubled = session.call(_twice, ref, keep=True)
            assert session.get(doubled).tolist() == list(range(0, 20, 2))
            big = np.frombuffer(os.urandom(8 << 20), dtype=np.uint8)  # bytes over the link, both ways
            assert np.array_equal(session.get(session.put(big)), big)
            with pytest.raises(ValueError, match="no luck") as caught:
                session.call(_fail, "no luck")
            assert isinstance(caught.value, gpuport.RemoteError) and "_fail" in caught.value.remote_traceback
            assert session.call(_total, ref) == 45.0  # the worker lives on
            link = json.loads((shared / "jobs" / info.job_id / "link.json").read_text())
            assert link["node"] in cluster.nodes and link["port"] > 0, link
            assert not (shared / "jobs" / info.job_id / "link.secret").exists()  # read by the link, and gone
        wait_for(lambda: slurm_id not in _listed(cluster), 60, f"Slurm job {slurm_id} of the closed session to end")


def test_a_session_asking_for_a_gpu_gets_it_from_slurms_gres(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path
) -> None:
    with slurm_server.connect() as gpu, gpu.session(gpus=1) as session:
        visible, node = session.call(_gpus)
        assert visible in ("0", "1") and node in cluster.nodes, (visible, node)
        script = (shared / "jobs" / session.info().job_id / "slurm.sh").read_text()
        assert "#SBATCH --gres=gpu:1\n" in script, script


def test_two_sessions_at_once_on_both_nodes_each_with_its_values_and_its_node_listed(
    slurm_server: RunningServer, cluster: SlurmCluster
) -> None:
    # A node's GPUs each: one session on each node.
    with slurm_server.connect() as gpu, gpu.session(gpus=2) as first, gpu.session(gpus=2) as second:
        nodes = {first.id: first.call(_node), second.id: second.call(_node)}
        assert sorted(nodes.values()) == sorted(cluster.nodes), nodes
        a, b = first.put(np.arange(3)), second.put(np.arange(5))
        assert (first.call(_total, a), second.call(_total, b)) == (3.0, 10.0)
        wait_for(
            lambda: {s.id: s.node for s in gpu.sessions()} == nodes,
            30,
            lambda: f"the sessions' nodes {nodes} (listed: {[(s.id, s.node) for s in gpu.sessions()]})",
        )
        listed = _cli(slurm_server, "sessions")
        assert "NODE" in listed and all(node in listed for node in cluster.nodes), listed
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
        env.update(client_env(slurm_server))
        with Command(["sessions"], env, None, "terminal", columns=160) as on_terminal:
            assert on_terminal.wait(60) == 0, on_terminal.raw
        assert "NODE" in on_terminal.text and all(node in on_terminal.text for node in cluster.nodes), on_terminal.raw


def test_a_job_cannot_pass_for_a_sessions_worker(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The server's connect to a worker (an executor reading the same shared folder with the server's
    key): a link file the job wrote is refused, the link serves its own job only, and a socket of
    another job put in the worker's place is refused by the link."""
    reply = slurm_server.rest(
        "POST", "/v1/jobs", slurm_server.admin_token, json={"command": [sys.executable, "-c", IMPOSTOR]}
    )
    assert reply.status_code == 201, reply.text
    impostor = reply.json()["id"]
    wait_for(lambda: "listening" in slurm_server.job_log(impostor), 60, "the impostor job to listen")
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    executor = SlurmExecutor(
        shared,
        BlobStore(tmp_path / "blobs"),
        CpuInventory("the test's"),
        key_file=slurm_server.state_dir / "slurm-link.key",
    )
    try:
        with slurm_server.connect() as gpu, gpu.session() as session:
            node = session.call(_node)
            assert node in cluster.nodes
            worker = session.info().job_id
            folder = shared / "jobs" / worker
            way_in = executor.connect(worker, "worker")  # the server's own way in
            way_in.close()
            # It names the worker's node, as the link wrote it: a model's replica shows it at once,
            # before squeue's next look has told the job's record.
            assert way_in.node == node, (way_in.node, node)

            # The job's folder is its user's to write: a link file it wrote (its own listener) is refused.
            link_file = folder / "link.json"
            real = link_file.read_bytes()
            forged = {**json.loads(real), "port": 1, "fingerprint": "0" * 64}
            link_file.write_text(json.dumps(forged))
            with pytest.raises(PermissionError, match="not written by its link"):
                executor.connect(worker, "worker")
            link_file.write_bytes(real)

            # The link serves its own job's endpoints only, whatever secret comes with the asking.
            link = json.loads(real)
            secret = executor._secret(worker)
            with pytest.raises(PermissionError, match=f"serves job {worker}"):
                dial(link["address"], link["port"], link["fingerprint"], secret, impostor, "worker")

            # Another job's socket in the worker's place: the link refuses it (not one of the job's processes).
            endpoint = folder / "run" / "worker.sock"
            endpoint.rename(folder / "run" / "kept.sock")
            try:
                endpoint.symlink_to(shared / "jobs" / impostor / "run" / "worker.sock")
                with pytest.raises(PermissionError):
                    executor.connect(worker, "worker")
            finally:
                endpoint.unlink(missing_ok=True)
                (folder / "run" / "kept.sock").rename(endpoint)
            assert session.call(_total, np.arange(4)) == 6.0  # the worker, untouched
    finally:
        executor.close()


def test_a_link_asked_with_a_wrong_secret_answers_nothing(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path
) -> None:
    with slurm_server.connect() as gpu, gpu.session() as session:
        assert session.call(_node) in cluster.nodes
        link = json.loads((shared / "jobs" / session.info().job_id / "link.json").read_text())
        with pytest.raises(ConnectionError):
            dial(link["address"], link["port"], link["fingerprint"], "00" * 32, session.info().job_id, "worker")
        started = time.monotonic()
        with socket.create_connection((link["address"], link["port"]), timeout=10) as plain:  # no TLS: nothing
            plain.sendall(b"GET / HTTP/1.0\r\n\r\n")
            plain.settimeout(15)
            try:
                said = plain.recv(100)
            except ConnectionResetError:
                said = b""
            assert said in (b"",) or said.startswith(b"\x15"), said  # closed, or a TLS alert: nothing of a worker's
        assert time.monotonic() - started < 15


def _exit_saying(code: int) -> None:
    print("exiting on purpose", file=sys.stderr, flush=True)
    os._exit(code)


def test_a_worker_that_exits_raises_worker_died_with_its_stderr_and_restart_gives_a_fresh_slurm_job(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path
) -> None:
    with slurm_server.connect() as gpu, gpu.session() as session:
        assert session.call(_node) in cluster.nodes
        first = _slurm_id(shared, session.info().job_id)
        with pytest.raises(gpuport.WorkerDied) as died:
            session.call(_exit_saying, 3)
        assert died.value.exit_code == 3, died.value
        assert "exiting on purpose" in died.value.stderr_tail  # read from its run folder, in the shared one
        session.restart()
        assert session.call(_node) in cluster.nodes
        assert _slurm_id(shared, session.info().job_id) != first


def test_a_session_slurm_holds_is_queued_with_slurms_reason_until_it_has_its_gpus(
    slurm_server: RunningServer, cluster: SlurmCluster
) -> None:
    with slurm_server.connect() as gpu, gpu.session(gpus=2) as first, gpu.session(gpus=2) as second:
        assert first.call(_node) != second.call(_node)  # every GPU of the cluster is held
        with gpu.session(gpus=1) as third:
            wait_for(
                lambda: (i := third.info()).state == "queued" and i.message.startswith("Slurm: "),
                30,
                lambda: f"the third session to wait for Slurm (it is {third.info()})",
            )
            first.close()
            assert third.call(_node) in cluster.nodes
            assert third.info().state == "running"


def test_a_named_session_outlives_a_server_killed_with_sigkill(
    cluster: SlurmCluster, shared: Path, tmp_path: Path
) -> None:
    env = server_env(SLURM_CONF=str(cluster.conf))
    state = tmp_path / "state"
    first = start_server(state, "--slurm", "--shared-dir", str(shared), env=env)
    second = None
    try:
        with first.connect() as gpu:
            session = gpu.session(name="kept", idle_timeout=120)
            session.put(np.arange(6), name="values")
            node = session.call(_node)
        first.stop(signal.SIGKILL)
        second = start_server(state, "--slurm", "--shared-dir", str(shared), env=env)
        second.admin_token = first.admin_token  # shown on the first start only
        with second.connect() as gpu:
            again = gpu.session(name="kept")
            assert again.reattached and again.id == session.id
            assert again.get(again.ref("values")).tolist() == list(range(6))  # its worker on the node kept them
            assert again.call(_node) == node
            again.close()
    finally:
        for running in (first, second):
            if running is not None:
                running.stop()


def test_a_models_replicas_run_as_slurm_jobs_on_both_nodes_and_answer_and_undeploy_ends_them(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path, tmp_path: Path
) -> None:
    """Model replicas are workers too: each a Slurm job holding its GPUs on its node, fed by the
    front door's batcher through the job's link; undeploy ends their Slurm jobs."""
    with slurm_server.connect() as gpu:
        # Two GPUs each: a node holds one replica, so the second lands on the other node.
        info = gpu.deploy("slurm-where", where_model(tmp_path), replicas=2, gpus=2, max_batch_size=0, timeout=180)
        try:
            assert info.state == "ready" and sorted(info.nodes) == sorted(cluster.nodes), info
            slurm_ids = [_slurm_id(shared, job_id) for job_id in info.jobs]
            assert set(slurm_ids) <= _listed(cluster)
            for value in (1.0, 2.5, 4.0):  # the batcher takes turns: both replicas answer in three
                y, _ = answer(ask(slurm_server, "slurm-where", 0.0, value))
                assert y == value * 2
            listed = _cli(slurm_server, "models")
            row = next(line for line in listed.splitlines() if line.startswith("slurm-where"))
            assert "NODES" in listed and all(node in row for node in cluster.nodes), listed
            env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
            env.update(client_env(slurm_server))
            with Command(["models"], env, None, "terminal", columns=200) as on_terminal:
                assert on_terminal.wait(60) == 0, on_terminal.raw
            assert all(word in on_terminal.text for word in ("NODES", *cluster.nodes)), on_terminal.raw
        finally:
            gpu.undeploy("slurm-where")
    wait_for(lambda: not set(slurm_ids) & _listed(cluster), 60, f"the replicas' Slurm jobs {slurm_ids} to end")
