"""`gpuport sbatch`: an existing Slurm batch script through a server in front of Slurm (--slurm)."""

from __future__ import annotations

from pathlib import Path

import click

from gpuport.cli._common import client
from gpuport.cli._jobs import _exit_status
from gpuport.cli._output import err


@click.command("sbatch", context_settings={"allow_interspersed_args": False})
@click.option(
    "--partition", "-p", metavar="NAME", help="The Slurm partition [default: the script's, else the server's]."
)
@click.option(
    "--wait", "wait", is_flag=True, help="Wait for the job's end, and exit with its exit code (as sbatch --wait)."
)
@click.argument("script", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def sbatch_command(ctx: click.Context, partition: str | None, wait: bool, script: Path, args: tuple[str, ...]) -> None:
    """Submit a Slurm batch SCRIPT (with ARGS) as it is: its folder is synced, and its #SBATCH lines
    (job name, gres, time, output ...) are honoured. Prints the job's id. Needs a server in front of
    a Slurm cluster (gpuport server --slurm)."""
    job = client(ctx).submit_batch(script, list(args), partition=partition)
    print(job.id, flush=True)
    err.print(f"job {job.id} submitted to Slurm: gpuport logs -f {job.id} follows it, gpuport queue shows why it waits")
    if wait:
        ctx.exit(_exit_status(job.wait().info))
