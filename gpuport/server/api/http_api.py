"""HTTP routes (FastAPI): the REST API under ``/v1``, behind the same tokens as gRPC.

Errors come out as ``{"error": {"type": "NotFound", "message": "..."}}`` with the HTTP status from
``ERROR_TABLE``. ``/openapi.json`` describes every route. No ``/docs`` or ``/redoc``: FastAPI's pages
load their script from a CDN without integrity checks into the dashboard's origin, where tokens are.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import logging
import time
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuport._version import __version__
from gpuport.defaults import LOG_CHUNK_BYTES, MAX_REST_BODY_BYTES
from gpuport.protocol.errors import (
    AuthenticationError,
    GpuportError,
    InvalidRequest,
    Overloaded,
    PermissionDenied,
    ServerError,
    status_for,
)
from gpuport.protocol.paths import check_path
from gpuport.protocol.units import parse_duration, parse_size
from gpuport.server.api import rest_files
from gpuport.server.api.callers import asgi_caller
from gpuport.server.api.dashboard import LOGIN_BODY_BYTES, LOGIN_PATH, add_dashboard_routes
from gpuport.server.api.openapi import build_openapi
from gpuport.server.api.serving_http import Predictions, add_serving_routes, protocol_error
from gpuport.server.app import ServerApp
from gpuport.server.environments import EnvRequest
from gpuport.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gpuport.server.services.auth import Identity
from gpuport.server.services.job_requests import JobRequest, tf_roles
from gpuport.server.services.jobs import ArrayRecord, JobRecord
from gpuport.server.services.snapshots import check_snapshot_name
from gpuport.server.unpacker import unpack

log = logging.getLogger(__name__)


class TokenCreate(BaseModel):
    name: str
    admin: bool = False
    client_cert: bool = Field(
        False, description="Also a client certificate that stands for the token (its key is in the reply, once)"
    )
    scrape: bool = Field(False, description="A scrape token: it reads GET /metrics (Prometheus) and nothing else")


class JobCreate(BaseModel):
    """A job for ``POST /v1/jobs``: a ``command`` (argv list, or a string run by /bin/sh -c), or a
    ``script`` run as ``python SCRIPT --key value ...`` with its ``hyperparameters``."""

    command: list[str] | str | None = None
    script: str | None = Field(None, description="A Python file of the project, run with the hyperparameters as flags")
    hyperparameters: dict[str, Any] | None = Field(
        None, description="Also written to hyperparameters.json in the workdir"
    )
    project: str | None = Field(None, description="A snapshot pushed under this name (gpuport push DIR --name NAME)")
    snapshot_id: str | None = None
    datasets: list[str] = Field(default_factory=list, description="Pushed snapshots mounted read-only")
    gpus: int = 0
    env: dict[str, str] = Field(default_factory=dict)
    outputs: list[str] = Field(default_factory=list, description="Workdir paths brought back as outputs")
    name: str = ""
    time_limit: float | str | None = Field(None, description='Seconds, or a duration such as "90s" or "2h"')
    gpu_memory: int | str | None = Field(None, description='A slice of one GPU: bytes, or a size such as "8GiB"')
    cpus: float = Field(0, description="CPUs reserved (0: none)")
    memory: int | str | None = Field(None, description='RAM reserved and enforced: bytes, or a size such as "4GiB"')
    priority: int = Field(0, description="-100 .. 100; above 0: admins only")
    nprocs: int = Field(1, description="Processes of the job (distributed training), with TF_CONFIG and RANK set")
    tf_roles: dict[str, int] = Field(
        default_factory=dict, description='TF_CONFIG roles, e.g. {"chief": 1, "worker": 2}'
    )
    retries: int = Field(
        0,
        description="Times the job is queued again after a failure not of its code's making: its node lost, "
        "the server restarted, or an exit code of retry_on_exit",
    )
    retry_on_exit: list[int] = Field(default_factory=list, description="Exit codes to retry too (with retries)")
    preemptible: bool | None = Field(
        None, description="The server may preempt it (queue it again) for a job that waited; default: priority < 0"
    )
    checkpoint: str = Field("", description="A folder of its workdir kept when preempted or retried, put back after")
    nodes: int = Field(1, description="A job over this many nodes of a cluster (gpus, cpus, memory are per node)")
    partition: str = Field("", description="With a server in front of Slurm (--slurm): the job's partition")
    batch_script: str | None = Field(
        None,
        description="With a server in front of Slurm (--slurm): a batch script of the project, run with its own "
        "#SBATCH options; `command` (a list) is then its arguments",
    )
    nprocs_per_node: int | None = Field(None, description="With nodes > 1: processes on each node (default 1)")
    gpus_per_node: int | None = Field(None, description="With nodes > 1: GPUs on each node (the same as gpus)")
    after: list[str] = Field(
        default_factory=list,
        description="Jobs to wait for: JOB, JOB:ok (succeeded, the default) or JOB:any (ended); "
        "JOB an id, a name or a job array; a job whose JOB:ok fails is cancelled",
    )
    requirements: str | None = Field(
        None,
        description='Its Python environment, built on the server with uv: "auto" (the project\'s uv.lock, '
        "pyproject.toml or requirements.txt), a file of the project, or requirements as text; none: the server's",
    )
    groups: list[str] = Field(default_factory=list, description="pyproject.toml's dependency groups to include")
    python: str = Field("", description='A Python version the server has, e.g. "3.12" (an isolated environment)')
    isolated_env: bool = Field(False, description="Without the server's own packages under the environment")


class ArrayCreate(JobCreate):
    """A job array or a sweep for ``POST /v1/arrays``: a job's fields, and ``array`` (Slurm's
    syntax) or ``sweep`` (every combination of its values is a task)."""

    array: str = Field("", description='Slurm\'s --array: "0-99%8", "1,3,5", "0-15:4"; with a sweep only "%N"')
    sweep: dict[str, list[str | int | float | bool]] = Field(
        default_factory=dict,
        description='Parameters and their values, e.g. {"lr": [0.001, 0.0001], "batch": [32, 64]}: each task '
        "gets --lr VALUE --batch VALUE appended, and GPUPORT_SWEEP_LR, GPUPORT_SWEEP_BATCH",
    )


class QuotaSet(BaseModel):
    gpus: float | None = Field(None, description="GPUs held at once (slices count as their part); null: no limit")
    jobs: int | None = Field(None, description="Jobs running at once; null: no limit")
    queued: int | None = Field(None, description="Jobs queued at once; null: the default's (1,000 unless '*' says)")
    processes: int | None = Field(None, description="Processes and threads of each job at once; null: the default")
    storage: int | str | None = Field(
        None, description="Bytes of blobs and logs the user may keep, or a size such as '50GiB'; null: the default's"
    )
    shares: float | None = Field(
        None, description="The user's shares in the fair share over weeks; null: the default's (1)"
    )


def _flag_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def hyperparameter_flags(hyperparameters: dict[str, Any]) -> list[str]:
    """A script's flags, as argparse reads them: ``--key value``; true is ``--key`` alone and false
    nothing (``action="store_true"``); a list is ``--key v1 v2 ...`` (``nargs="+"``), an empty list
    or null nothing; a dict is its JSON."""
    flags: list[str] = []
    for key, value in hyperparameters.items():
        if value is True:
            flags.append(f"--{key}")
        elif value is False or value is None or value == []:
            continue
        elif isinstance(value, list):
            flags += [f"--{key}", *map(_flag_value, value)]
        else:
            flags += [f"--{key}", _flag_value(value)]
    return flags


def job_request(body: JobCreate) -> JobRequest:
    if body.batch_script is not None:
        if body.script is not None or isinstance(body.command, str):
            raise InvalidRequest("with `batch_script`, `command` is a list of its arguments, and `script` is not given")
        body = body.model_copy(
            update={"command": [check_path(body.batch_script, what="batch script"), *(body.command or [])]}
        )
    if (body.command is None) == (body.script is None):
        raise InvalidRequest("give either `command` or `script` (with `hyperparameters`), not both")
    command: list[str] = []
    shell = ""
    if body.script is not None:
        script = check_path(body.script, what="script")
        if script.startswith("-"):  # python would read it as its own option (-c CODE, -m MODULE)
            raise InvalidRequest(f"script {script!r} starts with '-', which python would read as an option: rename it")
        command = ["python", script, *hyperparameter_flags(body.hyperparameters or {})]
    elif isinstance(body.command, str):
        shell = body.command
    else:
        command = list(body.command or [])
    return JobRequest(
        command=command,
        shell=shell,
        snapshot_id=body.snapshot_id or "",
        project=body.project or "",
        datasets=body.datasets,
        gpus=body.gpus if body.gpus_per_node is None else body.gpus_per_node,
        env=body.env,
        outputs=body.outputs,
        name=body.name,
        hyperparameters=body.hyperparameters,
        time_limit=0.0 if body.time_limit is None else parse_duration(body.time_limit),
        gpu_memory=0 if body.gpu_memory is None else parse_size(body.gpu_memory),
        cpus=body.cpus,
        memory=0 if body.memory is None else parse_size(body.memory),
        priority=body.priority,
        nprocs=body.nodes * (body.nprocs_per_node or 1) if body.nodes > 1 else body.nprocs,
        tf_roles=tf_roles(body.tf_roles),
        retries=body.retries,
        retry_on_exit=body.retry_on_exit,
        preemptible=body.preemptible,
        checkpoint=body.checkpoint,
        nodes=body.nodes,
        after=body.after,
        partition=body.partition,
        batch_script=check_path(body.batch_script, what="batch script") if body.batch_script else "",
        environment=EnvRequest(body.requirements, tuple(body.groups), body.python, body.isolated_env)
        if body.requirements
        else None,
    )


def _check_script(app: ServerApp, caller: Identity, request: JobRequest, script: str) -> None:
    """Refuse a job whose ``script`` is not a file of its project, naming it, before it queues."""
    if not (request.snapshot_id or request.project):
        raise InvalidRequest(
            f"script {script!r}: the job has no project to find it in — upload one (POST /v1/snapshots?name=NAME "
            "with a tar, tar.gz or zip body, or `gpuport push DIR --name NAME`) and give its name as `project`"
        )
    record = app.snapshots.resolve(caller, snapshot_id=request.snapshot_id, name=request.project)
    paths = {e.path for e in app.snapshots.manifest(record)}
    if script not in paths:
        near = sorted(p for p in paths if p.endswith(".py"))[:5]
        where = f"project {request.project!r}" if request.project else f"snapshot {record.id[:12]}"
        raise InvalidRequest(
            f"script {script!r} is not in {where} ({len(paths)} files"
            + (f"; its Python files include {', '.join(near)}" if near else "")
            + ")"
        )


def job_json(job: JobRecord) -> dict[str, Any]:
    return {"job_id": job.id, **dataclasses.asdict(job), "state": job.state.value}


def array_json(array: ArrayRecord) -> dict[str, Any]:
    return {
        "array_id": array.id,
        **{k: v for k, v in dataclasses.asdict(array).items() if k != "tasks"},
        "counts": dict(array.counts()),
        "tasks": [job_json(t) for t in array.tasks],
    }


def _decode_whole(data: bytes, final: bool) -> tuple[str, int]:
    """Text of ``data`` and the bytes it used: a UTF-8 character cut at the end is left for the next read."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=final)
    return text, len(data) - len(decoder.getstate()[0])


_bearer = HTTPBearer(auto_error=False)
# The route whose body is an archive, streamed to disk by the route itself within its own limit.
_ARCHIVE_PATH = "/v1/snapshots"
# The prediction protocols' paths: their errors are {"error": "message"}.
_SERVING = ("/v2", "/v1/models")


def _caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Identity:
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    server: ServerApp = request.app.state.gpuport
    return asgi_caller(server.auth, request.scope, header)


# A route parameter of this type is the authenticated caller.
Caller = Annotated[Identity, Depends(_caller)]


def _scraper(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Identity:
    """The caller of ``GET /metrics``: an admin, or a scrape token (which nothing else takes)."""
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    server: ServerApp = request.app.state.gpuport
    identity = server.auth.authenticate(header, scope="metrics")
    if identity.scope != "metrics":
        identity.require_admin("reading the server's metrics (or a scrape token: gpuport token create NAME --scrape)")
    return identity


Scraper = Annotated[Identity, Depends(_scraper)]


def _error_response(error: GpuportError) -> JSONResponse:
    _, http_status = status_for(error)
    if isinstance(error, rest_files.TooLarge):
        http_status = 413
    return JSONResponse({"error": {"type": type(error).__name__, "message": str(error)}}, status_code=http_status)


class _Guard:
    """What reaches the REST routes is bounded before it is read: a request that carries a body must
    show a valid token first (FastAPI reads a body before it resolves the route's token), and the body
    is read here, counting bytes as they arrive (Content-Length or chunked), up to
    ``MAX_REST_BODY_BYTES``: past it the answer is 413 and the rest is never read. Predictions do the
    same in ``Predictions``, with their own limit. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` (``@app.middleware``) spawned a task and two memory streams per request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        # The dashboard's login carries its token in a small body: bounded tighter, with no token
        # before it, and paced per source address before anything of it is read.
        logging_in = scope["method"] == "POST" and scope["path"] == LOGIN_PATH
        if logging_in:
            address = (scope.get("client") or ("?",))[0]
            again = await scope["app"].state.login_pace.admit(address)
            if again:
                log.warning("refused a login from %s: too many logins from there", address)
                response = _error_response(
                    Overloaded(f"too many logins from {address} at once: try again in {again:.0f} s")
                )
                response.headers["retry-after"] = str(max(1, round(again)))
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if not (b"transfer-encoding" in headers or (length and length != b"0")):
            return await self.app(scope, receive, send)  # no body
        streamed = scope["method"] == "POST" and scope["path"] == _ARCHIVE_PATH  # read by its route, bounded
        limit = LOGIN_BODY_BYTES if logging_in else MAX_REST_BODY_BYTES
        error: GpuportError | None = None
        try:
            server: ServerApp = scope["app"].state.gpuport
            if not logging_in:
                asgi_caller(server.auth, scope, headers.get(b"authorization", b"").decode("latin-1") or None)
        except (AuthenticationError, PermissionDenied) as e:  # no token, a bad one, or a scrape token
            client = scope.get("client") or ("?",)
            log.warning("rejected %s %s from %s: %s", scope["method"], scope["path"], client[0], e)
            error = e
        if error is None and streamed:
            return await self.app(scope, receive, send)
        if error is None and length.isdigit() and int(length) > limit:
            error = _TooLarge(int(length), limit=limit)
        body = bytearray()
        while error is None:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone
            body += message.get("body", b"")
            if len(body) > limit:
                error = _TooLarge(len(body), exact=False, limit=limit)
            elif not message.get("more_body", False):
                break
        if error is not None:
            # The prediction protocols' routes answer in their own error format.
            serving = scope["path"].startswith(_SERVING)
            response = protocol_error(error) if serving else _error_response(error)
            response.status_code = 413 if isinstance(error, _TooLarge) else response.status_code
            response.headers["connection"] = "close"  # what is left of the body is not read
            return await response(scope, receive, send)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class _TooLarge(InvalidRequest):
    def __init__(self, size: int, exact: bool = True, limit: int = MAX_REST_BODY_BYTES) -> None:
        said = f"{size} bytes" if exact else f"more than {limit} bytes"
        super().__init__(
            f"request body of {said} is over the limit of {limit} — upload files with "
            "`gpuport push`, and refer to them by name"
        )


def build_http_app(app: ServerApp) -> Predictions:
    """The HTTP port's ASGI app: predictions answered by ``Predictions``, the rest by FastAPI."""
    api = FastAPI(
        title="gpuport",
        version=__version__,
        description="GPU over IP: the gpuport server's REST API.",
        docs_url=None,  # see the module's doc
        redoc_url=None,
    )
    api.state.gpuport = app

    def document() -> dict[str, Any]:
        if api.openapi_schema is None:
            api.openapi_schema = build_openapi(api)
        return api.openapi_schema

    api.openapi = document  # type: ignore[method-assign]

    @api.exception_handler(GpuportError)
    async def _gpuport_error(request: Request, error: GpuportError) -> JSONResponse:
        if isinstance(error, AuthenticationError):
            client = request.client.host if request.client else "?"
            log.warning("rejected %s %s from %s: %s", request.method, request.url.path, client, error)
        return _error_response(error)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own answers (no such route, a method the route does not take) in gpuport's error
        format, or the prediction protocols' ``{"error": "..."}`` on their paths: never ``{"detail": ...}``."""
        path, method = request.url.path, request.method
        if error.status_code == 404:
            kind, message = "NotFound", f"no such route: {method} {path} — the REST API is listed at /openapi.json"
        elif error.status_code == 405:
            kind, message = "MethodNotAllowed", f"{path} does not take {method}"
        else:
            kind, message = "HTTPError", str(error.detail)
        if path.startswith(_SERVING):
            return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)
        body = {"error": {"type": kind, "message": message}}
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        invalid = InvalidRequest(f"malformed request: {problems}")
        return protocol_error(invalid) if request.url.path.startswith(_SERVING) else _error_response(invalid)

    api.add_middleware(_Guard)

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error_response(ServerError("internal server error — the server's log has the details"))

    add_serving_routes(api)
    add_dashboard_routes(api, app)

    @api.get("/v1/health", summary="Liveness; needs no token")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    @api.get(
        "/metrics",
        summary="Prometheus metrics (an admin token, or a scrape token)",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(identity: Scraper) -> Response:
        # On the loop, as /v1/gpus and /v1/queue: the batchers' counters and the queue are the loop's.
        return Response(app.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @api.get("/v1/whoami", summary="The identity behind the token")
    async def whoami(identity: Caller) -> dict[str, Any]:
        return {"user": identity.name, "admin": identity.admin}

    @api.get("/v1/status", summary="Server, machine and GPUs")
    async def status(identity: Caller) -> dict[str, Any]:
        return dataclasses.asdict(await asyncio.to_thread(app.status, identity))

    @api.get("/v1/gpus", summary="Each GPU, read live")
    async def gpus(identity: Caller) -> dict[str, Any]:
        return dataclasses.asdict(await asyncio.to_thread(app.gpus, identity))  # read on the nodes

    @api.get("/v1/tokens", summary="Tokens (admin)")
    async def list_tokens(identity: Caller, include_revoked: bool = False) -> list[dict[str, Any]]:
        return [dataclasses.asdict(r) for r in app.auth.list(identity, include_revoked)]

    @api.post("/v1/tokens", status_code=201, summary="Create a token (admin); the token is shown once")
    async def create_token(body: TokenCreate, identity: Caller) -> dict[str, Any]:
        record, token, cert = await app.create_token(identity, body.name, body.admin, body.client_cert, body.scrape)
        made = {**dataclasses.asdict(record), "token": token}
        if cert is not None:
            made |= {
                "cert_pem": cert.cert_pem.decode(),
                "key_pem": cert.key_pem.decode(),
                "server_cert_pem": app.state.cert_path.read_text(),
                "cert_port": app.cert_port,
            }
        return made

    @api.delete(
        "/v1/tokens/{name}", summary="Revoke a token (admin); end_work=true also ends the user's jobs and sessions"
    )
    async def revoke_token(name: str, identity: Caller, end_work: bool = False) -> dict[str, Any]:
        return dataclasses.asdict(app.revoke_token(identity, name, end_work))

    @api.post("/v1/jobs", status_code=201, summary="Submit a job; the reply carries its job_id")
    async def submit_job(body: JobCreate, identity: Caller) -> dict[str, Any]:
        request = job_request(body)
        if body.script is not None:
            _check_script(app, identity, request, request.command[1])
        checked = await asyncio.to_thread(app.jobs.check, identity, request)  # a cluster's admission may block
        return job_json(app.jobs.submit(identity, request, checked))

    @api.post(
        "/v1/arrays",
        status_code=201,
        summary="Submit a job array (array: Slurm's syntax) or a sweep; the reply carries its array_id and tasks",
    )
    async def submit_array(body: ArrayCreate, identity: Caller) -> dict[str, Any]:
        request = job_request(body)
        if body.script is not None:
            _check_script(app, identity, request, request.command[1])
        sweep = {name: [_flag_value(v) for v in values] for name, values in body.sweep.items()}
        checked = await asyncio.to_thread(app.jobs.check, identity, request)  # a cluster's admission may block
        return array_json(app.jobs.submit_array(identity, request, body.array, sweep, checked))

    @api.get(
        "/v1/arrays/{array_id}", summary="A job array (by its id or name) with its tasks and their counts by state"
    )
    async def get_array(array_id: str, identity: Caller) -> dict[str, Any]:
        return array_json(app.jobs.array(identity, array_id))

    @api.post("/v1/arrays/{array_id}/cancel", summary="Cancel every task of a job array that has not ended")
    async def cancel_array(array_id: str, identity: Caller) -> dict[str, Any]:
        return array_json(app.jobs.cancel_array(identity, array_id))

    @api.get(
        "/v1/jobs",
        summary="Your active and recent jobs (all=true: every one; admins: every user's); "
        "name, state (repeatable) and user (admins: another's) filter them",
    )
    async def list_jobs(
        identity: Caller,
        all: bool = False,
        name: str = "",
        state: Annotated[list[str] | None, Query()] = None,
        user: str = "",
    ) -> list[dict[str, Any]]:
        jobs = app.jobs.list_for(identity, all=all, name=name, states=state or (), user=user)
        return [job_json(j) for j in jobs]

    @api.get("/v1/jobs/{job_id}", summary="One job")
    async def get_job(job_id: str, identity: Caller) -> dict[str, Any]:
        return job_json(app.jobs.get(identity, job_id))

    @api.get(
        "/v1/jobs/{job_id}/logs",
        summary="The log from a byte offset; call again with next_offset until `complete` is true",
    )
    async def job_logs(
        job_id: str, identity: Caller, offset: int = 0, limit: int = LOG_CHUNK_BYTES, tail: int | None = None
    ) -> dict[str, Any]:
        job, offset, data = await app.jobs.read_log(identity, job_id, offset, limit, tail)
        text, used = _decode_whole(data, final=job.state.is_terminal() and len(data) < limit)
        next_offset = offset + used
        return {
            "job_id": job.id,
            "state": job.state.value,
            "offset": offset,  # further than asked where the log was cut there
            "next_offset": next_offset,
            "data": text,
            "complete": job.state.is_terminal() and next_offset >= job.log_bytes,
        }

    @api.post("/v1/jobs/{job_id}/cancel", summary="Cancel a job (SIGTERM, then SIGKILL after a grace period)")
    async def cancel_job(job_id: str, identity: Caller) -> dict[str, Any]:
        return job_json(app.jobs.cancel(identity, job_id))

    @api.get("/v1/queue", summary="Every queued job in the order they start, with its position and why it waits")
    async def queue(identity: Caller) -> list[dict[str, Any]]:
        return [job_json(j) for j in app.jobs.queue(identity)]

    @api.get("/v1/quotas", summary="Quotas (admins: all; a user: their own and the default '*')")
    async def list_quotas(identity: Caller) -> list[dict[str, Any]]:
        return [dataclasses.asdict(q) for q in await asyncio.to_thread(app.quotas.list, identity)]

    @api.put("/v1/quotas/{user}", summary="Set a user's quota (admin); user '*' is everyone without their own")
    async def set_quota(user: str, body: QuotaSet, identity: Caller) -> dict[str, Any]:
        storage = None if body.storage is None else parse_size(body.storage)
        record = await asyncio.to_thread(
            app.quotas.set, identity, user, body.gpus, body.jobs, body.queued, body.processes, storage, body.shares
        )
        return dataclasses.asdict(record)

    @api.get("/v1/usage", summary="What each user's work held (yours; an admin: everyone's) and the fair share now")
    async def usage(identity: Caller, since: str = "", user: str = "", by: str = "user") -> dict[str, Any]:
        """``since``: a duration back from now ("7d", "12h") or epoch seconds; none: everything recorded."""
        start = 0.0
        if since:
            try:
                start = float(since)
            except ValueError:
                start = time.time() - parse_duration(since)
        entries, fair = await asyncio.to_thread(app.usage_report, identity, start, user or None, by)
        return {
            "entries": [dataclasses.asdict(e) for e in entries],
            "fair_share": [dataclasses.asdict(f) for f in fair],
            "half_life": app.usage.half_life,
        }

    @api.post("/v1/storage/sweep", summary="Remove the blobs nobody keeps now, past the grace period (admin)")
    async def sweep_storage(identity: Caller) -> dict[str, Any]:
        identity.require_admin("sweeping the storage")
        return dataclasses.asdict(await asyncio.to_thread(app.storage.sweep))

    @api.delete("/v1/quotas/{user}", status_code=204, summary="Remove a user's quota (admin)")
    async def unset_quota(user: str, identity: Caller) -> Response:
        app.quotas.unset(identity, user)
        return Response(status_code=204)

    @api.post(
        _ARCHIVE_PATH,
        status_code=201,
        summary="Upload a project or dataset as one archive (tar, tar.gz or zip body); ?name= names it",
        description="The body is the archive itself, with its type as Content-Type: application/x-tar, "
        "application/gzip (a .tar.gz) or application/zip; application/octet-stream: found from its first bytes.",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    async def upload_snapshot(request: Request, identity: Caller, name: str = "") -> dict[str, Any]:
        kind = rest_files.archive_kind(request)
        archive = await rest_files.receive_archive(request, app.blobs.root / "incoming")
        app.transfers.add("rest", "in", archive.stat().st_size)
        try:
            kind = rest_files.sniffed(kind, archive)
            if name:
                check_snapshot_name(name)  # before the work, not after it
            async with app.unpackers:
                entries = await unpack(app.blobs.root, archive, kind)
            sizes = {e.blob: e.size for e in entries if e.blob}
            adding = await asyncio.to_thread(app.snapshots.new_bytes, identity.name, sizes)
            await asyncio.to_thread(app.storage.check, identity.name, adding, "this archive")
            record = app.snapshots.record_archive(identity, entries, name)
        finally:
            archive.unlink(missing_ok=True)
        return {"snapshot_id": record.id, **dataclasses.asdict(record)}

    @api.get("/v1/jobs/{job_id}/outputs", summary="A job's outputs: path, size, mode (and a symlink's target)")
    async def job_outputs(job_id: str, identity: Caller) -> list[dict[str, Any]]:
        return rest_files.listing(rest_files.job_outputs(app, identity, job_id))

    @api.get(
        "/v1/jobs/{job_id}/outputs.tar.gz",
        summary="All of a job's outputs as one .tar.gz, streamed",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def job_outputs_archive(job_id: str, identity: Caller) -> StreamingResponse:
        return rest_files.archive_response(app, identity, job_id, {})

    @api.get(
        "/v1/jobs/{job_id}/outputs/{path:path}",
        summary="One output file of a job, streamed",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def job_output(job_id: str, path: str, identity: Caller) -> Response:
        return rest_files.file_response(app, identity, job_id, path, {})

    @api.get("/v1/snapshots", summary="Your named snapshots (gpuport push)")
    async def list_snapshots(identity: Caller) -> list[dict[str, Any]]:
        return [dataclasses.asdict(s) for s in app.snapshots.named(identity)]

    @api.delete(
        "/v1/snapshots/{name_or_id}",
        summary="Remove a named snapshot (or a snapshot by id, with its names): its storage is freed",
    )
    async def delete_snapshot(name_or_id: str, identity: Caller) -> dict[str, Any]:
        by_id = len(name_or_id) == 64 and all(c in "0123456789abcdef" for c in name_or_id)
        name, sid = ("", name_or_id) if by_id else (name_or_id, "")
        return dataclasses.asdict(await asyncio.to_thread(app.snapshots.remove, identity, name, sid))

    return Predictions(api, app)
