"""The job supervisor, run for real (``python -I -S supervisor.py JOB_DIR``) on a job directory of
its own: one process as always, N processes of a distributed job, fail-fast, kill with a reason.

Real distributed training (TensorFlow's MultiWorkerMirroredStrategy, PyTorch DDP) runs through the
server in ``test_distributed.py``.
"""

from __future__ import annotations

import json
import marshal
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuport.server.worker import supervisor
from tests.conftest import wait_for

# What the supervisor sets for N > 1; the tests' own environment must not pretend to have them.
DISTRIBUTED_VARS = (
    "TF_CONFIG",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GPUPORT_RANK",
    "GPUPORT_NPROCS",
)
ENDS_WITHIN = 15.0  # seconds for a supervisor to end once its job is done, failed or stopped

SHOWN = (*DISTRIBUTED_VARS, "CUDA_VISIBLE_DEVICES")
# Prints what a rank sees of its environment, as JSON on one line.
SHOW_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {SHOWN!r}}}), flush=True)"
# Rank 0 notes a SIGTERM in a file and sleeps on, so that only SIGKILL ends it; once it is ready,
# rank 1 fails with 3.
ONE_FAILS = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.environ["RANK"] == "1":
        for _ in range(1000):
            if os.path.exists("rank0-ready"):
                break
            time.sleep(0.01)
        print("rank 1 fails", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *_: open("rank0-got-sigterm", "w").close())
    open("rank0-ready", "w").close()
    for _ in range(600):
        time.sleep(0.1)
    """
)
# Every rank says it is ready, then sleeps: ended only by the supervisor.
SLEEPS = "import time; print('ready', flush=True); time.sleep(60)"


@dataclass
class Job:
    """A supervisor started on ``job_dir``; its job runs in ``work``."""

    job_dir: Path
    work: Path
    process: subprocess.Popen[bytes]

    def wait(self, timeout: float = ENDS_WITHIN) -> dict[str, Any]:
        """Wait for the supervisor to end; its exit.json."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            tail = self.log()[-3000:]
            raise AssertionError(f"the supervisor still runs after {timeout}s; the log ends:\n{tail}") from None
        assert code == 0, (self.job_dir / "supervisor.log").read_text()
        return dict(json.loads((self.job_dir / "exit.json").read_text()))

    def info(self) -> dict[str, Any]:
        """supervisor.json, once the supervisor has started the job."""
        path = self.job_dir / "supervisor.json"
        wait_for(path.exists, what="supervisor.json")
        return dict(json.loads(path.read_text()))

    def log(self) -> str:
        path = self.job_dir / "log"
        return path.read_text() if path.exists() else ""

    def wait_for_log(self, pattern: str, count: int = 1) -> None:
        wait_for(lambda: len(re.findall(pattern, self.log(), re.M)) >= count, what=f"{count} x {pattern!r} in the log")


Start = Callable[..., Job]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Start]:
    """Start the supervisor on a job directory of its own; whatever is left is killed at the end."""
    jobs: list[Job] = []

    def start(argv: list[str], **options: Any) -> Job:
        job_dir, work = tmp_path / f"job{len(jobs)}", tmp_path / f"work{len(jobs)}"
        job_dir.mkdir()
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARS}
        spec = {"argv": argv, "cwd": str(work), "env": env, "grace": 2.0, "time_limit": 0, **options}
        (job_dir / "spec.marshal").write_bytes(marshal.dumps(spec))
        with open(job_dir / "supervisor.log", "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", supervisor.__file__, str(job_dir)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        jobs.append(Job(job_dir, work, process))
        return jobs[-1]

    yield start
    for job in jobs:
        if job.process.poll() is None:  # a failed test: stop what it left running
            job.process.kill()
            job.process.wait()
            info = job.job_dir / "supervisor.json"
            for pid in json.loads(info.read_text())["children"] if info.exists() else []:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def by_rank(log: str) -> dict[int, list[str]]:
    """The log's prefixed lines, rank by rank, without their prefix."""
    lines: dict[int, list[str]] = {}
    for line in log.splitlines():
        if match := re.fullmatch(r"\[(\d+)\] (.*)", line):
            lines.setdefault(int(match[1]), []).append(match[2])
    return lines


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_one_process_writes_the_log_as_it_always_has(run: Start) -> None:
    code = SHOW_ENV + "; import sys; print('to stderr', file=sys.stderr); sys.stdout.write('last'); sys.exit(5)"
    job = run(python(code))
    status = job.wait()
    assert status["exit_code"] == 5
    assert set(status) == {"started_at", "ended_at", "exit_code", "cpu_seconds"}
    seen, rest = job.log().split("\n", 1)
    assert rest == "to stderr\nlast"  # straight from the process: no prefix, nothing added
    assert json.loads(seen) == {k: os.environ.get(k) for k in SHOWN}
    info = job.info()
    assert info["children"] == [info["child"]] and info["pid"] == job.process.pid


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_command_that_cannot_start_ends_with_127(run: Start, nprocs: int) -> None:
    job = run(["/nonexistent/command"], nprocs=nprocs)
    status = job.wait()
    assert status["exit_code"] == 127 and status.get("failed_rank") == (0 if nprocs > 1 else None)
    assert status["error"] == "cannot start '/nonexistent/command': No such file or directory"
    assert job.log() == f"gpuport: {status['error']}\n"


def test_a_link_starts_before_the_job_and_is_killed_after_it(run: Start, tmp_path: Path) -> None:
    # The link notes its pid, says ready, and then waits; the job sees that it runs already.
    pid_file = tmp_path / "link.pid"
    link = python(
        f"import os, sys, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('ready', flush=True); time.sleep(600)"
    )
    job = run(python(f"import os; print(os.path.exists({str(pid_file)!r}))"), link={"argv": link, "env": {}})
    status = job.wait()
    assert status["exit_code"] == 0 and job.log() == "True\n"
    pid = int(pid_file.read_text())
    wait_for(lambda: is_gone(pid) or _zombie(pid), 10, "the link to be killed once the job has ended")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_link_that_does_not_start_stops_the_job_saying_why(run: Start, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    job = run(python(f"open({str(ran)!r}, 'w')"), link={"argv": python("print('OSError: no address')"), "env": {}})
    status = job.wait()
    assert status["exit_code"] == 127 and not ran.exists()
    assert status["error"] == "the job's link to the server did not start: OSError: no address"
    assert job.log() == f"gpuport: {status['error']}\n"


def test_two_ranks_find_each_other(run: Start) -> None:
    job = run(python(SHOW_ENV), nprocs=2)
    assert job.wait()["exit_code"] == 0
    lines = by_rank(job.log())
    assert sorted(lines) == [0, 1]
    seen = {rank: json.loads(lines[rank][0]) for rank in lines}
    assert seen[0]["MASTER_ADDR"] == seen[1]["MASTER_ADDR"] == "127.0.0.1"
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    assert seen[0]["TF_CONFIG"] is not None
    cluster = json.loads(seen[0]["TF_CONFIG"])["cluster"]
    assert list(cluster) == ["worker"] and len(cluster["worker"]) == 2
    addresses = [*cluster["worker"], f"127.0.0.1:{seen[0]['MASTER_PORT']}"]
    assert len(set(addresses)) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses)
    for rank in (0, 1):
        assert json.loads(seen[rank]["TF_CONFIG"]) == {"cluster": cluster, "task": {"type": "worker", "index": rank}}
        assert seen[rank]["RANK"] == seen[rank]["LOCAL_RANK"] == seen[rank]["GPUPORT_RANK"] == str(rank)
        assert seen[rank]["WORLD_SIZE"] == seen[rank]["LOCAL_WORLD_SIZE"] == seen[rank]["GPUPORT_NPROCS"] == "2"
        assert seen[rank]["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    info = job.info()
    assert len(info["children"]) == 2 and info["child"] == info["children"][0]


# SHOW_ENV, then a file saying so; the chief waits for every other rank's before it ends the job.
SHOW_ENV_CHIEF_LAST = SHOW_ENV + textwrap.dedent(
    """
    import time
    open(f"shown-{os.environ['RANK']}", "w").close()
    others = [f"shown-{r}" for r in range(int(os.environ["WORLD_SIZE"])) if str(r) != os.environ["RANK"]]
    deadline = time.monotonic() + 30
    while "chief" in os.environ["TF_CONFIG"] and json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "chief":
        if all(os.path.exists(o) for o in others) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    """
)


def test_tf_roles_name_the_tasks_in_order(run: Start) -> None:
    job = run(python(SHOW_ENV_CHIEF_LAST), nprocs=4, tf_roles=[["chief", 1], ["worker", 2], ["ps", 1]])
    assert job.wait()["exit_code"] == 0
    configs = {rank: json.loads(json.loads(lines[0])["TF_CONFIG"]) for rank, lines in by_rank(job.log()).items()}
    tasks = [configs[rank]["task"] for rank in range(4)]
    assert tasks == [
        {"type": "chief", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
        {"type": "ps", "index": 0},
    ]
    cluster = configs[0]["cluster"]
    assert list(cluster) == ["chief", "worker", "ps"]
    assert [len(cluster[role]) for role in cluster] == [1, 2, 1]
    assert all(config["cluster"] == cluster for config in configs.values())
    assert len({address for addresses in cluster.values() for address in addresses}) == 4


def test_the_job_ends_when_its_chief_has_finished(run: Start) -> None:
    # A parameter server serves until it is stopped: the chief's success is the job's.
    serve = "import os, sys, time\nif os.environ['RANK'] != '0':\n    time.sleep(120)\nprint('chief done', flush=True)"
    job = run(python(serve), nprocs=2, tf_roles=[["chief", 1], ["ps", 1]])
    status = job.wait()
    assert status["exit_code"] == 0 and "failed_rank" not in status
    assert (
        "[0] chief done" in job.log() and "gpuport: the chief has finished; stopping the other processes" in job.log()
    )


def test_rank_gpus_set_each_ranks_visible_devices(run: Start) -> None:
    job = run(python(SHOW_ENV), nprocs=3, rank_gpus=[[0, 2], [1], []])
    assert job.wait()["exit_code"] == 0
    seen = {rank: json.loads(lines[0])["CUDA_VISIBLE_DEVICES"] for rank, lines in by_rank(job.log()).items()}
    assert seen == {0: "0,2", 1: "1", 2: ""}


def test_lines_of_ranks_never_mix(run: Start) -> None:
    # Lines of uneven lengths, flushed in pieces that cut lines in two, from both ranks at once.
    code = textwrap.dedent(
        """
        import os, sys
        rank = os.environ["RANK"]
        out = sys.stdout
        for i in range(3000):
            out.write(f"rank {rank} line {i} " + "x" * (i % 300) + "\\n")
            if i % 7 == 0:
                out.write(f"rank {rank} half of line")
                out.flush()
                out.write(f" {i}\\n")
        out.write(f"rank {rank} the end")
        """
    )
    job = run(python(code), nprocs=2)
    assert job.wait()["exit_code"] == 0
    log = job.log()
    assert log.endswith("\n")
    lines = by_rank(log)
    assert len(lines[0]) + len(lines[1]) == len(log.splitlines())  # every line has its prefix
    for rank in (0, 1):
        expected = []
        for i in range(3000):
            expected.append(f"rank {rank} line {i} " + "x" * (i % 300))
            if i % 7 == 0:
                expected.append(f"rank {rank} half of line {i}")
        assert lines[rank] == [*expected, f"rank {rank} the end"]


def test_the_first_failing_rank_stops_the_others(run: Start) -> None:
    job = run(python(ONE_FAILS), nprocs=2, grace=1.0)
    started = time.monotonic()
    children = job.info()["children"]
    status = job.wait()
    assert time.monotonic() - started < 10  # the sleeper would go on for a minute
    assert status["exit_code"] == 3 and status["failed_rank"] == 1
    assert "cancelled" not in status and "timed_out" not in status
    assert is_gone(children[0])
    assert (job.work / "rank0-got-sigterm").exists()  # SIGTERM first; SIGKILL after the grace period
    lines = job.log().splitlines()
    note = "gpuport: rank 1 exited with code 3; stopping the other processes"
    assert note in lines and lines.index("[1] rank 1 fails") < lines.index(note)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_sigusr1_kills_the_job_for_the_reason_in_kill_json(run: Start, nprocs: int) -> None:
    job = run(python(SLEEPS), nprocs=nprocs, grace=30.0)
    children = job.info()["children"]
    job.wait_for_log("ready$", nprocs)
    reason = "exceeded its GPU memory slice of 8GiB (used 9.1GiB)"
    (job.job_dir / "kill.json").write_text(json.dumps({"reason": reason}))
    started = time.monotonic()
    os.kill(job.process.pid, signal.SIGUSR1)
    status = job.wait()
    assert time.monotonic() - started < 5  # no grace period
    assert status["killed"] == reason and status["exit_code"] == -signal.SIGKILL
    assert "failed_rank" not in status and "cancelled" not in status
    assert job.log().endswith(f"gpuport: job killed: {reason}\n")
    assert all(is_gone(pid) for pid in children)


def test_cancel_stops_every_rank(run: Start) -> None:
    job = run(python(SLEEPS), nprocs=2)
    children = job.info()["children"]
    job.wait_for_log("ready$", 2)
    os.kill(job.process.pid, signal.SIGTERM)
    status = job.wait()
    assert status["cancelled"] is True and status["exit_code"] == -signal.SIGTERM
    assert "failed_rank" not in status
    assert all(is_gone(pid) for pid in children)


def test_the_time_limit_stops_every_rank(run: Start) -> None:
    job = run(python(SLEEPS), nprocs=2, time_limit=1.0)
    children = job.info()["children"]
    started = time.monotonic()
    status = job.wait()
    assert time.monotonic() - started < 10
    assert status["timed_out"] is True and status["exit_code"] == -signal.SIGTERM
    assert "failed_rank" not in status and "cancelled" not in status
    assert all(is_gone(pid) for pid in children)


def test_a_sandboxed_jobs_report_is_taken_only_for_its_known_fields() -> None:
    """The supervisor inside a sandbox runs as the job's user: what it reports is a claim, checked."""
    forged = b'{"exit_code": 3, "started_at": 1.5, "cancelled": true, "killed": "x", "ended_at": "soon"}'
    assert supervisor._reported_status(forged) == {"exit_code": 3, "started_at": 1.5, "cancelled": True}
    for junk in (b"", b"garbage", b"[1]", b'{"exit_code": true}', b'{"started_at": 1}'):
        assert supervisor._reported_status(junk) is None
    assert supervisor._reported_status(b'{"exit_code": 0, "timed_out": 1}') == {"exit_code": 0}
