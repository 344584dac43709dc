"""One user cannot push the others off (issue 32, point 6), on real servers: a flood of bare
connections at the data port, a flood of dashboard logins, thousands of ended jobs, a deep queue."""

from __future__ import annotations

import collections
import contextlib
import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import gpuport
from gpuport.client._data_port import Channel
from gpuport.protocol import gpuport_pb2 as pb
from tests.conftest import JobFlag, RunningServer, client_env, needs_users, start_server, wait_for

# Holds until the flag file named by argv[1] appears in its folder (see JobFlag).
HOLD = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)"


@pytest.fixture(scope="module")
def fair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of this module's own: its tests set quotas and fill its job table."""
    running = start_server(tmp_path_factory.mktemp("fair") / "state")
    yield running
    running.stop()


@pytest.fixture
def flag(fair: RunningServer) -> Iterator[JobFlag]:
    raised = JobFlag(fair.state_dir)
    yield raised
    raised.close()


@pytest.fixture
def boss(fair: RunningServer) -> Iterator[gpuport.Client]:
    with fair.connect() as client:
        yield client


def _token(admin: gpuport.Client, name: str) -> str:
    needs_users()
    return admin.create_token(f"{name}-{len(admin.tokens())}").token


def test_every_running_job_is_listed_past_a_thousand_ended_ones(
    fair: RunningServer, boss: gpuport.Client, flag: JobFlag, cli: object
) -> None:
    token = _token(boss, "erin")
    with fair.connect(token) as erin:
        boss.set_quota(erin.user, jobs=1)  # the rest wait behind the running one: cancelled at once
        running = erin.submit(["python", "-c", HOLD, str(flag)], workdir=None)
        wait_for(lambda: running.status == "running", what="erin's first job")
        started = time.monotonic()
        for _ in range(1_010):
            erin.submit(["true"], workdir=None).cancel()
        print(f"1,010 submits and cancels in {time.monotonic() - started:.1f}s")
        listed = erin.jobs(all=True)
        assert [j.id for j in listed if j.status == "running"] == [running.id]
        # Newest first: the 500 newest ended ones, then the running one, older than all of them.
        assert [j.status for j in listed] == ["cancelled"] * 500 + ["running"]
        rest = fair.rest("GET", "/v1/jobs?all=true", token=token)
        assert rest.status_code == 200 and running.id in [j["id"] for j in rest.json()]
        shown = cli("jobs", "--all", **client_env(fair, token))  # type: ignore[operator]
        assert shown.code == 0 and running.id in shown.stdout
        flag.touch()
        assert running.wait(30).info.state == "succeeded"


def _pipelined_logins(server: RunningServer, token: str, count: int, source: str = "127.0.0.1") -> list[str]:
    """Log in ``count`` times over one TLS connection from ``source``, every request sent before the
    replies are read (HTTP/1.1 pipelining): the server does all the work, the client only writes and
    reads bytes. Returns the logins' ids."""
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    url = httpx.URL(server.http_url)
    body = json.dumps({"token": token}).encode()
    request = (
        f"POST /ui/login HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    raw = socket.create_connection((url.host, url.port), source_address=(source, 0))
    with raw, trust.wrap_socket(raw, server_hostname=url.host) as tls:
        sender = threading.Thread(target=tls.sendall, args=(request * count,), daemon=True)
        sender.start()
        replies = tls.makefile("rb")
        logins = []
        for _ in range(count):
            status, length, cookie = replies.readline(), 0, ""
            assert b" 200 " in status, status
            while (line := replies.readline().decode()) != "\r\n":
                name, _, value = line.partition(":")
                if name.lower() == "content-length":
                    length = int(value)
                elif name.lower() == "set-cookie" and value.strip().startswith("gpuport_login="):
                    cookie = value.strip().split(";")[0].split("=", 1)[1]
            replies.read(length)
            logins.append(cookie)
        sender.join()
        return logins


def test_a_flood_of_one_users_dashboard_logins_logs_only_their_own_oldest_out(
    fair: RunningServer, boss: gpuport.Client
) -> None:
    mallory, alice = _token(boss, "mallory"), _token(boss, "alice")
    trust = ssl.create_default_context(cafile=str(fair.state_dir / "tls" / "cert.pem"))
    with httpx.Client(base_url=fair.http_url, verify=trust, timeout=30) as http:

        def logged_in(login: str) -> bool:
            return http.get("/ui/me", headers={"cookie": f"gpuport_login={login}"}).status_code == 200

        [theirs] = _pipelined_logins(fair, alice, 1)
        flood = _pipelined_logins(fair, mallory, 160, source="127.0.0.2")  # past the 100 a user holds
        assert logged_in(theirs)  # alice's one login survives mallory's flood
        assert not logged_in(flood[0])  # mallory's own oldest went
        assert logged_in(flood[-1])


def test_logins_from_one_address_are_paced_and_past_a_hundred_waiting_refused(
    fair: RunningServer, boss: gpuport.Client
) -> None:
    """50 logins from an address at once, then 20 a second; a login past that waits its turn, and
    past 100 waiting it is answered 429 with Retry-After. Another address logs in meanwhile."""
    mallory, alice = _token(boss, "mallory"), _token(boss, "alice")
    started = time.monotonic()
    paced = _pipelined_logins(fair, mallory, 90, source="127.0.0.3")  # over one connection: one waits at a time
    assert all(paced)
    assert time.monotonic() - started >= (90 - 50) / 20 * 0.9  # the 40 past the burst came 20 a second
    answers: list[bytes] = []
    # Each connection is made first (TLS included), then all 200 logins are sent at once: on a busy
    # machine, connections made one after another could arrive slower than the pace lets them out.
    ready = threading.Barrier(200, timeout=120)
    flooding = [
        threading.Thread(target=lambda: answers.append(_status(fair, mallory, "127.0.0.4", ready))) for _ in range(200)
    ]
    for thread in flooding:
        thread.start()
    wait_for(lambda: len(answers) >= 60, timeout=60, what="the first logins of the flood")
    assert _status(fair, alice, "127.0.0.1").startswith(b"HTTP/1.1 200")  # another address: not behind them
    assert any(thread.is_alive() for thread in flooding)  # while the flood still waits
    for thread in flooding:
        thread.join(60)
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
    assert refused and len(answers) == 200, collections.Counter(a.split(b"\r\n")[0] for a in answers)
    assert all(b"retry-after:" in a.lower() and b"too many logins from 127.0.0.4" in a for a in refused)
    assert all(a.startswith((b"HTTP/1.1 200", b"HTTP/1.1 429")) for a in answers)


def _status(server: RunningServer, token: str, source: str, ready: threading.Barrier | None = None) -> bytes:
    """One login from ``source`` on a connection of its own: the whole answer. With ``ready``, the
    login is sent once every party's connection is made."""
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    url = httpx.URL(server.http_url)
    body = json.dumps({"token": token}).encode()
    request = (
        f"POST /ui/login HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    raw = socket.create_connection((url.host, url.port), timeout=60, source_address=(source, 0))
    with raw, trust.wrap_socket(raw, server_hostname=url.host) as tls:
        if ready is not None:
            ready.wait()
        tls.sendall(request)
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        return answer


def _add(a: int, b: int) -> int:
    return a + b


def test_a_flood_of_bare_connections_from_one_address_leaves_another_users_handshakes_alone(
    fair: RunningServer, boss: gpuport.Client
) -> None:
    """Plain TCP connections from 127.0.0.2, opened as fast as two threads can and never sending a
    byte (no TLS, no ticket), while a user on 127.0.0.1 opens a session and calls into it. One of
    that user's channels shook hands and holds its ticket back (a slow link) while hundreds of the
    flood's connections arrive, more than every address's share together once was; then more of
    its channels shake hands and send their tickets in the middle of the flood."""
    found = re.search(r"^  data port\s+(\d+)", fair.banner, re.MULTILINE)
    assert found, fair.banner
    port = int(found[1])
    token = _token(boss, "carol")
    stop, opened, pushed_out = threading.Event(), [0, 0], [0, 0]

    def flood(index: int) -> None:
        mine: collections.deque[socket.socket] = collections.deque()
        while not stop.is_set():
            bare = socket.socket()
            bare.bind(("127.0.0.2", 0))
            try:
                bare.connect(("127.0.0.1", port))
            except OSError:
                bare.close()
                continue
            mine.append(bare)
            opened[index] += 1
            if len(mine) > 200:  # the server pushed these out long ago: see that it did, and let go
                old = mine.popleft()
                old.setblocking(False)
                with contextlib.suppress(OSError):
                    pushed_out[index] += old.recv(1) == b""
                old.close()
        for bare in mine:
            bare.close()

    flooders = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(2)]
    for thread in flooders:
        thread.start()
    try:
        wait_for(lambda: sum(opened) > 300, what="the flood under way")
        with fair.connect(token) as carol, carol.session() as session:
            request = pb.TransferRequest(session_id=session.id, channel=True)
            ticket, held = session._transport.data_connection(request)  # TLS is up; the ticket waits
            assert held is not None
            then = sum(opened)
            wait_for(lambda: sum(opened) > then + 600, what="600 more bare connections")
            slow = Channel(held, ticket.ticket)  # answered C: its connection was not pushed out
            slow.close()
            before = sum(opened)
            started = time.monotonic()
            for i in range(20):
                assert session.call(_add, i, 1) == i + 1
                session._close_channel()  # the next call opens a new channel: a new handshake in the flood
            took = time.monotonic() - started
            during = sum(opened)
    finally:
        stop.set()
        for thread in flooders:
            thread.join(10)
    print(
        f"{during - before} bare connections during the calls, {sum(opened)} in all, {sum(pushed_out)} seen pushed out; 20 channels and calls in {took:.2f}s"
    )
    assert sum(pushed_out) > 0  # the flood's own oldest went
    assert took < 20


def test_a_queued_cap_refuses_the_job_past_it_and_stores_nothing(
    fair: RunningServer, boss: gpuport.Client, flag: JobFlag, cli: object, tmp_path: Path
) -> None:
    token = _token(boss, "quinn")
    with fair.connect(token) as quinn:
        env = client_env(fair)
        done = cli("quota", "set", quinn.user, "--jobs", "1", "--queued", "3", **env)  # type: ignore[operator]
        assert done.code == 0, done.output
        assert "1 job at once; 3 jobs queued" in done.output
        listed = cli("quota", "list", **env)  # type: ignore[operator]
        assert "QUEUED" in listed.stdout and any(
            quinn.user in line and " 3 " in line for line in listed.stdout.splitlines()
        ), listed.stdout
        running = quinn.submit(["python", "-c", HOLD, str(flag)], workdir=None)
        wait_for(lambda: running.status == "running", what="quinn's first job")
        waiting = [quinn.submit(["true"], workdir=None) for _ in range(3)]
        assert {j.status for j in waiting} == {"queued"}
        before = len(quinn.jobs(all=True))
        with pytest.raises(
            gpuport.ResourceUnavailable,
            match=rf"{quinn.user} has 3 jobs queued, the most allowed at once is 3: .*--queued N",
        ):
            quinn.submit(["true"], workdir=None)
        refused = cli("run", "--detach", "--", "true", cwd=tmp_path, **client_env(fair, token))  # type: ignore[operator]
        assert refused.code != 0 and "the most allowed at once is 3" in refused.output, refused.output
        assert len(quinn.jobs(all=True)) == before  # nothing stored
        waiting[0].cancel()
        quinn.submit(["true"], workdir=None)  # room again
        flag.touch()
        assert running.wait(30).info.state == "succeeded"
