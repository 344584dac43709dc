"""The `gpuport` command's entry point, and the helper process that makes its commands start fast.

Most of a command's time is Python importing gRPC, protobuf, click and rich (about 100 ms on a
small VM) before it says a word to the server. So the commands that only talk to the server
(``FAST``, and ``exec`` where it does not take the terminal: ``_on_terminal``) are run by a
helper: a process of the same user that imported all of that once and forks a child per command. The child takes the command's terminal (its stdin, stdout and stderr,
passed over a Unix socket), working folder, environment and umask, runs the command as the CLI
would, and reports its exit status; Ctrl-C and termination are passed on to it. What runs is the
same code on the same inputs: only the imports are done ahead.

On Linux only (elsewhere every command runs in its own process, as with ``GPUPORT_AGENT=0``).
The helper is started by the first such command (which runs as usual meanwhile) and exits after
``GPUPORT_AGENT_IDLE`` seconds (600) without a command, or when the code it loaded is no longer
the installed code. Its socket lives in a folder only its user can open, and it is one per Python,
gpuport install, network namespace and root filesystem: a command never runs in another one's world.
``GPUPORT_AGENT=0`` runs every command in its own process.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing's constant, without importing typing: every command loads this module
if TYPE_CHECKING:
    import socket

FAST = frozenset({"status", "jobs", "queue", "gpus", "push", "logs", "run"})
ENV_AGENT = "GPUPORT_AGENT"
ENV_IDLE = "GPUPORT_AGENT_IDLE"
_IDLE_DEFAULT = 600.0
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../gpuport


def main() -> None:
    """The `gpuport` command: through the helper when the command is one of ``FAST`` (or help
    for one of them, or for all), else here; ``--version`` alone is answered without click."""
    args = sys.argv[1:]
    if args == ["--version"]:  # click's own words, without loading click: half of this command's time
        from gpuport._version import __version__

        print(f"gpuport, version {__version__}")
        return
    command = next((a for a in args if not a.startswith("-")), "")
    wanted = os.environ.get(ENV_AGENT, "1") != "0" and sys.platform.startswith("linux")
    # Help is click's to write, and the helper has click loaded: `gpuport --help` and a fast
    # command's --help are written there too.
    if wanted and (
        command in FAST or (command == "exec" and not _on_terminal(args)) or (not command and "--help" in args)
    ):
        code = _through_helper(args)
        if code is not None:
            sys.stderr.flush()
            os._exit(code)  # nothing of this process's own to tear down: its command ran in the helper
    from gpuport.cli.main import main as run_here

    run_here()


# ---- the command's side ---------------------------------------------------------------------------


def _on_terminal(args: list[str]) -> bool:
    """Whether `gpuport exec` (its options in ``args``, before its JOB) takes this terminal as its
    own: with -t (raw mode, window sizes) or with -i and a terminal for stdin. Those run here: the
    helper's child is not in the terminal's foreground process group, and one that sets a terminal's
    mode or reads from it is stopped (SIGTTOU, SIGTTIN). Without them it only writes, as ``FAST``
    commands do, and reads a piped stdin."""
    interactive = False
    for arg in args[args.index("exec") + 1 :]:
        if not arg.startswith("-") or arg == "--":
            break  # JOB, or the end of the options
        short = arg[1:] if not arg.startswith("--") else ""
        if arg == "--tty" or "t" in short:
            return True
        interactive |= arg == "--interactive" or "i" in short
    return interactive and os.isatty(0)


def socket_path() -> str | None:
    """Where this user's helper for this Python, install and namespaces listens (None: no private
    folder can be had for it)."""
    import zlib

    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    folder = os.path.join(base, f"gpuport-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(folder) or os.path.islink(folder):
        return None  # not ours alone: no helper
    python = os.path.realpath(sys.executable)  # python and python3 of one venv are one Python
    parts = [python, sys.prefix, _PACKAGE, os.environ.get("PYTHONPATH", ""), str(_code_mtime())]
    try:
        parts.append(os.readlink("/proc/self/ns/net"))
    except OSError:
        pass
    root = os.stat("/")  # the filesystem it sees (not the mount namespace: `ip netns exec` makes a new one)
    parts.append(f"{root.st_dev}:{root.st_ino}")
    key = format(zlib.crc32("\0".join(parts).encode()), "08x")
    return os.path.join(folder, f"agent-{key}.sock")


def _code_mtime() -> int:
    """The newest modification time of the code a command runs: a helper that loaded older code is
    not used."""
    newest = 0
    for sub in ("", "cli", "client", "protocol"):
        try:
            with os.scandir(os.path.join(_PACKAGE, sub)) as entries:
                for entry in entries:
                    if entry.name.endswith(".py"):
                        newest = max(newest, entry.stat().st_mtime_ns)
        except OSError:
            pass
    return newest


def _through_helper(args: list[str]) -> int | None:
    """Run the command in the helper; its exit status, or None when there is no helper (one is
    started for the next command) and the command must run here."""
    import json
    import signal
    import socket

    path = socket_path()
    if path is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = {"argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask()}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reader = conn.makefile("rb")
        started = reader.readline()
    except OSError:
        conn.close()
        _start_helper(path)
        return None
    if not started:
        conn.close()
        return None  # the helper could not start it: nothing ran
    said = json.loads(started)
    if "exit" in said:  # it could not become the command (its folder is gone, say), and said why
        conn.close()
        return int(said["exit"])
    pid = said["pid"]

    def pass_on(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, pass_on)
    line = reader.readline()  # a signal passed on meanwhile does not interrupt the wait (PEP 475)
    conn.close()
    if not line:
        print("gpuport: the command ended without an exit status (killed?)", file=sys.stderr)
        return 1
    return int(json.loads(line)["exit"])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _start_helper(path: str) -> None:
    """Start the helper in the background, in a session of its own (no terminal: its commands get
    theirs), its stdio on /dev/null; not waited for (it outlives this command)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(_PACKAGE), env.get("PYTHONPATH")) if p)
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    try:
        os.posix_spawn(
            sys.executable, [sys.executable, "-m", "gpuport.cli._agent", path], env, file_actions=quiet, setsid=True
        )
    except (OSError, NotImplementedError):
        pass  # no helper: every command runs on its own, as with GPUPORT_AGENT=0


# ---- the helper's side ----------------------------------------------------------------------------


def serve(path: str) -> None:
    """Listen at ``path`` and run each command in a forked child, until idle for ``GPUPORT_AGENT_IDLE``
    seconds or another helper (or nobody) owns ``path``."""
    import fcntl
    import socket
    import time

    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another helper is starting or running
    os.ftruncate(lock, 0)
    os.write(lock, str(os.getpid()).encode())
    _preload()
    try:
        idle = float(os.environ.get(ENV_IDLE) or _IDLE_DEFAULT)
    except ValueError:
        idle = _IDLE_DEFAULT
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    mine = os.stat(path).st_ino
    children: set[int] = set()
    last = time.monotonic()
    try:
        while True:
            for pid in list(children):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.discard(pid)
                    last = time.monotonic()
            try:
                if os.stat(path).st_ino != mine:
                    return  # another helper took the path
            except FileNotFoundError:
                return
            if not children and time.monotonic() - last > idle:
                return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            last = time.monotonic()
            with conn:
                child = _fork_command(conn, listener)
            if child:
                children.add(child)
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == mine:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _preload() -> None:
    """Import what the fast commands use, so that their children start with it loaded (those a
    command would otherwise import on first use included: a child's imports are lost with it)."""
    import queue  # noqa: F401
    import shutil  # noqa: F401
    import ssl  # noqa: F401
    import tempfile  # noqa: F401

    import grpc._channel  # noqa: F401
    import platformdirs  # noqa: F401
    import rich._emoji_codes  # noqa: F401
    import rich.console  # noqa: F401
    import rich.table  # noqa: F401

    import gpuport.cli._jobs  # noqa: F401
    import gpuport.cli.main  # noqa: F401
    import gpuport.client._client  # noqa: F401
    import gpuport.client._jobs  # noqa: F401
    import gpuport.client._reach  # noqa: F401
    import gpuport.client._sync  # noqa: F401

    "localhost".encode("idna")  # a host name's first encoding loads its codec


def _fork_command(conn: socket.socket, listener: socket.socket) -> int:
    """Read one command from ``conn`` and fork its child; the child's pid (0: none started)."""
    import json
    import socket

    conn.settimeout(5)
    try:
        if hasattr(socket, "SO_PEERCRED"):
            import struct

            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                return 0
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                return 0
            data += more
        request = json.loads(data)
    except (OSError, ValueError):
        return 0
    try:
        if len(fds) != 3:
            return 0
        pid = os.fork()
        if pid == 0:
            listener.close()
            _run_child(conn, fds, request)  # never returns
        return pid
    finally:
        for fd in fds:
            os.close(fd)


def _run_child(conn: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked child: become the command (its terminal, folder, environment), run it, report."""
    import io
    import json
    import signal
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # signals for the helper's group are not the command's
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.umask(int(request["umask"]))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        encoding = os.environ.get("PYTHONIOENCODING", "").split(":")[0] or "utf-8"

        def stream(fd: int, mode: str, errors: str) -> io.TextIOWrapper:
            raw = io.FileIO(fd, mode, closefd=False)
            tty = raw.isatty()
            buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
            return io.TextIOWrapper(
                buffered,  # type: ignore[arg-type]
                encoding=encoding,
                errors=errors,
                line_buffering=tty or fd == 2,
                write_through=unbuffered and mode == "w",
            )

        sys.stdin = sys.__stdin__ = stream(0, "r", "strict")
        sys.stdout = sys.__stdout__ = stream(1, "w", "strict")
        sys.stderr = sys.__stderr__ = stream(2, "w", "backslashreplace")
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        sys.argv = ["gpuport", *request["argv"]]
        from gpuport.cli.main import cli

        try:
            cli.main(args=request["argv"], prog_name="gpuport")
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                code = 1
            else:
                code = int(e.code or 0)
    except BaseException:
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        try:
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except Exception:
            pass
        os._exit(code)


if __name__ == "__main__":
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # the folder of the command that started it: nothing of it is imported
    os.chdir("/")
    serve(sys.argv[1])
