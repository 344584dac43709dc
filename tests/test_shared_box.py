"""A shared box people can live on: what runs as root never follows a path a job can write, and a
job, a session worker and a model replica can each do ordinary work as an ordinary user's uid.

Every test here is as a user with an ordinary token on a root server (as in CI), where work runs
under a uid of its owner's, in a bubblewrap sandbox.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

import gpuport
from tests._shared_box import ordinary, swapper
from tests.conftest import RunningServer, needs_users, server_env, start_server, touch_in_job, wait_for


@pytest.fixture
def alice(admin: gpuport.Client, server: RunningServer) -> Iterator[gpuport.Client]:
    needs_users()
    with server.connect(admin.create_token(f"alice-{uuid.uuid4().hex[:8]}").token) as client:
        yield client


def _root_only_tree(folder: Path) -> dict[str, int]:
    """A tree like /root: folders 0700, files 0600 (a private key among them); its modes by path."""
    (folder / ".ssh").mkdir(parents=True)
    for name in ("id_ed25519", ".ssh/id_ed25519", ".ssh/authorized_keys"):
        (folder / name).write_text("secret\n")
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    return _modes(folder)


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.lstat().st_mode) for p in [folder, *folder.rglob("*")]}


def _pickled(module: object, value: object, path: Path) -> Path:
    cloudpickle.register_pickle_by_value(module)
    try:
        path.write_bytes(cloudpickle.dumps(value))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    return path


# ---- nothing that runs as root follows a path a job can write -------------------------------------


def test_replicas_swapping_their_folder_for_links_while_restarted_change_no_host_file(
    server: RunningServer, alice: gpuport.Client, tmp_path: Path
) -> None:
    """Replica 0 swaps folders of its model folder with symlinks to a root-only tree, without pause;
    replica 1 crashes three times meanwhile, and each time the server starts it again as root."""
    target = tmp_path / "root-like"
    before = _root_only_tree(target)
    model = _pickled(swapper, swapper.Swapper(str(target), crashes=3, seconds=60), tmp_path / "model.pkl")
    info = alice.deploy(f"swapper-{uuid.uuid4().hex[:6]}", model, replicas=2, wait=False)
    folder = server.state_dir / "models" / info.id
    try:
        wait_for(lambda: len(list(folder.glob("crashed-*"))) == 3, timeout=120, what="replica 1's third crash")
        crashed = set(alice.model(info.name).jobs)
        wait_for(lambda: alice.model(info.name).jobs[1] not in crashed, timeout=60, what="replica 1's fourth start")
        assert alice.model(info.name).state != "failed", alice.model(info.name).message
        assert (folder / "l0").is_symlink() or (folder / "d0").is_symlink()  # it did swap
    finally:
        alice.undeploy(info.name)
        # Checked however the wait ended: a server that followed the links may also have failed to
        # start the replica (a folder swapped away under its walk).
        assert _modes(target) == before


def test_traps_in_work_and_output_folders_are_neither_followed_nor_waited_on(
    server: RunningServer, alice: gpuport.Client, tmp_path: Path
) -> None:
    """Symlinks to a root-only tree, FIFOs and a hard link from a host file left for the output
    collection and the tidying: only the job's own files are collected, the host's stay as they were."""
    target = tmp_path / "root-like"
    before = _root_only_tree(target)
    host_file = tmp_path / "host-secret"
    host_file.write_text("the host's, not the job's\n")
    host_file.chmod(0o600)
    script = f"""
import os, time
out = os.environ["GPUPORT_OUTPUT_DIR"]
for folder in (".", out, "results"):
    os.makedirs(folder, exist_ok=True)
    os.symlink({str(target)!r}, os.path.join(folder, "root"))
    os.symlink({str(target / ".ssh" / "id_ed25519")!r}, os.path.join(folder, "key"))
    os.mkfifo(os.path.join(folder, "fifo"))
open(os.path.join(out, "mine.txt"), "w").write("mine")
open("results/mine.txt", "w").write("mine")
os.link("results/mine.txt", "results/also-mine.txt")
open("ready", "w").close()
while not os.path.exists("go"):
    time.sleep(0.05)
"""
    job = alice.submit(["python", "-c", script], workdir=None, outputs=["results", "root", "key", "fifo"])
    wait_for(
        lambda: (server.state_dir / "jobs" / job.id / "work" / "ready").exists() or job.refresh().ended,
        what="the job's traps",
    )
    assert not job.info.ended, list(job.logs())
    # What a hard link made without protected_hardlinks would put there: a file the job cannot read.
    os.link(host_file, server.state_dir / "jobs" / job.id / "out" / "host.txt")
    touch_in_job(server.state_dir, job.id, "go")
    job.wait(60)
    assert job.exit_code == 0, list(job.logs())
    files = job.download(tmp_path / "got", ".")
    got = sorted(p.relative_to(tmp_path / "got").as_posix() for p in files)
    assert got == ["mine.txt", "results/also-mine.txt", "results/mine.txt"]
    assert (tmp_path / "got" / "results" / "also-mine.txt").read_text() == "mine"
    wait_for(lambda: not (server.state_dir / "jobs" / job.id / "work").exists(), what="the job's folders tidied")
    assert _modes(target) == before
    assert host_file.read_text() == "the host's, not the job's\n" and stat.S_IMODE(host_file.stat().st_mode) == 0o600


# ---- a job can do ordinary work ---------------------------------------------------------------------


def _check_ordinary(done: dict, uid_of_server: int = 0) -> None:
    assert done["uid"] != uid_of_server
    assert done["pool"] == [1, 1, 2, 6, 24] and done["lock"] and done["shared_memory"] == "abc"
    assert done["joblib"] == [1, 1, 2, 6, 24] and done["dataloader"] == list(range(8))
    assert done["home_owner"] == done["uid"] and done["shm_owner"] == done["uid"]


def test_a_job_uses_processes_shared_memory_and_its_home(alice: gpuport.Client, tmp_path: Path) -> None:
    shutil.copy(ordinary.__file__, tmp_path / "ordinary.py")
    job = alice.submit(["python", "ordinary.py"], workdir=tmp_path, memory="2GiB").wait(120)
    text = "\n".join(job.logs())
    assert job.exit_code == 0, text
    assert "joblib will operate in serial mode" not in text
    _check_ordinary(json.loads(text.split("ORDINARY ", 1)[1].splitlines()[0]))


def test_a_session_worker_uses_processes_shared_memory_and_its_home(alice: gpuport.Client) -> None:
    with alice.session() as session:
        _check_ordinary(session.call(ordinary.ordinary_work))


def test_a_model_replica_uses_processes_shared_memory_and_its_home(alice: gpuport.Client, tmp_path: Path) -> None:
    model = _pickled(ordinary, ordinary.OrdinaryModel(), tmp_path / "model.pkl")
    info = alice.deploy(f"ordinary-{uuid.uuid4().hex[:6]}", model)  # waits: load() did the work, or it failed
    try:
        assert info.state == "ready", info.message
    finally:
        alice.undeploy(info.name)


# ---- the server's environment stays with the server; a clone others cannot enter ---------------------


def test_a_server_from_a_closed_clone_runs_jobs_that_see_none_of_its_environment(tmp_path: Path) -> None:
    """gpuport's package in a folder made with umask 077 (0700, files 0600), as a clone made so: jobs
    see it through a readable copy, and none of the admin's variables reach them."""
    needs_users()
    clone = tmp_path / "clone"
    shutil.copytree(Path(gpuport.__file__).parent, clone / "gpuport", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [clone, *clone.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    env = server_env(
        GPUPORT_FAKE_GPUS="1x16GiB",
        PYTHONPATH=str(clone),
        ADMINS_CLOUD_KEY="not-for-jobs",
        LANG="C.UTF-8",
        TZ="UTC",
    )
    running = start_server(tmp_path / "state", env=env, wrapper=("env", "-C", str(tmp_path)))  # not from this clone
    try:
        assert "shown from a readable copy" in running.banner
        with running.connect() as admin, running.connect(admin.create_token("bob").token) as bob:
            script = "import gpuport, json, os; print('ENV', json.dumps({'file': gpuport.__file__, **os.environ}))"
            job = bob.submit(["python", "-c", script], workdir=None, env={"MINE": "1"}).wait(60)
            text = "\n".join(job.logs())
            assert job.exit_code == 0, text
            seen = json.loads(text.split("ENV ", 1)[1].splitlines()[0])
            assert seen["file"] == str(clone / "gpuport" / "__init__.py")
            assert seen["MINE"] == "1" and seen["LANG"] == "C.UTF-8" and seen["TZ"] == "UTC"
            assert "ADMINS_CLOUD_KEY" not in seen and "PYTHONUNBUFFERED" not in seen
            assert seen["PATH"].split(":")[0] == os.path.dirname(sys.executable)
            with bob.session() as session:  # a worker: gpuport's own code, from the copy
                assert session.call(os.getuid) != 0
    finally:
        running.stop()
    # The clone itself stayed closed.
    assert stat.S_IMODE(clone.stat().st_mode) == 0o700
    assert stat.S_IMODE((clone / "gpuport" / "__init__.py").stat().st_mode) == 0o600


def test_a_server_refuses_to_start_where_its_environment_is_closed_to_jobs(tmp_path: Path) -> None:
    """A Python environment made with umask 077 cannot be shown to other uids: the server says so,
    and what to do, rather than run jobs that all fail to start."""
    needs_users()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    venv.chmod(0o700)
    paths = [p for p in sys.path if p.endswith("site-packages")]
    pth = next((venv / "lib").glob("python3*")) / "site-packages" / "outer.pth"
    pth.write_text("\n".join(paths) + "\n")
    env = server_env(GPUPORT_FAKE_GPUS="1x16GiB")
    command = [str(venv / "bin" / "python"), "-m", "gpuport", "server", "--insecure", "--host", "127.0.0.1"]
    done = subprocess.run(
        [*command, "--port", "0", "--state-dir", str(tmp_path / "state")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert f"{venv}, a folder of the server's Python environment, is closed to other users" in said
    assert "umask 022" in said


# ---- a job's life loses no signal and no byte -------------------------------------------------------


def test_a_cancel_at_any_moment_of_a_start_ends_the_job_cancelled(alice: gpuport.Client) -> None:
    """Cancels sent from the moment of the submit on, while the supervisor starts, sets the sandbox
    up (again, when bubblewrap failed to) and runs the job: each job ends cancelled, none lost."""
    import random
    import threading
    import time

    rng = random.Random(32)
    jobs = []

    def submit_and_cancel(delay: float) -> None:
        job = alice.submit(["sleep", "60"], workdir=None)
        time.sleep(delay)
        job.cancel()
        jobs.append(job)

    for _ in range(4):  # rounds of 6 launches at once
        threads = [threading.Thread(target=submit_and_cancel, args=(rng.uniform(0, 0.3),)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    states = {job.id: job.wait(60).status for job in jobs}
    assert sorted(set(states.values())) == ["cancelled"], states


def test_a_log_past_its_limit_keeps_its_start_and_end_and_says_what_was_cut(
    server: RunningServer, alice: gpuport.Client
) -> None:
    """A job writes 300 MiB: the log holds its first and last 128 MiB on disk; a reader gets the
    start, the note of what was cut and the end, in order, with offsets as the job wrote them, by
    either door."""
    from gpuport.defaults import DEFAULT_LOG_LIMIT

    script = (
        "import sys\nline = b'x' * 1023 + b'\\n'\nout = sys.stdout.buffer\nout.write(b'FIRST\\n')\n"
        "for _ in range(300 * 1024):\n    out.write(line)\nout.write(b'LAST\\n')\nout.flush()\n"
    )
    job = alice.submit(["python", "-c", script], workdir=None)
    assert job.wait(120).exit_code == 0, list(job.logs())[:5]
    log = server.state_dir / "jobs" / job.id / "log"
    assert log.stat().st_size == 300 * 1024 * 1024 + 11  # offsets are as the job wrote them
    assert log.stat().st_blocks * 512 <= DEFAULT_LOG_LIMIT + (1 << 20)
    marks, total = [], 0
    for offset, data in job.log_chunks(0):
        assert offset >= total
        total = offset + len(data)
        marks += [line for line in data.split(b"\n") if line and not line.startswith(b"xxx")]
    assert marks[0] == b"FIRST" and marks[-1] == b"LAST" and len(marks) == 3, marks
    assert re.fullmatch(
        rb"\[gpuport: [\d,]+ bytes of this log were cut here, to keep it within [\d,]+ bytes\]", marks[1]
    )
    assert total == log.stat().st_size
    reply = server.rest(
        "GET", f"/v1/jobs/{job.id}/logs", token=server.admin_token, params={"offset": 150 * 1024 * 1024}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["offset"] > 150 * 1024 * 1024 and body["data"].startswith("\n[gpuport: ")
