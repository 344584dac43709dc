"""``gpuport quota``: what each user may hold at once (admins set it; jobs over it wait), and the
storage they may keep (past it, what would add to it is refused)."""

from __future__ import annotations

import click

from gpuport.cli._common import client, json_option
from gpuport.cli._output import err, escape, new_table, out, print_json, when
from gpuport.protocol.units import format_size


@click.group("quota")
def quota_group() -> None:
    """Per-user quotas: concurrent GPUs and jobs, processes per job, storage. USER '*' is everyone without a quota of their own."""


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
@click.option(
    "--storage",
    metavar="SIZE",
    help="Snapshots, datasets, outputs and logs the user may keep, e.g. 50GiB [default: '*''s, else 25% of the server's disk].",
)
@click.option(
    "--shares",
    type=float,
    help="The user's weight in the fair share over weeks: 2 entitles them to twice a 1's part [default: '*''s, else 1].",
)
@click.pass_context
def quota_set(
    ctx: click.Context,
    user: str,
    gpus: float | None,
    jobs: int | None,
    queued: int | None,
    processes: int | None,
    storage: str | None,
    shares: float | None,
) -> None:
    """Limit what USER holds at once (admin only); jobs over it wait in the queue, saying so. A
    limit not given is off, but for --queued and --processes, which are then the defaults.

    \b
        gpuport quota set alice --gpus 2 --jobs 4
        gpuport quota set '*' --gpus 1          # everyone else
        gpuport quota set bob --jobs 8 --processes 16384
        gpuport quota set carol --jobs 4 --storage 50GiB
        gpuport quota set alice --shares 2      # twice everyone else's part, over weeks
    """
    quota = client(ctx).set_quota(
        user, gpus=gpus, jobs=jobs, queued=queued, processes=processes, storage=storage, shares=shares
    )
    held = _limits(quota.gpus, quota.jobs, quota.queued, quota.processes)
    if quota.storage is not None:
        held += f"; {format_size(quota.storage)} of storage"
    if quota.shares is not None:
        held += f"; {quota.shares:g} share{'s' if quota.shares != 1 else ''} in the fair share"
    err.print(f"quota of {escape(quota.user)}: {held}")


@quota_group.command("list")
@json_option
@click.pass_context
def quota_list(ctx: click.Context, as_json: bool) -> None:
    """Every quota and each user's storage use (admins), or yours and the default one. A user
    without a quota of their own is shown with the default's limits, set '(*)'."""
    quotas = client(ctx).quotas()
    if as_json:
        print_json(quotas)
        return
    if not quotas:
        err.print("no quotas: every user may use everything")
        return
    table = new_table()
    for column in ("USER", "GPUS", "JOBS", "QUEUED", "PROCESSES/JOB", "USED", "STORAGE", "SHARES", "SET"):
        table.add_column(column)
    for q in quotas:
        table.add_row(
            escape(q.user),
            "-" if q.gpus is None else f"{q.gpus:g}",
            "-" if q.jobs is None else str(q.jobs),
            "default" if q.queued is None else str(q.queued),
            "?" if q.processes is None else str(q.processes),
            "-" if q.storage_used is None else format_size(q.storage_used),
            "?" if q.storage is None else format_size(q.storage),
            "default" if q.shares is None else f"{q.shares:g}",
            when(q.updated_at) if q.updated_at else "(*)",
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
