"""The web dashboard on the HTTP port: ``GET /`` and its routes under ``/ui/``.

A person logs in with a token once (``POST /ui/login``), or with the one-time code of a link that
``gpuport dashboard`` opened (``/#code=...``: in the fragment, which no request, log or Referer carries;
the page posts it to the same route, paced as any login); the server answers with a login of its own,
an opaque id in a ``Secure; HttpOnly; SameSite=Strict`` cookie, and a CSRF token that the page sends
back in ``X-CSRF-Token`` with every request that changes something. Each request takes the token the
login was made with through the same check as the API's (a revoked token ends its logins), so a
person sees and touches exactly what the API lets that token see and touch.

The page is three static files (no build step, nothing fetched from elsewhere), served with a strict
Content-Security-Policy; it writes every value as text, never as markup (a log's colours become
classes). It follows the server with two Server-Sent Event streams: ``/ui/events`` (GPUs with their
last hour, the queue, jobs, sessions, models, usage, environments, every two seconds; the jobs as one
page of the table's filters) and ``/ui/jobs/{id}/log`` (a job's log as it is written). A job's outputs download from
``/ui/jobs/{id}/outputs...`` with the checks of the REST API's routes, which take a token, not the
login.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gpuport.protocol.errors import AuthenticationError, GpuportError, PermissionDenied
from gpuport.server.api import rest_files
from gpuport.server.app import ServerApp
from gpuport.server.services.auth import AuthService, Identity
from gpuport.server.services.serving import message_for

COOKIE = "gpuport_login"
LOGIN_PATH = "/ui/login"
LOGIN_BODY_BYTES = 4096  # a token in JSON: the body of the one request that needs no credentials
CSRF_HEADER = "x-csrf-token"
LOGIN_SECONDS = 12 * 3600  # a login lasts a working day; the token itself may be revoked any time
EVENT_SECONDS = 2.0
_REVOKE_CHECK = 0.25  # seconds between looks at an open page's login, for a revoke to end it at once
# Logins one user holds at once; past it their oldest goes: a flood of logins cannot grow memory for
# ever, nor log anyone else out.
_MAX_LOGINS_PER_USER = 100
# Logins from one address: a burst of _LOGIN_BURST at once, then _LOGIN_RATE a second; a login past
# that waits its turn (its connection with it), and past _LOGIN_WAITING waiting ones it is refused.
# A person logs in a few times a day; a flood of logins, answered as fast as they came, took the
# server's event loop from every other user's calls.
_LOGIN_BURST = 50
_LOGIN_RATE = 20.0
_LOGIN_WAITING = 100
_ENDED_KEPT = 1000  # logins ended by a revoke whose reason is kept for their cookie
# Scripts, styles and connections from this server only; no inline script or style; not in a frame.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
_STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
JOBS_PER_PAGE = 50  # rows of the jobs table at once


@dataclass
class Login:
    user: str
    # The credential it was made with, kept in memory only, to check it at each request: a Bearer
    # value, or (a login by a link that a client certificate asked for) the certificate's fingerprint.
    authorization: str | None = dataclasses.field(repr=False)
    cert: str | None
    csrf: str = dataclasses.field(repr=False)
    expires: float

    def identity(self, auth: AuthService) -> Identity:
        """Who this login is now; ``AuthenticationError`` once its token is revoked."""
        return auth.authenticate(self.authorization, self.cert)


class Logins:
    """The dashboard's logins, in memory (a server restart logs everyone out), at most
    ``_MAX_LOGINS_PER_USER`` per user: a new one past that ends that same user's oldest."""

    def __init__(self) -> None:
        self._by_id: dict[str, Login] = {}
        self._of: dict[str, dict[str, None]] = {}  # user → their login ids, oldest first
        # Why a login ended when its token was revoked, for the page's next requests (the request
        # that found it out is often not the one whose answer the page shows); the newest only.
        self._ended: dict[str, str] = {}

    def create(self, user: str, authorization: str | None, cert: str | None = None) -> tuple[str, Login]:
        theirs = self._of.setdefault(user, {})
        while len(theirs) >= _MAX_LOGINS_PER_USER:
            self.drop(next(iter(theirs)))
        login_id = secrets.token_urlsafe(32)
        login = Login(user, authorization, cert, secrets.token_urlsafe(32), time.time() + LOGIN_SECONDS)
        self._by_id[login_id] = login
        self._of.setdefault(user, {})[login_id] = None
        return login_id, login

    def get(self, login_id: str | None) -> Login | None:
        login = self._by_id.get(login_id or "")
        if login is not None and login.expires < time.time():
            self.drop(login_id)
            return None
        return login

    def end(self, login_id: str | None, why: str) -> None:
        """Drop a login whose token no longer holds, remembering ``why`` for its cookie."""
        if login_id and login_id in self._by_id:
            self._ended[login_id] = why
            while len(self._ended) > _ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
        self.drop(login_id)

    def why_ended(self, login_id: str | None) -> str | None:
        """Why this cookie's login was ended by a revoke (``None``: never, or long ago)."""
        return self._ended.get(login_id or "")

    def drop(self, login_id: str | None) -> None:
        login = self._by_id.pop(login_id or "", None)
        if login is None:
            return
        theirs = self._of.get(login.user, {})
        theirs.pop(login_id or "", None)
        if not theirs:
            self._of.pop(login.user, None)


class LoginPace:
    """Logins paced per source address (a token bucket): ``admit`` waits until the address has a
    login left, or returns how many seconds to wait before trying again when too many already wait."""

    def __init__(self, burst: int = _LOGIN_BURST, rate: float = _LOGIN_RATE, waiting: int = _LOGIN_WAITING) -> None:
        self.burst, self.rate, self.waiting = burst, rate, waiting
        self._next: dict[str, float] = {}  # address → when its bucket is next full again (monotonic)
        self._waiting: dict[str, int] = {}

    async def admit(self, address: str) -> float:
        """0 once this login may go ahead; else the seconds to come back after (it was refused)."""
        now = time.monotonic()
        if len(self._next) > 10_000:  # addresses whose bucket is full again are forgotten
            self._next = {a: t for a, t in self._next.items() if t > now}
        full = max(self._next.get(address, now), now)  # the bucket is full at ``full``; each login adds 1/rate
        wait = full + 1 / self.rate - now - self.burst / self.rate
        if wait > 0 and self._waiting.get(address, 0) >= self.waiting:
            return wait
        self._next[address] = full + 1 / self.rate
        if wait > 0:
            self._waiting[address] = self._waiting.get(address, 0) + 1
            try:
                await asyncio.sleep(wait)
            finally:
                self._waiting[address] -= 1
                if not self._waiting[address]:
                    del self._waiting[address]
        return 0.0


class LoginBody(BaseModel):
    """A token, or the code of a one-time link."""

    token: str = ""
    code: str = ""


@dataclass(frozen=True)
class Viewer:
    identity: Identity
    login: Login
    login_id: str


def _viewer(request: Request) -> Viewer:
    """The person behind the request's login cookie; for a request that changes something, also its
    CSRF token in ``X-CSRF-Token`` (a page of another site can send the cookie's request, not read it)."""
    app: ServerApp = request.app.state.gpuport
    logins: Logins = request.app.state.logins
    login_id = request.cookies.get(COOKIE)
    login = logins.get(login_id)
    if login is None:
        raise AuthenticationError(
            logins.why_ended(login_id) or "not logged in to the dashboard (or the login expired): log in with a token"
        )
    if request.method not in ("GET", "HEAD"):
        sent = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(sent.encode(), login.csrf.encode()):
            raise PermissionDenied("this request lacks the dashboard's CSRF token: reload the page")
    try:
        identity = login.identity(app.auth)
    except AuthenticationError as e:
        logins.end(login_id, str(e))
        raise
    return Viewer(identity, login, login_id or "")


Seen = Annotated[Viewer, Depends(_viewer)]


def _static(name: str) -> Response:
    body = resources.files("gpuport.server").joinpath("dashboard", name).read_bytes()
    return Response(body, media_type=_STATIC[name], headers=_HEADERS)


def _gpus(app: ServerApp, who: Identity) -> list[dict[str, Any]]:
    listing = app.gpus(who)
    history = app.gpu_history.get()
    found = []
    for place, gpu in enumerate(listing.gpus):
        readings = history.get(app.gpu_history.key(gpu), [])
        found.append(
            {
                "key": app.gpu_history.key(gpu),
                "index": gpu.index,
                "node": gpu.node,
                "name": gpu.name,
                "memory_total": gpu.memory_total,
                "memory_used": gpu.memory_used,
                "utilization": gpu.utilization,
                "holders": [
                    {"job": a.job_id, "user": a.owner, "memory": a.memory, "memory_used": a.memory_used}
                    for a in listing.allocations.get(place, [])
                ],
                "history": [[r.at, r.utilization, r.memory_used] for r in readings],
            }
        )
    return found


# The usage panel's span: the last week's use, as `gpuport usage` shows it by default.
_USAGE_SPAN = 7 * 24 * 3600.0


def _usage(app: ServerApp, who: Identity) -> list[dict[str, Any]]:
    """The usage panel: each user's GPU-hours and CPU-hours over the last week, with their place
    in the fair share (``app.usage_report``: a user's own, an admin's everyone's). In a thread: the
    store's."""
    entries, fair = app.usage_report(who, time.time() - _USAGE_SPAN)
    standing = {f.user: f for f in fair}
    rows = []
    for user in sorted({e.user for e in entries} | standing.keys()):
        entry = next((e for e in entries if e.user == user), None)
        place = standing.get(user)
        rows.append(
            {
                "user": user,
                "runs": entry.runs if entry else 0,
                "gpu_hours": (entry.gpu_seconds if entry else 0.0) / 3600,
                "cpu_hours": (entry.cpu_seconds_reserved if entry else 0.0) / 3600,
                "shares": place.shares if place else None,
                "effective_share": place.effective_share if place else None,
                "decayed_use": place.decayed_use if place else None,
            }
        )
    return rows


def _environments(app: ServerApp, who: Identity) -> list[dict[str, Any]]:
    """The environments panel: what `gpuport envs` lists, to every user (environments are shared
    read-only; their package lists are no secret), with the jobs running in each now."""
    listing, _ = app.list_environments(who)
    keys = ("hash", "python_version", "packages", "size", "created_at", "last_used", "jobs", "running", "layered")
    return [{key: m[key] for key in keys} for m in listing]


@dataclass(frozen=True)
class Board:
    """What the dashboard reads in a thread (NVML, the store, the disk): GPUs, usage, environments."""

    gpus: list[dict[str, Any]]
    usage: list[dict[str, Any]]
    environments: list[dict[str, Any]]


def _board(app: ServerApp, who: Identity) -> Board:
    return Board(_gpus(app, who), _usage(app, who), _environments(app, who))


def _job(job: Any) -> dict[str, Any]:
    return {
        "id": job.id,
        "owner": job.owner,
        "name": job.name,
        "state": job.state.value,
        "command": job.command,
        "gpus": job.gpus,
        "gpu_memory": job.gpu_memory,
        "cpus": job.cpus,
        "memory": job.memory,
        "nodes": job.nodes,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "ended_at": job.ended_at,
        "exit_code": job.exit_code,
        "message": job.message,
        "position": job.position,
    }


@dataclass(frozen=True)
class JobsView:
    """Which jobs the dashboard's table shows: those in ``state``, whose name or id holds ``name``
    (any case), of ``user`` (admins: anyone's), page ``page`` of JOBS_PER_PAGE."""

    state: str = ""
    name: str = ""
    user: str = ""
    page: int = 1


def jobs_page(app: ServerApp, who: Identity, view: JobsView) -> dict[str, Any]:
    """One page of the jobs ``who`` sees (every user's, for an admin), as ``view`` filters them, with
    their count; a filter the API refuses (a state it does not know, another's jobs for a non-admin)
    is an empty page that says why."""
    try:
        jobs = app.jobs.list_for(who, all=who.admin, states=[view.state] if view.state else (), user=view.user)
    except GpuportError as e:
        return {"jobs": [], "total": 0, "page": 1, "pages": 1, "per_page": JOBS_PER_PAGE, "error": str(e)}
    if view.name:
        wanted = view.name.casefold()
        jobs = [j for j in jobs if wanted in j.name.casefold() or wanted in j.id]
    pages = max(1, -(-len(jobs) // JOBS_PER_PAGE))
    page = min(max(1, view.page), pages)
    shown = jobs[(page - 1) * JOBS_PER_PAGE : page * JOBS_PER_PAGE]
    return {
        "jobs": [_job(j) for j in shown],
        "total": len(jobs),
        "page": page,
        "pages": pages,
        "per_page": JOBS_PER_PAGE,
        "error": "",
    }


def _jobs_view(state: str = "", name: str = "", user: str = "", page: int = 1) -> JobsView:
    return JobsView(state.strip(), name.strip(), user.strip(), page)


# The query of a route that shows jobs: ?state=&name=&user=&page=
Jobs = Annotated[JobsView, Depends(_jobs_view)]


def state_for(app: ServerApp, who: Identity, board: Board, view: JobsView) -> dict[str, Any]:
    """What the dashboard shows ``who``: what the API would answer them. On the event loop, as the
    API's routes: the queue's pass and the services' in-memory state are the loop's; ``board``, read
    in a thread (``_board``: NVML, the store and the disk, as the watchdog reads them), comes with it:
    the GPUs, the usage panel's rows, the environments; the jobs are the page of them that ``view``
    asks for."""
    models = []
    stats = {(r.name, r.version): t for r, t in app.serving.statistics()}
    for record in app.serving.list():
        timings = stats.get((record.name, record.version))
        batches = sum(infer.count for _, infer, _ in timings.batches.values()) if timings else 0
        rows = sum(size * infer.count for size, (_, infer, _) in timings.batches.items()) if timings else 0
        models.append(
            {
                "name": record.name,
                "version": record.version,
                "owner": record.owner,
                "state": record.state,
                "message": message_for(record, who),
                "format": record.format,
                "mine": record.owner == who.name or who.admin,
                "nodes": record.nodes if record.owner == who.name or who.admin else [],  # as Models.List
                "requests": timings.success.count if timings else 0,
                "failed": timings.fail.count if timings else 0,
                "latency_ns": timings.success.ns if timings else 0,
                "batches": batches,
                "rows": rows,
            }
        )
    return {
        "at": time.time(),
        "user": who.name,
        "admin": who.admin,
        "gpus": board.gpus,
        "queue": [_job(j) for j in app.jobs.queue(who)],
        "jobs": jobs_page(app, who, view),
        "sessions": [
            {
                "id": s.id,
                "name": s.name,
                "owner": s.owner,
                "state": s.state,
                "created_at": s.created_at,
                "last_call_at": s.last_call_at,
                "refs": s.refs,
                "node": s.job.node,
                "gpus": s.job.gpus,
                "gpu_memory": s.job.gpu_memory,
            }
            for s in app.sessions.list_for(who)
        ],
        "models": models,
        "usage": board.usage,
        "environments": board.environments,
    }


def _sse(data: Any, event: str = "") -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def add_dashboard_routes(api: FastAPI, app: ServerApp) -> None:
    api.state.logins = Logins()
    api.state.login_pace = LoginPace()
    hidden = {"include_in_schema": False}

    @api.get("/", **hidden)
    async def index() -> Response:
        return _static("index.html")

    @api.get("/ui/static/{name}", **hidden)
    async def static(name: str) -> Response:
        if name not in _STATIC or name == "index.html":
            return Response(status_code=404, headers=_HEADERS)
        return _static(name)

    @api.post(LOGIN_PATH, **hidden)
    async def login(body: LoginBody, request: Request) -> Response:
        if body.code:
            identity, authorization, cert = app.login_codes.redeem(body.code.strip())
        else:
            authorization, cert = f"Bearer {body.token.strip()}", None
            identity = app.auth.authenticate(authorization)
        login_id, made = request.app.state.logins.create(identity.name, authorization, cert)
        response = Response(
            json.dumps({"user": identity.name, "admin": identity.admin, "csrf": made.csrf}),
            media_type="application/json",
            headers=_HEADERS,
        )
        secure = request.url.scheme == "https"
        response.set_cookie(
            COOKIE, login_id, max_age=LOGIN_SECONDS, path="/", secure=secure, httponly=True, samesite="strict"
        )
        return response

    @api.get("/ui/me", **hidden)
    async def me(viewer: Seen) -> dict[str, Any]:
        return {"user": viewer.identity.name, "admin": viewer.identity.admin, "csrf": viewer.login.csrf}

    @api.post("/ui/logout", **hidden)
    async def logout(viewer: Seen, request: Request) -> Response:
        request.app.state.logins.drop(viewer.login_id)
        response = Response(status_code=204, headers=_HEADERS)
        response.delete_cookie(COOKIE, path="/", secure=request.url.scheme == "https", httponly=True, samesite="strict")
        return response

    @api.get("/ui/state", **hidden)
    async def state(viewer: Seen, view: Jobs) -> dict[str, Any]:
        board = await asyncio.to_thread(_board, app, viewer.identity)
        return state_for(app, viewer.identity, board, view)

    @api.get("/ui/events", **hidden)
    async def events(viewer: Seen, view: Jobs, request: Request) -> StreamingResponse:
        def revoked() -> str:
            """Why the page's login no longer holds ('': it holds)."""
            try:
                viewer.login.identity(app.auth)
            except GpuportError as e:
                return str(e)
            return ""

        async def stream() -> AsyncIterator[bytes]:
            # A revoke ends the page within a moment, not a round later (reading the board can take
            # seconds on a busy machine): the login is looked at again while it is read and between.
            while not await request.is_disconnected():
                try:
                    identity = viewer.login.identity(app.auth)
                except GpuportError as e:
                    yield _sse({"error": str(e)}, "ended")
                    return
                reading = asyncio.ensure_future(asyncio.to_thread(_board, app, identity))
                while not reading.done():
                    await asyncio.wait({reading}, timeout=_REVOKE_CHECK)
                    if not reading.done() and (why := revoked()):
                        yield _sse({"error": why}, "ended")
                        return
                yield _sse(state_for(app, identity, reading.result(), view))
                for _ in range(round(EVENT_SECONDS / _REVOKE_CHECK)):
                    await asyncio.sleep(_REVOKE_CHECK)
                    if why := revoked():
                        yield _sse({"error": why}, "ended")
                        return

        return StreamingResponse(stream(), media_type="text/event-stream", headers=_HEADERS)

    @api.get("/ui/jobs/{job_id}/log", **hidden)
    async def job_log(job_id: str, viewer: Seen, offset: int = 0) -> StreamingResponse:
        app.jobs.get(viewer.identity, job_id)  # NotFound before the stream starts: another's job is not there

        async def stream() -> AsyncIterator[bytes]:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character cut short waits for its end
            try:
                chunks = app.jobs.logs(viewer.identity, job_id, offset, True)
                async for at, data in app.until_revoked(viewer.identity.name, chunks):
                    text = decoder.decode(data)
                    if text:
                        yield _sse({"offset": at + len(data), "text": text})
            except GpuportError as e:
                yield _sse({"error": str(e)}, "ended")
                return
            if tail := decoder.decode(b"", final=True):
                yield _sse({"text": tail})
            yield _sse(_job(app.jobs.get(viewer.identity, job_id)), "ended")

        return StreamingResponse(stream(), media_type="text/event-stream", headers=_HEADERS)

    # A job's outputs, as the REST API gives them (rest_files.py), to the login: a link of the page
    # downloads them. GETs, which change nothing: the cookie alone (SameSite=Strict) is enough.
    @api.get("/ui/jobs/{job_id}/outputs", **hidden)
    async def outputs(job_id: str, viewer: Seen) -> Response:
        listing = rest_files.listing(rest_files.job_outputs(app, viewer.identity, job_id))
        return Response(json.dumps(listing), media_type="application/json", headers=_HEADERS)

    @api.get("/ui/jobs/{job_id}/outputs.tar.gz", **hidden)
    async def outputs_archive(job_id: str, viewer: Seen) -> StreamingResponse:
        return rest_files.archive_response(app, viewer.identity, job_id, _HEADERS)

    @api.get("/ui/jobs/{job_id}/outputs/{path:path}", **hidden)
    async def output_file(job_id: str, path: str, viewer: Seen) -> StreamingResponse:
        return rest_files.file_response(app, viewer.identity, job_id, path, _HEADERS)

    @api.post("/ui/jobs/{job_id}/cancel", **hidden)
    async def cancel(job_id: str, viewer: Seen) -> dict[str, Any]:
        return _job(app.jobs.cancel(viewer.identity, job_id))

    @api.post("/ui/sessions/{session_id}/close", **hidden)
    async def close_session(session_id: str, viewer: Seen) -> dict[str, Any]:
        record = app.sessions.close(viewer.identity, session_id=session_id)
        return {"id": record.id, "state": record.state}

    @api.post("/ui/models/{name}/{version}/undeploy", **hidden)
    async def undeploy(name: str, version: int, viewer: Seen) -> list[dict[str, Any]]:
        return [{"name": r.name, "version": r.version} for r in app.serving.undeploy(viewer.identity, name, version)]
