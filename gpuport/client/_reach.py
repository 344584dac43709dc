"""A running job reached from here, by its owner: a port it listens on (``Forward``), a command in
its sandbox (``run_command``). Both go through the server's data port with a ticket from
``Jobs.Reach``; the server's side is ``server/api/reach.py`` and ``server/executors/reach.py``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol import reach
from gpuport.protocol.errors import (
    AuthenticationError,
    Conflict,
    ConnectionFailed,
    GpuportError,
    NotFound,
    PermissionDenied,
)
from gpuport.protocol.relay import relay

if TYPE_CHECKING:
    from gpuport.client._jobs import Job
    from gpuport.client._transport import Transport

# Seconds a forward's spare (a data-port connection made ahead, its ticket taken: see the data
# port's doc) is kept for its use; then it is made again. The server waits 120 s for its use.
_SPARE_FOR = 60.0
# Spares a forward keeps: connections that come one after another faster than a spare is made (a
# TLS handshake and the server's socket into the job: about 5 ms on a loaded 2-core VM) find one.
# Each holds a thread on the server and counts among its user's channels (64).
_SPARES = 3
# Seconds after a connection took a spare that the next one is made at the latest. It is made as soon
# as that connection's first answer came back: made at once, its TLS handshake (here and on the
# server) and the server's sockets into the job would take the CPUs while that connection waits for
# its answer (3-4 ms of a fresh connection's 7 on a loaded 2-core VM). With no spare left, at once.
_REFILL_AFTER = 0.05
# Threads waiting in ``accept`` that a forward keeps beyond those relaying: a new connection is
# taken by one already waiting (none is started on its way), and the next is started only when the
# last one waiting took a connection.
_ACCEPTING = 2
_STALE_TICKET = "unknown, used or expired"  # the data port's words for a ticket it does not hold


def _open(transport: Transport, request: pb.ReachRequest) -> tuple[socket.socket, bytes]:
    """A data-port connection and a ``Jobs.Reach`` ticket line for ``request``, not yet sent: the
    server does what it is for once it comes."""
    ticket, conn = transport.data_connection(request, transport.jobs.Reach)
    if conn is None:
        raise ConnectionFailed("the server's data port cannot be reached: forwards and `gpuport exec` need it")
    return conn, ticket.ticket.encode() + b"\n"


def _answer(conn: socket.socket, expected: bytes, what: str) -> None:
    """Read the server's one-byte answer; raise with its reason when it is not ``expected``."""
    answer = conn.recv(1)
    if answer != expected:
        said = (answer + conn.recv(2000)).decode(errors="replace")[1:].strip() if answer else "it closed the connection"
        conn.close()
        error = NotFound if said.startswith("nothing in job") else ConnectionFailed
        raise error(f"{what}: {said}" if error is ConnectionFailed else said)


def _sent_already(conn: socket.socket) -> bytes:
    """What ``conn``'s peer has sent so far (b"" when nothing, or when it closed), without waiting:
    a protocol whose server speaks first has sent nothing."""
    conn.setblocking(False)
    try:
        return conn.recv(65536)
    except BlockingIOError:
        return b""
    finally:
        conn.setblocking(True)


class Forward:
    """TCP port ``port`` of running job ``job`` (its own loopback, inside its sandbox), reachable on
    this machine at 127.0.0.1:``local_port``. Each connection there is one to the job's port, through
    the server's data port; many at once. It closes when the job ends, when the token is revoked, or
    with ``close()`` (or the end of a ``with`` block). Made by ``Job.forward``.

    One ticket (``Jobs.Reach``) serves all its connections, and data-port connections are kept ready
    ahead (spares: TLS shaken hands, ticket taken, the server's socket into the job made), so a new
    connection costs one byte to the server and its connect to the job's port; the spare it took is
    made again once its first answer came back, out of its way.

    >>> with job.forward(6006) as tensorboard:
    ...     print(f"http://127.0.0.1:{tensorboard.local_port}")
    ...     tensorboard.wait()   # until the job ends
    """

    def __init__(self, transport: Transport, job: Job | str, port: int, local_port: int = 0) -> None:
        from gpuport.client._jobs import Job, JobInfo

        self._transport = transport
        self.port = port
        self._request = pb.ReachRequest(job_id=job if isinstance(job, str) else job.id, port=port)
        self._lock = threading.Lock()
        self._spares: list[tuple[socket.socket, float]] = []  # made ahead, each with when
        self._spare_wanted = threading.Event()
        self._refill_at = 0.0  # when the spares missing are made at the latest (inf: none owed; 0: now)
        self._accepting = 0  # threads waiting in accept
        self._conns: set[socket.socket] = set()
        self._closed = threading.Event()  # closing: the threads stop
        self._shut = threading.Event()  # closed: nothing listens any more
        self.why = ""  # why it closed, once it has
        # The checks at once (the job is the caller's, running, reachable here), and the first spare.
        self._renew()
        self._spares.append((self._ready(), time.monotonic()))
        if isinstance(job, str):
            try:
                reply = transport.call(transport.jobs.Get, pb.JobRef(job_id=job))
            except BaseException:
                self._drop_spares()
                raise
            job = Job(transport, JobInfo._from_message(reply))
        self.job = job
        self._listener = socket.socket()
        try:
            self._listener.bind(("127.0.0.1", local_port))
        except OSError as e:
            self._listener.close()
            self._drop_spares()
            raise ConnectionFailed(f"cannot listen on 127.0.0.1:{local_port}: {e.strerror} — pick another") from None
        self._listener.listen(64)
        self.local_port: int = self._listener.getsockname()[1]
        for target, name in ((self._watch, "watch"), (self._keep_spare, "spare")):
            threading.Thread(target=target, name=f"gpuport forward {name}", daemon=True).start()
        for _ in range(_ACCEPTING):
            self._start_accepting()

    def _renew(self) -> tuple[bytes, int]:
        """A ticket for the forward's connections, and the data port to present it on."""
        ticket = self._transport.call(self._transport.jobs.Reach, self._request)
        self._ticket: tuple[bytes, int] = (ticket.ticket.encode() + b"\n", ticket.port)
        return self._ticket

    def _ready(self) -> socket.socket:
        """A spare: a data-port connection whose ticket the server took, ready for ``G``; with a new
        ticket when the server no longer holds the one it had (it restarted, or it was unused for 10 min)."""
        try:
            return self._present()
        except ConnectionFailed as e:
            if _STALE_TICKET not in str(e):
                raise
        self._renew()
        return self._present()

    def _present(self) -> socket.socket:
        line, data_port = self._ticket
        conn = self._transport.connect_data_port(data_port)
        if conn is None:
            raise ConnectionFailed("the server's data port cannot be reached: forwards and `gpuport exec` need it")
        try:
            conn.sendall(line)
        except BaseException:
            conn.close()
            raise
        _answer(conn, b"R", f"the server refused the forward to port {self.port}")  # closes it when refused
        return conn

    def _take_spare(self) -> socket.socket:
        """A spare for a new connection: one made ahead while fresh and open, else a new one. The
        one taken is made again when its connection's first answer came back (``_replied``), at
        the latest ``_REFILL_AFTER`` from now; at once when none is left."""
        while True:
            with self._lock:
                spare = self._spares.pop(0) if self._spares else None
                self._refill_at = min(self._refill_at, time.monotonic() + _REFILL_AFTER)
                left = len(self._spares)
            if not left:
                self._spare_wanted.set()
            if spare is None:
                return self._ready()
            conn, made = spare
            # Readable: the server closed it (a spare is sent nothing before its G).
            if time.monotonic() - made < _SPARE_FOR and not select.select([conn], [], [], 0)[0]:
                return conn
            conn.close()

    def _replied(self) -> None:
        """A connection's first answer came back: the spares taken may be made again now."""
        if self._refill_at != math.inf:
            self._refill_at = 0.0
            self._spare_wanted.set()

    def _keep_spare(self) -> None:
        """Keep ``_SPARES`` spares ready: new ones after each use (see ``_take_spare``), and before
        the server would drop those kept; after a failure, at the next use."""
        while not self._closed.is_set():
            now = time.monotonic()
            with self._lock:
                stale = [s for s in self._spares if now - s[1] >= _SPARE_FOR]
                self._spares = [s for s in self._spares if now - s[1] < _SPARE_FOR]
                if stale:
                    self._refill_at = 0.0  # made again now: no connection took them, none is in the way
                short = len(self._spares) < _SPARES
                if not short:
                    self._refill_at = math.inf
                wanted = short and (now >= self._refill_at or not self._spares)
                renew_at = min((s[1] for s in self._spares), default=now) + _SPARE_FOR
                if short:
                    renew_at = min(renew_at, self._refill_at)
            for conn, _ in stale:
                conn.close()
            if wanted:
                try:
                    conn = self._ready()
                except (GpuportError, OSError) as e:
                    if self._ended(e):
                        return
                    renew_at = math.inf  # the next connection asks for its own, and says why it cannot
                else:
                    with self._lock:
                        if not self._closed.is_set():
                            self._spares.append((conn, time.monotonic()))
                            continue
                    conn.close()  # closed meanwhile
                    return
            self._spare_wanted.wait(None if renew_at == math.inf else max(renew_at - time.monotonic(), 0.1))
            self._spare_wanted.clear()

    def _ended(self, error: BaseException) -> bool:
        """After a spare could not be made (``error``): close the forward when its token was revoked
        or its job is no longer the caller's running job (a new ticket says which), and say True."""
        if not isinstance(error, AuthenticationError):
            try:
                self._renew()
                return False
            except (AuthenticationError, Conflict, NotFound, PermissionDenied) as e:
                error = e
            except ValueError:  # grpc's "closed channel": the client was closed under the forward
                error = ConnectionFailed("its client was closed")
            except (GpuportError, OSError):
                return False
        self.close(str(error))
        return True

    def _drop_spares(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, []
        for conn, _ in spares:
            conn.close()

    def _start_accepting(self) -> None:
        with self._lock:
            self._accepting += 1
        threading.Thread(target=self._accept, name="gpuport forward", daemon=True).start()

    def _accept(self) -> None:
        """Take a connection, relay it, then wait for the next, while ``_ACCEPTING`` others wait
        (or more): a new connection is taken by a thread already waiting. When the last one waiting
        takes one, it starts another first; a thread that finds enough others waiting ends."""
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._accepting -= 1
                last = not self._accepting
            if last:
                self._start_accepting()
            self._relay(conn)
            with self._lock:
                if self._accepting >= _ACCEPTING:
                    return
                self._accepting += 1

    def _relay(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            try:
                remote = self._take_spare()
                # The server connects to the job's port on G; what the connection sent already
                # (an HTTP request, most often) goes in the same TLS record, so that the server
                # relays it at once, not after another wake-up.
                remote.sendall(b"G" + _sent_already(conn))
            except AuthenticationError as e:
                self.close(str(e))
                return
            except (GpuportError, OSError):
                return  # this connection is refused; the forward stays for the next
            with self._lock:
                self._conns.add(remote)
            relay(conn, remote, replied=self._replied)
            with contextlib.suppress(OSError):
                remote.close()
            with self._lock:
                self._conns.discard(remote)
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _watch(self) -> None:
        """Close the forward when the job ends (or the token is revoked: its wait fails)."""
        try:
            self.job.wait()
            self.close(f"job {self.job.id} ended ({self.job.info.state})")
        except GpuportError as e:
            self.close(str(e))
        except ValueError:  # grpc's "closed channel"
            self.close("its client was closed")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the forward has closed (True), or ``timeout`` seconds have passed (False)."""
        return self._shut.wait(timeout)

    @property
    def closed(self) -> bool:
        return self._shut.is_set()

    def close(self, why: str = "closed") -> None:
        """Stop listening and end every connection through it."""
        with self._lock:
            if self._closed.is_set():
                return
            self.why = why
            self._closed.set()
            conns, self._conns = self._conns, set()
        self._spare_wanted.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; a close alone would not
        self._listener.close()
        self._drop_spares()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._shut.set()  # only now: whoever waited may connect here next and must be refused

    def __enter__(self) -> Forward:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpuport.Forward 127.0.0.1:{self.local_port} -> {self.job.id}:{self.port}>"


@dataclass(frozen=True)
class CommandResult:
    """What a command run in a job (``Job.exec``) gave: its exit code (negative: the signal that
    killed it), and its stdout and stderr."""

    exit_code: int
    stdout: bytes
    stderr: bytes


def run_command(
    transport: Transport,
    job_ref: str,
    argv: list[str],
    *,
    tty: bool = False,
    stdin: int | bytes = b"",
    on_stdout: Callable[[bytes], object],
    on_stderr: Callable[[bytes], object],
    window: Callable[[], tuple[int, int]] | None = None,
    wake: int = -1,
) -> int:
    """Run ``argv`` in running job ``job_ref`` (see ``Job.exec``); return its exit code. ``stdin`` is
    a file descriptor to read (until its end) or bytes; ``window()`` gives the terminal's size, read
    again each time ``wake`` (an fd, as a SIGWINCH handler's wakeup fd) is readable."""
    conn, ticket = _open(transport, pb.ReachRequest(job_id=job_ref, exec=True))
    rows, cols = window() if window is not None else (0, 0)
    request = {"argv": argv, "tty": tty, "rows": rows, "cols": cols, "term": os.environ.get("TERM", "")}
    try:
        conn.sendall(ticket + json.dumps(request).encode() + b"\n")
        _answer(conn, b"X", "the command could not start")
        if isinstance(stdin, bytes):
            conn.sendall(reach.frame(reach.STDIN, stdin) + reach.frame(reach.STDIN_END))
            stdin = -1
        return _pump(conn, stdin, on_stdout, on_stderr, window, wake)
    finally:
        with contextlib.suppress(OSError):
            conn.close()


def _pump(
    conn: socket.socket,
    stdin: int,
    on_stdout: Callable[[bytes], object],
    on_stderr: Callable[[bytes], object],
    window: Callable[[], tuple[int, int]] | None,
    wake: int,
) -> int:
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    for fd in (stdin, wake):
        if fd >= 0:
            poller.register(fd, select.POLLIN)
    inbox = bytearray()
    while True:
        tls_ready = isinstance(conn, ssl.SSLSocket) and conn.pending()
        ready = dict(poller.poll(0 if tls_ready else None))
        if tls_ready:
            ready[conn.fileno()] = select.POLLIN
        if ready.pop(conn.fileno(), 0):
            data = conn.recv(1 << 16)
            if not data:
                raise ConnectionFailed("the server closed the command's connection before it ended")
            inbox += data
            while len(inbox) >= reach.HEAD.size:
                kind, size = reach.HEAD.unpack_from(inbox)
                if len(inbox) < reach.HEAD.size + size:
                    break
                body = bytes(inbox[reach.HEAD.size : reach.HEAD.size + size])
                del inbox[: reach.HEAD.size + size]
                if kind == reach.STDOUT:
                    on_stdout(body)
                elif kind == reach.STDERR:
                    on_stderr(body)
                elif kind == reach.EXITED:
                    return int(reach.EXIT.unpack(body)[0])
        if stdin >= 0 and ready.pop(stdin, 0):
            data = os.read(stdin, 1 << 16)
            conn.sendall(reach.frame(reach.STDIN if data else reach.STDIN_END, data))
            if not data:
                poller.unregister(stdin)
                stdin = -1
        if wake >= 0 and ready.pop(wake, 0):
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 512)
            if window is not None:
                conn.sendall(reach.frame(reach.WINDOW_SIZE, reach.WINDOW.pack(*window())))
