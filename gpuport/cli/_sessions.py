"""``gpuport sessions``: the worker processes holding your values and allocations on the server."""

from __future__ import annotations

import time

import click

from gpuport.cli._common import client, json_option
from gpuport.cli._output import err, escape, new_table, out, print_json
from gpuport.protocol.units import format_duration, format_size


@click.group("sessions", invoke_without_command=True)
@json_option
@click.pass_context
def sessions_group(ctx: click.Context, as_json: bool) -> None:
    """List your live sessions (every user's, for an admin); `gpuport sessions close NAME` ends one.

    A session is opened from Python (`gpu.session(name="exp1")`); it holds its allocation and its
    values until it is closed or has had no call for its idle timeout.
    """
    if ctx.invoked_subcommand is not None:
        return
    sessions = client(ctx).sessions()
    if as_json:
        print_json(sessions)
        return
    if not sessions:
        err.print("no live sessions")
        return
    now = time.time()
    table = new_table()
    nodes = len({s.node for s in sessions if s.node}) > 1  # a cluster's: each worker's node is said
    for column in ("ID", "NAME", "OWNER", "STATE", "NODE", "GPUS", "VALUES", "IDLE", "ENDS IN", "CLIENTS"):
        if column != "NODE" or nodes:
            table.add_column(column)
    for s in sessions:
        if s.gpu_memory:
            gpus = f"{format_size(s.gpu_memory)} of GPU {','.join(map(str, s.gpu_indices)) or '?'}"
        elif s.gpus:
            gpus = f"{s.gpus} ({','.join(map(str, s.gpu_indices)) or 'queued'})"
        else:
            gpus = "-"
        idle = max(0.0, now - s.last_call_at)
        state = s.state if not s.message else f"{s.state}: {s.message}"
        table.add_row(
            s.id,
            escape(s.name) or "-",
            escape(s.owner),
            escape(state),
            *([escape(s.node) or "-"] if nodes else []),
            gpus,
            str(s.refs),
            format_duration(idle),
            format_duration(max(0.0, s.idle_timeout - idle)),
            str(s.attached),
        )
    out.print(table)


@sessions_group.command("close")
@click.argument("name_or_id")
@click.pass_context
def sessions_close(ctx: click.Context, name_or_id: str) -> None:
    """End a session by its NAME or ID: its worker stops and what it held is freed."""
    info = client(ctx).close_session(name_or_id)
    err.print(f"session {info.id}{f' ({escape(info.name)})' if info.name else ''} closed")
