"""gRPC servicers: authenticate, convert messages, call ``ServerApp``; errors leave through ``rpc``."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gpuport._version import __version__
from gpuport.defaults import MAX_MESSAGE_BYTES
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol import gpuport_pb2_grpc as pb_grpc
from gpuport.protocol.errors import ERROR_METADATA_KEY, AuthenticationError, GpuportError, ServerError, status_for
from gpuport.server.app import GpuListing, ServerApp
from gpuport.server.services.auth import Identity, TokenRecord

log = logging.getLogger(__name__)
_EMPTY = pb.Empty()

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value  # type: ignore[no-any-return]
    return None


def rpc(method: Handler) -> Handler:
    """Authenticate the caller, pass its ``Identity`` to ``method``, and turn errors into statuses.

    A ``GpuportError`` becomes its status from ``ERROR_TABLE`` with its message; anything else is
    logged here with its traceback and reaches the caller only as "internal error".
    """

    @functools.wraps(method)
    async def wrapper(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            identity = self.app.auth.authenticate(_authorization(context))
            return await method(self, request, identity)
        except AuthenticationError as e:
            log.warning("rejected a call to %s from %s: %s", method.__name__, context.peer(), e)
            error: GpuportError = e
        except GpuportError as e:
            error = e
        except Exception:
            log.exception("%s failed", method.__qualname__)
            error = ServerError("internal server error — the server's log has the details")
        code, _ = status_for(error)
        await context.abort(code, str(error), trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),))

    return wrapper  # type: ignore[return-value]


class _Servicer:
    def __init__(self, app: ServerApp) -> None:
        self.app = app


def gpu_list_message(listing: GpuListing) -> pb.GpuList:
    return pb.GpuList(
        inventory=listing.inventory,
        note=listing.note,
        gpus=[
            pb.Gpu(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_total=g.memory_total,
                memory_used=g.memory_used,
                utilization=-1 if g.utilization is None else g.utilization,
                processes=[pb.GpuProcess(pid=p.pid, memory_used=p.memory_used, job_id=p.job_id) for p in g.processes],
                jobs=g.jobs,
            )
            for g in listing.gpus
        ],
    )


def token_message(record: TokenRecord) -> pb.TokenInfo:
    return pb.TokenInfo(
        name=record.name, admin=record.admin, created_at=record.created_at, revoked_at=record.revoked_at or 0.0
    )


class ControlServicer(_Servicer, pb_grpc.ControlServicer):
    @rpc
    async def Hello(self, request: pb.HelloRequest, caller: Identity) -> pb.HelloReply:
        return pb.HelloReply(
            server_version=__version__,
            python_version=self.app.python_version,
            hostname=self.app.hostname,
            user=caller.name,
            admin=caller.admin,
        )

    @rpc
    async def Ping(self, request: pb.Empty, caller: Identity) -> pb.Empty:
        return _EMPTY

    @rpc
    async def Status(self, request: pb.Empty, caller: Identity) -> pb.StatusReply:
        s = self.app.status(caller)
        return pb.StatusReply(
            server_version=s.server_version,
            python_version=s.python_version,
            hostname=s.hostname,
            started_at=s.started_at,
            cpus=s.cpus,
            memory_total=s.memory_total,
            memory_available=s.memory_available,
            gpus=gpu_list_message(s.gpus),
            user=s.user,
            admin=s.admin,
        )

    @rpc
    async def ListGpus(self, request: pb.Empty, caller: Identity) -> pb.GpuList:
        return gpu_list_message(self.app.gpus(caller))


class TokensServicer(_Servicer, pb_grpc.TokensServicer):
    @rpc
    async def Create(self, request: pb.CreateTokenRequest, caller: Identity) -> pb.CreateTokenReply:
        record, token = self.app.auth.create(caller, request.name, request.admin)
        return pb.CreateTokenReply(info=token_message(record), token=token)

    @rpc
    async def List(self, request: pb.ListTokensRequest, caller: Identity) -> pb.TokenList:
        records = self.app.auth.list(caller, include_revoked=request.include_revoked)
        return pb.TokenList(tokens=[token_message(r) for r in records])

    @rpc
    async def Revoke(self, request: pb.RevokeTokenRequest, caller: Identity) -> pb.TokenInfo:
        return token_message(self.app.auth.revoke(caller, request.name))


def build_grpc_server(
    app: ServerApp, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> tuple[grpc.aio.Server, int]:
    """Build the gRPC server for ``app`` bound to ``host:port`` (0 picks a free port); returns it and its port.

    ``credentials`` None means plaintext, which the caller allows only on loopback.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_ControlServicer_to_server(ControlServicer(app), server)
    pb_grpc.add_TokensServicer_to_server(TokensServicer(app), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    return server, bound
