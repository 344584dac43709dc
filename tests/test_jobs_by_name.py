"""Jobs found by name, listed with filters, logs read from their end, and a running job's outputs,
through the Python API, the CLI and REST, against the real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import gpuport
from gpuport.protocol import gpuport_pb2 as pb
from tests.conftest import RunningServer, client_env, touch_in_job, wait_for

# Prints "up", then waits for the file "go" in its working folder (touch_in_job), then ends.
HOLD = "import os, time\nprint('up', flush=True)\nwhile not os.path.exists('go'): time.sleep(0.02)\n"


def _name() -> str:
    return f"train-{uuid.uuid4().hex[:6]}"  # the server is shared: every test its own names


def _held(gpu: gpuport.Client, name: str, script: str = HOLD, **options: object) -> gpuport.Job:
    """A job of ``script`` (by default: HOLD), once it has printed its first line."""
    job = gpu.submit(["python", "-c", script], workdir=None, name=name, **options)  # type: ignore[arg-type]
    wait_for(lambda: job.refresh().log_bytes, what=f"job {job.id}'s first line")
    return job


def _release(server: RunningServer, job: gpuport.Job) -> gpuport.Job:
    touch_in_job(server.state_dir, job.id, "go")
    return job.wait(30)


# ---- a name is unique among a user's unfinished jobs ----------------------------------------------------


def test_a_name_is_held_by_one_unfinished_job_and_free_again_once_it_ends(
    server: RunningServer, admin: gpuport.Client, cli: object
) -> None:
    name = _name()
    first = _held(admin, name)
    with pytest.raises(gpuport.Conflict) as raised:
        admin.submit(["true"], workdir=None, name=name)
    message = str(raised.value)
    assert first.id in message and repr(name) in message and "another name" in message and "cancel" in message
    result = cli("run", "-d", "--name", name, "--", "true", **client_env(server))  # type: ignore[operator]
    assert result.code == 1 and first.id in result.stderr and "another name" in result.stderr
    assert [j.id for j in admin.jobs(name=name)] == [first.id]  # nothing was queued
    assert _release(server, first).info.state == "succeeded"
    second = admin.submit(["true"], workdir=None, name=name).wait(30)  # free once the first has ended
    assert second.info.state == "succeeded"
    third = _held(admin, name)  # and again after a cancel
    third.cancel()
    third.wait(30)
    assert admin.submit(["true"], workdir=None, name=name).wait(30).info.state == "succeeded"


def test_concurrent_submits_of_one_name_let_exactly_one_win(server: RunningServer, admin: gpuport.Client) -> None:
    name = _name()

    def submit(_: int) -> str:
        try:
            with server.connect() as gpu:
                return gpu.submit(["python", "-c", HOLD], workdir=None, name=name).id
        except gpuport.Conflict:
            return ""

    with ThreadPoolExecutor(6) as pool:
        won = [job_id for job_id in pool.map(submit, range(6)) if job_id]
    assert len(won) == 1
    assert [j.id for j in admin.jobs(name=name)] == won
    job = admin.job(won[0])
    wait_for(lambda: job.refresh().log_bytes, what="the job's first line")
    assert _release(server, job).info.state == "succeeded"


def test_a_name_that_looks_like_a_job_id_is_refused(admin: gpuport.Client) -> None:
    with pytest.raises(gpuport.InvalidRequest, match="looks like a job id"):
        admin.submit(["true"], workdir=None, name="j-0123abcd")


def test_other_users_keep_names_of_their_own(server: RunningServer, admin: gpuport.Client, user_token: str) -> None:
    name = _name()
    mine = _held(admin, name)
    with server.connect(user_token) as gpu:
        theirs = gpu.submit(["true"], workdir=None, name=name).wait(30)  # the same name: another user's
        assert gpu.job(name).id == theirs.id
    assert admin.job(name).id == mine.id
    _release(server, mine)


# ---- every job command takes a name -------------------------------------------------------------------


def test_every_job_command_takes_a_name(
    server: RunningServer, admin: gpuport.Client, cli: object, tmp_path: Path
) -> None:
    env = client_env(server)
    name = _name()
    script = (
        HOLD
        + "print('saved', flush=True)\nopen(os.path.join(os.environ['GPUPORT_OUTPUT_DIR'], 'w.txt'), 'w').write('w')\n"
    )
    job = _held(admin, name, script)
    assert admin.job(name).id == job.id  # the Python API
    rest = server.rest("GET", f"/v1/jobs/{name}", server.admin_token)
    assert rest.status_code == 200 and rest.json()["job_id"] == job.id
    assert cli("logs", name, **env).stdout == "up\n"  # type: ignore[operator]
    follow = subprocess.Popen(
        [sys.executable, "-m", "gpuport", "logs", "-f", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    try:
        wait_for(lambda: admin.job(job.id).info.log_bytes, what="the first line")
        touch_in_job(server.state_dir, job.id, "go")
        out, errors = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0 and out == "up\nsaved\n", errors
    assert cli("wait", name, **env).code == 0  # type: ignore[operator]
    download = cli("download", name, "-o", str(tmp_path / "dl"), **env)  # type: ignore[operator]
    assert download.code == 0 and (tmp_path / "dl" / "w.txt").read_text() == "w", download.output
    # A newer job of the name is the one found; once it has ended, the newest.
    later = _held(admin, name)
    assert cli("cancel", name, **env).code == 0  # type: ignore[operator]
    assert later.wait(30).info.state == "cancelled" and admin.job(name).id == later.id
    assert job.refresh().state == "succeeded"  # the older one untouched


def test_a_name_nobody_has_is_not_found_with_a_clear_error(
    server: RunningServer, admin: gpuport.Client, user_token: str, cli: object
) -> None:
    name = _name()
    with pytest.raises(gpuport.NotFound, match=f"no job named '{name}'"):
        admin.job(name)
    result = cli("logs", "-f", name, **client_env(server))  # type: ignore[operator]
    assert result.code == 1 and f"no job named '{name}'" in result.stderr and "gpuport jobs --all" in result.stderr
    assert server.rest("GET", f"/v1/jobs/{name}/logs", server.admin_token).status_code == 404
    # Another user's job is not found by its name either.
    job = admin.submit(["true"], workdir=None, name=name).wait(30)
    with server.connect(user_token) as gpu, pytest.raises(gpuport.NotFound, match=f"no job named '{name}'"):
        gpu.job(name)
    assert admin.job(name).id == job.id


# ---- gpuport jobs --name --state --user -------------------------------------------------------------


def test_jobs_filter_by_name_state_and_user(
    server: RunningServer, admin: gpuport.Client, user_token: str, cli: object
) -> None:
    name = _name()
    done = admin.submit(["false"], workdir=None, name=name).wait(30)
    running = _held(admin, name)
    assert [j.id for j in admin.jobs(name=name)] == [running.id, done.id]
    assert [j.id for j in admin.jobs(name=name, state="running")] == [running.id]
    assert [j.id for j in admin.jobs(name=name, state=["failed", "queued"])] == [done.id]
    assert admin.jobs(name=name, state="succeeded") == []
    env = client_env(server)
    listed = cli("jobs", "--name", name, "--state", "failed", "--json", **env)  # type: ignore[operator]
    assert [j["id"] for j in json.loads(listed.stdout)] == [done.id]
    rest = server.rest("GET", "/v1/jobs", server.admin_token, params={"name": name, "state": ["running", "failed"]})
    assert [j["job_id"] for j in rest.json()] == [running.id, done.id]
    bad = cli("jobs", "--state", "finished", **env)  # type: ignore[operator]
    assert bad.code == 1 and "unknown job state 'finished'" in bad.stderr and "succeeded" in bad.stderr
    _release(server, running)

    with server.connect(user_token) as gpu:
        user = gpu.submit(["true"], workdir=None, name=name).wait(30).info.owner
        assert [j.info.owner for j in gpu.jobs(user=user, all=True)] == [user]
        with pytest.raises(gpuport.PermissionDenied, match="only an admin can list another user's jobs"):
            gpu.jobs(user="admin")
    theirs = cli("jobs", "--user", user, "--name", name, "--json", **env)  # type: ignore[operator]
    assert [j["owner"] for j in json.loads(theirs.stdout)] == [user]  # an admin may
    refused = cli("jobs", "--user", "someone-else", **client_env(server, user_token))  # type: ignore[operator]
    assert refused.code == 1 and "only an admin" in refused.stderr
    status = server.rest("GET", "/v1/jobs", user_token, params={"user": "someone-else"}).status_code
    assert status == 403


# ---- logs --tail ----------------------------------------------------------------------------------------


def test_logs_tail_prints_the_last_lines(server: RunningServer, admin: gpuport.Client, cli: object) -> None:
    env = client_env(server)
    # Lines across more than one read from the end (1 MiB each), and a last line without its newline.
    script = "import sys\nfor i in range(30000): print(f'line {i:05d} ' + 'x' * 60)\nsys.stdout.write('last')\n"
    job = admin.submit(["python", "-c", script], workdir=None).wait(30)
    assert list(job.logs(tail=3)) == ["line 29998 " + "x" * 60, "line 29999 " + "x" * 60, "last"]
    assert list(job.logs(tail=0)) == []
    assert len(list(job.logs(tail=25000))) == 25000
    assert len(list(job.logs(tail=10**6))) == 30001  # more than there are: all of them
    tail = cli("logs", "--tail", "2", job.id, **env)  # type: ignore[operator]
    assert tail.stdout == "line 29999 " + "x" * 60 + "\nlast"
    rest = server.rest("GET", f"/v1/jobs/{job.id}/logs", server.admin_token, params={"tail": 1}).json()
    assert rest["data"] == "last" and rest["complete"] is True
    ends = admin.submit(["python", "-c", "print('a'); print('b'); print('c')"], workdir=None).wait(30)
    assert cli("logs", "-n", "2", ends.id, **env).stdout == "b\nc\n"  # type: ignore[operator]
    bad = cli("logs", "--tail", "-1", ends.id, **env)  # type: ignore[operator]
    assert bad.code == 2


def test_logs_tail_then_follow(server: RunningServer, admin: gpuport.Client) -> None:
    script = "print('one'); print('two'); print('three', flush=True)\n" + HOLD + "print('after', flush=True)\n"
    job = admin.submit(["python", "-c", script], workdir=None)
    wait_for(lambda: b"up" in b"".join(d for _, d in job.log_chunks()), what="the job's first lines")
    follower = subprocess.Popen(
        [sys.executable, "-m", "gpuport", "logs", "-f", "--tail", "2", job.id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **client_env(server)},
    )
    try:
        assert follower.stdout is not None
        assert [follower.stdout.readline(), follower.stdout.readline()] == ["three\n", "up\n"]
        touch_in_job(server.state_dir, job.id, "go")
        rest, errors = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0 and rest == "after\n", errors


# ---- download from a running job ---------------------------------------------------------------------


def test_download_a_running_jobs_outputs_as_they_are_now(
    server: RunningServer, admin: gpuport.Client, cli: object, tmp_path: Path
) -> None:
    script = textwrap.dedent(
        """
        import os, time
        out = os.environ["GPUPORT_OUTPUT_DIR"]
        os.makedirs("model", exist_ok=True)
        open("model/step1.bin", "w").write("first")
        open(os.path.join(out, "metrics.json"), "w").write("{}")
        os.symlink("/etc/hostname", os.path.join(out, "link"))  # never followed out of the job's folders
        print("up", flush=True)
        while not os.path.exists("go"): time.sleep(0.02)
        open("model/step2.bin", "w").write("second")
        """
    )
    both = _held(admin, _name(), gpus=2)  # holds the GPUs: the next job waits
    queued = admin.submit(["true"], workdir=None, gpus=1)
    with pytest.raises(gpuport.Conflict, match="queued: it has no outputs until it runs"):
        queued.download(tmp_path / "none")
    _release(server, both)
    queued.wait(30)

    job = _held(admin, _name(), script, outputs=["model"])
    files = job.download(tmp_path / "py")
    assert sorted(p.relative_to(tmp_path / "py").as_posix() for p in files) == ["metrics.json", "model/step1.bin"]
    live = admin.transport.call(admin.transport.jobs.Outputs, pb.JobRef(job_id=job.id)).snapshot_id
    result = cli("download", job.info.name, "-o", str(tmp_path / "cli"), **client_env(server))  # type: ignore[operator]
    assert result.code == 0 and "as they are now" in result.stderr, result.output
    assert (tmp_path / "cli" / "model" / "step1.bin").read_text() == "first"
    assert not (tmp_path / "cli" / "link").exists()
    assert _release(server, job).info.state == "succeeded"
    final = job.download(tmp_path / "final")
    assert (tmp_path / "final" / "model" / "step2.bin").read_text() == "second" and len(final) == 3
    # The snapshot taken while it ran is dropped once it has ended: it counts against nobody's storage.
    with pytest.raises(gpuport.NotFound):
        admin.transport.call(admin.transport.snapshots.Get, pb.SnapshotRef(snapshot_id=live))


def test_download_a_running_job_that_has_written_nothing_yet(
    server: RunningServer, admin: gpuport.Client, cli: object, tmp_path: Path
) -> None:
    job = _held(admin, _name())
    result = cli("download", job.id, "-o", str(tmp_path / "dl"), **client_env(server))  # type: ignore[operator]
    assert result.code == 0 and "has no outputs yet" in result.stderr, result.output
    with pytest.raises(gpuport.InvalidRequest, match="has no outputs yet"):
        job.download(tmp_path / "dl", "model/")
    _release(server, job)


def test_logs_tail_stops_at_the_part_cut_from_a_long_log(server: RunningServer, admin: gpuport.Client) -> None:
    job = admin.submit(["true"], workdir=None).wait(30)
    # The log as a server leaves one that passed its limit: its first part, a hole, the note and its last part.
    log = server.state_dir / "jobs" / job.id / "log"
    with open(log, "wb") as f:
        f.write(b"first\n" * 1000)
        f.seek(8 << 20)
        f.write(b"[gpuport: cut here]\nx\ny\n")
    if log.stat().st_blocks * 512 >= 8 << 20:
        pytest.skip("this filesystem keeps no holes in files")
    assert list(job.logs(tail=2)) == ["x", "y"]
    assert list(job.logs(tail=100)) == ["[gpuport: cut here]", "x", "y"]
