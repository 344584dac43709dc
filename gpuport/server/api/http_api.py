"""HTTP routes (FastAPI): the REST API under ``/v1``, behind the same tokens as gRPC.

Errors come out as ``{"error": {"type": "NotFound", "message": "..."}}`` with the HTTP status from
``ERROR_TABLE``. OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from gpuport._version import __version__
from gpuport.protocol.errors import AuthenticationError, GpuportError, InvalidRequest, ServerError, status_for
from gpuport.server.app import ServerApp
from gpuport.server.services.auth import Identity

log = logging.getLogger(__name__)


class TokenCreate(BaseModel):
    name: str
    admin: bool = False


_bearer = HTTPBearer(auto_error=False)


def _caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Identity:
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    server: ServerApp = request.app.state.gpuport
    return server.auth.authenticate(header)


# A route parameter of this type is the authenticated caller.
Caller = Annotated[Identity, Depends(_caller)]


def _error_response(error: GpuportError) -> JSONResponse:
    _, http_status = status_for(error)
    return JSONResponse({"error": {"type": type(error).__name__, "message": str(error)}}, status_code=http_status)


def build_http_app(app: ServerApp) -> FastAPI:
    api = FastAPI(title="gpuport", version=__version__, description="GPU over IP: the gpuport server's REST API.")
    api.state.gpuport = app

    @api.exception_handler(GpuportError)
    async def _gpuport_error(request: Request, error: GpuportError) -> JSONResponse:
        if isinstance(error, AuthenticationError):
            client = request.client.host if request.client else "?"
            log.warning("rejected %s %s from %s: %s", request.method, request.url.path, client, error)
        return _error_response(error)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        return _error_response(InvalidRequest(f"malformed request: {problems}"))

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error_response(ServerError("internal server error — the server's log has the details"))

    @api.get("/v1/health", summary="Liveness; needs no token")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    @api.get("/v1/whoami", summary="The identity behind the token")
    async def whoami(identity: Caller) -> dict[str, Any]:
        return {"user": identity.name, "admin": identity.admin}

    @api.get("/v1/status", summary="Server, machine and GPUs")
    async def status(identity: Caller) -> dict[str, Any]:
        return dataclasses.asdict(app.status(identity))

    @api.get("/v1/gpus", summary="Each GPU, read live")
    async def gpus(identity: Caller) -> dict[str, Any]:
        return dataclasses.asdict(app.gpus(identity))

    @api.get("/v1/tokens", summary="Tokens (admin)")
    async def list_tokens(identity: Caller, include_revoked: bool = False) -> list[dict[str, Any]]:
        return [dataclasses.asdict(r) for r in app.auth.list(identity, include_revoked)]

    @api.post("/v1/tokens", status_code=201, summary="Create a token (admin); the token is shown once")
    async def create_token(body: TokenCreate, identity: Caller) -> dict[str, Any]:
        record, token = app.auth.create(identity, body.name, body.admin)
        return {**dataclasses.asdict(record), "token": token}

    @api.delete("/v1/tokens/{name}", summary="Revoke a token (admin)")
    async def revoke_token(name: str, identity: Caller) -> dict[str, Any]:
        return dataclasses.asdict(app.auth.revoke(identity, name))

    return api
