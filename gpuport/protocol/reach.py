"""How a command run in a job (``gpuport exec``) talks over the data port, both ends' framing.

After its ticket (a ``Jobs.Reach`` one with ``exec``), the client sends one JSON line, ``{"argv":
[...], "tty": bool, "rows": N, "cols": N, "term": "xterm"}``; the server answers ``X`` once the
command runs (or ``E``, why, and a newline). From then on both ways carry frames: a kind byte and
a 4-byte little-endian length, then that many bytes.

client → server: ``i`` bytes for its stdin, ``e`` its stdin ended, ``w`` a window size (rows and
columns, 2 bytes each, little-endian). server → client: ``o`` its stdout (with a terminal, all of
its output), ``r`` its stderr, ``x`` its exit code (4 bytes, signed: negative for a signal), last.

A forward (``Jobs.Reach`` with a port) needs no framing: the server answers ``R`` once it is ready
(a connection made ahead, a spare), the client sends ``G`` when a connection of its own takes it, the
server then connects to the job's port, and the bytes go through as they are (see ``relay``).
"""

from __future__ import annotations

import struct

HEAD = struct.Struct("<cI")  # kind, length
WINDOW = struct.Struct("<HH")  # rows, columns
EXIT = struct.Struct("<i")
MAX_LINE = 1 << 20  # bytes of the request line, at most
MAX_FRAME = 1 << 20  # bytes of a frame's body, at most

STDIN, STDIN_END, WINDOW_SIZE = b"i", b"e", b"w"
STDOUT, STDERR, EXITED = b"o", b"r", b"x"


def frame(kind: bytes, data: bytes = b"") -> bytes:
    return HEAD.pack(kind, len(data)) + data
