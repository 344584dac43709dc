"""Limits the kernel enforces: each job in a cgroup of its own, held to its memory and its cap of
processes, and killed alone when it goes over (server/cgroups.py, worker/supervisor.py).

The tests with real jobs need a server that may make cgroups (root, with the v1 memory and pids
controllers or a delegated cgroup v2); elsewhere they skip with the reason the server's banner gives.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import gpuport
from gpuport.defaults import DEFAULT_PROCESSES_PER_JOB
from gpuport.protocol.units import format_size
from gpuport.server import cgroups
from gpuport.server.executors import workspace
from gpuport.server.inventory import memory_floor
from gpuport.server.worker import supervisor
from tests.conftest import JobFlag, RunningServer, client_env, start_server, wait_for

# Allocates and touches 1 GiB, a MiB at a time, saying how far it got.
ALLOCATE = """
import sys
held = []
for mib in range(1, 1025):
    held.append(b"x" * (1 << 20))
    if mib % 128 == 0:
        print(mib, "MiB", flush=True)
print("held it all")
"""

# Forks 5,000 processes that wait (their parent's end ends them), and says how many it got.
FORK = """
import os, sys, time
forked = 0
try:
    for _ in range(5000):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
except BlockingIOError as e:
    print("fork failed after", forked, ":", e, flush=True)
    sys.exit(3)
print("forked", forked, flush=True)
"""


def limits_line(server: RunningServer) -> str:
    found = re.search(r"^  limits\s+(.*)$", server.banner, re.MULTILINE)
    assert found, server.banner
    return found.group(1)


def needs_cgroups(server: RunningServer) -> None:
    line = limits_line(server)
    if not line.startswith("cgroup v"):
        pytest.skip(f"the server cannot put jobs in cgroups here: {line}")


def job_groups(job_id: str) -> dict[str, str]:
    """The folders of a job's cgroup(s) on this machine, by controller: found, not computed."""
    found = {}
    for _, point, fstype, options in cgroups._mounts():
        hits = glob.glob(f"{point}/**/gpuport/*/{job_id}", recursive=True)
        for controller in ("memory", "pids"):
            if hits and (controller in options or fstype == "cgroup2" and Path(hits[0], "memory.max").exists()):
                found[controller] = hits[0]
    return found


def memory_limit(folder: str) -> int:
    name = "memory.max" if Path(folder, "memory.max").exists() else "memory.limit_in_bytes"
    return int(Path(folder, name).read_text())


@pytest.fixture
def alice(admin: gpuport.Client, server: RunningServer, user_token: str) -> Iterator[gpuport.Client]:
    with server.connect(user_token) as client:
        yield client


def test_the_banner_says_which_cgroups_hold_the_jobs(server: RunningServer) -> None:
    line = limits_line(server)
    assert line.startswith(("cgroup v2:", "cgroup v1:", "none: ")), line
    if line.startswith("none: "):  # and says why, and what happens instead
        assert "memory limits are polled" in line, line
    else:
        assert "held to its --memory (default " in line and "processes to the quota" in line, line
        assert "CPU shared equally by users" in line or "CPU not divided (no cpu controller)" in line, line


def test_a_job_over_its_memory_limit_is_killed_alone(
    server: RunningServer, alice: gpuport.Client, user_token: str, tmp_path: Path, cli: object
) -> None:
    needs_cgroups(server)
    flag = JobFlag(server.state_dir, f"go-{uuid.uuid4().hex[:6]}")
    try:
        other = alice.submit(["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.05; done; echo lived"], workdir=None)
        wait_for(lambda: other.refresh().state == "running", what="the other job running")
        (tmp_path / "alloc.py").write_text(ALLOCATE)
        greedy = alice.submit(["python", "alloc.py"], workdir=tmp_path, memory="256MiB").wait(120)
        info = greedy.info
        assert info.state == "killed", info
        assert info.message == "exceeded its memory limit of 256MiB", info
        log = list(greedy.logs())
        assert "held it all" not in log and log[-1] == "gpuport: job killed: exceeded its memory limit of 256MiB", log
        # `gpuport wait` and `gpuport jobs` say so too.
        env = client_env(server, user_token)
        waited = cli("wait", info.id, **env)  # type: ignore[operator]
        assert f"job {info.id} killed" in waited.output, waited.output
        assert "exceeded its memory limit of 256MiB" in waited.output, waited.output
        listed = cli("jobs", "--json", **env)  # type: ignore[operator]
        mine = next(j for j in json.loads(listed.stdout) if j["id"] == info.id)
        assert (mine["state"], mine["message"]) == ("killed", "exceeded its memory limit of 256MiB"), mine
        # The other job and the server live on; the greedy job's groups are gone.
        assert other.refresh().state == "running", (other.refresh(), list(other.logs()))
        assert psutil.pid_exists(server.pid or server.process.pid) and server.process.poll() is None
        assert job_groups(info.id) == {}
        flag.touch()
        assert other.wait(60).info.state == "succeeded" and "lived" in list(other.logs())
    finally:
        flag.close()


def test_a_job_the_kernels_oom_killer_ended_is_retried_when_asked(
    server: RunningServer, alice: gpuport.Client, tmp_path: Path
) -> None:
    needs_cgroups(server)
    (tmp_path / "alloc.py").write_text(ALLOCATE)
    asked = alice.submit(["python", "alloc.py"], workdir=tmp_path, memory="256MiB", retries=1, retry_on_exit=[137])
    info = asked.wait(120).info
    # Killed again on its retry: the retry spent, it ends as the kernel's OOM killer left it.
    assert info.state == "killed" and info.retried == 1, info
    assert info.message == "exceeded its memory limit of 256MiB", info
    # Not asked (137 not named): the OOM kill ends it at once, whatever its retries.
    other = alice.submit(["python", "alloc.py"], workdir=tmp_path, memory="256MiB", retries=1, retry_on_exit=[3])
    info = other.wait(120).info
    assert info.state == "killed" and info.retried == 0, info


def test_a_job_without_memory_gets_the_default_limit_and_the_process_cap(
    server: RunningServer, alice: gpuport.Client
) -> None:
    needs_cgroups(server)
    room = psutil.virtual_memory().total - memory_floor()  # what is left above the floor
    assert f"(default {format_size(room)})" in limits_line(server)
    flag = JobFlag(server.state_dir, f"go-{uuid.uuid4().hex[:6]}")
    try:
        job = alice.submit(["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.05; done"], workdir=None)
        wait_for(lambda: job.refresh().state == "running", what="the job running")
        # Both groups, not the first found: the recursive glob of one hierarchy can run before the
        # other's group is there, or miss it on a busy machine (seen once in CI: no "memory" key).
        groups = wait_for(
            lambda: (found := job_groups(job.id)).keys() >= {"memory", "pids"} and found, what="the job's cgroups"
        )
        assert room - 4096 < memory_limit(groups["memory"]) <= room  # in whole pages
        assert Path(groups["pids"], "pids.max").read_text().strip() == str(DEFAULT_PROCESSES_PER_JOB)
        # Its processes are in it (bubblewrap, the shell, its sleeps); its supervisor is not.
        # Read again until they agree: a sandbox set up again (bubblewrap's passing failures under
        # load) has a new child, and none for a moment.
        written = server.state_dir / "jobs" / job.id / "supervisor.json"

        def seen() -> tuple[dict, set[int]] | None:
            if not written.exists():
                return None
            started = json.loads(written.read_text())
            inside = {int(p) for p in Path(groups["pids"], "cgroup.procs").read_text().split()}
            return (started, inside) if started["child"] in inside else None

        started, inside = wait_for(seen, what="the job's processes in its group")  # type: ignore[misc]
        assert started["pid"] not in inside, (started, inside)
        flag.touch()
        assert job.wait(60).info.state == "succeeded"
        wait_for(lambda: job_groups(job.id) == {}, what="the job's groups removed")
    finally:
        flag.close()


def test_a_fork_bomb_stops_at_the_cap_of_processes(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path, cli: object
) -> None:
    needs_cgroups(server)
    name = f"forker-{uuid.uuid4().hex[:8]}"
    token = admin.create_token(name).token
    env = client_env(server, server.admin_token)
    listed = cli("quota", "list", **env)  # type: ignore[operator]
    star = next(line for line in listed.stdout.splitlines() if line.split()[:1] == ["*"])
    assert str(DEFAULT_PROCESSES_PER_JOB) in star.split(), listed.stdout  # the default, as quota list shows it
    done = cli("quota", "set", name, "--jobs", "4", "--processes", "64", **env)  # type: ignore[operator]
    assert done.code == 0 and "64 processes and threads per job" in done.output, done.output
    mine = next(q for q in admin.quotas() if q.user == name)
    assert (mine.jobs, mine.processes) == (4, 64)
    (tmp_path / "fork.py").write_text(FORK)
    with server.connect(token) as forker:
        job = forker.submit(["python", "fork.py"], workdir=tmp_path).wait(120)
        log = "\n".join(job.logs())
        info = job.info
    assert info.state == "failed" and info.exit_code == 3, (info, log)
    forked = int(re.search(r"fork failed after (\d+)", log).group(1))  # type: ignore[union-attr]
    assert 16 < forked < 64, log  # the sandbox, the supervisor and Python's own threads come first
    assert "reached its cap of 64 processes and threads" in info.message, info
    assert log.rstrip().endswith("`gpuport quota list` shows it)"), log
    wait_for(lambda: job_groups(info.id) == {}, what="the job's groups removed, its processes gone")


def test_without_a_sandbox_a_job_is_held_to_its_memory_too(tmp_path: Path) -> None:
    running = start_server(tmp_path / "state", "--no-sandbox")
    try:
        needs_cgroups(running)
        project = tmp_path / "project"  # not the folder of the server's state, whose files change while it syncs
        project.mkdir()
        (project / "alloc.py").write_text(ALLOCATE)
        with running.connect() as admin:
            job = admin.submit(["python", "alloc.py"], workdir=project, memory="200MiB").wait(120)
            assert (job.info.state, job.info.message) == ("killed", "exceeded its memory limit of 200MiB"), job.info
            assert admin.submit(["true"], workdir=None).wait(60).info.state == "succeeded"
    finally:
        running.stop()


def test_without_cgroups_the_banner_says_so_and_the_poll_holds_memory(tmp_path: Path) -> None:
    running = start_server(tmp_path / "state", "--no-cgroups")
    try:
        assert limits_line(running) == (
            "none: --no-cgroups was given; memory limits are polled (2 Hz), processes not capped"
        )
        project = tmp_path / "project"
        project.mkdir()
        (project / "alloc.py").write_text(
            ALLOCATE.replace('print(mib, "MiB", flush=True)', "import time; time.sleep(0.01)")
        )
        with running.connect() as admin:
            info = admin.submit(["python", "alloc.py"], workdir=project, memory="200MiB").wait(120).info
            assert info.state == "killed" and info.message.startswith("exceeded its memory limit of 200MiB (used "), (
                info
            )
    finally:
        running.stop()


def test_a_jobs_groups_are_made_with_its_limits(tmp_path: Path) -> None:
    """Cgroup v2's files, on a folder that stands for the hierarchy (this machine may have none)."""
    parent = tmp_path / "gpuport" / "key"
    parent.mkdir(parents=True)
    limits = cgroups.Cgroups(2, "", ("memory", "pids"), (str(parent),), (str(tmp_path / "server"),), 8 << 30)
    spec = limits.make("j-1", 256 << 20, 100)
    assert spec is not None
    folder = parent / "j-1"
    files = {
        name: (folder / name).read_text() for name in ("memory.max", "memory.swap.max", "memory.oom.group", "pids.max")
    }
    assert files == {"memory.max": str(256 << 20), "memory.swap.max": "0", "memory.oom.group": "1", "pids.max": "100"}
    assert spec["dirs"] == [str(folder)] and spec["homes"] == [str(tmp_path / "server")]
    assert spec["oom_own"] == "exceeded its memory limit of 256MiB"
    limits.make("j-2", 0, 100)
    assert (parent / "j-2" / "memory.max").read_text() == str(8 << 30)
    assert "limit of 8GiB (the default" in limits.make("j-2", 0, 100)["oom_own"]  # type: ignore[index]
    assert cgroups.NONE.make("j-3", 256 << 20, 100) is None

    # What the supervisor reads at the job's end.
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    (folder / "pids.events").write_text("max 0\n")
    groups = supervisor._Groups(spec)
    assert groups.oom_kills() == 1 and groups.oom_reason() == spec["oom_own"] and not groups.capped()
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\n")  # the parent's OOM
    (folder / "pids.events").write_text("max 3\n")
    assert groups.oom_reason() == spec["oom_other"] and groups.capped() == 100


def test_on_cgroup_v2_a_jobs_group_is_made_in_its_owners(tmp_path: Path) -> None:
    """Where v2 offers the cpu controller, each user's jobs share that user's group, which gets all
    three controllers for them; a user's group stays when one of their jobs goes."""
    parent = tmp_path / "gpuport" / "key"
    parent.mkdir(parents=True)
    limits = cgroups.Cgroups(
        2, "", ("memory", "pids"), (str(parent),), (str(tmp_path / "server"),), 8 << 30, cpu_parent=str(parent)
    )
    spec = limits.make("j-1", 256 << 20, 100, owner="Bob")
    assert spec is not None
    assert spec["dirs"] == [str(parent / "u-bob" / "j-1")] and spec["cpu"] == ""  # v2: the supervisor stays out
    assert (parent / "u-bob" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (parent / "u-bob" / "j-1" / "memory.max").read_text() == str(256 << 20)
    assert limits.group("j-1", "memory") == str(parent / "u-bob" / "j-1")
    assert "CPU shared equally by users" in limits.describe()
    assert cgroups.user_group("a/../b") != "u-a/../b" and cgroups.user_group("a/../b").startswith("u-h")


def test_on_cgroup_v1_a_users_cpu_group_is_made_beside_the_server(tmp_path: Path) -> None:
    """v1: each user's cpu group is made in the server's own cpu group, named for the server, so that it
    weighs what one process beside it does; the server's group itself is never removed, other servers'
    users' groups and other groups there are left alone."""
    home = tmp_path / "cpu"
    (home / "gpuport-other-u-bob").mkdir(parents=True)  # another server's
    (home / "system.slice").mkdir()
    memory = tmp_path / "memory" / "gpuport" / "key"
    memory.mkdir(parents=True)
    limits = cgroups.Cgroups(
        1, "", ("memory",), (str(memory),), (str(tmp_path / "memory"),), 8 << 30, str(home), "gpuport-key-"
    )
    spec = limits.make("j-1", 256 << 20, 100, owner="Bob")
    assert spec is not None and spec["cpu"] == str(home / "gpuport-key-u-bob")
    assert spec["dirs"] == [str(memory / "j-1")]  # the job's own groups stay under gpuport/<key>
    shutil.rmtree(memory / "j-1")  # what its supervisor removes at its end
    limits.release()
    assert sorted(p.name for p in home.iterdir()) == ["gpuport-other-u-bob", "system.slice"]


def test_the_server_moves_a_supervisor_into_its_owners_cpu_group(tmp_path: Path) -> None:
    """v1: the server moves a job's supervisor to its owner's cpu group as it starts it, before its
    Python has started (which it would otherwise do on the host's share)."""
    mount = next((m for m in cgroups._mounts() if m[2] == "cgroup" and "cpu" in m[3]), None)
    own = cgroups._own_groups().get("cpu")
    home = cgroups._folder(mount[0], mount[1], own) if mount and own else None
    if home is None or not os.access(home, os.W_OK):
        pytest.skip("no writable cgroup v1 cpu hierarchy here")
    group = os.path.join(home, f"gpuport-test-{uuid.uuid4().hex[:8]}-u-bob")
    os.mkdir(group)
    child = subprocess.Popen(["sleep", "30"])
    try:
        workspace._charge_to_owner(child.pid, {"cgroup": {"version": 1, "cpu": group}})
        lines = Path(f"/proc/{child.pid}/cgroup").read_text().splitlines()
        assert any(line.split(":")[1] == "cpu" and line.endswith(group[len(home) :]) for line in lines), lines
    finally:
        child.kill()
        child.wait()
        cgroups.remove_group(group)
    workspace._charge_to_owner(child.pid, {"cgroup": {"version": 1, "cpu": group}})  # gone: no error


# Waits for the flag file named by argv[1], then spins; says how much CPU time it got between 2 s
# and 7 s after the flag was made (its mtime: the same window for every job, however late each saw it).
# Every job spins on the same one CPU: the kernel weighs groups CPU by CPU, so on two CPUs Bob's one
# process could not take more than one of them, and on a machine busy with other work the groups'
# shares of each CPU would hang on where their processes happen to run.
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
raised = os.stat(sys.argv[1]).st_mtime
if time.time() > raised + 2:
    sys.exit("saw the flag too late to measure")
while time.time() < raised + 2:
    pass
start = time.process_time()
while time.time() < raised + 7:
    pass
print("cpu", time.process_time() - start, flush=True)
"""


def test_cpu_is_divided_between_users_not_between_their_jobs(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path
) -> None:
    """Alice's three busy jobs together get what Bob's one gets (both want more than two cores
    give): Bob's job gets about three times the CPU time of each of Alice's, in the same 5 s."""
    needs_cgroups(server)
    if "CPU shared equally by users" not in limits_line(server):
        pytest.skip(f"no cpu controller here: {limits_line(server)}")
    (tmp_path / "spin.py").write_text(SPIN)
    names = [f"cpu-{who}-{uuid.uuid4().hex[:6]}" for who in ("alice", "bob")]
    tokens = [admin.create_token(name).token for name in names]
    with server.connect(tokens[0]) as alice, server.connect(tokens[1]) as bob:
        flag = JobFlag(server.state_dir, f"spin-{uuid.uuid4().hex[:6]}")
        try:  # all four spin at once, once all four run
            spin = ["python", "spin.py", str(flag)]
            theirs = [alice.submit(spin, workdir=tmp_path) for _ in range(3)]
            mine = bob.submit(spin, workdir=tmp_path)
            wait_for(lambda: all(j.refresh().state == "running" for j in [*theirs, mine]), what="four running jobs")
            flag.touch()
            logs = ["\n".join(job.wait(120).logs()) for job in [*theirs, mine]]
        finally:
            flag.close()
    cpu = [float(re.search(r"^cpu (\S+)$", log, re.MULTILINE)[1]) for log in logs]  # type: ignore[index]
    # 2-3x Alice's average here; with CPU divided by processes, each would get the same.
    assert cpu[3] >= 1.5 * sum(cpu[:3]) / 3, cpu
    for name in names:  # each user's group, made for their first job, stays for their next
        points = [point for _, point, _, options in cgroups._mounts() if "cpu" in options]
        found = [f"/**/gpuport/*/u-{name}", f"/**/gpuport-*-u-{name}"]  # v2; v1: beside the server
        assert any(glob.glob(point + pattern, recursive=True) for point in points for pattern in found), name


def _allocate(mib: int) -> int:
    held = [b"x" * (1 << 20) for _ in range(mib)]
    return len(held)


def test_a_session_worker_is_held_to_its_memory_and_killed_alone(server: RunningServer, alice: gpuport.Client) -> None:
    needs_cgroups(server)
    with alice.session(memory="300MiB") as session:
        assert session.call(_allocate, 64) == 64
        worker = session.info().job_id
        groups = job_groups(worker)
        assert set(groups) == {"memory", "pids"} and memory_limit(groups["memory"]) == 300 << 20
        with pytest.raises(gpuport.WorkerDied):
            session.call(_allocate, 1024)
        info = alice.job(worker).wait(60).info
        assert (info.state, info.message) == ("killed", "exceeded its memory limit of 300MiB"), info
        assert session.info().state == "died"
        session.restart()
        assert session.call(_allocate, 16) == 16  # a fresh worker, in a fresh group
        assert job_groups(session.info().job_id) and job_groups(worker) == {}
