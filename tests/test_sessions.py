"""Remote sessions end to end, on the shared server with two fake 16 GiB GPUs and real worker
processes: values of numpy, torch and TensorFlow kept in a worker and used by reference, a Keras
model fitted once and used through Refs, remote output, re-attaching from another process, idle
ends, every kind of failure, GPUs held and queued for, and a 1 GiB value bit for bit."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuport
from tests.conftest import RunningServer, client_env, needs_users, touch_in_job, wait_for

GiB = 2**30
SCRIPTS = Path(__file__).parent / "_sessions"
# How long a worker may take to go away once its session has ended.
END_TIMEOUT = 30.0


class Boom(Exception):
    """An exception class of this test module: the worker gets it by value, and it comes back as itself."""


# ---- What the worker runs: functions of this module, which the server cannot import -------------


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _numpy_info(array: Any) -> tuple[str, str, list[int], bool]:
    return _kind(array), array.dtype.str, list(array.shape), bool(array.flags.writeable)


def _torch_info(tensor: Any) -> tuple[str, str, list[int], str]:
    return _kind(tensor), str(tensor.dtype), list(tensor.shape), str(tensor.device)


def _tf_info(tensor: Any) -> tuple[str, str, list[int], str]:
    return _kind(tensor), tensor.dtype.name, list(tensor.shape), tensor.device


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _tf_sum(tensor: Any) -> float:
    import tensorflow as tf

    return float(tf.reduce_sum(tf.cast(tensor, tf.float64)))


def _kinds_and_total(parts: list[Any], extra: dict[str, Any], scale: float = 1.0) -> tuple[list[str], float]:
    values = [*parts, *extra.values()]
    return [type(v).__name__ for v in values], scale * float(sum(float(v.sum()) for v in values))


def _fit(x: Any, y: Any, epochs: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((x.shape[1],)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.02),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, epochs=epochs, batch_size=32, verbose=0)
    return model


def _accuracy(model: Any, x: Any, y: Any) -> float:
    _, accuracy = model.evaluate(x, y, verbose=0)
    return float(accuracy)


def _predict(model: Any, x: Any) -> Any:
    return np.argmax(model.predict(x, verbose=0), axis=1)


def _chatty(flag: str) -> int:
    print("first line", flush=True)
    print("first warning", file=sys.stderr, flush=True)
    while not os.path.exists(flag):
        time.sleep(0.02)
    print("last line")  # not flushed: the call must still bring it back before it returns
    print("last warning", file=sys.stderr)
    return 7


def _divide(a: float, b: float) -> float:
    return a / b


def _raise_boom(detail: str) -> None:
    raise Boom(detail, 42)


def _exit(code: int) -> None:
    print("exiting on purpose", file=sys.stderr, flush=True)
    os._exit(code)


def _segfault() -> None:
    print("about to crash", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(30)  # the signal is delivered before this returns


def _is_arange(array: Any) -> bool:
    return bool(np.array_equal(array.view(np.uint32), np.arange(array.size, dtype=np.uint32)))


# ---- Fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu(server: RunningServer) -> Iterator[gpuport.Client]:
    """A client for the whole module, for the session its value tests share."""
    with server.connect() as client:
        yield client


@pytest.fixture(scope="module")
def shared(gpu: gpuport.Client) -> Iterator[gpuport.Session]:
    """One CPU session for the value tests: its worker imports torch and TensorFlow once."""
    with gpu.session() as session:
        yield session


@pytest.fixture
def open_session(admin: gpuport.Client) -> Iterator[Callable[..., gpuport.Session]]:
    """Open sessions that are closed at teardown, whatever the test did, so no GPU stays held."""
    opened: list[gpuport.Session] = []

    def open_(**options: Any) -> gpuport.Session:
        session = admin.session(**options)
        opened.append(session)
        return session

    yield open_
    for session in opened:
        with contextlib.suppress(gpuport.GpuportError):
            session.close()


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _live(client: gpuport.Client) -> dict[str, gpuport.SessionInfo]:
    return {info.id: info for info in client.sessions()}


def _worker() -> str:
    """Which worker runs the call: its job's id (its pid is 2 or so, inside its sandbox)."""
    return os.environ["GPUPORT_JOB_ID"]


def _gone(client: gpuport.Client, worker: str) -> bool:
    """Whether the worker's job has ended: its supervisor records that once every process is gone."""
    return client.job(worker).status not in ("queued", "running")


# ---- Values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([True, False, True]),
        np.arange(6, dtype=">i8").reshape(2, 3),  # big-endian
        np.asfortranarray(np.linspace(-1, 1, 12).reshape(3, 4)),
        np.arange(40, dtype=np.int16).reshape(5, 8)[::2, 1::3],  # not contiguous
        np.array(["gpu", "port"]),
        np.array(2.5, dtype=np.float16),  # 0-d
    ],
    ids=["float32", "bool", "big-endian", "fortran", "strided", "str", "0-d"],
)
def test_numpy_arrays_keep_dtype_shape_and_values_there_and_back(shared: gpuport.Session, array: Any) -> None:
    ref = shared.put(array)
    assert ref.session_id == shared.id and ref.type == "numpy.ndarray"
    assert ref.summary.endswith(str(array.shape))
    assert shared.call(_numpy_info, ref) == ("numpy.ndarray", array.dtype.str, list(array.shape), True)
    back = shared.get(ref)
    assert type(back) is np.ndarray and back.dtype.str == array.dtype.str and back.shape == array.shape
    assert np.array_equal(back, array)
    shared.delete(ref)


def test_torch_tensors_keep_dtype_shape_and_values_there_and_back(shared: gpuport.Session) -> None:
    torch = pytest.importorskip("torch")
    tensors = [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.tensor([1, -2, 3], dtype=torch.int64),
        torch.linspace(-1, 1, 5, dtype=torch.bfloat16),  # a dtype numpy lacks
        torch.arange(6.0).reshape(2, 3).t(),  # not contiguous
    ]
    for tensor in tensors:
        ref = shared.put(tensor)
        assert ref.type == "torch.Tensor"
        remote = shared.call(_torch_info, ref)
        assert remote == ("torch.Tensor", str(tensor.dtype), list(tensor.shape), "cpu")
        back = shared.get(ref)
        assert type(back) is torch.Tensor and back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back, tensor)
    inside = {"weights": torch.ones(2, 2, dtype=torch.float64), "step": 3}  # pickled, tensor raw inside
    back = shared.get(shared.put(inside))
    assert back["step"] == 3 and back["weights"].dtype == torch.float64
    assert torch.equal(back["weights"], inside["weights"])


def test_tensorflow_tensors_keep_dtype_shape_and_values_there_and_back(shared: gpuport.Session) -> None:
    tf = pytest.importorskip("tensorflow")
    tensors = [
        tf.constant([[1.5, -2.0], [3.25, 4.0]]),
        tf.constant([1, 2, 3], dtype=tf.int64),
        tf.cast(tf.range(6), tf.bfloat16),
        tf.constant([b"gpu", b"", b"port"]),
    ]
    for tensor in tensors:
        ref = shared.put(tensor)
        kind, dtype, shape, device = shared.call(_tf_info, ref)
        assert kind.endswith("EagerTensor") and (dtype, shape) == (tensor.dtype.name, list(tensor.shape))
        assert device.endswith("CPU:0")
        back = shared.get(ref)
        assert isinstance(back, tf.Tensor) and back.dtype == tensor.dtype and back.shape == tensor.shape
        assert bool(tf.reduce_all(back == tensor))
    assert shared.call(_tf_sum, shared.put(tensors[0])) == pytest.approx(6.75)


def test_refs_anywhere_in_the_arguments_are_resolved_in_the_worker(shared: gpuport.Session) -> None:
    torch = pytest.importorskip("torch")
    a = shared.put(np.full((100, 100), 1.0, dtype=np.float32))
    b = shared.put(torch.full((10,), 2.0))
    c = shared.put(np.arange(4, dtype=np.int64))
    kinds, total = shared.call(_kinds_and_total, [a, b], {"c": c, "d": np.ones(3)}, scale=c)
    assert kinds == ["ndarray", "Tensor", "ndarray", "ndarray"]  # the Refs arrived as the values themselves
    assert total == pytest.approx(np.arange(4) * (10_000 + 20 + 6 + 3))  # scale=c: a Ref as a keyword too
    assert shared.call(id, a) == shared.call(id, a)  # the very object the worker holds, not a copy sent again
    shared.delete(a, b, c)
    assert not {a.id, b.id, c.id} & {r.id for r in shared.refs()}


def test_keep_returns_a_ref_that_describes_the_value_and_names_find_it(shared: gpuport.Session) -> None:
    source = shared.put(np.arange(12, dtype=np.float32).reshape(3, 4), name="source")
    assert source.name == "source" and shared.ref("source").id == source.id
    doubled = shared.call(np.multiply, source, 2, keep=True)
    assert isinstance(doubled, gpuport.Ref) and doubled.id != source.id
    assert (doubled.type, doubled.summary) == ("numpy.ndarray", "float32 (3, 4)")
    named = shared.call(np.sum, doubled, axis=0, keep="column-sums")
    assert named.name == "column-sums" and named.summary == "float32 (4,)"
    assert shared.ref("column-sums").id == named.id
    assert np.array_equal(shared.get(named), np.arange(12, dtype=np.float32).reshape(3, 4).sum(axis=0) * 2)
    assert {"source", "column-sums"} <= {r.name for r in shared.refs()}
    assert doubled.id in {r.id for r in shared.refs()}
    shared.delete(source, doubled, named)
    with pytest.raises(gpuport.NotFound):
        shared.ref("source")
    with pytest.raises(gpuport.NotFound):
        shared.get(doubled)


def test_a_ref_works_only_in_its_own_session(open_session: Callable[..., gpuport.Session]) -> None:
    first, second = open_session(), open_session()
    ref = first.put(np.arange(3))
    with pytest.raises(gpuport.InvalidRequest, match=f"belongs to session {first.id}"):
        second.call(len, [ref])
    with pytest.raises(gpuport.InvalidRequest, match=f"belongs to session {first.id}"):
        second.get(ref)
    assert first.call(len, ref) == 3 and second.refs() == []


def test_a_ref_the_worker_no_longer_holds_is_not_found_when_passed_to_a_call(
    open_session: Callable[..., gpuport.Session],
) -> None:
    session = open_session()
    deleted = session.put(np.arange(3))
    session.delete(deleted)
    with pytest.raises(gpuport.NotFound, match="deleted"):
        session.call(len, [deleted])
    earlier = session.put(np.arange(3))
    session.restart()
    with pytest.raises(gpuport.NotFound, match="earlier worker"):
        session.call(len, earlier)
    assert session.call(len, session.put(np.arange(4))) == 4


def test_device_gpu_on_a_server_without_cuda_keeps_the_value_on_the_cpu(
    open_session: Callable[..., gpuport.Session],
) -> None:
    # The shared server's GPUs are fake: torch and TensorFlow in the worker see none.
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("tensorflow")
    session = open_session()
    ref = session.put(torch.arange(4.0), device="gpu")
    assert session.call(_torch_info, ref) == ("torch.Tensor", "torch.float32", [4], "cpu")
    assert torch.equal(session.get(ref), torch.arange(4.0))
    ref = session.put(tf.constant([1.0, 2.0]), device="gpu")
    assert session.call(_tf_info, ref)[3].endswith("CPU:0")
    ref = session.put(np.arange(3), device="gpu")  # numpy stays numpy
    assert session.call(_numpy_info, ref)[0] == "numpy.ndarray"
    assert session.call(_torch_info, session.put(torch.ones(2), device="cpu"))[3] == "cpu"


def test_a_value_the_worker_cannot_rebuild_is_refused_and_the_worker_lives_on(
    open_session: Callable[..., gpuport.Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A class of a module only this process can import: its instances pickle as an import of it.
    name = f"only_here_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("class Local:\n    def __init__(self, n):\n        self.n = n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)
    session = open_session()
    kept = session.put(np.arange(3), name="kept")
    pid = session.call(_worker)
    with pytest.raises((gpuport.InvalidRequest, gpuport.RemoteError), match=name):
        session.call(len, [module.Local(2)])
    assert session.call(_worker) == pid
    with pytest.raises(gpuport.InvalidRequest, match=name):
        session.put(module.Local(1))
    assert session.call(_worker) == pid and session.info().state == "running"
    assert [r.id for r in session.refs()] == [kept.id]


def test_a_result_that_cannot_travel_back_is_an_error_and_can_be_kept_instead(
    open_session: Callable[..., gpuport.Session],
) -> None:
    session = open_session()
    pid = session.call(_worker)
    with pytest.raises(gpuport.GpuportError, match="keep=True"):
        session.call(threading.Lock)
    lock = session.call(threading.Lock, keep="lock")
    assert lock.name == "lock" and "lock" in lock.type
    with pytest.raises(gpuport.GpuportError, match="pickle"):
        session.get(lock)
    assert session.call(_worker) == pid and [r.id for r in session.refs()] == [lock.id]


def test_a_keras_model_fitted_once_is_evaluated_by_later_calls_through_refs_only(shared: gpuport.Session) -> None:
    pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)  # learnable: a line through the first two features
    x_ref, y_ref = shared.put(x, name="x-train"), shared.put(y, name="y-train")  # sent once, here
    model = shared.call(_fit, x_ref, y_ref, 3, keep="model")
    assert model.name == "model" and "Sequential" in model.type
    where = shared.call(id, x_ref)
    accuracy = shared.call(_accuracy, model, x_ref, y_ref)  # only Refs travel
    assert isinstance(accuracy, float) and accuracy > 0.8  # chance is about 0.5
    assert shared.call(id, x_ref) == where  # the data the model was fitted on is still the one object held
    fresh = rng.normal(size=(50, 8)).astype(np.float32)
    predicted = shared.call(_predict, model, fresh)  # a small new batch and the model by reference
    assert predicted.shape == (50,) and np.mean(predicted == (fresh[:, 0] + 0.5 * fresh[:, 1] > 0)) > 0.7
    assert {"x-train", "y-train", "model"} <= {r.name for r in shared.refs()}
    shared.delete(x_ref, y_ref, model)


# ---- Output -----------------------------------------------------------------------------------------


def test_remote_prints_show_locally_as_they_happen_stdout_and_stderr_apart(
    server: RunningServer, open_session: Callable[..., gpuport.Session], capsys: pytest.CaptureFixture[str]
) -> None:
    session = open_session()
    assert session.call(print, "hello from the worker") is None
    assert session.call(os.write, 2, b"straight to fd 2\n") == 17  # as C code and TensorFlow's logs write
    seen = capsys.readouterr()
    assert seen.out.count("hello from the worker") == 1 and "hello" not in seen.err
    assert seen.err.count("straight to fd 2") == 1 and "fd 2" not in seen.out
    out: list[str] = []
    err: list[str] = []

    def read() -> None:
        captured = capsys.readouterr()
        out.append(captured.out)
        err.append(captured.err)

    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(session.call, _chatty, "go")  # in the worker's folder: see touch_in_job
        wait_for(
            lambda: read() or ("first line" in "".join(out) and "first warning" in "".join(err)),
            what="the first lines shown while the call still runs",
        )
        assert not call.done()
        touch_in_job(server.state_dir, session.info().job_id, "go")
        assert call.result(timeout=60) == 7
    read()  # right after call() returned: everything is there already
    stdout, stderr = "".join(out), "".join(err)
    assert stdout.count("first line") == 1 and stdout.count("last line") == 1
    assert stderr.count("first warning") == 1 and stderr.count("last warning") == 1
    assert stdout.index("first line") < stdout.index("last line")
    assert "warning" not in stdout and "line" not in stderr


def _print_later(text: str, delay: float) -> None:
    """In the worker: print ``text`` from a thread of its own ``delay`` seconds after the call ended."""
    import threading

    threading.Timer(delay, lambda: print(text, flush=True)).start()


def test_an_idle_sessions_output_still_comes_and_a_calls_before_its_result(
    open_session: Callable[..., gpuport.Session], capsys: pytest.CaptureFixture[str]
) -> None:
    """The server reads an idle session's output seldom (twice a second), but a call wakes it: the
    call's prints are shown before it returns, and what a worker's own thread prints between calls
    still comes."""
    session = open_session()
    session.call(abs, -1)
    time.sleep(2.5)  # idle: its output is read seldom now
    capsys.readouterr()
    assert session.call(print, "after a pause") is None
    assert capsys.readouterr().out.count("after a pause") == 1  # already there when call() returned
    session.call(_print_later, "from the worker's own thread", 2.0)  # printed when no call runs
    seen: list[str] = []
    wait_for(
        lambda: seen.append(capsys.readouterr().out) or "from the worker's own thread" in "".join(seen),
        timeout=10,
        what="a print between calls",
    )


def test_a_sandboxed_job_is_known_as_its_jobs_before_its_command_runs(
    server: RunningServer, admin: gpuport.Client
) -> None:
    """Whoever listens on a session worker's socket must be one of its job's processes, which the
    server reads from the job's supervisor.json: the supervisor writes it before the job may start.
    Written after, a worker quick off the mark on a busy machine was refused ("... is not the
    worker's socket") and its session's first call failed."""
    needs_users()  # a sandboxed server: the supervisor.json said here is the sandbox's
    job = admin.submit(["sh", "-c", "date +%s.%N"], workdir=None).wait(60)
    started = float("".join(job.logs()).strip())
    announced = next(server.state_dir.glob(f"**/{job.id}/supervisor.json")).stat().st_mtime
    assert announced <= started, f"supervisor.json written {announced - started:.4f} s after the job started"


# ---- Names, other processes, the CLI, idle ends ---------------------------------------------------


def test_a_named_session_is_found_from_another_process_listed_and_closed(
    server: RunningServer, admin: gpuport.Client, open_session: Callable[..., gpuport.Session], cli: Any
) -> None:
    name = _unique("notebook")
    session = open_session(name=name)
    assert session.name == name and session.id.startswith("s-")
    session.put(np.arange(6, dtype=np.float32).reshape(2, 3), name="weights")
    pid = session.call(_worker)
    again = admin.session(name=name)  # the same session, values intact
    assert again.id == session.id and [r.name for r in again.refs()] == ["weights"]
    again.detach()
    child = subprocess.run(
        [sys.executable, str(SCRIPTS / "reattach.py"), name],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **client_env(server)},
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report == {
        "id": session.id,
        "refs": ["weights"],
        "type": "numpy.ndarray",
        "summary": "float32 (2, 3)",
        "session_id": session.id,
        "dtype": "<f4",
        "value": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
        "state": "running",
    }
    # The child only detached: its value is there for us, the session still runs.
    assert np.array_equal(session.get(session.ref("doubled")), np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
    info = _live(admin)[session.id]
    assert (info.name, info.owner, info.state, info.refs) == (name, "admin", "running", 2)
    assert info.attached >= 1 and info.job_id and info.created_at <= info.last_call_at <= time.time()
    table = cli("sessions", **client_env(server))
    assert table.code == 0, table.stderr
    assert table.stdout.split()[:2] == ["ID", "NAME"] and "STATE" in table.stdout.splitlines()[0]
    row = next(line for line in table.stdout.splitlines() if session.id in line)
    assert name in row and "running" in row
    listed = json.loads(cli("sessions", "--json", **client_env(server)).stdout)
    mine = next(entry for entry in listed if entry["id"] == session.id)
    assert (mine["name"], mine["state"], mine["refs"]) == (name, "running", 2)
    closed = cli("sessions", "close", name, **client_env(server))
    assert closed.code == 0, closed.stderr
    wait_for(lambda: session.id not in _live(admin), timeout=END_TIMEOUT, what="the session ended")
    wait_for(lambda: _gone(admin, pid), timeout=END_TIMEOUT, what="its worker process gone")
    with pytest.raises(gpuport.NotFound):
        session.ref("weights")
    gone = cli("sessions", "close", name, **client_env(server))
    assert gone.code != 0 and name in gone.stderr


def test_idle_sessions_end_after_their_idle_timeout_named_or_not(
    admin: gpuport.Client, open_session: Callable[..., gpuport.Session]
) -> None:
    name = _unique("idle")
    named = open_session(name=name, idle_timeout="2s")
    named.put(1, name="one")
    named_job = named.info().job_id
    named.detach()
    unnamed = open_session(idle_timeout=2)  # still attached: idle is about calls
    info = unnamed.info()
    assert info.idle_timeout == 2 and info.state == "running"
    jobs = (named_job, info.job_id)

    def ended() -> bool:
        live = _live(admin)
        return named.id not in live and unnamed.id not in live

    wait_for(ended, timeout=END_TIMEOUT, what="both idle sessions ended")
    wait_for(
        lambda: all(admin.job(j).info.state not in ("queued", "running") for j in jobs),
        timeout=END_TIMEOUT,
        what="their workers' jobs ended",
    )
    with pytest.raises(gpuport.NotFound):
        unnamed.call(len, "abc")
    fresh = open_session(name=name)  # the name is free again: a new session, without the old values
    assert fresh.id != named.id and fresh.refs() == []


def test_leaving_the_with_block_closes_an_unnamed_session(admin: gpuport.Client) -> None:
    with admin.session(cpus=1, memory="2GiB", idle_timeout="90s") as session:
        info = session.info()
        assert (info.cpus, info.memory, info.idle_timeout, info.name) == (1, 2 * GiB, 90, "")
        pid = session.call(_worker)
        assert session.id in _live(admin)
    assert session.id not in _live(admin)
    wait_for(lambda: _gone(admin, pid), timeout=END_TIMEOUT, what="its worker process gone")
    assert admin.job(info.job_id).wait(END_TIMEOUT).info.state not in ("queued", "running")


def test_sessions_lists_only_the_callers_own(
    server: RunningServer, admin: gpuport.Client, user_token: str, open_session: Callable[..., gpuport.Session]
) -> None:
    name = _unique("mine")
    session = open_session(name=name)
    with server.connect(user_token) as user:
        assert session.id not in _live(user)
        theirs = user.session(name=name)  # the same name, another owner: another session
        try:
            assert theirs.id != session.id and theirs.refs() == []
            assert theirs.id in _live(user)
        finally:
            theirs.close()
    assert session.id in _live(admin)


# ---- Failures ---------------------------------------------------------------------------------------


def test_user_errors_come_back_as_remote_errors_that_are_also_the_original_type(
    open_session: Callable[..., gpuport.Session],
) -> None:
    session = open_session()
    with pytest.raises(ZeroDivisionError) as caught:
        session.call(_divide, 1, 0)
    error = caught.value
    assert isinstance(error, gpuport.RemoteError) and isinstance(error, gpuport.GpuportError)
    assert error.remote_type == "ZeroDivisionError"
    assert "_divide" in error.remote_traceback
    assert isinstance(error.exception, ZeroDivisionError)
    assert "ZeroDivisionError" in str(error) and "division by zero" in str(error) and "_divide" in str(error)

    with pytest.raises(Boom) as boom:
        session.call(_raise_boom, "no luck")
    assert isinstance(boom.value, gpuport.RemoteError)
    assert boom.value.remote_type == f"{Boom.__module__}.Boom"
    assert isinstance(boom.value.exception, Boom) and boom.value.exception.args == ("no luck", 42)
    assert "_raise_boom" in boom.value.remote_traceback and "no luck" in str(boom.value)
    assert session.call(_divide, 6, 3) == 2.0  # the worker lives on
    assert session.info().state == "running"


def test_a_worker_that_exits_or_crashes_raises_worker_died_and_restart_gives_a_fresh_one(
    open_session: Callable[..., gpuport.Session],
) -> None:
    session = open_session()
    lost = session.put(np.arange(3), name="lost")
    first = session.call(_worker)
    with pytest.raises(gpuport.WorkerDied) as died:
        session.call(_exit, 3)
    assert (died.value.exit_code, died.value.signal) == (3, None)
    assert "exiting on purpose" in died.value.stderr_tail
    assert not isinstance(died.value, gpuport.CallTimeout)
    info = session.info()
    assert info.state == "died"
    session.restart()
    assert session.info().state == "running" and session.refs() == []
    with pytest.raises(gpuport.NotFound, match="earlier worker"):
        session.get(lost)
    with pytest.raises(gpuport.NotFound):
        session.ref("lost")
    second = session.call(_worker)
    assert second != first and session.call(_divide, 1, 4) == 0.25

    with pytest.raises(gpuport.WorkerDied) as crashed:
        session.call(_segfault)
    assert crashed.value.signal == "SIGSEGV"
    assert "about to crash" in crashed.value.stderr_tail
    assert session.info().state == "died"
    session.restart()
    assert session.call(_worker) not in (first, second)


def test_a_call_past_its_timeout_raises_call_timeout_and_the_worker_is_stopped(
    admin: gpuport.Client, open_session: Callable[..., gpuport.Session]
) -> None:
    session = open_session()
    assert session.call(time.sleep, 0.05, timeout=30) is None  # within its time: fine
    pid = session.call(_worker)
    start = time.monotonic()
    with pytest.raises(gpuport.CallTimeout) as caught:
        session.call(time.sleep, 60, timeout=1)
    assert time.monotonic() - start < 20
    assert isinstance(caught.value, gpuport.WorkerDied) and isinstance(caught.value, TimeoutError)
    wait_for(lambda: _gone(admin, pid), timeout=END_TIMEOUT, what="the worker stopped")
    assert session.info().state == "died"
    session.restart()
    assert session.call(_divide, 3, 1) == 3.0


def test_an_argument_that_cannot_be_pickled_is_refused_locally_and_the_session_goes_on(
    open_session: Callable[..., gpuport.Session],
) -> None:
    session = open_session()
    kept = session.put(np.arange(3))
    pid = session.call(_worker)
    with socket.socket() as sock:
        for bad in (threading.Lock(), sock):
            with pytest.raises(gpuport.InvalidRequest, match="pickle"):
                session.call(len, [bad])
            with pytest.raises(gpuport.InvalidRequest, match="pickle"):
                session.put({"inside": bad})
    assert session.call(np.sum, kept) == 3 and session.call(_worker) == pid
    assert [r.id for r in session.refs()] == [kept.id]


def test_a_client_of_another_python_minor_version_is_refused_naming_both(
    server: RunningServer, admin: gpuport.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = platform.python_version()
    before = set(_live(admin))
    with monkeypatch.context() as patch:
        patch.setattr(platform, "python_version", lambda: "3.9.1")
        with server.connect() as old:
            with pytest.raises(gpuport.IncompatibleVersions) as caught:
                old.session()
            divide = old.function()(_divide)
            try:
                with pytest.raises(gpuport.IncompatibleVersions) as called:
                    divide(1, 2)
            finally:
                divide.close()
    for error in (caught.value, called.value):
        assert isinstance(error, gpuport.InvalidRequest)
        assert "3.9" in str(error) and ".".join(real.split(".")[:2]) in str(error)
    assert set(_live(admin)) <= before  # no worker was started


# ---- GPUs -------------------------------------------------------------------------------------------


def test_a_gpu_session_holds_its_gpu_and_one_wanting_more_than_is_free_queues(
    admin: gpuport.Client, open_session: Callable[..., gpuport.Session], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(gpuport.ResourceUnavailable, match="asked for 3 GPUs"):
        open_session(gpus=3)  # more than the server has: refused, not queued forever
    wait_for(lambda: not any(g.jobs for g in admin.gpus()), what="both GPUs free")
    one = open_session(gpus=1)
    info = one.info()
    assert (info.state, info.gpus, len(info.gpu_indices)) == ("running", 1, 1)
    (index,) = info.gpu_indices
    assert one.call(_env, "CUDA_VISIBLE_DEVICES") == str(index)
    assert {g.index: g.jobs for g in admin.gpus()}[index] == (info.job_id,)
    assert [x.job_id for g in admin.gpus() for x in g.allocations] == [info.job_id]

    two = open_session(gpus=2, wait=False)
    wait_for(lambda: "needs 2 GPUs, 1 free" in two.info().message, what="the reason the second one waits")
    waiting = two.info()
    assert waiting.state == "queued"
    assert waiting.job_id in [j.id for j in admin.queue()]
    assert _live(admin)[two.id].state == "queued"
    two.close()
    assert two.id not in _live(admin)
    wait_for(lambda: waiting.job_id not in [j.id for j in admin.queue()], what="the closed one out of the queue")

    # Opening with wait=True blocks, says why once on stderr, and returns once the GPUs are free.
    capsys.readouterr()
    err: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(open_session, gpus=2)
        wait_for(lambda: err.append(capsys.readouterr().err) or "needs 2 GPUs" in "".join(err), what="why it waits")
        assert not opening.done()
        one.close()
        both = opening.result(timeout=60)
    err.append(capsys.readouterr().err)
    assert "".join(err).count("needs 2 GPUs") == 1
    assert tuple(both.info().gpu_indices) == (0, 1) and both.call(_env, "CUDA_VISIBLE_DEVICES") == "0,1"
    both.close()
    wait_for(lambda: not any(g.jobs for g in admin.gpus()), timeout=END_TIMEOUT, what="both GPUs released")


# ---- A large value ----------------------------------------------------------------------------------


def test_a_gibibyte_array_round_trips_bit_for_bit(open_session: Callable[..., gpuport.Session]) -> None:
    session = open_session()
    bits = np.arange(GiB // 4, dtype=np.uint32)  # every element differs
    ref = session.put(bits.view(np.float32))
    assert ref.summary == f"float32 ({GiB // 4},)"
    assert session.call(_is_arange, ref)  # the worker holds every byte
    back = session.get(ref)
    assert back.dtype == np.float32 and back.shape == bits.shape
    assert np.array_equal(back.view(np.uint32), bits)
