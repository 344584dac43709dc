"""``Job``: a handle on a job submitted with ``Client.submit``: its state, logs, outputs. ``JobArray``:
one on a job array or sweep, whose tasks are ``Job``s."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from gpuport.defaults import DEFAULT_RECONNECT_WINDOW
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import ConnectionFailed, InvalidRequest, ServerError, WaitTimeout

if TYPE_CHECKING:
    from gpuport.client._reach import CommandResult, Forward
    from gpuport.client._transport import Progress, Transport

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "timeout", "killed", "lost"})
# Longest single Wait call; longer waits make several.
_WAIT_SLICE = 60.0
# Seconds between attempts to reach a server that dropped the connection (restarting, say).
_RECONNECT_PAUSE = 0.5


@dataclass(frozen=True)
class JobInfo:
    """A job as the server described it at one moment.

    ``state`` is one of queued, running, succeeded, failed, cancelled, timeout, killed (over its GPU
    memory slice or memory limit), lost. ``exit_code`` is None until the job has ended (negative:
    killed by that signal). ``message`` says why it waits or how it ended; ``position`` is its place
    in the queue while it waits (1: next). ``gpu_memory`` and ``memory`` are bytes.
    """

    id: str
    name: str
    owner: str
    state: str
    command: tuple[str, ...]
    gpus: int
    gpu_indices: tuple[int, ...]
    created_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    message: str
    outputs: tuple[str, ...]
    output_snapshot_id: str
    log_bytes: int
    time_limit: float | None = None  # seconds
    gpu_memory: int = 0
    cpus: float = 0.0
    memory: int = 0
    priority: int = 0
    nprocs: int = 1
    position: int = 0
    node: str = ""  # where it runs or ran: a cluster's node, or the server's hostname
    array_id: str = ""  # the job array it is a task of ("" : none)
    array_index: int | None = None  # its index there
    environment: str = ""  # the hash of the Python environment it runs in ("" : the server's own)
    preemptible: bool = False  # the server may preempt it (queue it again) for a job that waited
    preemptions: int = 0  # times it was preempted and queued again
    retried: int = 0  # times it was queued again after a failure (its retries)

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def _from_message(cls, m: pb.JobInfo) -> JobInfo:
        return cls(
            id=m.job_id,
            name=m.name,
            owner=m.owner,
            state=m.state,
            command=tuple(m.command),
            gpus=m.gpus,
            gpu_indices=tuple(m.gpu_indices),
            created_at=m.created_at,
            started_at=m.started_at or None,
            ended_at=m.ended_at or None,
            exit_code=m.exit_code if m.has_exit_code else None,
            message=m.message,
            outputs=tuple(m.outputs),
            output_snapshot_id=m.output_snapshot_id,
            log_bytes=m.log_bytes,
            time_limit=m.time_limit or None,
            gpu_memory=m.gpu_memory,
            cpus=m.cpus,
            memory=m.memory,
            priority=m.priority,
            nprocs=m.nprocs or 1,
            position=m.position,
            node=m.node,
            array_id=m.array_id,
            array_index=m.array_index if m.array_id else None,
            environment=m.environment,
            preemptible=m.preemptible,
            preemptions=m.preemptions,
            retried=m.retried,
        )


def _keep_trying(since: float | None) -> float | None:
    """After a dropped connection: pause and return when the retries began (``since``, or now);
    None once they have gone on for DEFAULT_RECONNECT_WINDOW, and the caller should give up."""
    since = since or time.monotonic()
    if time.monotonic() - since > DEFAULT_RECONNECT_WINDOW:
        return None
    time.sleep(_RECONNECT_PAUSE)
    return since


class _Described(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...


_Info = TypeVar("_Info", bound=_Described)


class _Handle(Generic[_Info]):
    """A handle on something the server keeps: the connection it came through, and ``info``, the
    thing as the server last described it (``refresh`` asks again)."""

    def __init__(self, transport: Transport, info: _Info) -> None:
        self._transport = transport
        self.info = info

    @property
    def id(self) -> str:
        """Its id on the server."""
        return self.info.id

    @property
    def name(self) -> str:
        """The name it was given ("" for none)."""
        return self.info.name


class Job(_Handle[JobInfo]):
    """A job on the server. ``gpu.submit(...)`` and ``gpu.job(id)`` return one.

    >>> job = gpu.submit(["python", "train.py"], outputs=["model/"])
    >>> for line in job.logs(follow=True):
    ...     print(line)
    >>> job.wait().exit_code
    0
    >>> job.download("results/")
    """

    def refresh(self) -> JobInfo:
        """Ask the server for the job's current state."""
        self.info = JobInfo._from_message(self._transport.call(self._transport.jobs.Get, pb.JobRef(job_id=self.id)))
        return self.info

    @property
    def status(self) -> str:
        """The job's state now: queued, running, succeeded, failed, cancelled, timeout, killed or lost."""
        return self.info.state if self.info.ended else self.refresh().state

    @property
    def exit_code(self) -> int | None:
        """The exit code once the job has ended (negative: killed by that signal); None before."""
        return self.info.exit_code if self.info.ended else self.refresh().exit_code

    def wait(self, timeout: float | None = None) -> Job:
        """Block until the job has ended; return the job. Raises ``WaitTimeout`` after ``timeout`` seconds.

        A dropped connection (a server restart) is retried for up to a minute.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        reconnecting_since = None
        while not self.info.ended:
            remaining = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"job {self.id} is still {self.info.state} after {timeout:g}s")
            request = pb.WaitRequest(job_id=self.id, timeout=min(remaining, _WAIT_SLICE))
            try:
                reply = self._transport.call(
                    self._transport.jobs.Wait, request, timeout=min(remaining, _WAIT_SLICE) + 30
                )
            except ConnectionFailed:
                reconnecting_since = _keep_trying(reconnecting_since)
                if reconnecting_since is None:
                    raise
                continue
            reconnecting_since = None
            self.info = JobInfo._from_message(reply)
        return self

    def cancel(self) -> JobInfo:
        """Cancel the job: a queued job at once, a running one with SIGTERM (SIGKILL after a grace period).

        Raises ``Conflict`` when it has already ended.
        """
        self.info = JobInfo._from_message(self._transport.call(self._transport.jobs.Cancel, pb.JobRef(job_id=self.id)))
        return self.info

    def log_chunks(
        self, offset: int = 0, *, follow: bool = False, tail: int | None = None
    ) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of the log from ``offset``, or from the start of its last ``tail`` lines
        (found by the server from the log's end). With ``follow``, until the job ends.

        A dropped stream is resumed from the last byte received (for up to a minute of retries), so
        no byte is lost or repeated.
        """
        reconnecting_since = None
        while True:
            request = pb.LogsRequest(job_id=self.id, offset=offset, follow=follow, tail=tail)
            try:
                for chunk in self._transport.stream(self._transport.jobs.Logs, request):
                    if chunk.offset < offset and tail is None:  # further on: past a part cut from a long log
                        raise ServerError(f"log of {self.id}: got bytes from offset {chunk.offset}, expected {offset}")
                    tail = None  # the first chunk says where the tail starts: resumed from offsets after it
                    reconnecting_since = None
                    offset = chunk.offset + len(chunk.data)
                    if chunk.data:
                        yield chunk.offset, chunk.data
                return
            except ConnectionFailed:
                reconnecting_since = _keep_trying(reconnecting_since) if follow else None
                if reconnecting_since is None:
                    raise

    def logs(self, follow: bool = False, *, offset: int = 0, tail: int | None = None) -> Iterator[str]:
        """The job's log (stdout and stderr, in order) as lines without their newline; with
        ``tail``, its last ``tail`` lines only (read from its end, however long the log).

        With ``follow``, lines arrive as the job prints them, until it ends.
        """
        pending = b""
        for _, data in self.log_chunks(offset, follow=follow, tail=tail):
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if pending:
            yield pending.decode("utf-8", "replace")

    def forward(self, port: int, local_port: int = 0) -> Forward:
        """Reach TCP ``port`` of this running job (a server it runs on its own loopback: TensorBoard,
        Jupyter, a debugger) at 127.0.0.1 of this machine, through the server's data port, until the
        job ends or ``close()``. ``local_port`` 0: any free one (``.local_port`` says which). The
        job's owner only: raises ``PermissionDenied`` for another's, ``Conflict`` when it does not run.

        >>> with job.forward(6006) as board:
        ...     webbrowser.open(f"http://127.0.0.1:{board.local_port}")
        """
        from gpuport.client._reach import Forward

        return Forward(self._transport, self, port, local_port)

    def exec(self, command: list[str], *, input: bytes = b"") -> CommandResult:
        """Run ``command`` inside this running job: its sandbox (processes, network, folders), its
        uid, its environment, its workdir; held to its limits, and killed when it ends. ``input``
        is its stdin. Returns its exit code and output. The job's owner only (``PermissionDenied``).

        >>> job.exec(["nvidia-smi"]).stdout
        """
        from gpuport.client._reach import CommandResult, run_command

        out, err = bytearray(), bytearray()
        code = run_command(
            self._transport, self.id, list(command), stdin=input, on_stdout=out.extend, on_stderr=err.extend
        )
        return CommandResult(code, bytes(out), bytes(err))

    def output(self, path: str = "") -> str:
        """One of the job's outputs as a source for ``gpu.deploy``: ``job:<id>:<path>``."""
        return f"job:{self.id}:{path}"

    def download(self, dest: str | Path, path: str | None = None, *, progress: Progress | None = None) -> list[Path]:
        """Fetch the job's outputs (or those at ``path``) into folder ``dest``; return the files written.

        A running job's are what its output paths hold now: a file it is writing may come cut
        short. Files already in ``dest`` with the same content are not fetched again. Raises
        ``Conflict`` while the job is queued, ``InvalidRequest`` when ``path`` matches no output.
        """
        snapshot = self.info.output_snapshot_id
        if not self.info.ended:
            reply = self._transport.call(self._transport.jobs.Outputs, pb.JobRef(job_id=self.id))
            self.info, snapshot = JobInfo._from_message(reply.job), reply.snapshot_id
        if not snapshot:
            if path is not None:
                raise InvalidRequest(f"job {self.id} has no outputs" + ("" if self.info.ended else " yet"))
            return []
        return self._transport.download(snapshot, Path(dest), path, progress)

    def __repr__(self) -> str:
        return f"<gpuport.Job {self.id} {self.info.state}>"


@dataclass(frozen=True)
class ArrayInfo:
    """A job array or sweep as the server described it at one moment: ``spec`` as given ("0-99%8"),
    ``max_running`` its %N (0: no cap), ``sweep`` a sweep's parameters and values, ``tasks`` each
    task's ``JobInfo`` in index order."""

    id: str
    name: str
    owner: str
    spec: str
    max_running: int
    created_at: float
    sweep: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tasks: tuple[JobInfo, ...] = ()

    @property
    def ended(self) -> bool:
        return all(t.ended for t in self.tasks)

    def counts(self) -> dict[str, int]:
        """Tasks by state: {"succeeded": 98, "failed": 2}."""
        return dict(Counter(t.state for t in self.tasks))

    @classmethod
    def _from_message(cls, m: pb.ArrayInfo) -> ArrayInfo:
        return cls(
            id=m.array_id,
            name=m.name,
            owner=m.owner,
            spec=m.spec,
            max_running=m.max_running,
            created_at=m.created_at,
            sweep={p.name: tuple(p.values) for p in m.sweep},
            tasks=tuple(JobInfo._from_message(t) for t in m.tasks),
        )


class JobArray(_Handle[ArrayInfo]):
    """A job array or sweep on the server: ``gpu.submit(..., array="0-99%8")`` (or ``sweep=``) and
    ``gpu.array(id_or_name)`` return one. Its ``tasks`` are ``Job``s (ids ``<array id>_<index>``).

    >>> grid = gpu.submit(["python", "train.py"], sweep={"lr": [1e-3, 1e-4], "batch": [32, 64]})
    >>> grid.wait().counts()
    {'succeeded': 4}
    >>> grid.download("results/")          # results/0/, results/1/ ... one folder per task
    """

    @property
    def tasks(self) -> list[Job]:
        """The tasks as ``Job`` handles, in index order (as last described: ``refresh`` asks again)."""
        return [Job(self._transport, t) for t in self.info.tasks]

    def task(self, index: int) -> Job:
        """The task of this index. Raises ``KeyError`` when the array has none."""
        for t in self.info.tasks:
            if t.array_index == index:
                return Job(self._transport, t)
        raise KeyError(f"array {self.id} has no task {index}")

    def refresh(self) -> ArrayInfo:
        """Ask the server for the array's tasks and their states now."""
        reply = self._transport.call(self._transport.jobs.GetArray, pb.JobRef(job_id=self.id))
        self.info = ArrayInfo._from_message(reply)
        return self.info

    def counts(self) -> dict[str, int]:
        """Tasks by state now."""
        return (self.info if self.info.ended else self.refresh()).counts()

    def wait(self, timeout: float | None = None) -> JobArray:
        """Block until every task has ended; return the array. Raises ``WaitTimeout`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for task in self.tasks:
            if not task.info.ended:
                try:
                    task.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except WaitTimeout:
                    raise WaitTimeout(f"array {self.id} has tasks still running after {timeout:g}s") from None
        self.refresh()
        return self

    def failed(self) -> list[JobInfo]:
        """The tasks that ended other than ``succeeded``."""
        return [t for t in self.info.tasks if t.ended and t.state != "succeeded"]

    def cancel(self) -> ArrayInfo:
        """Cancel every task that has not ended (queued ones at once, running ones with SIGTERM,
        SIGKILL after a grace period). Raises ``Conflict`` when all have ended."""
        reply = self._transport.call(self._transport.jobs.CancelArray, pb.JobRef(job_id=self.id))
        self.info = ArrayInfo._from_message(reply)
        return self.info

    def download(self, dest: str | Path, path: str | None = None, *, progress: Progress | None = None) -> list[Path]:
        """Fetch each task's outputs into ``dest/<index>/``; return the files written. Tasks
        without outputs (queued, or that left none) are skipped."""
        files: list[Path] = []
        for task in self.tasks:
            if task.info.state == "queued" or (task.info.ended and not task.info.output_snapshot_id):
                continue
            try:
                files += task.download(Path(dest) / str(task.info.array_index), path, progress=progress)
            except InvalidRequest:  # nothing at ``path`` in this task's outputs
                if path is None:
                    raise
        return files

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(self.info.counts().items()))
        return f"<gpuport.JobArray {self.id} [{len(self.info.tasks)} tasks: {counts}]>"
