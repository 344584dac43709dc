"""How sessions' values travel and last: the data port's channel and its tickets (and their end with
their token), values on the channel, the gRPC fallback, a server restart under a live session, Refs
of an earlier worker."""

from __future__ import annotations

import hashlib
import json
import socket
import ssl
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import gpuport
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol import values
from tests.conftest import RunningServer, data_port_unreachable, start_server

# Past the 4 MiB that travel inside a call: these go through the data port (or gRPC streams).
LARGE = 3 * 1024 * 1024  # float32 elements: 12 MiB


def _large() -> np.ndarray:
    return np.arange(LARGE, dtype=np.uint32).view(np.float32)


@pytest.fixture
def session(admin: gpuport.Client) -> Iterator[gpuport.Session]:
    with admin.session() as s:
        yield s


def test_large_values_go_through_the_data_port_both_ways(admin: gpuport.Client, session: gpuport.Session) -> None:
    assert admin.transport.data_port > 0
    x = _large()
    ref = session.put(x)
    assert ref.summary == f"float32 ({LARGE},)"
    back = session.get(ref)
    assert back.dtype == x.dtype and np.array_equal(back.view(np.uint32), x.view(np.uint32))
    # A computed result (not the memory a value was put in) goes back through a copy: the same bytes.
    doubled = session.call(lambda a: a.view(np.uint32) * 2, ref)
    assert np.array_equal(doubled, x.view(np.uint32) * 2)


def test_without_the_data_port_values_go_through_grpc(admin: gpuport.Client, session: gpuport.Session) -> None:
    admin.transport.data_port = 0  # as for a server reached through a firewall that lets only the gRPC port through
    x = _large()
    ref = session.put(x)
    assert np.array_equal(session.get(ref).view(np.uint32), x.view(np.uint32))


def test_an_unreachable_data_port_warns_and_falls_back_to_grpc(admin: gpuport.Client, session: gpuport.Session) -> None:
    data_port_unreachable(admin)
    x = _large()
    with pytest.warns(UserWarning, match="data port"):
        ref = session.put(x)
    assert admin.transport.data_port == 0  # not tried again
    assert np.array_equal(session.get(ref).view(np.uint32), x.view(np.uint32))


def _data_port_says(server: RunningServer, port: int, line: bytes) -> bytes:
    context = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    context.check_hostname = False
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as conn:
        conn.sendall(line)
        return conn.recv(1000)


def test_the_data_port_takes_only_a_valid_unused_ticket(
    server: RunningServer, admin: gpuport.Client, session: gpuport.Session
) -> None:
    port = admin.transport.data_port
    assert _data_port_says(server, port, b"0" * 64 + b"\n").startswith(b"Ethis ticket is unknown")
    ticket = admin.transport.sessions.Transfer(
        pb.TransferRequest(session_id=session.id, channel=True), metadata=admin.transport.metadata
    )
    assert _data_port_says(server, port, ticket.ticket.encode() + b"\n") == b"C"
    again = _data_port_says(server, port, ticket.ticket.encode() + b"\n")
    assert again.startswith(b"E")  # used up


def test_a_ticket_for_no_channel_tunnel_or_blobs_is_refused(admin: gpuport.Client, session: gpuport.Session) -> None:
    with pytest.raises(gpuport.InvalidRequest, match="ask for a channel"):
        admin.transport.call(admin.transport.sessions.Transfer, pb.TransferRequest(session_id=session.id))


def test_refs_of_an_earlier_worker_say_so(session: gpuport.Session) -> None:
    ref = session.put([1, 2, 3])
    session.restart()
    with pytest.raises(gpuport.NotFound, match="earlier worker"):
        session.get(ref)


def test_a_named_session_and_its_values_outlive_a_server_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_server(state)
    try:
        with first.connect() as gpu:
            s = gpu.session(name="durable")
            s.put(np.arange(5), name="x")
            worker = s.info().job_id
            s.detach()
    finally:
        first.stop()
    second = start_server(state)
    second.admin_token = first.admin_token  # printed on the first start only
    try:
        with second.connect() as gpu:
            with gpu.session(name="durable") as s:
                assert s.reattached
                assert s.info().job_id == worker  # the same worker process, still running
                assert s.get(s.ref("x")).tolist() == [0, 1, 2, 3, 4]
                assert s.call(lambda v: int(v.sum()), s.ref("x")) == 10
                s.close()
            assert [x for x in gpu.sessions() if x.name == "durable"] == []
    finally:
        second.stop()


def test_a_worker_whose_server_is_gone_ends_itself_once_idle(tmp_path: Path) -> None:
    from gpuport.protocol import refs
    from gpuport.server.worker.session import Worker

    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "worker.sock"))
        listener.listen()
        worker = threading.Thread(target=Worker("j-test").serve, args=(listener, 0.3), daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive()  # no server ever came
        with socket.socket(socket.AF_UNIX) as server:
            worker = threading.Thread(target=Worker("j-test").serve, args=(listener, 0.3), daemon=True)
            worker.start()
            server.connect(str(tmp_path / "worker.sock"))  # a server that connects, then says nothing
            worker.join(10)
            assert not worker.is_alive()
    refs.table = None


# ---- the channel carrying calls, and memory reused ------------------------------------------------


def _channel(server: RunningServer, client: gpuport.Client, session_id: str) -> ssl.SSLSocket:
    """A raw channel on the data port for ``session_id``, as the client opens one."""
    request = pb.TransferRequest(session_id=session_id, channel=True)
    ticket = client.transport.call(client.transport.sessions.Transfer, request)
    context = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    context.check_hostname = False
    conn = context.wrap_socket(socket.create_connection(("127.0.0.1", ticket.port), timeout=30))
    conn.sendall(ticket.ticket.encode() + b"\n")
    assert conn.recv(1) == b"C"
    return conn


def _exchange(conn: ssl.SSLSocket, body: bytes) -> tuple[int, bytes]:
    conn.sendall(struct.pack("<I", len(body)) + body)
    head = _read(conn, 5)
    size, kind = struct.unpack("<IB", head)
    return kind, _read(conn, size)


def _read(conn: ssl.SSLSocket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the server closed the channel")
        data += chunk
    return data


def test_a_channel_carries_calls_and_answers_bad_ones_with_errors(
    server: RunningServer, admin: gpuport.Client, session: gpuport.Session
) -> None:
    session.put([1, 2], name="on-channel")
    with admin.session() as other, _channel(server, admin, session.id) as conn:
        kind, body = _exchange(conn, pb.CallRequest(session_id=session.id, op=pb.CallRequest.REFS).SerializeToString())
        assert kind == 0 and "on-channel" in {r.name for r in pb.CallReply.FromString(body).refs}
        kind, body = _exchange(conn, b"\xff\xff\xff")  # not a CallRequest
        assert kind == 1 and json.loads(body)["error"] == "InvalidRequest"
        kind, body = _exchange(conn, pb.CallRequest(session_id=other.id, op=pb.CallRequest.REFS).SerializeToString())
        error = json.loads(body)
        assert kind == 1 and error["error"] == "InvalidRequest" and f"session {session.id}" in error["message"]
        kind, body = _exchange(conn, pb.CallRequest(session_id=session.id, op=pb.CallRequest.GET).SerializeToString())
        assert kind == 1  # a GET naming no Ref: the worker's error, and the channel goes on
        kind, _ = _exchange(conn, pb.CallRequest(session_id=session.id, op=pb.CallRequest.REFS).SerializeToString())
        assert kind == 0
        conn.sendall(struct.pack("<I", 1 << 31))  # past the limit: refused, and the channel closed
        size, kind = struct.unpack("<IB", _read(conn, 5))
        assert kind == 1 and "limit" in json.loads(_read(conn, size))["message"]
        assert conn.recv(1) == b""


def test_a_channel_ticket_is_only_for_the_sessions_owner(
    server: RunningServer, user_token: str, session: gpuport.Session
) -> None:
    with server.connect(user_token) as other, pytest.raises(gpuport.NotFound):
        other.transport.call(other.transport.sessions.Transfer, pb.TransferRequest(session_id=session.id, channel=True))


def test_calls_from_threads_and_from_another_client_are_answered_in_turn(
    server: RunningServer, admin: gpuport.Client
) -> None:
    with admin.session(name="busy") as s, server.connect() as second:
        second.transport.data_port = 0  # this one's calls go through gRPC: the worker answers both connections
        s.call(lambda i: i, 0)
        assert s._channel is not None
        results: dict[str, list[int]] = {}

        def calls(name: str, session: gpuport.Session) -> None:
            results[name] = [session.call(lambda i: i * 2, i) for i in range(30)]

        with second.session(name="busy") as t:
            threads = [threading.Thread(target=calls, args=(f"t{n}", s)) for n in range(3)]
            threads.append(threading.Thread(target=calls, args=("grpc", t)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        assert results == {name: [i * 2 for i in range(30)] for name in ("t0", "t1", "t2", "grpc")}
        s.close()


def test_a_channel_the_server_closed_is_opened_again(session: gpuport.Session) -> None:
    assert session.call(lambda: 1) == 1
    first = session._channel
    assert first is not None
    first._sock.shutdown(socket.SHUT_RDWR)  # as when the server restarted between two calls
    assert session.call(lambda: 2) == 2
    assert session._channel is not None and session._channel is not first


def test_memory_a_value_still_uses_is_not_reused(session: gpuport.Session) -> None:
    x = _large()
    ref = session.put(x)
    halves = session.call(lambda a: a[::2], ref, keep=True)  # a view into the memory x arrived in
    session.delete(ref)
    ref = session.put(np.full(LARGE, 7, dtype=np.uint32))  # the same size: it would fit in x's memory
    assert np.array_equal(session.get(halves).view(np.uint32), x.view(np.uint32)[::2])
    session.delete(halves, ref)
    for n in (LARGE // 2, LARGE * 2, LARGE):  # smaller, larger, the same: memory handed back is resized
        y = np.arange(n, dtype=np.uint32) * 3
        ref = session.put(y)
        assert np.array_equal(session.get(ref), y)
        assert session.call(lambda a: int(a[-1]), ref) == (n - 1) * 3
        session.delete(ref)


def test_results_are_received_into_memory_their_arrays_let_go_of(session: gpuport.Session) -> None:
    n = 6 * 1024 * 1024  # 24 MiB: results this large are received into kept memory
    first = session.get(session.put(np.full(n, 1, dtype=np.uint32)))
    second = session.get(session.put(np.full(n, 2, dtype=np.uint32)))
    assert not np.shares_memory(first, second)  # the first is still in use
    assert (first == 1).all() and (second == 2).all()
    address = first.ctypes.data
    del first
    third = session.get(session.put(np.arange(n, dtype=np.uint32)))
    assert third.ctypes.data == address  # the first one's memory, now that nothing uses it
    assert np.array_equal(third, np.arange(n, dtype=np.uint32)) and (second == 2).all()


# ---- revocation: what a ticket handed out before it would carry, it carries no more -----------------


def _revocable(server: RunningServer, admin: gpuport.Client) -> tuple[str, gpuport.Client]:
    """A token to revoke (an admin's: these tests need no sandbox), and its client."""
    name = f"rita-{uuid.uuid4().hex[:8]}"
    return name, server.connect(admin.create_token(name, admin=True).token)


def _data_port(server: RunningServer, port: int) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    context.check_hostname = False
    return context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30))


def _refs(admin: gpuport.Client, session_id: str) -> int:
    """How many values the session's worker holds, as the server counts them."""
    return next(info.refs for info in admin.sessions() if info.id == session_id)


@pytest.mark.parametrize("kind", ["channel", "blobs"])
def test_a_ticket_handed_out_before_its_tokens_revocation_is_refused_and_carries_nothing(
    server: RunningServer, admin: gpuport.Client, kind: str
) -> None:
    name, rita = _revocable(server, admin)
    session = rita.session() if kind != "blobs" else None
    blob_data = f"{name}'s file".encode()
    blob = hashlib.sha256(blob_data).hexdigest()
    if session is not None:
        request, after = pb.TransferRequest(session_id=session.id, channel=True), b""
    else:
        request = pb.TransferRequest(blobs=True)
        head, end = struct.pack("<c64sQ", b"F", blob.encode(), len(blob_data)), struct.pack("<c64sQ", b"Z", b"", 0)
        after = head + blob_data + end
    ticket = rita.transport.call(rita.transport.sessions.Transfer, request)
    admin.revoke_token(name)
    with _data_port(server, ticket.port) as conn:
        conn.sendall(ticket.ticket.encode() + b"\n" + after)
        said = conn.recv(1000)
        assert conn.recv(1000) == b""  # and closed: nothing else is served
    refused = f"Ethis ticket was handed to '{name}', whose token has been revoked since: nothing was transferred"
    assert said == f"{refused} — log in with a valid token and try again\n".encode()
    if session is not None:
        admin.close_session(session.id)
        session.detach()
    else:
        assert not (server.state_dir / "blobs" / blob[:2] / blob[2:]).exists()
    rita.close()


def test_a_result_under_way_on_a_channel_is_cut_when_its_token_is_revoked(
    server: RunningServer, admin: gpuport.Client
) -> None:
    name, rita = _revocable(server, admin)
    session = rita.session()
    size = 12 * LARGE * 4  # 144 MiB: far more than the sockets between here and the server hold
    ref = session.put(np.ones(size // 4, dtype=np.float32))
    get = pb.CallRequest(session_id=session.id, op=pb.CallRequest.GET, ref_ids=[ref.id], results_follow=True)
    got = 0
    with _channel(server, rita, session.id) as conn:
        conn.sendall(struct.pack("<I", len(get.SerializeToString())) + get.SerializeToString())
        length, kind = struct.unpack("<IB", _read(conn, 5))
        reply = pb.CallReply.FromString(_read(conn, length))
        assert kind == 0 and reply.value.follows and sum(reply.value.sizes) == size
        while got < 1024 * 1024:
            got += len(conn.recv(65536))
        admin.revoke_token(name)
        try:
            while chunk := conn.recv(1024 * 1024):
                got += len(chunk)
        except OSError:  # the TLS end cut short
            pass
    assert got < size // 2, got  # what the sockets held when it was cut, at most
    assert _refs(admin, session.id) == 1  # the value itself stays the session's
    admin.close_session(session.id)
    session.detach()
    rita.close()


def test_a_value_under_way_on_a_channel_is_cut_when_its_token_is_revoked_and_nothing_of_it_stays(
    server: RunningServer, admin: gpuport.Client
) -> None:
    name, rita = _revocable(server, admin)
    session = rita.session()
    session.put([1])  # the worker runs
    size = 12 * LARGE * 4
    header = values.encode(np.zeros(4, dtype=np.uint8)).header
    put = pb.CallRequest(
        session_id=session.id, op=pb.CallRequest.PUT, value=pb.Value(header=header, sizes=[size], follows=True)
    )
    with _channel(server, rita, session.id) as conn:
        conn.sendall(struct.pack("<I", len(put.SerializeToString())) + put.SerializeToString())
        conn.sendall(b"u" * (4 * 1024 * 1024))
        admin.revoke_token(name)
        conn.settimeout(10)
        try:
            said = conn.recv(1000)
        except OSError:  # the TLS end cut short
            said = b""
        assert said == b"", said  # no reply: the value never arrived
    assert _refs(admin, session.id) == 1  # only the first value
    admin.close_session(session.id)
    session.detach()
    rita.close()


def test_a_value_the_call_refused_is_read_past_and_the_channel_goes_on(
    server: RunningServer, admin: gpuport.Client, session: gpuport.Session
) -> None:
    header = values.encode(np.zeros(4, dtype=np.uint8)).header
    with _channel(server, admin, session.id) as conn:
        bad = pb.CallRequest(
            session_id=session.id,
            op=pb.CallRequest.PUT,
            value=pb.Value(header=header, sizes=[5 * 1024 * 1024], follows=True),
            timeout=-1,  # refused before the worker sees it
        )
        conn.sendall(struct.pack("<I", len(bad.SerializeToString())) + bad.SerializeToString())
        conn.sendall(b"v" * (5 * 1024 * 1024))
        length, kind = struct.unpack("<IB", _read(conn, 5))
        assert kind == 1 and "timeout" in json.loads(_read(conn, length))["message"]
        kind, body = _exchange(conn, pb.CallRequest(session_id=session.id, op=pb.CallRequest.REFS).SerializeToString())
        assert kind == 0  # the 5 MiB were read past: the next call is understood
        negative = pb.CallRequest(
            session_id=session.id, op=pb.CallRequest.PUT, value=pb.Value(header=header, sizes=[-1], follows=True)
        )
        kind, body = _exchange(conn, negative.SerializeToString())
        assert kind == 1 and "negative" in json.loads(body)["message"]
        assert conn.recv(1) == b""  # how much follows is unknown: the channel ends


def test_values_on_a_channel_need_no_connection_of_their_own(
    server: RunningServer, admin: gpuport.Client, session: gpuport.Session
) -> None:
    """A large value and a large result travel on the session's own channel: no ticket is asked for."""
    session.call(lambda: None)  # the channel open
    asked: list[object] = []
    transfer = admin.transport.sessions.Transfer
    admin.transport.sessions.Transfer = lambda *a, **k: asked.append(a) or transfer(*a, **k)  # type: ignore[method-assign]
    try:
        x = _large()
        back = session.get(session.put(x))
        doubled = session.call(lambda a: a.view(np.uint32) * 2, x)
    finally:
        admin.transport.sessions.Transfer = transfer  # type: ignore[method-assign]
    assert asked == []
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    assert np.array_equal(doubled, x.view(np.uint32) * 2)
