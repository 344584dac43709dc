"""One user cannot push the others off (issue 32, point 6), on real servers: a flood of bare
connections at the data port, a flood of dashboard logins, thousands of ended jobs, a deep queue."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import gpuport
from tests.conftest import JobFlag, RunningServer, client_env, needs_users, start_server, wait_for

# Holds until the flag file named by argv[1] appears in its folder (see JobFlag).
HOLD = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)"


@pytest.fixture(scope="module")
def fair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of this module's own: its tests set quotas and fill its job table."""
    running = start_server(tmp_path_factory.mktemp("fair") / "state")
    yield running
    running.stop()


@pytest.fixture
def flag(fair: RunningServer) -> Iterator[JobFlag]:
    raised = JobFlag(fair.state_dir)
    yield raised
    raised.close()


@pytest.fixture
def boss(fair: RunningServer) -> Iterator[gpuport.Client]:
    with fair.connect() as client:
        yield client


def _token(admin: gpuport.Client, name: str) -> str:
    needs_users()
    return admin.create_token(f"{name}-{len(admin.tokens())}").token


def test_every_running_job_is_listed_past_a_thousand_ended_ones(
    fair: RunningServer, boss: gpuport.Client, flag: JobFlag, cli: object
) -> None:
    token = _token(boss, "erin")
    with fair.connect(token) as erin:
        boss.set_quota(erin.user, jobs=1)  # the rest wait behind the running one: cancelled at once
        running = erin.submit(["python", "-c", HOLD, str(flag)], workdir=None)
        wait_for(lambda: running.status == "running", what="erin's first job")
        started = time.monotonic()
        for _ in range(1_010):
            erin.submit(["true"], workdir=None).cancel()
        print(f"1,010 submits and cancels in {time.monotonic() - started:.1f}s")
        listed = erin.jobs(all=True)
        assert [j.id for j in listed if j.status == "running"] == [running.id]
        # Newest first: the 500 newest ended ones, then the running one, older than all of them.
        assert [j.status for j in listed] == ["cancelled"] * 500 + ["running"]
        rest = fair.rest("GET", "/v1/jobs?all=true", token=token)
        assert rest.status_code == 200 and running.id in [j["id"] for j in rest.json()]
        shown = cli("jobs", "--all", **client_env(fair, token))  # type: ignore[operator]
        assert shown.code == 0 and running.id in shown.stdout
        flag.touch()
        assert running.wait(30).info.state == "succeeded"
