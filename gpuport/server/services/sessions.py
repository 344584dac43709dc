"""Sessions: a worker process that keeps a user's values and runs their functions, next to the GPU.

A session's worker is a job of kind "session" (``worker/session.py`` as its command): it is queued,
placed, capped, watched and listed in ``gpuport gpus`` like any job, and it outlives a server
restart like any job. This service keeps what is a session's own: its name, its idle timeout, the
server's connection to its worker, values being uploaded or downloaded (held by ``staging.py``), and
who follows its output.

The server reaches a worker only through the executor, by its job id: its endpoint ``worker``
(``tunnel-NAME`` for a tunnel), and its files ``stdout`` and ``stderr``. Each worker's output starts
where the one before it ended (a session's offsets only grow): the session keeps its workers in turn,
each with where its output starts, and reads an offset from the worker that wrote it.

Ending: ``close``; a session with no call for ``idle_timeout`` seconds; an unnamed session that no
client has followed for ``min(idle_timeout, DETACHED_GRACE)`` (its client left without closing it).
A named session outlives its clients until one closes it or it idles out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import mmap
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuport.defaults import (
    DEFAULT_SESSION_IDLE_TIMEOUT,
    ENV_SESSION_IDLE_TIMEOUT,
    ENV_SESSION_OUTPUT,
    LOG_CHUNK_BYTES,
    LOG_POLL_INTERVAL,
    MAX_NAME_LENGTH,
    SESSION_DETACHED_GRACE,
    SESSION_INLINE_BYTES,
    SESSION_REUSE_SECONDS,
)
from gpuport.protocol.errors import (
    Conflict,
    GpuportError,
    InvalidRequest,
    NotFound,
    ResourceUnavailable,
    ServerError,
)
from gpuport.protocol.sockets import recv_exact
from gpuport.protocol.units import format_duration
from gpuport.protocol.values import check_compatible
from gpuport.server.environments import EnvRequest
from gpuport.server.executors.base import handed_over
from gpuport.server.services.auth import Identity
from gpuport.server.services.job_requests import JobRequest
from gpuport.server.services.jobs import JobRecord, JobService, JobState
from gpuport.server.services.staging import (
    STAGED_TTL,
    ClientGone,
    Direct,
    Following,
    SessionMemory,
    Staged,
    Staging,
    check_size,
    pass_on,
)
from gpuport.server.store import Store
from gpuport.server.worker import wire

log = logging.getLogger(__name__)

_WORKER = [sys.executable, "-m", "gpuport.server.worker.session"]
_CONNECT_TIMEOUT = 60.0  # seconds from a worker's start to its socket accepting
_END_WAIT = 10.0  # seconds to wait for a dead worker's job to record how it ended
_TUNNEL_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")  # a worker's endpoint tunnel-NAME
_TAIL_BYTES = 8192  # of a dead worker's stderr, for its last lines
# Seconds the server waits for a worker's reply before it turns to other work: most calls answer
# within it, and then cost no extra turns of the event loop (which is blocked that long at most).
_QUICK_REPLY = 0.001
_STATE_EVERY = 0.5  # seconds between looks at a followed session's state
# A followed session's output is read every LOG_POLL_INTERVAL while a call runs, for a second after
# one, and while output comes; otherwise every _IDLE_OUTPUT_POLL, or at once when a call starts. An
# idle session followed every 20 ms cost the server 2.3% of a core (five: 11.8%, none: 0.5%).
_BUSY_OUTPUT_FOR = 1.0
_IDLE_OUTPUT_POLL = 0.5
_LINK_STATE_EVERY = 10  # tries to connect to a starting worker between looks at its state (0.1 s)
_REAP_EVERY = 1.0
_RECOUNT_WAIT = 5.0  # seconds a starting server waits for the workers it picks up to count their values
_STDERR_TAIL_LINES = 20
_SEND_SLICE = 1024 * 1024  # bytes of a staged result handed to one send on a channel
_MAX_IDLE_TIMEOUT = 30 * 24 * 3600.0
_OUTPUT = ("stdout", "stderr")  # the worker's files of fds 1 and 2
_ERRORS = {cls.__name__: cls for cls in (InvalidRequest, NotFound, Conflict, ResourceUnavailable)}


@dataclass(frozen=True)
class SessionSpec:
    name: str = ""
    gpus: int = 0
    gpu_memory: int = 0
    cpus: float = 0.0
    memory: int = 0
    priority: int = 0
    idle_timeout: float = 0.0  # 0: the default
    env: dict[str, str] = field(default_factory=dict)
    python_version: str = ""
    cloudpickle_version: str = ""
    requirements: str = ""  # its workers' Python environment, as text; "": the box's own


@dataclass(frozen=True)
class SessionRecord:
    id: str
    name: str
    owner: str
    state: str  # queued, running, died, ended
    job: JobRecord
    created_at: float
    last_call_at: float
    idle_timeout: float
    message: str
    refs: int
    attached: int
    reattached: bool = False


@dataclass
class Value:
    """A value on its way: the codec's header, inline buffers, or a staged upload with the buffers' sizes."""

    header: bytes = b""
    buffers: list[bytes] = field(default_factory=list)
    staged: str = ""
    sizes: list[int] = field(default_factory=list)
    follows: bool = False  # on a data-port channel: the buffers' bytes follow the message (``sizes``)


@dataclass
class CallIn:
    session_id: str
    op: str  # call, put, get, delete, refs
    value: Value | None = None
    function: str = ""
    function_pickle: bytes = b""
    keep: bool = False
    ref_name: str = ""
    ref_ids: list[str] = field(default_factory=list)
    device: str = ""
    timeout: float = 0.0


@dataclass
class CallOut:
    value: Value | None = None
    ref: dict[str, str] | None = None
    refs: list[dict[str, str]] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    exception: bytes = b""
    unknown_function: bool = False
    stdout_offset: int = 0
    stderr_offset: int = 0
    download: str = ""
    # On a data-port channel: sends the result's bytes after the reply (``value.follows``).
    follows: Callable[[socket.socket], None] | None = None


@dataclass
class _Live:
    """What the server keeps in memory about a session that has not ended."""

    id: str
    owner: str
    name: str
    job_id: str
    idle_timeout: float
    last_call_at: float = field(default_factory=time.time)
    calls: int = 0  # in flight
    attached: int = 0
    detached_since: float = field(default_factory=time.time)
    link: wire.Link | None = None
    # Its worker shares this machine's memory (descriptors travel to it); False: a worker on another
    # node, whose values travel as bytes (``_as_bytes``). Known once it was first connected to.
    shares_memory: bool = True
    # Its workers in turn: (job id, where its stdout starts, where its stderr starts); the last is job_id.
    workers: list[tuple[str, int, int]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    refs: int = 0
    counting: threading.Lock = field(default_factory=threading.Lock)  # calls come from channel threads too
    memory: SessionMemory = field(default_factory=SessionMemory)  # for its large values
    # How to wake each of its output's followers (``output``) when a call starts, from any thread.
    followers: set[Callable[[], object]] = field(default_factory=set)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count a call in flight (the reaper leaves the session alone) and note when calls happen;
        wake its output's followers, which read it often while calls run."""
        with self.counting:
            self.calls += 1
            self.last_call_at = time.time()
        for wake in list(self.followers):
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                wake()
        try:
            yield
        finally:
            with self.counting:
                self.calls -= 1
                self.last_call_at = time.time()


class SessionService:
    def __init__(self, store: Store, jobs: JobService) -> None:
        self.store = store
        self.jobs = jobs
        self.executor = jobs.executor
        self._live: dict[str, _Live] = {}
        self.staging = Staging()
        self.data_port = 0  # set by the daemon once the data port listens
        self._reaper: asyncio.Task[None] | None = None
        self._recounting: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Pick up the sessions a previous server left; their workers (jobs) run on, holding their
        values, which are counted again before the server says it is ready (a worker busy with a call
        from before answers in the background, once it is free)."""
        self._loop = asyncio.get_running_loop()
        for row in self.store.query("SELECT * FROM sessions WHERE ended_at IS NULL ORDER BY seq"):
            live = _Live(row["id"], row["owner"], row["name"], row["job_id"], row["idle_timeout"])
            live.workers = [tuple(w) for w in json.loads(row["workers"] or "[]")] or [(live.job_id, 0, 0)]
            self._live[row["id"]] = live
        self._recounting = {asyncio.create_task(self._recount(live)) for live in self._live.values()}
        if self._recounting:
            await asyncio.wait(self._recounting, timeout=_RECOUNT_WAIT)
        self._reaper = asyncio.create_task(self._reap())

    async def _recount(self, live: _Live) -> None:
        """Ask a running worker how many values it holds (the count is the worker's: this server has
        not seen the calls that made them); a worker not running holds none."""
        if self.jobs.get(Identity(live.owner, admin=True), live.job_id).state is not JobState.RUNNING:
            return
        async with live.lock:
            try:
                link = await self._link(live, None)
                await link.send({"op": "refs"})
                self._out(live, await link.recv())
            except (_Died, GpuportError, EOFError, OSError) as e:  # a call will find it again, and say
                log.info("session %s: its values could not be counted after the restart: %s", live.id, e)
                if live.link is not None:
                    live.link.close()
                    live.link = None

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in self._recounting:
            task.cancel()
        for live in self._live.values():
            if live.link is not None:
                live.link.close()
        self.staging.drop()

    # ---- sessions ---------------------------------------------------------------------------------

    def open(self, caller: Identity, spec: SessionSpec) -> SessionRecord:
        """A new session for ``caller``, or their live session named ``spec.name``."""
        problem = self.executor.workers_problem()
        if problem:
            raise InvalidRequest(
                f"sessions run on a one-machine gpuport server for now; {problem} — send jobs (`gpuport run`), "
                "or open sessions on a one-machine server"
            )
        if spec.python_version or spec.cloudpickle_version:
            problem = check_compatible(spec.python_version, spec.cloudpickle_version, remote="client", local="server")
            if problem:
                raise InvalidRequest(f"sessions need matching versions: {problem}")
        if spec.name and (
            len(spec.name) > MAX_NAME_LENGTH or not spec.name.isprintable() or spec.name.startswith("s-")
        ):
            raise InvalidRequest(
                f"session name {spec.name[:80]!r}: use up to {MAX_NAME_LENGTH} printable characters, not starting "
                "with 's-'"
            )
        idle = spec.idle_timeout or DEFAULT_SESSION_IDLE_TIMEOUT
        if not 0 < idle <= _MAX_IDLE_TIMEOUT:
            raise InvalidRequest(f"idle timeout {idle:g}s is outside 0 .. {format_duration(_MAX_IDLE_TIMEOUT)}")
        if spec.name:
            row = self.store.query_one(
                "SELECT id FROM sessions WHERE owner = ? AND name = ? AND ended_at IS NULL", (caller.name, spec.name)
            )
            if row is not None:
                return self._record(self._live[row["id"]], reattached=True)
        session_id = "s-" + secrets.token_hex(4)
        stored = {
            "gpus": spec.gpus,
            "gpu_memory": spec.gpu_memory,
            "cpus": spec.cpus,
            "memory": spec.memory,
            "priority": spec.priority,
            "env": spec.env,
            "requirements": spec.requirements,
        }
        job = self._start_worker(caller, session_id, spec.name, stored, idle, (0, 0))
        workers = [(job.id, 0, 0)]
        try:
            with self.store.transaction() as db:
                db.execute(
                    "INSERT INTO sessions (id, owner, name, job_id, spec, idle_timeout, created_at, workers) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        session_id,
                        caller.name,
                        spec.name,
                        job.id,
                        json.dumps(stored),
                        idle,
                        time.time(),
                        json.dumps(workers),
                    ),
                )
        except Exception:
            self.jobs.cancel(caller, job.id)
            raise
        live = self._live[session_id] = _Live(session_id, caller.name, spec.name, job.id, idle, workers=workers)
        log.info(
            "session %s%s opened for %s (worker %s)",
            session_id,
            f" ({spec.name})" if spec.name else "",
            caller.name,
            job.id,
        )
        return self._record(live)

    def _start_worker(
        self, caller: Identity, session_id: str, name: str, spec: dict[str, Any], idle: float, starts: tuple[int, int]
    ) -> JobRecord:
        """A new worker for the session, its output starting at ``starts`` (stdout, stderr)."""
        return self.jobs.submit(
            caller,
            JobRequest(
                command=list(_WORKER),
                gpus=spec["gpus"],
                gpu_memory=spec["gpu_memory"],
                cpus=spec["cpus"],
                memory=spec["memory"],
                priority=spec["priority"],
                env=spec["env"],
                name=f"session {name or session_id}",
                kind="session",
                internal_env={ENV_SESSION_IDLE_TIMEOUT: str(idle), ENV_SESSION_OUTPUT: "{},{}".format(*starts)},
                environment=EnvRequest(spec["requirements"]) if spec.get("requirements") else None,
            ),
        )

    def _find(self, caller: Identity, session_id: str = "", name: str = "") -> _Live:
        if name and not session_id:
            for live in self._live.values():
                if live.name == name and live.owner == caller.name:
                    return live
            raise NotFound(f"no live session named {name[:80]!r} — `gpuport sessions` lists yours")
        found = self._live.get(session_id[:64])
        if found is None or (found.owner != caller.name and not caller.admin):
            raise NotFound(f"no live session {session_id[:64]!r} — `gpuport sessions` lists yours")
        return found

    def _state(self, live: _Live, job: JobRecord) -> tuple[str, str]:
        if job.state is JobState.QUEUED:
            return "queued", job.message
        if job.state is JobState.RUNNING:
            held = self.executor.waiting([job.id]).get(job.id, "")  # by a cluster's own queue (Slurm's)
            return ("queued", held) if held else ("running", "")
        return "died", f"its worker {job.message}" if job.message else "its worker ended"

    def _record(self, live: _Live, *, reattached: bool = False) -> SessionRecord:
        job = self.jobs.get(Identity(live.owner, admin=True), live.job_id)
        state, message = self._state(live, job)
        return SessionRecord(
            id=live.id,
            name=live.name,
            owner=live.owner,
            state=state,
            job=job,
            created_at=job.created_at,
            last_call_at=live.last_call_at,
            idle_timeout=live.idle_timeout,
            message=message,
            refs=live.refs,
            attached=live.attached,
            reattached=reattached,
        )

    def get(self, caller: Identity, session_id: str = "", name: str = "") -> SessionRecord:
        return self._record(self._find(caller, session_id, name))

    def list_for(self, caller: Identity) -> list[SessionRecord]:
        """The caller's live sessions (every user's, for an admin), oldest first."""
        return [self._record(s) for s in self._live.values() if s.owner == caller.name or caller.admin]

    def close(self, caller: Identity, session_id: str = "", name: str = "", reason: str = "closed") -> SessionRecord:
        live = self._find(caller, session_id, name)
        record = self._record(live)
        self._end(live, reason)
        return dataclasses.replace(record, state="ended", message=reason)

    def _end(self, live: _Live, reason: str) -> None:
        self._live.pop(live.id, None)
        with self.store.transaction() as db:
            db.execute("UPDATE sessions SET ended_at = ?, message = ? WHERE id = ?", (time.time(), reason, live.id))
        if live.link is not None:
            live.link.close()
            live.link = None
        self._stop_worker(live)
        self.staging.drop(session_id=live.id)
        live.memory.drop_spare()
        log.info("session %s ended: %s", live.id, reason)

    def _stop_worker(self, live: _Live) -> None:
        owner = Identity(live.owner, admin=True)
        with contextlib.suppress(Conflict, NotFound):
            self.jobs.cancel(owner, live.job_id)

    async def restart(self, caller: Identity, session_id: str = "", name: str = "") -> SessionRecord:
        """A fresh worker for the session (its values are lost), after the old one has ended."""
        live = self._find(caller, session_id, name)
        async with live.lock:
            old = self.jobs.get(Identity(live.owner, admin=True), live.job_id)
            if not old.state.is_terminal():
                if live.link is not None:
                    live.link.close()
                    live.link = None
                if old.state is JobState.RUNNING:
                    self.jobs.kill(old.id, "the session was restarted")
                self._stop_worker(live)
                await self.jobs.wait(Identity(live.owner, admin=True), old.id, _END_WAIT)
            row = self.store.query_one("SELECT spec FROM sessions WHERE id = ?", (live.id,))
            assert row is not None
            starts = await asyncio.to_thread(self._offsets, live)  # the next worker's output goes on from there
            job = self._start_worker(
                Identity(live.owner, admin=False),
                live.id,
                live.name,
                json.loads(row["spec"]),
                live.idle_timeout,
                starts,
            )
            live.workers = [*live.workers, (job.id, *starts)]
            with self.store.transaction() as db:
                db.execute(
                    "UPDATE sessions SET job_id = ?, workers = ? WHERE id = ?",
                    (job.id, json.dumps(live.workers), live.id),
                )
            live.job_id, live.refs, live.last_call_at = job.id, 0, time.time()
            live.memory.drop_spare()
            log.info("session %s restarted: worker %s", live.id, job.id)
            return self._record(live)

    # ---- calls ------------------------------------------------------------------------------------

    async def _link(self, live: _Live, deadline: float | None) -> wire.Link:
        """The connection to the session's worker, once it runs and listens."""
        if live.link is not None:
            return live.link
        owner = Identity(live.owner, admin=True)
        started: float | None = None
        polls = 0
        while True:
            # Its state from the store (and the cluster's queue): at each poll while it waits, every
            # _LINK_STATE_EVERY once it runs, between tries to connect (each look costs the server
            # ~1.5 ms of CPU, which a worker's start on a busy machine would wait for).
            if polls % _LINK_STATE_EVERY == 0 or started is None:
                job = self.jobs.get(owner, live.job_id)
                if job.state.is_terminal():
                    raise _Died(job)
                # A cluster with a queue of its own may hold a worker it was handed (Slurm's): still queued.
                held = self.executor.waiting([job.id]).get(job.id, "") if job.state is JobState.RUNNING else ""
            polls += 1
            if held:
                started = None  # its start is counted from when the cluster runs it
            elif job.state is JobState.RUNNING:
                started = started or time.monotonic()
                try:
                    stream = await asyncio.to_thread(self._connect, live, live.job_id)
                    live.link = wire.Link(stream.sock)
                    return live.link
                except (FileNotFoundError, ConnectionError) as e:
                    if time.monotonic() - started > _CONNECT_TIMEOUT:
                        log.warning("session %s: its worker %s cannot be reached: %s", live.id, live.job_id, e)
                        raise ServerError(
                            f"the worker of session {live.id} did not start listening within "
                            f"{_CONNECT_TIMEOUT:g}s — its output and the server's log may say why"
                        ) from None
            if deadline is not None and time.monotonic() > deadline:
                raise ResourceUnavailable(f"session {live.id} is still queued: {held or job.message}")
            await asyncio.sleep(0.01 if job.state is JobState.RUNNING and not held else 0.1)

    def _connect(self, live: _Live, job_id: str, direct: bool = False) -> Any:
        """A stream to the worker's endpoint; whether descriptors travel along it says how large
        values move (shared memory here, bytes to another node). ``direct``: for a channel's own
        blocking connection (``Executor.connect``)."""
        stream = self.executor.connect(job_id, "worker", direct)
        live.shares_memory = stream.passes_fds
        return stream

    async def call(self, caller: Identity, request: CallIn) -> CallOut:
        if request.value is not None and request.value.follows:
            raise InvalidRequest("a value's bytes follow its call only on a data-port channel: upload them first")
        live = self._find(caller, request.session_id)
        header, buffers, fds, staged = self._request(live, request)
        try:
            async with live.lock:
                with live.call():
                    return await self._roundtrip(live, header, buffers, fds, staged, request.timeout)
        finally:
            if staged is not None:
                live.memory.sent(staged)

    def _request(self, live: _Live, request: CallIn) -> tuple[dict[str, Any], list[Any], list[int], Staged | None]:
        """The frame for the worker: its header, inline buffers and descriptors, and the upload it
        names (the caller closes it once sent)."""
        _check(request)
        header: dict[str, Any] = {"op": request.op}
        buffers: list[Any] = []
        fds: list[int] = []
        staged: Staged | None = None
        if request.function_pickle:
            header["function_pickle"] = True
            buffers.append(request.function_pickle)
        if request.value is not None:
            header["value"] = request.value.header.decode()
            buffers += request.value.buffers
            if request.value.staged:
                staged = self.staging.take(request.value.staged[:64])
                if staged is None or staged.session_id != live.id:
                    if staged is not None:
                        staged.close()
                    raise NotFound(
                        f"no upload {request.value.staged[:64]!r} for this session (it expires after {STAGED_TTL:g}s)"
                    )
                if sum(request.value.sizes) != staged.size:
                    staged.close()
                    raise InvalidRequest("the sizes of the uploaded buffers do not add up to the upload's size")
                header["fd_sizes"] = [staged.size]
                header["staged_sizes"] = list(request.value.sizes)
                fds.append(staged.parts[0][0])
        header.update(
            function=request.function,
            keep=request.keep,
            name=request.ref_name,
            ref_ids=list(request.ref_ids),
            device=request.device,
        )
        return header, buffers, fds, staged

    def call_direct(
        self,
        caller: Identity,
        request: CallIn,
        direct: Direct,
        following: Following | None = None,
        results_follow: bool = False,
    ) -> CallOut:
        """``call`` from a data-port channel's thread: straight to the worker on the channel's own
        connection, with no turn of the event loop (the worker answers its connections one request
        at a time). What is not a plain round trip goes to the event loop: a worker the server has
        not reached yet (starting, queued), one that dies, a call past its timeout.

        ``following``: the value's bytes, which follow the request on the channel. To a worker on
        another node they pass on as they come, never held whole here; to one that shares memory
        with this server (or one not reached yet) they are received into memory it maps first.
        ``results_follow``: a large result's bytes may follow the reply on the channel
        (``CallOut.follows`` sends them), again passed on from a worker on another node as they come."""
        live = self._find(caller, request.session_id)
        if live.id != direct.session_id:
            raise InvalidRequest(f"this channel carries the calls of session {direct.session_id}, not {live.id}")
        _check(request)  # before a value is received for it
        sock = self._direct_socket(live, direct)
        if following is not None and (sock is None or live.shares_memory):
            self._receive(caller, live, request, following)
            following = None
        if sock is None:
            return self._follows(self._on_loop(self.call(caller, request)), results_follow)
        header, buffers, fds, staged = self._request(live, request)
        streamed = 0  # bytes of a result still in ``sock``, on their way to the client after the reply
        with live.call():
            try:
                sock.settimeout(request.timeout or None)
                if live.shares_memory:
                    wire.send(sock, header, buffers, fds)
                elif following is not None:
                    assert request.value is not None
                    wire.send_head(sock, {**header, "inline": True}, buffers, request.value.sizes)
                    following.pass_to(sock)
                else:
                    with _as_bytes(header, buffers, staged) as (header, buffers):
                        wire.send(sock, header, buffers)
                head, total, fds = wire.recv_head(sock)
                if results_follow and "value" in head and not fds and total > SESSION_INLINE_BYTES:
                    frame, streamed = wire.Frame(head, [], fds), total
                else:
                    body = memoryview(bytearray(total))
                    recv_exact(sock, body, "the worker")
                    frame = wire.Frame(head, wire.split(head, body), fds)
            except ClientGone:
                direct.close()  # the worker has part of a frame: this connection is out of step
                raise
            except TimeoutError:
                direct.close()
                return self._on_loop(self._timed_out(live, request.timeout))
            except (EOFError, OSError):
                direct.close()
                return self._on_loop(self._lost(live))
            finally:
                if staged is not None:
                    live.memory.sent(staged)
        if not streamed:
            return self._follows(self._out(live, frame), results_follow)
        sizes = frame.header.pop("sizes", [])
        out = self._out(live, frame)
        if out.value is None:  # an answer the worker should not have sent: nothing follows it
            direct.close()
            raise ServerError(f"the worker of session {live.id} sent a result the server cannot read")
        out.value.sizes, out.value.follows = sizes, True

        def send(conn: socket.socket) -> None:
            try:
                pass_on(sock, conn, streamed)
            except BaseException:
                direct.close()
                raise

        out.follows = send
        return out

    def _receive(self, caller: Identity, live: _Live, request: CallIn, following: Following) -> None:
        """The value's bytes that follow on the channel, received into memory the worker maps (as
        an upload through gRPC is): the request then names it as staged."""
        assert request.value is not None
        size = following.size
        check_size(size)
        fd, mapped = live.memory.upload_memory(size)
        staged = Staged(caller.name, live.id, [(fd, 0, size)], size, mapped=mapped)
        try:
            if size:
                if staged.mapped is None:
                    staged.mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | wire.POPULATE)
                view = memoryview(staged.mapped)
                try:
                    following.into(view)
                finally:
                    view.release()
        except BaseException:
            staged.close()
            raise
        request.value.staged, request.value.follows = self.staging.add(staged, "u-"), False

    def _follows(self, out: CallOut, results_follow: bool) -> CallOut:
        """With ``results_follow``: a staged result's bytes follow the reply on the channel, instead
        of waiting for a download of their own."""
        if not results_follow or out.value is None or not out.value.staged:
            return out
        staged = self.staging.take(out.value.staged[:64])
        if staged is None:
            return out
        out.value.staged, out.value.follows, out.download = "", True, ""

        def send(conn: socket.socket) -> None:
            with staged.read_once() as views:
                for view in views:
                    for at in range(0, len(view), _SEND_SLICE):
                        conn.sendall(view[at : at + _SEND_SLICE])

        out.follows = send
        return out

    def _direct_socket(self, live: _Live, direct: Direct) -> socket.socket | None:
        if direct.sock is not None and direct.job_id == live.job_id:
            return direct.sock
        direct.close()
        if live.link is None:  # the event loop's path waits for the worker to listen, and says how it ended
            return None
        job_id = live.job_id
        try:
            direct.sock = self._connect(live, job_id, direct=True).sock
        except OSError:
            return None
        direct.job_id = job_id
        return direct.sock

    def _on_loop(self, work: Coroutine[Any, Any, CallOut]) -> CallOut:
        assert self._loop is not None, "SessionService.start() was not awaited"
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    async def _timed_out(self, live: _Live, timeout: float) -> CallOut:
        self.jobs.kill(live.job_id, f"a call ran past its timeout of {format_duration(timeout)}")
        return await self._lost(live, timeout=timeout)

    async def _roundtrip(
        self,
        live: _Live,
        header: dict[str, Any],
        buffers: list[Any],
        fds: list[int],
        staged: Staged | None,
        timeout: float,
    ) -> CallOut:
        try:
            link = await self._link(live, None)
        except _Died as died:
            return await self._died(live, died.job)
        try:
            if live.shares_memory:
                await link.send(header, buffers, fds)
            else:
                with _as_bytes(header, buffers, staged) as (inline_header, inline_buffers):
                    await link.send(inline_header, inline_buffers)
            receive = link.recv(_QUICK_REPLY)
            frame = await (asyncio.wait_for(receive, timeout) if timeout else receive)
        except asyncio.TimeoutError:
            return await self._timed_out(live, timeout)
        except (EOFError, ConnectionError, OSError):
            return await self._lost(live)
        return self._out(live, frame)

    async def _lost(self, live: _Live, timeout: float = 0.0) -> CallOut:
        """The worker went away in the middle of a call: say how it ended."""
        if live.link is not None:
            live.link.close()
            live.link = None
        job = await self.jobs.wait(Identity(live.owner, admin=True), live.job_id, _END_WAIT)
        out = await self._died(live, job)
        if timeout and out.failure is not None:
            out.failure["kind"] = "timeout"
        return out

    async def _died(self, live: _Live, job: JobRecord) -> CallOut:
        live.refs = 0
        tail, (stdout, stderr) = await asyncio.to_thread(lambda: (self._stderr_tail(live), self._offsets(live)))
        message = job.message or "it ended"
        if not job.state.is_terminal():
            message = "it closed its connection to the server"
        failure = {
            "kind": "died",
            "type": "WorkerDied",
            "message": f"the worker of session {live.id} died: {message}",
            "traceback": "",
            "exit_code": job.exit_code,
            "stderr_tail": tail,
        }
        return CallOut(failure=failure, stdout_offset=stdout, stderr_offset=stderr)

    def _offsets(self, live: _Live) -> tuple[int, int]:
        """Where the session's stdout and stderr end now (blocks: the worker's files are read)."""
        job_id, *starts = live.workers[-1]
        ends = [max(start, self.executor.file_size(job_id, name)) for start, name in zip(starts, _OUTPUT)]
        return ends[0], ends[1]

    def _stderr_tail(self, live: _Live) -> str:
        job_id, _, start = live.workers[-1]
        end = self.executor.file_size(job_id, "stderr")
        at = max(start, end - _TAIL_BYTES)
        lines = self.executor.read_file(job_id, "stderr", at, end - at).decode(errors="replace").splitlines()
        return "\n".join(lines[-_STDERR_TAIL_LINES:])

    def _read_output(self, live: _Live, fd: int, offset: int) -> tuple[int, bytes]:
        """The session's output ``fd`` from ``offset``: from the worker that wrote it, up to where the
        next one's starts; (the next one's start, b"") past the end of an earlier worker's."""
        workers = list(live.workers)
        at = max([i for i, worker in enumerate(workers) if worker[fd] <= offset], default=0)
        end = workers[at + 1][fd] if at + 1 < len(workers) else None
        limit = LOG_CHUNK_BYTES if end is None else min(LOG_CHUNK_BYTES, end - offset)
        data = self.executor.read_file(workers[at][0], _OUTPUT[fd - 1], offset, limit) if limit > 0 else b""
        if not data and end is not None:
            return end, b""
        return offset, data

    def _out(self, live: _Live, frame: wire.Frame) -> CallOut:
        h = frame.header
        out = CallOut(stdout_offset=h.get("stdout", 0), stderr_offset=h.get("stderr", 0))
        released = h.get("released", [])
        if released and len(released) <= len(frame.fds):  # the last descriptors: memory the worker let go of
            kept = len(frame.fds) - len(released)
            for fd, (_, size) in zip(frame.fds[kept:], released):
                if self.staging.holds(os.fstat(fd).st_ino):  # a result still on its way out of it
                    os.close(fd)
                else:
                    live.memory.keep_spare(fd, size)
            frame.fds = frame.fds[:kept]
        try:
            if "error" in h:
                name, message = h["error"]
                raise _ERRORS.get(name, InvalidRequest)(message)
            if h.get("unknown_function"):
                out.unknown_function = True
            elif "failure" in h:
                out.failure = h["failure"]
                out.exception = bytes(frame.buffers[0]) if frame.buffers else b""
            elif "ref" in h:
                out.ref = h["ref"]
            elif "refs" in h:
                out.refs = h["refs"]
            if "values" in h:
                live.refs = h["values"]
            elif "refs" in h:  # a worker an older server started, which does not count its values itself
                live.refs = len(h["refs"])
            elif "ref" in h:
                live.refs += 1
            if "value" in h:
                if not frame.fds and sum(b.nbytes for b in frame.buffers) > SESSION_INLINE_BYTES:
                    # A large result that came as bytes (a worker on another node): staged here, for
                    # the client to download as it does one the worker left in shared memory.
                    frame.fds, h["parts"] = _staging_copy(frame.buffers)
                    frame.buffers = []
                value = Value(header=h["value"].encode(), buffers=[bytes(b) for b in frame.buffers])
                if frame.fds:
                    # [descriptor index, offset, size] of each buffer, in the descriptors sent along
                    parts = [(frame.fds[i], offset, size) for i, offset, size in h["parts"]]
                    staged = Staged(
                        live.owner, live.id, parts, sum(size for _, _, size in parts), borrow=live.memory.borrow
                    )
                    frame.fds = []  # the staged value owns them now
                    key = self.staging.add(staged, "d-")
                    value.staged, value.sizes = key, [size for _, _, size in parts]
                    out.download = key
                out.value = value
            return out
        finally:
            for fd in frame.fds:
                os.close(fd)

    # ---- bulk data --------------------------------------------------------------------------------

    async def upload(self, caller: Identity, chunks: AsyncIterator[tuple[str, int, bytes]]) -> str:
        """Receive a value's buffers (laid end to end) into memory the worker will map; return its key."""
        first = await anext(chunks, None)
        if first is None:
            raise InvalidRequest("an upload needs at least one message, naming the session and the size")
        session_id, size, data = first
        live = self._find(caller, session_id)
        check_size(size)
        fd, mapped = live.memory.upload_memory(size)
        if mapped is None and size:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | wire.POPULATE)
        try:
            at = 0
            while True:
                if data:
                    if at + len(data) > size:
                        raise InvalidRequest(f"the upload sent more than the {size} bytes it announced")
                    assert mapped is not None
                    mapped[at : at + len(data)] = data
                    at += len(data)
                nxt = await anext(chunks, None)
                if nxt is None:
                    break
                data = nxt[2]
            if at != size:
                raise InvalidRequest(f"the upload ended after {at} of the {size} bytes it announced")
        except BaseException:
            os.close(fd)
            if mapped is not None:
                mapped.close()
            raise
        key = self.staging.add(Staged(caller.name, live.id, [(fd, 0, size)], size, mapped=mapped), "u-")
        live.last_call_at = time.time()
        return key

    def transfer(
        self, caller: Identity, session_id: str, channel: bool = False, tunnel: str = "", blobs: bool = False
    ) -> str:
        """A ticket for the data port: with ``channel`` for a channel carrying the session's calls and
        their values, with ``tunnel`` for a byte stream to the worker's endpoint ``tunnel-NAME`` (a
        TensorFlow server the worker runs), or with ``blobs`` (and no session) for an upload of
        snapshot blobs."""
        if not self.data_port:
            raise InvalidRequest("this server has no data port: send values through gRPC (Upload, Download)")
        if blobs:
            return self.staging.ticket("", "blobs", caller)
        live = self._find(caller, session_id)
        if channel:
            return self.staging.ticket(live.id, "channel", caller)
        if tunnel:
            if not _TUNNEL_NAME.fullmatch(tunnel):
                raise InvalidRequest(f"tunnel name {tunnel[:40]!r}: use up to 32 lower-case letters, digits and '-'")
            return self.staging.ticket(live.id, f"tunnel:{tunnel}", caller)
        raise InvalidRequest(
            "ask for a channel (a session's values go through it), a tunnel or blobs: this server hands out no "
            "ticket for a value of its own"
        )

    def tunnel_socket(self, session_id: str, name: str) -> socket.socket:
        """The tunnel ``NAME`` of session ``session_id``'s worker: the connection its endpoint
        ``tunnel-NAME`` (checked to be the worker's) hands over. Raises OSError when there is none,
        PermissionError when another process listens there."""
        live = self._live.get(session_id)
        if live is None:
            raise FileNotFoundError(f"session {session_id} has ended")
        return handed_over(self.executor.connect(live.job_id, f"tunnel-{name}"), name)

    async def download(self, caller: Identity, session_id: str, key: str) -> AsyncIterator[bytes]:
        live = self._find(caller, session_id)
        staged = self.staging.take(key[:64])
        if staged is None or staged.session_id != live.id:
            raise NotFound(f"no result {key[:64]!r} to download for this session (it expires after {STAGED_TTL:g}s)")
        with staged.read_once() as views:
            for view in views:
                for at in range(0, len(view), SESSION_INLINE_BYTES):
                    yield bytes(view[at : at + SESSION_INLINE_BYTES])

    # ---- output -----------------------------------------------------------------------------------

    async def output(
        self, caller: Identity, session_id: str, stdout_offset: int, stderr_offset: int
    ) -> AsyncIterator[tuple[int, int, bytes, str]]:
        """The session's output from these offsets on (negative: from its end now), as (fd, offset,
        data, ""), while it lives; a change of state comes as (0, 0, b"", state). Following it keeps
        an unnamed session alive."""
        live = self._find(caller, session_id)
        offsets = {1: stdout_offset, 2: stderr_offset}
        if min(offsets.values()) < 0:  # from where it stands now
            now = await asyncio.to_thread(self._offsets, live)
            offsets = {fd: now[fd - 1] if asked < 0 else asked for fd, asked in offsets.items()}
        live.attached += 1
        state, looked_at, moved_at = "", -math.inf, time.monotonic()
        woken = asyncio.Event()
        wake = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, woken.set)
        live.followers.add(wake)
        try:
            for fd in (1, 2):  # where the stream starts, so that the client knows its offsets
                yield fd, offsets[fd], b"", ""
            while True:
                read = await asyncio.to_thread(
                    lambda: [(fd, *self._read_output(live, fd, offsets[fd])) for fd in (1, 2)]
                )
                moved = False
                for fd, at, data in read:
                    moved = moved or at != offsets[fd] or bool(data)
                    offsets[fd] = at
                    if data:
                        yield fd, at, data, ""
                        offsets[fd] += len(data)
                if moved:
                    moved_at = time.monotonic()
                    continue
                ended = live.id not in self._live
                if ended or time.monotonic() - looked_at >= _STATE_EVERY:  # the state: from the store, less often
                    looked_at = time.monotonic()
                    job = self.jobs.get(Identity(live.owner, admin=True), live.job_id) if not ended else None
                    now = "ended" if job is None else self._state(live, job)[0]
                    if now != state:
                        state = now
                        yield 0, 0, b"", state
                if ended:
                    return
                woken.clear()  # before the look at its calls: a call that starts after it wakes this
                busy = live.calls or time.time() - live.last_call_at < _BUSY_OUTPUT_FOR
                if busy or time.monotonic() - moved_at < _BUSY_OUTPUT_FOR:
                    await asyncio.sleep(LOG_POLL_INTERVAL)
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(woken.wait(), _IDLE_OUTPUT_POLL)
        finally:
            live.followers.discard(wake)
            live.attached -= 1
            if not live.attached:
                live.detached_since = time.time()

    # ---- ending idle sessions ---------------------------------------------------------------------

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY)
            try:
                self.reap()
            except Exception:
                log.exception("ending idle sessions failed")

    def reap(self) -> None:
        now = time.time()
        for live in list(self._live.values()):
            if live.calls:
                continue
            if now - live.last_call_at > live.idle_timeout:
                self._end(live, f"idle for {format_duration(live.idle_timeout)}")
            elif (
                not live.name
                and not live.attached
                and now - live.detached_since > min(live.idle_timeout, SESSION_DETACHED_GRACE)
            ):
                self._end(live, "its client went away without closing it")
            else:
                live.memory.drop_spare(older_than=SESSION_REUSE_SECONDS)
        self.staging.drop(older_than=STAGED_TTL)


class _Died(Exception):
    def __init__(self, job: JobRecord) -> None:
        super().__init__(job.message)
        self.job = job


def _check(request: CallIn) -> None:
    if request.op not in ("call", "put", "get", "delete", "refs"):
        raise InvalidRequest(f"unknown operation {request.op!r}")
    if request.timeout < 0:
        raise InvalidRequest(f"timeout must be 0 (none) or more, not {request.timeout:g}")


@contextlib.contextmanager
def _as_bytes(
    header: dict[str, Any], buffers: list[Any], staged: Staged | None
) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """A request for a worker that shares no memory with this server (on another node): the staged
    upload's bytes go inline after the other buffers, and the worker is asked to answer inline."""
    header = {**header, "inline": True}
    sizes = header.pop("staged_sizes", None)
    header.pop("fd_sizes", None)
    if staged is None:
        yield header, buffers
        return
    views = staged.views()
    parts: list[memoryview] = []
    try:
        whole = views[0][1] if views else memoryview(b"")
        at = 0
        for size in sizes or [staged.size]:
            parts.append(whole[at : at + size])
            at += size
        yield header, [*buffers, *parts]
    finally:
        for part in parts:
            part.release()
        for mapped, view in views:
            view.release()
            if mapped is not None:
                with contextlib.suppress(BufferError):  # a view still held: the map goes with it
                    mapped.close()


def _staging_copy(buffers: list[memoryview]) -> tuple[list[int], list[list[int]]]:
    """``buffers`` copied into one memfd: its descriptor, and [0, offset, size] of each buffer in it."""
    total = sum(b.nbytes for b in buffers)
    fd, mapped = wire.staging_file(total, "gpuport-result")
    parts, at = [], 0
    try:
        for b in buffers:
            if mapped is not None:
                mapped[at : at + b.nbytes] = b.cast("B") if b.format != "B" else b
            parts.append([0, at, b.nbytes])
            at += b.nbytes
    except BaseException:
        os.close(fd)
        raise
    finally:
        if mapped is not None:
            mapped.close()
    return [fd], parts
