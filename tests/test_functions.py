"""Remote functions end to end, on the shared server with two fake 16 GiB GPUs: functions of this
module (which the server cannot import), lambdas and closures, spawn, map over parallel workers in
order, timeouts, errors, the GPU slice a function asks for, and workers that end with the function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuport
from tests.conftest import RunningServer, client_env, wait_for

GiB = 2**30
SCRIPTS = Path(__file__).parent / "_sessions"
# How long a worker may take to go away once its function is closed.
END_TIMEOUT = 30.0
# Read by _scaled at call time; a test changes it here, and the worker must see the change.
_FACTOR = 3


class Refused(Exception):
    """An exception class of this test module, raised remotely and caught here as itself."""


# ---- What the workers run ------------------------------------------------------------------------


def _square(x: float) -> float:
    return x * x


def _scaled(x: float) -> float:
    return _square(x) * _FACTOR  # another function and a global of this module, both by value


def _add(a: Any, b: Any) -> Any:
    return a + b


def _slow_pid(x: int, delay: float) -> tuple[int, str]:
    time.sleep(delay)
    return x * 10, _worker()


def _worker() -> str:
    """Which worker runs the call: its job's id (its pid is 2 or so, inside its sandbox)."""
    return os.environ["GPUPORT_JOB_ID"]


def _gpu_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "GPUPORT_GPU_MEMORY")}


def _refuse(reason: str) -> None:
    raise Refused(reason)


def _gone(client: gpuport.Client, worker: str) -> bool:
    """Whether the worker's job has ended: its supervisor records that once every process is gone."""
    return client.job(worker).status not in ("queued", "running")


@pytest.fixture
def remote(admin: gpuport.Client) -> Iterator[Callable[..., Callable[[Callable[..., Any]], Any]]]:
    """``admin.function(**options)``, whose functions are closed at teardown whatever the test did."""
    made: list[Any] = []

    def function(**options: Any) -> Callable[[Callable[..., Any]], Any]:
        decorate = admin.function(**options)

        def apply(fn: Callable[..., Any]) -> Any:
            wrapped = decorate(fn)
            made.append(wrapped)
            return wrapped

        return apply

    yield function
    for wrapped in made:
        wrapped.close()


def test_a_function_of_this_module_runs_remotely_by_value(remote: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    square = remote()(_square)
    assert square(7) == 49
    scaled = remote()(_scaled)
    monkeypatch.setattr(sys.modules[__name__], "_FACTOR", 5)  # the worker sees this module as it is here
    assert scaled(2) == 20
    added = remote()(_add)(np.arange(4), np.ones(4, dtype=np.int64))  # arrays both ways
    assert added.dtype == np.int64 and np.array_equal(added, np.arange(1, 5))


def test_lambdas_closures_and_the_decorator(admin: gpuport.Client, remote: Any) -> None:
    offset = 10
    assert remote()(lambda x: x + offset)(1) == 11

    def make_scaler(k: float) -> Callable[[float], float]:
        def scale(x: float) -> float:
            return k * x

        return scale

    assert remote()(make_scaler(2.5))(4) == 10.0

    @admin.function(cpus=1)
    def describe(values: list[int], *, sep: str = ",") -> str:
        return sep.join(str(v + offset) for v in values)

    try:
        assert describe([1, 2], sep="+") == "11+12"
    finally:
        describe.close()


def test_spawn_returns_a_future(remote: Any) -> None:
    slow = remote()(_slow_pid)
    future = slow.spawn(4, delay=0.2)
    assert isinstance(future, Future)
    value, pid = future.result(timeout=60)
    assert value == 40 and pid.startswith("j-")  # a worker's
    failing = remote()(lambda: 1 / 0).spawn()
    assert isinstance(failing.exception(timeout=60), ZeroDivisionError)


def test_map_keeps_the_order_and_spreads_over_parallel_workers(remote: Any) -> None:
    slow = remote(max_workers=3)(_slow_pid)
    results = slow.map(range(6), [0.5] * 6)
    assert [value for value, _ in results] == [0, 10, 20, 30, 40, 50]
    pids = {pid for _, pid in results}
    assert 2 <= len(pids) <= 3  # in parallel, within max_workers
    assert remote(max_workers=1)(_square).map([3, 1, 2]) == [9, 1, 4]


def test_a_call_past_its_timeout_raises_call_timeout_and_the_next_call_works(remote: Any) -> None:
    sleepy = remote(timeout=1)(_slow_pid)
    start = time.monotonic()
    with pytest.raises(gpuport.CallTimeout) as caught:
        sleepy(1, 60)
    assert time.monotonic() - start < 20
    assert isinstance(caught.value, gpuport.WorkerDied) and isinstance(caught.value, TimeoutError)
    assert sleepy(2, 0)[0] == 20  # a fresh worker in place of the stopped one


def test_errors_raised_remotely_come_back_as_their_own_type(remote: Any) -> None:
    refuse = remote()(_refuse)
    with pytest.raises(Refused, match="not today") as caught:
        refuse("not today")
    assert isinstance(caught.value, gpuport.RemoteError)
    assert caught.value.remote_type == f"{Refused.__module__}.Refused" and "_refuse" in caught.value.remote_traceback
    with pytest.raises(ZeroDivisionError):
        remote()(lambda: 1 / 0)()
    assert refuse.map([]) == []


def test_a_function_gets_the_gpu_slice_it_asks_for(admin: gpuport.Client, remote: Any) -> None:
    env = remote(gpu_memory="2GiB")(_gpu_env)()
    assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1") and env["GPUPORT_GPU_MEMORY"] == str(2 * GiB)
    whole = remote(gpus=1)(_gpu_env)()
    assert whole["CUDA_VISIBLE_DEVICES"] in ("0", "1")


def test_close_and_interpreter_exit_end_the_workers(server: RunningServer, admin: gpuport.Client) -> None:
    where = admin.function()(_worker)
    pid = where()
    assert not _gone(admin, pid)
    where.close()
    wait_for(lambda: _gone(admin, pid), timeout=END_TIMEOUT, what="the closed function's worker gone")
    child = subprocess.run(
        [sys.executable, str(SCRIPTS / "exit_without_close.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **client_env(server)},
    )
    assert child.returncode == 0, child.stderr
    pid = json.loads(child.stdout.splitlines()[-1])["worker"]
    wait_for(lambda: _gone(admin, pid), timeout=END_TIMEOUT, what="the exited process's worker gone")
