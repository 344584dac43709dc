"""Job commands: ``run``, ``jobs``, ``logs``, ``wait``, ``cancel``, ``download``, ``push``, ``snapshots``."""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import click

from gpuport.cli._building import BuildStatus
from gpuport.cli._common import client, json_option
from gpuport.cli._output import ago, err, escape, new_table, out, print_json
from gpuport.cli._usage import fair_share_table
from gpuport.defaults import DEFAULT_DETACH_WINDOW, DEFAULT_OUTPUT_DIR
from gpuport.protocol.arrays import format_indices
from gpuport.protocol.errors import GpuportError, InvalidRequest, NotFound, WaitTimeout
from gpuport.protocol.units import format_duration, format_size

if TYPE_CHECKING:
    from rich.table import Table

    from gpuport.client import Client, Job, JobArray, JobInfo

# Tasks of an array whose logs `gpuport run --array` streams at once; the others' come once a stream is free.
_ARRAY_STREAMS = 32
# Seconds between looks at an array's tasks while `gpuport run --array` streams them.
_ARRAY_POLL = 0.3

# Transfers smaller than this finish before a progress bar would be worth drawing.
_PROGRESS_FROM_BYTES = 4 * 1024 * 1024


@contextmanager
def _progress(verb: str) -> Iterator[Callable[[int, int], None]]:
    """A callback for uploads and downloads that draws a bar on stderr once a transfer is large enough."""
    bar: Any = None  # a rich Progress, made (and imported) only for a transfer large enough to show
    task = None

    def update(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if total < _PROGRESS_FROM_BYTES or not err.is_terminal:
                return
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            bar = Progress(
                TextColumn(verb),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=err.console,
                transient=True,
            )
            bar.start()
            task = bar.add_task(verb, total=total)
        assert task is not None
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


def _exit_status(info: JobInfo) -> int:
    """The shell's convention: the exit code, or 128 + the signal that killed it."""
    if info.state == "timeout":
        return 124  # as timeout(1) says it
    if info.exit_code is None:
        return 130 if info.state == "cancelled" else 1
    if info.exit_code < 0:
        return 128 - info.exit_code
    return min(info.exit_code, 255)


def _env(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            if key not in os.environ:
                raise InvalidRequest(f"--env {key}: give KEY=VALUE, or a KEY set in your environment")
            value = os.environ[key]
        env[key] = value
    return env


class _Follower(threading.Thread, ABC):
    """Copies logs to stdout in a thread of its own, until they end (``_stream``).

    The main thread only sleeps meanwhile (``wait``), so that Ctrl-C raises KeyboardInterrupt there,
    in ``time.sleep``, and never inside gRPC's own code (where it could leave a lock held and hang the
    command). Closing the client's channel cancels the streams.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.error: BaseException | None = None
        self.finished = False
        self._muted = False
        self._writing = threading.Lock()

    def run(self) -> None:
        try:
            self._stream()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by wait(), which raises it
            self.error = e
        finally:
            self.finished = True

    @abstractmethod
    def _stream(self) -> None:
        """Copy the logs to stdout until they end."""

    def _write(self, data: bytes, sink: Any) -> bool:
        """Write ``data`` to ``sink`` unless muted; False once muted."""
        with self._writing:
            if self._muted:
                return False
            sink.write(data)
            sink.flush()
            return True

    def mute(self) -> None:
        """Write nothing more: the command is about to exit, and a thread writing to stdout at exit
        would abort the interpreter."""
        with self._writing:
            self._muted = True

    def wait(self) -> None:
        """Sleep until the logs have ended; re-raise what stopped them. KeyboardInterrupt comes through."""
        while not self.finished:
            time.sleep(0.01)
        if self.error is not None:
            raise self.error


class _LogFollower(_Follower):
    """Copies a job's log to stdout as it grows, until the job ends. ``building``: on a terminal, a
    status line while the job's environment is built, in place of the build's lines (``BuildStatus``)."""

    def __init__(self, job: Job, follow: bool = True, tail: int | None = None, building: bool = False) -> None:
        super().__init__(f"log of {job.id}")
        self.job = job
        self.follow = follow
        self.tail = tail
        self.status = BuildStatus(err.console) if building and sys.stdout.isatty() and err.is_terminal else None

    def _stream(self) -> None:
        sink = sys.stdout.buffer
        try:
            for _, data in self.job.log_chunks(0, follow=self.follow, tail=self.tail):
                if self.status is not None:
                    data = self.status.feed(data)
                if data and not self._write(data, sink):
                    return
            if self.status is not None:
                self._write(self.status.end(), sink)
        finally:
            if self.status is not None:
                self.status.stop()

    def mute(self) -> None:
        super().mute()
        if self.status is not None:
            self.status.stop()


def _summary(info: JobInfo) -> str:
    took = ""
    if info.started_at and info.ended_at:
        took = f" in {format_duration(info.ended_at - info.started_at)}"
    style = {
        "succeeded": "green",
        "failed": "red",
        "cancelled": "yellow",
        "timeout": "red",
        "killed": "red",
        "lost": "red",
    }.get(info.state, "")
    return f"[{style}]job {info.id} {info.state}[/]{took}: {escape(info.message)}"


def _download(job: Job, dest: Path, path: str | None = None) -> None:
    with _progress("downloading") as progress:
        files = job.download(dest, path, progress=progress)
    now = "" if job.info.ended else f" as they are now: job {job.id} is still {job.info.state}"
    if files:
        err.print(f"outputs: {escape(str(dest))}/ ({len(files)} file{'s' if len(files) != 1 else ''}){now}")
    elif now:
        err.print(f"job {job.id} is {job.info.state} and has no outputs yet")


def _roles(text: str | None) -> dict[str, int] | None:
    """``chief=1,worker=2,ps=1`` → {"chief": 1, "worker": 2, "ps": 1}."""
    if not text:
        return None
    roles = {}
    for part in text.split(","):
        role, sep, count = part.partition("=")
        if not sep or not count.strip().isdigit():
            raise InvalidRequest(f"--tf-roles {text!r}: write it like chief=1,worker=2,ps=1")
        roles[role.strip()] = int(count)
    return roles


def _sweep(pairs: tuple[str, ...]) -> dict[str, list[str]] | None:
    """``lr=1e-3,1e-4`` (each) → {"lr": ["1e-3", "1e-4"]}."""
    sweep: dict[str, list[str]] = {}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        if not sep or not key.strip() or not values:
            raise InvalidRequest(f"--sweep {pair!r}: write it as NAME=V1,V2 (e.g. --sweep lr=1e-3,1e-4)")
        if key.strip() in sweep:
            raise InvalidRequest(f"--sweep {key.strip()} is given twice: give all its values in one, NAME=V1,V2")
        sweep[key.strip()] = values.split(",")
    return sweep or None


def _is_array(target: object) -> TypeGuard[JobArray]:
    from gpuport.client import JobArray  # here: the module is loaded by commands that talk to a server only

    return isinstance(target, JobArray)


def _array_or_job(gpu: Client, ref: str) -> JobArray | Job:
    """The job array ``ref`` names, else the job."""
    try:
        return gpu.array(ref)
    except NotFound:
        return gpu.job(ref)


def _array_status(info: Any) -> int:
    """0 when every task succeeded; else the exit status of the first that did not (by index), at least 1."""
    for task in info.tasks:
        if task.state != "succeeded":
            return max(1, _exit_status(task))
    return 0


def _array_summary(info: Any) -> str:
    counts = info.counts()
    said = ", ".join(f"{counts[s]} {s}" for s in sorted(counts, key=lambda s: (s != "succeeded", s)))
    failed = [t for t in info.tasks if t.state != "succeeded"]
    style = "green" if not failed else "red"
    text = f"[{style}]array {info.id}[/]: {len(info.tasks)} tasks, {said}"
    if failed:
        text += f"; not succeeded: {format_indices(t.array_index for t in failed)}"
        first = failed[0]
        text += f" (task {first.array_index}: {escape(first.message)})"
    return text


class _ArrayFollower(_Follower):
    """Streams the log of every task of an array to stdout, each line prefixed with its task's index
    (``[7] ...``), as ``--nprocs`` prefixes ranks: tasks are followed once they start, up to
    _ARRAY_STREAMS at a time."""

    def __init__(self, array: JobArray) -> None:
        super().__init__(f"logs of {array.id}")
        self.array = array

    def _stream(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        followed: set[str] = set()
        with ThreadPoolExecutor(_ARRAY_STREAMS, thread_name_prefix="task log") as pool:
            futures = []
            while True:
                info = self.array.refresh()
                for task in self.array.tasks:
                    # A task cancelled before it started has no log to stream.
                    if task.id not in followed and task.info.started_at is not None:
                        followed.add(task.id)
                        futures.append(pool.submit(self._follow, task))
                if info.ended or self._muted:
                    break
                time.sleep(_ARRAY_POLL)
            for future in futures:
                future.result()

    def _follow(self, task: Job) -> None:
        sink = sys.stdout.buffer
        prefix = f"[{task.info.array_index}] ".encode()
        pending = b""
        for _, data in task.log_chunks(0, follow=True):
            pending += data
            *lines, pending = pending.split(b"\n")
            if lines:
                self._write(b"".join(prefix + line + b"\n" for line in lines), sink)
            if self._muted:
                return
        if pending:
            self._write(prefix + pending + b"\n", sink)


def _download_array(array: JobArray, dest: Path, path: str | None = None) -> None:
    with _progress("downloading") as progress:
        files = array.download(dest, path, progress=progress)
    now = "" if array.info.ended else " as they are now: some tasks have not ended"
    if files:
        err.print(
            f"outputs: {escape(str(dest))}/INDEX/ ({len(files)} file{'s' if len(files) != 1 else ''} "
            f"of {len({f.relative_to(dest).parts[0] for f in files})} tasks){now}"
        )
    else:
        err.print(f"array {array.id} has no outputs" + (" yet" if now else ""))


def _run_array(ctx: click.Context, array: JobArray, detach: bool, output_dir: Path | None) -> None:
    """``gpuport run --array``/``--sweep``: stream every task's lines, fetch outputs, summarize."""
    info = array.info
    cap = f", at most {info.max_running} at once" if info.max_running else ""
    if detach:
        out.print(array.id)
        err.print(
            f"{len(info.tasks)} tasks{cap}; see them with `gpuport jobs`, outputs with `gpuport download {array.id}`"
        )
        return
    err.print(f"[dim]array {array.id}: {len(info.tasks)} tasks ({array.id}_INDEX){cap}[/]")
    follower = _ArrayFollower(array)
    follower.start()
    try:
        follower.wait()
    except KeyboardInterrupt:
        err.print(
            f"\ndetached from array {array.id}, whose tasks go on — "
            f"press Ctrl-C again within {DEFAULT_DETACH_WINDOW:g}s to cancel them all"
        )
        try:
            time.sleep(DEFAULT_DETACH_WINDOW)
        except KeyboardInterrupt:
            follower.mute()
            array.cancel()
            err.print(f"cancelling array {array.id}...")
            info = array.wait().info
            err.print(_array_summary(info))
            ctx.exit(_array_status(info))
        follower.mute()
        err.print(f"see it with `gpuport jobs`; outputs with `gpuport download {array.id}`")
        ctx.exit(0)
    info = array.wait().info
    if any(t.output_snapshot_id for t in info.tasks):
        _download_array(array, output_dir or Path(DEFAULT_OUTPUT_DIR) / array.id)
    err.print(_array_summary(info))
    ctx.exit(_array_status(info))


def _check_runnable(command: tuple[str, ...], workdir: Path, project: str | None) -> None:
    """Refuse a Python file of the workdir given as the command (``gpuport run train.py``) where the
    job could not run it: not executable, or named without a slash (the job's PATH is searched for
    those, not its workdir). The job would only fail on the server, after the upload."""
    program = command[0]
    if project or not program.endswith(".py") or not (workdir / program).is_file():
        return
    executable = os.access(workdir / program, os.X_OK)
    if executable and "/" in program:
        return
    why = "is not executable" if not executable else "is looked up on the server's PATH, not in the workdir"
    raise InvalidRequest(
        f"{program} {why}: a Python file runs with python — did you mean `gpuport run -- python {shlex.join(command)}`?"
    )


@click.command("run", context_settings={"allow_interspersed_args": False})
@click.option("--gpus", default=0, show_default=True, type=int, help="Whole GPUs to give the job.")
@click.option("--gpu-memory", metavar="SIZE", help="A slice of one GPU instead (8GiB), enforced.")
@click.option("--cpus", default=0, type=float, help="CPUs to reserve (default: none reserved).")
@click.option("--memory", metavar="SIZE", help="RAM to reserve (16GiB); the job is killed past it.")
@click.option("--priority", default=0, show_default=True, type=int, help="-100 .. 100; above 0: admins only.")
@click.option(
    "--nprocs", default=1, show_default=True, type=int, help="Processes to start (TF_CONFIG, RANK, WORLD_SIZE set)."
)
@click.option("--tf-roles", metavar="ROLES", help="TF_CONFIG roles of the processes: chief=1,worker=2,ps=1.")
@click.option(
    "--name", help="A name to find the job by (logs, wait...); one queued or running job of yours has it at a time."
)
@click.option(
    "--env", "-e", "env", multiple=True, metavar="KEY=VALUE", help="Set an environment variable (repeatable)."
)
@click.option(
    "--workdir",
    "-w",
    default=".",
    show_default=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Folder to sync and run in.",
)
@click.option(
    "--output",
    "-o",
    "outputs",
    multiple=True,
    metavar="PATH",
    help="File or folder of the workdir to bring back (repeatable).",
)
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), help="Where outputs go.")
@click.option("--project", help="Run in a snapshot pushed under this name instead of syncing --workdir.")
@click.option("--dataset", "datasets", multiple=True, metavar="NAME", help="Mount a pushed snapshot read-only.")
@click.option("--time", "time_limit", metavar="DURATION", help="Stop the job after this long (90s, 2h); exit 124.")
@click.option("--nodes", type=click.IntRange(1, 64), default=1, help="On a cluster: run the job over this many nodes.")
@click.option("--nprocs-per-node", type=click.IntRange(1, 64), default=1, help="With --nodes: processes on each node.")
@click.option("--gpus-per-node", type=click.IntRange(0), help="With --nodes: whole GPUs on each node (as --gpus).")
@click.option(
    "--retries",
    type=click.IntRange(0, 100),
    default=0,
    show_default=True,
    help="Times the job is queued again (after a backoff) when it fails for a reason outside its code: its "
    "node lost, a server restart that lost it, or an exit code of --retry-on-exit.",
)
@click.option(
    "--retry-on-exit",
    metavar="CODES",
    help="With --retries: exit codes that are retried too, e.g. 3,75 (others fail the job); 137 retries a job "
    "the kernel's OOM killer ended.",
)
@click.option(
    "--preemptible/--not-preemptible",
    default=None,
    help="Whether the server may preempt the job (queue it again) for one that waited longer than its "
    "--preempt-after [default: preemptible when --priority is below 0].",
)
@click.option(
    "--checkpoint",
    metavar="DIR",
    help="A folder of the workdir kept when the job is preempted or retried, and put back for its next run.",
)
@click.option(
    "--array",
    metavar="SPEC",
    help="Run a job array, as Slurm's: 0-99, 1,3,5, 0-15:4; %N at the end runs at most N at once (0-99%8).",
)
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    metavar="NAME=V1,V2",
    help="Run every combination of these values (repeatable); each task gets --NAME VALUE appended.",
)
@click.option(
    "--after",
    multiple=True,
    metavar="JOB[:ok|:any]",
    help="Wait until JOB (an id, name or array) succeeded (ok, default) or ended (any); repeatable.",
)
@click.option(
    "--requirements",
    metavar="FILE",
    help="Build the job's Python environment from this file of the workdir (default: its uv.lock, "
    "pyproject.toml or requirements.txt, if any).",
)
@click.option("--no-deps-env", is_flag=True, help="Run in the server's own environment, whatever the workdir holds.")
@click.option("--group", "groups", multiple=True, metavar="NAME", help="Include this pyproject.toml dependency group.")
@click.option("--python", "python", metavar="VERSION", help="Run on this Python version of the server's (3.12).")
@click.option("--isolated-env", is_flag=True, help="Build the environment without the server's own packages under it.")
@click.option(
    "--env-of",
    metavar="JOB",
    help="Run in the environment JOB ran in (or one `gpuport envs` lists, by hash), as built: no resolving again.",
)
@click.option("--detach", "-d", is_flag=True, help="Submit and return at once; print the job id.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run_command(
    ctx: click.Context,
    gpus: int,
    gpu_memory: str | None,
    cpus: float,
    memory: str | None,
    priority: int,
    nprocs: int,
    tf_roles: str | None,
    name: str | None,
    env: tuple[str, ...],
    workdir: Path,
    outputs: tuple[str, ...],
    output_dir: Path | None,
    project: str | None,
    datasets: tuple[str, ...],
    time_limit: str | None,
    nodes: int,
    nprocs_per_node: int,
    gpus_per_node: int | None,
    retries: int,
    retry_on_exit: str | None,
    preemptible: bool | None,
    checkpoint: str | None,
    array: str | None,
    sweeps: tuple[str, ...],
    after: tuple[str, ...],
    requirements: str | None,
    no_deps_env: bool,
    groups: tuple[str, ...],
    python: str | None,
    isolated_env: bool,
    env_of: str | None,
    detach: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND on the server: sync the workdir, stream the logs, bring the outputs back.

    \b
        gpuport run --gpus 1 --output model/ -- python train.py --epochs 5

    Only files the server lacks are uploaded (.gitignore and .gpuportignore are honoured). The
    command exits with the job's exit code. Outputs (--output paths, and whatever the job writes to
    $GPUPORT_OUTPUT_DIR) land in ./gpuport-outputs/<job-id>/. Ctrl-C detaches from the job (it keeps
    running, or stays queued); a second Ctrl-C cancels it.

    With --nprocs N the job runs N processes, with TF_CONFIG (or --tf-roles) and
    MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set and their log lines prefixed with the rank.

    \b
        gpuport run --array 0-99%8 -- python train.py
        gpuport run --sweep lr=1e-3,1e-4 --sweep batch=32,64 -- python train.py

    --array runs one job per index, with GPUPORT_ARRAY_INDEX and SLURM_ARRAY_TASK_ID set (Slurm
    scripts run unchanged); --sweep one per combination, with --lr 1e-3 --batch 32 appended and
    GPUPORT_SWEEP_LR, GPUPORT_SWEEP_BATCH set (with a sweep, --array %N alone caps it). Their lines
    come prefixed with the task's index, outputs land in ./gpuport-outputs/<array-id>/<index>/, and
    the exit status is 0 only when every task succeeded. --after makes the job (or each task) wait.

    A workdir with a uv.lock, a pyproject.toml with dependencies, or a requirements.txt runs in a
    Python environment with exactly that installed, built on the server once (its log is part of
    the job's) and shared by every job that asks for the same, over the server's own packages.
    """
    if no_deps_env and (requirements or groups or python or isolated_env):
        raise click.UsageError("--no-deps-env runs in the server's environment: drop it, or the environment's options")
    if env_of and (requirements or no_deps_env or groups or python or isolated_env):
        raise click.UsageError("--env-of runs in an environment built already: drop the environment's other options")
    _check_runnable(command, workdir, project)
    roles = _roles(tf_roles)
    if roles and nprocs == 1:
        nprocs = sum(roles.values())
    gpu = client(ctx)
    with _progress("uploading") as progress:
        job = gpu.submit(
            list(command),
            workdir,
            gpus=gpus if gpus_per_node is None else gpus_per_node,
            env=_env(env),
            outputs=outputs,
            name=name,
            project=project,
            datasets=datasets,
            time_limit=time_limit,
            gpu_memory=gpu_memory,
            cpus=cpus,
            memory=memory,
            priority=priority,
            nprocs=nprocs,
            tf_roles=roles,
            retries=retries,
            retry_on_exit=_exit_codes(retry_on_exit),
            preemptible=preemptible,
            checkpoint=checkpoint,
            nodes=nodes,
            nprocs_per_node=nprocs_per_node,
            after=after,
            array=array,
            sweep=_sweep(sweeps),
            requirements=None if no_deps_env or env_of else requirements or "auto",
            groups=groups,
            python=python,
            isolated_env=isolated_env,
            env_of=env_of,
            progress=progress,
        )
    if _is_array(job):
        _run_array(ctx, job, detach, output_dir)
        return
    if detach:
        out.print(job.id)
        if job.info.state == "queued":
            err.print(f"job {job.id} is queued{_why_queued(job.info)}")
        err.print(f"follow it with `gpuport logs -f {job.id}`; outputs with `gpuport download {job.id}`")
        return
    follower = _LogFollower(job, building=True)
    follower.start()
    try:  # the line about the queue too: a Ctrl-C as it is written detaches as any other
        if job.info.state == "queued" and job.info.message:
            err.print(f"[dim]job {job.id} queued{_why_queued(job.info)}[/]")
        follower.wait()
    except KeyboardInterrupt:
        try:  # from before the prompt is out: a second Ctrl-C at once, while it is written, cancels too
            err.print(
                f"\ndetached from job {job.id}{_goes_on(job)} — "
                f"press Ctrl-C again within {DEFAULT_DETACH_WINDOW:g}s to cancel it"
            )
            time.sleep(DEFAULT_DETACH_WINDOW)
        except KeyboardInterrupt:
            job.cancel()
            err.print(f"cancelling job {job.id}...")
            follower.wait()  # the log goes on to the job's last line
            info = job.wait().info
            err.print(_summary(info))
            ctx.exit(_exit_status(info))
        follower.mute()
        err.print(f"re-attach with `gpuport logs -f {job.id}`; outputs with `gpuport download {job.id}`")
        ctx.exit(0)
    info = job.wait().info
    if info.output_snapshot_id:
        _download(job, output_dir or Path(DEFAULT_OUTPUT_DIR) / job.id)
    err.print(_summary(info))
    ctx.exit(_exit_status(info))


def _goes_on(job: Job) -> str:
    """What a job left to itself does now, as ", which keeps running" (or "stays queued"), or "" when
    the server does not say within the detach window. Asked in a thread of its own, as the log is: a second
    Ctrl-C lands in the main thread's sleep, never in gRPC's code."""
    states: list[str] = []

    def ask() -> None:
        with suppress(GpuportError):  # the server, unreachable now: the job goes on there all the same
            states.append(job.refresh().state)

    asking = threading.Thread(target=ask, name=f"state of {job.id}", daemon=True)
    asking.start()
    deadline = time.monotonic() + DEFAULT_DETACH_WINDOW
    while asking.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"queued": ", which stays queued", "running": ", which keeps running"}.get(states[0] if states else "", "")


def _why_queued(j: JobInfo) -> str:
    """A queued job's place and reason, as " (#2): waiting for 2 GPUs", or ""."""
    place = f" (#{j.position})" if j.position else ""
    return f"{place}: {escape(j.message)}" if j.message else place


def resources(j: JobInfo) -> str:
    """What a job holds (once running) or asks for, in a few words."""
    parts = []
    if j.gpu_memory:
        where = f"GPU {j.gpu_indices[0]}" if j.gpu_indices else "a GPU"
        parts.append(f"{format_size(j.gpu_memory)} of {where}")
    elif j.gpu_indices:
        parts.append("GPU " + ",".join(map(str, j.gpu_indices)))
    elif j.gpus:
        parts.append(f"{j.gpus} GPU{'s' if j.gpus > 1 else ''}")
    if j.cpus:
        parts.append(f"{j.cpus:g} CPU")
    if j.memory:
        parts.append(f"{format_size(j.memory)} RAM")
    if j.nprocs > 1:
        parts.append(f"{j.nprocs} procs")
    return ", ".join(parts) or "-"


def _grouped(jobs: list[JobInfo]) -> list[JobInfo | list[JobInfo]]:
    """The jobs as listed, each array's tasks as one list in the place of its first."""
    rows: list[JobInfo | list[JobInfo]] = []
    arrays: dict[str, list[JobInfo]] = {}
    for j in jobs:
        if not j.array_id:
            rows.append(j)
        elif j.array_id in arrays:
            arrays[j.array_id].append(j)
        else:
            arrays[j.array_id] = [j]
            rows.append(arrays[j.array_id])
    return rows


def _states(tasks: list[JobInfo]) -> str:
    """Tasks by state in a few words: ``3 running, 5 queued, 92 succeeded``."""
    order = ("running", "queued", "succeeded", "failed", "cancelled", "timeout", "killed", "lost")
    counts = {s: sum(t.state == s for t in tasks) for s in order}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n)


def _exit_codes(text: str | None) -> list[int]:
    """--retry-on-exit's CODES: 3,75 → [3, 75]."""
    try:
        return [int(code) for code in (text or "").replace(" ", "").split(",") if code]
    except ValueError:
        raise click.BadParameter(f"give exit codes separated by commas, e.g. 3,75, not {text!r}") from None


def _jobs_table(jobs: list[JobInfo]) -> Table:
    from rich.text import Text

    table = new_table()
    nodes = len({j.node for j in jobs if j.node}) > 1  # a cluster's: each job's node is said
    for column in ("JOB", "NAME", "OWNER", "STATE", "NODE", "RESOURCES", "SUBMITTED", "RAN", "EXIT", "COMMAND"):
        if column == "JOB":
            table.add_column(column, no_wrap=True, min_width=10)  # an id is never cut: it is what you type next
        elif column != "NODE" or nodes:
            # Short columns never wrap, so the command (then a queued job's reason) gives way first,
            # and is cut to fit rather than wrapped: one line per job (piped, nothing is cut).
            table.add_column(column, overflow="ellipsis", no_wrap=column not in ("NAME", "STATE", "COMMAND"))
    for row in _grouped(jobs):
        if isinstance(row, list):  # an array's tasks: one line
            first = row[0]
            command = " ".join(first.command).replace("\r", "\\r").replace("\n", "\\n")  # one line, as below
            table.add_row(
                f"{first.array_id}[{format_indices(t.array_index for t in row if t.array_index is not None)}]",
                escape(first.name) or "-",
                escape(first.owner),
                _states(row),
                *(["-"] if nodes else []),
                resources(first),
                f"{ago(min(t.created_at for t in row))} ago",
                "-",
                "-",
                Text(command if len(command) <= 60 else command[:57] + "...", no_wrap=True, overflow="ellipsis"),
            )
            continue
        j = row
        ran = "-"
        if j.started_at:
            ran = format_duration((j.ended_at or time.time()) - j.started_at)
        exit_code = "-" if j.exit_code is None else str(j.exit_code)
        command = " ".join(j.command).replace("\r", "\\r").replace("\n", "\\n")  # a script's lines: one line
        table.add_row(
            j.id,
            escape(j.name) or "-",
            escape(j.owner),
            j.state
            + (f", preempted ({j.preemptions}x)" if j.preemptions else "")
            + (f", retried ({j.retried}x)" if j.retried else "")
            + (f" ({escape(j.message)})" if j.state == "queued" and j.message else ""),
            *([escape(j.node) or "-"] if nodes else []),
            resources(j),
            f"{ago(j.created_at)} ago",
            ran,
            exit_code,
            Text(command if len(command) <= 60 else command[:57] + "...", no_wrap=True, overflow="ellipsis"),
        )
    return table


@click.command("jobs")
@click.option(
    "--all", "-a", "all_", is_flag=True, help="Every job, not only active and recent ones (admins: every user's)."
)
@click.option("--name", help="Only jobs of this name.")
@click.option(
    "--state",
    "states",
    multiple=True,
    metavar="STATE",
    help="Only jobs in this state (repeatable): queued, running, succeeded, failed, cancelled, timeout, killed, lost.",
)
@click.option("--user", help="Only this user's jobs (another user's: admins only).")
@json_option
@click.pass_context
def jobs_command(
    ctx: click.Context, all_: bool, name: str | None, states: tuple[str, ...], user: str | None, as_json: bool
) -> None:
    """List your jobs: queued, running, and those of the last day (newest first)."""
    infos = [j.info for j in client(ctx).jobs(all=all_, name=name, state=states, user=user)]
    if as_json:
        print_json(infos)
    elif not infos:
        err.print("no jobs" + ("" if all_ else " in the last day (--all shows older ones)"))
    else:
        out.print(_jobs_table(infos))


@click.command("queue")
@json_option
@click.pass_context
def queue_command(ctx: click.Context, as_json: bool) -> None:
    """Every queued job (every user's), in the order they will start, and why each waits."""
    infos = client(ctx).queue()
    if as_json:
        print_json(infos)
        return
    if not infos:
        err.print("the queue is empty")
        return
    table = new_table()
    for column in ("#", "JOB", "OWNER", "PRIORITY", "ASKS FOR", "WAITING", "WHY"):
        table.add_column(column, overflow="fold" if column == "WHY" else "ellipsis")
    for j in infos:
        table.add_row(
            str(j.position),
            j.id,
            escape(j.owner),
            str(j.priority),
            resources(j),
            ago(j.created_at),
            escape(j.message),
        )
    out.print(table)
    fair_share_table(client(ctx).usage(since="7d"))


@click.command("logs")
@click.argument("job_id", metavar="JOB")
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the job ends.")
@click.option("--tail", "-n", type=click.IntRange(0), metavar="N", help="Only the last N lines (with -f: then follow).")
@click.pass_context
def logs_command(ctx: click.Context, job_id: str, follow: bool, tail: int | None) -> None:
    """Print a job's log (stdout and stderr, in order). JOB is its id or its name."""
    follower = _LogFollower(client(ctx).job(job_id), follow, tail)
    follower.start()
    try:
        follower.wait()
    except KeyboardInterrupt:
        follower.mute()
        ctx.exit(130)


@click.command("wait")
@click.argument("job_id", metavar="JOB")
@click.option("--timeout", type=float, help="Give up after this many seconds (exit status 124).")
@click.pass_context
def wait_command(ctx: click.Context, job_id: str, timeout: float | None) -> None:
    """Wait for a job (its id or name) to end; exit with its exit code. For an array: every task,
    exiting 0 only when all succeeded."""
    job = _array_or_job(client(ctx), job_id)
    if _is_array(job):
        try:
            array_info = job.wait(timeout).info
        except WaitTimeout as e:
            err.print(escape(str(e)))
            ctx.exit(124)
        err.print(_array_summary(array_info))
        ctx.exit(_array_status(array_info))
    try:
        info = job.wait(timeout).info
    except WaitTimeout as e:
        err.print(escape(str(e)))
        ctx.exit(124)
    err.print(_summary(info))
    ctx.exit(_exit_status(info))


@click.command("cancel")
@click.argument("job_id", metavar="JOB")
@click.pass_context
def cancel_command(ctx: click.Context, job_id: str) -> None:
    """Cancel a job (its id or name): a queued one at once, a running one with SIGTERM, then SIGKILL
    after a grace period. An array's id or name cancels every task of it that has not ended."""
    target = _array_or_job(client(ctx), job_id)
    if _is_array(target):
        counts = target.cancel().counts()
        err.print(
            f"array {target.id}: {counts.get('cancelled', 0)} tasks cancelled, "
            f"{counts.get('running', 0)} stopping (SIGTERM now, SIGKILL after the grace period)"
        )
        return
    info = target.cancel()
    if info.state == "cancelled":
        err.print(f"job {info.id} cancelled")
    else:
        err.print(f"job {info.id}: stopping (SIGTERM now, SIGKILL after the grace period)")


@click.command("download")
@click.argument("job_id", metavar="JOB")
@click.argument("path", required=False)
@click.option("--output-dir", "-o", type=click.Path(file_okay=False, path_type=Path), help="Where to put the files.")
@click.pass_context
def download_command(ctx: click.Context, job_id: str, path: str | None, output_dir: Path | None) -> None:
    """Download a job's outputs (or only those at PATH) into ./gpuport-outputs/JOB/. JOB is its id or name.

    A running job's outputs are copied as they are now: a file it is still writing may come cut
    short. Files already there with the same content are not fetched again. An array's go to
    ./gpuport-outputs/ARRAY/INDEX/, a folder per task.
    """
    job = _array_or_job(client(ctx), job_id)
    if _is_array(job):
        _download_array(job, output_dir or Path(DEFAULT_OUTPUT_DIR) / job.id, path)
        return
    dest = output_dir or Path(DEFAULT_OUTPUT_DIR) / job.id
    if not job.info.output_snapshot_id and job.info.ended:
        err.print(f"job {job.id} has no outputs")
        return
    _download(job, dest, path)


@click.command("push")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--name", required=True, help="Name of the snapshot: a --project or --dataset for later jobs.")
@json_option
@click.pass_context
def push_command(ctx: click.Context, folder: Path, name: str, as_json: bool) -> None:
    """Upload FOLDER as a named snapshot (only what the server lacks is sent)."""
    with _progress("uploading") as progress:
        snapshot = client(ctx).push(folder, name, progress=progress)
    if as_json:
        print_json(snapshot)
        return
    err.print(
        f"pushed {escape(str(folder))} as {escape(name)}: {snapshot.files} files, {format_size(snapshot.bytes)} "
        f"(uploaded {snapshot.uploaded_files} files, {format_size(snapshot.uploaded_bytes)})"
    )


@click.group("snapshots", invoke_without_command=True)
@json_option
@click.pass_context
def snapshots_command(ctx: click.Context, as_json: bool) -> None:
    """List your named snapshots (made with `gpuport push`); `gpuport snapshots rm` removes one."""
    if ctx.invoked_subcommand is not None:
        return
    snapshots = client(ctx).snapshots()
    if as_json:
        print_json(snapshots)
        return
    table = new_table()
    for column in ("NAME", "FILES", "SIZE", "ID"):
        table.add_column(column)
    for s in snapshots:
        table.add_row(escape(s.name), str(s.files), format_size(s.bytes), s.id[:12])
    out.print(table)


@snapshots_command.command("rm")
@click.argument("name_or_id")
@click.pass_context
def snapshots_rm(ctx: click.Context, name_or_id: str) -> None:
    """Remove the snapshot NAME_OR_ID: a name you pushed, or an id (a job's outputs: its
    output_snapshot_id), with every name pointing at it. Its storage is freed once nothing else of
    yours uses its files (the server removes them within its grace period, 1h by default).

    \b
        gpuport snapshots rm mydata
    """
    removed = client(ctx).remove_snapshot(name_or_id)
    err.print(f"removed snapshot {escape(name_or_id)} ({removed.files} files, {format_size(removed.bytes)})")


JOB_COMMANDS = [
    run_command,
    jobs_command,
    queue_command,
    logs_command,
    wait_command,
    cancel_command,
    download_command,
    push_command,
    snapshots_command,
]
