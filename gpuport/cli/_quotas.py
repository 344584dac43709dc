"""``gpuport quota``: what each user may hold at once (admins set it; jobs over it wait)."""

from __future__ import annotations

import click

from gpuport.cli._common import client, json_option
from gpuport.cli._output import err, escape, new_table, out, print_json, when


@click.group("quota")
def quota_group() -> None:
    """Per-user quotas: concurrent GPUs and jobs, processes per job. USER '*' is everyone without a quota of their own."""


@quota_group.command("set")
@click.argument("user")
@click.option("--gpus", type=float, help="GPUs held at once (a slice counts as its part of a GPU).")
@click.option("--jobs", type=int, help="Jobs running at once.")
@click.option("--queued", type=int, help="Jobs queued at once: a submit past it is refused (default 1,000).")
@click.option(
    "--processes",
    type=int,
    help="Processes and threads each job may run at once, held by the kernel (cgroups) [default: 4096].",
)
@click.pass_context
def quota_set(
    ctx: click.Context, user: str, gpus: float | None, jobs: int | None, queued: int | None, processes: int | None
) -> None:
    """Limit what USER holds at once (admin only); jobs over it wait in the queue, saying so. A
    limit not given is off, but for --queued and --processes, which are then the defaults.

    \b
        gpuport quota set alice --gpus 2 --jobs 4
        gpuport quota set '*' --gpus 1          # everyone else
        gpuport quota set bob --jobs 8 --processes 16384
    """
    quota = client(ctx).set_quota(user, gpus=gpus, jobs=jobs, queued=queued, processes=processes)
    err.print(f"quota of {escape(quota.user)}: {_limits(quota.gpus, quota.jobs, quota.queued, quota.processes)}")


@quota_group.command("list")
@json_option
@click.pass_context
def quota_list(ctx: click.Context, as_json: bool) -> None:
    """Every quota (admins), or yours and the default one."""
    quotas = client(ctx).quotas()
    if as_json:
        print_json(quotas)
        return
    if not quotas:
        err.print("no quotas: every user may use everything")
        return
    table = new_table()
    for column in ("USER", "GPUS", "JOBS", "QUEUED", "PROCESSES/JOB", "SET"):
        table.add_column(column)
    for q in quotas:
        table.add_row(
            escape(q.user),
            "-" if q.gpus is None else f"{q.gpus:g}",
            "-" if q.jobs is None else str(q.jobs),
            "default" if q.queued is None else str(q.queued),
            "?" if q.processes is None else str(q.processes),
            when(q.updated_at),
        )
    out.print(table)


@quota_group.command("unset")
@click.argument("user")
@click.pass_context
def quota_unset(ctx: click.Context, user: str) -> None:
    """Remove USER's quota (admin only)."""
    client(ctx).unset_quota(user)
    err.print(f"quota of {escape(user)} removed")


def _limits(gpus: float | None, jobs: int | None, queued: int | None = None, processes: int | None = None) -> str:
    parts = []
    if gpus is not None:
        parts.append(f"{gpus:g} GPU{'s' if gpus != 1 else ''}")
    if jobs is not None:
        parts.append(f"{jobs} job{'s' if jobs != 1 else ''}")
    held = " and ".join(parts) + " at once" if parts else "no limit on GPUs or jobs"
    if queued is not None:
        held += f"; {queued} job{'s' if queued != 1 else ''} queued"
    return held + (f"; {processes} processes and threads per job" if processes is not None else "")
