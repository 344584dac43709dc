"""Scale-out on Ray: one gpuport server, jobs placed on the nodes of a real 2-node Ray cluster.

The cluster (tests/_ray.py) runs on this machine: two `ray start` nodes with their own loopback
addresses, 2 fake GPUs each, token authentication. The server joins it with --ray.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpuport
from tests._ray import RayCluster, RayNode, start_cluster
from tests._serving.ask import answer, ask, where_model
from tests._terminal import Command
from tests.conftest import CLIENT_ENV, JobFlag, RunningServer, client_env, server_env, start_server, wait_for

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'gpuport[ray]')")

pytestmark = pytest.mark.timeout(300)

HOLD = "import os, time\nwhile not os.path.exists('go'): time.sleep(0.05)\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("ray"))
    try:
        yield cluster
    finally:
        cluster.close()


def _start(cluster: RayCluster, state_dir: Path, *args: str, token: str | None = None) -> RunningServer:
    env = server_env(RAY_AUTH_TOKEN=token or cluster.token)
    return start_server(state_dir, "--ray", cluster.address, *args, env=env)


@pytest.fixture(scope="module")
def server(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = _start(cluster, tmp_path_factory.mktemp("state"))
    try:
        yield running
    finally:
        running.stop()


class Flags:
    """A JobFlag on every node: holding jobs wait for the file 'go' in their working folder there."""

    def __init__(self, cluster: RayCluster) -> None:
        self.flags = [JobFlag(node.root / "gpuport") for node in cluster.nodes]

    def touch(self) -> None:
        for flag in self.flags:
            flag.touch()

    def close(self) -> None:
        for flag in self.flags:
            flag.close()


def _submit(server: RunningServer, code: str, token: str | None = None, **spec: object) -> dict:
    reply = server.rest(
        "POST", "/v1/jobs", token or server.admin_token, json={"command": [sys.executable, "-c", code], **spec}
    )
    assert reply.status_code == 201, reply.text
    return reply.json()


def _job(server: RunningServer, job_id: str, token: str | None = None) -> dict:
    reply = server.rest("GET", f"/v1/jobs/{job_id}", token or server.admin_token)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ended(server: RunningServer, job_id: str, timeout: float = 60, token: str | None = None) -> dict:
    return wait_for(
        lambda: (j := _job(server, job_id, token))["state"] not in ("queued", "running") and j,
        timeout,
        f"job {job_id} to end",
    )


def _log(server: RunningServer, job_id: str) -> str:
    reply = server.rest("GET", f"/v1/jobs/{job_id}/logs", server.admin_token)
    assert reply.status_code == 200, reply.text
    return reply.json()["data"]


def _cli(server: RunningServer, *args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, **client_env(server), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "gpuport", *args], env=env, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_banner_lists_the_nodes(server: RunningServer, cluster: RayCluster) -> None:
    assert f"cluster      Ray at {cluster.address}: 2 nodes" in server.banner
    assert "node-a (127.0.0.2): 2 x 16GiB, 2 CPUs" in server.banner
    assert "node-b (127.0.0.3): 2 x 16GiB, 2 CPUs" in server.banner


def test_a_job_runs_on_a_node_in_its_sandbox_and_brings_back_its_log_outputs_and_code(
    server: RunningServer, cluster: RayCluster, tmp_path: Path
) -> None:
    # The node's blob store and Ray's own folder (its session: sockets, logs) stay out of the sandbox.
    private = [str(n.root / name) for n in cluster.nodes for name in ("gpuport/blobs", "session_latest")]
    code = (
        "import os, sys\n"
        "print('node', os.environ['GPUPORT_NODE'], 'gpus', repr(os.environ['CUDA_VISIBLE_DEVICES']), flush=True)\n"
        "print('uid', os.getuid(), 'ray', sorted(k for k in os.environ if 'RAY' in k), flush=True)\n"
        f"print('sees node dir', any(os.path.exists(p) for p in {private!r}))\n"
        "open(os.path.join(os.environ['GPUPORT_OUTPUT_DIR'], 'result.txt'), 'w').write('made on ' + "
        "os.environ['GPUPORT_NODE'])\n"
        "sys.exit(3)\n"
    )
    job = _ended(server, _submit(server, code)["job_id"])
    assert (job["state"], job["exit_code"]) == ("failed", 3), job
    assert job["node"] in ("node-a", "node-b")
    log = _log(server, job["job_id"])
    assert f"node {job['node']} gpus ''" in log  # a CPU-only job sees no GPU
    assert "ray []" in log  # nor Ray's token and settings
    assert "sees node dir False" in log
    uid = int(log.split("uid ")[1].split()[0])
    assert uid >= 61000  # its owner's uid, as on one machine
    said = _cli(server, "download", job["job_id"], "-o", str(tmp_path / "got"))
    assert (tmp_path / "got" / "result.txt").exists(), (said, job["message"], job["output_snapshot_id"])
    assert (tmp_path / "got" / "result.txt").read_text() == f"made on {job['node']}"


def test_jobs_fill_both_nodes_and_a_two_gpu_job_is_never_split(server: RunningServer, cluster: RayCluster) -> None:
    flags = Flags(cluster)
    try:
        one = [
            _submit(server, HOLD + "print(os.environ['GPUPORT_NODE'], os.environ['CUDA_VISIBLE_DEVICES'])", gpus=1)
            for _ in range(2)
        ]
        running = [wait_for(lambda j=j: (r := _job(server, j["job_id"]))["state"] == "running" and r) for j in one]
        # Packed onto one node, so that the other keeps both its GPUs for a 2-GPU job.
        assert len({j["node"] for j in running}) == 1, running
        assert sorted(tuple(j["gpu_indices"]) for j in running) == [(0,), (1,)]
        two = _submit(server, HOLD + "print(os.environ['GPUPORT_NODE'], os.environ['CUDA_VISIBLE_DEVICES'])", gpus=2)
        two = wait_for(lambda: (r := _job(server, two["job_id"]))["state"] == "running" and r)
        assert two["node"] != running[0]["node"] and two["gpu_indices"] == [0, 1]
        # `gpuport gpus` and `gpuport jobs` say which node each GPU and job is on.
        listing = server.rest("GET", "/v1/gpus", server.admin_token).json()
        held = {(g["node"], g["index"]): g["jobs"] for g in listing["gpus"]}
        assert len(held) == 4 and {node for node, _ in held} == {"node-a", "node-b"}
        assert held[(two["node"], 0)] == held[(two["node"], 1)] == [two["job_id"]]
        gpus_table = _cli(server, "gpus")
        assert "NODE" in gpus_table and all(f"{j['node']}  " in gpus_table for j in [*running, two])
        jobs_table = _cli(server, "jobs")
        for job in [*running, two]:
            row = next((line for line in jobs_table.splitlines() if line.startswith(job["job_id"])), None)
            assert row is not None, jobs_table
            assert f" {job['node']} " in row, row
        # The cluster is full: a 1-GPU job waits, saying so.
        third = _submit(server, "pass", gpus=1)
        assert third["state"] == "queued" and "GPU" in third["message"], third
        flags.touch()
        for job in [*running, two]:
            ended = _ended(server, job["job_id"])
            assert ended["state"] == "succeeded"
            assert _log(server, job["job_id"]).split() == [job["node"], ",".join(map(str, job["gpu_indices"]))]
        assert _ended(server, third["job_id"])["state"] == "succeeded"
    finally:
        flags.close()


def test_logs_follow_live_and_cancel_stops_the_job(server: RunningServer, cluster: RayCluster) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(7)))\n"
        "print('started', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    job = _submit(server, code)
    wait_for(lambda: "started" in _log(server, job["job_id"]), 60, "the log's first line, live")
    assert _job(server, job["job_id"])["state"] == "running"
    server.rest("POST", f"/v1/jobs/{job['job_id']}/cancel", server.admin_token)
    ended = _ended(server, job["job_id"])
    assert ended["state"] == "cancelled" and ended["exit_code"] == 7, ended
    assert "got SIGTERM" in _log(server, job["job_id"])


def test_a_dataset_crosses_to_a_node_once(server: RunningServer, cluster: RayCluster, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "big.bin").write_bytes(os.urandom(3 << 20))
    _cli(server, "push", str(data), "--name", "rays-data")
    code = "import os; print(os.path.getsize(os.path.join(os.environ['GPUPORT_DATASETS_DIR'], 'rays-data', 'big.bin')))"
    first = _ended(server, _submit(server, code, datasets=["rays-data"], gpus=2)["job_id"])
    assert first["state"] == "succeeded" and _log(server, first["job_id"]).strip() == str(3 << 20)
    node = next(n for n in cluster.nodes if n.name == first["node"])
    blobs = [p for p in (node.root / "gpuport" / "blobs").rglob("*") if p.is_file() and p.stat().st_size == 3 << 20]
    assert len(blobs) == 1, blobs
    placed = blobs[0].stat().st_ino
    second = _ended(server, _submit(server, code, datasets=["rays-data"], gpus=2)["job_id"])
    assert second["state"] == "succeeded" and second["node"] == first["node"]
    assert blobs[0].stat().st_ino == placed  # not sent again: the node's copy is the one placed first


def test_the_fair_queue_spans_the_nodes(server: RunningServer, cluster: RayCluster) -> None:
    tokens = {}
    for name in ("ray-alice", "ray-bob"):
        reply = server.rest("POST", "/v1/tokens", server.admin_token, json={"name": name})
        assert reply.status_code == 201, reply.text
        tokens[name] = reply.json()["token"]
    flags = Flags(cluster)
    try:
        alice = [_submit(server, HOLD, tokens["ray-alice"], gpus=1) for _ in range(6)]
        wait_for(lambda: sum(_job(server, j["job_id"])["state"] == "running" for j in alice) == 4)
        assert {_job(server, j["job_id"])["node"] for j in alice[:4]} == {"node-a", "node-b"}
        bob = _submit(server, "print('bob ran')", tokens["ray-bob"], gpus=1)
        queue = server.rest("GET", "/v1/queue", server.admin_token).json()
        # Alice's 5th holds the reservation (the first that waited); then Bob, who holds nothing,
        # goes ahead of Alice's 6th although he came later: the cluster's 4 GPUs are all hers.
        assert [j["id"] for j in queue] == [alice[4]["job_id"], bob["job_id"], alice[5]["job_id"]]
        flags.touch()
        assert _ended(server, bob["job_id"])["state"] == "succeeded"
        for job in alice:
            assert _ended(server, job["job_id"])["state"] == "succeeded"
    finally:
        flags.close()


def test_a_wrong_or_missing_token_or_address_stops_the_server_saying_why(cluster: RayCluster, tmp_path: Path) -> None:
    def refused(address: str, token: str) -> str:
        env = server_env(RAY_AUTH_TOKEN=token) if token else server_env()
        done = start_server(tmp_path / "state", "--ray", address, env=env, expect_ready=False)
        assert done.process.returncode != 0
        return "\n".join(done.output)

    said = refused(cluster.address, "not-the-token")
    assert f"the Ray cluster at {cluster.address} refused this server's token" in said, said
    said = refused(cluster.address, "")
    assert "wants a token: give the server the cluster's token in RAY_AUTH_TOKEN" in said, said
    said = refused("127.0.0.9:9", cluster.token)
    assert "cannot reach the Ray cluster at 127.0.0.9:9" in said, said


def test_a_cluster_without_token_authentication_is_refused_unless_insecure_on_loopback(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    open_cluster = start_cluster(tmp_path_factory.mktemp("ro"), ("solo",), authenticated=False)  # short: socket paths
    try:
        state = tmp_path_factory.mktemp("open-state")
        refused = start_server(state, "--ray", open_cluster.address, env=server_env(), expect_ready=False)
        said = "\n".join(refused.output)
        assert refused.process.returncode != 0
        assert f"the Ray cluster at {open_cluster.address} accepts requests without a token" in said, said
        assert "CVE-2023-48022" in said and "--ray-insecure" in said
        allowed = start_server(state, "--ray", open_cluster.address, "--ray-insecure", env=server_env())
        try:
            assert f"Ray at {open_cluster.address}: 1 node" in allowed.banner
        finally:
            allowed.stop()
    finally:
        open_cluster.close()


@pytest.mark.parametrize("killed", ["running", "placing"])
def test_a_restarted_server_finds_its_jobs_running_on_the_nodes(
    cluster: RayCluster, tmp_path: Path, killed: str
) -> None:
    """The first server is killed once its job runs, or as soon as it has placed the job on a node
    (its node may still be launching it then): either way the job runs once and is watched again."""
    state = tmp_path / "state"
    first = _start(cluster, state)
    flags = Flags(cluster)
    try:
        job = _submit(first, HOLD + "print('released', flush=True)\nraise SystemExit(5)\n", gpus=1)
        if killed == "placing":
            wait_for(lambda: (state / "jobs" / job["job_id"] / "placement.json").exists(), 60, "the job's placement")
        else:
            wait_for(lambda: _job(first, job["job_id"])["state"] == "running")
        first.stop(signal.SIGKILL)
        second = _start(cluster, state)
        second.admin_token = first.admin_token  # shown on the first start only
        try:
            assert _job(second, job["job_id"])["state"] == "running"
        finally:
            second.stop()  # SIGTERM: a stop that lets go of the cluster records nothing of the job
        third = _start(cluster, state)
        third.admin_token = first.admin_token
        try:
            assert _job(third, job["job_id"])["state"] == "running"
            flags.touch()
            ended = _ended(third, job["job_id"])
            assert (ended["state"], ended["exit_code"]) == ("failed", 5), ended
            assert _log(third, job["job_id"]) == "released\n"
        finally:
            third.stop()
    finally:
        flags.close()


def test_a_node_lost_mid_job_fails_its_job_and_leaves_nothing_running(
    server: RunningServer, cluster: RayCluster
) -> None:
    flags = Flags(cluster)
    lost = None
    try:
        # node-a is packed first: fill it, so that the next job goes to node-b.
        filler = _submit(server, HOLD, gpus=2)
        wait_for(lambda: _job(server, filler["job_id"])["node"] == "node-a")
        victim = _submit(server, HOLD, gpus=1)
        victim = wait_for(lambda: (j := _job(server, victim["job_id"]))["state"] == "running" and j)
        assert victim["node"] == "node-b"
        retried = _submit(server, HOLD + "print('ran on', os.environ['GPUPORT_NODE'])", gpus=1, retries=1)
        assert wait_for(lambda: (j := _job(server, retried["job_id"]))["state"] == "running" and j)["node"] == "node-b"
        node = next(n for n in cluster.nodes if n.name == "node-b")
        holders = wait_for(
            lambda: node.running(victim["job_id"]),
            30,
            "the job's supervisor to run under node-b's raylet",
        )
        lost_at = time.monotonic()
        lost = node
        node.raylet().kill()
        ended = _ended(server, victim["job_id"], timeout=60)
        took = time.monotonic() - lost_at
        assert ended["state"] == "failed" and ended["message"].startswith("node lost: node-b"), ended
        assert took < 30, f"the loss took {took:.1f}s to be seen"
        wait_for(lambda: not any(p.is_running() for p in holders), 15, "the lost node's job processes to end")
        # The job with a retry is queued again instead: it waits for a GPU (node-a's are taken). Its
        # own watcher may see the loss a moment after the victim's did.
        seen: list[dict] = []
        wait_for(
            lambda: (seen.append(_job(server, retried["job_id"])) or seen[-1])["state"] == "queued",
            60,
            lambda: f"the retried job queued again (it is {seen[-1]['state']}: {seen[-1]['message']!r})",
        )
        # The node comes back: the cluster has two nodes again, and work goes to it.
        _restart(server, cluster, node)
        lost = None
        again = _submit(server, "import os; print(os.environ['GPUPORT_NODE'])", gpus=1)
        ended = _ended(server, again["job_id"], 90)
        assert ended["state"] == "succeeded", (ended["message"], ended["node"], _log(server, again["job_id"]))
        assert _log(server, again["job_id"]).strip() == "node-b"
        flags.touch()
        ended = _ended(server, retried["job_id"], 90)
        assert ended["state"] == "succeeded" and _log(server, retried["job_id"]) == "ran on node-b\n", ended
    finally:
        flags.close()
        if lost is not None:  # the tests after this one need both nodes
            _restart(server, cluster, lost)


def test_a_job_whose_node_stops_answering_as_it_starts_is_placed_again(cluster: RayCluster, tmp_path: Path) -> None:
    # A server of its own: the node it finds silent is one it no longer uses (the shared one's must).
    server = _start(cluster, tmp_path / "state")
    flags = Flags(cluster)
    node = next(n for n in cluster.nodes if n.name == "node-b")
    agents: list = []
    try:
        filler = _submit(server, HOLD, gpus=2)  # node-a first: the next job goes to node-b
        wait_for(lambda: _job(server, filler["job_id"])["state"] == "running")
        assert _job(server, filler["job_id"])["node"] == "node-a"
        agents = node.running("NodeAgent")
        assert agents, [p.name() for p in node.processes()]
        for agent in agents:
            agent.suspend()  # node-b's agent hangs: the job's start there gets no answer
        job = _submit(server, "import os; print('ran on', os.environ['GPUPORT_NODE'])", gpus=1)
        said = f"job {job['job_id']}: queued again: node node-b left while the job was started there"
        wait_for(lambda: any(said in line for line in server.output), 60, "the job queued again, its node silent")
        assert _job(server, job["job_id"])["state"] == "queued"
        flags.touch()  # node-a's GPUs free up: the job runs there
        ended = _ended(server, job["job_id"], 90)
        assert ended["state"] == "succeeded" and _log(server, job["job_id"]) == "ran on node-a\n", ended
    finally:
        for agent in agents:
            with contextlib.suppress(psutil.Error):
                agent.resume()
        flags.close()
        server.stop()


def _restart(server: RunningServer, cluster: RayCluster, node: RayNode) -> None:
    """Start a lost node again, and wait until the server places work on it."""
    node.kill()
    cluster.nodes.remove(node)
    cluster.join(node.name, "127.0.0.3")

    def nodes() -> set[str]:
        return {g["node"] for g in server.rest("GET", "/v1/gpus", server.admin_token).json()["gpus"]}

    wait_for(lambda: nodes() == {"node-a", node.name}, 90, lambda: f"the server to see {node.name} again: {nodes()}")


SCRIPTS = Path(__file__).parent / "_distributed"


def test_a_job_over_two_nodes_gets_the_ranks_environment_and_logs_of_both(
    server: RunningServer, cluster: RayCluster
) -> None:
    code = (
        "import json, os\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'MASTER_ADDR', 'GPUPORT_NODE',"
        " 'GPUPORT_NODE_RANK', 'GPUPORT_NODE_IPS', 'CUDA_VISIBLE_DEVICES']\n"
        "print(json.dumps({k: os.environ.get(k) for k in keys}))\n"
        "print(json.dumps(json.loads(os.environ['TF_CONFIG'])))\n"
    )
    job = _submit(server, code, nodes=2, nprocs_per_node=1, gpus_per_node=1)
    ended = _ended(server, job["job_id"])
    assert ended["state"] == "succeeded", (ended["message"], _log(server, job["job_id"]))
    assert ended["nodes"] == 2 and sorted(node for node, _ in ended["placement"]) == ["node-a", "node-b"]
    lines = _log(server, job["job_id"]).splitlines()
    envs = {int(line[1]): json.loads(line[4:]) for line in lines if line[4:].startswith('{"RANK"')}
    configs = {int(line[1]): json.loads(line[4:]) for line in lines if line[4:].startswith('{"cluster"')}
    assert sorted(envs) == [0, 1], lines
    ips = "127.0.0.2,127.0.0.3" if ended["placement"][0][0] == "node-a" else "127.0.0.3,127.0.0.2"
    for rank, env in envs.items():
        node, gpus = ended["placement"][rank]
        assert env == {
            "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
            "NODE_RANK": str(rank), "MASTER_ADDR": ips.split(",")[0], "GPUPORT_NODE": node,
            "GPUPORT_NODE_RANK": str(rank), "GPUPORT_NODE_IPS": ips, "CUDA_VISIBLE_DEVICES": str(gpus[0]),
        }  # fmt: skip
        assert configs[rank]["task"] == {"type": "worker", "index": rank}
        assert [a.split(":")[0] for a in configs[rank]["cluster"]["worker"]] == ips.split(",")


def test_a_failing_rank_on_one_node_stops_the_job_on_the_other(server: RunningServer, cluster: RayCluster) -> None:
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(120)\n"
    started = time.monotonic()
    ended = _ended(server, _submit(server, code, nodes=2)["job_id"])
    assert (ended["state"], ended["exit_code"]) == ("failed", 3), ended
    assert ended["message"].startswith("rank 1 exited with code 3"), ended["message"]
    assert time.monotonic() - started < 30


def test_more_nodes_than_the_cluster_has_is_refused(server: RunningServer) -> None:
    reply = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": ["true"], "nodes": 3})
    assert reply.status_code == 409 or reply.status_code >= 400, reply.text
    assert "asked for 3 nodes; the cluster has 2" in reply.text


@pytest.mark.parametrize("script", ["torch_ddp.py", "tf_multiworker.py"], ids=["torch-ddp", "tf-mwms"])
def test_distributed_training_across_two_nodes_ends_with_equal_weights(
    server: RunningServer, cluster: RayCluster, script: str
) -> None:
    pytest.importorskip("torch" if script.startswith("torch") else "tensorflow")
    _cli(server, "push", str(SCRIPTS), "--name", "distributed-scripts")
    reply = server.rest(
        "POST",
        "/v1/jobs",
        server.admin_token,
        json={"command": ["python", script], "project": "distributed-scripts", "nodes": 2},
    )
    assert reply.status_code == 201, reply.text
    ended = _ended(server, reply.json()["job_id"], timeout=240)
    log = _log(server, ended["job_id"])
    assert ended["state"] == "succeeded", (ended["message"], log)
    sums = {line.split()[0]: line.rsplit(" ", 1)[1] for line in log.splitlines() if "sha256" in line}
    assert sorted(sums) == ["[0]", "[1]"] and sums["[0]"] == sums["[1]"], log


# ---- serving: a model's replicas on the nodes, fed by the front door's batcher ------------------------


def _model_ended(server: RunningServer, info: gpuport.ModelInfo) -> None:
    """Undeploy it, and wait for its replicas' jobs to end: their GPUs are free for the next test."""
    with server.connect() as gpu:
        jobs = list(gpu.model(info.name).jobs)
        gpu.undeploy(info.name)
    for job_id in jobs:
        _ended(server, job_id)


def _dashboard(server: RunningServer, browser: Any) -> Any:
    """The dashboard in Chromium, logged in as the admin, its board shown."""
    sync_api = pytest.importorskip("playwright.sync_api")
    page = browser.new_context(ignore_https_errors=True).new_page()
    page.goto(server.http_url + "/")
    page.fill("#token", server.admin_token)
    page.click("#login button[type=submit]")
    sync_api.expect(page.locator("#board")).to_be_visible()
    return page


def test_a_model_s_replicas_run_on_both_nodes_and_answer_tritonclient_and_kserve_rest(
    server: RunningServer, tmp_path: Path, browser: Any
) -> None:
    triton_http = pytest.importorskip("tritonclient.http")
    np = pytest.importorskip("numpy")
    with server.connect() as gpu:
        # Two GPUs each: a node holds one replica, so the second lands on the other node.
        info = gpu.deploy("ray-where", where_model(tmp_path), replicas=2, gpus=2, max_batch_size=0, timeout=180)
    try:
        assert info.state == "ready" and sorted(info.nodes) == ["node-a", "node-b"], info
        # tritonclient over HTTPS: two requests at once, each held a moment, take both replicas.
        headers = {"Authorization": f"Bearer {server.admin_token}"}
        cert = str(server.state_dir / "tls" / "cert.pem")
        address = server.http_url.removeprefix("https://").rstrip("/")
        with triton_http.InferenceServerClient(
            url=address, ssl=True, ssl_options={"ca_certs": cert}, concurrency=2
        ) as client:
            assert client.is_model_ready("ray-where", headers=headers)
            pending = []
            for value in (1.0, 2.0):
                tensor = triton_http.InferInput("x", [1, 2], "FP32")
                tensor.set_data_from_numpy(np.array([[1.0, value]], dtype=np.float32))
                pending.append(client.async_infer("ray-where", [tensor], headers=dict(headers)))
            results = [p.get_result(timeout=60) for p in pending]
        assert [r.as_numpy("y").tolist() for r in results] == [[[2.0]], [[4.0]]]
        assert {r.as_numpy("node")[0, 0].decode() for r in results} == {"node-a", "node-b"}
        # The KServe v2 REST path, JSON both ways.
        y, node = answer(ask(server, "ray-where", 0.0, 21.0))
        assert y == 42.0 and node in ("node-a", "node-b")
        # `gpuport models` says each replica's node, piped and on a terminal.
        listed = _cli(server, "models")
        row = next(line for line in listed.splitlines() if line.startswith("ray-where"))
        assert "NODES" in listed and "node-a" in row and "node-b" in row, listed
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
        env.update(client_env(server))
        with Command(["models"], env, None, "terminal", columns=200) as on_terminal:
            assert on_terminal.wait(60) == 0, on_terminal.raw
        assert all(word in on_terminal.text for word in ("NODES", "node-a", "node-b")), on_terminal.raw
        # The dashboard too.
        page = _dashboard(server, browser)
        expect = pytest.importorskip("playwright.sync_api").expect
        expect(page.locator("#models th", has_text="nodes")).to_have_count(1, timeout=15_000)
        expect(page.locator("#models tr", has_text="ray-where")).to_contain_text("node-a")
        expect(page.locator("#models tr", has_text="ray-where")).to_contain_text("node-b")
        page.context.close()
    finally:
        _model_ended(server, info)


def test_a_replica_on_a_lost_node_fails_its_request_at_once_and_is_restarted_on_the_other(
    server: RunningServer, cluster: RayCluster, tmp_path: Path
) -> None:
    flags = Flags(cluster)
    lost = None
    info = None
    try:
        holder = _submit(server, HOLD, gpus=1)  # node-a is packed first: one of its GPUs is held
        assert wait_for(lambda: (j := _job(server, holder["job_id"]))["state"] == "running" and j)["node"] == "node-a"
        with server.connect() as gpu:
            info = gpu.deploy("ray-lost", where_model(tmp_path), replicas=2, gpus=1, max_batch_size=0, timeout=180)
            assert list(info.nodes) == ["node-a", "node-b"], info
            flags.touch()  # the holder ends: node-a has room for a replica again
            assert _ended(server, holder["job_id"])["state"] == "succeeded"
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                # A request held in flight on each replica; then node-b goes.
                asked = [pool.submit(lambda v=v: (ask(server, "ray-lost", 12.0, v), time.monotonic())) for v in (1, 2)]
                wait_for(lambda: gpu.model("ray-lost").requests == 2, 30, "both requests sent to the replicas")
                node = next(n for n in cluster.nodes if n.name == "node-b")
                lost = node
                node.raylet().kill()
                killed_at = time.monotonic()
                replies = [future.result(timeout=90) for future in asked]
            failed = [(reply, at) for reply, at in replies if reply.status_code != 200]
            served = [(reply, at) for reply, at in replies if reply.status_code == 200]
            assert len(failed) == 1 and len(served) == 1, [r.text for r, _ in replies]
            reply, at = failed[0]
            # An error naming the node, at once: not after the model's 12 s, and never a hang.
            assert reply.status_code >= 500 and "on node node-b" in reply.json()["error"], reply.text
            assert at - killed_at < 10, f"the request on the lost node failed {at - killed_at:.1f}s after the loss"
            assert answer(served[0][0]) in ((2.0, "node-a"), (4.0, "node-a"))
            # The other replica serves meanwhile; the lost one is started again where there is room.
            assert answer(ask(server, "ray-lost", 0.0, 5.0)) == (10.0, "node-a")
            seen: list[gpuport.ModelInfo] = []
            wait_for(
                lambda: (seen.append(gpu.model("ray-lost")) or seen[-1]).nodes == ("node-a", "node-a"),
                60,
                lambda: f"the lost replica restarted on node-a (it is {seen[-1].state}: {seen[-1].nodes})",
            )
            assert seen[-1].state == "ready" and seen[-1].jobs[0] == info.jobs[0] and seen[-1].jobs[1] != info.jobs[1]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda v: answer(ask(server, "ray-lost", 0.5, v)), (1.0, 2.0)))
            assert answers == [(2.0, "node-a"), (4.0, "node-a")]
    finally:
        flags.close()
        if info is not None:
            _model_ended(server, info)
        if lost is not None:  # the tests after this one need both nodes
            _restart(server, cluster, lost)


# ---- sessions: a worker on a node, reached through its agent's link --------------------------------


def _node() -> str:
    return os.environ["GPUPORT_NODE"]


def _total(values: Any) -> float:
    return float(values.sum())


def _twice(values: Any) -> Any:
    return values * 2


def _digest(values: Any) -> str:
    import hashlib

    return hashlib.sha256(values.tobytes()).hexdigest()


def _made_there(size: int) -> Any:
    import numpy as np

    return np.arange(size // 4, dtype=np.uint32)


def _fail(message: str) -> None:
    raise ValueError(message)


def _alive(processes: list[psutil.Process]) -> bool:
    alive = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            alive.append(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    return any(alive)


def test_a_session_runs_on_a_node_with_its_values_and_errors_there_and_closing_ends_its_worker(
    server: RunningServer, cluster: RayCluster
) -> None:
    np = pytest.importorskip("numpy")
    with server.connect() as gpu:
        with gpu.session() as session:
            node = session.call(_node)
            assert node in ("node-a", "node-b")
            info = session.info()
            assert (info.state, info.node) == ("running", node)
            ref = session.put(np.arange(10))
            assert session.call(_total, ref) == 45.0  # the Ref is resolved on the node
            doubled = session.call(_twice, ref, keep=True)
            assert session.get(doubled).tolist() == list(range(0, 20, 2))
            with pytest.raises(ValueError, match="no luck") as caught:
                session.call(_fail, "no luck")
            assert isinstance(caught.value, gpuport.RemoteError) and "_fail" in caught.value.remote_traceback
            assert session.call(_total, ref) == 45.0  # the worker lives on
            # 50 MB through the front door both ways, as bytes over the node's link.
            big = np.frombuffer(os.urandom(50 << 20), dtype=np.uint8)
            big_ref = session.put(big)
            assert session.call(_digest, big_ref) == hashlib.sha256(big.tobytes()).hexdigest()
            assert np.array_equal(session.get(big_ref), big)
            made = session.get(session.call(_made_there, 50 << 20, keep=True))
            assert np.array_equal(made, np.arange((50 << 20) // 4, dtype=np.uint32))
            where = next(n for n in cluster.nodes if n.name == node)
            workers = where.running(info.job_id)
            assert workers, "the session's worker runs under its node's raylet"
        wait_for(lambda: not _alive(workers), 30, "the closed session's worker to end on its node")


def test_sessions_land_on_both_nodes_and_a_lost_nodes_session_dies_naming_it(
    server: RunningServer, cluster: RayCluster, browser: Any
) -> None:
    lost = None
    with server.connect() as gpu:
        first = gpu.session(gpus=2)  # node-a is packed first: it fills it, and the next goes to node-b
        opened = [first]
        try:
            assert first.call(_node) == "node-a"
            second = gpu.session(gpus=1)
            opened.append(second)
            assert second.call(_node) == "node-b"
            kept = second.put([1, 2, 3])
            listed = _cli(server, "sessions")
            assert "NODE" in listed and "node-a" in listed and "node-b" in listed, listed
            env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
            env.update(client_env(server))
            with Command(["sessions"], env, None, "terminal", columns=160) as on_terminal:
                assert on_terminal.wait(60) == 0, on_terminal.raw
            assert all(word in on_terminal.text for word in ("NODE", "node-a", "node-b")), on_terminal.raw
            assert {s.id: s.node for s in gpu.sessions()} == {first.id: "node-a", second.id: "node-b"}
            page = _dashboard(server, browser)  # the dashboard says each session's node too
            expect = pytest.importorskip("playwright.sync_api").expect
            expect(page.locator("#sessions th", has_text="node")).to_have_count(1, timeout=15_000)
            expect(page.locator("#sessions tr", has_text=first.id)).to_contain_text("node-a")
            expect(page.locator("#sessions tr", has_text=second.id)).to_contain_text("node-b")
            page.context.close()
            node = next(n for n in cluster.nodes if n.name == "node-b")
            lost = node
            node.raylet().kill()
            seen: list[gpuport.SessionInfo] = []
            wait_for(
                lambda: (seen.append(second.info()) or seen[-1]).state == "died",
                60,
                lambda: f"the session to die with its node ({seen[-1].state}: {seen[-1].message!r})",
            )
            assert "node lost: node-b" in seen[-1].message
            with pytest.raises(gpuport.WorkerDied, match="node lost: node-b"):
                second.get(kept)
            assert first.call(_node) == "node-a"  # the other node's session lives on
            first.close()
            second.restart()  # a fresh worker where there is room: node-a
            assert second.call(_node) == "node-a"
            second.close()
        finally:
            for session in opened:
                with contextlib.suppress(gpuport.GpuportError):
                    session.close()
            if lost is not None:  # the tests after this one need both nodes
                _restart(server, cluster, lost)


def test_listing_jobs_while_a_node_hangs_answers_with_the_last_known_log_size(
    server: RunningServer, cluster: RayCluster
) -> None:
    flags = Flags(cluster)
    try:
        job = _submit(server, "print('x' * 99, flush=True)\n" + HOLD)
        with server.connect() as gpu:

            def listed() -> gpuport.JobInfo:
                return next(j.info for j in gpu.jobs() if j.id == job["job_id"])

            # Its node is asked for its log's size off the listing's way; the listing shows it once known.
            wait_for(lambda: listed().log_bytes == 100, 60, "the listing to show the log's size")
            node = next(n for n in cluster.nodes if n.name == listed().node)
            agents = node.running("NodeAgent")
            assert agents, [p.name() for p in node.processes()]
            for agent in agents:
                agent.suspend()  # the node's agent hangs: an actor call to it waits until it times out
            try:
                assert listed().log_bytes == 100  # as last known, rather than 0 after a call timed out
            finally:
                for agent in agents:
                    agent.resume()
        flags.touch()
        assert _ended(server, job["job_id"])["state"] == "succeeded"
    finally:
        flags.close()


def test_a_named_session_on_a_node_outlives_a_server_killed_with_sigkill(cluster: RayCluster, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = _start(cluster, state)
    second = None
    try:
        with first.connect() as gpu:
            session = gpu.session(name="kept", idle_timeout=120)
            session.put([1, 2, 3], name="values")
            node = session.call(_node)
        first.stop(signal.SIGKILL)
        second = _start(cluster, state)
        second.admin_token = first.admin_token  # shown on the first start only
        with second.connect() as gpu:
            again = gpu.session(name="kept")
            assert again.reattached and again.id == session.id
            assert again.get(again.ref("values")) == [1, 2, 3]  # its worker on the node kept them
            assert again.call(_node) == node
            again.close()
    finally:
        for running in (first, second):
            if running is not None:
                running.stop()


def test_a_deployment_on_a_node_outlives_a_server_killed_with_sigkill(cluster: RayCluster, tmp_path: Path) -> None:
    """The replica runs on through the front door's kill -9; the next server takes it up on its node
    and answers with it, without starting another."""
    state = tmp_path / "state"
    first = _start(cluster, state)
    second = None
    try:
        with first.connect() as gpu:
            info = gpu.deploy("kept-where", where_model(tmp_path), replicas=1, max_batch_size=0, timeout=180)
        assert info.state == "ready" and info.nodes[0] in ("node-a", "node-b"), info
        y, node = answer(ask(first, "kept-where", 0.0, 3.0))
        assert y == 6.0 and node == info.nodes[0]
        first.stop(signal.SIGKILL)
        second = _start(cluster, state)
        second.admin_token = first.admin_token  # shown on the first start only
        with second.connect() as gpu:
            again = wait_for(lambda: (m := gpu.model("kept-where")).state == "ready" and m, 120, "the model ready")
        assert again.jobs == info.jobs and again.nodes == info.nodes, again  # the same replica, on its node
        y, node = answer(ask(second, "kept-where", 0.0, 5.0))
        assert y == 10.0 and node == info.nodes[0]
        with second.connect() as gpu:
            gpu.undeploy("kept-where")
        for job_id in info.jobs:
            _ended(second, job_id)
    finally:
        for running in (first, second):
            if running is not None:
                running.stop()


def _exit_saying(code: int) -> None:
    print("exiting on purpose", file=sys.stderr, flush=True)
    os._exit(code)


def test_a_worker_that_exits_on_a_node_raises_worker_died_with_its_stderr_and_a_call_past_its_timeout_stops_it(
    server: RunningServer,
) -> None:
    with server.connect() as gpu, gpu.session() as session:
        first = session.call(_node)
        with pytest.raises(gpuport.WorkerDied) as died:
            session.call(_exit_saying, 3)
        assert died.value.exit_code == 3, died.value
        assert "exiting on purpose" in died.value.stderr_tail  # read from its run folder on the node
        assert session.info().state == "died"
        session.restart()
        assert session.call(_node) in ("node-a", "node-b") and first in ("node-a", "node-b")
        start = time.monotonic()
        with pytest.raises(gpuport.CallTimeout):
            session.call(time.sleep, 60, timeout=1)
        assert time.monotonic() - start < 30
        assert session.info().state == "died"


# ---- functions, notebooks, TensorFlow's remote device and large values on the nodes ----------------


def _node_after(seconds: float) -> str:
    import os
    import time

    time.sleep(seconds)  # both workers are busy at once: the pool needs two
    return os.environ["GPUPORT_NODE"]


def test_a_function_pool_spreads_over_both_nodes_and_answers_calls(server: RunningServer) -> None:
    with server.connect() as gpu:
        # Two GPUs a worker: a node holds one, so the pool's second worker lands on the other node.
        remote = gpu.function(_node_after, gpus=2, max_workers=2, timeout=120)
        try:
            nodes = remote.map([2.0, 2.0, 0.0, 0.0])
            assert set(nodes) == {"node-a", "node-b"}, nodes
            assert remote(0.0) in ("node-a", "node-b")
            with pytest.raises(ValueError, match="no luck"):
                gpu.function(_fail)("no luck")
        finally:
            remote.close()


def test_a_notebook_cell_runs_in_a_session_on_a_node(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("GPUPORT_URL", server.url)
    monkeypatch.setenv("GPUPORT_TOKEN", server.admin_token)
    monkeypatch.setenv("GPUPORT_FINGERPRINT", server.fingerprint)
    cells = [
        "%load_ext gpuport",
        "%%gpuport --session nb-ray --cpus 0.5\nimport os\nx = 21\nprint('on', os.environ['GPUPORT_NODE'])\nx * 2",
        "%gpuport_pull x\nprint(x + 1)",
        "%gpuport_close",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    client = nbclient.NotebookClient(
        notebook, timeout=180, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    nbformat.write(notebook, tmp_path / "ray.ipynb")  # with its outputs: an artifact to open when it fails
    ran = notebook.cells

    def text(cell: Any) -> str:
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")

    results = [str(o.data["text/plain"]) for o in ran[1].outputs if o.output_type == "execute_result"]
    assert results == ["42"], ran[1].outputs
    assert text(ran[1]) in ("on node-a\n", "on node-b\n"), ran[1].outputs
    assert text(ran[2]) == "22\n", ran[2].outputs
    with server.connect() as gpu:
        assert not [s for s in gpu.sessions() if s.name == "nb-ray" and s.state != "ended"]


TF_CLIENT = """
import json, sys
import gpuport
import tensorflow as tf

url, token, fingerprint, report = sys.argv[1:5]
with gpuport.connect(url, token, fingerprint=fingerprint) as gpu:
    with gpu.tensorflow(cpus=1) as remote:
        with tf.device(remote.device("CPU:0")):
            y = tf.constant([1.0, 2.0]) * 3
            node = tf.strings.strip(tf.io.read_file("/proc/self/environ"))
        where = [v.split("=", 1)[1] for v in node.numpy().decode().split("\\0") if v.startswith("GPUPORT_NODE=")]
        out = {"op": [y.device, y.numpy().tolist()], "node": where, "info": remote.session.info().node}
with open(report, "w") as f:
    json.dump(out, f)
"""


def test_tensorflow_s_remote_device_runs_ops_on_a_node(server: RunningServer, tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    report, script = tmp_path / "report.json", tmp_path / "client.py"
    script.write_text(TF_CLIENT)
    done = subprocess.run(
        [sys.executable, str(script), server.url, server.admin_token, server.fingerprint, str(report)],
        check=False,
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=180,  # TensorFlow starts on both ends; a tunnel that never opens fails here
    )
    assert done.returncode == 0 and report.exists(), done.stdout + done.stderr
    seen = json.loads(report.read_text())
    assert seen["op"] == ["/job:worker/replica:0/task:0/device:CPU:0", [3.0, 6.0]]
    assert seen["info"] in ("node-a", "node-b") and seen["node"] == [seen["info"]], seen


def test_a_1_gib_value_goes_to_a_node_and_back_whole_through_the_front_door(server: RunningServer) -> None:
    np = pytest.importorskip("numpy")
    big = np.frombuffer(os.urandom(1 << 30), dtype=np.uint8)
    digest = hashlib.sha256(big).hexdigest()
    with server.connect() as gpu, gpu.session() as session:
        ref = session.put(big)
        assert session.call(_digest, ref) == digest
        back = session.get(ref)
        assert back.shape == big.shape and hashlib.sha256(back).hexdigest() == digest


def _uploads_mapped() -> int:
    with open("/proc/self/maps") as maps:
        return sum("memfd:gpuport-upload" in line for line in maps)


def _exit_in(seconds: float) -> None:
    import os
    import threading
    import time

    threading.Thread(target=lambda: (time.sleep(seconds), os._exit(5)), daemon=True).start()


def test_values_on_a_node_arrive_in_memory_its_worker_maps_and_stay_whole_across_calls(server: RunningServer) -> None:
    """The node's agent receives a large value from its link into a memfd that the worker maps (as the
    front door does on one machine), and sends results back from the worker's memory: sizes around
    the chunks (1 MiB) and the inline limit (4 MiB), each checked by its hash, again and again; a worker
    that dies while a value is on its way raises WorkerDied, never a hang."""
    np = pytest.importorskip("numpy")
    sizes = [0, 1, (1 << 20) - 1, (4 << 20) + 1, (9 << 20) + 12345]
    with server.connect() as gpu, gpu.session() as session:
        kept = []
        for size in sizes:
            value = np.frombuffer(os.urandom(size), dtype=np.uint8)
            kept.append((session.put(value), hashlib.sha256(value).hexdigest(), size))
        assert session.call(_uploads_mapped) == 2  # the two large values, in the memfds the agent filled
        for _ in range(2):  # kept on the node across calls, and got again
            for ref, digest, size in kept:
                assert session.call(_digest, ref) == digest
                back = session.get(ref)
                assert back.nbytes == size and hashlib.sha256(back).hexdigest() == digest, size
        session.delete(kept[3][0])
        made = session.get(session.call(_made_there, (6 << 20) + 4, keep=True))  # made there, not put
        assert np.array_equal(made, np.arange(((6 << 20) + 4) // 4, dtype=np.uint32))
        assert session.call(_digest, kept[4][0]) == kept[4][1]
        session.call(_exit_in, 0.5)
        start = time.monotonic()
        with pytest.raises(gpuport.WorkerDied):
            session.put(np.zeros(256 << 20, dtype=np.uint8))  # the worker dies while it is on its way
        assert time.monotonic() - start < 120
