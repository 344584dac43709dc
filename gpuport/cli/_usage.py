"""``gpuport usage``: what each user's jobs, sessions and models held (like Slurm's ``sreport``),
and each user's place in the fair share over weeks (also shown under ``gpuport queue``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpuport.cli._common import client, json_option
from gpuport.cli._output import err, escape, new_table, out, print_json
from gpuport.protocol.units import format_duration, format_size

if TYPE_CHECKING:
    from gpuport.client import UsageReport


@click.command("usage")
@click.option(
    "--since",
    default="7d",
    show_default=True,
    metavar="DURATION",
    help="How far back, e.g. 1d, 30d; 'all': everything recorded.",
)
@click.option("--user", metavar="USER", help="Only USER's (an admin may name anyone; a user sees their own).")
@click.option(
    "--by",
    type=click.Choice(["user", "day"]),
    default="user",
    show_default=True,
    help="One row per user, or per user and day (UTC).",
)
@json_option
@click.pass_context
def usage_command(ctx: click.Context, since: str, user: str | None, by: str, as_json: bool) -> None:
    """What your jobs, sessions and models held (an admin: everyone's): GPU-hours (a slice counts as
    its part of its GPU), CPU-hours reserved and used, memory reserved; and the fair share now.

    \b
        gpuport usage                       # the last 7 days, by user
        gpuport usage --since 30d --by day
        gpuport usage --since all --user alice
    """
    report = client(ctx).usage(since=None if since == "all" else since, user=user, by=by)
    if as_json:
        print_json(report)
        return
    if not report.entries:
        err.print(f"no usage recorded {'yet' if since == 'all' else f'in the last {since}'}")
    else:
        table = new_table()
        columns = [
            "USER",
            *(["DAY"] if by == "day" else []),
            "RUNS",
            "GPU-HOURS",
            "CPU-HOURS",
            "CPU USED",
            "MEMORY-HOURS",
        ]
        for column in columns:
            table.add_column(column, justify="left" if column in ("USER", "DAY") else "right")
        for e in report.entries:
            table.add_row(
                escape(e.user),
                *([e.day] if by == "day" else []),
                str(e.runs),
                f"{e.gpu_seconds / 3600:.2f}",
                f"{e.cpu_seconds_reserved / 3600:.2f}",
                f"{e.cpu_seconds_used / 3600:.2f}",
                f"{format_size(int(e.memory_byte_seconds / 3600))}h",
            )
        out.print(table)
    fair_share_table(report)


def fair_share_table(report: UsageReport) -> None:
    """Each user's shares, effective share and decayed use: how the queue orders users over weeks."""
    if not report.fair_share:
        return
    table = new_table()
    for column in ("USER", "SHARES", "EFFECTIVE SHARE", "DECAYED USE"):
        table.add_column(column, justify="left" if column == "USER" else "right")
    for f in report.fair_share:
        table.add_row(escape(f.user), f"{f.shares:g}", f"{f.effective_share:.1%}", f"{f.decayed_use:.1%}")
    out.print(
        f"fair share (use decays by half every {format_duration(report.half_life)}; least use per share goes first):"
    )
    out.print(table)
