"""Attacks by a user with an ordinary token, each asserted by what it could not do.

The blob store answers per user (a hash is no oracle and no key); outputs are collected without
following a job's symlinks and copied into the store, never hard-linked; and every job runs in a
bubblewrap sandbox, as a uid of its owner's when the server is root (as here, in CI): it sees neither
the state dir nor other processes, and its ports are in a network namespace of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import gpuport
from gpuport.defaults import DEFAULT_JOBS_PER_USER, MAX_REST_BODY_BYTES
from gpuport.protocol import gpuport_pb2 as pb
from tests.conftest import (
    JobFlag,
    RunningServer,
    client_env,
    needs_users,
    server_env,
    start_server,
    touch_in_job,
    wait_for,
)


@pytest.fixture
def alice(admin: gpuport.Client, server: RunningServer) -> Iterator[gpuport.Client]:
    with server.connect(admin.create_token(f"alice-{uuid.uuid4().hex[:8]}").token) as client:
        yield client


@pytest.fixture
def bob(admin: gpuport.Client, server: RunningServer) -> Iterator[gpuport.Client]:
    with server.connect(admin.create_token(f"bob-{uuid.uuid4().hex[:8]}").token) as client:
        yield client


def test_a_hash_neither_tells_nor_hands_out_another_users_content(
    alice: gpuport.Client, bob: gpuport.Client, tmp_path: Path
) -> None:
    secret = f"alice's API key {uuid.uuid4()}\n".encode()
    blob = hashlib.sha256(secret).hexdigest()
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "key.txt").write_bytes(secret)
    alice.push(tmp_path / "alice", "keys")

    # Bob guesses the content: the server answers as if nobody had it.
    assert list(bob.transport.call(bob.transport.snapshots.Missing, pb.BlobList(blobs=[blob])).blobs) == [blob]
    # A manifest naming it makes no snapshot of it for him.
    entry = pb.ManifestEntry(path="stolen.txt", blob=blob, size=len(secret), mode=0o644)
    reply = bob.transport.call(bob.transport.snapshots.Create, pb.CreateSnapshotRequest(entries=[entry], name="stolen"))
    assert list(reply.missing) == [blob] and not reply.snapshot_id
    assert "stolen" not in [s.name for s in bob.snapshots()]

    # Sending the bytes proves he has them: then the snapshot is his, and he sent them all.
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "key.txt").write_bytes(secret)
    pushed = bob.push(tmp_path / "bob", "mine")
    assert pushed.uploaded_files == 1 and pushed.uploaded_bytes == len(secret)
    # Alice, who holds it, uploads nothing on her next push.
    again = alice.push(tmp_path / "alice", "keys")
    assert again.uploaded_files == 0


def test_outputs_are_collected_without_following_the_jobs_symlinks(admin: gpuport.Client, tmp_path: Path) -> None:
    script = """
import os
out = os.environ["GPUPORT_OUTPUT_DIR"]
os.symlink("/etc", "up")                       # work/up -> /etc
os.makedirs("results")
os.symlink("/etc/passwd", "results/passwd")
open("results/real.txt", "w").write("mine")
os.symlink("/etc/passwd", out + "/passwd")     # in $GPUPORT_OUTPUT_DIR too
os.symlink("/", out + "/root")
open(out + "/kept.txt", "w").write("kept")
"""
    job = admin.submit(["python", "-c", script], workdir=None, outputs=["up/hostname", "up", "results"]).wait(60)
    assert job.exit_code == 0, list(job.logs())
    assert "up/hostname" in job.info.message and "up" in job.info.message  # declared, but not found
    files = job.download(tmp_path, ".")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in files) == ["kept.txt", "results/real.txt"]


def test_an_output_enters_the_store_as_a_copy_of_the_servers_own(
    server: RunningServer, admin: gpuport.Client, tmp_path: Path
) -> None:
    """A hard link would make the blob the job's own inode (its uid's, which a later job of the same
    user could change, wherever it kept another link to it)."""
    content = f"trained weights {uuid.uuid4()}"
    script = f"import os\nopen(os.environ['GPUPORT_OUTPUT_DIR'] + '/weights.bin', 'w').write({content!r})"
    job = admin.submit(["python", "-c", script], workdir=None).wait(60)
    assert job.exit_code == 0, list(job.logs())
    (downloaded,) = job.download(tmp_path / "out", ".")
    assert downloaded.read_text() == content
    blob = hashlib.sha256(content.encode()).hexdigest()
    stored = (server.state_dir / "blobs" / blob[:2] / blob[2:]).stat()
    assert stored.st_uid == os.getuid() and stored.st_nlink == 1 and stored.st_mode & 0o777 == 0o444


# ---- the sandbox: what a job of one user cannot reach -------------------------------------------

PROBE = r"""
import json, os, socket, sys
state = sys.argv[1]
seen = {"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
seen["state"] = sorted(os.listdir(state)) if os.path.isdir(state) else []
seen["jobs"] = sorted(os.listdir(state + "/jobs")) if os.path.isdir(state + "/jobs") else []
for name, path in (("key", state + "/tls/key.pem"), ("db", state + "/gpuport.db")):
    try:
        open(path, "rb").close()
        seen[name] = "readable"
    except OSError as e:
        seen[name] = type(e).__name__
seen["home"] = os.path.exists(os.path.expanduser("~root/.ssh"))
print(json.dumps(seen))
"""


def _last_json(job: gpuport.Job) -> dict:
    import json

    lines = list(job.logs())
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"log": lines}


def test_a_job_sees_neither_the_state_dir_nor_other_processes(
    server: RunningServer, alice: gpuport.Client, bob: gpuport.Client
) -> None:
    first = alice.submit(["python", "-c", PROBE, str(server.state_dir)], workdir=None).wait(60)
    second = bob.submit(["python", "-c", PROBE, str(server.state_dir)], workdir=None).wait(60)
    for job, seen in ((first, _last_json(first)), (second, _last_json(second))):
        # Of the state dir, only the way to its own folders is there (made for the sandbox's mounts).
        assert set(seen["state"]) <= {"jobs", "fake-gpus"} and seen["jobs"] == [job.id], seen
        assert seen["key"] == seen["db"] == "FileNotFoundError", seen
        assert len(seen["pids"]) <= 3, seen  # its supervisor, itself (and a shell): nothing of the host's
        assert not seen["home"]
    if os.geteuid() == 0:  # a uid per user, neither the server's nor each other's
        uids = {_last_json(first)["uid"], _last_json(second)["uid"]}
        assert len(uids) == 2 and 0 not in uids, uids


def _job_pid(server: RunningServer, job: gpuport.Job) -> int:
    """The host pid of the job's first process, as the server knows it."""
    import json

    info = json.loads((server.state_dir / "jobs" / job.id / "supervisor.json").read_text())
    return int(psutil.Process(info["child"]).children(recursive=True)[-1].pid)


def test_a_job_cannot_signal_or_connect_to_another_users_job(
    server: RunningServer, alice: gpuport.Client, bob: gpuport.Client
) -> None:
    listener = (
        "import socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(60)\n"
    )
    victim = alice.submit(["python", "-c", listener], workdir=None)
    lines = victim.logs(follow=True)
    port = int(next(lines))
    pid = _job_pid(server, victim)
    attack = (
        "import os, signal, socket, sys\n"
        "pid, port = map(int, sys.argv[1:])\n"
        "try:\n    os.kill(pid, signal.SIGKILL); print('killed')\n"
        "except OSError as e:\n    print('kill', type(e).__name__)\n"
        "try:\n    socket.create_connection(('127.0.0.1', port), timeout=2); print('connected')\n"
        "except OSError as e:\n    print('connect', type(e).__name__)\n"
    )
    attacker = bob.submit(["python", "-c", attack, str(pid), str(port)], workdir=None).wait(60)
    said = list(attacker.logs())
    assert said == ["kill ProcessLookupError", "connect ConnectionRefusedError"], said
    # Nor can anyone on the host: the port is in the job's own network namespace.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    assert victim.status == "running"
    victim.cancel()
    assert victim.wait(30).info.state == "cancelled"


def test_a_dataset_stays_as_it_was_pushed_whatever_a_job_does(
    alice: gpuport.Client, bob: gpuport.Client, tmp_path: Path
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "labels.csv").write_text("cat,dog\n")
    alice.push(tmp_path / "data", "labels")
    vandal = (
        "import os\n"
        "path = os.environ['GPUPORT_DATASETS_DIR'] + '/labels/labels.csv'\n"
        "for attempt in (lambda: os.chmod(path, 0o666), lambda: open(path, 'w').write('poisoned'),\n"
        "                lambda: os.unlink(path)):\n"
        "    try:\n        attempt(); print('done')\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
    )
    job = alice.submit(["python", "-c", vandal], workdir=None, datasets=["labels"]).wait(60)
    assert "done" not in list(job.logs()), list(job.logs())
    reader = "import os; print(open(os.environ['GPUPORT_DATASETS_DIR'] + '/labels/labels.csv').read().strip())"
    assert list(alice.submit(["python", "-c", reader], workdir=None, datasets=["labels"]).wait(60).logs()) == [
        "cat,dog"
    ]


def test_without_a_sandbox_every_token_is_an_admin_token(tmp_path: Path) -> None:
    """A server that finds no bubblewrap says so, and refuses to make a token that is not an admin's."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = server_env(GPUPORT_FAKE_GPUS="1x1GiB", PATH=f"{empty}{os.pathsep}{Path(sys.executable).parent}")
    running = start_server(tmp_path / "state", env=env)
    try:
        assert "isolation    none: bubblewrap is not installed" in running.banner
        with running.connect() as admin:
            with pytest.raises(gpuport.InvalidRequest, match="cannot isolate jobs"):
                admin.create_token("carol")
            assert admin.create_token("dave", admin=True).admin
    finally:
        running.stop()


NOBODY = 65534


def _unprivileged() -> tuple[str, ...]:
    """The command prefix that runs the server as an unprivileged uid: none when the tests are not
    root; as root, ``setpriv`` to nobody inside a bubblewrap mount namespace that shows this
    Python's folder (root's 0700 home hides it from other uids). Skips where user namespaces are off."""
    if os.geteuid() != 0:
        return ()
    if not (shutil.which("bwrap") and shutil.which("setpriv")):
        pytest.skip("needs bubblewrap and setpriv (apt-get install bubblewrap util-linux)")
    shown: list[str] = []
    made: set[str] = set()
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, Path(gpuport.__file__).parents[1])}
    for path in sorted(needed):
        if path.startswith("/root/"):
            for folder in (str(p) for p in reversed(Path(path).parents) if str(p).startswith("/root/")):
                if folder not in made:
                    shown += ["--perms", "0755", "--dir", folder]
                    made.add(folder)
            shown += ["--ro-bind", path, path]
            continue
        for folder in [*reversed(Path(path).parents), Path(path)]:
            if not folder.stat().st_mode & 0o001:
                pytest.skip(f"{folder} is closed to other users: the server as uid {NOBODY} could not run from {path}")
    prefix = ("bwrap", "--dev-bind", "/", "/", "--tmpfs", "/root", *shown, "--")
    drop = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    probe = subprocess.run(
        [*prefix, *drop, "bwrap", "--ro-bind", "/", "/", "--unshare-pid", "true"], capture_output=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are off for unprivileged users here: {probe.stderr.decode().strip()}")
    return (*prefix, *drop)


def test_an_unprivileged_server_sandboxes_jobs_in_a_user_namespace(tmp_path: Path) -> None:
    """Not root: bubblewrap makes the namespaces in an unprivileged user namespace, and jobs keep the
    server's uid, with the state dir and the machine's processes out of sight as before."""
    wrapper = _unprivileged()
    home = Path(tempfile.mkdtemp(prefix="gpuport-unprivileged-"))  # not under the tests' 0700 tmp
    try:
        home.chmod(0o755)
        if wrapper:
            os.chown(home, NOBODY, NOBODY)
        state = home / "state"
        running = start_server(state, wrapper=wrapper)
        try:
            assert "isolation    bubblewrap sandbox, the server's uid" in running.banner, running.banner
            with running.connect() as admin:
                with running.connect(admin.create_token("erin").token) as erin:  # a sandbox: users allowed
                    job = erin.submit(["python", "-c", PROBE, str(state)], workdir=None).wait(60)
                    seen = _last_json(job)
                    assert job.exit_code == 0, seen
            assert set(seen["state"]) <= {"jobs", "fake-gpus"} and seen["jobs"] == [job.id], seen
            assert seen["key"] == seen["db"] == "FileNotFoundError", seen
            assert len(seen["pids"]) <= 3 and seen["uid"] == (NOBODY if wrapper else os.getuid()), seen
        finally:
            running.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_job_reaches_neither_the_servers_ports_nor_the_machines_loopback(
    server: RunningServer, alice: gpuport.Client
) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    probe = (
        "import socket, sys\n"
        "port = int(sys.argv[1])\n"
        "for host in ('127.0.0.1', '10.0.2.2'):  # its own loopback; slirp4netns's gateway to the host\n"
        "    try:\n        socket.create_connection((host, port), timeout=3); print(host, 'connected')\n"
        "    except OSError as e:\n        print(host, type(e).__name__)\n"
        "routes = open('/proc/net/route').read().split('\\n')[1:]\n"
        "print('default route', any(r.split()[1:2] == ['00000000'] for r in routes if r.strip()))\n"
    )
    said = list(alice.submit(["python", "-c", probe, str(port)], workdir=None).wait(60).logs())
    assert said[0] == "127.0.0.1 ConnectionRefusedError", said
    assert "connected" not in said[1], said
    # With slirp4netns the job has a way out (a default route); without, loopback only.
    assert said[2] == f"default route {bool(shutil.which('slirp4netns'))}", said


@pytest.mark.skipif(
    not shutil.which("slirp4netns"), reason="slirp4netns is not installed (apt-get install slirp4netns)"
)
def test_a_jobs_way_out_ends_with_its_supervisor_even_killed(server: RunningServer, alice: gpuport.Client) -> None:
    """slirp4netns holds the job's network namespace open: it must not outlive the supervisor that
    started it, even one killed with SIGKILL (a lifeline pipe, ``--exit-fd``)."""
    import json

    job = alice.submit(["sleep", "600"], workdir=None)
    try:
        info = server.state_dir / "jobs" / job.id / "supervisor.json"
        wait_for(info.exists, 60, "the job's supervisor")
        supervisor = psutil.Process(json.loads(info.read_text())["pid"])
        slirp = wait_for(
            lambda: [p for p in supervisor.children() if "slirp4netns" in p.name()], 30, "the job's slirp4netns"
        )[0]
        supervisor.kill()
        gone, _ = psutil.wait_procs([slirp], timeout=15)
        assert gone, f"slirp4netns (pid {slirp.pid}) outlived its supervisor"
    finally:
        with contextlib.suppress(Exception):
            job.cancel()


# ---- revocation ---------------------------------------------------------------------------------


def _user_client(server: RunningServer, admin: gpuport.Client, name: str) -> tuple[str, gpuport.Client]:
    needs_users()
    user = f"{name}-{uuid.uuid4().hex[:8]}"
    return user, server.connect(admin.create_token(user).token)


def test_a_revoked_tokens_open_channel_and_streams_close_at_once_and_its_work_goes_on(
    server: RunningServer, admin: gpuport.Client
) -> None:
    name, carol = _user_client(server, admin, "carol")
    session = carol.session()
    assert session.call(sum, [1, 2]) == 3  # its data-port channel is open now
    job = carol.submit(["python", "-c", "import time\nwhile True: print('tick', flush=True); time.sleep(0.1)"],
                       workdir=None)  # fmt: skip
    followed: list[object] = []

    def follow() -> None:
        try:
            for _ in carol.job(job.id).logs(follow=True):
                pass
            followed.append("ended")
        except gpuport.GpuportError as e:
            followed.append(e)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    wait_for(lambda: admin.job(job.id).refresh().log_bytes > 0, what="the job's first line")
    admin.revoke_token(name)
    with pytest.raises(gpuport.AuthenticationError):
        session.call(sum, [1, 2])  # on the channel opened before: closed
    follower.join(10)
    assert not follower.is_alive() and isinstance(followed[0], gpuport.AuthenticationError), followed
    # Rotating a token loses no work: the job runs on, the session lives.
    assert admin.job(job.id).status == "running"
    assert any(s.id == session.id for s in admin.sessions())
    admin.job(job.id).cancel()
    admin.close_session(session.id)
    session.detach()
    carol.close()


def test_revoking_with_end_work_cancels_the_users_jobs_and_closes_their_sessions(
    server: RunningServer, admin: gpuport.Client, cli: object
) -> None:
    name, dave = _user_client(server, admin, "dave")
    session = dave.session()
    session.call(len, "x")
    running = dave.submit(["sleep", "60"], workdir=None)
    wait_for(lambda: running.status == "running", what="dave's job running")
    result = cli("token", "revoke", name, "--end-work", **client_env(server))  # type: ignore[operator]
    assert result.code == 0 and "ended their jobs and sessions" in result.stdout, result.stderr
    ended = admin.job(running.id).wait(30).info
    assert ended.state == "cancelled", ended
    wait_for(lambda: all(s.id != session.id for s in admin.sessions()), what="dave's session closed")
    session.detach()
    dave.close()


# ---- bounded before read ------------------------------------------------------------------------


def _https(server: RunningServer, head: bytes) -> ssl.SSLSocket:
    """A raw HTTPS connection to the server's HTTP port, with ``head`` sent on it."""
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    trust.check_hostname = False
    host, port = server.http_url.removeprefix("https://").rsplit(":", 1)
    conn = trust.wrap_socket(socket.create_connection((host, int(port)), timeout=10))
    conn.sendall(head)
    return conn


def _status_line(conn: ssl.SSLSocket) -> str:
    return conn.recv(65536).split(b"\r\n", 1)[0].decode()


def test_a_request_body_is_not_read_without_a_token_and_is_counted_as_it_arrives(server: RunningServer) -> None:
    chunked = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    # No token: answered 401 while the body is still coming (its end is never sent).
    conn = _https(server, chunked + b"\r\n" + b"100000\r\n" + b"x" * 65536)
    assert _status_line(conn) == "HTTP/1.1 401 Unauthorized"
    conn.close()
    wrong = _https(
        server, b"POST /v1/tokens HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer gp_wrong\r\nContent-Length: 900\r\n\r\n"
    )
    assert _status_line(wrong) == "HTTP/1.1 401 Unauthorized"  # before any of its 900 bytes came
    wrong.close()
    # A token, and a chunked body past the limit: 413 once the limit is crossed, and the connection
    # closed (what is left of the body is not read).
    head = chunked + f"Authorization: Bearer {server.admin_token}\r\n\r\n".encode()
    conn = _https(server, head)
    with contextlib.suppress(OSError):  # the server may close before all is sent
        for _ in range(2 * MAX_REST_BODY_BYTES // 0x10000):
            conn.sendall(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
    answer = b""
    while chunk := conn.recv(65536):  # to the end: the server closes the connection
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"over the limit" in answer, answer[:200]
    conn.close()
    # Within the limit, chunked: the job is made.
    body = json.dumps({"command": ["true"]}).encode()
    conn = _https(server, head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert _status_line(conn) == "HTTP/1.1 201 Created"
    conn.close()


def test_the_data_port_holds_no_thread_for_a_connection_without_its_ticket(
    server: RunningServer, admin: gpuport.Client
) -> None:
    port = int(re.search(r"data port\s+(\d+)", server.banner)[1])  # type: ignore[index]
    process = psutil.Process(server.process.pid)
    before = process.num_threads()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(200)]
    time.sleep(0.5)
    assert process.num_threads() < before + 5, (before, process.num_threads())
    assert idle[0].recv(1) == b""  # the oldest were closed to make room for the newest
    session = admin.session()
    assert session.call(sum, [1, 2]) == 3  # a session's channel still opens meanwhile
    session.close()
    # A client that sends its ticket a byte a second is closed when its time from the start is up.
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    trust.check_hostname = False
    slow = trust.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=15))
    started = time.monotonic()
    with pytest.raises(OSError):
        for _ in range(30):
            slow.sendall(b"0")
            time.sleep(1)
    assert 8 < time.monotonic() - started < 15
    for conn in [slow, *idle]:
        conn.close()


def test_an_idle_channel_gives_its_thread_up_and_takes_one_again_for_its_next_call(
    server: RunningServer, admin: gpuport.Client
) -> None:
    from gpuport.server.api.data_port import _PARK_AFTER

    process = psutil.Process(server.process.pid)
    sessions = [admin.session() for _ in range(6)]
    try:
        assert [s.call(sum, [i, 1]) for i, s in enumerate(sessions)] == [1, 2, 3, 4, 5, 6]  # 6 channels, busy
        opened = [s._channel for s in sessions]
        # The server's pools grow lazily, the more so on a busy machine (six sessions' output is
        # followed): counted once they have grown, as the channels idle and are called again.
        time.sleep(_PARK_AFTER + 1)
        assert [s.call(sum, [i, 2]) for i, s in enumerate(sessions)] == [2, 3, 4, 5, 6, 7]
        busy = process.num_threads()
        # Six threads end; the server may start two of its own meanwhile.
        wait_for(
            lambda: process.num_threads() <= busy - 4,
            20,
            lambda: f"the idle channels' threads ended ({process.num_threads()} threads, {busy} when busy)",
        )
        assert [s.call(sum, [i, 3]) for i, s in enumerate(sessions)] == [3, 4, 5, 6, 7, 8]
        assert None not in opened and [s._channel for s in sessions] == opened  # the same channels, not new ones
    finally:
        for session in sessions:
            session.close()


def test_one_user_runs_a_bounded_number_of_jobs_by_default(tmp_path: Path) -> None:
    running = start_server(tmp_path / "state")
    flag = JobFlag(running.state_dir)
    try:
        with running.connect() as admin:
            assert [(q.user, q.jobs) for q in admin.quotas()] == [("*", DEFAULT_JOBS_PER_USER)]
            hold = f"while [ ! -e {flag} ]; do sleep 0.05; done"
            jobs = [admin.submit(hold, workdir=None) for _ in range(DEFAULT_JOBS_PER_USER + 1)]
            wait_for(lambda: sum(j.status == "running" for j in jobs) == DEFAULT_JOBS_PER_USER, 60, "16 running")
            last = jobs[-1].refresh()
            assert last.state == "queued" and f"runs {DEFAULT_JOBS_PER_USER} jobs, the most" in last.message, last
            admin.set_quota("*", jobs=DEFAULT_JOBS_PER_USER + 1)  # an admin raises it: it starts
            wait_for(lambda: jobs[-1].status == "running", 30, "the job past the default")
            flag.touch()
            assert all(j.wait(60).info.state == "succeeded" for j in jobs)
    finally:
        flag.close()
        running.stop()


def test_work_that_reserves_no_memory_waits_below_the_memory_floor(tmp_path: Path, cli: object) -> None:
    bad = start_server(tmp_path / "bad", "--memory-floor", "lots", expect_ready=False)
    assert bad.process.returncode != 0 and "--memory-floor" in bad.banner and "8GiB" in bad.banner, bad.banner
    running = start_server(tmp_path / "state", "--memory-floor", "1024TiB")
    try:
        assert "memory floor 1024TiB free" in running.banner
        with running.connect() as admin:
            waits = admin.submit(["true"], workdir=None)
            reserves = admin.submit(["true"], workdir=None, memory="64MiB")
            assert reserves.wait(60).info.state == "succeeded"  # what reserves memory is counted as before
            listed = cli("queue", **client_env(running))  # type: ignore[operator]
            assert listed.code == 0 and "below the floor of 1024TiB" in " ".join(listed.stdout.split()), listed.stdout
            info = waits.refresh()
            assert info.state == "queued" and "reserves no memory waits" in info.message, info
            waits.cancel()
    finally:
        running.stop()


# ---- a job's environment ------------------------------------------------------------------------

TRICKY = 'it\'s "quoted"\n$(touch pwned) `touch pwned` \\ ${HOME} end ü'


def test_a_jobs_environment_reaches_the_job_only_and_as_it_was_given(
    server: RunningServer, alice: gpuport.Client
) -> None:
    """A one-process job starts straight under bubblewrap, its environment read by /bin/sh as the
    job's uid: not given to what runs as root before (an LD_PRELOAD would run there), not on any
    command line, and every byte as it was sent, nothing in it run."""
    secret = f"secret-{uuid.uuid4().hex}"
    script = (
        "import json, os, time\n"
        "print(json.dumps([os.environ['TRICKY'], os.environ['SECRET'], sorted(os.listdir('.'))]), flush=True)\n"
        "while not os.path.exists('go'): time.sleep(0.02)\n"
    )
    job = alice.submit(["python", "-c", script], workdir=None, env={"TRICKY": TRICKY, "SECRET": secret})
    try:
        wait_for(lambda: job.refresh().log_bytes, what="the job's line")
        supervisor = json.loads((server.state_dir / "jobs" / job.id / "supervisor.json").read_text())
        bwrap = psutil.Process(supervisor["child"])
        for process in [bwrap, *bwrap.children(recursive=True)]:
            if process.uids().real == 0:  # bubblewrap, outside and as the job's pid 1
                assert secret not in process.environ().values(), process.cmdline()
            assert not any(secret in arg for arg in process.cmdline()), process.cmdline()
        assert json.loads(list(job.logs())[0]) == [TRICKY, secret, []]  # and no file 'pwned'
    finally:
        touch_in_job(server.state_dir, job.id, "go")
    assert job.wait(30).exit_code == 0
