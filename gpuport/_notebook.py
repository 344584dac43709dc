"""Notebooks: cells that run on the GPU machine, in a session, with their variables kept there.

In Jupyter (or IPython)::

    %load_ext gpuport

    %%gpuport --gpus 1
    import tensorflow as tf
    model = tf.keras.Sequential([...])     # lives in the session's worker, between cells
    model.fit(x, y, epochs=3)              # its output streams into the notebook as it comes

    %gpuport_pull history                  # a value of the session's, here
    %gpuport_push batch                    # a value of here, there
    %gpuport_pull --session other loss     # ... of another session's, without switching to it

A cell runs in a named session (``--session NAME``; by default one named after the notebook, from
Jupyter's ``JPY_SESSION_NAME``, else ``notebook``), opened on first use with the options given
(``--gpus``, ``--gpu-memory``, ``--cpus``, ``--memory``) and found again by a restarted kernel, its
variables intact; ``%gpuport_pull`` and ``%gpuport_push`` use the current session, or the one their own
``--session NAME`` gives. The cell's last expression is its result, as in a local cell. An exception shows
with its remote traceback. The server is the one ``gpuport.connect()`` finds (the saved profile, or
``GPUPORT_URL`` and ``GPUPORT_TOKEN``); ``--profile`` picks another. ``%gpuport_close [NAME]`` ends
a session and frees what it holds.
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
from pathlib import Path
from typing import Any

from gpuport.client import Client, Session, connect
from gpuport.protocol.errors import InvalidRequest, RemoteError

# The module in the worker whose namespace the cells share: it lives as long as the worker.
_NAMESPACE = "__gpuport_notebook__"


def _namespace() -> dict[str, Any]:
    """(In the worker.) The cells' namespace, made on first use."""
    import sys
    import types

    module = sys.modules.get(_NAMESPACE)
    if module is None:
        module = sys.modules[_NAMESPACE] = types.ModuleType(_NAMESPACE)
        module.__dict__["__name__"] = "__main__"
    return module.__dict__


def _run_cell(source: str, label: str) -> Any:
    """(In the worker.) Run a cell's code in the namespace; the value of a last expression, if any."""
    namespace = _namespace()
    tree = ast.parse(source, filename=label)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, label, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), label, "eval"), namespace)


def _get(name: str) -> Any:
    """(In the worker.) A variable of the cells."""
    namespace = _namespace()
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined in the session's cells")
    return namespace[name]


def _set(name: str, value: Any) -> None:
    """(In the worker.) Set a variable of the cells."""
    _namespace()[name] = value


class _Result:
    """A cell's result that cannot be brought here (it holds what only the worker has): its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _repr_or_value(source: str, label: str) -> tuple[bool, Any]:
    """(In the worker.) The cell's result as (True, value) when it pickles, else (False, its repr)."""
    import cloudpickle

    value = _run_cell(source, label)
    if value is None:
        return True, None
    try:
        cloudpickle.dumps(value)
    except Exception:
        return False, repr(value)
    return True, value


_OPTIONS = "--session NAME, --gpus N, --gpu-memory SIZE, --cpus N, --memory SIZE, --requirements FILE, --profile NAME"


_MOVE_OPTIONS = "--session NAME, --profile NAME, then the variables' names"


class _Parser(argparse.ArgumentParser):
    def __init__(self, prog: str, options: str) -> None:
        super().__init__(prog=prog, add_help=False)
        self.options = options

    def error(self, message: str) -> Any:  # argparse would print its usage and exit the kernel's process
        raise InvalidRequest(f"{self.prog}: {message} — its options: {self.options}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser("%%gpuport", _OPTIONS)
    parser.add_argument("--session", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--gpu-memory", default=None)
    parser.add_argument("--cpus", type=float, default=0.0)
    parser.add_argument("--memory", default=None)
    parser.add_argument("--requirements", default=None)  # a local file: the session's Python environment
    return parser


def _move_parser(prog: str) -> argparse.ArgumentParser:
    """``%gpuport_pull`` and ``%gpuport_push``: names, and the session (default: the current one)."""
    parser = _Parser(prog, _MOVE_OPTIONS)
    parser.add_argument("--session", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("names", nargs="+")
    return parser


def _words(magic: str, line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as e:
        raise InvalidRequest(f"{magic} {line}: {e}") from None


def default_session_name() -> str:
    """The notebook's session: named after the notebook where Jupyter says which it is."""
    path = os.environ.get("JPY_SESSION_NAME", "")
    stem = os.path.splitext(os.path.basename(path))[0] if path else ""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem).strip("-.")
    return f"notebook-{cleaned}"[:64] if cleaned else "notebook"


class Notebook:
    """The extension's state in one kernel: the client, and the sessions its cells used."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.clients: dict[str | None, Client] = {}
        self.sessions: dict[str, Session] = {}
        self.current = default_session_name()
        self.cells = 0

    def session(self, options: argparse.Namespace, switch: bool = True) -> Session:
        """The session ``options`` name (else the current one), opened on first use; with ``switch``, it
        becomes the current one."""
        name = options.session or self.current
        if switch:
            self.current = name
        found = self.sessions.get(name)
        if found is not None:
            return found
        client = self.clients.get(options.profile)
        if client is None:
            client = self.clients[options.profile] = connect(profile=options.profile)
        session = client.session(
            name=name,
            gpus=options.gpus,
            gpu_memory=options.gpu_memory,
            cpus=options.cpus,
            memory=options.memory,
            requirements=Path(options.requirements) if options.requirements else None,
        )
        self.sessions[name] = session
        return session

    def run(self, line: str, cell: str) -> Any:
        options = _parser().parse_args(_words("%%gpuport", line))
        session = self.session(options)
        self.cells += 1
        label = f"<gpuport cell {self.cells}>"
        try:
            picklable, value = session.call(_repr_or_value, cell, label)
        except RemoteError as e:
            raise CellFailed(e) from None
        return value if picklable else _Result(value)

    def pull(self, line: str) -> None:
        options = _move_parser("%gpuport_pull").parse_args(_words("%gpuport_pull", line))
        session = self.session(options, switch=False)
        for name in options.names:
            self.shell.user_ns[name] = session.call(_get, name)

    def push(self, line: str) -> None:
        options = _move_parser("%gpuport_push").parse_args(_words("%gpuport_push", line))
        missing = [name for name in options.names if name not in self.shell.user_ns]
        if missing:
            raise InvalidRequest(f"%gpuport_push {missing[0]}: no variable {missing[0]!r} here")
        session = self.session(options, switch=False)
        for name in options.names:
            session.call(_set, name, self.shell.user_ns[name])

    def close(self, line: str) -> None:
        name = line.strip() or self.current
        session = self.sessions.pop(name, None)
        if session is None:
            raise InvalidRequest(f"%gpuport_close: no session {name!r} in this notebook")
        session.close()


class CellFailed(RemoteError):
    """A cell's code raised on the server. IPython shows it as a local cell's error: the remote
    traceback, from the cell's own lines, not the frames of the magic that sent it."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(
            str(error),
            remote_type=error.remote_type,
            remote_traceback=error.remote_traceback,
            exception=error.exception,
        )

    def _render_traceback_(self) -> list[str]:  # IPython's hook for an exception's own traceback
        lines = self.remote_traceback.rstrip().splitlines()
        cell = next((i for i, line in enumerate(lines) if 'File "<gpuport cell' in line), None)
        if cell is None:
            return lines or [f"{self.remote_type}: {self}"]
        return ["Traceback (most recent call last):", *lines[cell:]]


def load_ipython_extension(shell: Any) -> None:
    """``%load_ext gpuport``: registers ``%%gpuport``, ``%gpuport_pull``, ``%gpuport_push`` and
    ``%gpuport_close`` in ``shell``."""
    notebook = Notebook(shell)
    shell.register_magic_function(notebook.run, magic_kind="cell", magic_name="gpuport")
    shell.register_magic_function(notebook.pull, magic_kind="line", magic_name="gpuport_pull")
    shell.register_magic_function(notebook.push, magic_kind="line", magic_name="gpuport_push")
    shell.register_magic_function(notebook.close, magic_kind="line", magic_name="gpuport_close")
