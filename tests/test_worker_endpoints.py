"""The executor seam's reach into a worker: its endpoints (``connect``) and files (``read_file``),
by job id and name, on this machine's executor (real jobs, in the sandbox this machine has)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuport.server.blobs import BlobStore
from gpuport.server.executors.base import JobLaunch, Placement
from gpuport.server.executors.local import LocalExecutor
from gpuport.server.inventory import CpuInventory
from gpuport.server.isolation import detect
from gpuport.server.worker import wire

from .conftest import wait_for

# A worker that answers each frame on run/worker.sock with what it got, and leaves a file.
_WORKER = """
import os, sys
from gpuport.server.worker import wire
run = os.environ["GPUPORT_RUN_DIR"]
with open(os.path.join(run, "stdout"), "w") as f:
    f.write("hello from the worker\\n")
listener = wire.listen(run, "worker.sock")
while True:
    conn, _ = listener.accept()
    with conn:
        try:
            frame = wire.recv(conn)
        except EOFError:
            continue
        wire.send(conn, {"got": frame.header})
"""

# A job that passes something else off as its endpoint and its file: links the server must not follow.
_IMPOSTOR = """
import os, sys, time
run = os.environ["GPUPORT_RUN_DIR"]
os.symlink(sys.argv[1], os.path.join(run, "worker.sock"))
os.symlink(sys.argv[2], os.path.join(run, "stdout"))
time.sleep(600)
"""


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[LocalExecutor]:
    executor = LocalExecutor(tmp_path / "jobs", BlobStore(tmp_path / "blobs"), detect(), CpuInventory("test"))
    started: list[str] = []
    executor.started = started  # type: ignore[attr-defined]
    yield executor
    for job_id in started:
        executor.kill(job_id, "the test is over")


def _start(executor: LocalExecutor, job_id: str, argv: list[str]) -> None:
    ended = threading.Event()
    executor.started.append(job_id)  # type: ignore[attr-defined]
    executor.start(JobLaunch(job_id, "alice", Placement(executor.name), argv, env={}), ended.set)


def _listening(executor: LocalExecutor, job_id: str) -> bool:
    try:
        executor.connect(job_id, "worker").close()
    except (FileNotFoundError, ConnectionError):
        return False
    return True


def test_connect_reaches_the_workers_endpoint_by_job_id_and_read_file_its_files(executor: LocalExecutor) -> None:
    _start(executor, "j-worker", [sys.executable, "-c", _WORKER])
    wait_for(lambda: _listening(executor, "j-worker"), timeout=60, what="the worker listening")
    stream = executor.connect("j-worker", "worker")
    with stream.sock:
        assert stream.passes_fds  # this machine's workers share its memory: values may travel as memfds
        wire.send(stream.sock, {"op": "ping"})
        reply = wire.recv(stream.sock).header
    assert reply["got"] == {"op": "ping"}
    assert executor.read_file("j-worker", "stdout") == b"hello from the worker\n"
    assert executor.read_file("j-worker", "stdout", 6, 4) == b"from"
    assert executor.read_file("j-worker", "stdout", -7) == b"worker\n"
    assert executor.file_size("j-worker", "stdout") == len(b"hello from the worker\n")
    assert executor.read_file("j-worker", "nothing") == b"" and executor.file_size("j-worker", "nothing") == 0


def test_an_endpoint_that_is_not_the_workers_own_is_refused_and_a_linked_file_is_not_read(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    # Another process's socket (here the test's: another user's worker in real life) and a file of
    # the server's: a job may link to either from its run folder; the server follows neither.
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(tmp_path / "other.sock"))
    other.listen(4)
    secret = tmp_path / "secret"
    secret.write_text("the server's own")
    with other:
        _start(executor, "j-impostor", [sys.executable, "-c", _IMPOSTOR, str(tmp_path / "other.sock"), str(secret)])
        run = executor.folders.folder("j-impostor") / "run"
        wait_for(lambda: os.path.lexists(run / "stdout"), timeout=60, what="the job's links")
        with pytest.raises(PermissionError, match="is not the worker's socket"):
            executor.connect("j-impostor", "worker")
        assert executor.read_file("j-impostor", "stdout") == b""
        assert executor.file_size("j-impostor", "stdout") == 0


def test_names_that_are_not_endpoints_are_refused(executor: LocalExecutor) -> None:
    for name in ("../jobs", "a/b", "", "Worker", "x" * 65):
        with pytest.raises(ValueError, match="is not an endpoint's name"):
            executor.connect("j-none", name)


def test_closing_a_link_ends_a_receive_or_a_send_waiting_on_it_at_once() -> None:
    """A worker whose node went without a word never answers nor closes: the server closing its link
    (the deployment's watcher, on seeing the job end) must end the batch waiting on it, not leave it."""
    import asyncio
    import time

    async def main() -> None:
        ours, silent = socket.socketpair()  # the far end reads nothing and says nothing
        with silent:
            link = wire.Link(ours)
            receiving = asyncio.ensure_future(link.recv())
            await asyncio.sleep(0.1)
            assert not receiving.done()
            closed_at = time.monotonic()
            link.close()
            with pytest.raises(ConnectionAbortedError):
                await asyncio.wait_for(receiving, 5)
            assert time.monotonic() - closed_at < 1
        ours, silent = socket.socketpair()
        with silent:
            link = wire.Link(ours)
            sending = asyncio.ensure_future(link.send({"op": "predict"}, [bytes(64 << 20)]))  # past the buffers
            await asyncio.sleep(0.1)
            assert not sending.done()
            link.close()
            with pytest.raises(ConnectionAbortedError):
                await asyncio.wait_for(sending, 5)

    asyncio.run(main())
