"""The `gpuport` command run as a person runs it: on a pseudo-terminal, or with its output piped.

On a terminal, stdin, stdout and stderr are all the terminal, which is the command's controlling
terminal (so Ctrl-C typed there is SIGINT to its process group), of a given size, with
TERM=xterm-256color and no COLUMNS or LINES to say otherwise. What it wrote comes back as one text,
with the terminal's "\\r\\n" made "\\n" again; ``raw`` keeps rich's control sequences (a progress
bar's drawing), ``text`` drops them. Piped, stdout and stderr go to one pipe, and Ctrl-C is the
SIGINT a terminal would send.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import final

# Run in the child before the CLI: let Ctrl-C raise KeyboardInterrupt (a test run in the background
# inherits SIGINT ignored, and exec keeps that); on a terminal, first take the terminal on stdin as
# the controlling one (the child leads a new session, so the terminal's foreground group becomes its own).
_LAUNCH = (
    "import fcntl, os, signal, sys, termios\n"
    "if sys.argv[1] == 'terminal': fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


@final
class Command:
    """``gpuport ARGS...`` started with ``stdio`` "piped" or "terminal" (one of ``columns`` x ``rows``);
    with ``python``, ``python PYTHON ARGS...`` instead (e.g. ``("-c", code)``)."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None = None,
        stdio: str = "piped",
        columns: int = 100,
        rows: int = 30,
        python: Sequence[str] = ("-m", "gpuport"),
    ) -> None:
        if stdio not in ("piped", "terminal"):
            raise ValueError(f"stdio {stdio!r}: give 'piped' or 'terminal'")
        self.stdio = stdio
        full_env = dict(env)
        if stdio == "terminal":
            end, writer = os.openpty()
            fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
            full_env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
            full_env["TERM"] = "xterm-256color"
            stdin: int = writer
        else:
            end, writer = os.pipe()
            stdin = subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, stdio, *python, *args],
                stdin=stdin,
                stdout=writer,
                stderr=writer,
                cwd=cwd,
                env=full_env,
                start_new_session=True,
            )
        except BaseException:
            os.close(end)
            raise
        finally:
            os.close(writer)  # the child's copies alone hold it open: reading ends when it exits
        self._end = end  # ours: the terminal's master side, or the pipe's reading end
        self._raw = bytearray()

    @property
    def raw(self) -> str:
        """All it has written so far, control sequences included, with "\\r\\n" as "\\n"."""
        return self._raw.decode(errors="replace").replace("\r\n", "\n")

    @property
    def text(self) -> str:
        """What it has written so far, without control sequences and carriage returns."""
        return _CONTROL.sub("", self.raw)

    def ctrl_c(self) -> None:
        """Press Ctrl-C: typed on the terminal, or (piped) the SIGINT a terminal would send."""
        if self.stdio == "terminal":
            os.write(self._end, b"\x03")
        else:
            self.process.send_signal(signal.SIGINT)

    def read_until(self, text: str, timeout: float = 60.0) -> None:
        """Read what it writes until ``text`` has appeared in ``text``; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while text not in self.text:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{text!r} not written within {timeout:g} s ({self.stdio}):\n{self.raw}")

    def wait(self, timeout: float = 120.0) -> int:
        """Read everything it writes until it exits; its exit status."""
        deadline = time.monotonic() + timeout
        while self._read(max(0.0, deadline - time.monotonic())):
            pass
        try:
            return self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the command did not end within {timeout:g} s ({self.stdio}):\n{self.raw}") from None

    def close(self) -> None:
        """Kill the command (and its group) if it still runs; close our end."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        os.close(self._end)

    def _read(self, timeout: float) -> bool:
        """Read what is there within ``timeout`` s; False once nothing more will come (or time is up)."""
        ready, _, _ = select.select([self._end], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self._end, 65536)
        except OSError as e:  # EIO: a terminal whose other side every process has closed
            if e.errno != errno.EIO:
                raise
            return False
        self._raw += data
        return bool(data)

    def __enter__(self) -> Command:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drew_progress(raw: str, verb: str) -> bool:
    """Whether output ``raw`` holds a progress bar saying ``verb``: the word, and the bar's line "━"."""
    return f"{verb} " in raw and "\u2501" in raw


def run_on_terminal(
    args: Sequence[str], env: Mapping[str, str], cwd: Path | None = None, timeout: float = 120.0
) -> tuple[int, str, str]:
    """Run ``gpuport ARGS...`` on a new 100x30 terminal to its end: (exit status, text, raw output)."""
    with Command(args, env, cwd, "terminal") as command:
        code = command.wait(timeout)
        return code, command.text, command.raw
