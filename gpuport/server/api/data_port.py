"""The data port: a session's calls and large values as plain bytes over TLS, beside gRPC.

gRPC in Python moved 0.38 GB/s on this project's 2-core test VM where a TLS socket moved 0.6–1.3
GB/s (protobuf copies every chunk twice, and the event loop sees each one), and sessions exist to
move arrays. So a session's calls, and with them its values, go here: the client asks for a ticket
over gRPC (``Sessions.Transfer``, authenticated like any call), connects, and sends the ticket (64
hex digits and a newline). A connection with a bad ticket is answered ``E`` and the reason, and
closed. Same certificate, same cipher as the gRPC port.

Until its ticket line is in, a connection costs no thread: one thread accepts, shakes hands (TLS)
and reads every ticket line, without blocking, within ``_HANDSHAKE_DEADLINE`` from the connection's
accept in all (not per read). It holds at most ``_MAX_UNREDEEMED_PER_SOURCE`` such connections from
one source address (an IPv6 /64): a new one past that pushes out that address's own oldest, so a
flood of bare connections from one address never pushes out another's handshake; and at most
``_MAX_UNREDEEMED`` from all addresses, past which the address holding the most loses its oldest. A connection with its ticket gets a thread for its transfer or
channel; a user holds at most ``_MAX_CHANNELS`` channels, tunnels and blob uploads open. A channel
with no call for ``_PARK_AFTER`` seconds gives its thread up: it waits in that same selector, and
gets a thread again when its next call comes.

A tunnel (``TransferRequest.tunnel``, NAME) is a byte stream to a server the session's worker runs
(TensorFlow's, in the worker's own network namespace). The worker listens on ``tunnel-NAME.sock``
and answers each connection there with a connection to its server, passed as a file descriptor
(``F`` and SCM_RIGHTS). The client is answered ``T``, and its bytes are relayed both ways to that
connection until either side closes, or ``E`` and why when the worker has no such socket. It counts
among its user's channels, and closes with their token.

A running job is reached the same way, with a ticket from ``Jobs.Reach`` (its owner's only). A
forward's (``forward:PORT``) is good for each of its connections, until its owner's token is
revoked (``Staging.redeem``). Its client keeps connections here ready ahead, spares: on each, the
ticket is checked and the sockets into the job's network namespace made (``executors/reach.py``'s
``Dialer``), then it is answered ``R``; when a connection comes to the forward, the client sends ``G``,
and only then is the job's port connected to (the job sees a connection only when its user makes
one) and relayed as a tunnel is; closed at once where it cannot be (as a refused connect). A spare
waits for its ``G`` for ``_SPARE_WAIT`` seconds. A command (``exec``) runs in the job's sandbox,
its streams framed as ``protocol/reach.py`` says (``api/reach.py``). Both count among the user's
channels (a spare too), and close with their token.

Blobs (``TransferRequest.blobs``: a folder's files for a snapshot, no session) are answered ``B``,
then come as a header each (``_BLOB_HEAD``: ``F``, the blob's 64 hex digits, its size as 8 bytes
little-endian) followed by its bytes, and ``Z`` and 72 bytes of anything to end. Each is written
and hashed as it arrives (two writer threads: ``BlobSink``) and placed in the blob store once it
hashes to its name, as gRPC's ``Snapshots.Upload`` does; a first push of 283 MB took 0.59–0.69 s
this way where gRPC's stream took 0.70–0.83 s (tmpfs, the 2-core VM, in turns). The end is
answered ``K`` with the blobs placed and their bytes (``_BLOBS_DONE``), a bad blob with ``E`` and
why; the blobs placed before it stay the sender's.

A channel (``TransferRequest.channel``) carries a session's calls, for as long as the client keeps it
open: answered ``C``, then each ``Sessions.Call`` request as a 4-byte little-endian length and the
serialized ``CallRequest``, and each reply as a length, one byte (0: a ``CallReply`` follows; 1: an
error, JSON ``{"error": class name, "message": ...}``) and the body. Its thread relays the calls
straight to the worker's socket: no HTTP/2 framing and no turns of the event loop, which is what a
small call's round trip is made of through gRPC. A value past ``SESSION_INLINE_BYTES`` follows its
request (``Value.follows``: the bytes of its buffers, ``sizes``, end to end), and a large result
follows its reply likewise when the request allows it (``CallRequest.results_follow``): no
connection of their own. To a worker that maps this server's memory a value is received into the
memfd it maps; to a worker on another node it passes on as it comes (``Following``), and its result
comes back the same way, never held whole here. A value the call did not take (it failed first) is
read and dropped, so the channel's next call starts where it should.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import logging
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from gpuport.defaults import MAX_BLOB_BYTES, MAX_MESSAGE_BYTES
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import (
    AuthenticationError,
    ConfigError,
    GpuportError,
    InvalidRequest,
    ResourceUnavailable,
    ServerError,
)
from gpuport.protocol.relay import relay
from gpuport.protocol.tls import wrap_socket
from gpuport.server.api.grpc_api import call_in, call_reply
from gpuport.server.api.reach import serve_exec
from gpuport.server.app import ServerApp
from gpuport.server.blobs import BlobSink, check_hash
from gpuport.server.executors.base import Executor
from gpuport.server.metrics import Transfers
from gpuport.server.services.auth import Identity
from gpuport.server.services.sessions import SessionService
from gpuport.server.services.snapshots import SnapshotService
from gpuport.server.services.staging import ClientGone, Direct, Following, Redeemed
from gpuport.server.services.storage import StorageService, over_quota

log = logging.getLogger(__name__)

_TICKET_LINE = 65  # 64 hex digits and "\n"
_HANDSHAKE_DEADLINE = 10.0  # seconds from accept to a whole ticket line, TLS handshake included
_MAX_UNREDEEMED = 512  # connections still shaking hands or sending their ticket, from every address
_MAX_UNREDEEMED_PER_SOURCE = 32  # of those, from one address (an IPv6 /64)
_MAX_CHANNELS = 64  # channels, tunnels and blob uploads one user holds open
_PARK_AFTER = 2.0  # seconds without a call after which a channel gives its thread up
_IDLE_TIMEOUT = 60.0  # seconds a transfer may stall before the server gives up on it
_SPARE_WAIT = 120.0  # seconds a forward's spare connection waits for its use (the client renews it before)
_SLICE = 1024 * 1024  # bytes per send or receive call
_LENGTH = struct.Struct("<I")
_REPLY = struct.Struct("<IB")  # length, kind
_BLOB_HEAD = struct.Struct("<c64sQ")  # F (a blob follows) or Z (the end), blob id, size
_BLOBS_DONE = struct.Struct("<QQ")  # blobs placed, bytes
_OK, _ERROR = 0, 1


class DataPort:
    def __init__(self, app: ServerApp, host: str, port: int, cert: Path | None, key: Path | None) -> None:
        # The services, through the app as the gRPC and HTTP doors reach them.
        self.sessions: SessionService = app.sessions
        self.executor: Executor | None = app.executor  # where forwards and commands reach running jobs
        self.snapshots: SnapshotService = app.snapshots
        self.storage: StorageService | None = app.storage  # blobs count against their sender's storage quota
        self.transfers: Transfers = app.transfers
        self.staging = self.sessions.staging
        self._context: ssl.SSLContext | None = None
        if cert is not None and key is not None:
            self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._context.load_cert_chain(cert, key)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as e:
            self._listener.close()
            raise ConfigError(
                f"cannot listen for data on {host}:{port}: {e.strerror} — is another server using it? "
                "pick another --data-port"
            ) from None
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._held: dict[str, set[socket.socket]] = {}  # a user's open channels, closed when their token goes
        self._held_lock = threading.Lock()
        # Idle channels handed to the accepting thread's selector, and the way to wake it for them.
        self._parking: list[_Parked] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)

    def revoke(self, name: str) -> None:
        """Close every channel ``name`` holds open (with any value on its way through it) and every
        transfer of theirs under way, at once, and refuse their tickets not redeemed yet (their token
        was revoked)."""
        self.staging.forget(name)  # first: a connection counted after this sees the revocation (_take_hold)
        with self._held_lock:
            conns = self._held.pop(name, set())
        for conn in conns:
            with contextlib.suppress(OSError):
                # The socket's own shutdown, not SSLSocket's, which would pull the TLS state from
                # under the thread reading it: that thread's read ends, and it closes the channel.
                socket.socket.shutdown(conn, socket.SHUT_RDWR)

    def start(self) -> None:
        threading.Thread(target=self._accept, name="gpuport data port", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self) -> None:
        """Accept connections and read their ticket lines, all in this one thread; hand each
        connection whose line is in to a thread of its own."""
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        waiting: dict[socket.socket, _Arriving] = {}  # in order of arrival
        by_source: dict[str, dict[socket.socket, None]] = {}  # the same, per source address
        parked: dict[socket.socket, _Parked] = {}  # idle channels

        def settle(conn: socket.socket) -> None:
            """No longer waiting for its ticket: handed on, or dropped."""
            arriving = waiting.pop(conn, None)
            if arriving is not None:
                theirs = by_source[arriving.source]
                del theirs[conn]
                if not theirs:
                    del by_source[arriving.source]
            selector.unregister(conn)

        def drop(conn: socket.socket) -> None:
            settle(conn)
            with contextlib.suppress(OSError):
                conn.close()

        def make_room(source: str) -> None:
            """Push out the oldest of ``source``'s own connections once it holds its share, or past
            the bound for all, the oldest of the address holding the most: never another's for one
            address's flood."""
            theirs = by_source.get(source, {})
            if len(theirs) >= _MAX_UNREDEEMED_PER_SOURCE:
                drop(next(iter(theirs)))
            elif len(waiting) >= _MAX_UNREDEEMED:
                drop(next(iter(max(by_source.values(), key=len))))

        try:
            while not self._closed:
                now = time.monotonic()
                for conn in [c for c, a in waiting.items() if a.deadline <= now]:
                    log.info("%s sent no ticket in %gs: closed", waiting[conn].peer, _HANDSHAKE_DEADLINE)
                    drop(conn)
                timeout = min((a.deadline for a in waiting.values()), default=now + 60) - now
                for key, _ in selector.select(max(timeout, 0.0)):
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while self._wake_r.recv(4096):
                                pass
                        with self._held_lock:
                            arrived, self._parking = self._parking, []
                        for idle in arrived:
                            parked[idle.conn] = idle
                            selector.register(idle.conn, selectors.EVENT_READ)
                        continue
                    idle = parked.pop(key.fileobj, None)  # type: ignore[call-overload]
                    if idle is not None:  # its next call (or its end): a thread for it again
                        selector.unregister(idle.conn)
                        threading.Thread(
                            target=self._hold_channel,
                            args=(idle.conn, idle.caller, idle.direct),
                            name="gpuport channel",
                            daemon=True,
                        ).start()
                        continue
                    if key.fileobj is self._listener:
                        for conn, peer in self._accept_ready():
                            source = _source(peer)
                            make_room(source)
                            waiting[conn] = _Arriving(peer, source, time.monotonic() + _HANDSHAKE_DEADLINE)
                            by_source.setdefault(source, {})[conn] = None
                            selector.register(conn, selectors.EVENT_READ)
                        continue
                    conn = key.fileobj  # type: ignore[assignment]
                    arriving = waiting.get(conn)
                    if arriving is None:
                        continue  # pushed out by a newer one in this same turn
                    try:
                        want = _step(conn, arriving)
                    except (OSError, EOFError, ValueError) as e:
                        log.info("a connection from %s failed before its ticket: %s", arriving.peer, e)
                        drop(conn)
                        continue
                    if want is not None:
                        selector.modify(conn, want)
                        continue
                    settle(conn)
                    threading.Thread(
                        target=self._serve, args=(conn, arriving), name="gpuport transfer", daemon=True
                    ).start()
        except OSError:
            pass  # the listener was closed
        finally:
            for conn in list(waiting):
                drop(conn)
            for idle in parked.values():
                idle.direct.close()
                with contextlib.suppress(OSError):
                    idle.conn.close()
            selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept_ready(self) -> list[tuple[socket.socket, object]]:
        """The connections waiting to be accepted, made non-blocking (and TLS, not yet shaken hands)."""
        accepted = []
        while True:
            try:
                raw, peer = self._listener.accept()
            except BlockingIOError:
                return accepted
            except OSError as e:
                if self._closed:
                    raise
                # Out of file descriptors, say: the listener stays readable, so wait a moment.
                log.warning("the data port could not accept a connection: %s", e)
                time.sleep(0.1)
                return accepted
            try:
                raw.setblocking(False)
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = raw
                if self._context is not None:
                    conn = wrap_socket(self._context, raw, server_side=True, do_handshake_on_connect=False)
            except OSError as e:  # gone already
                log.info("a connection from %s failed at once: %s", peer, e)
                raw.close()
                continue
            accepted.append((conn, peer))

    def _serve(self, conn: socket.socket | None, arriving: _Arriving) -> None:
        assert conn is not None
        peer = arriving.peer
        try:
            conn.settimeout(max(arriving.deadline - time.monotonic(), 0.1))
            line = bytes(arriving.line)
            try:
                found = self.staging.redeem(line.decode("ascii", "replace").strip())
            except AuthenticationError as e:
                conn.sendall(b"E" + str(e).encode() + b"\n")
                return
            if found is None:
                conn.sendall(b"Ethis ticket is unknown, used or expired: ask for another with Sessions.Transfer\n")
                return
            assert found.caller is not None
            if found.kind == "blobs":
                conn.settimeout(_IDLE_TIMEOUT)
                name = found.caller.name
                if self._take_hold(conn, found):  # its threads and buffers count among the user's
                    try:
                        self._blobs(conn, name, peer)
                    finally:
                        with self._held_lock:
                            self._held.get(name, set()).discard(conn)
                return
            if found.kind.startswith("tunnel:"):
                tunnel, conn = conn, None  # the tunnel's own from here on
                self._tunnel(tunnel, found, peer)
                return
            if found.kind.startswith("forward:") or found.kind == "exec":
                reached, conn = conn, None  # its own from here on
                self._reach(reached, found, peer)
                return
            if found.kind == "channel":
                conn.settimeout(None)  # a channel waits for the client's next call as long as it likes
                name = found.caller.name
                if not self._take_hold(conn, found):
                    return
                channel, conn = conn, None  # the channel's own from here on: _hold_channel closes it
                try:
                    channel.sendall(b"C")
                except OSError as e:
                    log.info("a channel from %s failed: %s", peer, e)
                    self._let_go(channel, name)
                    return
                self._hold_channel(channel, found.caller, Direct(found.key))
                return
            conn.sendall(f"Ea ticket for {found.kind!r}, which this server does not serve\n".encode())
        except (OSError, EOFError, ValueError) as e:
            log.info("a transfer from %s failed: %s", peer, e)
        finally:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()

    def _blobs(self, conn: socket.socket, name: str, peer: object) -> None:
        """Receive blobs (see the module's doc) until the sender's end, placing each once it checks out."""
        sink = BlobSink(self.snapshots.blobs)
        source = conn.makefile("rb", buffering=_SLICE)
        budget = self.storage.left(name) if self.storage is not None else None
        received, over, held = 0, False, False

        def hold() -> None:
            """The blobs that arrived whole are the sender's (once; past the quota none is theirs,
            and the sweep removes them): before any answer, which the sender's next call (its
            snapshot) counts on, and from an upload cut short too."""
            nonlocal held
            if sink.placed and not over and not held:
                self.snapshots.hold(name, sink.placed)
            held = True

        try:
            conn.sendall(b"B")
            buffer = memoryview(sink.buffer())
            at = 0
            while True:
                kind, blob_id, size = _BLOB_HEAD.unpack(_read(source, _BLOB_HEAD.size))
                if kind == b"Z":
                    break
                blob = check_hash(blob_id.decode("ascii", "replace"))
                if kind != b"F":
                    raise InvalidRequest(f"a blob upload carried {kind!r} where a blob's header was expected")
                if size > MAX_BLOB_BYTES:
                    raise InvalidRequest(f"blob {blob} is larger than the limit of {MAX_BLOB_BYTES} bytes")
                received += size
                if budget is not None and received > budget:  # refused before its bytes are read
                    over = True
                    assert self.storage is not None
                    raise ResourceUnavailable(over_quota(name, *self._use(name), received, "this upload"))
                offset = 0
                while True:
                    if at == len(buffer):
                        buffer.release()
                        sink.send()
                        buffer, at = memoryview(sink.buffer()), 0
                    n = min(size - offset, len(buffer) - at)
                    if n and source.readinto(buffer[at : at + n]) != n:  # BufferedReader: short only at the end
                        raise EOFError(f"the client closed the connection inside blob {blob}")
                    sink.part(blob, offset, at, n, offset + n == size)
                    at += n
                    offset += n
                    if offset == size:
                        break
            buffer.release()
            sink.send()
            sink.finish()
            hold()
            conn.sendall(b"K" + _BLOBS_DONE.pack(len(sink.placed), sink.bytes))
        except (InvalidRequest, ResourceUnavailable) as e:
            sink.abort()
            hold()  # the ones before the refused one
            log.info("a blob upload from %s was refused: %s", peer, e)
            with contextlib.suppress(OSError, EOFError, ValueError):
                conn.sendall(b"E" + str(e).encode() + b"\n")
                while source.read(_SLICE):  # until the sender has sent all and reads the answer
                    pass
        finally:
            sink.abort()  # its threads stop, and what was not placed goes, however the upload ended
            source.close()
            self.transfers.add("snapshots", "in", sink.bytes)
            hold()

    def _use(self, name: str) -> tuple[int, int]:
        """What ``name`` keeps, and may keep."""
        assert self.storage is not None
        return self.storage.used(name), self.storage.quotas.storage(name)

    def _tunnel(self, conn: socket.socket, found: Redeemed, peer: object) -> None:
        """Relay a tunnel's bytes between the client and the worker's socket until either side ends."""
        assert found.caller is not None
        name, session_id, tunnel = found.caller.name, found.key, found.kind.partition(":")[2]
        conn.settimeout(None)
        if not self._take_hold(conn, found):
            with contextlib.suppress(OSError):
                conn.close()
            return
        try:
            try:
                worker = self.sessions.tunnel_socket(session_id, tunnel)
            except OSError as e:
                conn.sendall(f"Ethe session's worker has no tunnel {tunnel!r} open: {e.strerror or e}\n".encode())
                return
            with worker:
                conn.sendall(b"T")
                relay(conn, worker)
        except (OSError, ValueError) as e:
            log.info("a tunnel from %s ended: %s", peer, e)
        finally:
            self._let_go(conn, name)

    def _reach(self, conn: socket.socket, found: Redeemed, peer: object) -> None:
        """A running job's port (``forward:PORT``), its bytes relayed both ways until either side ends,
        or a command run in it (``exec``: ``api/reach.py``); job ``found.key`` is the ticket holder's,
        as ``Jobs.Reach`` checked. Either counts among its user's channels, and ends with their token."""
        assert found.caller is not None and self.executor is not None
        conn.settimeout(None)
        if not self._take_hold(conn, found):
            with contextlib.suppress(OSError):
                conn.close()
            return
        try:
            if found.kind == "exec":
                serve_exec(conn, self.executor, found.key)
                return
            try:
                dialer = self.executor.dial_port(found.key, int(found.kind.partition(":")[2]))
            except GpuportError as e:
                conn.sendall(b"E" + str(e).encode() + b"\n")
                return
            try:
                conn.sendall(b"R")
                conn.settimeout(_SPARE_WAIT)
                if conn.recv(1) != b"G":
                    return  # the client let its spare go
                conn.settimeout(None)
                try:
                    target = dialer.connect()
                except GpuportError as e:  # the client's connection closes: as a refused connect would
                    log.info("a forward of %s found no way in: %s", found.caller.name, e)
                    return
            finally:
                dialer.close()
            with target:
                relay(conn, target)
        except (OSError, ValueError, EOFError) as e:
            log.info("a %s from %s ended: %s", found.kind.partition(":")[0], peer, e)
        finally:
            self._let_go(conn, found.caller.name)

    def _hold_channel(self, conn: socket.socket, caller: Identity, direct: Direct) -> None:
        """Relay a channel's calls in this thread until it ends (then closed) or goes idle (then parked)."""
        try:
            if self._channel(conn, caller, direct):
                return
        except (OSError, EOFError, ValueError, ClientGone) as e:
            log.info("a channel of %s failed: %s", caller.name, e)
        direct.close()
        self._let_go(conn, caller.name)

    def _take_hold(self, conn: socket.socket, found: Redeemed) -> bool:
        """Count ``conn``, redeemed as ``found``, among its caller's open connections (closed at once
        when their token is revoked); or, when their token was revoked since the ticket was redeemed,
        or they hold the most channels allowed, answer ``E`` and why, and say False."""
        assert found.caller is not None
        name = found.caller.name
        with self._held_lock:
            # Under the lock revoke() takes after Staging.forget: a revocation either finds this
            # connection there or is seen here.
            revoked = self.staging.revocations(name) != found.revocations
            held = self._held.setdefault(name, set())
            count = len(held)
            if not revoked and count < _MAX_CHANNELS:
                held.add(conn)
                return True
        if revoked:
            why = f"the token of '{name}' was revoked: nothing was transferred — log in with a valid token"
        else:
            why = (
                f"{name} holds {count} channels, tunnels and uploads open, the most allowed: close sessions "
                "(or clients) no longer used"
            )
        with contextlib.suppress(OSError):
            conn.sendall(f"E{why}\n".encode())
        return False

    def _let_go(self, conn: socket.socket, name: str) -> None:
        with self._held_lock:
            self._held.get(name, set()).discard(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def _park(self, idle: _Parked) -> None:
        with self._held_lock:
            self._parking.append(idle)
        with contextlib.suppress(OSError):  # the port is closing
            self._wake_w.send(b"p")

    def _channel(self, conn: socket.socket, caller: Identity, direct: Direct) -> bool:
        """Relay a client's calls until it closes the channel (False) or sends none for
        ``_PARK_AFTER`` seconds (True: the channel is parked, open, and this thread is free)."""
        prefix = bytearray(_LENGTH.size)
        waiting = select.poll()
        waiting.register(conn, select.POLLIN)
        while True:
            pending = isinstance(conn, ssl.SSLSocket) and conn.pending()
            if not pending and not waiting.poll(_PARK_AFTER * 1000):
                self._park(_Parked(conn, caller, direct))
                return True
            if not _receive(conn, memoryview(prefix), eof_ok=True):
                return False  # the client closed the channel between calls
            (size,) = _LENGTH.unpack(prefix)
            if size > MAX_MESSAGE_BYTES:
                _reply(conn, _ERROR, _error(InvalidRequest(f"a call of {size} bytes is over the channel's limit")))
                return False
            body = bytearray(size)
            _receive(conn, memoryview(body))
            out, following = None, None
            try:
                request = pb.CallRequest.FromString(bytes(body))
                call = call_in(request)
                if call.value is not None and call.value.follows:
                    if any(n < 0 for n in call.value.sizes):
                        _reply(conn, _ERROR, _error(InvalidRequest("a value's buffer sizes cannot be negative")))
                        return False  # how many bytes follow is unknown: the channel is out of step
                    following = Following(conn, sum(call.value.sizes))
                out = self.sessions.call_direct(caller, call, direct, following, request.results_follow)
                kind, data = _OK, call_reply(out).SerializeToString()
            except DecodeError:
                kind, data = _ERROR, _error(InvalidRequest("the channel carried something other than a call"))
            except GpuportError as e:
                kind, data = _ERROR, _error(e)
            except ClientGone:
                raise
            except Exception:
                log.exception("a call on a data-port channel failed")
                kind, data = _ERROR, _error(ServerError("internal server error — the server's log has the details"))
            if following is not None:
                following.drain()  # what the call did not take (it failed first): the next call starts after it
                self.transfers.add("data_port", "in", following.size)
            _reply(conn, kind, data)
            if kind == _OK and out is not None and out.follows is not None:
                out.follows(conn)
                self.transfers.add("data_port", "out", sum(out.value.sizes) if out.value else 0)


@dataclass
class _Parked:
    """An idle channel, waiting in the selector for its next call."""

    conn: socket.socket
    caller: Identity
    direct: Direct


@dataclass
class _Arriving:
    """A connection whose ticket line is not all in yet."""

    peer: object
    source: str  # what its share is counted by (_source)
    deadline: float  # time.monotonic() by which the line must be in
    handshaken: bool = False
    line: bytearray = field(default_factory=bytearray)


def _source(peer: object) -> str:
    """The address a connection's share of handshakes is counted by: its IP address, or for IPv6 its
    /64 (one host may hold a whole /64)."""
    host = peer[0] if isinstance(peer, tuple) else str(peer)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _step(conn: socket.socket, arriving: _Arriving) -> int | None:
    """Go on with a non-blocking handshake and ticket line as far as they go now: the selector
    event to wait for, or None when the line is in (the socket is then blocking again)."""
    try:
        if not arriving.handshaken and isinstance(conn, ssl.SSLSocket):
            conn.do_handshake()
        arriving.handshaken = True
        while len(arriving.line) < _TICKET_LINE:
            chunk = conn.recv(_TICKET_LINE - len(arriving.line))
            if not chunk:
                raise EOFError("the client closed the connection before sending its ticket")
            arriving.line += chunk
    except ssl.SSLWantWriteError:
        return selectors.EVENT_WRITE
    except (ssl.SSLWantReadError, BlockingIOError):
        return selectors.EVENT_READ
    conn.setblocking(True)
    return None


def _read(source: io.BufferedReader, n: int) -> bytes:
    data = source.read(n)
    if len(data) != n:
        raise EOFError(f"the client closed the connection after {len(data)} of a header's {n} bytes")
    return data


def _error(error: GpuportError) -> bytes:
    return json.dumps({"error": type(error).__name__, "message": str(error)}).encode()


def _reply(conn: socket.socket, kind: int, data: bytes) -> None:
    conn.sendall(_REPLY.pack(len(data), kind) + data)


def _receive(conn: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Fill ``view`` from ``conn``; with ``eof_ok``, False when the client closed before its first byte."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got : got + _SLICE])
        if not n:
            if eof_ok and not got:
                return False
            raise EOFError(f"the client closed the connection after {got} of {len(view)} bytes")
        got += n
    return True
