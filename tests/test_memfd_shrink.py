"""A session's worker runs its user's code and shares memory with the server: memfds both map. Code
that cuts such a memory short under the server's map would make the server's next read of it a
SIGBUS, which ends the server for everyone. Every memfd the server maps and a worker holds is sealed
against shrinking (``wire.hold_size``); memory that cannot be sealed is not mapped."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

import gpuport
from gpuport.server.services.staging import Staged
from gpuport.server.worker import wire
from tests.conftest import RunningServer


@pytest.fixture
def mallory(admin: gpuport.Client, server: RunningServer) -> Iterator[gpuport.Client]:
    with server.connect(admin.create_token(f"mallory-{os.urandom(3).hex()}").token) as client:
        yield client


def _cut_every_memfd() -> list[str]:
    """In the worker: try to cut every memfd it holds to nothing, as a hostile user's code can; say
    how each try went."""
    import os

    tries = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            try:
                os.ftruncate(int(name), 0)
                tries.append("cut")
            except OSError as e:
                tries.append(type(e).__name__)
    return tries


def test_a_worker_cannot_cut_the_memory_the_server_maps(server: RunningServer, mallory: gpuport.Client) -> None:
    x = np.arange(8 << 20, dtype=np.uint8)
    with mallory.session(progress=False) as s:
        ref = s.put(x)
        tries = s.call(_cut_every_memfd)
        assert tries and "cut" not in tries, tries  # the value's memory: sealed against shrinking
        assert np.array_equal(s.get(ref), x)  # intact, and read from the server's map of it
        big = s.call(np.ones, 16 << 20, dtype=np.uint8)  # a large result, in the worker's memfd
        assert big.nbytes == 16 << 20 and int(big.sum()) == 16 << 20
    assert server.process.poll() is None


def test_memory_that_cannot_be_held_to_its_size_is_not_mapped() -> None:
    fd = wire.memory_file(1 << 20)
    try:
        assert wire.hold_size(fd)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        os.ftruncate(fd, 2 << 20)  # it may still grow
    finally:
        os.close(fd)
    unsealable = os.memfd_create("no-seals")  # made without MFD_ALLOW_SEALING
    with tempfile.TemporaryFile() as plain:
        plain.truncate(1 << 20)
        for fd in (unsealable, plain.fileno()):
            os.ftruncate(fd, 1 << 20)
            assert not wire.hold_size(fd)
            staged = Staged("mallory", "s-1", [(os.dup(fd), 0, 1 << 20)], 1 << 20)
            with pytest.raises(ValueError, match="could be cut"):
                staged.views()
            staged.close()
    os.close(unsealable)
