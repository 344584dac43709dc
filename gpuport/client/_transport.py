"""``Transport``: the one connection under a ``Client``, and under every ``Job``, ``Session`` and
TensorFlow tunnel it makes.

It holds the channel, the token's metadata, the service stubs and the pinned certificate; it makes
calls and streams with errors mapped to gpuport's, syncs folders up and snapshots down, and opens
connections to the server's data port. Nothing else in the client touches gRPC's channel or the
data port's sockets.
"""

from __future__ import annotations

import functools
import platform
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from gpuport._version import __version__
from gpuport.client._channel import (
    Target,
    diagnose,
    map_rpc_error,
    mismatch_error,
    open_channel,
    parse_url,
    probe,
    reach,
    read_certificate,
)
from gpuport.client._config import Settings
from gpuport.client._types import Snapshot
from gpuport.defaults import DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol import gpuport_pb2_grpc as pb_grpc
from gpuport.protocol.errors import (
    ConnectionFailed,
    InvalidRequest,
    NotFound,
    ServerError,
    ServerUnreachable,
    TLSError,
)
from gpuport.protocol.paths import check_entries
from gpuport.protocol.tls import wrap_socket

if TYPE_CHECKING:
    import socket
    import ssl

    from gpuport.client import _sync  # imported by the methods that sync: other commands need none of it
    from gpuport.client._data_port import Channel

Reply = TypeVar("Reply")
# progress(done_bytes, total_bytes), called as an upload or download goes.
Progress = Callable[[int, int], None]


class Closable(Protocol):
    name: str

    def close(self) -> None: ...

    def detach(self) -> None: ...


def _trusted_certificate(target: Target, settings: Settings, timeout: float) -> str | None:
    """The certificate to trust for ``target``: the pinned one, or one read now that matches the pin."""
    if not target.tls:
        return None
    if settings.certificate:
        return settings.certificate
    if not settings.fingerprint:
        probe(target, timeout)  # nothing there at all is said first: ServerUnreachable
        raise TLSError(
            f"no certificate pinned for {target.url} — run `gpuport login {target.url}`, or set "
            "GPUPORT_FINGERPRINT to the fingerprint `gpuport server` printed"
        )
    certificate, presented = read_certificate(target, timeout)
    if presented != settings.fingerprint:
        raise mismatch_error(target, settings.fingerprint, presented)
    return certificate


class Transport:
    """An authenticated, encrypted connection to a server, checked with a Hello on creation.

    ``hello`` is the server's answer (who the token is, the server's versions, its data port);
    the stubs (``control``, ``jobs``, ``sessions`` ...) are gRPC's, called through ``call`` and
    ``stream``. ``opened`` holds the sessions opened through it, which ``Client.close`` ends.
    """

    def __init__(self, settings: Settings, *, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        self.target = reach(parse_url(settings.url))
        self.fingerprint = settings.fingerprint if self.target.tls else None
        self.metadata = (("authorization", f"Bearer {settings.token}"),)
        # Also trusted on the data port, where sessions' large values and tunnels go.
        self._certificate = _trusted_certificate(self.target, settings, timeout)
        self.channel = open_channel(self.target, self._certificate)
        self.control = pb_grpc.ControlStub(self.channel)
        self.tokens = pb_grpc.TokensStub(self.channel)
        self.snapshots = pb_grpc.SnapshotsStub(self.channel)
        self.jobs = pb_grpc.JobsStub(self.channel)
        self.quotas = pb_grpc.QuotasStub(self.channel)
        self.usage = pb_grpc.UsageStub(self.channel)
        self.sessions = pb_grpc.SessionsStub(self.channel)
        self.models = pb_grpc.ModelsStub(self.channel)
        self.opened: weakref.WeakSet[Closable] = weakref.WeakSet()
        # Uploads send messages encoded ahead of time (_sync.prefetched), so they go out as bytes.
        self._upload = self.channel.stream_unary(
            "/gpuport.v1.Snapshots/Upload", request_serializer=None, response_deserializer=pb.UploadReply.FromString
        )
        # No cloudpickle version: importing it costs a command 12 ms, and only sessions need it.
        request = pb.HelloRequest(client_version=__version__, python_version=platform.python_version())
        try:
            self.hello: pb.HelloReply = self.call(self.control.Hello, request, timeout=timeout, connecting=True)
        except BaseException:
            self.channel.close()
            raise
        self.data_port: int = self.hello.data_port  # 0: none; after a failed connection, too (gRPC instead)
        self._data_context: ssl.SSLContext | None = None  # the data port's TLS settings, once made

    @functools.cached_property
    def pickle_problem(self) -> str | None:
        """Why pickles cannot cross to this server (another Python minor version, or cloudpickle major
        version), or None: sessions and functions exchange pickles. Said when a session is opened."""
        import cloudpickle

        from gpuport.protocol.values import check_compatible

        return check_compatible(self.hello.python_version, self.hello.cloudpickle_version or cloudpickle.__version__)

    @property
    def url(self) -> str:
        return self.target.url

    def call(
        self,
        method: Callable[..., Reply],
        request: Any,
        *,
        timeout: float | None = DEFAULT_CALL_TIMEOUT,
        connecting: bool = False,
    ) -> Reply:
        """One unary (or client-streaming) call; a failure raises the matching ``GpuportError``."""
        try:
            return method(request, metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as e:
            error = map_rpc_error(e, self.target)
            details = e.details() or ""  # type: ignore[attr-defined]
        # Raised outside the except block: the gRPC error adds nothing a user can act on.
        if connecting and isinstance(error, ServerUnreachable):
            error = diagnose(self.target, self.fingerprint, details, timeout or DEFAULT_CONNECT_TIMEOUT)
        raise error

    def stream(
        self, method: Callable[..., Iterator[Reply]], request: Any, timeout: float | None = None
    ) -> Iterator[Reply]:
        """A server stream, with errors mapped as ``call`` maps them."""
        call: Any = method(request, metadata=self.metadata, timeout=timeout)  # an iterator and a grpc.Call
        try:
            yield from call
        except grpc.RpcError as e:
            error = map_rpc_error(e, self.target)
        else:
            return
        finally:
            call.cancel()  # a consumer that stops early frees the server's side of the stream
        raise error

    # ---- the data port ------------------------------------------------------------------------------

    def data_connection(
        self, request: pb.TransferRequest | pb.ReachRequest, method: Any = None
    ) -> tuple[pb.TransferTicket, socket.socket | None]:
        """A ticket for ``request`` (from ``method``: ``Sessions.Transfer`` unless given) and a
        connection to the server's data port to present it on (``connect_data_port``)."""
        ticket: pb.TransferTicket = self.call(method or self.sessions.Transfer, request)
        return ticket, self.connect_data_port(ticket.port, stacklevel=5)

    def connect_data_port(self, port: int, stacklevel: int = 4) -> socket.socket | None:
        """A connection to the server's data port (``port``, as a ticket names it): TLS with the
        pinned certificate. None (and gRPC is used from then on) when the port cannot be reached, as
        behind a firewall that lets only the gRPC port through."""
        import socket  # here: a command without sessions needs no socket of its own, nor Python's TLS
        import ssl

        target = self.target
        try:
            raw = socket.create_connection((target.host, target.local_port(port)), timeout=DEFAULT_CONNECT_TIMEOUT)
        except OSError as e:
            warnings.warn(
                f"cannot reach the server's data port {target.host}:{port} ({e.strerror or e}); large "
                "values go through the gRPC port instead, about half as fast — open that port too",
                stacklevel=stacklevel,
            )
            self.data_port = 0
            return None
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.settimeout(None)
        if self._certificate is None:  # --insecure, on loopback only
            return raw
        if self._data_context is None:  # made once: loading the certificate is a third of a handshake here
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False  # the pinned certificate is the only one trusted: names do not matter
            context.load_verify_locations(cadata=self._certificate)
            self._data_context = context
        try:
            return wrap_socket(self._data_context, raw)  # closes the connection when it fails
        except (OSError, ssl.SSLError) as e:
            raise ConnectionFailed(f"the TLS handshake with the server's data port failed: {e}") from None

    def open_channel(self, session_id: str) -> Channel | None:
        """A channel on the data port for session ``session_id``'s calls; None: use gRPC."""
        from gpuport.client import _data_port

        return _data_port.open_channel(self, session_id)

    # ---- folders up, snapshots down ---------------------------------------------------------------

    def sync(self, folder: Path, name: str, progress: Progress | None) -> Snapshot:
        """Sync ``folder``: only blobs the server lacks travel, and they start while the rest is hashed."""
        from gpuport.client import _sync

        files = _sync.scan(folder)
        cache = _sync.HashCache(folder)
        known, unknown = cache.split(files)
        if not unknown:  # every hash known: the server may have this very snapshot, named by its id
            named = self._name_unchanged(known, name)
            if named is not None:
                if progress:
                    progress(0, 0)
                return named
        uploads = _sync.UploadQueue()
        files = self._hash_and_upload(cache, known, unknown, uploads, progress) if unknown else known
        request = pb.CreateSnapshotRequest(entries=_sync.manifest(files), name=name)
        reply = self.call(self.snapshots.Create, request)
        if reply.missing:  # the server lost blobs the hash cache knew, or a file changed meanwhile
            missing = set(reply.missing)
            retry = _sync.UploadQueue()
            for f in files:
                if f.blob in missing:
                    retry.add(f)
            retry.close()
            self._send(retry, progress)
            uploads.files, uploads.bytes = uploads.files + retry.files, uploads.bytes + retry.bytes
            reply = self.call(self.snapshots.Create, request)
            if reply.missing:
                raise ServerError(f"the server still lacks {len(reply.missing)} file(s) after the upload — sync again")
        elif progress and not uploads.files:
            progress(0, 0)
        return Snapshot(reply.snapshot_id, name, reply.files, reply.bytes, uploads.files, uploads.bytes)

    def _name_unchanged(self, files: list[_sync.LocalFile], name: str) -> Snapshot | None:
        """Name the snapshot of ``files`` (hashes known) without sending its manifest: its id is
        computed here as the server computes it. None where the server has no such snapshot of
        ours (or is older than ``Snapshots.Name``): the manifest must go."""
        from gpuport.protocol.paths import snapshot_id

        sid = snapshot_id(sorted(files, key=lambda f: f.path))
        try:
            reply = self.call(self.snapshots.Name, pb.NameSnapshotRequest(snapshot_id=sid, name=name))
        except (NotFound, ServerError):  # ServerError: UNIMPLEMENTED, from a server older than Name
            return None
        return Snapshot(reply.snapshot_id, name, reply.files, reply.bytes, 0, 0)

    def _send(self, uploads: _sync.UploadQueue, progress: Progress | None) -> None:
        """Upload the queue's files in one stream, until the queue is closed: on the data port
        (plain bytes over TLS: no protobuf copies, no event loop per message), or through gRPC where
        that port cannot be reached."""
        from gpuport.client import _sync

        if self.data_port:
            try:
                ticket, conn = self.data_connection(pb.TransferRequest(blobs=True))
            except (InvalidRequest, NotFound):  # a server without a data port, or one older than blobs there
                conn = None
            if conn is not None:
                with conn:
                    conn.sendall(ticket.ticket.encode() + b"\n")
                    _sync.send_blobs(conn, uploads, progress)
                return
        self.call(self._upload, _sync.prefetched(_sync.upload_batches(uploads, progress)), timeout=None)

    def _hash_and_upload(
        self,
        cache: _sync.HashCache,
        known: list[_sync.LocalFile],
        unknown: list[_sync.LocalFile],
        uploads: _sync.UploadQueue,
        progress: Progress | None,
    ) -> list[_sync.LocalFile]:
        """Hash ``unknown`` in rounds; upload what the server lacks in a background stream meanwhile."""
        from concurrent.futures import ThreadPoolExecutor

        from gpuport.client import _sync

        failure: list[BaseException] = []

        def upload() -> None:
            try:
                self._send(uploads, progress)
            except BaseException as e:  # raised in the caller's thread below
                failure.append(e)
                uploads.drain()

        sender = threading.Thread(target=upload, name="gpuport upload", daemon=True)
        started = False

        def offer(batch: list[_sync.LocalFile]) -> None:
            nonlocal started
            blobs = [f.blob for f in batch if f.blob]
            if not blobs:
                return
            sizes = [f.size for f in batch if f.blob]  # the server refuses at once a push past the quota
            missing = set(self.call(self.snapshots.Missing, pb.BlobList(blobs=blobs, sizes=sizes)).blobs)
            for f in batch:
                if f.blob in missing:
                    if not started:
                        sender.start()
                        started = True
                    uploads.add(f)

        hashed: list[_sync.LocalFile] = []
        try:
            offer(known)
            with ThreadPoolExecutor(max_workers=_sync._HASH_THREADS) as pool:
                for group in _sync.rounds(unknown):
                    done = cache.hash_files(group, pool)
                    hashed += done
                    offer(done)
        finally:
            uploads.close()
            if started:
                sender.join()
        cache.save()
        if failure:
            raise failure[0]
        return known + hashed

    def download(self, snapshot_id: str, dest: Path, path: str | None, progress: Progress | None) -> list[Path]:
        """Bring snapshot ``snapshot_id`` (the files at ``path`` in it) into ``dest``: only files not
        there already travel. Returns every file chosen."""
        from gpuport.client import _sync

        snapshot = self.call(self.snapshots.Get, pb.SnapshotRef(snapshot_id=snapshot_id))
        entries = list(snapshot.entries)
        check_entries(entries)  # a manifest from the server gets the checks one sent to it gets
        chosen = _sync.select(entries, path)
        dest.mkdir(parents=True, exist_ok=True)
        needed = [e for e in chosen if not _sync.already_there(dest, e)]
        blobs = sorted({e.blob for e in needed if e.blob})
        stream = self.stream(self.snapshots.Download, pb.DownloadRequest(snapshot_id=snapshot_id, blobs=blobs))
        _sync.place(dest, needed, stream if blobs else iter(()), progress)
        return [dest / e.path for e in chosen]

    def close(self) -> None:
        """Detach the named sessions opened through this transport, close the unnamed ones, then the
        channel."""
        for session in list(self.opened):
            if session.name:
                session.detach()
            else:
                session.close()
        self.channel.close()
