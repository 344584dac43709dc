"""The CLI starts without what its command does not use: `gpuport --version` and `--help` load no gRPC,
protobuf, cloudpickle, asyncio, numpy or rich; a command that talks to the server loads gRPC but no
cloudpickle, numpy or asyncio's event loop of its own. Checked in fresh interpreters; the times are
bench/bench_cli.py's."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import gpuport
from tests._terminal import Command, drew_progress
from tests.conftest import RunningServer, client_env, wait_for

HEAVY = ("grpc", "google.protobuf", "cloudpickle", "asyncio", "numpy", "rich", "gpuport.client._client")
PROBE = """
import json, sys, runpy
sys.argv = ["gpuport", *json.loads(sys.argv[1])]
try:
    runpy.run_module("gpuport", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules)}), file=sys.stderr)
"""


def _modules(args: list[str], env: dict[str, str] | None = None) -> tuple[int, set[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, env=env, timeout=60
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], set(report["modules"]), done.stdout


def _loaded(modules: set[str], prefix: str) -> bool:
    return any(m == prefix or m.startswith(prefix + ".") for m in modules)


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"]])
def test_version_and_help_load_nothing_heavy(args: list[str]) -> None:
    code, modules, out = _modules(args)
    assert code == 0 and ("gpuport" in out or "Usage" in out), out
    assert [m for m in HEAVY if _loaded(modules, m)] == []


def test_version_says_what_click_would_without_loading_it() -> None:
    code, modules, out = _modules(["--version"])
    from click.testing import CliRunner

    from gpuport.cli.main import cli

    clicks = CliRunner().invoke(cli, ["--version"], prog_name="gpuport")
    assert (code, out) == (clicks.exit_code, clicks.output) and "gpuport, version" in out
    assert not _loaded(modules, "click")


def test_importing_gpuport_loads_the_client_on_first_use() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, gpuport; before = 'grpc' in sys.modules; gpuport.connect; "
            "print(before, 'grpc' in sys.modules, gpuport.NotFound.__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split()[:3] == ["False", "True", "NotFound"], done.stderr


def test_a_server_command_loads_grpc_but_not_sessions(server: RunningServer) -> None:
    code, modules, out = _modules(["status"], env={**os.environ, **client_env(server), "GPUPORT_AGENT": "0"})
    assert code == 0 and "gpuport" in out
    assert _loaded(modules, "grpc") and _loaded(modules, "google.protobuf")
    assert [m for m in ("cloudpickle", "numpy", "gpuport.client._sessions") if _loaded(modules, m)] == []


# ---- the helper that runs the server commands (gpuport/cli/_agent.py) ----------------------------


def _timeless(text: str) -> str:
    """``text`` without what differs from one command to the next: durations (an uptime, a job's
    age) and the machine's free memory."""
    text = re.sub(r"[\d.]+[KMGT]?i?B of [\d.]+[KMGT]?i?B RAM free", "RAM", text)
    text = re.sub(r"(\d+(\.\d+)?(ms|s|m|h|d))+\b", "N", text)  # 2m59s and 3m alike, as a minute turns
    return re.sub(r" {2,}", "  ", text)  # a table's column is as wide as its longest duration was


class Helper:
    """The CLI with its helper on, in a runtime folder of this test's own: its helper is stopped
    (by the pid in its lock file) at the end."""

    def __init__(self, server: RunningServer, runtime: Path) -> None:
        runtime.mkdir(mode=0o700)
        self.runtime = runtime
        self.env = {
            **os.environ,
            **client_env(server),
            "GPUPORT_AGENT": "1",
            "GPUPORT_AGENT_IDLE": "60",
            "XDG_RUNTIME_DIR": str(runtime),
            "COLUMNS": "200",
        }

    def run(self, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuport", *args],
            env={**self.env, **env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def pid(self) -> int | None:
        locks = list(self.runtime.glob("gpuport-*/agent-*.sock.lock"))
        return int(locks[0].read_text()) if locks and locks[0].read_text() else None

    def start(self) -> psutil.Process:
        """Start the helper with a first command (which runs on its own), once it listens."""
        assert self.run("status").returncode == 0
        return self.ready()

    def ready(self) -> psutil.Process:
        def up() -> psutil.Process | None:
            pid = self.pid()
            socks = list(self.runtime.glob("gpuport-*/agent-*.sock"))
            return psutil.Process(pid) if pid and socks and psutil.pid_exists(pid) else None

        return wait_for(up, 30, "the CLI's helper to listen")

    def stop(self) -> None:
        pid = self.pid()
        if pid and psutil.pid_exists(pid):
            helper = psutil.Process(pid)
            if "gpuport.cli._agent" in " ".join(helper.cmdline()):
                helper.terminate()
                helper.wait(10)


def _project(tmp_path: Path, name: str, text: str) -> Path:
    """A project folder holding one file ``name``."""
    project = tmp_path / "project"
    project.mkdir()
    (project / name).write_text(text)
    return project


@pytest.fixture
def helper(server: RunningServer, tmp_path: Path) -> Iterator[Helper]:
    running = Helper(server, tmp_path / "runtime")
    try:
        yield running
    finally:
        running.stop()


def test_server_commands_run_in_the_helper_with_the_same_output(helper: Helper, server: RunningServer) -> None:
    alone = helper.run("status", GPUPORT_AGENT="0")
    first = helper.run("status")  # no helper yet: runs here, and starts one
    assert first.returncode == 0 and _timeless(first.stdout) == _timeless(alone.stdout), first.stderr
    process = helper.ready()
    assert oct(os.stat(helper.runtime / f"gpuport-{os.getuid()}").st_mode & 0o777) == "0o700"
    for args in (["status"], ["jobs", "--all"], ["gpus"], ["queue"], ["--help"], ["push", "--help"]):
        here, there = helper.run(*args, GPUPORT_AGENT="0"), helper.run(*args)
        assert (there.returncode, _timeless(there.stdout), there.stderr) == (
            here.returncode,
            _timeless(here.stdout),
            here.stderr,
        ), args
    # The command's process loaded none of gRPC: its child in the helper did the work.
    thin = (
        "import json, sys\nfrom gpuport.cli import _agent\ncode = _agent._through_helper(['status'])\n"
        "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", thin], env=helper.env, capture_output=True, text=True, timeout=60)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] == 0 and "gpuport" in done.stdout, done.stderr
    assert not _loaded(set(report["modules"]), "grpc") and not _loaded(set(report["modules"]), "click")
    assert process.is_running()
    wait_for(lambda: not process.children(), 15, "the helper to reap its children")


def test_the_helper_takes_each_commands_folder_environment_and_exit_status(
    helper: Helper, server: RunningServer, tmp_path: Path
) -> None:
    helper.start()
    project = _project(tmp_path, "train.py", "print('hi')\n")
    pushed = helper.run("push", ".", "--name", "helper-test", cwd=project)
    assert pushed.returncode == 0 and "pushed . as helper-test: 1 files, 12B" in pushed.stderr, pushed  # its folder
    wrong = helper.run("jobs", GPUPORT_TOKEN="gp_wrong")  # this command's token, not the first one's
    alone = helper.run("jobs", GPUPORT_TOKEN="gp_wrong", GPUPORT_AGENT="0")
    assert wrong.returncode == alone.returncode == 1 and wrong.stderr == alone.stderr and "token" in wrong.stderr
    missing = helper.run("logs", "j-00000000")
    assert missing.returncode == 1 and "no job" in missing.stderr


def test_a_push_over_4_mib_through_the_helper_draws_its_bar_on_a_terminal(
    helper: Helper, tmp_path: Path, stdio: str
) -> None:
    helper.start()
    project = tmp_path / "big"
    project.mkdir()
    (project / "table.bin").write_bytes(os.urandom(20_000_000))
    with Command(["push", ".", "--name", f"helper-big-{stdio}"], helper.env, project, stdio) as push:
        assert push.wait(120) == 0, push.raw
    assert f"pushed . as helper-big-{stdio}: 1 files, 19.1MiB (uploaded 1 files, 19.1MiB)" in push.text, push.raw
    assert drew_progress(push.raw, "uploading") is (stdio == "terminal")


def test_ctrl_c_stops_a_command_running_in_the_helper(helper: Helper, server: RunningServer, admin: object) -> None:
    process = helper.start()
    ticking = "import time\nwhile True: print('tick', flush=True); time.sleep(0.1)"
    job = admin.submit(["python", "-c", ticking], workdir=None)  # type: ignore[attr-defined]
    try:
        follower = subprocess.Popen(
            [sys.executable, "-m", "gpuport", "logs", "-f", job.id],
            env=helper.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert follower.stdout is not None
        assert follower.stdout.readline().strip() == "tick"  # streamed as it comes, from the helper's child
        assert len(process.children()) == 1
        follower.send_signal(signal.SIGINT)
        assert follower.wait(15) != 0
        wait_for(lambda: not process.children(), 15, "the command's child in the helper to end")
        follower.stdout.close()
        assert follower.stderr is not None
        follower.stderr.close()
    finally:
        job.cancel()


def _socket_path(env: dict[str, str], wrapper: tuple[str, ...] = (), options: tuple[str, ...] = ()) -> str:
    """The helper socket a fresh Python (run with ``options``, under ``wrapper``, from a folder of
    no package) computes in ``env``."""
    code = "from gpuport.cli._agent import socket_path; print(socket_path())"
    argv = [*wrapper, sys.executable, *options, "-c", code]
    done = subprocess.run(argv, env=env, cwd=env["XDG_RUNTIME_DIR"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_helper_serves_one_network_namespace_and_root_whatever_the_mount_namespace(tmp_path: Path) -> None:
    """`ip netns exec` runs each command in a new mount namespace of the same files: one helper
    serves them all; a command in another network namespace gets a helper of its own there."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (util-linux) to make namespaces")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    here = _socket_path(env)
    assert here.startswith(f"{tmp_path}/gpuport-{os.getuid()}/agent-") and here.endswith(".sock")
    assert _socket_path(env, ("unshare", "--mount")) == here
    assert _socket_path(env, ("unshare", "--net")) != here


def test_a_helper_is_not_used_once_the_code_changes_and_ends_when_idle(server: RunningServer, tmp_path: Path) -> None:
    # A copy of the package: touching its client code gives another socket (a new helper for it).
    copy = tmp_path / "site"
    package = Path(gpuport.__file__).parent
    shutil.copytree(package, copy / "gpuport", ignore=shutil.ignore_patterns("__pycache__", "server"))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": str(copy)}
    # -S: no site, so no editable install's finder ahead of PYTHONPATH (socket_path needs only the stdlib).
    before = _socket_path(env, options=("-S",))
    assert _socket_path(env, options=("-S",)) == before
    client = copy / "gpuport" / "client" / "_client.py"
    os.utime(client)  # now: newer than any file copied
    assert _socket_path(env, options=("-S",)) != before
    # A helper told to idle for 1 s ends by itself, and removes its socket.
    helper = Helper(server, tmp_path / "runtime")
    helper.env["GPUPORT_AGENT_IDLE"] = "1"
    process = helper.start()
    process.wait(15)  # ended by itself (raises if it has not within 15 s)
    assert not list(helper.runtime.glob("gpuport-*/agent-*.sock"))


def test_gpuport_run_through_the_helper_streams_its_job_and_exits_with_its_status(
    helper: Helper, tmp_path: Path
) -> None:
    helper.start()
    project = _project(tmp_path, "job.py", "print('hello from the job', flush=True)\nraise SystemExit(3)\n")
    here = helper.run("run", "--", "python", "job.py", cwd=project, GPUPORT_AGENT="0")
    there = helper.run("run", "--", "python", "job.py", cwd=project)
    assert here.returncode == there.returncode == 3, there.stderr
    assert here.stdout == there.stdout == "hello from the job\n"
    assert "exited with code 3" in there.stderr


def test_gpuport_exec_without_a_terminal_runs_in_the_helper(helper: Helper, admin: gpuport.Client) -> None:
    process = helper.start()
    job = admin.submit(["python", "-c", "import time; print('up', flush=True); time.sleep(600)"], workdir=None)
    try:
        wait_for(lambda: "up" in list(job.logs()), 60, "the job to run")
        argv = ["sh", "-c", "echo out; echo err >&2; exit 4"]
        here = helper.run("exec", job.id, "--", *argv, GPUPORT_AGENT="0")
        there = helper.run("exec", job.id, "--", *argv)
        assert here.returncode == there.returncode == 4, there.stderr
        assert (here.stdout, here.stderr) == (there.stdout, there.stderr) == ("out\n", "err\n")
        # Its piped stdin passed on, from the helper's child while it waits for its end.
        piped = subprocess.Popen(
            [sys.executable, "-m", "gpuport", "exec", job.id, "--", "tr", "a-z", "A-Z"],
            env=helper.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        wait_for(lambda: len(process.children()) == 1, 30, "the command's child in the helper")
        out, err = piped.communicate(b"shout\n", timeout=60)
        assert (piped.returncode, out) == (0, b"SHOUT\n"), err
    finally:
        job.cancel()


@pytest.mark.parametrize(
    ("args", "own_process"),
    [
        (["exec", "job", "--", "ls"], False),
        (["exec", "job", "--", "ls", "-t", "-i"], False),  # the command's options, not exec's
        (["exec", "-t", "job", "--", "top"], True),
        (["exec", "-it", "job", "--", "bash"], True),
        (["exec", "--tty", "job", "--", "top"], True),
        (["exec", "--interactive", "job", "--", "cat"], os.isatty(0)),
    ],
)
def test_gpuport_exec_on_a_terminal_runs_in_its_own_process(args: list[str], own_process: bool) -> None:
    """The helper's child is not in the terminal's foreground process group: a command that sets
    its mode or reads it (-t, or -i on a terminal) runs on its own."""
    from gpuport.cli._agent import _on_terminal

    assert _on_terminal(args) is own_process
