"""Reaching into a running job on this machine: a TCP port on its own loopback (``gpuport forward``),
and a command run in its sandbox (``gpuport exec``).

A sandboxed job's namespaces are those of its sandbox's pid 1 (bubblewrap's child), whose host pid
its supervisor records in ``supervisor.json`` as ``init``. Before its namespaces are used, that pid
is pinned (a pidfd) and checked to be the job's: bubblewrap's child, bubblewrap the supervisor's,
and the supervisor still holding the job's lock; the namespaces are then held open as files, and
the pid checked to be alive still, so that a pid reused meanwhile never leads into another job.

- A port: sockets made in the job's network namespace (``setns`` in a thread of its own, which then
  ends), one for 127.0.0.1 and one for ::1, ahead of the connection they are for (``Dialer``): the
  namespaces' checks and the ``setns`` (about 1.3 ms on a loaded 2-core VM) are paid while the
  client's next connection is not there yet; when it comes, the job is checked to run still and
  only the ``connect`` is left. A job on the machine's network (one over several nodes) is refused:
  its ports are the machine's.
- A command: ``nsenter`` with those namespace files (mount, UTS, IPC, network, cgroup, pid: it forks
  into the pid namespace), the sandbox's root and working directory; ``setpriv`` takes the job's
  uid and group and drops every capability; ``env -i`` sets the job's environment (after the uid
  change: a job's LD_PRELOAD never runs as root) and ``/bin/sh`` goes to the job's workdir, as the
  job's uid, then ``exec``s the command. Before all that, the first process moves itself into the
  job's cgroups (its owner's cpu group too, on v1): the command is held to the job's limits, and a
  job's end (its pid namespace gone, its groups emptied) kills it. With ``tty``, it runs on a new
  pseudo-terminal, as the leader of a session whose controlling terminal that is (``setsid -c``).

Nothing the job can write is opened as root by path: the job's folder's ``supervisor.json`` and
``spec.marshal`` are the server's, the rest comes through ``/proc``. Without a sandbox (a
``--no-sandbox`` server) a command runs as the server's user, in the job's workdir with its
environment, and a port is the machine's own loopback's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import marshal
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import termios
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuport.protocol.errors import Conflict, InvalidRequest, NotFound

_CLONE_NEWNET = 0x40000000
_CONNECT_TIMEOUT = 10.0  # seconds for a connection to a job's port
_FAMILIES = (socket.AF_INET, socket.AF_INET6)  # a port's loopback addresses, tried in this order
# The namespaces a command enters, as /proc/PID/ns names them and as nsenter's options.
_NAMESPACES = (("mnt", "mount"), ("uts", "uts"), ("ipc", "ipc"), ("net", "net"), ("cgroup", "cgroup"), ("pid", "pid"))
# The first process's own: into each of the job's cgroups ("$1": how many), then the command.
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1/cgroup.procs" || exit 125; n=$((n - 1)); shift; done; exec "$@"'
# As the job's uid: to its workdir (or the sandbox's root, where that is gone), then the command.
_TO_WORKDIR = 'cd -- "$0" 2>/dev/null || cd /; exec "$@"'
_JOIN_FAILED = 125  # _JOIN's code when the job's groups are gone: the job has ended


def _program(name: str) -> str:
    found = shutil.which(name, path=os.defpath)
    if found is None:
        raise InvalidRequest(f"`{name}` is not installed on the server (util-linux, coreutils): ask its admin")
    return found


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class Namespaces:
    """A running sandbox's namespaces (``/proc/PID/ns`` name → an open fd) and its root folder, held open."""

    fds: dict[str, int] = field(default_factory=dict)
    root: int = -1

    def close(self) -> None:
        for fd in [*self.fds.values(), self.root]:
            if fd >= 0:
                os.close(fd)
        self.fds.clear()
        self.root = -1


def sandbox_namespaces(job_dir: Path, job_id: str, running: Any, names: tuple[str, ...]) -> Namespaces:
    """The namespaces ``names`` of job ``job_id``'s sandbox, held open (and with ``mnt``, its root);
    raises ``Conflict`` when the job is not running (any more)."""
    gone = Conflict(f"job {job_id} is not running: only a running job can be reached")
    try:
        info = json.loads((job_dir / "supervisor.json").read_text())
        init, bwrap, supervisor = int(info["init"]), int(info["child"]), int(info["pid"])
    except FileNotFoundError:
        raise gone from None
    except (OSError, ValueError, KeyError, TypeError):
        raise Conflict(
            f"job {job_id} started before this server could reach into jobs: only jobs started since can be"
        ) from None
    try:
        pidfd = os.pidfd_open(init)
    except ProcessLookupError:
        raise gone from None
    found = Namespaces()
    try:
        if _parent(init) != bwrap or _parent(bwrap) != supervisor or not running():
            raise gone
        for name in names:
            found.fds[name] = os.open(f"/proc/{init}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        if "mnt" in names:
            found.root = os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if select.select([pidfd], [], [], 0)[0]:  # it ended: those may be another process's
            raise gone
    except OSError:
        found.close()
        raise gone from None
    except BaseException:
        found.close()
        raise
    finally:
        os.close(pidfd)
    return found


def _sockets_in(netns: int) -> list[socket.socket]:
    """A TCP socket of each address family (IPv4, then IPv6 where the namespace has it) in the
    network namespace ``netns`` (a socket stays in the namespace it was made in): made by a thread
    that enters it and then ends, so no thread of the server stays there."""
    made: list[socket.socket] = []
    failed: list[OSError] = []

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(netns, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            failed.append(OSError(errno, os.strerror(errno)))
            return
        for family in _FAMILIES:
            try:
                made.append(socket.socket(family, socket.SOCK_STREAM))
            except OSError as e:  # no IPv6 there
                failed.append(e)

    thread = threading.Thread(target=make, name="gpuport forward", daemon=True)
    thread.start()
    thread.join()
    if not made:
        raise failed[0]
    return made


class Dialer:
    """Sockets made ahead in a running job's network namespace (or this machine's, without a
    sandbox) for one connection to TCP ``port`` on its loopback, made by ``connect()``; ``close()``
    lets them go unused."""

    def __init__(self, job_id: str, port: int, sockets: list[socket.socket], running: Any) -> None:
        self.job_id = job_id
        self.port = port
        self._sockets = sockets
        self._running = running

    def connect(self) -> socket.socket:
        """The connection, to 127.0.0.1 (then ::1). Raises ``Conflict`` when the job is not running
        any more, ``NotFound`` when nothing listens there."""
        if not self._running():
            raise Conflict(f"job {self.job_id} is not running: only a running job can be reached")
        refused: OSError | None = None
        while self._sockets:
            conn = self._sockets.pop(0)
            conn.settimeout(_CONNECT_TIMEOUT)
            try:
                conn.connect(("127.0.0.1" if conn.family == socket.AF_INET else "::1", self.port))
            except OSError as e:
                conn.close()
                refused = e
                continue
            conn.settimeout(None)
            return conn
        why = refused.strerror if refused is not None and refused.strerror else str(refused)
        raise NotFound(f"nothing in job {self.job_id} accepts connections on port {self.port} of its loopback ({why})")

    def close(self) -> None:
        for conn in self._sockets:
            conn.close()
        self._sockets.clear()


def dial_port(job_dir: Path, job_id: str, port: int, sandboxed: bool, running: Any) -> Dialer:
    """A ``Dialer`` for TCP ``port`` on job ``job_id``'s loopback. Raises ``Conflict`` when the job
    is not running, ``InvalidRequest`` for a job on the machine's network."""
    if not sandboxed:
        if not running():
            raise Conflict(f"job {job_id} is not running: only a running job can be reached")
        return Dialer(job_id, port, [socket.socket(family, socket.SOCK_STREAM) for family in _FAMILIES], running)
    namespaces = sandbox_namespaces(job_dir, job_id, running, ("net",))
    try:
        netns = namespaces.fds["net"]
        if os.fstat(netns).st_ino == os.stat("/proc/self/ns/net").st_ino:
            raise InvalidRequest(
                f"job {job_id} runs on the machine's own network (a job over several nodes): its ports are "
                "the machine's, not its own to forward"
            )
        return Dialer(job_id, port, _sockets_in(netns), running)
    finally:
        namespaces.close()


@dataclass
class Command:
    """A command running in a job: its process (``nsenter``'s, for a sandbox) and its ends: the
    terminal's (``terminal``, both ways) or three pipes."""

    process: subprocess.Popen[bytes]
    terminal: int = -1  # the pseudo-terminal's master end, with a terminal

    def resize(self, rows: int, cols: int) -> None:
        if self.terminal >= 0:
            _set_window(self.terminal, rows, cols)

    def stop(self) -> None:
        """Hang up its terminal, and kill what is left in its process group (its caller went away)."""
        if self.terminal >= 0:
            with contextlib.suppress(OSError):
                os.close(self.terminal)
            self.terminal = -1
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        """Close its ends, once it has exited."""
        if self.terminal >= 0:
            with contextlib.suppress(OSError):
                os.close(self.terminal)
            self.terminal = -1
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


_TIOCSPTLCK = 0x40045431  # (un)lock a pseudo-terminal's other end
_TIOCGPTPEER = 0x5441  # open a pseudo-terminal's other end, from its master


def _terminal(root: int) -> tuple[int, int]:
    """A new pseudo-terminal (master, other end): of the sandbox's own ``/dev/pts`` under ``root``
    (the sandbox's root folder, where only root writes), so that it has a name there (``tty``);
    else, or outside a sandbox, of this machine's."""
    if root >= 0:
        try:
            master = os.open("dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=root)
        except OSError:
            return os.openpty()
        try:
            fcntl.ioctl(master, _TIOCSPTLCK, struct.pack("i", 0))
            return master, fcntl.ioctl(master, _TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)
        except OSError:
            os.close(master)
    return os.openpty()


def _set_window(terminal: int, rows: int, cols: int) -> None:
    if rows and cols:
        with contextlib.suppress(OSError):
            fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def run_command(
    job_dir: Path,
    job_id: str,
    argv: list[str],
    *,
    tty: bool,
    term: str,
    rows: int,
    cols: int,
    uid: int | None,
    running: Any,
) -> Command:
    """Start ``argv`` in running job ``job_id`` (see the module's doc); ``uid``: the job's, when its
    sandbox has one. Raises ``Conflict`` when the job is not running, ``InvalidRequest`` for a
    command that cannot be run."""
    if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise InvalidRequest("give the command to run: `gpuport exec JOB -- CMD [ARGS...]`")
    try:
        spec = marshal.loads((job_dir / "spec.marshal").read_bytes())
    except (OSError, ValueError, EOFError):
        raise Conflict(f"job {job_id} is not running: only a running job can be reached") from None
    env = dict(spec["env"])
    if tty:
        env["TERM"] = term if term and term.isprintable() and len(term) < 64 else "xterm"
    groups = spec.get("cgroup") or {}
    folders = [*groups.get("dirs", ()), *([groups["cpu"]] if groups.get("cpu") else [])]
    join = ["/bin/sh", "-c", _JOIN, "gpuport-exec", str(len(folders)), *folders]
    ctty = [_program("setsid"), "--ctty"] if tty else []
    namespaces = None
    if spec.get("sandbox"):
        namespaces = sandbox_namespaces(job_dir, job_id, running, tuple(name for name, _ in _NAMESPACES))
        fd = namespaces.fds
        enter = [_program("nsenter"), *(f"--{option}=/proc/self/fd/{fd[name]}" for name, option in _NAMESPACES)]
        enter += [f"--root=/proc/self/fd/{namespaces.root}", f"--wd=/proc/self/fd/{namespaces.root}"]
        drop = [_program("setpriv")]
        if uid is not None:
            drop += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        drop += ["--inh-caps=-all", "--bounding-set=-all", "--pdeathsig=KILL", "--"]
        with_env = [_program("env"), "-i", "--", *(f"{k}={v}" for k, v in env.items())]
        command = [*join, *enter, *drop, *ctty, *with_env, "/bin/sh", "-c", _TO_WORKDIR, spec["cwd"], *argv]
        where: dict[str, Any] = {"env": {"PATH": os.defpath}, "cwd": "/", "pass_fds": [*fd.values(), namespaces.root]}
    else:
        if not running():
            raise Conflict(f"job {job_id} is not running: only a running job can be reached")
        command = [*join, *ctty, *argv]
        where = {"env": env, "cwd": spec["cwd"]}
    terminal = -1
    try:
        if tty:
            terminal, end = _terminal(namespaces.root if namespaces is not None else -1)
            ends: dict[str, Any] = {"stdin": end, "stdout": end, "stderr": end}
            _set_window(terminal, rows, cols)
        else:
            ends = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        try:
            process = subprocess.Popen(command, **ends, **where, start_new_session=True)
        except OSError as e:
            raise InvalidRequest(f"cannot start {argv[0]!r}: {e.strerror}") from None
        finally:
            if tty:
                os.close(ends["stdin"])
    except BaseException:
        if terminal >= 0:
            os.close(terminal)
        raise
    finally:
        if namespaces is not None:
            namespaces.close()
    return Command(process, terminal)
