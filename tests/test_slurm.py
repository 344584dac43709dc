"""gpuport in front of a real Slurm cluster (`gpuport server --slurm`): jobs become Slurm jobs.

The cluster (tests/_slurm.py) is one node of this machine with 2 fake GPUs as gres; the shared
directory is a local folder. Jobs that hold wait for the file 'go' in their workdir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._slurm import UNTIL_TERM, SlurmCluster, missing, start_cluster
from tests._terminal import Command
from tests.conftest import CLIENT_ENV, RunningServer, client_env, server_env, start_server, wait_for

pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "Slurm is here")

HOLD = "import os, time\nwhile not os.path.exists('go'): time.sleep(0.05)\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.close()


def _start(cluster: SlurmCluster, state_dir: Path, shared: Path, *args: str) -> RunningServer:
    env = server_env(SLURM_CONF=str(cluster.conf))
    return start_server(state_dir, "--slurm", "--shared-dir", str(shared), *args, env=env)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def slurm_server(
    cluster: SlurmCluster, shared: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = _start(cluster, tmp_path_factory.mktemp("state"), shared)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _released(cluster: SlurmCluster, shared: Path) -> Iterator[None]:
    """Whatever a test leaves holding is released after it (the next test gets both GPUs)."""
    yield
    _go(shared)
    cluster.cancel_all()


def _go(shared: Path, job_id: str = "") -> None:
    for work in (shared / "jobs").glob(f"{job_id or '*'}/work"):
        (work / "go").touch()


def _submit(server: RunningServer, code: str, **spec: object) -> dict:
    reply = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": [sys.executable, "-c", code], **spec})
    assert reply.status_code == 201, reply.text
    return reply.json()


def _cli(server: RunningServer, *args: str, cwd: Path | None = None, code: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **client_env(server), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "gpuport", *args], check=False, env=env, cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == code, done.stdout + done.stderr
    return done


def _slurm_id(shared: Path, job_id: str) -> str:
    return wait_for(lambda: (p := shared / "jobs" / job_id / "slurm.id").exists() and p.read_text(), 30, "its Slurm id")


def test_the_banner_names_slurm(slurm_server: RunningServer) -> None:
    assert (
        "cluster      Slurm at partitions debug*, short, through Slurm's commands (sbatch, squeue): 1 node"
        in slurm_server.banner
    )


def test_a_job_gets_the_gpus_slurm_allocated_and_its_exit_code(
    slurm_server: RunningServer, cluster: SlurmCluster, shared: Path
) -> None:
    code = (
        "import os, sys\n"
        "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['SLURM_JOB_ID'], os.environ['SLURM_CPUS_PER_TASK'])\n"
        "open('result.txt', 'w').write('kept')\n"
        "sys.exit(3)\n"
    )
    job = _submit(slurm_server, code, gpus=2, cpus=2, outputs=["result.txt"])
    ended = slurm_server.ended(job["job_id"])
    assert (ended["state"], ended["exit_code"]) == ("failed", 3), ended
    slurm_id = _slurm_id(shared, job["job_id"])
    assert slurm_server.job_log(job["job_id"]) == f"0,1 {slurm_id} 2\n"
    files = slurm_server.rest("GET", f"/v1/jobs/{job['job_id']}/outputs", slurm_server.admin_token)
    assert files.status_code == 200 and "result.txt" in files.text, files.text
    one = _submit(slurm_server, "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))", gpus=1)
    assert slurm_server.ended(one["job_id"])["state"] == "succeeded"
    assert slurm_server.job_log(one["job_id"]) == "'0'\n"


def test_a_slice_of_a_gpu_is_one_of_the_clusters_gpu_shards(slurm_server: RunningServer, shared: Path) -> None:
    """The test cluster cuts each GPU into shards (gres/shard): a --gpu-memory job takes one, and
    Slurm shows it the GPU the shard is of."""
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['SLURM_SHARDS_ON_NODE'])"
    job = _submit(slurm_server, code, gpu_memory=4 << 30)
    ended = slurm_server.ended(job["job_id"])
    assert ended["state"] == "succeeded", slurm_server.job_log(job["job_id"])
    assert slurm_server.job_log(job["job_id"]) in ("0 1\n", "1 1\n")
    script = (shared / "jobs" / job["job_id"] / "slurm.sh").read_text()
    assert "#SBATCH --gres=shard:1\n" in script and "gres=gpu" not in script, script


def test_a_slice_of_a_gpu_is_refused_where_the_cluster_shares_no_gpu(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "slurm", shards=False)
    server = None
    try:
        env = server_env(SLURM_CONF=str(cluster.conf))
        server = start_server(tmp_path / "state", "--slurm", "--shared-dir", str(tmp_path / "shared"), env=env)
        reply = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": ["true"], "gpu_memory": 4 << 30})
        assert reply.status_code in (400, 409, 422) and "shares no GPU" in reply.text, reply.text
        assert "--gpus" in reply.text  # what to ask for instead
        assert server.rest("GET", "/v1/jobs?all=true", server.admin_token).json() == []  # nothing was stored
    finally:
        if server is not None:
            server.stop()
        cluster.cancel_all()
        cluster.close()


def test_a_job_slurm_holds_shows_slurms_reason_in_the_queue(slurm_server: RunningServer, shared: Path) -> None:
    first = _submit(slurm_server, HOLD, gpus=2)
    wait_for(lambda: (shared / "jobs" / first["job_id"] / "supervisor.json").exists(), 60, "the first job to run")
    second = _submit(slurm_server, HOLD + "print('second ran')\n", gpus=2)
    assert second["state"] == "running"  # handed over to Slurm at once: gpuport holds nothing back
    out = wait_for(
        lambda: second["job_id"] in (o := _cli(slurm_server, "queue").stdout) and "Slurm: Resources" in o and o,
        30,
        "the queue to show Slurm's reason",
    )
    assert first["job_id"] not in out  # it runs
    listed = slurm_server.rest("GET", "/v1/queue", slurm_server.admin_token)
    assert listed.status_code == 200, listed.text
    _go(shared, first["job_id"])
    assert slurm_server.ended(first["job_id"])["state"] == "succeeded"
    wait_for(
        lambda: second["job_id"] not in _cli(slurm_server, "queue").stdout, 30, "the second job to leave the queue"
    )
    _go(shared, second["job_id"])
    assert slurm_server.ended(second["job_id"])["state"] == "succeeded"
    assert slurm_server.job_log(second["job_id"]) == "second ran\n"


def test_cancel_stops_a_running_job_with_sigterm_and_a_pending_one_at_once(
    slurm_server: RunningServer, shared: Path
) -> None:
    running = _submit(slurm_server, UNTIL_TERM, gpus=2)
    wait_for(lambda: "started" in slurm_server.job_log(running["job_id"]), 60, "the log's first line, live")
    pending = _submit(slurm_server, HOLD, gpus=2)
    wait_for(lambda: pending["job_id"] in _cli(slurm_server, "queue").stdout, 30, "the second job pending")
    slurm_server.rest("POST", f"/v1/jobs/{pending['job_id']}/cancel", slurm_server.admin_token)
    assert slurm_server.ended(pending["job_id"])["state"] == "cancelled"
    slurm_server.rest("POST", f"/v1/jobs/{running['job_id']}/cancel", slurm_server.admin_token)
    ended = slurm_server.ended(running["job_id"])
    assert ended["state"] == "cancelled" and ended["exit_code"] == 7, ended
    assert "got SIGTERM" in slurm_server.job_log(running["job_id"])


SCRIPT = """#!/bin/sh
# an ordinary Slurm script
#SBATCH --job-name=mine
#SBATCH --gres=gpu:2
#SBATCH --time=5
#SBATCH --output=out-%j.txt

echo "$SLURM_JOB_NAME $CUDA_VISIBLE_DEVICES $*"
cat data.txt
exit 4
"""


def test_a_batch_script_runs_with_its_own_sbatch_lines(
    slurm_server: RunningServer, shared: Path, tmp_path: Path
) -> None:
    (tmp_path / "train.sh").write_text(SCRIPT)
    (tmp_path / "data.txt").write_text("synced\n")
    done = _cli(slurm_server, "sbatch", "--wait", "train.sh", "a", "b c", cwd=tmp_path, code=4)
    job_id = done.stdout.strip()
    assert slurm_server.job_log(job_id) == "mine 0,1 a b c\nsynced\n"
    slurm_id = _slurm_id(shared, job_id)
    job = slurm_server.job(job_id)
    assert job["state"] == "failed", job
    files = slurm_server.rest("GET", f"/v1/jobs/{job_id}/outputs", slurm_server.admin_token)
    assert files.status_code == 200 and f"out-{slurm_id}.txt" in files.text, files.text
    with slurm_server.connect() as client:  # the Python door, and REST's
        again = client.submit_batch(tmp_path / "train.sh", ["x"]).wait()
        assert again.info.exit_code == 4 and list(again.logs()) == ["mine 0,1 x", "synced"]
    snapshot = slurm_server.rest(
        "POST",
        "/v1/snapshots?name=script",
        slurm_server.admin_token,
        content=_tar(tmp_path),
        headers={"Content-Type": "application/x-tar"},
    )
    assert snapshot.status_code in (200, 201), snapshot.text
    rest = slurm_server.rest(
        "POST",
        "/v1/jobs",
        slurm_server.admin_token,
        json={"batch_script": "train.sh", "command": ["r"], "project": "script"},
    )
    assert rest.status_code == 201, rest.text
    assert slurm_server.ended(rest.json()["job_id"])["exit_code"] == 4
    assert slurm_server.job_log(rest.json()["job_id"]).startswith("mine 0,1 r\n")


def _tar(folder: Path) -> bytes:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("train.sh", "data.txt"):
            tar.add(folder / name, arcname=name)
    return buffer.getvalue()


def test_a_job_slurm_rejects_is_refused_with_slurms_message(slurm_server: RunningServer, tmp_path: Path) -> None:
    reply = slurm_server.rest("POST", "/v1/jobs", slurm_server.admin_token, json={"command": ["true"], "gpus": 5})
    assert reply.status_code == 400, reply.text
    assert "Slurm refused the job" in reply.text and "Requested node configuration is not available" in reply.text
    reply = slurm_server.rest(
        "POST", "/v1/jobs", slurm_server.admin_token, json={"command": ["true"], "partition": "nope"}
    )
    assert reply.status_code == 400 and "invalid partition" in reply.text.lower(), reply.text
    (tmp_path / "big.sh").write_text("#!/bin/sh\n#SBATCH --gres=gpu:9\ntrue\n")
    done = _cli(slurm_server, "sbatch", "big.sh", cwd=tmp_path, code=1)
    assert "Slurm refused the job" in done.stderr and "Requested node configuration" in done.stderr, done.stderr
    listed = slurm_server.rest("GET", "/v1/jobs?all=true", slurm_server.admin_token).text
    assert "big.sh" not in listed  # refused: never queued


def test_sbatch_on_a_terminal_says_where_the_job_went_and_exits_with_its_code(
    slurm_server: RunningServer, tmp_path: Path
) -> None:
    (tmp_path / "train.sh").write_text(SCRIPT)
    (tmp_path / "data.txt").write_text("synced\n")
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env.update(client_env(slurm_server))
    with Command(["sbatch", "--wait", "train.sh", "t"], env, tmp_path, "terminal") as sbatch:
        assert sbatch.wait() == 4, sbatch.text
    assert re.search(r"job (j-[0-9a-f]{8}) submitted to Slurm: gpuport logs -f \1 follows it", sbatch.text), sbatch.text


def test_a_batch_script_elsewhere_is_refused_saying_why(server: RunningServer, tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text(SCRIPT)
    done = _cli(server, "sbatch", "train.sh", cwd=tmp_path, code=1)
    assert "gpuport server --slurm" in done.stderr, done.stderr


def test_a_server_killed_and_restarted_finds_its_slurm_jobs(
    cluster: SlurmCluster, shared: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    first = _start(cluster, state, shared)
    job = _submit(first, HOLD + "print('released', flush=True)\nraise SystemExit(5)\n", gpus=1)
    wait_for(lambda: (shared / "jobs" / job["job_id"] / "supervisor.json").exists(), 60, "the job to run")
    ended_meanwhile = _submit(first, "print('quick')", gpus=1)
    _slurm_id(shared, ended_meanwhile["job_id"])  # handed over to Slurm
    first.stop(signal.SIGKILL)
    wait_for(lambda: (shared / "jobs" / ended_meanwhile["job_id"] / "slurm.done").exists(), 60, "the quick job's end")
    second = _start(cluster, state, shared)
    second.admin_token = first.admin_token  # shown on the first start only
    try:
        assert second.job(job["job_id"])["state"] == "running"
        quick = second.ended(ended_meanwhile["job_id"])
        assert quick["state"] == "succeeded" and second.job_log(quick["job_id"]) == "quick\n"
        _go(shared, job["job_id"])
        ended = second.ended(job["job_id"])
        assert (ended["state"], ended["exit_code"]) == ("failed", 5), ended
        assert second.job_log(job["job_id"]) == "released\n"
    finally:
        second.stop()


def test_an_arrays_throttle_holds_its_tasks_back_on_slurm_too(slurm_server: RunningServer, shared: Path) -> None:
    # Four tasks of 1 CPU would all run at once on the node's 4 CPUs: only %2 holds them back.
    body = {"command": [sys.executable, "-c", HOLD], "array": "0-3%2", "cpus": 1}
    reply = slurm_server.rest("POST", "/v1/arrays", slurm_server.admin_token, json=body)
    assert reply.status_code == 201, reply.text
    tasks = [t["job_id"] for t in reply.json()["tasks"]]
    folders = [shared / "jobs" / task for task in tasks]
    wait_for(lambda: sum((f / "supervisor.json").exists() for f in folders) == 2, 60, "two tasks to run")
    queue = slurm_server.rest("GET", "/v1/queue", slurm_server.admin_token).json()
    held = sorted(j["job_id"] for j in queue if "the most at once (%2)" in j["message"])
    assert held == sorted(t for t, f in zip(tasks, folders) if not (f / "slurm.id").exists()), queue
    assert len(held) == 2, [(j["job_id"], j["message"]) for j in queue]  # the others are not Slurm's yet

    def all_ended() -> bool:
        _go(shared)
        return all(slurm_server.job(task)["state"] == "succeeded" for task in tasks)

    wait_for(all_ended, 120, "every task to end")
    spans = [json.loads((f / "exit.json").read_text()) for f in folders]
    at_once = max(sum(s["started_at"] <= t["started_at"] < s["ended_at"] for s in spans) for t in spans)
    assert at_once == 2, spans


def test_a_submit_waiting_on_slurm_does_not_hold_the_server_up(
    cluster: SlurmCluster, shared: Path, tmp_path: Path
) -> None:
    """sbatch --test-only (a submit's check) may wait on a busy slurmctld: other calls go on meanwhile."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    held, entered = tmp_path / "held", tmp_path / "entered"
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" --test-only "*) : > {entered}; while [ -e {held} ]; do sleep 0.05; done;; esac\n'
        f'exec {shutil.which("sbatch")} "$@"\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    held.touch()
    env = server_env(SLURM_CONF=str(cluster.conf), PATH=f"{bin_dir}:{os.environ['PATH']}")
    server = start_server(tmp_path / "state", "--slurm", "--shared-dir", str(shared), env=env)
    try:
        submitted: list[object] = []
        thread = threading.Thread(target=lambda: submitted.append(_submit(server, "print('checked')")))
        thread.start()
        wait_for(entered.exists, 30, "the submit to wait in sbatch --test-only")
        listed = server.rest("GET", "/v1/jobs", server.admin_token)  # 10 s at most: the loop answers
        assert listed.status_code == 200, listed.text
        assert thread.is_alive()  # still held in sbatch
        held.unlink()
        thread.join(60)
        assert submitted and server.ended(submitted[0]["job_id"])["state"] == "succeeded"  # type: ignore[index]
    finally:
        held.unlink(missing_ok=True)
        server.stop()


def test_slurm_options_alone_are_refused_saying_what_to_give(tmp_path: Path) -> None:
    def refused(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gpuport", "server", "--state-dir", str(tmp_path / "state"), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        return done.stderr

    assert "--slurm needs --shared-dir DIR" in refused("--slurm")
    assert "go with --slurm" in refused("--shared-dir", str(tmp_path))
