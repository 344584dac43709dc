"""A job over two nodes of a real Slurm cluster (`gpuport server --slurm`, `--nodes 2 --nprocs-per-node 2`).

The cluster (tests/_slurm.py) is two slurmd on this machine, this machine's name and node2, each a
node of its own with 2 fake GPUs as gres; the shared directory is a local folder. Its ranks start
through srun in one Slurm job of two nodes.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._slurm import SlurmCluster, missing, start_cluster
from tests._terminal import Command
from tests.conftest import CLIENT_ENV, RunningServer, client_env, server_env, start_server, wait_for

pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "Slurm is here")

# Each rank says what it was given, then all meet rank 0 at MASTER_ADDR:MASTER_PORT (across the nodes).
MEET = """import json, os, socket, time
e = os.environ
task = json.loads(e["TF_CONFIG"])["task"]
print(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"], e["GPUPORT_NODE_RANK"],
      e["GPUPORT_NODE"], e["GPUPORT_NODE_IPS"], e["CUDA_VISIBLE_DEVICES"], task["index"], e["SLURMD_NODENAME"],
      flush=True)
address = (e["MASTER_ADDR"], int(e["MASTER_PORT"]))
if e["RANK"] == "0":
    server = socket.create_server(("", address[1]))
    got = sorted(server.accept()[0].recv(8).decode() for _ in range(int(e["WORLD_SIZE"]) - 1))
    print("met", *got, flush=True)
else:
    for _ in range(600):
        try:
            socket.create_connection(address, timeout=5).sendall(e["RANK"].encode())
            break
        except OSError:
            time.sleep(0.05)
"""

# Each rank says it started, takes SIGTERM as its end (code 7), and waits; rank `FAILING` fails.
STOPPABLE = """import os, signal, sys, time
rank = os.environ["RANK"]
signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), os._exit(7)))
print("started", flush=True)
if rank == os.environ.get("FAILING"):
    while not all(os.path.exists(f"started-{r}") for r in range(4) if str(r) != rank):
        time.sleep(0.05)
    print("failing", flush=True)
    sys.exit(5)
open(f"started-{rank}", "w").close()
while True:
    time.sleep(0.05)
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


def _submit(server: RunningServer, code: str, **spec: object) -> dict:
    body = {"command": [sys.executable, "-c", code], "nodes": 2, "nprocs_per_node": 2, **spec}
    reply = server.rest("POST", "/v1/jobs", server.admin_token, json=body)
    assert reply.status_code == 201, reply.text
    return reply.json()


def _lines(log: str) -> dict[int, list[str]]:
    """The log's lines of each rank, without the "[r] " prefix and Slurm's own lines (srun's, slurmstepd's)."""
    by_rank: dict[int, list[str]] = {}
    for line in log.splitlines():
        if line.startswith("[") and "] " in line:
            rank, text = line[1:].split("] ", 1)
            if not text.startswith(("srun: ", "slurmstepd")):
                by_rank.setdefault(int(rank), []).append(text)
    return by_rank


def test_a_job_over_two_nodes_gets_one_slurm_job_and_the_rank_variables(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path
) -> None:
    job = _submit(slurm_server, MEET, gpus_per_node=2)
    ended = slurm_server.ended(job["job_id"])
    log = slurm_server.job_log(job["job_id"])
    assert (ended["state"], ended["exit_code"]) == ("succeeded", 0), log
    script = (shared / "jobs" / job["job_id"] / "slurm.sh").read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --gres=gpu:2\n" in script
    by_rank = _lines(log)
    assert sorted(by_rank) == [0, 1, 2, 3], log
    said = [by_rank[rank][0].split() for rank in range(4)]
    names = [said[0][6], said[2][6]]  # node rank 0's and 1's, in the allocation's order
    assert sorted(names) == sorted(cluster.nodes), log
    gpus: dict[str, set[str]] = {}
    for rank in range(4):
        node = rank // 2
        expected = [str(rank), str(rank % 2), "4", "2", str(node), str(node), names[node], "127.0.0.1,127.0.0.1"]
        assert said[rank][:8] == expected, log
        assert said[rank][9:] == [str(rank), names[node]], log  # its TF_CONFIG task; the node Slurm ran it on
        gpus.setdefault(names[node], set()).add(said[rank][8])
    assert gpus == {name: {"0", "1"} for name in names}, log  # a GPU of its own on each node
    assert "met 1 2 3" in by_rank[0], log  # every rank reached rank 0 at MASTER_ADDR:MASTER_PORT


def test_a_failing_rank_stops_the_others_on_every_node_with_its_exit_code(slurm_server: RunningServer) -> None:
    job = _submit(slurm_server, STOPPABLE, env={"FAILING": "3"})
    ended = slurm_server.ended(job["job_id"])
    log = slurm_server.job_log(job["job_id"])
    assert (ended["state"], ended["exit_code"]) == ("failed", 5), log
    assert "gpuport: rank 3 exited with code 5; stopping the other processes" in log
    by_rank = _lines(log)
    for rank in (0, 1, 2):  # on both nodes, each stopped with SIGTERM (through Slurm), not killed
        assert by_rank[rank] == ["started", "got SIGTERM"], log
        assert f"[{rank}] srun: error: " in log and "Exited with exit code 7" in log


def test_cancel_ends_every_rank_on_every_node(slurm_server: RunningServer, shared: Path) -> None:
    job = _submit(slurm_server, STOPPABLE, gpus_per_node=1)
    work = shared / "jobs" / job["job_id"] / "work"
    wait_for(lambda: all((work / f"started-{r}").exists() for r in range(4)), 90, "every rank to start")
    reply = slurm_server.rest("POST", f"/v1/jobs/{job['job_id']}/cancel", slurm_server.admin_token)
    assert reply.status_code == 200, reply.text
    ended = slurm_server.ended(job["job_id"])
    log = slurm_server.job_log(job["job_id"])
    assert (ended["state"], ended["exit_code"]) == ("cancelled", 7), log
    by_rank = _lines(log)
    assert all(by_rank[rank] == ["started", "got SIGTERM"] for rank in range(4)), log


def test_more_nodes_than_the_cluster_has_are_refused(slurm_server: RunningServer) -> None:
    reply = slurm_server.rest(
        "POST",
        "/v1/jobs",
        slurm_server.admin_token,
        json={"command": ["true"], "nodes": 3, "nprocs_per_node": 1},
    )
    assert reply.status_code == 429, reply.text
    assert "asked for 3 nodes; the cluster has 2" in reply.text, reply.text


def test_a_batch_script_over_nodes_is_refused_saying_where_its_nodes_go(slurm_server: RunningServer) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = b"#!/bin/sh\n#SBATCH --nodes=2\nsrun hostname\n"
        info = tarfile.TarInfo("train.sh")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    snapshot = slurm_server.rest(
        "POST",
        "/v1/snapshots?name=nodes-script",
        slurm_server.admin_token,
        content=buffer.getvalue(),
        headers={"Content-Type": "application/x-tar"},
    )
    assert snapshot.status_code in (200, 201), snapshot.text
    body = {"batch_script": "train.sh", "command": [], "project": "nodes-script", "nodes": 2}
    reply = slurm_server.rest("POST", "/v1/jobs", slurm_server.admin_token, json=body)
    assert reply.status_code == 400, reply.text
    assert "give the nodes in its own #SBATCH lines" in reply.text, reply.text


@pytest.mark.parametrize("stdio", ["piped", "terminal"])
def test_gpuport_run_over_two_nodes_from_the_cli(slurm_server: RunningServer, tmp_path: Path, stdio: str) -> None:
    code = "import os; print(os.environ['RANK'], os.environ['GPUPORT_NODE'], os.environ['SLURMD_NODENAME'])"
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env.update(client_env(slurm_server), COLUMNS="200")
    argv = ["run", "--nodes", "2", "--nprocs-per-node", "1", "--", sys.executable, "-c", code]
    with Command(argv, env, tmp_path, stdio, columns=200) as run:
        assert run.wait(120) == 0, run.raw
    said = sorted(line.split() for line in run.text.splitlines() if line.startswith("["))
    assert [s[0] for s in said] == ["[0]", "[1]"] and [s[1] for s in said] == ["0", "1"], run.raw
    assert all(s[2] == s[3] for s in said) and said[0][2] != said[1][2], run.raw  # a node each
