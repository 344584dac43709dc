"""What `gpuport run` shows on a terminal while a job's environment is built: a status line with the
time it has taken ("building environment (12 packages)… 0:00:07") in place of uv's lines, replaced by
the job's own output once it starts. Piped, the log goes through as it is.

The server writes the making of an environment into the job's log between lines of its own:
``gpuport: resolving requirements.txt with uv``, then ``building environment HASH (N packages: ...)…``
(or ``waiting for environment HASH ...``, a build of another job's), up to ``environment HASH built in
...`` (or ``is built``, or ``the box's environment has every package ...``): what lies between is held,
and shown after all when the log ends inside it (a build that failed: uv's words).
"""

from __future__ import annotations

import re
from typing import Any

_OWN = b"gpuport: "  # the start of a line of the server's own in a job's log
_RESOLVING = re.compile(rb"gpuport: resolving (.+) with uv$")
_NOTHING = re.compile(rb"gpuport: the box's environment has every package")
_BUILDING = re.compile(rb"gpuport: building environment \S+ \((\d+) packages?\b")
_WAITING = re.compile(rb"gpuport: waiting for environment \S+, being built for another job")
_READY = re.compile(rb"gpuport: environment \S+ (built in|is built)")


class BuildStatus:
    """Between a job's log and a terminal: ``feed`` takes each chunk of the log and returns what to
    write now; ``end`` (the log ended) returns what was held back; ``stop`` takes the status line away.
    ``console``: the rich console (stderr's) the status line is drawn on."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.watching = True  # until the job's own output starts: then everything goes through
        self._line = b""  # a line of the log not ended yet
        self._held = bytearray()  # the build's lines, under the status line
        self._status: Any = None  # a rich Progress while a build is shown
        self._task: Any = None  # its one task

    def feed(self, data: bytes) -> bytes:
        if not self.watching:
            return data
        self._line += data
        shown = bytearray()
        while self.watching:
            line, newline, rest = self._line.partition(b"\n")
            if not newline:
                break
            self._line = rest
            shown += self._take(line + newline)
        if not self.watching:
            shown += self._line
            self._line = b""
        elif self._status is None and self._line and not _maybe_own(self._line):
            shown += self._line  # the job's output, a prompt without its line's end: at once
            self._line, self.watching = b"", False
        return bytes(shown)

    def end(self) -> bytes:
        """The log has ended: what is still held (a build that did not finish: its lines)."""
        self.stop()
        rest = bytes(self._held) + self._line
        self._held.clear()
        self._line = b""
        self.watching = False
        return rest

    def stop(self) -> None:
        """Take the status line away (from the follower's thread, or the main one's on Ctrl-C)."""
        status, self._status = self._status, None
        if status is not None:
            status.stop()

    def _take(self, line: bytes) -> bytes:
        if self._status is not None and (_READY.match(line) or _NOTHING.match(line)):
            self.stop()
            self._held.clear()
            return line
        resolving, building = _RESOLVING.match(line), _BUILDING.match(line)
        if resolving:
            self._show(f"resolving {resolving[1].decode(errors='replace')}…")
        elif building:
            count = int(building[1])
            self._show(f"building environment ({count} package{'s' if count != 1 else ''})…")
        elif _WAITING.match(line):
            self._show("waiting for the environment another job is building…")
        elif self._status is None:
            if not line.startswith(_OWN):
                self.watching = False
            return line
        self._held += line
        return b""

    def _show(self, text: str) -> None:
        """The status line says ``text`` now, with the time since it was first drawn."""
        if self._status is None:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._status = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._status.start()
            self._task = self._status.add_task(text, total=None)
        else:
            self._status.update(self._task, description=text)


def _maybe_own(start: bytes) -> bool:
    """Whether a line that starts with ``start`` may be one of the server's own."""
    return start.startswith(_OWN) or _OWN.startswith(start)
