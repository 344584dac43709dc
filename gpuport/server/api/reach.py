"""The data port's side of a command run in a job (``gpuport exec``; framing in ``protocol/reach.py``).

One thread per command: it reads the client's frames (stdin, its end, window sizes) and the
command's output, and writes each as it comes, so a TLS socket is never read and written at once.
The command's stdin is written without blocking (what it has not taken yet waits here), so a
command that does not read never stops its output. Once the command has exited, its output is
read to its end (for at most ``_DRAIN``: what it left running may hold it open), then its exit
code is sent. A client that goes away (or whose token is revoked: the data port shuts its
connection) takes the command with it: its terminal is hung up and its process group killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import ssl
import time
from typing import Any

from gpuport.protocol import reach
from gpuport.protocol.errors import GpuportError, InvalidRequest
from gpuport.server.executors.base import Executor
from gpuport.server.executors.reach import Command

_REQUEST_TIMEOUT = 10.0  # seconds for the request line to come, after the ticket
_DRAIN = 1.0  # seconds to read the output of a command that has exited
_READ = 1 << 16


def serve_exec(conn: socket.socket, executor: Executor, job_id: str) -> None:
    """Read the request line, start the command, and carry its streams until it has exited (see the
    module's doc). Errors before it starts are answered ``E`` and why."""
    conn.settimeout(_REQUEST_TIMEOUT)
    line, rest = _read_line(conn)
    try:
        request = _request(line)
        command = executor.run_command(job_id, **request)
    except GpuportError as e:
        conn.sendall(b"E" + str(e).encode() + b"\n")
        return
    ended = False
    try:
        conn.sendall(b"X")
        conn.settimeout(None)
        ended = _pump(conn, command, bytearray(rest))
    finally:
        if ended:
            command.close()  # what it left running stays, as after ssh
        else:
            command.stop()  # the client went away


def _read_line(conn: socket.socket) -> tuple[bytes, bytes]:
    data = bytearray()
    while b"\n" not in data:
        chunk = conn.recv(_READ)
        if not chunk:
            raise EOFError("the client closed the connection before its request")
        data += chunk
        if len(data) > reach.MAX_LINE:
            raise ValueError("a request line past its limit")
    line, _, rest = bytes(data).partition(b"\n")
    return line, rest


def _request(line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
        argv = request["argv"]
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise TypeError
        return {
            "argv": argv,
            "tty": bool(request.get("tty")),
            "term": str(request.get("term") or ""),
            "rows": int(request.get("rows") or 0) & 0xFFFF,
            "cols": int(request.get("cols") or 0) & 0xFFFF,
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidRequest("a command's request was not what `gpuport exec` sends") from None


def _pump(conn: socket.socket, command: Command, inbox: bytearray) -> bool:
    """Carry the streams until the command has exited and said so (True), or the client went away (False)."""
    process = command.process
    if command.terminal >= 0:
        outputs = {command.terminal: reach.STDOUT}
        stdin = command.terminal
    else:
        assert process.stdout is not None and process.stderr is not None and process.stdin is not None
        outputs = {process.stdout.fileno(): reach.STDOUT, process.stderr.fileno(): reach.STDERR}
        stdin = process.stdin.fileno()
    for fd in (*outputs, stdin):
        os.set_blocking(fd, False)
    exited = os.pidfd_open(process.pid)
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    poller.register(exited, select.POLLIN)
    pending = bytearray()  # for its stdin, not taken yet
    stdin_ended = False
    exited_at: float | None = None
    watched: dict[int, int] = {}
    try:
        while True:
            wanted = {fd: select.POLLIN for fd in outputs}
            if pending and stdin >= 0:
                wanted[stdin] = wanted.get(stdin, 0) | select.POLLOUT
            for fd in watched.keys() - wanted.keys():
                poller.unregister(fd)
            for fd, events in wanted.items():
                if watched.get(fd) != events:
                    poller.register(fd, events)  # registers, or changes what for
            watched = wanted
            if exited_at is not None and (not outputs or time.monotonic() - exited_at > _DRAIN):
                conn.sendall(reach.frame(reach.EXITED, reach.EXIT.pack(process.wait())))
                return True
            tls_ready = isinstance(conn, ssl.SSLSocket) and conn.pending()
            timeout = 0 if tls_ready else (100 if exited_at is not None else None)
            ready = dict(poller.poll(timeout))
            if tls_ready:
                ready[conn.fileno()] = select.POLLIN
            if ready.pop(conn.fileno(), 0):
                data = conn.recv(_READ)
                if not data:
                    return False
                inbox += data
                stdin_ended |= _take_frames(inbox, pending, command)
            if ready.pop(exited, 0) and exited_at is None:
                exited_at = time.monotonic()
                poller.unregister(exited)
            for fd, events in ready.items():
                if fd in outputs and events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    try:
                        data = os.read(fd, _READ)
                    except BlockingIOError:
                        data = None
                    except OSError:  # EIO: a terminal whose every other end has closed
                        data = b""
                    if data:
                        conn.sendall(reach.frame(outputs[fd], data))
                    elif data is not None:
                        del outputs[fd]  # unregistered at the loop's top
            if pending and stdin >= 0:
                try:
                    del pending[: os.write(stdin, pending)]
                except BlockingIOError:
                    pass
                except OSError:  # it closed its stdin: what was left for it goes
                    pending.clear()
                    stdin = _close_stdin(command, stdin)
            if stdin_ended and not pending and stdin >= 0 and command.terminal < 0:
                stdin = _close_stdin(command, stdin)
    finally:
        os.close(exited)


def _close_stdin(command: Command, stdin: int) -> int:
    if command.terminal < 0 and command.process.stdin is not None:
        with contextlib.suppress(OSError):
            command.process.stdin.close()
        return -1
    return stdin


def _take_frames(inbox: bytearray, pending: bytearray, command: Command) -> bool:
    """Act on the whole frames in ``inbox`` (and drop them from it); True when stdin's end was one."""
    ended = False
    while len(inbox) >= reach.HEAD.size:
        kind, size = reach.HEAD.unpack_from(inbox)
        if size > reach.MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes, past the limit")
        if len(inbox) < reach.HEAD.size + size:
            break
        body = bytes(inbox[reach.HEAD.size : reach.HEAD.size + size])
        del inbox[: reach.HEAD.size + size]
        if kind == reach.STDIN:
            pending += body
        elif kind == reach.STDIN_END:
            ended = True
        elif kind == reach.WINDOW_SIZE and len(body) == reach.WINDOW.size:
            command.resize(*reach.WINDOW.unpack(body))
    return ended
