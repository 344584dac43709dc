"""The dynamic batcher, with replicas that really compute (numpy) and record the batches they saw."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

from gpuport.protocol.errors import InvalidRequest, ResourceUnavailable, ServerError
from gpuport.server.serving.batcher import Batcher, Inputs

T = TypeVar("T")
W = np.arange(12, dtype=np.float32).reshape(4, 3)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a test's coroutine, cut off well before pytest's own timeout would be."""
    return asyncio.run(asyncio.wait_for(coro, 10))


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` until it holds, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


class Model:
    """A replica computing ``x @ W``; it records each batch's rows, and can take time or wait for a gate."""

    def __init__(self, seconds: float = 0.0, gate: asyncio.Event | None = None) -> None:
        self.seconds = seconds
        self.gate = gate
        self.batches: list[int] = []
        self.started = asyncio.Event()

    async def __call__(self, inputs: Inputs) -> Inputs:
        x = inputs["x"]
        self.batches.append(len(x))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.seconds:
            await asyncio.sleep(self.seconds)
        if (x < 0).any():
            raise ValueError("negative input")
        return {"y": x @ W, "total": x.sum(axis=1)}


def rows(n: int, start: float = 0.0) -> np.ndarray:
    return (start + np.arange(n * 4, dtype=np.float32)).reshape(n, 4)


def check(x: np.ndarray, out: Inputs) -> None:
    np.testing.assert_allclose(out["y"], x @ W)
    np.testing.assert_allclose(out["total"], x.sum(axis=1))


def test_concurrent_callers_coalesce_into_batches_and_each_gets_its_rows_in_order() -> None:
    async def main() -> None:
        model = Model(seconds=0.01)
        batcher = Batcher([model], max_batch_size=8, max_queue_delay=0.05)
        batcher.start()
        xs = [rows(1 + i % 3, start=100.0 * i) for i in range(16)]  # 31 rows in all
        try:
            outs = await asyncio.gather(*(batcher.infer({"x": x}) for x in xs))
        finally:
            await batcher.close()
        for x, out in zip(xs, outs):
            assert out["y"].shape == (len(x), 3)
            check(x, out)
        assert sum(model.batches) == 31 and max(model.batches) <= 8 and len(model.batches) <= 6
        stats = batcher.stats
        assert (stats.batches, stats.requests, stats.rows, stats.failed_batches) == (len(model.batches), 16, 31, 0)
        assert stats.mean_batch_size == 31 / len(model.batches) and stats.queue_length == 0

    run(main())


def test_a_lone_request_runs_after_max_queue_delay_and_a_full_batch_at_once() -> None:
    async def main() -> None:
        model = Model()
        batcher = Batcher([model], max_batch_size=4, max_queue_delay=0.3)
        batcher.start()
        try:
            begin = time.monotonic()
            check(rows(1), await batcher.infer({"x": rows(1)}))
            waited = time.monotonic() - begin
            assert 0.25 <= waited < 1.0
            begin = time.monotonic()
            await batcher.infer({"x": rows(4)})  # full: no reason to wait
            assert time.monotonic() - begin < 0.2
        finally:
            await batcher.close()
        lone = Batcher([Model()], max_batch_size=4, max_queue_delay=0)
        lone.start()
        try:
            begin = time.monotonic()
            await lone.infer({"x": rows(1)})
            assert time.monotonic() - begin < 0.2
        finally:
            await lone.close()

    run(main())


def test_the_delay_counts_from_a_requests_arrival_not_from_when_a_replica_is_free() -> None:
    async def main() -> None:
        model = Model(seconds=0.6)
        batcher = Batcher([model], max_batch_size=4, max_queue_delay=0.4)
        batcher.start()
        try:
            busy = asyncio.create_task(batcher.infer({"x": rows(4)}))  # a full batch: runs for 0.6 s
            await until(model.started.is_set)
            model.seconds = 0.0
            begin = time.monotonic()
            await batcher.infer({"x": rows(1)})
            # Due at 0.4 s, the replica is free at 0.6 s: it runs then (0.6 + 0.4 if counted from there).
            assert 0.5 <= time.monotonic() - begin < 0.9
            await busy
        finally:
            await batcher.close()
        assert model.batches == [4, 1]

    run(main())


def test_on_uvloop_a_batch_waits_out_its_delay_without_spinning() -> None:
    """uvloop's timers may go off up to half a millisecond early (whole milliseconds): a batch whose
    timer went off is due, rather than waited for again and again until the clock agrees."""
    uvloop = pytest.importorskip("uvloop")

    class Counting(Batcher):
        waits = 0

        async def _wait(self, deadline: float | None) -> bool:
            Counting.waits += 1
            return await super()._wait(deadline)

    async def main() -> None:
        batcher = Counting([Model()], max_batch_size=4, max_queue_delay=0.0025)
        batcher.start()
        try:
            begin = time.monotonic()
            for _ in range(40):
                check(rows(1), await batcher.infer({"x": rows(1)}))
            assert time.monotonic() - begin >= 40 * 0.0015  # each waited (about) its delay
        finally:
            await batcher.close()

    uvloop.run(asyncio.wait_for(main(), 10))
    assert Counting.waits <= 3 * 40 + 2  # per batch: for a request, then for the deadline


def test_max_batch_size_1_runs_each_request_alone_and_0_passes_requests_through() -> None:
    async def main() -> None:
        model = Model()
        batcher = Batcher([model], max_batch_size=1, max_queue_delay=0.05)
        batcher.start()
        xs = [rows(1, start=i) for i in range(5)] + [rows(3)]  # 3 rows: no batching, no limit
        try:
            outs = await asyncio.gather(*(batcher.infer({"x": x}) for x in xs))
        finally:
            await batcher.close()
        assert model.batches == [1, 1, 1, 1, 1, 3]
        for x, out in zip(xs, outs):
            check(x, out)

        async def scalar(inputs: Inputs) -> Inputs:  # a model without a batch dimension
            return {"sum": np.asarray(inputs["v"].sum())}

        plain = Batcher([scalar], max_batch_size=0, max_queue_delay=0.05)
        plain.start()
        try:
            out = await plain.infer({"v": np.arange(5)})
        finally:
            await plain.close()
        assert out["sum"].shape == () and out["sum"] == 10

    run(main())


def test_incompatible_requests_run_in_separate_batches_and_none_starves() -> None:
    seen: list[tuple[str, ...]] = []

    async def double(inputs: Inputs) -> Inputs:
        seen.append(tuple(f"{name}:{a.dtype}:{a.shape}" for name, a in sorted(inputs.items())))
        return {name: a * 2 for name, a in inputs.items()}

    async def main() -> None:
        batcher = Batcher([double], max_batch_size=8, max_queue_delay=0.05)
        requests: list[Inputs] = [
            {"x": np.full((1, 4), 1, np.float32)},
            {"x": np.full((1, 4), 2, np.float64)},  # another dtype
            {"x": np.full((2, 4), 3, np.float32)},
            {"x": np.full((1, 5), 4, np.float32)},  # another trailing shape
            {"x": np.full((1, 4), 5, np.float32), "z": np.ones((1,), np.int64)},  # other names
            {"x": np.full((1, 4), 6, np.float32)},
        ]
        tasks = [asyncio.create_task(batcher.infer(r)) for r in requests]
        await until(lambda: batcher.stats.queue_length == len(requests))
        batcher.start()
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            await batcher.close()
        assert seen == [
            ("x:float32:(4, 4)",),  # the oldest, with the compatible 3rd and 6th
            ("x:float64:(1, 4)",),
            ("x:float32:(1, 5)",),
            ("x:float32:(1, 4)", "z:int64:(1,)"),
        ]
        for request, out in zip(requests, outs):
            assert out.keys() == request.keys()
            for name, array in request.items():
                np.testing.assert_array_equal(out[name], array * 2)
                assert out[name].dtype == array.dtype

    run(main())


def test_the_oldest_request_starts_the_next_batch_so_a_stream_of_others_cannot_starve_it() -> None:
    async def main() -> None:
        seen: list[str] = []

        async def kinds(inputs: Inputs) -> Inputs:
            seen.append(f"{inputs['x'].dtype}x{len(inputs['x'])}")
            return {"y": inputs["x"] + 1}

        batcher = Batcher([kinds], max_batch_size=2, max_queue_delay=0.05)
        dtypes = ["f4", "f8", "f4", "f4", "f4", "f4", "f4"]
        tasks = [asyncio.create_task(batcher.infer({"x": np.zeros((1, 2), d)})) for d in dtypes]
        await until(lambda: batcher.stats.queue_length == len(dtypes))
        batcher.start()
        try:
            await asyncio.gather(*tasks)
        finally:
            await batcher.close()
        assert seen == ["float32x2", "float64x1", "float32x2", "float32x2"]

    run(main())


def test_malformed_and_oversize_requests_are_refused_at_once() -> None:
    async def main() -> None:
        model = Model()
        batcher = Batcher([model], max_batch_size=4, max_queue_delay=0.05)
        batcher.start()
        try:
            with pytest.raises(InvalidRequest, match=r"5 rows.*max_batch_size 4"):
                await batcher.infer({"x": rows(5)})
            with pytest.raises(InvalidRequest, match="0 rows"):
                await batcher.infer({"x": rows(0)})
            with pytest.raises(InvalidRequest, match="'x' has 2, 'z' has 3"):
                await batcher.infer({"x": rows(2), "z": np.zeros(3)})
            with pytest.raises(InvalidRequest, match="scalar"):
                await batcher.infer({"x": np.array(1.0, np.float32)})
            with pytest.raises(InvalidRequest, match="at least one"):
                await batcher.infer({})
        finally:
            await batcher.close()
        assert model.batches == [] and batcher.stats.requests == 0

    run(main())


def test_a_full_queue_refuses_requests_as_overloaded() -> None:
    async def main() -> None:
        model = Model()
        batcher = Batcher([model], max_batch_size=4, max_queue_delay=0, max_queue=2)
        queued = [asyncio.create_task(batcher.infer({"x": rows(1, start=i)})) for i in range(2)]
        await until(lambda: batcher.stats.queue_length == 2)
        with pytest.raises(ResourceUnavailable, match="overloaded.*max_queue 2"):
            await batcher.infer({"x": rows(1)})
        batcher.start()
        try:
            for i, task in enumerate(queued):
                check(rows(1, start=i), await task)
            check(rows(1), await batcher.infer({"x": rows(1)}))  # room again
        finally:
            await batcher.close()

    run(main())


def test_a_failing_replica_fails_exactly_its_batchs_callers_and_goes_on() -> None:
    async def main() -> None:
        model = Model()
        batcher = Batcher([model], max_batch_size=4, max_queue_delay=0.05)
        xs = [rows(1, start=i) for i in range(8)]
        xs[1] = -xs[1]  # poisons the first batch (requests 0-3)
        tasks = [asyncio.create_task(batcher.infer({"x": x})) for x in xs]
        await until(lambda: batcher.stats.queue_length == 8)
        batcher.start()
        try:
            outs = await asyncio.gather(*tasks, return_exceptions=True)
            for out in outs[:4]:
                assert isinstance(out, ServerError) and "ValueError: negative input" in str(out)
            for x, out in zip(xs[4:], outs[4:]):
                assert isinstance(out, dict)
                check(x, out)

            async def refuses(inputs: Inputs) -> Inputs:
                raise InvalidRequest("the model wants images of 28x28")

            batcher.replace(0, refuses)
            with pytest.raises(InvalidRequest, match="28x28"):  # a gpuport error goes through as is
                await batcher.infer({"x": rows(1)})
            batcher.replace(0, model)
            check(rows(2), await batcher.infer({"x": rows(2)}))
        finally:
            await batcher.close()
        assert model.batches == [4, 4, 2] and batcher.stats.failed_batches == 2

    run(main())


def test_two_replicas_both_get_work_and_each_request_runs_once() -> None:
    async def main() -> None:
        first, second = Model(seconds=0.05), Model(seconds=0.05)
        batcher = Batcher([first, second], max_batch_size=4, max_queue_delay=0)
        batcher.start()
        xs = [rows(1, start=i) for i in range(16)]
        try:
            outs = await asyncio.gather(*(batcher.infer({"x": x}) for x in xs))
            for x, out in zip(xs, outs):
                check(x, out)
            assert first.batches and second.batches
            assert sum(first.batches) + sum(second.batches) == 16
            # A restarted replica gets the next batches in place of the old one.
            third = Model()
            batcher.replace(1, third)
            before = len(second.batches)
            await asyncio.gather(*(batcher.infer({"x": x}) for x in xs))
            assert len(second.batches) == before and third.batches
            assert sum(first.batches) + sum(second.batches) + sum(third.batches) == 32
        finally:
            await batcher.close()

    run(main())


def test_a_request_cancelled_while_queued_is_dropped() -> None:
    async def main() -> None:
        model = Model()
        batcher = Batcher([model], max_batch_size=8, max_queue_delay=0.3)
        tasks = [asyncio.create_task(batcher.infer({"x": rows(n)})) for n in (1, 2, 3)]
        await until(lambda: batcher.stats.queue_length == 3)
        tasks[1].cancel()
        await until(lambda: batcher.stats.queue_length == 2)
        batcher.start()
        try:
            check(rows(1), await tasks[0])
            check(rows(3), await tasks[2])
            with pytest.raises(asyncio.CancelledError):
                await tasks[1]
            # The oldest request, cancelled while a replica waits for its batch to fill: the next one
            # becomes the oldest, and runs on its own delay.
            lone = asyncio.create_task(batcher.infer({"x": rows(1)}))
            await until(lambda: batcher.stats.queue_length == 1)
            later = asyncio.create_task(batcher.infer({"x": rows(2)}))
            await until(lambda: batcher.stats.queue_length == 2)
            lone.cancel()
            check(rows(2), await later)
        finally:
            await batcher.close()
        assert model.batches == [4, 2] and batcher.stats.requests == 3

    run(main())


def test_a_request_cancelled_while_its_batch_runs_is_not_answered() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        model = Model(gate=gate)
        batcher = Batcher([model], max_batch_size=4, max_queue_delay=0.05)
        batcher.start()
        try:
            gone = asyncio.create_task(batcher.infer({"x": rows(1)}))
            stays = asyncio.create_task(batcher.infer({"x": rows(2, start=7)}))
            await until(model.started.is_set)
            gone.cancel()
            gate.set()
            check(rows(2, start=7), await stays)
            with pytest.raises(asyncio.CancelledError):
                await gone
            check(rows(1), await batcher.infer({"x": rows(1)}))
        finally:
            await batcher.close()
        assert model.batches == [3, 1]

    run(main())


def test_close_fails_queued_and_new_requests_and_lets_running_batches_finish() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        model = Model(gate=gate)
        batcher = Batcher([model], max_batch_size=1, max_queue_delay=0)
        batcher.start()
        running = asyncio.create_task(batcher.infer({"x": rows(1)}))
        await until(model.started.is_set)
        queued = asyncio.create_task(batcher.infer({"x": rows(1)}))
        await until(lambda: batcher.stats.queue_length == 1)
        closing = asyncio.create_task(batcher.close(grace=5.0))
        with pytest.raises(ResourceUnavailable, match="stopped serving"):
            await queued
        with pytest.raises(ResourceUnavailable, match="stopped serving"):
            await batcher.infer({"x": rows(1)})
        gate.set()
        check(rows(1), await running)  # within its grace
        await closing
        assert model.batches == [1]

        stuck = Batcher([Model(gate=asyncio.Event())], max_batch_size=4, max_queue_delay=0)
        stuck.start()
        cut = asyncio.create_task(stuck.infer({"x": rows(1)}))
        await until(lambda: stuck.stats.batches == 1)
        await stuck.close(grace=0.05)
        with pytest.raises(ResourceUnavailable, match="stopped serving"):
            await cut

    run(main())


def test_an_output_that_lost_the_batch_dimension_fails_the_batch() -> None:
    async def main() -> None:
        async def pooled(inputs: Inputs) -> Inputs:
            return {"mean": inputs["x"].mean(axis=0)}  # (4,): averaged over the batch

        batcher = Batcher([pooled], max_batch_size=8, max_queue_delay=0.05)
        batcher.start()
        try:
            outs = await asyncio.gather(*(batcher.infer({"x": rows(n)}) for n in (1, 2)), return_exceptions=True)
        finally:
            await batcher.close()
        for out in outs:
            assert isinstance(out, ServerError)
            assert "output 'mean' with shape (4,) for a batch of 3 rows" in str(out)
            assert "batch dimension" in str(out)
        assert batcher.stats.failed_batches == 1

    run(main())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="max_batch_size"):
        Batcher([Model()], max_batch_size=-1, max_queue_delay=0)
    with pytest.raises(InvalidRequest, match="max_queue_delay"):
        Batcher([Model()], max_batch_size=4, max_queue_delay=-0.1)
    with pytest.raises(ValueError, match="at least one replica"):
        Batcher([], max_batch_size=4, max_queue_delay=0)


def test_a_paused_replica_takes_no_batch_while_another_one_answers_and_all_paused_still_answer_at_once() -> None:
    async def main() -> None:
        first, second = Model(seconds=0.01), Model(seconds=0.01)
        batcher = Batcher([first, second], max_batch_size=2, max_queue_delay=0)
        batcher.start()
        xs = [rows(1, start=i) for i in range(12)]
        try:
            batcher.pause(1)  # its worker is gone, restarting elsewhere: the queue goes to the other
            outs = await asyncio.gather(*(batcher.infer({"x": x}) for x in xs))
            for x, out in zip(xs, outs):
                check(x, out)
            assert sum(first.batches) == 12 and second.batches == []
            # Every replica paused: they take batches again, and what they answer is what callers get
            # (here: the rows), rather than a wait for a replica that may never come back.
            batcher.pause(0)
            check(xs[0], await batcher.infer({"x": xs[0]}))
            batcher.resume(0)
            batcher.resume(1)
            before = len(second.batches)
            await asyncio.gather(*(batcher.infer({"x": x}) for x in xs))
            assert len(second.batches) > before  # it takes its share again
            with pytest.raises(IndexError):
                batcher.pause(2)
        finally:
            await batcher.close()

    run(main())
