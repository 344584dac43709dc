"""gpuport in front of a real Slurm cluster through slurmrestd (`gpuport server --slurm --slurm-rest URL`).

The cluster (tests/_slurm.py, ``rest=True``) takes JWTs, and its slurmrestd runs as an unprivileged
user. The server's PATH starts with a folder whose sbatch, squeue, scancel and sinfo only record
that they were run and fail: what the REST path does must go through slurmrestd, whose log shows it.
Jobs that hold wait for the file 'go' in their workdir.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuport.protocol.errors import InvalidRequest
from gpuport.server.executors.slurm_rest import job_properties
from tests._slurm import UNTIL_TERM, SlurmCluster, rest_missing, start_cluster, start_rest
from tests.conftest import RunningServer, client_env, server_env, start_server, wait_for

HOLD = "import os, time\nprint('started', flush=True)\nwhile not os.path.exists('go'): time.sleep(0.05)\n"
REPLACED = ("sbatch", "squeue", "scancel", "sinfo")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if rest_missing():
        pytest.skip(rest_missing())
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"), rest=True)
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.close()


@pytest.fixture(scope="module")
def no_commands(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of stand-ins for the commands slurmrestd replaces: each records its use in 'used' and fails."""
    folder = tmp_path_factory.mktemp("bin")
    for name in REPLACED:
        tool = folder / name
        tool.write_text(
            f"#!/bin/sh\necho {name} >> {folder / 'used'}\necho '{name} is not for this server' >&2\nexit 1\n"
        )
        tool.chmod(0o755)
    return folder


def _env(cluster: SlurmCluster, no_commands: Path, **extra: str) -> dict[str, str]:
    path = f"{no_commands}{os.pathsep}{os.environ.get('PATH', '')}"
    return server_env(SLURM_CONF=str(cluster.conf), PATH=path, **extra)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def token_file(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "slurm.jwt"
    path.write_text(f"SLURM_JWT={cluster.token()}\n")  # as `scontrol token` writes it
    return path


@pytest.fixture(scope="module")
def rest_server(
    cluster: SlurmCluster, shared: Path, no_commands: Path, token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    args = ("--slurm", "--shared-dir", str(shared), "--slurm-rest", cluster.rest_url)
    env = _env(cluster, no_commands)
    running = start_server(tmp_path_factory.mktemp("state"), *args, "--slurm-rest-token-file", str(token_file), env=env)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _released(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a test of the cluster leaves holding is released after it; none ran a replaced command."""
    if "cluster" not in request.fixturenames:
        yield  # a test without Slurm
        return
    cluster, shared, no_commands = (request.getfixturevalue(name) for name in ("cluster", "shared", "no_commands"))
    yield
    for work in (shared / "jobs").glob("*/work"):
        (work / "go").touch()
    cluster.cancel_all()
    used = no_commands / "used"
    assert not used.exists(), f"the server ran {used.read_text().split()} instead of asking slurmrestd"


def test_sbatch_options_become_slurmrestds_job_properties_and_others_are_refused_by_name() -> None:
    found = job_properties(["--job-name=a -t 1-02:00 --mem=2G", "-N 2-3 --ntasks-per-node=4", "-p short -c2"])
    assert found == {
        "name": "a",
        "time_limit": 26 * 60,
        "memory_per_node": 2048,
        "nodes": [2, 3],
        "tasks_per_node": 4,
        "partition": "short",
        "cpus_per_task": 2,
    }
    assert job_properties(["--time=90", "--time 0:30", "--gres=gpu:2 --mem 512"]) == {
        "time_limit": 1,
        "gres": "gpu:2",
        "memory_per_node": 512,
    }
    with pytest.raises(InvalidRequest, match="#SBATCH --exclusive is not passed on through slurmrestd"):
        job_properties(["--exclusive"])
    with pytest.raises(InvalidRequest, match="not a value sbatch reads for --mem"):
        job_properties(["--mem=lots"])
    with pytest.raises(InvalidRequest, match="--time needs a value"):
        job_properties(["--time"])


def test_slurm_rest_options_without_slurm_are_refused_saying_what_goes_with_what(tmp_path: Path) -> None:
    def refused(*args: str) -> str:
        argv = [sys.executable, "-m", "gpuport", "server", "--state-dir", str(tmp_path / "state"), *args]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        return done.stderr

    assert "go with --slurm" in refused("--slurm-rest", "http://127.0.0.1:6820")
    shared = ("--slurm", "--shared-dir", str(tmp_path))
    assert "--slurm-rest-token-file goes with --slurm-rest URL" in refused(*shared, "--slurm-rest-token-file", "t")


def _submit(server: RunningServer, code: str, **spec: object) -> dict:
    reply = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": [sys.executable, "-c", code], **spec})
    assert reply.status_code == 201, reply.text
    return reply.json()


def _queue(server: RunningServer) -> str:
    env = {**os.environ, **client_env(server), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "gpuport", "queue"], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_job_runs_through_slurmrestd_its_log_streams_and_its_exit_code_comes_back(
    rest_server: RunningServer, cluster: SlurmCluster, shared: Path, token_file: Path
) -> None:
    assert f"through slurmrestd at {cluster.rest_url} (API v0.0.38): 1 node" in rest_server.banner
    code = HOLD + "import os, sys\nprint(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['SLURM_JOB_ID'])\nsys.exit(3)\n"
    job = _submit(rest_server, code, gpus=2, cpus=2, memory=256 << 20)
    wait_for(lambda: rest_server.job_log(job["job_id"]) == "started\n", 60, "the log's first line, while it runs")
    (shared / "jobs" / job["job_id"] / "work" / "go").touch()
    ended = rest_server.ended(job["job_id"])
    assert (ended["state"], ended["exit_code"]) == ("failed", 3), ended
    slurm_id = (shared / "jobs" / job["job_id"] / "slurm.id").read_text()
    assert rest_server.job_log(job["job_id"]) == f"started\n0,1 {slurm_id}\n"
    said = cluster.log("slurmrestd")
    assert "POST /slurm/v0.0.38/job/submit" in said and "GET /slurm/v0.0.38/jobs" in said, said

    # Tokens expire: the file is read again when it changes (here to a wrong one, then a fresh one).
    kept = token_file.read_text()
    token_file.write_text("not-a-token\n")
    refused = rest_server.rest("POST", "/v1/jobs", rest_server.admin_token, json={"command": ["true"]})
    assert refused.status_code == 400, refused.text
    token_file.write_text(kept + "\n")
    again = _submit(rest_server, "print('again')")
    assert rest_server.ended(again["job_id"])["state"] == "succeeded"
    assert rest_server.job_log(again["job_id"]) == "again\n"


def test_a_pending_job_shows_slurms_reason_and_cancel_ends_jobs_cancelled(
    rest_server: RunningServer, shared: Path
) -> None:
    running = _submit(rest_server, UNTIL_TERM, gpus=2)
    wait_for(lambda: "started" in rest_server.job_log(running["job_id"]), 60, "the first job to run")
    pending = _submit(rest_server, HOLD, gpus=2)
    wait_for(
        lambda: pending["job_id"] in (q := _queue(rest_server)) and "Slurm: Resources" in q,
        30,
        "the queue to show Slurm's reason",
    )
    rest_server.rest("POST", f"/v1/jobs/{pending['job_id']}/cancel", rest_server.admin_token)
    assert rest_server.ended(pending["job_id"])["state"] == "cancelled"
    rest_server.rest("POST", f"/v1/jobs/{running['job_id']}/cancel", rest_server.admin_token)
    ended = rest_server.ended(running["job_id"])
    assert ended["state"] == "cancelled" and ended["exit_code"] == 7, ended
    assert "got SIGTERM" in rest_server.job_log(running["job_id"])


def test_a_job_slurm_rejects_is_refused_with_slurms_message(rest_server: RunningServer) -> None:
    before = len(rest_server.rest("GET", "/v1/jobs?all=true", rest_server.admin_token).json())
    reply = rest_server.rest(
        "POST", "/v1/jobs", rest_server.admin_token, json={"command": ["true"], "partition": "nope"}
    )
    assert reply.status_code == 400, reply.text
    assert "Slurm refused the job" in reply.text and "Invalid partition name specified" in reply.text, reply.text
    reply = rest_server.rest("POST", "/v1/jobs", rest_server.admin_token, json={"command": ["true"], "gpus": 5})
    assert reply.status_code == 400 and "Requested node configuration is not available" in reply.text, reply.text
    after = rest_server.rest("GET", "/v1/jobs?all=true", rest_server.admin_token).json()
    assert len(after) == before  # refused: never queued


def test_a_batch_scripts_sbatch_lines_reach_slurmrestd_and_one_it_cannot_pass_is_refused(
    rest_server: RunningServer, tmp_path: Path
) -> None:
    env = {**os.environ, **client_env(rest_server)}

    def sbatch(script: str, code: int) -> subprocess.CompletedProcess[str]:
        (tmp_path / "train.sh").write_text(script)
        done = subprocess.run(
            [sys.executable, "-m", "gpuport", "sbatch", "--wait", "train.sh"],
            check=False,
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == code, done.stdout + done.stderr
        return done

    done = sbatch("#!/bin/sh\n#SBATCH --job-name=mine\n#SBATCH -t 0:30 --gres=gpu:1\necho $SLURM_JOB_NAME\n", 0)
    assert rest_server.job_log(done.stdout.strip()) == "mine\n"
    done = sbatch("#!/bin/sh\n#SBATCH --exclusive\ntrue\n", 1)
    assert "#SBATCH --exclusive is not passed on through slurmrestd" in done.stderr, done.stderr


def test_a_server_reaches_slurmrestd_on_its_unix_socket_too(
    cluster: SlurmCluster, no_commands: Path, tmp_path: Path
) -> None:
    args = ("--slurm", "--shared-dir", str(tmp_path / "shared"), "--slurm-rest", cluster.rest_socket)
    server = start_server(tmp_path / "state", *args, env=_env(cluster, no_commands, SLURM_JWT=cluster.token()))
    try:
        assert f"through slurmrestd at {cluster.rest_socket} (API v0.0.38)" in server.banner, server.banner
        job = _submit(server, "print('over the socket')", gpus=1)
        assert server.ended(job["job_id"])["state"] == "succeeded"
        assert server.job_log(job["job_id"]) == "over the socket\n"
    finally:
        server.stop()


def test_a_wrong_token_or_no_slurmrestd_stops_the_server_at_its_start_saying_why(
    cluster: SlurmCluster, no_commands: Path, tmp_path: Path
) -> None:
    args = ("--slurm", "--shared-dir", str(tmp_path / "shared"), "--slurm-rest", cluster.rest_url)
    env = _env(cluster, no_commands, SLURM_JWT="not-a-token")
    server = start_server(tmp_path / "state", *args, env=env, expect_ready=False)
    said = server.banner
    assert server.process.returncode != 0 and "ready" not in server.output, said
    assert f"slurmrestd at {cluster.rest_url}" in said and "scontrol token username=" in said, said
    env = _env(cluster, no_commands)
    server = start_server(tmp_path / "state", *args, env=env, expect_ready=False)
    assert "--slurm-rest-token-file FILE or SLURM_JWT" in server.banner, server.banner
    closed = "http://127.0.0.1:9"  # the discard port: nobody listens
    server = start_server(tmp_path / "state", *args[:-1], closed, env={**env, "SLURM_JWT": "x"}, expect_ready=False)
    assert f"slurmrestd at {closed}: " in server.banner and "is slurmrestd running there?" in server.banner


def test_a_slurmrestd_without_an_api_version_gpuport_speaks_is_refused_naming_both(
    cluster: SlurmCluster, no_commands: Path, tmp_path: Path
) -> None:
    older = start_rest(cluster, "openapi/v0.0.37", "slurmrestd-37")
    args = ("--slurm", "--shared-dir", str(tmp_path / "shared"), "--slurm-rest", older)
    env = _env(cluster, no_commands, SLURM_JWT=cluster.token())
    server = start_server(tmp_path / "state", *args, env=env, expect_ready=False)
    said = server.banner
    assert server.process.returncode != 0 and "ready" not in server.output, said
    assert f"slurmrestd at {older} offers the API versions v0.0.37; gpuport speaks v0.0.38" in said, said
