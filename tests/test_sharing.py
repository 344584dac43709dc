"""GPU sharing end to end, on a real server with two fake 16 GiB GPUs and real job processes:
requests, the queue and its order across a restart, slices and their enforcement, quotas, limits."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuport
from gpuport.defaults import DEFAULT_JOBS_PER_USER
from tests.conftest import JobFlag, RunningServer, client_env, needs_users, start_server, wait_for

GiB = 2**30
# Holds until the flag file named by argv[1] appears in its folder (see JobFlag).
HOLD = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)"
# "Allocates" fake GPU memory: declares argv[1] bytes on its GPU to the fake inventory, then holds.
USE_GPU = textwrap.dedent(
    """
    import os, sys, time
    gpu = os.environ["CUDA_VISIBLE_DEVICES"]
    path = os.path.join(os.environ["GPUPORT_FAKE_GPU_DIR"], str(os.getpid()))
    with open(path + ".tmp", "w") as f:
        f.write(f"{gpu} {sys.argv[1]}")
    os.replace(path + ".tmp", path)
    print("allocated", sys.argv[1], "on GPU", gpu, flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    """
)


@pytest.fixture(scope="module")
def sharing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of this module's own: its tests set quotas and fill the GPUs."""
    running = start_server(tmp_path_factory.mktemp("sharing") / "state")
    yield running
    running.stop()


@pytest.fixture
def flag(sharing: RunningServer) -> Iterator[JobFlag]:
    """A file whose appearance lets the test's holding jobs end; it is made at teardown too, so that a
    failed test leaves no job holding GPUs for the next."""
    raised = JobFlag(sharing.state_dir)
    yield raised
    raised.close()


@pytest.fixture
def admin_of(sharing: RunningServer) -> Iterator[gpuport.Client]:
    with sharing.connect() as client:
        yield client


def _user(server: RunningServer, admin: gpuport.Client, name: str) -> gpuport.Client:
    needs_users()
    names = {t.name for t in admin.tokens()}
    token = admin.create_token(f"{name}-{len(names)}").token
    return server.connect(token)


def _hold(gpu: gpuport.Client, flag: JobFlag, **request: object) -> gpuport.Job:
    return gpu.submit(["python", "-c", HOLD, str(flag)], workdir=None, **request)  # type: ignore[arg-type]


def test_requests_no_machine_could_satisfy_are_refused_at_submit(
    sharing: RunningServer, admin_of: gpuport.Client, cli: object
) -> None:
    before = len(admin_of.jobs(all=True))
    refusals = [
        ({"gpus": 3}, gpuport.ResourceUnavailable, "asked for 3 GPUs; this server has 2 x 16GiB"),
        (
            {"gpu_memory": "20GiB"},
            gpuport.ResourceUnavailable,
            "asked for a 20GiB slice of a GPU; this server has 2 x 16GiB",
        ),
        ({"cpus": 4096}, gpuport.ResourceUnavailable, "asked for 4096 CPUs; this server has"),
        ({"memory": "64TiB"}, gpuport.ResourceUnavailable, "asked for 64TiB of memory; this server has"),
        ({"gpus": 1, "gpu_memory": "1GiB"}, gpuport.InvalidRequest, "not both"),
        ({"priority": 500}, gpuport.InvalidRequest, "priority 500 is outside -100 .. 100"),
        ({"nprocs": 2, "tf_roles": {"chief": 1, "worker": 2}}, gpuport.InvalidRequest, "add up to 3 processes"),
        ({"nprocs": 2, "tf_roles": {"boss": 2}}, gpuport.InvalidRequest, "unknown TensorFlow role 'boss'"),
        ({"nprocs": 2, "gpus": 3}, gpuport.ResourceUnavailable, "asked for 3 GPUs"),
        ({"gpu_memory": "lots"}, gpuport.InvalidRequest, "cannot read 'lots' as a size"),
    ]
    for request, error, message in refusals:
        with pytest.raises(error) as caught:
            admin_of.submit(["true"], workdir=None, **request)  # type: ignore[arg-type]
        assert message in str(caught.value), (request, str(caught.value))
    assert len(admin_of.jobs(all=True)) == before  # nothing was created
    result = cli("run", "--gpus", "3", "--", "true", **client_env(sharing))  # type: ignore[operator]
    assert result.code == 1 and "asked for 3 GPUs; this server has 2 x 16GiB" in result.stderr


def test_only_admins_may_raise_a_priority(sharing: RunningServer, admin_of: gpuport.Client) -> None:
    with _user(sharing, admin_of, "prio") as user:
        with pytest.raises(gpuport.PermissionDenied, match="only an admin"):
            user.submit(["true"], workdir=None, priority=10)
        assert user.submit(["true"], workdir=None, priority=-10).wait(30).info.state == "succeeded"
    assert admin_of.submit(["true"], workdir=None, priority=10).wait(30).info.priority == 10


def test_the_queue_is_fair_between_users_and_explains_each_wait(
    sharing: RunningServer, admin_of: gpuport.Client, flag: JobFlag, cli: object
) -> None:
    with _user(sharing, admin_of, "alice") as alice, _user(sharing, admin_of, "bob") as bob:
        first = [_hold(alice, flag, gpus=1) for _ in range(2)]
        wait_for(lambda: all(j.status == "running" for j in first), what="alice's first jobs running")
        waiting = [_hold(alice, flag, gpus=1) for _ in range(5)]
        bobs = _hold(bob, flag, gpus=1)
        big = _hold(alice, flag, gpus=2, priority=-1)  # yields to everyone else
        queue = admin_of.queue()
        assert [j.id for j in queue][:2] == [waiting[0].id, bobs.id]  # the head (reserved), then bob
        assert [j.position for j in queue] == list(range(1, 8))
        assert queue[-1].id == big.id and "needs 2 GPUs, 0 free, 6 jobs ahead" in queue[-1].message
        assert queue[1].message == "needs 1 GPU, 0 free, 1 job ahead"
        mine = {j.id: j for j in bob.queue()}
        assert mine[waiting[0].id].command == () and mine[bobs.id].command  # others' commands stay private
        shown = cli("queue", **client_env(sharing))  # type: ignore[operator]
        assert shown.code == 0 and "needs 1 GPU, 0 free, 1 job ahead" in shown.stdout and bobs.id in shown.stdout
        assert bob.job(bobs.id).info.position == 2
        flag.touch()
        for job in [*first, *waiting, bobs, big]:
            assert job.wait(60).info.state == "succeeded"
        assert bobs.info.started_at <= min(j.info.started_at for j in waiting[1:])  # type: ignore[operator]


def test_slices_share_a_gpu_with_their_caps_and_show_in_gpus(
    sharing: RunningServer, admin_of: gpuport.Client, tmp_path: Path, flag: JobFlag, cli: object
) -> None:
    env_dump = (
        "import json, os, sys\n"
        "keys = ['CUDA_VISIBLE_DEVICES', 'GPUPORT_GPU_MEMORY', 'GPUPORT_GPU_MEMORY_FRACTION',"
        " 'XLA_PYTHON_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_PREALLOCATE', 'TF_FORCE_GPU_ALLOW_GROWTH',"
        " 'CUPY_GPU_MEMORY_LIMIT']\n"
        "print(json.dumps({k: os.environ.get(k) for k in keys}))\n"
        "print(sorted(m for m in ('tensorflow', 'torch', 'jax', 'cupy') if m in sys.modules))\n"
    )
    probe = admin_of.submit(["python", "-c", env_dump], workdir=None, gpu_memory="4GiB").wait(30)
    seen = json.loads(next(probe.logs()))
    assert seen == {
        "CUDA_VISIBLE_DEVICES": "0",
        "GPUPORT_GPU_MEMORY": str(4 * GiB),
        "GPUPORT_GPU_MEMORY_FRACTION": "0.250000",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.250000",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "CUPY_GPU_MEMORY_LIMIT": str(4 * GiB),
    }
    assert list(probe.logs())[1] == "[]"  # the bootstrap imported no framework
    work = tmp_path / "work"
    work.mkdir()
    (work / "use.py").write_text(USE_GPU)
    with _user(sharing, admin_of, "carol") as carol:
        a = carol.submit(["python", "use.py", str(3 * GiB), str(flag)], workdir=work, gpu_memory="6GiB")
        b = admin_of.submit(["python", "use.py", str(GiB), str(flag)], workdir=work, gpu_memory="6GiB")
        whole = _hold(admin_of, flag, gpus=1)
        for job in (a, b, whole):
            wait_for(lambda job=job: job.status == "running", what=f"{job.id} running")  # type: ignore[misc]
        assert a.info.gpu_indices == b.info.gpu_indices  # both slices on one GPU
        gpus = {g.index: g for g in admin_of.gpus()}
        shared = gpus[a.info.gpu_indices[0]]
        held = {x.job_id: x for x in shared.allocations}
        assert held[a.id].owner.startswith("carol") and held[a.id].memory == 6 * GiB

        def used() -> dict[str, int]:
            return {x.job_id: x.memory_used for g in admin_of.gpus() for x in g.allocations}

        wait_for(lambda: used().get(a.id) == 3 * GiB and used().get(b.id) == GiB, what="each slice's use read")
        other = gpus[1 - a.info.gpu_indices[0]]
        assert [(x.job_id, x.memory) for x in other.allocations] == [(whole.id, 0)]
        table = cli("gpus", **client_env(sharing))  # type: ignore[operator]
        assert f"{a.id} (carol" in table.stdout and "6GiB, uses 3GiB)" in table.stdout and "whole GPU" in table.stdout
        flag.touch()
        for job in (a, b, whole):
            assert job.wait(30).info.state == "succeeded"


def test_a_job_past_its_slice_is_killed_with_the_reason_in_status_and_log(
    admin_of: gpuport.Client, tmp_path: Path, flag: JobFlag
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "use.py").write_text(USE_GPU)
    used = int(9.1 * GiB)
    job = admin_of.submit(["python", "use.py", str(used), "never"], workdir=work, gpu_memory="8GiB")
    info = job.wait(30).info
    assert info.state == "killed"
    assert info.message == "exceeded its GPU memory slice of 8GiB (used 9.1GiB)"
    lines = list(job.logs())
    assert lines[0].startswith("allocated") and lines[-1] == f"gpuport: job killed: {info.message}"
    within = admin_of.submit(["python", "use.py", str(8 * GiB), str(flag)], workdir=work, gpu_memory="8GiB")
    wait_for(lambda: within.refresh().log_bytes, what="the job within its slice allocating")
    flag.touch()
    assert within.wait(30).info.state == "succeeded"  # at its slice exactly: fine


def test_a_job_past_its_memory_limit_is_killed(admin_of: gpuport.Client) -> None:
    hog = "import time\nx = bytearray(400 * 1024 * 1024)\nprint('holding', flush=True)\ntime.sleep(60)"
    job = admin_of.submit(["python", "-c", hog], workdir=None, memory="200MiB").wait(60)
    # Held by the kernel where the server has cgroups ("... of 200MiB"), else by the watchdog's poll
    # ("... of 200MiB (used 400.1MiB)"): tests/test_limits.py has both.
    assert job.info.state == "killed" and job.info.message.startswith("exceeded its memory limit of 200MiB")


def test_quotas_make_jobs_wait_and_only_admins_set_them(
    sharing: RunningServer, admin_of: gpuport.Client, flag: JobFlag, cli: object
) -> None:
    with _user(sharing, admin_of, "dave") as dave:
        with pytest.raises(gpuport.PermissionDenied):
            dave.set_quota(dave.user, gpus=5)
        admin_of.set_quota(dave.user, gpus=1, jobs=2)
        try:
            with pytest.raises(gpuport.ResourceUnavailable, match="quota of dave-.* is 1 at once"):
                dave.submit(["true"], workdir=None, gpus=2)
            held = _hold(dave, flag, gpus=1)
            wait_for(lambda: held.status == "running", what="dave's first job")
            over = _hold(dave, flag, gpus=1)
            assert (
                over.status == "queued"
                and over.info.message == f"over quota: {dave.user} holds 1 of 1 GPUs allowed at once"
            )
            cpu = _hold(dave, flag)
            wait_for(lambda: cpu.status == "running", what="a job without GPUs within the job quota")
            third = _hold(dave, flag)
            assert third.status == "queued" and f"over quota: {dave.user} runs 2 jobs" in third.info.message
            # A user sees their own quota and the default every user without one has.
            assert [(q.user, q.jobs) for q in dave.quotas()] == [("*", DEFAULT_JOBS_PER_USER), (dave.user, 2)]
            admin_of.set_quota(dave.user, gpus=2, jobs=3)  # raised: the job waiting on it starts at once
            wait_for(lambda: over.status == "running", what="the job over the old quota running")
            assert third.status == "queued" and f"over quota: {dave.user} runs 3 jobs" in third.refresh().message
            env = client_env(sharing)
            listed = cli("quota", "list", **env)  # type: ignore[operator]
            assert listed.code == 0 and dave.user in listed.stdout
            flag.touch()
            for job in (held, over, cpu, third):
                assert job.wait(30).info.state == "succeeded"
        finally:
            admin_of.unset_quota(dave.user)
        # still listed, for the storage they keep (their jobs' logs), but under the default's limits
        (listed_dave,) = [q for q in admin_of.quotas() if q.user == dave.user]
        assert listed_dave.updated_at == 0 and listed_dave.jobs == DEFAULT_JOBS_PER_USER
        result = cli("quota", "unset", dave.user, **client_env(sharing))  # type: ignore[operator]
        assert result.code == 1 and "no quota for" in result.stderr


def test_the_queue_order_survives_a_restart(tmp_path: Path) -> None:
    needs_users()
    state = tmp_path / "state"
    flag = JobFlag(state)
    first = start_server(state)
    try:
        with first.connect() as admin:
            users = [first.connect(admin.create_token(name).token) for name in ("erin", "frank")]
            holders = [_hold(users[0], flag, gpus=1) for _ in range(2)]
            wait_for(lambda: all(h.status == "running" for h in holders), what="both GPUs held")
            queued = [_hold(u, flag, gpus=g) for u in users for g in (1, 2)]
            before = [(j.id, j.position, j.message) for j in admin.queue()]
            assert len(before) == 4
            for user in users:
                user.close()
    finally:
        first.stop()
    again = start_server(state)
    try:
        with again.connect(first.admin_token) as admin:
            after = [(j.id, j.position, j.message) for j in admin.queue()]
            states = {j.id: (j.state, j.message) for j in (admin.job(h.id).info for h in [*holders, *queued])}
            assert after == before, (states, "\n".join(again.output[-30:]))
            flag.touch()
            for job in [*holders, *queued]:
                assert admin.job(job.id).wait(60).info.state == "succeeded"
    finally:
        flag.close()
        again.stop()


def test_a_deep_queue_is_looked_at_only_so_deep_yet_what_fits_behind_it_starts(tmp_path: Path) -> None:
    from gpuport.server.scheduler import LOOK_AHEAD

    state = tmp_path / "state"
    flag = JobFlag(state)
    server = start_server(state)
    try:
        with server.connect() as admin:
            holders = [_hold(admin, flag, gpus=1) for _ in range(2)]
            wait_for(lambda: all(h.status == "running" for h in holders), what="both GPUs held")
            deep = [_hold(admin, flag, gpus=1) for _ in range(LOOK_AHEAD + 10)]
            assert deep[0].info.position == 1 and "needs 1 GPU, 0 free" in deep[0].info.message
            last = admin.job(deep[-1].id).info
            assert last.state == "queued" and last.position == 0
            said = f"waiting behind the first {LOOK_AHEAD} jobs in the queue, none of which can start now"
            assert last.message == said
            # What each submit answered, those past the look-ahead without a pass of their own.
            replies = [j.info for j in deep]
            assert [r.position for r in replies] == [*range(1, LOOK_AHEAD + 1), *[0] * 10]
            assert all(r.message == said for r in replies[LOOK_AHEAD:])
            assert replies[LOOK_AHEAD - 1].message.endswith(f", {LOOK_AHEAD - 1} jobs ahead")
            cpu = admin.submit(["python", "-c", HOLD, str(flag)], workdir=None)  # asks for no GPU: it fits now
            assert cpu.info.state in ("queued", "running")
            wait_for(lambda: cpu.status == "running", what="the CPU job behind the deep queue to start")
            queue = admin.queue()
            assert [j.id for j in queue] == [j.id for j in deep]
            assert [j.position for j in queue] == list(range(1, len(deep) + 1))
            flag.touch()
            assert admin.job(deep[-1].id).wait(120).info.state == "succeeded"
    finally:
        flag.close()
        server.stop()


def test_cpus_reserve_and_set_thread_pools(admin_of: gpuport.Client) -> None:
    names = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
    show = f"import os; print(*(os.environ.get(n) for n in {names!r}))"
    job = admin_of.submit(["python", "-c", show], workdir=None, cpus=2)
    assert list(job.wait(30).logs()) == ["2 2 2"]
    job = admin_of.submit(["python", "-c", show], workdir=None, cpus=2, env={"TF_NUM_INTEROP_THREADS": "4"})
    assert list(job.wait(30).logs()) == ["2 2 4"]  # the job's own setting wins


@pytest.mark.parametrize("door", ["sdk", "rest"])
def test_requests_and_the_queue_through_both_doors(sharing: RunningServer, admin_of: gpuport.Client, door: str) -> None:
    body = {"command": ["true"], "gpu_memory": "2GiB", "cpus": 1, "memory": "1GiB", "priority": -5}
    if door == "sdk":
        job_id = admin_of.submit(["true"], workdir=None, gpu_memory="2GiB", cpus=1, memory="1GiB", priority=-5).id
    else:
        response = sharing.rest("POST", "/v1/jobs", sharing.admin_token, json=body)
        assert response.status_code == 201, response.text
        job_id = response.json()["job_id"]
    info = admin_of.job(job_id).wait(30).info
    assert (info.gpu_memory, info.cpus, info.memory, info.priority) == (2 * GiB, 1.0, GiB, -5)
    assert info.state == "succeeded"
    listed = sharing.rest("GET", "/v1/queue", sharing.admin_token)
    assert listed.status_code == 200 and isinstance(listed.json(), list)
    bad = sharing.rest("POST", "/v1/jobs", sharing.admin_token, json={**body, "gpu_memory": "99GiB"})
    assert bad.status_code >= 400 and "asked for a 99GiB slice" in bad.json()["error"]["message"]


def test_quotas_through_rest(sharing: RunningServer) -> None:
    put = sharing.rest("PUT", "/v1/quotas/ghost", sharing.admin_token, json={"gpus": 0.5})
    assert put.status_code == 200 and put.json()["gpus"] == 0.5 and put.json()["jobs"] is None
    assert "ghost" in [q["user"] for q in sharing.rest("GET", "/v1/quotas", sharing.admin_token).json()]
    assert sharing.rest("DELETE", "/v1/quotas/ghost", sharing.admin_token).status_code == 204
    assert sharing.rest("DELETE", "/v1/quotas/ghost", sharing.admin_token).status_code == 404


def test_the_environment_keeps_gpuport_names_reserved(admin_of: gpuport.Client) -> None:
    with pytest.raises(gpuport.InvalidRequest, match="set by gpuport"):
        admin_of.submit(["true"], workdir=None, env={"GPUPORT_GPU_MEMORY": "1"})
