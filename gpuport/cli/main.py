"""``gpuport``: log in to a GPU server, look at its GPUs, manage tokens, and run the server itself."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click

import gpuport
from gpuport.cli._batch import sbatch_command
from gpuport.cli._common import client as _client
from gpuport.cli._common import json_option
from gpuport.cli._jobs import JOB_COMMANDS
from gpuport.cli._models import deploy_command, label_command, models_command, undeploy_command
from gpuport.cli._output import ago, err, escape, gpu_table, out, print_error, print_json, when
from gpuport.cli._quotas import quota_group
from gpuport.cli._reach import REACH_COMMANDS
from gpuport.cli._sessions import sessions_group
from gpuport.cli._usage import usage_command
from gpuport.client._channel import Target, parse_url
from gpuport.client._config import config_path, load_profiles, remove_profile
from gpuport.defaults import (
    DEFAULT_AGE_WEIGHT,
    DEFAULT_BLOB_GRACE,
    DEFAULT_FAIRSHARE_HALF_LIFE,
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_PREEMPT_AFTER,
    DEFAULT_PROFILE,
    ENV_PROFILE,
)
from gpuport.protocol.errors import GpuportError, InvalidRequest
from gpuport.protocol.units import format_size, parse_duration, parse_size


class _Gpuport(click.Group):
    """Turns every GpuportError into one line on stderr and exit status 1: no traceback for users.

    An OSError (a file here, the terminal) is one line too. A Ctrl-C that no command took itself
    ends it with status 130 (click would say "Aborted!" and 1). Any other exception is a bug of the
    CLI's: never silent, it is said with its traceback, and exit status 1. Click's own (usage
    errors, exits, Abort) go on to click."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpuportError as e:
            print_error(str(e))
            ctx.exit(1)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:  # Ctrl-C where a command does not take it itself: 130, as a shell says
            _restore_stdio()
            ctx.exit(130)
        except OSError as e:  # this machine's files or terminal: said as the system says it
            _restore_stdio()
            print_error(str(e))
            ctx.exit(1)
        except Exception as e:  # noqa: BLE001 - any other is a bug: said, never silent
            _report_bug(e)
            ctx.exit(1)


def _restore_stdio() -> None:
    """Put the real stdout and stderr back: a live display (a progress bar) that failed may have left
    its own stand-ins in place, which would swallow every word said after it."""
    if sys.__stdout__ is not None and sys.__stderr__ is not None:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def _report_bug(error: Exception) -> None:
    """Say an unexpected error, with its traceback, on the real stderr."""
    import traceback

    _restore_stdio()
    traceback.print_exception(error)
    print_error(
        f"unexpected {type(error).__name__}: {error} — a bug in gpuport {gpuport.__version__}; "
        "please report it with the traceback above"
    )


@click.group(cls=_Gpuport)
@click.option("--profile", envvar=ENV_PROFILE, help="Saved server profile to use (default: 'default').")
@click.version_option(gpuport.__version__, prog_name="gpuport")
@click.pass_context
def cli(ctx: click.Context, profile: str | None) -> None:
    """GPU over IP: run deep-learning work on a remote GPU machine, securely."""
    ctx.ensure_object(dict)
    ctx.obj["profile"] = profile


# ---- the daemon ---------------------------------------------------------------------------------


@cli.command()
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to bind; 0.0.0.0 for every interface.")
@click.option(
    "--port",
    default=DEFAULT_GRPC_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="gRPC port (0: any free).",
)
@click.option(
    "--http-port",
    default=DEFAULT_HTTP_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="HTTP port (0: any free).",
)
@click.option(
    "--data-port",
    type=click.IntRange(0, 65535),
    help="Port for sessions' large values, TLS like the others [default: the gRPC port + 2].",
)
@click.option(
    "--cert-port",
    type=click.IntRange(0, 65535),
    help="gRPC port for clients that authenticate with a client certificate (gpuport token create "
    "--client-cert) instead of a token [default: the gRPC port + 3].",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    help="Where the server keeps its state [default: the user data dir].",
)
@click.option("--insecure", is_flag=True, help="No TLS. Refused unless --host is a loopback address.")
@click.option("--new-admin-token", is_flag=True, help="Print one more admin token (when every admin token is lost).")
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.option(
    "--job-uids",
    default="61000-61999",
    show_default=True,
    help="As root: the Unix uids that users' jobs run as, one per gpuport user (kept in the state dir).",
)
@click.option(
    "--no-sandbox",
    is_flag=True,
    help="Run jobs as the server's own user, unisolated (a box of one user): every token is then an admin token.",
)
@click.option(
    "--no-cgroups",
    is_flag=True,
    help="Keep jobs out of cgroups: their memory limits are then polled (2 Hz), and their processes not capped.",
)
@click.option(
    "--memory-floor",
    metavar="SIZE",
    help="Work that reserves no memory waits while the machine has less free, e.g. 4GiB; 0: no floor "
    "[default: 5% of the memory, at most 2GiB].",
)
@click.option(
    "--blob-grace",
    metavar="DURATION",
    help="Blobs no snapshot, output or dataset refers to are removed once this old, e.g. 30m "
    "(uploads in flight become snapshots within it) [default: 1h].",
)
@click.option(
    "--env-cache",
    metavar="SIZE",
    help="Python environments built for jobs take at most this much disk, e.g. 50GiB; the least recently "
    "used not in use are removed past it [default: 25% of the state dir's disk].",
)
@click.option(
    "--fairshare-half-life",
    metavar="DURATION",
    help="The fair share forgets half of each user's past use of the GPUs this often, e.g. 3d [default: 7d].",
)
@click.option(
    "--preempt-after",
    metavar="DURATION",
    help="A job that has waited this long for what --preemptible jobs hold has them preempted (queued "
    "again), when its priority is higher or its owner under their share, e.g. 30m [default: 10m].",
)
@click.option(
    "--age-weight",
    type=float,
    help="How much a waiting job's turn in the fair share improves as it waits: after a week (and no more "
    "after that), by this many times the machine's average use per share; 1 puts a user at twice their share "
    "whose job waited a week level with one at their share who just asked (0: no age factor) [default: 1].",
)
@click.option(
    "--ray",
    "ray_address",
    metavar="ADDRESS",
    help="Place jobs on the nodes of this Ray cluster (its GCS address, host:port) instead of this machine. "
    "The cluster must use Ray's token authentication: give its token in RAY_AUTH_TOKEN.",
)
@click.option(
    "--ray-insecure",
    is_flag=True,
    help="Allow a Ray cluster without token authentication, on a loopback address only (tests, one box).",
)
@click.option(
    "--slurm",
    is_flag=True,
    help="Hand jobs to the Slurm cluster of this (login) node: each job becomes a Slurm job, and Slurm's queue "
    "decides when and where it runs. Needs --shared-dir.",
)
@click.option(
    "--shared-dir",
    type=click.Path(path_type=Path),
    help="With --slurm: a folder every compute node mounts at the same path (NFS), where jobs' workspaces live.",
)
@click.option(
    "--slurm-partition", metavar="NAME", default="", help="With --slurm: the partition of jobs that name none."
)
@click.option(
    "--slurm-rest",
    metavar="URL",
    default="",
    help="With --slurm: submit, list and cancel jobs through this slurmrestd (http(s)://host:port, or "
    "unix:/path/to/socket with its local authentication) instead of sbatch, squeue and scancel. Over the network "
    "it takes a JWT (scontrol token): --slurm-rest-token-file, or SLURM_JWT. sacct, scontrol and srun stay commands.",
)
@click.option(
    "--slurm-rest-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="With --slurm-rest: a file holding slurmrestd's JWT for the server's user; read again when it changes.",
)
@click.option(
    "--print-systemd-unit",
    is_flag=True,
    help="Print a systemd unit that runs the server with these options as a service, and exit.",
)
def server(
    host: str,
    port: int,
    http_port: int,
    data_port: int | None,
    cert_port: int | None,
    state_dir: Path | None,
    insecure: bool,
    new_admin_token: bool,
    log_level: str,
    job_uids: str,
    no_sandbox: bool,
    no_cgroups: bool,
    memory_floor: str | None,
    blob_grace: str | None,
    env_cache: str | None,
    fairshare_half_life: str | None,
    age_weight: float | None,
    preempt_after: str | None,
    ray_address: str | None,
    ray_insecure: bool,
    slurm: bool,
    shared_dir: Path | None,
    slurm_partition: str,
    slurm_rest: str,
    slurm_rest_token_file: Path | None,
    print_systemd_unit: bool,
) -> None:
    """Run the gpuport daemon on this (GPU) machine.

    The first start creates the state dir, a self-signed TLS certificate and an admin token, which
    is printed once. Stop it with Ctrl-C or SIGTERM.
    """
    if print_systemd_unit:
        from gpuport.server.systemd import systemd_unit

        options = ["--host", host, "--port", str(port), "--http-port", str(http_port)]
        options += ["--data-port", str(data_port)] if data_port is not None else []
        options += ["--cert-port", str(cert_port)] if cert_port is not None else []
        options += ["--insecure"] if insecure else []
        options += ["--log-level", log_level] if log_level != "info" else []
        options += ["--job-uids", job_uids] if job_uids != "61000-61999" else []
        options += ["--no-sandbox"] if no_sandbox else []
        options += ["--no-cgroups"] if no_cgroups else []
        options += ["--memory-floor", memory_floor] if memory_floor is not None else []
        options += ["--blob-grace", blob_grace] if blob_grace is not None else []
        options += ["--env-cache", env_cache] if env_cache is not None else []
        options += ["--fairshare-half-life", fairshare_half_life] if fairshare_half_life is not None else []
        options += ["--age-weight", str(age_weight)] if age_weight is not None else []
        options += ["--preempt-after", preempt_after] if preempt_after is not None else []
        options += ["--ray", ray_address] if ray_address else []
        options += ["--ray-insecure"] if ray_insecure else []
        options += ["--slurm"] if slurm else []
        options += ["--shared-dir", str(shared_dir)] if shared_dir is not None else []
        options += ["--slurm-partition", slurm_partition] if slurm_partition else []
        options += ["--slurm-rest", slurm_rest] if slurm_rest else []
        options += ["--slurm-rest-token-file", str(slurm_rest_token_file)] if slurm_rest_token_file else []
        print(systemd_unit(options, state_dir), end="")
        return
    try:
        from gpuport.server.daemon import serve
        from gpuport.server.isolation import parse_uid_range
        from gpuport.server.state import default_state_dir
    except ImportError as e:
        from gpuport._packages import missing_package

        raise click.ClickException(missing_package(e, "`gpuport server`")) from None
    try:
        floor = None if memory_floor is None else parse_size(memory_floor)
    except InvalidRequest as e:
        raise click.BadParameter(str(e), param_hint="--memory-floor") from None
    try:
        grace = DEFAULT_BLOB_GRACE if blob_grace is None else parse_duration(blob_grace)
    except InvalidRequest as e:
        raise click.BadParameter(str(e), param_hint="--blob-grace") from None
    try:
        cache = None if env_cache is None else parse_size(env_cache)
    except InvalidRequest as e:
        raise click.BadParameter(str(e), param_hint="--env-cache") from None
    try:
        half_life = DEFAULT_FAIRSHARE_HALF_LIFE if fairshare_half_life is None else parse_duration(fairshare_half_life)
        if half_life <= 0:
            raise InvalidRequest(f"give a duration of more than 0, not {fairshare_half_life}")
    except InvalidRequest as e:
        raise click.BadParameter(str(e), param_hint="--fairshare-half-life") from None
    if age_weight is not None and not (age_weight >= 0 and age_weight < float("inf")):
        raise click.BadParameter(f"give 0 or more, not {age_weight}", param_hint="--age-weight")
    try:
        preempt = DEFAULT_PREEMPT_AFTER if preempt_after is None else parse_duration(preempt_after)
    except InvalidRequest as e:
        raise click.BadParameter(str(e), param_hint="--preempt-after") from None
    if slurm and shared_dir is None:
        raise click.UsageError("--slurm needs --shared-dir DIR: a folder every compute node mounts at the same path")
    if not slurm and (shared_dir is not None or slurm_partition or slurm_rest or slurm_rest_token_file):
        raise click.UsageError("--shared-dir, --slurm-partition and --slurm-rest go with --slurm")
    if slurm_rest_token_file is not None and not slurm_rest:
        raise click.UsageError("--slurm-rest-token-file goes with --slurm-rest URL (slurmrestd's address)")
    import logging

    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_loop(
        serve(
            host=host,
            port=port,
            http_port=http_port,
            data_port=data_port,
            cert_port=cert_port,
            state_dir=state_dir or default_state_dir(),
            insecure=insecure,
            new_admin_token=new_admin_token,
            job_uids=parse_uid_range(job_uids),
            sandbox=not no_sandbox,
            use_cgroups=not no_cgroups,
            memory_floor=floor,
            blob_grace=grace,
            env_cache=cache,
            fairshare_half_life=half_life,
            age_weight=DEFAULT_AGE_WEIGHT if age_weight is None else age_weight,
            preempt_after=preempt,
            ray_address=ray_address,
            ray_insecure=ray_insecure,
            slurm_dir=shared_dir.absolute() if slurm and shared_dir is not None else None,
            slurm_partition=slurm_partition,
            slurm_rest=slurm_rest,
            slurm_rest_token_file=slurm_rest_token_file.absolute() if slurm_rest_token_file else None,
            say=lambda text: print(text, flush=True),
        )
    )


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the server's event loop: uvloop's where it is installed (the server extra installs it on
    Linux and macOS), faster than asyncio's own at sockets, TLS and callbacks."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        asyncio.run(main)
    else:
        uvloop.run(main)


# ---- trust and identity -------------------------------------------------------------------------


def _confirm_certificate(target: Target, presented: str, pinned_before: str | None) -> bool:
    if pinned_before:
        err.print(f"[bold red]WARNING:[/] the certificate of {escape(target.url)} has CHANGED.")
        err.print(f"  pinned before: {pinned_before}\n  presented now: {presented}")
        err.print("  If nobody replaced it on purpose, someone may be intercepting the connection.")
    else:
        err.print(f"The server at {escape(target.url)} presents a certificate with fingerprint\n  {presented}")
        err.print("Check it against the `fingerprint` line that `gpuport server` printed.")
    try:
        return click.confirm("Trust this certificate?", default=False, err=True)
    except click.Abort:
        err.print()
        return False


@cli.command("login")
@click.argument("url")
@click.option("--token", envvar="GPUPORT_TOKEN", help="Your token (gp_...); asked for when not given.")
@click.option("--fingerprint", help="Expected certificate fingerprint (sha256:...), as `gpuport server` prints it.")
@click.option("--profile", "profile_name", help="Save as this profile [default: the --profile above, else 'default'].")
@click.option("--yes", "-y", is_flag=True, help="Trust the presented certificate without asking.")
@click.option(
    "--start",
    "start_command",
    is_flag=False,
    flag_value="gpuport server",
    default=None,
    metavar="[COMMAND]",
    help="With an ssh:// URL: start the server on the box when none answers there (COMMAND, default "
    "'gpuport server', run with --host 127.0.0.1); its first admin token is used when no --token is given.",
)
@json_option
@click.pass_context
def login_command(
    ctx: click.Context,
    url: str,
    token: str | None,
    fingerprint: str | None,
    profile_name: str | None,
    yes: bool,
    start_command: str | None,
    as_json: bool,
) -> None:
    """Pin the server's certificate, check your token, and save them as a profile.

    URL is https://HOST:7600, or ssh://[USER@]HOST[:PORT][?port=7600] to reach a server whose box
    has only SSH open: every command then goes through the system's ssh (its config and agent)."""
    profile_name = profile_name or ctx.obj.get("profile") or DEFAULT_PROFILE
    if not token and start_command is None:
        token = click.prompt("Token", hide_input=True, err=True)
    from gpuport.client import login

    confirm = (lambda *_: True) if yes else _confirm_certificate
    with login(
        url, token, fingerprint=fingerprint, profile=profile_name, confirm=confirm, start=start_command
    ) as client:
        if as_json:
            print_json(
                {
                    "url": client.url,
                    "profile": profile_name,
                    "user": client.user,
                    "admin": client.admin,
                    "fingerprint": client.fingerprint,
                    "config": str(config_path()),
                }
            )
            return
        role = "admin" if client.admin else "user"
        who = f"[bold]{escape(client.user)}[/] ({role})"
        out.print(f"Logged in to {escape(client.url)} as {who}, server {client.server_version}.")
        if client.fingerprint:
            out.print(f"Pinned certificate {client.fingerprint}.")
        out.print(f"Saved as profile '{escape(profile_name)}' in {escape(str(config_path()))}.")


@cli.command("logout")
@click.option("--profile", "profile_name", help="Profile to forget [default: the --profile above, else 'default'].")
@click.pass_context
def logout_command(ctx: click.Context, profile_name: str | None) -> None:
    """Forget a saved profile (its token and pinned certificate)."""
    profile_name = profile_name or ctx.obj.get("profile") or DEFAULT_PROFILE
    if not remove_profile(profile_name):
        raise click.ClickException(f"no profile named '{profile_name}' in {config_path()}")
    out.print(f"Forgot profile '{escape(profile_name)}'.")


@cli.command("profiles")
@json_option
def profiles_command(as_json: bool) -> None:
    """List the saved server profiles."""
    profiles = load_profiles()
    if as_json:
        print_json([{"name": n, "url": p.url, "fingerprint": p.fingerprint} for n, p in sorted(profiles.items())])
        return
    if not profiles:
        out.print("No profiles yet: run `gpuport login https://HOST:7600 --token gp_...`.")
        return
    for name, p in sorted(profiles.items()):
        out.print(f"{escape(name):12} {escape(p.url):32} {p.fingerprint or 'no TLS'}")


# ---- the machine --------------------------------------------------------------------------------
# ---- the machine --------------------------------------------------------------------------------


def _print_envs(envs: list[dict], as_json: bool) -> None:
    if as_json:
        print_json(envs)
        return
    for e in envs:
        if e["removed"]:
            out.print(f"removed {e['hash']}")
            continue
        layer = "layered" if e["layered"] else "isolated"
        out.print(
            f"{e['hash']}  {format_size(e['size']):>9}  Python {e['python_version']:8} {layer:8} "
            f"last used {ago(e['last_used'])}  {e['jobs']} job{'s' if e['jobs'] != 1 else ''}  "
            f"{escape(', '.join(e['packages'][:6]))}{', ...' if len(e['packages']) > 6 else ''}"
        )
    if not envs:
        out.print("No environments: a job whose project has a requirements.txt, pyproject.toml or uv.lock builds one.")


@cli.group("envs", invoke_without_command=True)
@json_option
@click.pass_context
def envs_group(ctx: click.Context, as_json: bool) -> None:
    """The Python environments the server built for jobs: hash, size, Python, last use, jobs."""
    if ctx.invoked_subcommand is None:
        _print_envs(_client(ctx).environments(), as_json)


@envs_group.command("prune")
@json_option
@click.pass_context
def envs_prune_command(ctx: click.Context, as_json: bool) -> None:
    """Remove the environments no running job uses (admins); they are built again when asked for."""
    _print_envs(_client(ctx).environments(prune=True), as_json)


@cli.command("gpus")
@json_option
@click.pass_context
def gpus_command(ctx: click.Context, as_json: bool) -> None:
    """The server's GPUs, read live: memory, utilization and the gpuport jobs using each."""
    client = _client(ctx)
    if as_json:
        print_json(client.gpus())
        return
    status = client.status()
    if not status.gpus:
        out.print(f"No GPU on {escape(status.hostname)}: {escape(status.note)}")
        return
    out.print(gpu_table(status.gpus))


@cli.command("status")
@json_option
@click.pass_context
def status_command(ctx: click.Context, as_json: bool) -> None:
    """The server: version, machine, who you are, and its GPUs."""
    s = _client(ctx).status()
    if as_json:
        print_json(s)
        return
    role = "admin" if s.admin else "user"
    out.print(f"[bold]{escape(s.url)}[/]  gpuport {s.server_version} on {escape(s.hostname)}, up {ago(s.started_at)}")
    out.print(f"  you      {escape(s.user)} ({role})")
    memory = f"{format_size(s.memory_available)} of {format_size(s.memory_total)} RAM free"
    out.print(f"  machine  {s.cpus} CPUs, {memory}, Python {s.python_version}")
    if s.gpus:
        out.print(f"  GPUs     {len(s.gpus)} ({s.inventory})")
        out.print(gpu_table(s.gpus))
    else:
        out.print(f"  GPUs     none: {escape(s.note)}")


@cli.command("dashboard")
@click.option("--print", "print_only", is_flag=True, help="Print the login link instead of opening a browser.")
@click.pass_context
def dashboard_command(ctx: click.Context, print_only: bool) -> None:
    """Open the server's web dashboard in your browser, logged in: a link that works once, within a minute."""
    client = _client(ctx)
    url = client.dashboard_url()
    if not print_only and _open_browser(url):
        err.print(f"Opened the dashboard of {escape(client.url)} in your browser, as {escape(client.user)}.")
        return
    click.echo(url)
    if not print_only:
        err.print("No browser could be opened here: open the link above yourself.")
    err.print(f"The link logs in as {escape(client.user)} once, within a minute: keep it to yourself.")


def _open_browser(url: str) -> bool:
    """Whether a browser took ``url``; never a text browser in this terminal, which cannot run the page."""
    graphical = os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("BROWSER")
    if sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")) and not graphical:
        return False
    import webbrowser  # here: only this command opens a browser

    try:
        return webbrowser.open(url)
    except webbrowser.Error:
        return False


# ---- tokens (admin) -----------------------------------------------------------------------------


@cli.group("token")
def token_group() -> None:
    """Create, list and revoke tokens (admin only)."""


@token_group.command("create")
@click.argument("name")
@click.option("--admin", is_flag=True, help="Make it an admin token.")
@click.option(
    "--client-cert",
    "cert_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write a client certificate that stands for the token into this new folder: cert.pem, key.pem, "
    "and ca.pem (the server's certificate), for clients that speak TLS options but send no token.",
)
@click.option("--scrape", is_flag=True, help="A scrape token: it reads GET /metrics (Prometheus) and nothing else.")
@json_option
@click.pass_context
def token_create(
    ctx: click.Context, name: str, admin: bool, cert_dir: Path | None, scrape: bool, as_json: bool
) -> None:
    """Create a token for user NAME; it is printed once.

    With --client-cert DIR, the server also signs a client certificate for NAME (revoked with the
    token). Triton's clients, for example, then need no header: over HTTPS on the server's HTTP
    port, and over gRPC on its port for certificates (the gRPC port + 3 by default)."""
    if cert_dir is not None and cert_dir.exists() and any(cert_dir.iterdir()):
        raise click.BadParameter(f"{cert_dir} is not empty: give a new or empty folder", param_hint="--client-cert")
    client = _client(ctx)
    new = client.create_token(name, admin=admin, client_cert=cert_dir is not None, scrape=scrape)
    if cert_dir is not None:
        cert_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for file, text, mode in (
            ("key.pem", new.key_pem, 0o600),
            ("cert.pem", new.cert_pem, 0o644),
            ("ca.pem", new.server_cert_pem, 0o644),
        ):
            path = cert_dir / file
            path.touch(mode=mode)
            path.write_text(text)
    target = parse_url(client.url)
    host = f"[{target.host}]" if ":" in target.host else target.host
    if as_json:
        shown = {"name": new.name, "admin": new.admin, "token": new.token}
        if cert_dir is not None:
            shown |= {"client_cert": str(cert_dir), "cert_port": new.cert_port}
        print_json(shown)
        return
    kind = " (admin)" if new.admin else " (scrape: GET /metrics only)" if scrape else ""
    err.print(f"Token for '{escape(new.name)}'{kind}; it is shown only now:")
    print(new.token)
    if cert_dir is not None:
        err.print(
            f"Its client certificate is in {escape(str(cert_dir))}/ (cert.pem, key.pem: keep it private; ca.pem: "
            f"the server's certificate). Use it over HTTPS on the server's HTTP port, and over gRPC at "
            f"{escape(host)}:{new.cert_port}. Revoking the token revokes it."
        )


@token_group.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@json_option
@click.pass_context
def token_list(ctx: click.Context, include_revoked: bool, as_json: bool) -> None:
    """List tokens (never their secrets)."""
    tokens = _client(ctx).tokens(include_revoked=include_revoked)
    if as_json:
        print_json(tokens)
        return
    for t in tokens:
        state = f"revoked {when(t.revoked_at)}" if t.revoked_at else "valid"
        role = "admin" if t.admin else "scrape" if t.scrape else "user"
        out.print(f"{escape(t.name):24} {role:6}  created {when(t.created_at)}  {state}")


@token_group.command("revoke")
@click.argument("name")
@click.option("--end-work", is_flag=True, help="Also cancel NAME's queued and running jobs and close their sessions.")
@click.pass_context
def token_revoke(ctx: click.Context, name: str, end_work: bool) -> None:
    """Revoke the token of NAME: it stops working at once, and what it holds open closes.

    Its jobs and sessions go on (a token rotated is not work lost), unless --end-work."""
    _client(ctx).revoke_token(name, end_work=end_work)
    ended = ", and ended their jobs and sessions" if end_work else ""
    out.print(f"Revoked the token '{escape(name)}'{ended}.")


@cli.command("tf-connect")
@click.option("--gpus", type=int, default=0, show_default=True, help="Whole GPUs (none: the remote CPU).")
@click.option("--gpu-memory", help="A slice of one GPU instead, e.g. 8GiB.")
@click.option("--cpus", type=float, default=0.0, help="CPUs reserved.")
@click.option("--memory", help="RAM reserved, e.g. 16GiB.")
@click.pass_context
def tf_connect(ctx: click.Context, gpus: int, gpu_memory: str | None, cpus: float, memory: str | None) -> None:
    """Start TensorFlow's server on the GPU machine, reachable here over gpuport's TLS, until Ctrl-C.

    Prints the address for other processes here, which connect with
    tf.config.experimental_connect_to_host(ADDRESS, job_name="worker") and place ops with
    tf.device("/job:worker/replica:0/task:0/device:GPU:0"). The allocation is freed on exit."""
    import threading

    remote = _client(ctx).tensorflow(gpus=gpus, gpu_memory=gpu_memory, cpus=cpus, memory=memory, connect=False)
    with remote:
        print(remote.address, flush=True)
        err.print(
            f"TensorFlow server (job 'worker', devices {', '.join(remote.devices)}) at {remote.address}. In your "
            f"program: tf.config.experimental_connect_to_host({remote.address!r}, job_name='worker'), then "
            f"tf.device({remote.device('GPU:0' if 'GPU:0' in remote.devices else 'CPU:0')!r}). Ctrl-C ends it."
        )
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


for _command in [*JOB_COMMANDS, *REACH_COMMANDS]:
    cli.add_command(_command)
cli.add_command(sbatch_command)
cli.add_command(quota_group)
cli.add_command(usage_command)
cli.add_command(sessions_group)
cli.add_command(deploy_command)
cli.add_command(models_command)
cli.add_command(label_command)
cli.add_command(undeploy_command)


def main() -> None:
    cli(prog_name="gpuport")
