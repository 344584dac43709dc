"""Runs first in every Python process of a job: the job's PYTHONPATH starts with this folder.

Output: a job's stdout goes to a file, where Python would buffer it in blocks and a user would see
nothing for minutes; unbuffered, every print() costs two system calls and a busy job slows down
threefold. So stdout stays block-buffered for speed and is kept live and in order instead: a
thread flushes it every 50 ms, and whatever is written to stderr flushes stdout first. A job that
sets PYTHONUNBUFFERED keeps Python's own behaviour.

GPU memory: a job that holds a slice of a GPU (GPUPORT_GPU_MEMORY, GPUPORT_GPU_MEMORY_FRACTION) has
each deep-learning framework held to it, TensorFlow and PyTorch by a hook that runs when the job
imports them, JAX and CuPy by their own environment variables (see _gpuport_caps). What was capped
is in `caps`: `import sitecustomize; sitecustomize.caps`.

Standard library only, and nothing imported that the job does not import itself. Afterwards the
sitecustomize this module shadows, if any, runs as it would have.
"""

import atexit
import os
import sys
import threading

# Imported while this folder is still on sys.path (_chain takes it off); the _gpuport_ prefix keeps
# it from hiding a module of the job's.
import _gpuport_caps

caps = _gpuport_caps.caps  # what was capped: `import sitecustomize; sitecustomize.caps`

_FLUSH_EVERY = 0.05  # seconds


class _StderrFlushingStdout:
    """sys.stderr, flushing sys.stdout before each write so that the log keeps the order of the calls."""

    def __init__(self, stream, stdout):
        self._stream = stream
        self._stdout = stdout

    def write(self, text):
        self._stdout.flush()
        return self._stream.write(text)

    def writelines(self, lines):
        self._stdout.flush()
        return self._stream.writelines(lines)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _start_flusher(stdout):
    stop = threading.Event()

    def run():
        while not stop.wait(_FLUSH_EVERY):
            try:
                stdout.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to keep live
                return

    thread = threading.Thread(target=run, name="gpuport-stdout-flush", daemon=True)
    thread.start()

    def finish():
        # Stopped before the interpreter finalizes: a daemon thread caught inside flush() then
        # would abort the process ("could not acquire lock for <stdout>").
        stop.set()
        thread.join(1.0)

    atexit.register(finish)


def _live_output():
    stdout, stderr = sys.stdout, sys.stderr
    if os.environ.get("PYTHONUNBUFFERED") or stdout is None or stderr is None or stdout.isatty():
        return
    try:
        stdout.reconfigure(line_buffering=False, write_through=False)
    except (AttributeError, ValueError):
        return
    sys.stderr = _StderrFlushingStdout(stderr, stdout)
    _start_flusher(stdout)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=lambda: _start_flusher(sys.stdout))


def _chain():
    """Drop this folder from sys.path and run the sitecustomize it hid, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None:
        from importlib.util import module_from_spec

        module = module_from_spec(spec)
        spec.loader.exec_module(module)


_live_output()
_gpuport_caps.install()  # before _chain: a framework the shadowed sitecustomize imports is capped too
_chain()
