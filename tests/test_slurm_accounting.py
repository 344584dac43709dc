"""Accounting on Slurm: the usage gpuport records for Slurm jobs is what Slurm's accounting says.

The test cluster (tests/_slurm.py) keeps completion records (``JobCompType=jobcomp/filetxt``), which
``sacct --completion`` reads. Each job runs as a user of its own, so that ``GET /v1/usage`` (one
entry per user) gives each job's figures.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuport.server.executors.slurm import asked_gpus
from tests._slurm import SlurmCluster, missing, start_cluster
from tests.conftest import server_env, start_server, wait_for

pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "Slurm is here")

# Seconds a job's usage may differ from sacct's elapsed (times its GPUs, or its CPUs) once sacct has
# recorded the job: none, as gpuport takes sacct's figures. Before, the row counts from squeue's start
# to the supervisor's end, within about a second of them (a look every second, Slurm's whole seconds).
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.close()


def _sleeper(seconds: float) -> list[str]:
    code = f"import os, time\nprint(os.environ.get('CUDA_VISIBLE_DEVICES', ''), flush=True)\ntime.sleep({seconds})\n"
    return [sys.executable, "-c", code]


def _sacct(cluster: SlurmCluster, slurm_ids: list[str]) -> dict[str, tuple[int, int]]:
    """Slurm id → (elapsed seconds, allocated CPUs), as sacct reads Slurm's completion records."""
    fields = "JobIDRaw,ElapsedRaw,AllocCPUS,State"
    done = cluster.run("sacct", "--completion", "-n", "-P", "-X", "-j", ",".join(slurm_ids), "-o", fields)
    found = {}
    for line in done.stdout.splitlines():
        slurm_id, elapsed, cpus, state = line.split("|")
        if state.startswith("COMPLETED"):
            found[slurm_id] = (int(elapsed), int(cpus))
    return found


def test_usage_of_slurm_jobs_is_sacct_elapsed_times_allocated_gpus_without_the_wait_in_slurms_queue(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    server = start_server(
        tmp_path / "state", "--slurm", "--shared-dir", str(shared), env=server_env(SLURM_CONF=str(cluster.conf))
    )
    try:
        with server.connect() as admin:
            tokens = {
                user: admin.create_token(user, admin=True).token for user in ("long", "wide", "behind", "cancelled")
            }

        def submit(user: str, seconds: float, gpus: int, cpus: int = 1) -> dict:
            body = {"command": _sleeper(seconds), "gpus": gpus, "cpus": cpus}
            reply = server.rest("POST", "/v1/jobs", tokens[user], json=body)
            assert reply.status_code == 201, reply.text
            return reply.json()

        def slurm_id(job: dict) -> str:
            path = shared / "jobs" / job["job_id"] / "slurm.id"
            return wait_for(lambda: path.exists() and path.read_text().strip(), 30, "its Slurm id")

        # Both GPUs for 3 s; behind it, one GPU for 1 s and one GPU and 2 CPUs for 2 s, which wait.
        wide = submit("wide", 3, gpus=2)
        wait_for(lambda: (shared / "jobs" / wide["job_id"] / "supervisor.json").exists(), 60, "the first job to run")
        behind = submit("behind", 1, gpus=1)
        long = submit("long", 2, gpus=1, cpus=2)
        cancelled = submit("cancelled", 1, gpus=2)
        jobs = {"wide": wide, "behind": behind, "long": long}
        ids = {user: slurm_id(job) for user, job in jobs.items()}
        wait_for(
            lambda: cluster.run("squeue", "-h", "-j", slurm_id(cancelled), "-o", "%T").stdout.strip() == "PENDING",
            30,
            "the job behind the first to wait in Slurm's queue",
        )
        assert server.rest("POST", f"/v1/jobs/{cancelled['job_id']}/cancel", tokens["cancelled"]).status_code == 200
        ended = {}
        for user, job in jobs.items():
            ended[user] = wait_for(
                lambda job=job, user=user: (
                    (j := server.rest("GET", f"/v1/jobs/{job['job_id']}", tokens[user]).json())["state"]
                    not in ("queued", "running")
                    and j
                ),
                60,
                f"the {user} job to end",
            )
            assert ended[user]["state"] == "succeeded", ended[user]
        allocated = {  # the GPUs Slurm gave each job, as the job saw them
            user: len(server.rest("GET", f"/v1/jobs/{job['job_id']}/logs", tokens[user]).json()["data"].split(","))
            for user, job in jobs.items()
        }
        assert allocated == {"wide": 2, "behind": 1, "long": 1}
        sacct = wait_for(lambda: len(s := _sacct(cluster, list(ids.values()))) == 3 and s, 30, "sacct's records")
        expected = {user: sacct[ids[user]][0] * allocated[user] for user in jobs}

        def usage() -> dict[str, dict]:
            reply = server.rest("GET", "/v1/usage", server.admin_token)
            assert reply.status_code == 200, reply.text
            return {e["user"]: e for e in reply.json()["entries"]}

        # The executor closes each row with sacct's figures a moment after the job ends.
        wait_for(
            lambda: all(
                abs(e.get("gpu_seconds", -9) - expected[u]) <= TOLERANCE
                and abs(e.get("cpu_seconds_reserved", -9) - sacct[ids[u]][0] * sacct[ids[u]][1]) <= TOLERANCE
                for u, e in ((u, usage().get(u, {})) for u in jobs)
            ),
            30,
            f"gpuport's usage to match sacct's {expected}",
        )
        entries = usage()
        for user in jobs:
            elapsed, cpus = sacct[ids[user]]
            assert entries[user]["gpu_seconds"] == pytest.approx(elapsed * allocated[user], abs=TOLERANCE), user
            assert entries[user]["cpu_seconds_reserved"] == pytest.approx(elapsed * cpus, abs=TOLERANCE), user
            assert entries[user]["runs"] == 1
        assert sacct[ids["long"]][1] == 2
        # The two behind the first waited in Slurm's queue, which gpuport does not count.
        for user in ("behind", "long"):
            handed_over = ended[user]["ended_at"] - ended[user]["created_at"]
            assert entries[user]["gpu_seconds"] < handed_over - 1.5, (user, entries[user], handed_over)
        assert "cancelled" not in entries  # it never ran: it held nothing
    finally:
        server.stop()


def test_a_job_that_ended_while_the_server_was_down_is_accounted_as_sacct_says(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    shared, state = tmp_path / "shared", tmp_path / "state"
    env = server_env(SLURM_CONF=str(cluster.conf))
    first = start_server(state, "--slurm", "--shared-dir", str(shared), env=env)
    body = {"command": _sleeper(2), "gpus": 2}
    reply = first.rest("POST", "/v1/jobs", first.admin_token, json=body)
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["job_id"]
    folder = shared / "jobs" / job_id
    wait_for(lambda: (folder / "supervisor.json").exists(), 60, "the job to run")
    first.stop(signal.SIGKILL)
    wait_for(lambda: (folder / "slurm.done").exists(), 60, "the job's end, with no server watching")
    slurm_id = (folder / "slurm.id").read_text().strip()
    sacct = wait_for(lambda: _sacct(cluster, [slurm_id]).get(slurm_id), 30, "sacct's record")
    second = start_server(state, "--slurm", "--shared-dir", str(shared), env=env)
    try:

        def used() -> tuple[float, float]:
            reply = second.rest("GET", "/v1/usage", first.admin_token)
            assert reply.status_code == 200, reply.text
            entries = reply.json()["entries"]  # none until the first look at sacct, if squeue never saw it run
            return (entries[0]["gpu_seconds"], entries[0]["cpu_seconds_reserved"]) if entries else (-1.0, -1.0)

        expected = (sacct[0] * 2.0, float(sacct[0] * sacct[1]))
        wait_for(lambda: used() == pytest.approx(expected, abs=TOLERANCE), 30, f"the usage to be sacct's {expected}")
    finally:
        second.stop()


@pytest.mark.parametrize(
    ("options", "asked"),
    [
        (["--gres=gpu:2"], (2, 1)),
        (["--gres=gpu:a100:1", "--nodes=3"], (1, 3)),
        (["--gres gpu:4 -N 2", "--gres=gpu:1"], (1, 2)),  # the last wins, as in sbatch
        (["-N2-4", "--job-name=x"], (0, 2)),
    ],
)
def test_the_gpus_and_nodes_a_script_asks_for(options: list[str], asked: tuple[int, int]) -> None:
    assert asked_gpus(options) == asked
