"""``gpuport server``: start the daemon, print how to reach it, serve until SIGINT/SIGTERM.

The gRPC server and the HTTP server (uvicorn) share one asyncio event loop and one ``ServerApp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gpuport._version import __version__
from gpuport.defaults import (
    DEFAULT_AGE_WEIGHT,
    DEFAULT_BLOB_GRACE,
    DEFAULT_FAIRSHARE_HALF_LIFE,
    DEFAULT_PREEMPT_AFTER,
    DEFAULT_SHUTDOWN_GRACE,
)
from gpuport.protocol.errors import ConfigError
from gpuport.protocol.sockets import is_loopback
from gpuport.protocol.units import format_size
from gpuport.server import cgroups, isolation
from gpuport.server.api.callers import with_client_certificate
from gpuport.server.api.data_port import DataPort
from gpuport.server.api.grpc_api import build_grpc_server
from gpuport.server.api.http_api import build_http_app
from gpuport.server.app import ServerApp
from gpuport.server.executors import Executor
from gpuport.server.inventory import Inventory, detect_inventory
from gpuport.server.inventory import memory_floor as resolve_memory_floor
from gpuport.server.state import open_state_dir
from gpuport.server.tls import TLSIdentity, load_or_create_identity

log = logging.getLogger("gpuport.server")


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the daemon owns SIGINT/SIGTERM for both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY on accepted connections only for a socket
    # that says it is TCP. Without it, uvicorn's separate header and body writes met the client's
    # delayed ACK (Nagle): 40 ms on every request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot listen for HTTP on {host}:{port}: {e.strerror} — is another server using it? "
            "pick another --http-port"
        ) from None
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _url(scheme: str, host: str, port: int) -> str:
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"{scheme}://[{shown}]:{port}" if ":" in shown else f"{scheme}://{shown}:{port}"


@dataclass(frozen=True)
class Banner:
    """What a start printed, read back by ``parse_banner``."""

    grpc_url: str
    http_url: str
    fingerprint: str | None  # None with --insecure
    admin_token: str | None  # only on a first start, or with --new-admin-token


def parse_banner(text: str) -> Banner:
    """Read the lines ``_banner`` prints, so that tests, benchmarks and scripts need no parser of their own.

    Raises ``ValueError`` when the text holds no gRPC and HTTP URLs.
    """

    def field(label: str) -> str | None:
        match = re.search(rf"^  {label}\s+(\S+)", text, re.MULTILINE)
        return match.group(1) if match else None

    grpc_url, http_url = field("gRPC"), field("HTTP")
    if not (grpc_url and http_url):
        raise ValueError(f"not a gpuport server banner:\n{text}")
    return Banner(grpc_url, http_url, field("fingerprint"), field("admin token"))


def _banner(
    root: Path,
    grpc_url: str,
    http_url: str,
    data_port: int,
    cert_port: int,
    identity: TLSIdentity | None,
    inventory: Inventory,
    sandbox: isolation.Sandbox,
    new_token: str | None,
    memory_floor: int = 0,
    executor: Executor | None = None,
    limits: cgroups.Cgroups = cgroups.NONE,
) -> str:
    """What every start prints: where to reach the server, what to pin, what it has; then ``ready``."""
    gpus = inventory.gpus()
    on_cluster = executor is not None and executor.kind != "local"
    lines = [
        f"gpuport server {__version__}",
        f"  state dir    {root}",
        f"  gRPC         {grpc_url}",
        f"  HTTP         {http_url}",
        f"  data port    {data_port}          (sessions' values, pushed files: open it beside the gRPC port)",
        *([f"  cert port    {cert_port}          (gRPC for clients with a client certificate)"] if cert_port else []),
        f"  fingerprint  {identity.fingerprint}" if identity else "  TLS          off (--insecure, loopback only)",
        "  GPUs         those of the cluster's nodes (below)"
        if on_cluster
        else f"  GPUs         {len(gpus)} ({', '.join(f'{g.name} {format_size(g.memory_total)}' for g in gpus)})"
        if gpus
        else f"  GPUs         none: {inventory.note}",
        f"  isolation    {sandbox.describe()}",
        "  limits       each node's own cgroups, as its agent finds them"
        if on_cluster
        else f"  limits       {limits.describe()}",
        *(_cluster_lines(executor) if executor is not None and on_cluster else []),
        f"  memory floor {format_size(memory_floor)} free (below it, work that reserves no memory waits)"
        if memory_floor
        else "  memory floor none (--memory-floor 0)",
    ]
    if new_token:
        lines += [
            f"  admin token  {new_token}",
            "               shown once, now: store it. Log in with",
            f"               gpuport login {grpc_url} --token {new_token}",
        ]
    return "\n".join([*lines, "ready"])


def _cluster_lines(executor: Executor) -> list[str]:
    nodes = executor.nodes()
    address = getattr(executor, "address", "?")
    kind = "Slurm" if executor.keeps_queue else "Ray"
    lines = [f"  cluster      {kind} at {address}: {len(nodes)} node{'s' if len(nodes) != 1 else ''}"]
    for node in nodes:
        m = node.machine
        size = f"{m.describe_gpus()}, {m.cpus:g} CPUs, {format_size(m.memory)}"
        lines.append(f"               {node.name} ({node.address}): {size}")
    return lines


async def serve(
    *,
    host: str,
    port: int,
    http_port: int,
    state_dir: Path,
    data_port: int | None = None,
    cert_port: int | None = None,
    insecure: bool = False,
    new_admin_token: bool = False,
    job_uids: tuple[int, int] = isolation.DEFAULT_JOB_UIDS,
    sandbox: bool = True,
    use_cgroups: bool = True,
    memory_floor: int | None = None,
    ray_address: str | None = None,
    ray_insecure: bool = False,
    slurm_dir: Path | None = None,
    slurm_partition: str = "",
    slurm_rest: str = "",
    slurm_rest_token_file: Path | None = None,
    blob_grace: float = DEFAULT_BLOB_GRACE,
    env_cache: int | None = None,
    fairshare_half_life: float = DEFAULT_FAIRSHARE_HALF_LIFE,
    age_weight: float = DEFAULT_AGE_WEIGHT,
    preempt_after: float = DEFAULT_PREEMPT_AFTER,
    say: Callable[[str], None] = print,
) -> None:
    """Run the server until SIGINT or SIGTERM. Raises ``ConfigError`` for anything that stops it starting.

    The first start prints the first admin token; ``new_admin_token`` prints one more admin token
    on any start (for when every admin token is lost). ``data_port`` (None: the gRPC port + 2, or any
    free port when that is 0) carries sessions' large values (see api/data_port.py); ``cert_port``
    (None: the gRPC port + 3, or any free port) is gRPC for clients with a client certificate. ``job_uids``
    and ``sandbox`` (False: none) say how jobs are isolated (see server/isolation.py); ``use_cgroups``
    (False: none) whether each job runs in a cgroup of its own (see server/cgroups.py). Below
    ``memory_floor`` bytes of free memory (None: the default; 0: no floor), work that reserves no
    memory waits; a job that asks for no memory may use the machine's memory less the floor. Blobs
    nobody keeps are removed once ``blob_grace`` seconds old (see services/storage.py). The Python
    environments built for jobs take at most ``env_cache`` bytes (None: a share of the state dir's
    disk; see server/environments.py). The fair share forgets half of a user's use every
    ``fairshare_half_life`` seconds, and a waiting job's turn improves by up to ``age_weight`` times
    the machine's average use per share, reached after a week's wait (see ``FairShare``).
    ``ray_address``: place jobs on that Ray cluster's nodes (see executors/ray.py).
    ``slurm_dir``: hand jobs to the Slurm cluster whose compute nodes share that folder, in
    ``slurm_partition`` unless a job names one (see executors/slurm.py), through slurmrestd at
    ``slurm_rest`` where given (its JWT in ``slurm_rest_token_file`` or SLURM_JWT; see
    executors/slurm_rest.py), else through Slurm's commands.
    """
    if insecure and not is_loopback(host):
        raise ConfigError(
            f"--insecure is refused on {host}: without TLS, tokens and data would cross the network in "
            "clear. It is allowed only on a loopback address (127.0.0.1, ::1, localhost); drop --insecure"
        )
    os.umask(0o077)  # the database, its WAL and everything the server writes stay private to its user
    state = open_state_dir(state_dir)
    identity = None
    if not insecure:
        identity, _ = load_or_create_identity(state, host)
        if not identity.covers(host):
            log.warning(
                "the TLS certificate does not name %s; pinned clients are unaffected, but clients "
                "that verify names will refuse it (delete %s to make a new one: every client must log in again)",
                host,
                state.tls_dir,
            )
    inventory = detect_inventory()
    isolated = (
        isolation.detect(job_uids, state.python_dir) if sandbox else isolation.Sandbox("none", "--no-sandbox was given")
    )
    executor = None
    if slurm_rest and slurm_dir is None:
        raise ConfigError("--slurm-rest names the slurmrestd of the cluster --slurm hands jobs to: give --slurm too")
    if ray_address and slurm_dir:
        raise ConfigError("--ray and --slurm each name the cluster that runs the jobs: give one of them")
    if slurm_dir is not None:
        from gpuport.server.blobs import BlobStore
        from gpuport.server.executors.slurm import SlurmExecutor

        # Said as it is: Slurm runs the jobs as the user who submits them, the server's.
        isolated = isolation.Sandbox("none", "--slurm: jobs run on the cluster's nodes as the server's user")

        key_file = state.root / "slurm-link.key"  # the secrets of its jobs' links derive from it
        client = None
        if slurm_rest:
            import pwd

            from gpuport.server.executors.slurm_rest import SlurmCommands, SlurmRest

            user = pwd.getpwuid(os.getuid()).pw_name  # Slurm's jobs are the server's user's
            token = os.environ.get("SLURM_JWT", "")
            client = SlurmRest(slurm_rest, user, SlurmCommands(), slurm_rest_token_file, token)
        blobs = BlobStore(state.blobs_dir)
        executor = SlurmExecutor(slurm_dir, blobs, inventory, slurm_partition, key_file, client)
    if ray_address:
        from gpuport.server.blobs import BlobStore
        from gpuport.server.executors.ray import RayExecutor

        executor = RayExecutor(ray_address, state.jobs_dir, BlobStore(state.blobs_dir), insecure=ray_insecure)
    floor = resolve_memory_floor(memory_floor)
    limits = cgroups.NONE
    if use_cgroups and executor is None:
        room = max(0, psutil.virtual_memory().total - floor)
        limits = cgroups.detect(cgroups.server_key(state.jobs_dir), room)
    app = ServerApp(
        state,
        inventory,
        isolated,
        executor,
        memory_floor=floor,
        cgroups=limits,
        blob_grace=blob_grace,
        env_cache=env_cache,
        fairshare_half_life=fairshare_half_life,
        age_weight=age_weight,
        preempt_after=preempt_after,
    )
    data: DataPort | None = None
    try:
        credentials = cert_credentials = None
        if identity is not None:
            pair = [(identity.key_pem, identity.cert_pem)]
            credentials = grpc.ssl_server_credentials(pair)
            client_ca = state.client_ca_path.read_bytes()
            cert_credentials = grpc.ssl_server_credentials(pair, root_certificates=client_ca, require_client_auth=True)
            if cert_port is None:
                cert_port = port + 3 if port else 0
        try:
            grpc_server, bound, app.cert_port = build_grpc_server(
                app, host, port, credentials, cert_port, cert_credentials
            )
        except RuntimeError:
            ports = f"{port} or {cert_port}" if cert_credentials is not None else str(port)
            raise ConfigError(
                f"cannot listen for gRPC on {host}:{ports} — is another server using it? pick another "
                "--port (and --cert-port)"
            ) from None
        http_socket = _bind_http(host, http_port)
        if data_port is None:
            data_port = port + 2 if port else 0
        data = DataPort(
            app, host, data_port, state.cert_path if identity else None, state.key_path if identity else None
        )
        app.sessions.data_port = data.port
        app.auth.revoked_hooks.append(data.revoke)
        data.start()
        http_bound = http_socket.getsockname()[1]
        app.http_port = http_bound
        http = _HttpServer(
            uvicorn.Config(
                build_http_app(app),
                log_config=None,
                log_level="warning",
                access_log=False,
                lifespan="off",
                server_header=False,
                proxy_headers=False,  # no proxy in front by default; clients' own addresses are logged
                ssl_certfile=str(state.cert_path) if identity else None,
                ssl_keyfile=str(state.key_path) if identity else None,
                # A client certificate is asked for, never required (tokens need none); one that is
                # sent must be signed by the client CA, and the app learns it (callers.py).
                ssl_cert_reqs=ssl.CERT_OPTIONAL if identity else ssl.CERT_NONE,
                ssl_ca_certs=str(state.client_ca_path) if identity else None,
                http=with_client_certificate(AutoHTTPProtocol) if identity else "auto",
            )
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await app.start()
        await grpc_server.start()
        http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await http_task  # raises what stopped it
            raise ConfigError("the HTTP server stopped during start-up")

        # Only now that both ports are ours: a start that fails must not use up the first admin token,
        # which is shown once.
        new_token = app.auth.create_first_admin() or (app.auth.create_recovery_admin() if new_admin_token else None)
        scheme = "http" if insecure else "https"
        banner = _banner(
            state.root,
            _url(scheme, host, bound),
            _url(scheme, host, http_bound),
            data.port,
            app.cert_port,
            identity,
            inventory,
            isolated,
            new_token,
            app.jobs.memory_floor,
            app.executor,
            limits,
        )
        # Everything imported and built so far lives as long as the server: move it out of the
        # cyclic GC's sight, so that collections triggered by per-call garbage stay cheap.
        gc.collect()
        gc.freeze()
        say(banner)
        sys.stdout.flush()

        await asyncio.wait([asyncio.create_task(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
        say("stopping")
        http.should_exit = True
        await asyncio.gather(grpc_server.stop(DEFAULT_SHUTDOWN_GRACE), http_task, return_exceptions=True)
        say("stopped")
    finally:
        if data is not None:
            data.close()
        app.close()
        limits.release()
