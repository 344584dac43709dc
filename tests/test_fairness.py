"""One user cannot push the others off (issue 32, point 6), on real servers: a flood of bare
connections at the data port, a flood of dashboard logins, thousands of ended jobs, a deep queue."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

import gpuport
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


def _pipelined_logins(server: RunningServer, token: str, count: int) -> list[str]:
    """Log in ``count`` times over one TLS connection, every request sent before the replies are read
    (HTTP/1.1 pipelining): the server does all the work, the client only writes and reads bytes."""
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    url = httpx.URL(server.http_url)
    body = json.dumps({"token": token}).encode()
    request = (
        f"POST /ui/login HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((url.host, url.port)) as raw, trust.wrap_socket(raw, server_hostname=url.host) as tls:
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
        started = time.monotonic()
        flood = _pipelined_logins(fair, mallory, 10_050)  # past the 10,000 every user once shared
        print(f"10,050 logins in {time.monotonic() - started:.1f}s")
        assert logged_in(theirs)  # alice's one login survives mallory's flood
        assert not logged_in(flood[0])  # mallory's own oldest went
        assert logged_in(flood[-1])
