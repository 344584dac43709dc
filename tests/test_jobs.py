"""Jobs end to end through the Python API and the CLI, against the real server and real processes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import textwrap
from pathlib import Path

import pytest

import gpuport
from gpuport.protocol import gpuport_pb2 as pb
from tests._terminal import Command
from tests.conftest import RunningServer, client_env, touch_in_job, wait_for

TRAIN = textwrap.dedent(
    """
    import json, os, sys
    print("training on", os.environ.get("CUDA_VISIBLE_DEVICES"), "job", os.environ["GPUPORT_JOB_ID"])
    print("to stderr", file=sys.stderr)
    print("back to stdout")
    os.makedirs("model", exist_ok=True)
    with open("model/weights.bin", "wb") as f:
        f.write(bytes(range(256)) * 40)
    with open(os.path.join(os.environ["GPUPORT_OUTPUT_DIR"], "metrics.json"), "w") as f:
        json.dump({"accuracy": 0.9, "extra": os.environ.get("EXTRA")}, f)
    sys.exit(int(os.environ.get("EXIT", "0")))
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_text(TRAIN)
    (root / "data" / "table.csv").write_text("a,b\n1,2\n")
    (root / ".gitignore").write_text("*.tmp\n")
    (root / "scratch.tmp").write_text("not synced")
    return root


def test_submit_runs_in_the_synced_workdir_streams_logs_and_brings_outputs_back(
    admin: gpuport.Client, project: Path, tmp_path: Path
) -> None:
    job = admin.submit(
        ["python", "train.py"], workdir=project, gpus=1, env={"EXTRA": "x", "EXIT": "3"}, outputs=["model/"]
    )
    assert job.id.startswith("j-")
    lines = list(job.logs(follow=True))
    assert lines == [f"training on 0 job {job.id}", "to stderr", "back to stdout"]
    assert job.wait().exit_code == 3
    assert job.status == "failed" and job.info.message == "exited with code 3"
    files = job.download(tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in files) == ["metrics.json", "model/weights.bin"]
    assert (tmp_path / "out" / "model" / "weights.bin").read_bytes() == bytes(range(256)) * 40
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == {"accuracy": 0.9, "extra": "x"}
    only = job.download(tmp_path / "part", "model")
    assert [p.name for p in only] == ["weights.bin"] and not (tmp_path / "part" / "metrics.json").exists()
    assert admin.job(job.id).info.state == "failed"
    assert job.id in [j.id for j in admin.jobs()]


def test_download_fetches_only_files_that_differ(admin: gpuport.Client, project: Path, tmp_path: Path) -> None:
    job = admin.submit(["python", "train.py"], workdir=project, outputs=["model"]).wait()
    dest = tmp_path / "out"
    job.download(dest)
    weights, metrics = dest / "model" / "weights.bin", dest / "metrics.json"
    metrics.write_text("edited")
    before = weights.stat().st_ino, weights.stat().st_mtime_ns
    job.download(dest)
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == before  # same content: not fetched again
    assert json.loads(metrics.read_text())["accuracy"] == 0.9  # changed: fetched again


def test_only_missing_files_are_uploaded_and_ignored_ones_never(admin: gpuport.Client, project: Path) -> None:
    first = admin.push(project, "sync-test")
    assert first.files == 3  # train.py, data/table.csv, .gitignore; not scratch.tmp
    again = admin.push(project, "sync-test")
    assert (again.id, again.uploaded_files) == (first.id, 0)
    (project / "data" / "table.csv").write_text("a,b\n3,4\n")
    (project / "new.py").write_text("print(1)\n")
    changed = admin.push(project, "sync-test")
    assert changed.id != first.id and changed.uploaded_files == 2
    job = admin.submit("cat data/table.csv; ls", workdir=None, project="sync-test").wait()
    assert list(job.logs()) == ["a,b", "3,4", "data", "new.py", "train.py"]
    assert "sync-test" in [s.name for s in admin.snapshots()]


def _settled(folder: Path) -> None:
    """Make ``folder``'s files old: the hash cache keeps only settled files' hashes between pushes."""
    for path in folder.rglob("*"):
        os.utime(path, (1_000_000_000, 1_000_000_000))


def test_an_unchanged_push_names_its_snapshot_without_sending_the_manifest(
    admin: gpuport.Client, project: Path
) -> None:
    (project / "train.py").chmod(0o4755)  # a mode beyond 0o777, and a link: the id's every field
    (project / "latest.csv").symlink_to("data/table.csv")
    _settled(project)
    first = admin.push(project, "named-a")
    sent: list[int] = []
    create = admin.transport.snapshots.Create

    def counted(request: object, **kw: object) -> object:
        sent.append(len(request.entries))  # type: ignore[attr-defined]
        return create(request, **kw)

    admin.transport.snapshots.Create = counted  # type: ignore[method-assign]
    again = admin.push(project, "named-b")
    assert (again.id, again.files, again.bytes, again.uploaded_files) == (first.id, first.files, first.bytes, 0)
    assert sent == []  # its id, computed here as the server computes it, went instead
    names = {s.name: s.id for s in admin.snapshots()}
    assert (names["named-a"], names["named-b"]) == (first.id, first.id)
    (project / "train.py").write_text(TRAIN + "# changed\n")
    changed = admin.push(project, "named-b")
    assert changed.id != first.id and sent == [first.files] and changed.uploaded_files == 1


def test_an_unchanged_push_of_another_users_snapshot_sends_its_manifest_and_files(
    server: RunningServer, admin: gpuport.Client, project: Path, user_token: str
) -> None:
    _settled(project)
    first = admin.push(project, "theirs")
    with server.connect(user_token) as other:  # the same hash cache: every hash known, no such snapshot
        mine = other.push(project, "mine")
        with pytest.raises(gpuport.NotFound, match="no snapshot"):
            other.transport.call(other.transport.snapshots.Name, pb.NameSnapshotRequest(snapshot_id="0" * 64))
    assert (mine.id, mine.uploaded_files) == (first.id, first.files)
    assert "mine" not in [s.name for s in admin.snapshots()]


def test_a_job_gets_its_gpus_job_id_output_dir_and_datasets(admin: gpuport.Client, tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "x.txt").write_text("dataset bytes")
    admin.push(dataset, "ds-test")
    script = (
        'import os; print(os.environ["CUDA_VISIBLE_DEVICES"]); '
        'd = os.environ["GPUPORT_DATASETS_DIR"]; print(open(os.path.join(d, "ds-test", "x.txt")).read()); '
        'print(os.stat(os.path.join(d, "ds-test", "x.txt")).st_mode & 0o222)'
    )
    job = admin.submit(["python", "-c", script], workdir=None, gpus=2, datasets=["ds-test"]).wait()
    assert list(job.logs()) == ["0,1", "dataset bytes", "0"]  # read-only
    assert job.info.gpu_indices == (0, 1)


def test_gpu_jobs_queue_first_come_and_show_in_gpus(server: RunningServer, admin: gpuport.Client) -> None:
    hold = "import os, time\nwhile not os.path.exists('go'): time.sleep(0.02)"
    big = admin.submit(["python", "-c", hold], workdir=None, gpus=2)
    wait_for(lambda: big.status == "running", what="the 2-GPU job running")
    small = admin.submit(["python", "-c", "pass"], workdir=None, gpus=1)
    assert small.status == "queued" and "needs 1 GPU, 0 free" in small.info.message
    assert [g.jobs for g in admin.gpus()] == [(big.id,), (big.id,)]
    cpu = admin.submit(["python", "-c", "pass"], workdir=None).wait(30)
    assert cpu.info.state == "succeeded"  # needs no GPU: not held up
    touch_in_job(server.state_dir, big.id, "go")
    assert small.wait(30).exit_code == 0 and big.wait(30).exit_code == 0
    assert small.info.started_at >= big.info.ended_at - 0.5


def test_cancel_a_queued_job_and_a_running_one(admin: gpuport.Client, tmp_path: Path) -> None:
    handler = textwrap.dedent(
        """
        import signal, sys, time
        def stop(*_):
            print("got SIGTERM, saving", flush=True)
            sys.exit(5)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    running = admin.submit(["python", "-c", handler], workdir=None, gpus=2)
    wait_for(lambda: running.info.log_bytes or running.refresh().log_bytes, what="the job's first line")
    queued = admin.submit(["python", "-c", "pass"], workdir=None, gpus=1)
    assert queued.cancel().state == "cancelled"
    running.cancel()
    info = running.wait(30).info
    assert (info.state, info.exit_code) == ("cancelled", 5)
    assert list(running.logs()) == ["ready", "got SIGTERM, saving"]
    with pytest.raises(gpuport.Conflict, match="already ended"):
        running.cancel()


def test_cancel_kills_a_job_that_ignores_sigterm_after_the_grace_period(admin: gpuport.Client) -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    job = admin.submit(["python", "-c", stubborn], workdir=None)
    wait_for(lambda: job.refresh().log_bytes, what="the job's first line")
    job.cancel()
    info = job.wait(30).info
    assert info.state == "cancelled" and "SIGKILL" in info.message


def test_wait_timeout_and_a_command_that_does_not_exist(admin: gpuport.Client) -> None:
    job = admin.submit(["python", "-c", "import time; time.sleep(30)"], workdir=None)
    with pytest.raises(gpuport.WaitTimeout, match="still running"):
        job.wait(timeout=0.3)
    job.cancel()
    missing = admin.submit(["no-such-program-here"], workdir=None).wait(30)
    assert (missing.info.state, missing.info.exit_code) == ("failed", 127)
    assert "cannot start 'no-such-program-here'" in "\n".join(missing.logs())


# ---- the CLI --------------------------------------------------------------------------------------------


def test_cli_run_streams_logs_exits_with_the_job_code_and_downloads_outputs(
    cli: object, server: RunningServer, project: Path, stdio: str
) -> None:
    result = cli(
        "run",
        "--gpus",
        "1",
        "--output",
        "model/",
        "-e",
        "EXIT=4",
        "--",
        "python",
        "train.py",
        cwd=project,
        stdio=stdio,
        **client_env(server),
    )  # type: ignore[operator]
    assert result.code == 4, result.output
    assert "training on 0 job j-" in result.stdout and "to stderr" in result.stdout
    job_id = result.stdout.split(" job ")[1].split()[0]
    outputs = project / "gpuport-outputs" / job_id
    assert (outputs / "model" / "weights.bin").stat().st_size == 10240
    assert (outputs / "metrics.json").exists()
    assert f"job {job_id} failed" in result.stderr
    # The outputs folder is never synced back up with the next run.
    again = cli("run", "--", "ls", cwd=project, stdio=stdio, **client_env(server))  # type: ignore[operator]
    assert again.code == 0 and "train.py" in again.stdout and "gpuport-outputs" not in again.stdout


def test_cli_run_of_a_python_file_says_to_run_it_with_python_and_submits_nothing(
    cli: object, server: RunningServer, admin: gpuport.Client, project: Path
) -> None:
    env = client_env(server)
    name = f"py-hint-{os.getpid()}"
    refused = cli("run", "--name", name, "train.py", "--epochs", "5", cwd=project, **env)  # type: ignore[operator]
    assert refused.code == 1, refused.output
    assert refused.stderr.strip() == (
        "error: train.py is not executable: a Python file runs with python — "
        "did you mean `gpuport run -- python train.py --epochs 5`?"
    )
    (project / "hello.py").write_text("#!/usr/bin/env python3\nprint('hello')\n")
    (project / "hello.py").chmod(0o755)
    bare = cli("run", "--name", name, "hello.py", cwd=project, **env)  # type: ignore[operator]
    assert bare.code == 1 and "hello.py is looked up on the server's PATH, not in the workdir" in bare.stderr
    assert not admin.jobs(all=True, name=name)  # nothing was submitted
    # An executable script named by its path runs as it is.
    ran = cli("run", "./hello.py", cwd=project, **env)  # type: ignore[operator]
    assert ran.code == 0 and ran.stdout == "hello\n", ran.output


def _job_id(text: str) -> str:
    found = re.search(r"\bj-[0-9a-f]{8}\b", text)
    assert found, text
    return found[0]


def test_cli_detach_jobs_logs_wait_download_cancel(
    cli: object, server: RunningServer, project: Path, tmp_path: Path, stdio: str
) -> None:
    env = client_env(server)
    run = cli(
        "run",
        "--detach",
        "--name",
        "detached",
        "--output",
        "model",
        "--",
        "python",
        "train.py",
        cwd=project,
        stdio=stdio,
        **env,
    )  # type: ignore[operator]
    assert run.code == 0, run.output
    job_id = run.stdout.splitlines()[0]  # the id alone on its line, first
    assert job_id == _job_id(run.stdout) and f"gpuport logs -f {job_id}" in run.stderr
    assert cli("wait", job_id, stdio=stdio, **env).code == 0  # type: ignore[operator]
    listing = cli("jobs", "--json", **env)  # type: ignore[operator]
    mine = [j for j in json.loads(listing.stdout) if j["id"] == job_id][0]
    assert (mine["name"], mine["state"], mine["exit_code"]) == ("detached", "succeeded", 0)
    # Its name's jobs only: other tests' arrays (`j-…[0-4]`, their states counted) widen the columns.
    table = cli("jobs", "--name", "detached", stdio=stdio, **env)  # type: ignore[operator]
    assert table.code == 0 and "JOB" in table.stdout.splitlines()[0], table.output
    row = next(line for line in table.stdout.splitlines() if job_id in line)  # an id is never cut
    assert "detached" in row and "succeeded" in row
    if stdio == "terminal":  # the table fits the terminal's 100 columns
        assert max(len(line) for line in table.stdout.splitlines()) <= 100
    logs = cli("logs", job_id, stdio=stdio, **env)  # type: ignore[operator]
    assert logs.stdout.splitlines()[1:] == ["to stderr", "back to stdout"]
    download = cli("download", job_id, "model", "-o", str(tmp_path / "dl"), stdio=stdio, **env)  # type: ignore[operator]
    assert download.code == 0 and (tmp_path / "dl" / "model" / "weights.bin").exists()
    sleeper = _job_id(cli("run", "-d", "--", "sleep", "30", cwd=project, stdio=stdio, **env).stdout)  # type: ignore[operator]
    assert cli("cancel", sleeper, stdio=stdio, **env).code == 0  # type: ignore[operator]
    assert cli("wait", sleeper, stdio=stdio, **env).code == 128 + signal.SIGTERM  # type: ignore[operator]
    pushed = cli("push", str(project), "--name", f"cli-proj-{stdio}", stdio=stdio, **env)  # type: ignore[operator]
    assert pushed.code == 0 and f"as cli-proj-{stdio}" in pushed.stderr
    snapshots = cli("snapshots", stdio=stdio, **env)  # type: ignore[operator]
    assert snapshots.code == 0 and f"cli-proj-{stdio}" in snapshots.stdout and "NAME" in snapshots.stdout


def test_tables_keep_one_line_a_row_piped_and_on_a_terminal(
    cli: object, server: RunningServer, admin: gpuport.Client, stdio: str
) -> None:
    """A long command is one line: piped, nothing wraps whatever the width (80 columns when no terminal
    says otherwise); on a terminal, the command is cut to fit with an ellipsis."""
    words = ["python", "train.py", *[f"--option-{i}=value-{i}" for i in range(12)]]
    name = f"tables-{stdio}-{os.getpid()}"  # its jobs listed alone: other tests' arrays widen the columns
    job = admin.submit(words, workdir=None, name=name).wait(60)
    script = admin.submit(["python", "-c", "import sys\nprint(sys.version)"], workdir=None, name=name)  # lines, on one
    script.wait(60)
    session = admin.session(name=f"a-session-with-a-long-name-for-its-table-{stdio}-{os.getpid()}", cpus=0.1)
    try:
        env = client_env(server)
        piped_env = {**env, "COLUMNS": "80"}  # as a pipe with no terminal to measure
        for command in (("jobs",), ("sessions",)):
            listing = cli(*command, stdio=stdio, **(piped_env if stdio == "piped" else env))  # type: ignore[operator]
            assert listing.code == 0, listing.output
            rows = listing.stdout.splitlines()[1:]
            first = (
                r"^j-[0-9a-f]{8}(_\d+|\[[0-9,-]+\])? " if command == ("jobs",) else r"^s-[0-9a-f]+ "
            )  # an array: j-…[0-4]
            if stdio == "piped":  # every row one line, whatever else other tests left there
                assert rows and all(re.match(first, row) for row in rows), listing.stdout
            else:
                assert max(len(line) for line in listing.stdout.splitlines()) <= 100, listing.stdout
        jobs = cli("jobs", "--name", name, stdio=stdio, **(piped_env if stdio == "piped" else env))  # type: ignore[operator]
        lines = jobs.stdout.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.startswith(job.id)]
        assert " python" in lines[at]  # the command, cut as far as the other columns of the jobs there need
        assert at + 1 == len(lines) or re.match(r"^j-[0-9a-f]{8}[\[_ ]", lines[at + 1]), jobs.stdout
        (row,) = [i for i, line in enumerate(lines) if line.startswith(script.id)]
        assert " python -c" in lines[row] and (
            row + 1 == len(lines) or re.match(r"^j-[0-9a-f]{8}[\[_ ]", lines[row + 1])
        )
        if stdio == "piped":
            assert "python -c import sys\\nprint(sys.version)" in lines[row]
        if stdio == "piped":
            assert lines[at].rstrip().endswith("--option-1=value-1 --o...")  # its first 57 characters
        else:
            assert lines[at].rstrip().endswith("…")
    finally:
        session.close()


# A job that checks the 20 MB file synced with it and writes 20 MB of outputs.
BIG_JOB = textwrap.dedent(
    """
    import hashlib, os
    print("input", hashlib.sha256(open("input.bin", "rb").read()).hexdigest())
    data = os.urandom(20_000_000)
    with open(os.path.join(os.environ["GPUPORT_OUTPUT_DIR"], "weights.bin"), "wb") as f:
        f.write(data)
    print("output", hashlib.sha256(data).hexdigest())
    """
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_moves_files_over_4_mib_with_a_progress_bar_on_a_terminal(
    cli: object, server: RunningServer, project: Path, tmp_path: Path, stdio: str
) -> None:
    """push, run (its upload and its outputs) and download of 20 MB each: a bar on a terminal, none piped."""
    env = client_env(server)
    on_terminal = stdio == "terminal"
    data = tmp_path / "data"
    data.mkdir()
    (data / "table.bin").write_bytes(os.urandom(20_000_000))
    pushed = cli("push", str(data), "--name", f"big-{stdio}", stdio=stdio, **env)  # type: ignore[operator]
    assert pushed.code == 0 and "(uploaded 1 files, 19.1MiB)" in pushed.stderr, pushed.output
    assert pushed.drew_progress("uploading") is on_terminal, pushed.raw

    (project / "input.bin").write_bytes(os.urandom(20_000_000))  # new: the run uploads it
    (project / "job.py").write_text(BIG_JOB)
    run = cli("run", "--", "python", "job.py", cwd=project, stdio=stdio, **env)  # type: ignore[operator]
    assert run.code == 0, run.output
    assert f"input {_sha256(project / 'input.bin')}" in run.stdout
    assert run.drew_progress("uploading") is on_terminal and run.drew_progress("downloading") is on_terminal
    job_id = _job_id(run.stderr)
    written = run.stdout.split("output ")[1].split()[0]
    assert _sha256(project / "gpuport-outputs" / job_id / "weights.bin") == written

    again = cli("download", job_id, "-o", str(tmp_path / "dl"), stdio=stdio, **env)  # type: ignore[operator]
    assert again.code == 0 and "(1 file)" in again.stderr, again.output
    assert _sha256(tmp_path / "dl" / "weights.bin") == written
    assert again.drew_progress("downloading") is on_terminal
    # A folder where the file goes: the download fails after the bar has been drawn, and says why.
    (tmp_path / "blocked" / "weights.bin").mkdir(parents=True)
    blocked = cli("download", job_id, "-o", str(tmp_path / "blocked"), stdio=stdio, **env)  # type: ignore[operator]
    assert blocked.code == 1 and "error: [Errno 21] Is a directory" in blocked.stderr, blocked.output
    assert "Traceback" not in blocked.output and blocked.drew_progress("downloading") is on_terminal


# A command that fails as a bug would, as 0.1's progress bar did: rich's Progress handed the CLI's
# stand-in for a console, which is no context manager, fails to draw on a terminal once it has put
# its own stand-ins for stdout and stderr in place (piped, it draws nothing, and the command fails after).
BUGGY_COMMAND = textwrap.dedent(
    """
    import sys
    from rich.progress import Progress
    from gpuport.cli._output import err
    from gpuport.cli.main import cli

    @cli.command("buggy")
    def buggy() -> None:
        Progress(console=err, transient=True).start()
        raise RuntimeError("something unforeseen")

    cli(sys.argv[1:], prog_name="gpuport")
    """
)


def test_cli_says_an_unexpected_error_with_its_traceback_never_silently(stdio: str) -> None:
    with Command(["buggy"], os.environ, stdio=stdio, python=("-c", BUGGY_COMMAND)) as command:
        assert command.wait(60) == 1
    said = command.text
    assert "Traceback" in said and "in buggy" in said, command.raw
    assert "error: unexpected " in said and " — a bug in gpuport" in said, command.raw


def _start_cli_run(server: RunningServer, project: Path, client_config: Path, stdio: str) -> Command:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    # In its own process, as the other tests' commands (conftest): the helper's own tests pass Ctrl-C through it.
    env.update(client_env(server), GPUPORT_CONFIG_DIR=str(client_config), GPUPORT_AGENT="0")
    script = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    return Command(["run", "--", "python", "-c", script], env, project, stdio)


def test_cli_ctrl_c_detaches_and_a_second_ctrl_c_cancels(
    server: RunningServer, admin: gpuport.Client, project: Path, client_config: Path, stdio: str
) -> None:
    with _start_cli_run(server, project, client_config, stdio) as run:
        run.read_until("started\n")
        run.ctrl_c()
        assert run.wait(30) == 0, run.raw
    job_id = run.text.split("gpuport logs -f ")[1].split("`")[0]
    assert "re-attach" in run.text and admin.job(job_id).status == "running"
    assert f"detached from job {job_id}, which keeps running" in run.text
    admin.job(job_id).cancel()

    with _start_cli_run(server, project, client_config, stdio) as run:
        run.read_until("started\n")
        run.ctrl_c()
        run.read_until("press Ctrl-C again")
        run.ctrl_c()
        assert run.wait(30) == 128 + signal.SIGTERM, run.raw
    assert "cancelled" in run.text


def test_cli_detached_from_a_queued_job_says_it_stays_queued(
    server: RunningServer, admin: gpuport.Client, project: Path, client_config: Path, cli: object, stdio: str
) -> None:
    blocker = admin.submit(["sleep", "60"], workdir=None, gpus=2)  # both GPUs: the next job asking for one waits
    queued: list[str] = []
    try:
        wait_for(lambda: blocker.status == "running", what="the blocker running")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
        env.update(client_env(server), GPUPORT_CONFIG_DIR=str(client_config), GPUPORT_AGENT="0")
        with Command(["run", "--gpus", "1", "--", "echo", "hi"], env, project, stdio) as run:
            run.read_until(" queued (#")
            run.ctrl_c()
            assert run.wait(30) == 0, run.raw
        queued.append(_job_id(run.text))
        assert f"detached from job {queued[0]}, which stays queued — press Ctrl-C again" in run.text, run.text
        assert "keeps running" not in run.text and admin.job(queued[0]).status == "queued"

        detached = cli("run", "-d", "--gpus", "1", "--", "echo", "hi", cwd=project, stdio=stdio, **client_env(server))  # type: ignore[operator]
        assert detached.code == 0, detached.output
        queued.append(_job_id(detached.stdout))
        assert f"job {queued[1]} is queued (#2): " in detached.stderr, detached.output
    finally:
        for job_id in queued:
            admin.job(job_id).cancel()
        blocker.cancel()


def test_cli_logs_follow_streams_until_the_job_ends_and_ctrl_c_stops_it(
    server: RunningServer, admin: gpuport.Client, client_config: Path, stdio: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env.update(client_env(server), GPUPORT_CONFIG_DIR=str(client_config), GPUPORT_AGENT="0")
    script = "import os, time\nprint('up', flush=True)\nwhile not os.path.exists('go'): time.sleep(0.02)\nprint('done')"
    job = admin.submit(["python", "-c", script], workdir=None)
    with Command(["logs", "-f", job.id], env, stdio=stdio) as follower:
        follower.read_until("up\n")
        touch_in_job(server.state_dir, job.id, "go")
        assert follower.wait(60) == 0, follower.raw
    assert follower.text.splitlines() == ["up", "done"]

    job = admin.submit(["python", "-c", "import time\nprint('up', flush=True)\ntime.sleep(60)"], workdir=None)
    try:
        with Command(["logs", "-f", job.id], env, stdio=stdio) as follower:
            follower.read_until("up\n")
            follower.ctrl_c()
            assert follower.wait(30) == 130, follower.raw
        assert admin.job(job.id).status == "running"  # logs -f only stops following
    finally:
        job.cancel()


def test_python_output_is_live_and_in_order_without_flushes(server: RunningServer, admin: gpuport.Client) -> None:
    script = textwrap.dedent(
        """
        import os, sys, time
        print("first")                  # no flush: the bootstrap keeps it live
        while not os.path.exists("go"):
            time.sleep(0.02)
        print("out 1"); print("err", file=sys.stderr); print("out 2")
        """
    )
    job = admin.submit(["python", "-c", script], workdir=None)
    lines = job.logs(follow=True)
    assert next(lines) == "first"  # while the job still runs
    assert job.status == "running"
    touch_in_job(server.state_dir, job.id, "go")
    assert list(lines) == ["out 1", "err", "out 2"]


def test_outputs_with_identical_content_both_arrive(admin: gpuport.Client, tmp_path: Path) -> None:
    script = (
        "import os; d = os.environ['GPUPORT_OUTPUT_DIR']; os.makedirs(d + '/a'); os.makedirs(d + '/b'); "
        "[open(p, 'w').write('same bytes') for p in (d + '/a/one.txt', d + '/b/two.txt', d + '/three.txt')]"
    )
    job = admin.submit(["python", "-c", script], workdir=None).wait(30)
    files = job.download(tmp_path, ".")  # the copies go into folders the first file's did not make
    assert sorted(p.relative_to(tmp_path).as_posix() for p in files) == ["a/one.txt", "b/two.txt", "three.txt"]
    assert {(tmp_path / p).read_text() for p in ("a/one.txt", "b/two.txt", "three.txt")} == {"same bytes"}


def test_a_job_past_its_time_limit_is_stopped_as_timeout(admin: gpuport.Client) -> None:
    script = "import time\nprint('working', flush=True)\ntime.sleep(60)"
    job = admin.submit(["python", "-c", script], workdir=None, time_limit="1s").wait(30)
    assert job.info.state == "timeout" and job.info.time_limit == 1.0
    assert job.info.message.startswith("stopped at its time limit of 1s (killed by SIGTERM)")
    assert list(job.logs()) == ["working"]


def test_time_limits_through_the_cli_and_rest(cli: object, server: RunningServer, tmp_path: Path) -> None:
    result = cli("run", "--time", "1s", "--", "sleep", "30", cwd=tmp_path, **client_env(server))  # type: ignore[operator]
    assert result.code == 124 and "timeout" in result.stderr
    bad = cli("run", "--time", "soon", "--", "true", cwd=tmp_path, **client_env(server))  # type: ignore[operator]
    assert bad.code == 1 and "cannot read 'soon' as a duration" in bad.stderr
    created = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": ["sleep", "30"], "time_limit": "1s"})
    assert created.status_code == 201 and created.json()["time_limit"] == 1.0
    job_id = created.json()["job_id"]
    wait_for(lambda: server.rest("GET", f"/v1/jobs/{job_id}", server.admin_token).json()["state"] == "timeout")
    huge = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": ["true"], "time_limit": "400d"})
    assert huge.status_code == 400 and "time limit" in huge.json()["error"]["message"]
