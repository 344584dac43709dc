"""gRPC servicers: authenticate, convert messages, call ``ServerApp``; errors leave through ``rpc``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import cloudpickle
import grpc

from gpuport._version import __version__
from gpuport.defaults import BLOB_BATCH_BYTES, MAX_MESSAGE_BYTES, MAX_SNAPSHOT_FILES, STREAM_WINDOW_BYTES
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol import gpuport_pb2_grpc as pb_grpc
from gpuport.protocol.errors import (
    ERROR_METADATA_KEY,
    AuthenticationError,
    GpuportError,
    InvalidRequest,
    NotFound,
    ServerError,
    status_for,
)
from gpuport.server.api.callers import grpc_caller, grpc_credentials
from gpuport.server.api.serving_grpc import add_serving_services
from gpuport.server.app import GpuListing, ServerApp
from gpuport.server.blobs import check_hash, read_parts
from gpuport.server.environments import EnvRequest
from gpuport.server.services.auth import Identity, TokenRecord
from gpuport.server.services.job_requests import JobRequest, tf_roles
from gpuport.server.services.jobs import ArrayRecord, JobRecord
from gpuport.server.services.quotas import QuotaRecord
from gpuport.server.services.serving import DeploymentRecord, DeploySpec, message_for
from gpuport.server.services.sessions import CallIn, CallOut, SessionRecord, SessionSpec, Value
from gpuport.server.services.snapshots import Entry, SnapshotRecord

log = logging.getLogger(__name__)
_EMPTY = pb.Empty()
# Upload messages (about BLOB_BATCH_BYTES each) received ahead of the one being written.
_UPLOAD_QUEUE = 4

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


async def _fail(context: grpc.aio.ServicerContext, method: Callable[..., Any], error: Exception) -> None:
    """End the call with ``error``'s status from ``ERROR_TABLE``; anything not a ``GpuportError`` is
    logged here with its traceback and reaches the caller only as "internal error"."""
    if isinstance(error, AuthenticationError):
        log.warning("rejected a call to %s from %s: %s", method.__name__, context.peer(), error)
    elif not isinstance(error, GpuportError):
        log.error("%s failed", method.__qualname__, exc_info=error)
        error = ServerError("internal server error — the server's log has the details")
    code, _ = status_for(error)  # type: ignore[arg-type]
    await context.abort(code, str(error), trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),))


def rpc(method: Handler) -> Handler:
    """Authenticate the caller, pass its ``Identity`` to ``method``, and turn errors into statuses.

    For a client-streaming method the request is the stream: the caller is checked before its first
    message is read.
    """

    @functools.wraps(method)
    async def wrapper(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            identity = grpc_caller(self.app.auth, context)
            return await method(self, request, identity)
        except Exception as e:
            await _fail(context, method, e)

    return wrapper  # type: ignore[return-value]


def stream_rpc(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """``rpc`` for server-streaming methods: the same authentication and error mapping, around a generator."""

    @functools.wraps(method)
    async def wrapper(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            identity = grpc_caller(self.app.auth, context)
            async for reply in self.app.until_revoked(identity.name, method(self, request, identity)):
                yield reply
        except Exception as e:
            await _fail(context, method, e)

    return wrapper


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
                allocations=[
                    pb.GpuAllocation(job_id=a.job_id, owner=a.owner, memory=a.memory, memory_used=a.memory_used)
                    for a in listing.allocations.get(place, ())
                ],
                node=g.node,
            )
            for place, g in enumerate(listing.gpus)
        ],
    )


def token_message(record: TokenRecord) -> pb.TokenInfo:
    return pb.TokenInfo(
        name=record.name,
        admin=record.admin,
        created_at=record.created_at,
        revoked_at=record.revoked_at or 0.0,
        scrape=record.scope == "metrics",
    )


class ControlServicer(_Servicer, pb_grpc.ControlServicer):
    @rpc
    async def ListEnvironments(self, request: pb.EnvironmentsRequest, caller: Identity) -> pb.EnvironmentList:
        listing, removed = await asyncio.to_thread(self.app.list_environments, caller, request.prune)
        envs = [
            pb.Environment(
                hash=m["hash"],
                size=m["size"],
                python_version=m["python_version"],
                created_at=m["created_at"],
                last_used=m["last_used"],
                jobs=m["jobs"],
                layered=m["layered"],
                packages=m["packages"],
            )  # fmt: skip
            for m in listing
        ]
        return pb.EnvironmentList(environments=envs, removed=removed)

    @rpc
    async def Hello(self, request: pb.HelloRequest, caller: Identity) -> pb.HelloReply:
        return pb.HelloReply(
            server_version=__version__,
            python_version=self.app.python_version,
            hostname=self.app.hostname,
            user=caller.name,
            admin=caller.admin,
            cloudpickle_version=cloudpickle.__version__,
            data_port=self.app.sessions.data_port,
        )

    @rpc
    async def Ping(self, request: pb.Empty, caller: Identity) -> pb.Empty:
        return _EMPTY

    @rpc
    async def Status(self, request: pb.Empty, caller: Identity) -> pb.StatusReply:
        s = await asyncio.to_thread(self.app.status, caller)  # its GPUs: read on the nodes
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
        return gpu_list_message(await asyncio.to_thread(self.app.gpus, caller))  # read on the nodes

    async def CreateDashboardLink(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DashboardLink | None:
        """A one-time login code standing for the credential of this very call (hence not ``rpc``,
        which passes on the identity only)."""
        try:
            authorization, cert = grpc_credentials(context)
            caller = self.app.auth.authenticate(authorization, cert)
            if not self.app.http_port:
                raise ServerError("this server's HTTP port (the dashboard's) is not listening")
            code = self.app.login_codes.create(caller, authorization, cert)
            return pb.DashboardLink(code=code, expires_in=self.app.login_codes.seconds, http_port=self.app.http_port)
        except Exception as e:  # noqa: BLE001 - as in ``rpc``: every error leaves through _fail
            await _fail(context, self.CreateDashboardLink, e)
            return None


class TokensServicer(_Servicer, pb_grpc.TokensServicer):
    @rpc
    async def Create(self, request: pb.CreateTokenRequest, caller: Identity) -> pb.CreateTokenReply:
        record, token, cert = await self.app.create_token(
            caller, request.name, request.admin, request.client_cert, request.scrape
        )
        reply = pb.CreateTokenReply(info=token_message(record), token=token)
        if cert is not None:
            reply.cert_pem, reply.key_pem = cert.cert_pem.decode(), cert.key_pem.decode()
            reply.server_cert_pem = self.app.state.cert_path.read_text()
            reply.cert_port = self.app.cert_port
        return reply

    @rpc
    async def List(self, request: pb.ListTokensRequest, caller: Identity) -> pb.TokenList:
        records = self.app.auth.list(caller, include_revoked=request.include_revoked)
        return pb.TokenList(tokens=[token_message(r) for r in records])

    @rpc
    async def Revoke(self, request: pb.RevokeTokenRequest, caller: Identity) -> pb.TokenInfo:
        return token_message(self.app.revoke_token(caller, request.name, request.end_work))


def snapshot_message(record: SnapshotRecord, entries: list[Entry] | None = None) -> pb.Snapshot:
    return pb.Snapshot(
        snapshot_id=record.id,
        name=record.name,
        created_at=record.created_at,
        files=record.files,
        bytes=record.bytes,
        entries=[
            pb.ManifestEntry(path=e.path, blob=e.blob, size=e.size, mode=e.mode, link=e.link) for e in entries or ()
        ],
    )


class SnapshotsServicer(_Servicer, pb_grpc.SnapshotsServicer):
    @rpc
    async def Create(self, request: pb.CreateSnapshotRequest, caller: Identity) -> pb.CreateSnapshotReply:
        entries = [Entry(e.path, e.blob, e.size, e.mode & 0o777, e.link) for e in request.entries]
        record, missing = self.app.snapshots.create(caller, entries, request.name)
        if record is None:
            return pb.CreateSnapshotReply(missing=missing)
        return pb.CreateSnapshotReply(snapshot_id=record.id, files=record.files, bytes=record.bytes)

    @rpc
    async def Name(self, request: pb.NameSnapshotRequest, caller: Identity) -> pb.CreateSnapshotReply:
        record = self.app.snapshots.name(caller, request.snapshot_id, request.name)
        return pb.CreateSnapshotReply(snapshot_id=record.id, files=record.files, bytes=record.bytes)

    @rpc
    async def Missing(self, request: pb.BlobList, caller: Identity) -> pb.BlobList:
        if len(request.blobs) > MAX_SNAPSHOT_FILES:
            raise InvalidRequest(f"{len(request.blobs)} blobs asked about at once; the limit is {MAX_SNAPSHOT_FILES}")
        for blob in request.blobs:
            check_hash(blob)
        missing = self.app.snapshots.missing(caller, request.blobs)
        if len(request.sizes) == len(request.blobs):  # a push says how much it brings: refused now, if too much
            sizes = dict(zip(request.blobs, request.sizes, strict=True))
            adding = sum(max(0, sizes[blob]) for blob in missing)
            await asyncio.to_thread(self.app.storage.check, caller.name, adding, "this push")
        return pb.BlobList(blobs=missing)

    @rpc
    async def Get(self, request: pb.SnapshotRef, caller: Identity) -> pb.Snapshot:
        record = self.app.snapshots.resolve(caller, request.snapshot_id, request.name)
        return snapshot_message(record, self.app.snapshots.manifest(record))

    @rpc
    async def List(self, request: pb.Empty, caller: Identity) -> pb.SnapshotList:
        return pb.SnapshotList(snapshots=[snapshot_message(r) for r in self.app.snapshots.named(caller)])

    @rpc
    async def Delete(self, request: pb.SnapshotRef, caller: Identity) -> pb.Snapshot:
        record = await asyncio.to_thread(self.app.snapshots.remove, caller, request.name, request.snapshot_id)
        return snapshot_message(record)

    @rpc
    async def Upload(self, requests: AsyncIterator[pb.BlobBatch], caller: Identity) -> pb.UploadReply:
        left = await asyncio.to_thread(self.app.storage.left, caller.name)
        writer = self.app.blobs.writer(budget=left)
        # Receiving (on the event loop) and writing + hashing (in a thread) overlap through a small
        # queue; one after the other, an upload ran at half the speed.
        queue: asyncio.Queue[pb.BlobBatch | None] = asyncio.Queue(maxsize=_UPLOAD_QUEUE)

        async def receive() -> None:
            try:
                async for batch in requests:
                    await queue.put(batch)
            except Exception:
                await queue.put(None)  # a broken stream: the writer stops, then `await receiver` raises
                raise
            await queue.put(None)

        receiver = asyncio.create_task(receive())
        writing: asyncio.Future[None] | None = None
        try:
            while (batch := await queue.get()) is not None:
                writing = asyncio.ensure_future(asyncio.to_thread(writer.write, batch.parts))
                await asyncio.shield(writing)  # a cancel stops the wait, not the write (see below)
            await receiver
            writer.finish()
        except BaseException:
            receiver.cancel()
            if writing is not None and not writing.done():
                # A cancelled call (the client went away) stops waiting here, but the thread goes on
                # writing: the part it may be creating is removed only once it is done.
                await asyncio.wait([writing])
            writer.abort()
            raise
        finally:  # the blobs whose bytes arrived whole are the caller's, even from a stream cut short,
            # unless it went past their storage quota: then none is (the sweep removes them)
            self.app.transfers.add("snapshots", "in", writer.bytes)
            if not writer.over:
                await asyncio.to_thread(self.app.snapshots.hold, caller.name, writer.placed)
        return pb.UploadReply(blobs=len(writer.placed), bytes=writer.bytes)

    @stream_rpc
    async def Download(self, request: pb.DownloadRequest, caller: Identity) -> AsyncIterator[pb.BlobBatch]:
        record = self.app.snapshots.resolve(caller, request.snapshot_id)
        owned = {e.blob for e in self.app.snapshots.manifest(record)}
        for blob in request.blobs:
            check_hash(blob)
            if blob not in owned:
                raise NotFound(f"blob {blob} is not part of snapshot {record.id}")
        parts = read_parts(self.app.blobs, request.blobs, BLOB_BATCH_BYTES)
        while True:
            batch = await asyncio.to_thread(_read_batch, parts)
            if not batch.parts:
                return
            self.app.transfers.add("snapshots", "out", sum(len(p.data) for p in batch.parts))
            yield batch


def _read_batch(parts: Any) -> pb.BlobBatch:
    """Parts from ``parts`` until about BLOB_BATCH_BYTES are gathered (small files share a message)."""
    batch = pb.BlobBatch()
    size = 0
    for blob, offset, data, last in parts:
        batch.parts.append(pb.BlobPart(blob=blob, offset=offset, data=data, last=last))
        size += len(data) + 100
        if size >= BLOB_BATCH_BYTES:
            break
    return batch


def job_message(job: JobRecord) -> pb.JobInfo:
    return pb.JobInfo(
        job_id=job.id,
        name=job.name,
        owner=job.owner,
        state=job.state.value,
        command=job.command,
        gpus=job.gpus,
        gpu_indices=job.gpu_indices,
        created_at=job.created_at,
        started_at=job.started_at or 0.0,
        ended_at=job.ended_at or 0.0,
        has_exit_code=job.exit_code is not None,
        exit_code=job.exit_code or 0,
        message=job.message,
        snapshot_id=job.snapshot_id,
        output_snapshot_id=job.output_snapshot_id,
        outputs=job.outputs,
        log_bytes=job.log_bytes,
        time_limit=job.time_limit,
        gpu_memory=job.gpu_memory,
        cpus=job.cpus,
        memory=job.memory,
        priority=job.priority,
        nprocs=job.nprocs,
        position=job.position,
        node=job.node,
        array_id=job.array_id,
        array_index=job.array_index or 0,
        environment=job.environment,
        preemptible=job.preemptible,
        preemptions=job.preemptions,
        retried=job.retried,
    )


def array_message(array: ArrayRecord) -> pb.ArrayInfo:
    return pb.ArrayInfo(
        array_id=array.id,
        name=array.name,
        owner=array.owner,
        spec=array.spec,
        max_running=array.max_running,
        created_at=array.created_at,
        sweep=[pb.SweepParameter(name=k, values=v) for k, v in array.sweep.items()],
        tasks=[job_message(t) for t in array.tasks],
    )


def job_request(request: pb.JobSpec) -> JobRequest:
    """A ``JobSpec`` from the wire as the job service takes it."""
    hyperparameters = None
    if request.hyperparameters_json:
        try:
            hyperparameters = json.loads(request.hyperparameters_json)
        except ValueError as e:
            raise InvalidRequest(f"hyperparameters are not valid JSON: {e}") from None
    return JobRequest(
        command=list(request.command),
        shell=request.shell,
        snapshot_id=request.snapshot_id,
        project=request.project,
        datasets=list(request.datasets),
        gpus=request.gpus,
        env=dict(request.env),
        outputs=list(request.outputs),
        name=request.name,
        hyperparameters=hyperparameters,
        time_limit=request.time_limit,
        gpu_memory=request.gpu_memory,
        cpus=request.cpus,
        memory=request.memory,
        priority=request.priority,
        nprocs=request.nodes * (request.nprocs_per_node or 1) if request.nodes > 1 else request.nprocs or 1,
        tf_roles=tf_roles(dict(request.tf_roles)),
        retries=request.retries,
        retry_on_exit=list(request.retry_on_exit),
        preemptible=request.preemptible if request.HasField("preemptible") else None,
        checkpoint=request.checkpoint,
        nodes=request.nodes or 1,
        after=list(request.after),
        partition=request.partition,
        batch_script=request.batch_script,
        environment=EnvRequest(hash=request.environment)
        if request.environment
        else EnvRequest(request.requirements, tuple(request.env_groups), request.python, request.isolated_env)
        if request.requirements
        else None,
    )


# The longest a Wait call blocks; clients that wait longer call again.
_MAX_WAIT = 300.0


class JobsServicer(_Servicer, pb_grpc.JobsServicer):
    @rpc
    async def Submit(self, request: pb.JobSpec, caller: Identity) -> pb.JobInfo:
        job = job_request(request)
        checked = await asyncio.to_thread(self.app.jobs.check, caller, job)  # a cluster's admission may block
        return job_message(self.app.jobs.submit(caller, job, checked))

    @rpc
    async def Get(self, request: pb.JobRef, caller: Identity) -> pb.JobInfo:
        return job_message(self.app.jobs.get(caller, request.job_id))

    @rpc
    async def List(self, request: pb.ListJobsRequest, caller: Identity) -> pb.JobList:
        jobs = self.app.jobs.list_for(
            caller, all=request.all, name=request.name, states=list(request.states), user=request.user
        )
        return pb.JobList(jobs=[job_message(j) for j in jobs])

    @stream_rpc
    async def Logs(self, request: pb.LogsRequest, caller: Identity) -> AsyncIterator[pb.LogChunk]:
        tail = request.tail if request.HasField("tail") else None
        async for offset, data in self.app.jobs.logs(caller, request.job_id, request.offset, request.follow, tail):
            yield pb.LogChunk(offset=offset, data=data)

    @rpc
    async def Wait(self, request: pb.WaitRequest, caller: Identity) -> pb.JobInfo:
        timeout = min(max(request.timeout, 0.0), _MAX_WAIT) if request.timeout else _MAX_WAIT
        return job_message(await self.app.jobs.wait(caller, request.job_id, timeout))

    @rpc
    async def Cancel(self, request: pb.JobRef, caller: Identity) -> pb.JobInfo:
        return job_message(self.app.jobs.cancel(caller, request.job_id))

    @rpc
    async def Queue(self, request: pb.Empty, caller: Identity) -> pb.JobList:
        return pb.JobList(jobs=[job_message(j) for j in self.app.jobs.queue(caller)])

    @rpc
    async def Outputs(self, request: pb.JobRef, caller: Identity) -> pb.JobOutputs:
        job, snapshot, missing = await self.app.jobs.outputs(caller, request.job_id)
        return pb.JobOutputs(job=job_message(job), snapshot_id=snapshot, missing=missing)

    @rpc
    async def SubmitArray(self, request: pb.ArraySpec, caller: Identity) -> pb.ArrayInfo:
        sweep = {p.name: list(p.values) for p in request.sweep}
        if len(sweep) != len(request.sweep):
            raise InvalidRequest("a sweep parameter is given twice: give each once, with all its values")
        job = job_request(request.job)
        checked = await asyncio.to_thread(self.app.jobs.check, caller, job)  # a cluster's admission may block
        array = self.app.jobs.submit_array(caller, job, request.array, sweep, checked)
        return array_message(array)

    @rpc
    async def GetArray(self, request: pb.JobRef, caller: Identity) -> pb.ArrayInfo:
        return array_message(self.app.jobs.array(caller, request.job_id))

    @rpc
    async def CancelArray(self, request: pb.JobRef, caller: Identity) -> pb.ArrayInfo:
        return array_message(self.app.jobs.cancel_array(caller, request.job_id))

    @rpc
    async def Reach(self, request: pb.ReachRequest, caller: Identity) -> pb.TransferTicket:
        if request.exec:
            kind = "exec"
        elif 1 <= request.port <= 65535:
            kind = f"forward:{request.port}"
        else:
            raise InvalidRequest(f"port {request.port}: give a TCP port from 1 to 65535")
        job = self.app.jobs.reachable(caller, request.job_id)
        if not self.app.sessions.data_port:
            raise InvalidRequest("this server has no data port, which forwards and `gpuport exec` go through")
        ticket = self.app.sessions.staging.ticket(job.id, kind, caller)
        return pb.TransferTicket(ticket=ticket, port=self.app.sessions.data_port)


def quota_message(record: QuotaRecord) -> pb.QuotaInfo:
    return pb.QuotaInfo(
        user=record.user,
        gpus=record.gpus,
        jobs=record.jobs,
        queued=record.queued,
        updated_at=record.updated_at,
        processes=record.processes,
        storage=record.storage,
        storage_used=record.storage_used,
        shares=record.shares,
    )


class QuotasServicer(_Servicer, pb_grpc.QuotasServicer):
    @rpc
    async def Set(self, request: pb.QuotaInfo, caller: Identity) -> pb.QuotaInfo:
        gpus = request.gpus if request.HasField("gpus") else None
        jobs = request.jobs if request.HasField("jobs") else None
        queued = request.queued if request.HasField("queued") else None
        processes = request.processes if request.HasField("processes") else None
        storage = request.storage if request.HasField("storage") else None
        shares = request.shares if request.HasField("shares") else None
        record = await asyncio.to_thread(
            self.app.quotas.set, caller, request.user, gpus, jobs, queued, processes, storage, shares
        )
        return quota_message(record)

    @rpc
    async def List(self, request: pb.Empty, caller: Identity) -> pb.QuotaList:
        quotas = await asyncio.to_thread(self.app.quotas.list, caller)
        return pb.QuotaList(quotas=[quota_message(q) for q in quotas])

    @rpc
    async def Unset(self, request: pb.QuotaRef, caller: Identity) -> pb.Empty:
        self.app.quotas.unset(caller, request.user)
        return _EMPTY


class UsageServicer(_Servicer, pb_grpc.UsageServicer):
    @rpc
    async def Report(self, request: pb.UsageQuery, caller: Identity) -> pb.UsageReport:
        entries, fair = await asyncio.to_thread(
            self.app.usage_report, caller, request.since, request.user or None, request.by or "user"
        )
        return pb.UsageReport(
            entries=[pb.UsageEntry(**dataclasses.asdict(e)) for e in entries],
            fair_share=[pb.FairShareEntry(**dataclasses.asdict(f)) for f in fair],
            half_life=self.app.usage.half_life,
        )


def session_message(record: SessionRecord) -> pb.SessionInfo:
    job = record.job
    return pb.SessionInfo(
        session_id=record.id,
        name=record.name,
        owner=record.owner,
        state=record.state,
        job_id=job.id,
        gpus=job.gpus,
        gpu_memory=job.gpu_memory,
        cpus=job.cpus,
        memory=job.memory,
        gpu_indices=job.gpu_indices,
        created_at=record.created_at,
        last_call_at=record.last_call_at,
        idle_timeout=record.idle_timeout,
        message=record.message,
        refs=record.refs,
        attached=record.attached,
        position=job.position,
        reattached=record.reattached,
        node=job.node,
    )


_OPS = {
    pb.CallRequest.CALL: "call",
    pb.CallRequest.PUT: "put",
    pb.CallRequest.GET: "get",
    pb.CallRequest.DELETE: "delete",
    pb.CallRequest.REFS: "refs",
}


def _ref_message(ref: dict[str, str]) -> pb.RefInfo:
    return pb.RefInfo(ref_id=ref["ref_id"], name=ref["name"], type=ref["type"], summary=ref["summary"])


def call_in(request: pb.CallRequest) -> CallIn:
    value = None
    if request.HasField("value"):
        v = request.value
        value = Value(header=v.header, buffers=list(v.buffers), staged=v.staged, sizes=list(v.sizes), follows=v.follows)
    return CallIn(
        session_id=request.session_id,
        op=_OPS.get(request.op, str(request.op)),
        value=value,
        function=request.function,
        function_pickle=request.function_pickle,
        keep=request.keep,
        ref_name=request.ref_name,
        ref_ids=list(request.ref_ids),
        device=request.device,
        timeout=request.timeout,
    )


def call_reply(out: CallOut) -> pb.CallReply:
    reply = pb.CallReply(
        unknown_function=out.unknown_function,
        stdout_offset=out.stdout_offset,
        stderr_offset=out.stderr_offset,
        download=out.download,
    )
    if out.value is not None:
        v = out.value
        reply.value.CopyFrom(
            pb.Value(header=v.header, buffers=v.buffers, staged=v.staged, sizes=v.sizes, follows=v.follows)
        )
    if out.ref is not None:
        reply.ref.CopyFrom(_ref_message(out.ref))
    reply.refs.extend(_ref_message(r) for r in out.refs)
    if out.failure is not None:
        f = out.failure
        failure = pb.RemoteFailure(
            kind=f["kind"],
            type=f["type"],
            message=f["message"],
            traceback=f.get("traceback", ""),
            exception=out.exception,
            stderr_tail=f.get("stderr_tail", ""),
        )
        if f.get("exit_code") is not None:
            failure.has_exit_code = True
            failure.exit_code = f["exit_code"]
        reply.failure.CopyFrom(failure)
    return reply


class SessionsServicer(_Servicer, pb_grpc.SessionsServicer):
    @rpc
    async def Open(self, request: pb.SessionSpec, caller: Identity) -> pb.SessionInfo:
        spec = SessionSpec(
            name=request.name,
            gpus=request.gpus,
            gpu_memory=request.gpu_memory,
            cpus=request.cpus,
            memory=request.memory,
            priority=request.priority,
            idle_timeout=request.idle_timeout,
            env=dict(request.env),
            python_version=request.python_version,
            cloudpickle_version=request.cloudpickle_version,
            requirements=request.requirements,
        )
        return session_message(self.app.sessions.open(caller, spec))

    @rpc
    async def Get(self, request: pb.SessionRef, caller: Identity) -> pb.SessionInfo:
        return session_message(self.app.sessions.get(caller, request.session_id, request.name))

    @rpc
    async def List(self, request: pb.Empty, caller: Identity) -> pb.SessionList:
        return pb.SessionList(sessions=[session_message(s) for s in self.app.sessions.list_for(caller)])

    @rpc
    async def Close(self, request: pb.SessionRef, caller: Identity) -> pb.SessionInfo:
        return session_message(self.app.sessions.close(caller, request.session_id, request.name))

    @rpc
    async def Restart(self, request: pb.SessionRef, caller: Identity) -> pb.SessionInfo:
        return session_message(await self.app.sessions.restart(caller, request.session_id, request.name))

    @rpc
    async def Call(self, request: pb.CallRequest, caller: Identity) -> pb.CallReply:
        return call_reply(await self.app.sessions.call(caller, call_in(request)))

    @rpc
    async def Upload(self, request: Any, caller: Identity) -> pb.Staged:
        async def chunks() -> AsyncIterator[tuple[str, int, bytes]]:
            async for chunk in request:
                self.app.transfers.add("grpc", "in", len(chunk.data))
                yield chunk.session_id, chunk.size, chunk.data

        return pb.Staged(staged=await self.app.sessions.upload(caller, chunks()))

    @stream_rpc
    async def Download(self, request: pb.DownloadChunkRequest, caller: Identity) -> AsyncIterator[pb.DataChunk]:
        async for data in self.app.sessions.download(caller, request.session_id, request.staged):
            self.app.transfers.add("grpc", "out", len(data))
            yield pb.DataChunk(data=data)

    @rpc
    async def Transfer(self, request: pb.TransferRequest, caller: Identity) -> pb.TransferTicket:
        ticket = self.app.sessions.transfer(
            caller, request.session_id, channel=request.channel, tunnel=request.tunnel, blobs=request.blobs
        )
        return pb.TransferTicket(ticket=ticket, port=self.app.sessions.data_port)

    @stream_rpc
    async def Output(self, request: pb.OutputRequest, caller: Identity) -> AsyncIterator[pb.OutputChunk]:
        stream = self.app.sessions.output(caller, request.session_id, request.stdout_offset, request.stderr_offset)
        async for fd, offset, data, state in stream:
            yield pb.OutputChunk(fd=fd, offset=offset, data=data, state=state)


def model_message(record: DeploymentRecord, caller: Identity) -> pb.ModelInfo:
    """``record`` as ``caller`` may see it: anyone sees a model's name, owner, signature and state; only
    its owner and admins why it failed, its source (another user's snapshot id or job id) and its
    replicas' job ids."""
    spec = record.spec
    theirs = caller.admin or caller.name == record.owner

    def tensors(specs: list[dict[str, Any]]) -> list[pb.TensorSpec]:
        return [pb.TensorSpec(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in specs]

    return pb.ModelInfo(
        id=record.id,
        name=record.name,
        version=record.version,
        owner=record.owner,
        source=record.source if theirs else "",
        format=record.format,
        state=record.state,
        message=message_for(record, caller),
        inputs=tensors(record.inputs),
        outputs=tensors(record.outputs),
        max_batch_size=spec["max_batch_size"],
        max_queue_delay=spec["max_queue_delay"],
        replicas=spec["replicas"],
        gpus=spec["gpus"],
        gpu_memory=spec["gpu_memory"],
        jobs=record.jobs if theirs else [],
        nodes=record.nodes if theirs else [],
        created_at=record.created_at,
        requests=record.stats.requests,
        batches=record.stats.batches,
        rows=record.stats.rows,
        failed_batches=record.stats.failed_batches,
        queue_length=record.stats.queue_length,
        public=bool(spec.get("public")),
        labels=record.labels,
    )


class ModelsServicer(_Servicer, pb_grpc.ModelsServicer):
    @rpc
    async def Deploy(self, request: pb.DeployRequest, caller: Identity) -> pb.ModelInfo:
        spec = DeploySpec(
            name=request.name,
            source=request.source,
            version=request.version,
            format=request.format,
            gpus=request.gpus,
            gpu_memory=request.gpu_memory,
            cpus=request.cpus,
            memory=request.memory,
            max_batch_size=request.max_batch_size,
            max_queue_delay=request.max_queue_delay,
            replicas=request.replicas or 1,
            public=request.public,
            label=request.label,
            requirements=request.requirements,
        )
        return model_message(self.app.serving.deploy(caller, spec), caller)

    @rpc
    async def Get(self, request: pb.ModelRef, caller: Identity) -> pb.ModelInfo:
        return model_message(self.app.serving.find(request.name, request.version), caller)

    @rpc
    async def List(self, request: pb.Empty, caller: Identity) -> pb.ModelList:
        return pb.ModelList(models=[model_message(d, caller) for d in self.app.serving.list()])

    @rpc
    async def Label(self, request: pb.LabelRequest, caller: Identity) -> pb.ModelInfo:
        return model_message(self.app.serving.label(caller, request.name, request.label, request.version), caller)

    @rpc
    async def Undeploy(self, request: pb.ModelRef, caller: Identity) -> pb.ModelList:
        return pb.ModelList(
            models=[model_message(d, caller) for d in self.app.serving.undeploy(caller, request.name, request.version)]
        )


def build_grpc_server(
    app: ServerApp,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
    cert_port: int | None = None,
    cert_credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int, int]:
    """Build the gRPC server for ``app`` bound to ``host:port`` (0 picks a free port); returns it,
    its port and its port for client certificates (0: none).

    ``credentials`` None means plaintext, which the caller allows only on loopback. With
    ``cert_credentials`` (TLS that requires a client certificate) the same services also listen on
    ``cert_port``: gRPC's TLS either requires client certificates or never asks for one, so clients
    that authenticate with a certificate have a port of their own.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ]
    )
    pb_grpc.add_ControlServicer_to_server(ControlServicer(app), server)
    pb_grpc.add_TokensServicer_to_server(TokensServicer(app), server)
    pb_grpc.add_SnapshotsServicer_to_server(SnapshotsServicer(app), server)
    pb_grpc.add_JobsServicer_to_server(JobsServicer(app), server)
    pb_grpc.add_QuotasServicer_to_server(QuotasServicer(app), server)
    pb_grpc.add_UsageServicer_to_server(UsageServicer(app), server)
    pb_grpc.add_SessionsServicer_to_server(SessionsServicer(app), server)
    pb_grpc.add_ModelsServicer_to_server(ModelsServicer(app), server)
    add_serving_services(server, app)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    cert_bound = 0
    if cert_credentials is not None and cert_port is not None:
        address = f"[{host}]:{cert_port}" if ":" in host else f"{host}:{cert_port}"
        cert_bound = server.add_secure_port(address, cert_credentials)
    return server, bound, cert_bound
