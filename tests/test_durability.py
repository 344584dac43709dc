"""kill -9 the server while a job runs and others wait; start it again: nothing is lost. And 20 times
over, at random moments, with a session and a model live."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import gpuport
from tests.conftest import RunningServer, restartable_ports, start_server, touch_in_job, wait_for
from tests.test_serving_errors import _doubler_file

# Prints a numbered line every 20 ms until the flag file appears in its folder, then 5 more, then
# exits with 7.
COUNTER = textwrap.dedent(
    """
    import os, sys, time
    flag = sys.argv[1]
    i = 0
    while not os.path.exists(flag):
        print(f"line {i}", flush=True)
        i += 1
        time.sleep(0.02)
    for _ in range(5):
        print(f"line {i}", flush=True)
        i += 1
    sys.exit(7)
    """
)


def _start(state: Path, port: int, http_port: int) -> RunningServer:
    return start_server(state, "--port", str(port), "--http-port", str(http_port))


def _project(tmp_path: Path) -> Path:
    """A project folder with the counter in it, beside the server's state."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "counter.py").write_text(COUNTER)
    return project


def test_a_server_killed_with_sigkill_finds_its_jobs_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = restartable_ports(5)
    http_port = port + 4
    first = _start(state, port, http_port)
    project = _project(tmp_path)  # not the folder of the server's state, whose files change while it syncs
    token, fingerprint = first.admin_token, first.fingerprint
    lines: list[str] = []
    follower_error: list[BaseException] = []
    try:
        with first.connect() as gpu:
            running = gpu.submit(["python", "counter.py", "finish"], workdir=project, gpus=2, name="long")
            queued = [gpu.submit(["python", "-c", f"print('queued {n}')"], workdir=None, gpus=1) for n in range(2)]
            wait_for(lambda: running.refresh().log_bytes > 200, what="the running job's first lines")
            assert [q.status for q in queued] == ["queued", "queued"]

        def follow() -> None:
            try:
                with gpuport.connect(first.url, token, fingerprint=fingerprint) as gpu:
                    lines.extend(gpu.job(running.id).logs(follow=True))
            except BaseException as e:  # reported by the test below
                follower_error.append(e)

        follower = threading.Thread(target=follow)
        follower.start()
        wait_for(lambda: len(lines) > 5, what="the follower's first lines")
        supervisor = json.loads((state / "jobs" / running.id / "supervisor.json").read_text())
    finally:
        first.stop(signal.SIGKILL)
    # The job outlives the server.
    os.kill(supervisor["child"], 0)

    second = _start(state, port, http_port)
    try:
        with gpuport.connect(second.url, token, fingerprint=fingerprint) as gpu:
            job = gpu.job(running.id)
            assert job.status == "running"
            touch_in_job(state, job.id, "finish")
            assert job.wait(60).exit_code == 7
            assert job.info.state == "failed" and job.info.message == "exited with code 7"
            for q in queued:
                done = gpu.job(q.id).wait(60)
                assert done.info.state == "succeeded"
            assert [list(gpu.job(q.id).logs()) for q in queued] == [["queued 0"], ["queued 1"]]
            full_log = list(job.logs())
        follower.join(60)
        assert not follower.is_alive() and not follower_error, follower_error
        count = len(full_log)
        assert full_log == [f"line {i}" for i in range(count)] and count > 10
        assert lines == full_log  # the follower lost nothing and repeated nothing across the restart
    finally:
        touch_in_job(state, running.id, "finish")
        second.stop()


def test_a_job_that_ends_while_the_server_is_down_is_recorded(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_server(state)
    token, fingerprint = first.admin_token, first.fingerprint
    project = _project(tmp_path)
    try:
        with first.connect() as gpu:
            job = gpu.submit(["python", "counter.py", "finish"], workdir=project)
            wait_for(lambda: job.refresh().log_bytes > 0, what="the job's first line")
    finally:
        first.stop(signal.SIGKILL)
    touch_in_job(state, job.id, "finish")
    wait_for(lambda: (state / "jobs" / job.id / "exit.json").exists(), what="the job's exit status")
    second = start_server(state)
    try:
        with gpuport.connect(second.url, token, fingerprint=fingerprint) as gpu:
            info = gpu.job(job.id).wait(30).info
            assert (info.state, info.exit_code) == ("failed", 7)
            assert list(gpu.job(job.id).logs())[-1].startswith("line ")
    finally:
        second.stop()


# ---- chaos --------------------------------------------------------------------------------------

KILLS = 20


def test_twenty_kill_9s_at_random_moments_lose_no_job_and_run_none_twice(tmp_path: Path) -> None:
    """The server is killed with SIGKILL 20 times, each a random moment after a burst of submits
    (up to 10 more arriving from another thread meanwhile), with a session holding a value and a model
    deployed.
    Every job it answered for runs to its end exactly once, and so does every job it recorded from a
    submit whose answer the kill cut off; the session's worker and its value, and the model, are
    there at the end. Jobs count their runs in a file of the test's (the server runs with
    --no-sandbox, so that they can reach it)."""
    state, ran = tmp_path / "state", tmp_path / "ran"
    rng = random.Random(os.environ.get("GPUPORT_CHAOS_SEED", "gpuport"))
    server = start_server(state, "--no-sandbox")
    token, fingerprint = server.admin_token, server.fingerprint
    answered: list[str] = []

    def burst(url: str, count: int) -> None:
        with contextlib.suppress(gpuport.GpuportError):  # the kill may cut a submit off
            with gpuport.connect(url, token, fingerprint=fingerprint) as gpu:
                for _ in range(count):
                    script = f"sleep {rng.uniform(0, 0.8):.2f}; echo $GPUPORT_JOB_ID >> {ran}"
                    answered.append(gpu.submit(script, workdir=None).id)

    try:
        with server.connect() as gpu:
            gpu.deploy("chaos", _doubler_file(tmp_path))
            session = gpu.session(name="chaos")
            session.put(np.arange(3), name="x")
            worker = session.info().job_id
            session.detach()
        for _ in range(KILLS):
            burst(server.url, 2)
            racing = threading.Thread(target=burst, args=(server.url, 10))  # the kill may cut it off
            racing.start()
            time.sleep(rng.uniform(0, 0.6))
            server.stop(signal.SIGKILL)
            racing.join(30)
            server = start_server(state, "--no-sandbox")
        with gpuport.connect(server.url, token, fingerprint=fingerprint) as gpu:
            recorded = [j.id for j in gpu.jobs(all=True) if str(ran) in " ".join(j.info.command)]
            assert set(answered) <= set(recorded) and len(answered) >= 2 * KILLS
            for job_id in recorded:
                info = gpu.job(job_id).wait(120).info
                assert info.state == "succeeded", info
            runs = collections.Counter(ran.read_text().split())
            assert runs == collections.Counter(recorded), runs - collections.Counter(recorded)
            with gpu.session(name="chaos") as again:
                assert again.reattached and again.info().job_id == worker
                assert again.get(again.ref("x")).tolist() == [0, 1, 2]
                again.close()
            body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
            server.admin_token = token
            reply = server.rest("POST", "/v2/models/chaos/infer", token, json=body)
            assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [2, 4, 6, 8], reply.text
    finally:
        with contextlib.suppress(gpuport.GpuportError):  # what outlives a server, ended
            with gpuport.connect(server.url, token, fingerprint=fingerprint) as gpu:
                for live in gpu.sessions():
                    gpu.close_session(live.id)
                for deployed in gpu.models():
                    gpu.undeploy(deployed.name)
        server.stop()


def test_sessions_count_their_values_right_after_a_restart(tmp_path: Path, cli: Any) -> None:
    state = tmp_path / "state"
    port = restartable_ports(5)
    first = _start(state, port, port + 4)
    token, fingerprint = first.admin_token, first.fingerprint
    try:
        with first.connect() as gpu:
            session = gpu.session(name="kept", cpus=0.1)
            a = session.put(np.arange(4))
            session.put("first", name="label")
            session.put("second", name="label")  # a name holds one value: the newest
            b = session.put([1, 2, 3])
            session.delete(b)
            assert [s.refs for s in gpu.sessions() if s.id == session.id] == [2]
    finally:
        first.stop()

    second = _start(state, port, port + 4)
    try:
        env = {"GPUPORT_URL": second.url, "GPUPORT_TOKEN": token, "GPUPORT_FINGERPRINT": fingerprint}
        listed = cli("sessions", **env)  # before anything touches the session
        assert listed.code == 0, listed.output
        header, *rows = listed.stdout.splitlines()
        values = header.index("VALUES")
        (row,) = [r for r in rows if r.startswith(session.id)]
        assert row[values:].split()[0] == "2", listed.stdout
        with gpuport.connect(second.url, token, fingerprint=fingerprint) as gpu:
            again = gpu.session(name="kept")
            assert (
                np.array_equal(again.get(again.refs()[0]), np.arange(4)) and again.get(again.ref("label")) == "second"
            )
            assert [s.refs for s in gpu.sessions() if s.id == session.id] == [2]
            assert a.id in [r.id for r in again.refs()]
            again.close()
    finally:
        second.stop()
