"""kill -9 the server while a job runs and others wait; start it again: nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import threading
from pathlib import Path

import gpuport
from tests.conftest import RunningServer, start_server, touch_in_job, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def test_a_server_killed_with_sigkill_finds_its_jobs_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    port, http_port = _free_port(), _free_port()
    first = _start(state, port, http_port)
    (tmp_path / "counter.py").write_text(COUNTER)
    token, fingerprint = first.admin_token, first.fingerprint
    lines: list[str] = []
    follower_error: list[BaseException] = []
    try:
        with first.connect() as gpu:
            running = gpu.submit(["python", "counter.py", "finish"], workdir=tmp_path, gpus=2, name="long")
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
    (tmp_path / "counter.py").write_text(COUNTER)
    try:
        with first.connect() as gpu:
            job = gpu.submit(["python", "counter.py", "finish"], workdir=tmp_path)
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
