"""Sessions and remote functions: Python run in a worker process next to the server's GPU.

A ``Session`` is one worker holding an allocation and the values put in it (``Ref``); a
``RemoteFunction`` runs each call in a worker of a small pool of sessions it opens as needed.
Values cross as the codec of ``protocol/values.py``: arrays as raw buffers, the rest as cloudpickle.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import contextlib
import functools
import hashlib
import mmap
import os
import platform
import signal
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

import cloudpickle
import grpc

from gpuport.client._data_port import Channel, ChannelLost
from gpuport.defaults import (
    SESSION_INLINE_BYTES,
    SESSION_PROGRESS_BYTES,
    SESSION_REUSE_BYTES,
    SESSION_REUSE_SECONDS,
)
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol import refs, values
from gpuport.protocol.errors import (
    CallTimeout,
    ConnectionFailed,
    GpuportError,
    IncompatibleVersions,
    InvalidRequest,
    RemoteError,
    WorkerDied,
)
from gpuport.protocol.units import parse_duration, parse_size

if TYPE_CHECKING:
    from gpuport.client._transport import Transport

_OUTPUT_WAIT = 5.0  # seconds a call waits for its output to arrive before returning anyway
_RECONNECT_PAUSE = 0.5
_encoding_for = threading.local()  # the session whose call is being encoded, for Ref.__reduce__
_NO_ARGS_ENCODED = values.encode(((), {}))
_NO_ARGS_VALUE = pb.Value(header=_NO_ARGS_ENCODED.header, buffers=[b.tobytes() for b in _NO_ARGS_ENCODED.buffers])


@dataclass(frozen=True)
class SessionInfo:
    """A session as the server sees it; ``state`` is queued, running, died (its worker ended: see
    ``message``; ``restart()``) or ended."""

    id: str
    name: str
    owner: str
    state: str
    job_id: str
    gpus: int
    gpu_memory: int
    cpus: float
    memory: int
    gpu_indices: list[int]
    created_at: float
    last_call_at: float
    idle_timeout: float
    message: str
    refs: int
    attached: int
    position: int
    node: str = ""  # where its worker runs (a cluster's node; this machine's name on one machine)

    @classmethod
    def from_message(cls, m: pb.SessionInfo) -> SessionInfo:
        return cls(
            id=m.session_id,
            name=m.name,
            owner=m.owner,
            state=m.state,
            job_id=m.job_id,
            gpus=m.gpus,
            gpu_memory=m.gpu_memory,
            cpus=m.cpus,
            memory=m.memory,
            gpu_indices=list(m.gpu_indices),
            created_at=m.created_at,
            last_call_at=m.last_call_at,
            idle_timeout=m.idle_timeout,
            message=m.message,
            refs=m.refs,
            attached=m.attached,
            position=m.position,
            node=m.node,
        )


class Ref:
    """A value held by a session's worker. Pass it among a call's arguments (anywhere: in a list, a
    dict) and the worker uses the value itself; ``session.get(ref)`` brings it here."""

    __slots__ = ("id", "name", "session_id", "summary", "type")

    def __init__(self, session_id: str, info: pb.RefInfo) -> None:
        self.session_id = session_id
        self.id = info.ref_id
        self.name = info.name
        self.type = info.type
        self.summary = info.summary

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        summary = f" {self.summary}" if self.summary else ""
        return f"<Ref{name} {self.type}{summary} in {self.session_id}>"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        session = getattr(_encoding_for, "session", None)
        if session is not None and session != self.session_id:
            raise InvalidRequest(
                f"{self!r} belongs to session {self.session_id}, not to {session}: get() it and pass the value"
            )
        return refs.held, (self.id,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and (other.session_id, other.id) == (self.session_id, self.id)

    def __hash__(self) -> int:
        return hash((self.session_id, self.id))


# ---- pickling functions ----------------------------------------------------------------------------

_INSTALLED = tuple(
    os.path.realpath(p) + os.sep
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


def _by_value(function: Callable[..., Any]) -> None:
    """Have cloudpickle send the user's own modules by value: the server cannot import them.

    A function of ``__main__`` or a notebook is sent by value already; one from a module of the user's
    project (not installed in site-packages or the standard library) would otherwise be pickled as an
    import the worker cannot do.
    """
    name = getattr(function, "__module__", None) or ""
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    if module is None or top in ("__main__", "gpuport") or top in sys.builtin_module_names:
        return  # gpuport's own functions (the notebook's cells) are imports: the server has gpuport
    path = getattr(module, "__file__", None)
    if not path or os.path.realpath(path).startswith(_INSTALLED):
        return
    if isinstance(module, ModuleType):
        cloudpickle.register_pickle_by_value(module)


_pickled: weakref.WeakKeyDictionary[Any, tuple[str, bytes]] = weakref.WeakKeyDictionary()


def _pickle_function(function: Callable[..., Any]) -> tuple[str, bytes]:
    """The function's pickle and its sha256, made once per function object."""
    with contextlib.suppress(TypeError):
        cached = _pickled.get(function)
        if cached is not None:
            return cached
    if not callable(function):
        raise InvalidRequest(f"{function!r} is not callable: pass a function to call()")
    _by_value(function)
    try:
        data = cloudpickle.dumps(function, protocol=5)
    except Exception as e:
        raise InvalidRequest(
            f"the function {getattr(function, '__qualname__', function)!r} cannot be pickled: {e} "
            "(it refers to something that cannot travel, such as a lock, an open file or a connection)"
        ) from None
    entry = (hashlib.sha256(data).hexdigest(), data)
    with contextlib.suppress(TypeError):
        _pickled[function] = entry
    return entry


# ---- errors ------------------------------------------------------------------------------------------

_MIXED: dict[type, type] = {}


def _remote_error(failure: pb.RemoteFailure) -> GpuportError:
    if failure.kind in ("died", "timeout"):
        code = failure.exit_code if failure.has_exit_code else None
        name = None
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
        message = failure.message
        if failure.stderr_tail:
            message += "\nthe last lines of its stderr:\n" + failure.stderr_tail
        message += "\nits values are lost: session.restart() starts a fresh worker"
        cls = CallTimeout if failure.kind == "timeout" else WorkerDied
        return cls(message, exit_code=code, signal=name, stderr_tail=failure.stderr_tail)
    original: BaseException | None = None
    if failure.exception:
        with contextlib.suppress(Exception):
            loaded = cloudpickle.loads(failure.exception)
            if isinstance(loaded, BaseException):
                original = loaded
    message = f"{failure.type}: {failure.message}"
    if failure.traceback:
        message += "\n\nRemote traceback:\n" + failure.traceback.rstrip()
    error = _as_original(message, failure, original)
    if error is None:
        error = RemoteError(message, remote_type=failure.type, remote_traceback=failure.traceback, exception=original)
    return error


def _as_original(message: str, failure: pb.RemoteFailure, original: BaseException | None) -> Any:
    """A RemoteError that is also an instance of the original exception's type, where Python allows."""
    if not isinstance(original, Exception) or isinstance(original, GpuportError):
        return None
    kind = type(original)
    try:
        mixed = _MIXED.get(kind)
        if mixed is None:
            mixed = _MIXED[kind] = type(
                f"Remote{kind.__name__}", (RemoteError, kind), {"__module__": "gpuport", "__doc__": RemoteError.__doc__}
            )
        error: Any = mixed.__new__(mixed, message)
        error.__dict__.update(getattr(original, "__dict__", {}))
        error.args = (message,)
    except Exception:  # a layout conflict (two C-level bases), a __new__ that wants other arguments
        return None
    error.remote_type = failure.type
    error.remote_traceback = failure.traceback
    error.exception = original
    return error


# ---- output ----------------------------------------------------------------------------------------


class _Output:
    """A thread following the session's remote stdout and stderr onto the local ones, as they come."""

    def __init__(self, session: Session, start_at_end: bool) -> None:
        self._session = session
        self._offsets = {1: -1, 2: -1} if start_at_end else {1: 0, 2: 0}
        self._decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in (1, 2)}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._call: Any = None
        self.state = ""
        self._thread = threading.Thread(target=self._run, name=f"gpuport output {session.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        transport = self._session._transport
        while not self._stop.is_set():
            request = pb.OutputRequest(
                session_id=self._session.id, stdout_offset=self._offsets[1], stderr_offset=self._offsets[2]
            )
            try:
                self._call = transport.sessions.Output(request, metadata=transport.metadata)
                for chunk in self._call:
                    if chunk.fd in (1, 2):
                        if chunk.data:
                            text = self._decoders[chunk.fd].decode(chunk.data)
                            stream = sys.stdout if chunk.fd == 1 else sys.stderr
                            with contextlib.suppress(Exception):
                                stream.write(text)
                                stream.flush()
                        with self._changed:
                            self._offsets[chunk.fd] = chunk.offset + len(chunk.data)
                            self._changed.notify_all()
                    else:
                        self.state = chunk.state
                        if chunk.state == "ended":
                            self._stop.set()
                with self._changed:
                    self._changed.notify_all()
                if self._stop.is_set():
                    return
            except grpc.RpcError as e:
                if self._stop.is_set() or e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED):
                    return
            self._stop.wait(_RECONNECT_PAUSE)  # the server restarts, or the connection dropped: follow again

    def wait_for(self, stdout: int, stderr: int) -> None:
        """Until everything up to these offsets has been written here (a few seconds at most)."""
        deadline = time.monotonic() + _OUTPUT_WAIT
        with self._changed:
            while self._offsets[1] < stdout or self._offsets[2] < stderr:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return
                self._changed.wait(left)

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)


# ---- sessions --------------------------------------------------------------------------------------


class Session:
    """A live worker process on the server, holding an allocation and values: made by ``Client.session``.

    As a context manager: on exit an unnamed session is closed; a named one is left running (it ends
    when closed, or after its idle timeout), and ``gpu.session(name=...)`` finds it again.
    """

    def __init__(self, transport: Transport, info: pb.SessionInfo, *, progress: bool | None = None) -> None:
        self._transport = transport
        self.id: str = info.session_id
        self.name: str = info.name
        self.reattached: bool = info.reattached
        self._sent: set[str] = set()  # functions the current worker has been sent
        self._worker = info.job_id
        self._progress = progress
        self._closed = False
        self._channel: Channel | None = None
        self._output = _Output(self, start_at_end=info.reattached)

    # ---- life -------------------------------------------------------------------------------------

    def info(self) -> SessionInfo:
        return SessionInfo.from_message(
            self._transport.call(self._transport.sessions.Get, pb.SessionRef(session_id=self.id))
        )

    def _wait_running(self, info: pb.SessionInfo) -> None:
        said = ""
        while info.state == "queued":
            if info.message != said:
                print(f"gpuport: session {self.id} is queued: {info.message}", file=sys.stderr, flush=True)
                said = info.message
            time.sleep(0.2)
            info = self._transport.call(self._transport.sessions.Get, pb.SessionRef(session_id=self.id))

    def restart(self) -> None:
        """Start a fresh worker (the values held are lost): after ``WorkerDied``, or to start clean."""
        info = self._transport.call(self._transport.sessions.Restart, pb.SessionRef(session_id=self.id), timeout=60)
        self._worker, self._sent = info.job_id, set()
        self._wait_running(info)

    def close(self) -> None:
        """End the session: its worker stops and what it held is freed (a named one too)."""
        if self._closed:
            return
        self._closed = True
        self._output.stop()
        self._close_channel()
        with contextlib.suppress(GpuportError):
            self._transport.call(self._transport.sessions.Close, pb.SessionRef(session_id=self.id))

    def detach(self) -> None:
        """Stop following this session from here; a named session goes on running."""
        self._closed = True
        self._output.stop()
        self._close_channel()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self.name:
            self.detach()
        else:
            self.close()

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"<Session {self.id}{name}>"

    # ---- values -----------------------------------------------------------------------------------

    def _rpc(self, request: pb.CallRequest) -> pb.CallReply:
        return self._exchange(request)[0]

    def _exchange(
        self, request: pb.CallRequest, following: Sequence[memoryview] = ()
    ) -> tuple[pb.CallReply, memoryview | None]:
        """Make the call; returns its reply and, when a large result's bytes followed the reply on
        the session's channel, the memory they came into. ``following``: the buffers of the value
        (``request.value.follows``), sent after the request on the channel, or uploaded first where
        there is none."""
        if self._closed:
            raise InvalidRequest(f"session {self.id} was closed or detached here; open it again with gpu.session()")
        channel = self._open_channel()
        received = None
        if channel is not None:
            request.results_follow = True
            bar = _Progress("sending", sum(b.nbytes for b in following), self._progress) if following else None
            try:
                reply, received = channel.call(request, following, bar.advance if bar else None, self._receiving)
            except ChannelLost:
                self._close_channel()
                raise ConnectionFailed(
                    f"lost the connection to the server during a call to session {self.id}: the call may or may "
                    "not have run; the session's values are still there unless its worker died"
                ) from None
            finally:
                if bar is not None:
                    bar.close()
        else:
            if following:
                request.value.staged = self._upload(following, sum(b.nbytes for b in following))
                request.value.follows = False
            reply = self._transport.call(self._transport.sessions.Call, request, timeout=None)
        self._output.wait_for(reply.stdout_offset, reply.stderr_offset)
        if reply.HasField("failure"):
            if reply.failure.kind in ("died", "timeout"):
                self._sent = set()
            raise _remote_error(reply.failure)
        return reply, received

    def _receiving(self, total: int) -> tuple[memoryview, _Progress]:
        """Memory for a result of ``total`` bytes (see ``_Memory``), and its progress bar."""
        view = memoryview(_RESULTS.take(total))[:total] if total else memoryview(bytearray())
        return view, _Progress("receiving", total, self._progress)

    def _open_channel(self) -> Channel | None:
        """The channel carrying this session's calls on the data port (opened on first use, and again
        once the server closed it, as after its restart), or None for gRPC (no data port)."""
        channel = self._channel
        if channel is not None and channel.idle_and_closed():
            self._close_channel()
            channel = None
        if channel is None:
            channel = self._channel = self._transport.open_channel(self.id)
        return channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _value(self, encoded: values.Encoded) -> tuple[pb.Value, list[memoryview]]:
        """The value as sent: small, inline; large, its buffers following the request (returned
        apart, for ``_exchange``)."""
        total = sum(b.nbytes for b in encoded.buffers)
        if total <= SESSION_INLINE_BYTES:
            return pb.Value(header=encoded.header, buffers=[b.tobytes() for b in encoded.buffers]), []
        flat = [b.cast("B") if b.ndim != 1 or b.format != "B" else b for b in encoded.buffers]
        return pb.Value(header=encoded.header, sizes=[b.nbytes for b in flat], follows=True), flat

    def _upload(self, buffers: Sequence[memoryview], total: int) -> str:
        bar = _Progress("sending", total, self._progress)
        try:

            def chunks() -> Iterator[pb.UploadChunk]:
                yield pb.UploadChunk(session_id=self.id, size=total)
                for buffer in buffers:
                    flat = buffer.cast("B") if buffer.ndim != 1 or buffer.format != "B" else buffer
                    for at in range(0, flat.nbytes, SESSION_INLINE_BYTES):
                        piece = flat[at : at + SESSION_INLINE_BYTES]
                        yield pb.UploadChunk(data=piece.tobytes())
                        bar.advance(piece.nbytes)

            reply: pb.Staged = self._transport.call(self._transport.sessions.Upload, chunks(), timeout=None)
        finally:
            bar.close()
        return reply.staged

    def _result(self, value: pb.Value, received: memoryview | None = None) -> Any:
        buffers: list[Any] = list(value.buffers)
        if value.follows and received is not None:
            buffers, at = [], 0
            for size in value.sizes:
                buffers.append(received[at : at + size])
                at += size
        elif value.staged:
            total = sum(value.sizes)
            # Anonymous memory, not a bytearray: a bytearray is zero-filled first, which cost as much
            # time as receiving the bytes; reused once an earlier result's arrays are gone. The arrays
            # decoded from it keep the map alive.
            view = memoryview(_RESULTS.take(total))[:total] if total else memoryview(bytearray())
            bar = _Progress("receiving", total, self._progress)
            try:
                at = 0
                request = pb.DownloadChunkRequest(session_id=self.id, staged=value.staged)
                for chunk in self._transport.stream(self._transport.sessions.Download, request):
                    view[at : at + len(chunk.data)] = chunk.data
                    at += len(chunk.data)
                    bar.advance(len(chunk.data))
            finally:
                bar.close()
            buffers = []
            at = 0
            for size in value.sizes:
                buffers.append(view[at : at + size])
                at += size
        return values.decode(value.header, buffers)

    def put(self, value: Any, *, device: str | None = None, name: str | None = None) -> Ref:
        """Send ``value`` to the worker, where it stays; returns its Ref. ``device="gpu"`` places an
        array on the worker's GPU with its own framework (numpy arrays: as they are)."""
        if device not in (None, "cpu", "gpu"):
            raise InvalidRequest(f"device must be 'cpu' or 'gpu', not {device!r}")
        encoded, following = self._encode(value)
        request = pb.CallRequest(
            session_id=self.id,
            op=pb.CallRequest.PUT,
            value=encoded,
            device=device or "",
            ref_name=name or "",
        )
        return Ref(self.id, self._exchange(request, following)[0].ref)

    def _encode(self, value: Any) -> tuple[pb.Value, list[memoryview]]:
        _encoding_for.session = self.id
        try:
            return self._value(values.encode(value))
        finally:
            _encoding_for.session = None

    def call(
        self,
        function: Callable[..., Any],
        /,
        *args: Any,
        keep: bool | str = False,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``function(*args, **kwargs)`` in the worker and return its result; with ``keep`` the
        result stays there and its ``Ref`` comes back (``keep="name"`` also names it). Refs among the
        arguments are the values they stand for. Past ``timeout`` seconds the worker is stopped and
        ``CallTimeout`` raised. The remote code's prints appear here as they happen."""
        digest, pickled = _pickle_function(function)
        if timeout is not None and timeout <= 0:
            raise InvalidRequest(f"timeout must be more than 0 seconds, not {timeout}")
        encoded, following = self._encode((args, kwargs)) if args or kwargs else (_NO_ARGS_VALUE, [])  # encoded once
        request = pb.CallRequest(
            session_id=self.id,
            op=pb.CallRequest.CALL,
            value=encoded,
            function=digest,
            function_pickle=b"" if digest in self._sent else pickled,
            keep=bool(keep),
            ref_name=keep if isinstance(keep, str) else "",
            timeout=timeout or 0.0,
        )
        reply, received = self._exchange(request, following)
        if reply.unknown_function:  # a new worker (restarted, or after a server restart): send it again
            request.function_pickle = pickled
            reply, received = self._exchange(request, following)
        self._sent.add(digest)
        if keep:
            return Ref(self.id, reply.ref)
        return self._result(reply.value, received)

    def get(self, ref: Ref) -> Any:
        """The value ``ref`` stands for, brought here."""
        self._check(ref)
        reply, received = self._exchange(pb.CallRequest(session_id=self.id, op=pb.CallRequest.GET, ref_ids=[ref.id]))
        return self._result(reply.value, received)

    def delete(self, *refs: Ref) -> None:
        """Let the worker drop these values."""
        for ref in refs:
            self._check(ref)
        self._rpc(pb.CallRequest(session_id=self.id, op=pb.CallRequest.DELETE, ref_ids=[r.id for r in refs]))

    def refs(self) -> list[Ref]:
        """Every value the worker holds (after a re-attach: what earlier clients put there)."""
        reply = self._rpc(pb.CallRequest(session_id=self.id, op=pb.CallRequest.REFS))
        return [Ref(self.id, r) for r in reply.refs]

    def ref(self, name: str) -> Ref:
        """The value put or kept under ``name``."""
        for ref in self.refs():
            if ref.name == name:
                return ref
        from gpuport.protocol.errors import NotFound

        raise NotFound(f"session {self.id} holds no value named {name!r}")

    def _check(self, ref: Ref) -> None:
        if not isinstance(ref, Ref):
            raise InvalidRequest(f"expected a Ref, got {type(ref).__name__}")
        if ref.session_id != self.id:
            raise InvalidRequest(f"{ref!r} belongs to session {ref.session_id}, not to {self.id}")


class _Progress:
    """A progress bar on stderr for a large transfer (``show`` None: when stderr is a terminal)."""

    def __init__(self, what: str, total: int, show: bool | None) -> None:
        if show is None:
            show = total >= SESSION_PROGRESS_BYTES and sys.stderr.isatty()
        self._bar: Any = None
        if show:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self._bar = Progress(f"[bold]{what}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True)
            self._task = self._bar.add_task(what, total=total)
            self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class _Memory:
    """Memory that large results are received into, reused once the arrays made from it are gone (their
    views hold references to its map: CPython's reference count tells). Memory first touched costs page
    faults that take about as long as receiving the bytes (on a 2-core VM, 0.7 s a GiB). A map unused
    for ``SESSION_REUSE_SECONDS`` is given back; ``SESSION_REUSE_BYTES`` bounds what is kept."""

    _SMALLEST = 16 * 1024 * 1024  # smaller results are not worth keeping memory for
    _FREE = 2  # references to a map nobody uses: its entry's, and getrefcount's argument

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: list[list[Any]] = []  # [map, when last handed out]
        self._timer: threading.Timer | None = None

    def take(self, size: int) -> mmap.mmap:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            fits = [e for e in self._maps if size <= len(e[0]) <= size + size // 4 and self._unused(e)]
            if fits:
                entry = min(fits, key=lambda e: len(e[0]))
                entry[1] = now
                return entry[0]  # type: ignore[no-any-return]
        mapped = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
        if size >= self._SMALLEST:
            with self._lock:
                while self._maps and sum(len(e[0]) for e in self._maps) + size > SESSION_REUSE_BYTES:
                    free = [e for e in self._maps if self._unused(e)]
                    if not free:
                        break
                    self._maps.remove(min(free, key=lambda e: e[1]))
                if sum(len(e[0]) for e in self._maps) + size <= SESSION_REUSE_BYTES:
                    self._maps.append([mapped, now])
                    self._schedule()
        return mapped

    def _unused(self, entry: list[Any]) -> bool:
        return sys.getrefcount(entry[0]) <= self._FREE

    def _trim(self, now: float) -> None:
        self._maps = [e for e in self._maps if not (now - e[1] > SESSION_REUSE_SECONDS and self._unused(e))]

    def _schedule(self) -> None:
        if self._timer is None and self._maps:
            self._timer = threading.Timer(SESSION_REUSE_SECONDS + 1, self._tick)
            self._timer.daemon = True
            self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
            self._trim(time.monotonic())
            self._schedule()


_RESULTS = _Memory()


# ---- remote functions --------------------------------------------------------------------------------


def open_session(
    transport: Transport,
    *,
    name: str | None = None,
    gpus: int = 0,
    gpu_memory: int | str | None = None,
    cpus: float = 0.0,
    memory: int | str | None = None,
    priority: int = 0,
    idle_timeout: float | str | None = None,
    env: dict[str, str] | None = None,
    requirements: str = "",
    wait: bool = True,
    progress: bool | None = None,
) -> Session:
    """Open (or re-attach) a session through ``transport``: ``Client.session`` says how
    (``requirements`` as text here)."""
    if transport.pickle_problem:
        raise IncompatibleVersions(
            f"sessions and remote functions cannot work with this server: {transport.pickle_problem}"
        )
    spec = pb.SessionSpec(
        name=name or "",
        gpus=gpus,
        gpu_memory=parse_size(gpu_memory) if gpu_memory is not None else 0,
        cpus=cpus,
        memory=parse_size(memory) if memory is not None else 0,
        priority=priority,
        idle_timeout=parse_duration(idle_timeout) if idle_timeout is not None else 0.0,
        env=env or {},
        python_version=platform.python_version(),
        cloudpickle_version=cloudpickle.__version__,
        requirements=requirements,
    )
    info = transport.call(transport.sessions.Open, spec)
    session = Session(transport, info, progress=progress)
    transport.opened.add(session)
    if wait:
        try:
            session._wait_running(info)
        except BaseException:  # Ctrl-C while queued: give the place in the queue back
            if not name:
                session.close()
            raise
    return session


class RemoteFunction:
    """A function that runs on the server, made by ``@gpu.function(...)``.

    Calling it runs it in a worker holding the allocation asked for, and returns its result;
    ``spawn`` returns a ``concurrent.futures.Future``; ``map`` runs calls in parallel workers (up to
    ``max_workers``, and no more than can start at once). The workers are sessions kept between
    calls, closed by ``close()`` or when the program exits.
    """

    def __init__(
        self,
        transport: Transport,
        function: Callable[..., Any],
        options: dict[str, Any],
        timeout: float | None,
        max_workers: int,
    ) -> None:
        if max_workers < 1:
            raise InvalidRequest(f"max_workers must be 1 or more, not {max_workers}")
        functools.update_wrapper(self, function)
        self._transport = transport
        self._function = function
        self._options = options
        self._timeout = timeout
        self._cap = max_workers
        self._idle: list[Session] = []
        self._count = 0  # sessions open or being opened
        self._free = threading.Condition()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._finalizer = weakref.finalize(self, RemoteFunction._close_all, self._idle)

    def _acquire(self) -> Session:
        with self._free:
            while True:
                if self._idle:
                    return self._idle.pop()
                if self._count < self._cap:
                    self._count += 1
                    break
                self._free.wait()
        try:
            session = open_session(self._transport, wait=False, **self._options)
            info = session.info()
            if info.state == "queued":
                with self._free:
                    others = self._count - 1
                if others:  # the others run: use them rather than wait in the queue
                    session.close()
                    with self._free:
                        self._count -= 1
                        self._cap = max(1, self._count)
                    return self._acquire()
                session._wait_running(pb.SessionInfo(session_id=session.id, state="queued", message=info.message))
            return session
        except BaseException:
            with self._free:
                self._count -= 1
                self._free.notify()
            raise

    def _release(self, session: Session, broken: bool) -> None:
        if broken:
            session.close()
        with self._free:
            if broken:
                self._count -= 1
            else:
                self._idle.append(session)
            self._free.notify()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        session = self._acquire()
        broken = True
        try:
            result = session.call(self._function, *args, timeout=self._timeout, **kwargs)
            broken = False
            return result
        except (RemoteError, InvalidRequest):
            broken = False  # the worker is fine: the user's code raised, or an argument could not travel
            raise
        finally:
            self._release(session, broken)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self._cap, thread_name_prefix="gpuport function")
        return self._executor

    def spawn(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start a call and return at once; the Future's ``result()`` is the call's result (or raises)."""
        return self._pool().submit(self, *args, **kwargs)

    def map(self, iterable: Iterable[Any], *iterables: Iterable[Any]) -> list[Any]:
        """``[f(*xs) for xs in zip(iterable, *iterables)]``, the calls run in parallel workers."""
        return list(self._pool().map(self, iterable, *iterables))

    def close(self) -> None:
        """End the function's workers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._finalizer()

    @staticmethod
    def _close_all(idle: list[Session]) -> None:
        while idle:
            with contextlib.suppress(Exception):
                idle.pop().close()

    def __repr__(self) -> str:
        return f"<RemoteFunction {getattr(self._function, '__qualname__', self._function)!r}>"
