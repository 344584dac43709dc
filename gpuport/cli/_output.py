"""How the CLI prints: rich tables for people, ``--json`` for programs, errors on stderr."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

from gpuport.protocol.units import format_duration, format_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from gpuport.client import GPU


# The width of a console that is no terminal (a pipe, a file): wide enough that no table wraps, so
# `gpuport jobs | grep` and `> jobs.txt` see one line per row, whatever COLUMNS says.
_PIPED_WIDTH = 1_000_000


class _Console:
    """A rich ``Console`` made on first use: importing rich costs 15 ms, which a command that prints
    nothing through it (``--version``, ``--help``) does not pay. Piped, it wraps nothing."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Any = None

    @property
    def console(self) -> Console:
        """The rich ``Console`` itself, for what needs one and not a stand-in: a ``Progress`` enters
        it as a context manager, which ``__getattr__`` cannot pass on."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
            if not self._console.is_terminal:
                self._console.width = _PIPED_WIDTH
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)


out: Any = _Console(highlight=False, soft_wrap=True)
err: Any = _Console(stderr=True, highlight=False, soft_wrap=True)


def escape(text: str) -> str:
    """``text`` with rich's markup characters escaped: printed as it is."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def new_table() -> Table:
    """The CLI's tables: no box, bold headers."""
    from rich.table import Table

    return Table(box=None, pad_edge=False, header_style="bold")


def print_json(value: Any) -> None:
    print(json.dumps(_plain(value), indent=2, default=str))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def print_error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}")


def gpu_table(gpus: list[GPU] | tuple[GPU, ...]) -> Table:
    table = new_table()
    nodes = len({g.node for g in gpus}) > 1  # a cluster's: each GPU's node is said
    for column in ("NODE", "GPU", "NAME", "MEMORY USED / TOTAL", "UTIL", "JOBS (OWNER, SLICE, MEMORY USED)"):
        if column != "NODE" or nodes:
            table.add_column(column)
    for g in gpus:
        util = "?" if g.utilization is None else f"{g.utilization}%"
        held = [
            f"{a.job_id} ({escape(a.owner)}, {format_size(a.memory) if a.memory else 'whole GPU'}, "
            f"uses {format_size(a.memory_used)})"
            for a in g.allocations
        ]
        table.add_row(
            *([escape(g.node)] if nodes else []),
            str(g.index),
            escape(g.name),
            f"{format_size(g.memory_used)} / {format_size(g.memory_total)}",
            util,
            "\n".join(held) or "-",
        )
    return table


def ago(timestamp: float) -> str:
    return format_duration(max(0.0, time.time() - timestamp))


def when(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp)) if timestamp else "-"
