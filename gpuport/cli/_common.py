"""What every CLI command shares: the client of the chosen profile, the --json option."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from gpuport.client import Client

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def client(ctx: click.Context) -> Client:
    """A client for the profile chosen with --profile (or GPUPORT_*), closed when the command ends."""
    from gpuport.client import connect  # here: gRPC loads only for a command that talks to the server

    made = connect(profile=ctx.find_root().obj.get("profile"))
    ctx.call_on_close(made.close)
    return made
