"""Job arrays and sweeps (Slurm's --array), and dependencies between jobs (--after), through the
Python API, the CLI and REST, against the real server; and the scheduler's side of them, pure."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from pathlib import Path

import pytest

import gpuport
from gpuport.server.scheduler import Holding, Pending, Request, plan
from tests.conftest import RunningServer, client_env, start_server, touch_in_job, wait_for

# Prints its index and the array's ids, then waits for the file "go" in its working folder.
HOLD = (
    "import os, time\n"
    "e = os.environ\n"
    "print(e['GPUPORT_ARRAY_INDEX'], e['SLURM_ARRAY_TASK_ID'], e['GPUPORT_ARRAY_ID'], e['SLURM_ARRAY_JOB_ID'], "
    "e['SLURM_ARRAY_TASK_COUNT'], flush=True)\n"
    "while not os.path.exists('go'): time.sleep(0.02)\n"
)
# Waits for "go", then exits with the code in its first argument (0 without one).
GATE = "import os, sys, time\nwhile not os.path.exists('go'): time.sleep(0.02)\nsys.exit(int((sys.argv[1:] or ['0'])[0]))\n"


def _name() -> str:
    return f"arr-{uuid.uuid4().hex[:6]}"  # the server is shared: every test its own names


def _release_running(server: RunningServer, array: gpuport.JobArray) -> None:
    for task in array.info.tasks:
        if task.state == "running":
            with contextlib.suppress(OSError):  # it ended meanwhile, and its folder went
                touch_in_job(server.state_dir, task.id, "go")


def _release_all(server: RunningServer, array: gpuport.JobArray, cap: int, timeout: float = 120) -> int:
    """Let the running tasks end until all have, checking that never more than ``cap`` ran at once;
    the most seen running."""
    deadline = time.monotonic() + timeout
    most = 0
    while not array.refresh().ended:
        assert time.monotonic() < deadline, f"array {array.id} still has tasks after {timeout:g} s"
        running = array.info.counts().get("running", 0)
        assert running <= cap
        most = max(most, running)
        _release_running(server, array)
        time.sleep(0.02)
    return most


# ---- arrays -----------------------------------------------------------------------------------------


def test_an_array_gives_each_task_its_index_and_runs_at_most_n_at_once(
    server: RunningServer, admin: gpuport.Client, cli: object
) -> None:
    name = _name()
    array = admin.submit(["python", "-c", HOLD], workdir=None, array="1-11:2%2", name=name)
    assert [t.id for t in array.tasks] == [f"{array.id}_{i}" for i in (1, 3, 5, 7, 9, 11)]
    assert array.info.max_running == 2 and array.name == name
    wait_for(lambda: array.refresh().counts().get("running") == 2, what="two tasks running")
    waiting = [t for t in array.refresh().tasks if t.state == "queued"]
    assert len(waiting) == 4 and all("(%2)" in t.message and array.id in t.message for t in waiting)
    # `gpuport jobs`: the array on one line, with its tasks counted by state; --json lists each task.
    env = client_env(server)
    listed = cli("jobs", "--name", name, **env)  # type: ignore[operator]
    assert f"{array.id}[1,3,5,7,9,11]" in listed.stdout and "2 running, 4 queued" in listed.stdout, listed.output
    assert len([line for line in listed.stdout.splitlines() if array.id in line]) == 1
    each = json.loads(cli("jobs", "--name", name, "--json", **env).stdout)  # type: ignore[operator]
    assert sorted(j["array_index"] for j in each) == [1, 3, 5, 7, 9, 11]
    assert _release_all(server, array, 2) == 2  # the cap holds until the end, whatever order they end in
    assert array.info.counts() == {"succeeded": 6}
    for task in array.tasks:
        index = str(task.info.array_index)
        assert list(task.logs()) == [f"{index} {index} {array.id} {array.id} 6"]


def test_a_sweep_runs_the_grid_streams_prefixed_lines_and_fails_if_a_task_fails(
    server: RunningServer, cli: object, tmp_path: Path
) -> None:
    script = (
        "import json, os, sys\n"
        "lr, batch = sys.argv[sys.argv.index('--lr') + 1], sys.argv[sys.argv.index('--batch') + 1]\n"
        "print('args', ' '.join(sys.argv[1:]))\n"
        "print('env', os.environ['GPUPORT_SWEEP_LR'], os.environ['GPUPORT_SWEEP_BATCH'])\n"
        "open(os.path.join(os.environ['GPUPORT_OUTPUT_DIR'], 'point.json'), 'w').write(json.dumps([lr, batch]))\n"
        "sys.exit(3 if (lr, batch) == ('1e-4', '64') else 0)\n"
    )
    (tmp_path / "train.py").write_text(script)
    outputs = tmp_path / "out"
    result = cli(  # type: ignore[operator]
        "run", "--sweep", "lr=1e-3,1e-4", "--sweep", "batch=32,64", "--output-dir", str(outputs),
        "-w", str(tmp_path), "--", "python", "train.py",
        **client_env(server),
    )  # fmt: skip
    assert result.code == 3, result.output  # the first failed task's exit status
    grid = [("1e-3", "32"), ("1e-3", "64"), ("1e-4", "32"), ("1e-4", "64")]
    lines = result.stdout.splitlines()
    for index, (lr, batch) in enumerate(grid):
        assert f"[{index}] args --lr {lr} --batch {batch}" in lines
        assert f"[{index}] env {lr} {batch}" in lines
        assert json.loads((outputs / str(index) / "point.json").read_text()) == [lr, batch]
    assert "4 tasks, 3 succeeded, 1 failed" in result.stderr and "not succeeded: 3" in result.stderr


def test_cancel_and_download_take_an_arrays_name(
    server: RunningServer, admin: gpuport.Client, cli: object, tmp_path: Path
) -> None:
    name = _name()
    script = "import os\nopen(os.path.join(os.environ['GPUPORT_OUTPUT_DIR'], 'i'), 'w').write(os.environ['SLURM_ARRAY_TASK_ID'])\n"
    done = admin.submit(["python", "-c", script], workdir=None, array="0,2", name=name + "-done").wait(60)
    env = client_env(server)
    fetched = cli("download", name + "-done", "-o", str(tmp_path / "dl"), **env)  # type: ignore[operator]
    assert fetched.code == 0, fetched.output
    assert [(tmp_path / "dl" / i / "i").read_text() for i in ("0", "2")] == ["0", "2"]
    assert done.info.counts() == {"succeeded": 2}

    held = admin.submit(["python", "-c", GATE], workdir=None, array="0-9%3", name=name)
    wait_for(lambda: held.refresh().counts().get("running") == 3, what="three tasks running")
    result = cli("cancel", name, **env)  # type: ignore[operator]
    assert result.code == 0 and "7 tasks cancelled, 3 stopping" in result.stderr, result.output
    assert held.wait(60).info.counts() == {"cancelled": 10}
    again = cli("cancel", held.id, **env)  # type: ignore[operator]
    assert again.code == 1 and "nothing to cancel" in again.stderr
    status = cli("wait", held.id, **env)  # type: ignore[operator]
    # The first task that did not succeed says the status: task 0 ran, and SIGTERM stopped it.
    assert status.code == 128 + signal.SIGTERM and "10 cancelled" in status.stderr, status.output


def test_arrays_through_rest(server: RunningServer) -> None:
    token = server.admin_token
    body = {"command": ["python", "-c", "import sys, os; print(sys.argv[1:], os.environ['GPUPORT_SWEEP_LR'])"]}
    reply = server.rest("POST", "/v1/arrays", token, json={**body, "sweep": {"lr": [0.001, "1e-4"]}, "array": "%1"})
    assert reply.status_code == 201, reply.text
    array = reply.json()
    assert array["max_running"] == 1 and [t["job_id"] for t in array["tasks"]] == [
        f"{array['array_id']}_0",
        f"{array['array_id']}_1",
    ]
    wait_for(
        lambda: server.rest("GET", f"/v1/arrays/{array['array_id']}", token).json()["counts"] == {"succeeded": 2},
        what="both tasks succeeded",
    )
    logs = [server.rest("GET", f"/v1/jobs/{t['job_id']}/logs", token).json()["data"] for t in array["tasks"]]
    assert logs == ["['--lr', '0.001'] 0.001\n", "['--lr', '1e-4'] 1e-4\n"]
    bad = server.rest("POST", "/v1/arrays", token, json={**body, "array": "0-5:0"})
    assert bad.status_code == 400 and "step" in bad.json()["error"]["message"], bad.text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"array": "5-1"}, "ends before it starts"),
        ({"array": "0-9%0"}, "%N needs a whole number of 1 or more"),
        ({"array": "a-b"}, "is not an index or a range"),
        ({"array": "0-10000"}, "10001 tasks in one array or sweep; the most is 10000"),
        ({"sweep": {"lr": []}}, "has no values"),
        ({"sweep": {"l r": ["1"]}}, "sweep parameter 'l r'"),
        ({"sweep": {"a": list(map(str, range(101))), "b": list(map(str, range(100)))}}, "10100 tasks"),
        ({"sweep": {"lr": ["1"]}, "array": "0-3"}, "give only %N"),
    ],
)
def test_malformed_arrays_are_refused_and_nothing_is_queued(
    admin: gpuport.Client, options: dict[str, object], message: str
) -> None:
    name = _name()
    with pytest.raises(gpuport.InvalidRequest, match=message):
        admin.submit(["true"], workdir=None, name=name, **options)  # type: ignore[call-overload]
    assert admin.jobs(name=name, all=True) == []


def test_an_array_over_the_queued_cap_is_refused_whole(
    server: RunningServer, admin: gpuport.Client, user_token: str, cli: object
) -> None:
    with server.connect(user_token) as gpu:
        held = gpu.submit(["python", "-c", GATE], workdir=None)  # what the others wait for: they stay queued
        admin.set_quota(held.info.owner, queued=5)
        try:
            gpu.submit(["true"], workdir=None, after=held.id)
            with pytest.raises(gpuport.ResourceUnavailable, match="5 tasks would make 6 jobs of .* queued") as e:
                gpu.submit(["true"], workdir=None, after=held.id, array="0-4")
            assert "nothing was queued" in str(e.value)
            assert len(gpu.jobs(state="queued")) == 1
            env = client_env(server, user_token)
            result = cli("run", "--array", "0-4", "--after", held.id, "--", "true", **env)  # type: ignore[operator]
            assert result.code == 1 and "the most allowed at once is 5" in result.stderr
            array = gpu.submit(["true"], workdir=None, after=held.id, array="0-3")  # exactly up to the cap
            assert len(array.tasks) == 4 and len(gpu.jobs(state="queued")) == 5
        finally:
            admin.unset_quota(held.info.owner)
            touch_in_job(server.state_dir, held.id, "go")
            wait_for(lambda: not gpu.jobs(state=["queued", "running"]), what="the user's jobs ended")


def test_an_arrays_name_is_held_while_a_task_is_unfinished(admin: gpuport.Client) -> None:
    name = _name()
    array = admin.submit(["python", "-c", GATE], workdir=None, array="0-1", name=name)
    with pytest.raises(gpuport.Conflict, match=f"array {array.id} .* is named '{name}'"):
        admin.submit(["true"], workdir=None, name=name)
    assert admin.array(name).id == array.id
    with pytest.raises(gpuport.NotFound, match="is a job array of 2 tasks"):
        admin.job(name)
    array.cancel()
    assert array.wait(60).info.counts() == {"cancelled": 2}


# ---- dependencies -------------------------------------------------------------------------------------


def test_a_job_waits_for_its_dependency_to_succeed_and_says_so(
    server: RunningServer, admin: gpuport.Client, cli: object
) -> None:
    first = admin.submit(["python", "-c", GATE], workdir=None, name=_name())
    then = admin.submit(["python", "-c", "print('then')"], workdir=None, after=first.info.name)
    assert then.info.state == "queued" and then.info.message == f"waits for {first.id} to succeed"
    shown = cli("queue", **client_env(server))  # type: ignore[operator]
    assert f"waits for {first.id} to succeed" in shown.stdout, shown.output
    wait_for(lambda: first.refresh().state == "running", what="the first job running")
    assert then.refresh().state == "queued"
    touch_in_job(server.state_dir, first.id, "go")
    assert then.wait(60).info.state == "succeeded" and list(then.logs()) == ["then"]


def test_a_failed_dependency_cancels_under_ok_and_not_under_any(server: RunningServer, admin: gpuport.Client) -> None:
    first = admin.submit(["python", "-c", GATE, "4"], workdir=None)
    ok = admin.submit(["true"], workdir=None, after=f"{first.id}:ok")
    anyway = admin.submit(["true"], workdir=None, after=[f"{first.id}:any"])
    assert anyway.info.message == f"waits for {first.id} to end"
    chained = admin.submit(["true"], workdir=None, after=ok.id)  # waits for one that will be cancelled
    wait_for(lambda: first.refresh().state == "running", what="the first job running")
    touch_in_job(server.state_dir, first.id, "go")
    assert first.wait(60).info.state == "failed"
    assert ok.wait(60).info.state == "cancelled"
    assert (
        ok.info.message
        == f"cancelled: {first.id} ended failed, and this job was to run only once {first.id} succeeded (after {first.id}:ok)"
    )
    assert chained.wait(60).info.state == "cancelled" and ok.id in chained.info.message
    assert anyway.wait(60).info.state == "succeeded"
    with pytest.raises(gpuport.Conflict, match=f"{first.id} has already ended failed, so this job could never run"):
        admin.submit(["true"], workdir=None, after=first.id)


def test_a_job_waits_for_a_whole_array(server: RunningServer, admin: gpuport.Client, cli: object) -> None:
    name = _name()
    array = admin.submit(["python", "-c", GATE], workdir=None, array="0-2", name=name)
    result = cli("run", "-d", "--after", f"{name}:ok", "--", "true", **client_env(server))  # type: ignore[operator]
    assert result.code == 0, result.output
    then = admin.job(result.stdout.strip())
    assert then.info.message.startswith(f"waits for array {array.id} (3 of 3 tasks left) to succeed")
    wait_for(lambda: array.refresh().counts().get("running") == 3, what="the tasks running")
    touch_in_job(server.state_dir, array.tasks[0].id, "go")
    wait_for(lambda: "2 of 3 tasks left" in then.refresh().message, what="one task less to wait for")
    array.refresh()
    _release_running(server, array)
    assert then.wait(60).info.state == "succeeded", (then.info, list(then.logs()))


def test_dependencies_are_checked_when_submitted(server: RunningServer, admin: gpuport.Client, user_token: str) -> None:
    mine = admin.submit(["true"], workdir=None).wait(30)
    with server.connect(user_token) as gpu:
        with pytest.raises(gpuport.NotFound, match=f"--after {mine.id}: no job"):
            gpu.submit(["true"], workdir=None, after=mine.id)  # another user's: as if it did not exist
        theirs = gpu.submit(["true"], workdir=None).wait(30)
    with pytest.raises(gpuport.PermissionDenied, match="may wait only for its own user's jobs"):
        admin.submit(["true"], workdir=None, after=theirs.id)  # an admin sees it, and may not either
    with pytest.raises(gpuport.NotFound, match="no job named 'nobody-has-this'"):
        admin.submit(["true"], workdir=None, after="nobody-has-this:any")
    with pytest.raises(gpuport.InvalidRequest, match="an empty item"):
        admin.submit(["true"], workdir=None, after=f"{mine.id},")
    assert admin.submit(["true"], workdir=None, after=mine.id).wait(30).info.state == "succeeded"  # already met


def test_a_restarted_server_keeps_the_wait(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_server(state)
    token, fingerprint = first.admin_token, first.fingerprint
    try:
        with first.connect() as gpu:
            before = gpu.submit(["python", "-c", GATE], workdir=None)
            after = gpu.submit(["python", "-c", "print('after')"], workdir=None, after=before.id)
            capped = gpu.submit(["python", "-c", GATE], workdir=None, array="0-2%1")
            wait_for(lambda: before.refresh().state == "running", what="the first job running")
            wait_for(lambda: capped.refresh().counts().get("running") == 1, what="one task running")
    finally:
        first.stop(signal.SIGKILL)
    second = start_server(state)
    try:
        with gpuport.connect(second.url, token, fingerprint=fingerprint) as gpu:
            waiting = gpu.job(after.id)
            assert waiting.info.state == "queued" and waiting.info.message == f"waits for {before.id} to succeed"
            assert gpu.array(capped.id).counts() == {"running": 1, "queued": 2}  # its %1 too
            touch_in_job(state, before.id, "go")
            assert waiting.wait(60).info.state == "succeeded"
            array = gpu.array(capped.id)
            _release_all(second, array, 1)
            assert array.info.counts() == {"succeeded": 3}
    finally:
        second.stop()


# ---- the scheduler's side, pure ------------------------------------------------------------------------


def test_plan_keeps_an_arrays_cap_and_a_blocked_job_waits_without_reserving() -> None:
    from gpuport.server.scheduler import Machine

    machine = Machine((16 << 30,) * 2, 8.0, 64 << 30)
    queued = [Pending(f"a_{i}", "u", Request(), seq=i, group="a") for i in range(5)]
    queued.append(Pending("w", "u", Request(gpus=2), seq=10, blocked="waits for x to succeed"))
    queued.append(Pending("v", "v", Request(gpus=2), seq=11))
    running = [Holding("a_9", "u", Request(), (), group="a")]
    decisions = {d.job_id: d for d in plan(queued, running, machine, caps={"a": 3})}
    started = [j for j, d in decisions.items() if d.gpu_indices is not None]
    assert sorted(started) == ["a_0", "a_1", "v"]  # 1 running + 2 = the cap; w reserves nothing, v starts
    assert decisions["a_2"].reason.startswith("array a runs 3 of its tasks, the most at once (%3)")
    assert decisions["w"].reason.startswith("waits for x to succeed") and not decisions["w"].reserves
