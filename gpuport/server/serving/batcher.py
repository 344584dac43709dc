"""Dynamic batching: concurrent prediction requests coalesced into batches for a model's replicas.

The model is Triton's dynamic batcher. Requests wait in one FIFO queue that the replicas share. A
free replica takes the oldest request, then adds the next queued requests that are *compatible*
with it (the same input names, and per name the same dtype and the same shape past the first
dimension) while the batch's rows stay within ``max_batch_size``. It runs the batch as soon as it is
full, or once its oldest request has waited ``max_queue_delay`` seconds since it arrived, whichever
comes first (as closely as the event loop's timers go: uvloop's, which the server runs on, are in
whole milliseconds); with a delay of 0 it runs whatever is queued at once. Requests it skipped stay
queued in their order, and the oldest request always starts the next batch, so none starves.

One replica forms a batch at a time (the others wait their turn), as Triton's single scheduler
thread does: a second free replica starts on what the first one left in the queue. A replica that is
``pause``d (its worker restarting) takes no batch while another one may: the queue goes to those
that answer; when every replica is paused they take batches again, and their answer (an error, at
once) is what callers get rather than a wait.

A batch is, per input name, the requests' arrays concatenated along axis 0. The replica returns a
dict of arrays with the batch's rows as their first dimension; each caller gets its own rows of every
output, in order. ``max_batch_size`` 0 or 1 turns batching off: each request goes to a replica alone
and unchanged, and its result comes back unchanged (a model without a batch dimension).

Example::

    async def replica(inputs: Inputs) -> Inputs:
        return {"y": inputs["x"] @ weights}

    batcher = Batcher([replica], max_batch_size=64, max_queue_delay=0.002)
    batcher.start()
    outputs = await batcher.infer({"x": np.ones((3, 4), np.float32)})   # outputs["y"] has 3 rows
    await batcher.close()
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuport.defaults import DEFAULT_SHUTDOWN_GRACE, MAX_SERVING_QUEUE
from gpuport.protocol.errors import GpuportError, InvalidRequest, NotReady, Overloaded, ServerError

__all__ = ["Batcher", "BatcherStats", "Duration", "Inputs", "Replica", "Timings"]

log = logging.getLogger(__name__)

# Named arrays; each array's first dimension is the batch (rows).
Inputs = dict[str, np.ndarray]
# One replica of a model: runs a batch, returns its outputs (same rows, same order).
Replica = Callable[[Inputs], Awaitable[Inputs]]
# What makes two requests batchable together: per input name (sorted), its dtype and trailing shape.
_Key = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]


@dataclass(frozen=True)
class BatcherStats:
    """Counters of a batcher since it was made, for metrics and benchmarks.

    ``batches``, ``requests`` and ``rows`` count what was sent to replicas (failed batches included;
    requests cancelled while queued are not); ``failed_batches`` the batches whose replica raised or
    returned outputs without the batch dimension; ``mean_batch_size`` is rows per batch (0 before
    the first); ``queue_length`` the requests waiting now.
    """

    batches: int
    requests: int
    rows: int
    failed_batches: int
    mean_batch_size: float
    queue_length: int


@dataclass
class Duration:
    """How many times something happened, and the nanoseconds it took in all."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


# Upper bounds (seconds) of the request-latency histogram that ``Timings.latency`` counts: Prometheus's
# default buckets, from 5 ms to 10 s, with 1 and 2.5 ms below them for batched CPU models.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


@dataclass
class Timings:
    """Where a batcher's requests spent their time, as Triton's statistics extension reports it:
    per request, ``success``/``fail`` from ``infer`` to its answer, ``queue`` until its batch was
    taken, and the batch's ``compute_input`` (joining the requests' inputs), ``compute_infer`` (the
    replica's run: sending to the model's worker, the model, receiving) and ``compute_output``
    (splitting the outputs) counted once per request in it; per batch size (rows), the same three
    once per batch. ``last_inference``: milliseconds since the epoch of the last success.
    ``latency``: successes per bucket of ``LATENCY_BUCKETS`` (the first bound at or above each one's
    time; longer ones are in no bucket), for Prometheus's histogram."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, tuple[Duration, Duration, Duration]] = field(default_factory=dict)
    last_inference: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))

    def succeeded(self, ns: int) -> None:
        self.success.add(ns)
        at = bisect.bisect_left(LATENCY_BUCKETS, ns / 1e9)
        if at < len(self.latency):
            self.latency[at] += 1


@dataclass(eq=False)
class _Request:
    inputs: Inputs
    rows: int
    key: _Key | None  # None when batching is off
    arrival: float  # the loop's clock
    future: asyncio.Future[Inputs]
    queued_ns: int = 0  # time.perf_counter_ns() when it was queued


class Batcher:
    """Coalesces concurrent ``infer`` calls into batches for ``replicas`` (see the module docstring).

    ``max_batch_size`` is the most rows in one batch (0 or 1: no batching), ``max_queue_delay`` the
    most seconds the oldest request of a batch waits for more to arrive, ``max_queue`` the most
    requests that may wait; ``name`` names the model in error messages. Raises ``InvalidRequest``
    for a negative size or delay or a ``max_queue`` below 1, ``ValueError`` without replicas.
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        max_batch_size: int,
        max_queue_delay: float,
        max_queue: int = MAX_SERVING_QUEUE,
        name: str = "",
    ) -> None:
        if not replicas:
            raise ValueError("a batcher needs at least one replica")
        if max_batch_size < 0:
            raise InvalidRequest(f"max_batch_size must be 0 (no batching) or more, not {max_batch_size}")
        if max_queue_delay < 0:
            raise InvalidRequest(f"max_queue_delay must be 0 seconds or more, not {max_queue_delay}")
        if max_queue < 1:
            raise InvalidRequest(f"max_queue must be 1 or more, not {max_queue}")
        self._replicas = list(replicas)
        self._max_batch_size = max_batch_size
        self._batching = max_batch_size > 1
        self._max_queue_delay = float(max_queue_delay)
        self._max_queue = max_queue
        self._label = f"model {name!r}" if name else "the model"
        self._queue: list[_Request] = []  # oldest first
        self._forming = asyncio.Lock()  # one replica forms a batch at a time
        self._waiter: asyncio.Future[bool] | None = None  # the forming replica waits on it for news
        self._tasks: list[asyncio.Task[None]] = []
        self._paused: set[int] = set()  # replicas that take no batch while another one may
        self._unpaused = asyncio.Event()  # set at each change of ``_paused``, then replaced
        self._closed = False
        self._batches = self._requests = self._rows = self._failed = 0
        self.timings = Timings()

    # ---- the callers' side ------------------------------------------------------------------------

    async def infer(self, inputs: Inputs, *, rows_checked: int | None = None) -> Inputs:
        """Run ``inputs`` in the next batch that takes them; return this caller's rows of the outputs.
        Counted in ``timings``: a success, or a failure (cancelled calls are neither).
        ``rows_checked``: the request's rows, where the caller already checked that its inputs are
        named arrays that agree on them (``formats.check_inputs``); only the limits are checked then.

        Raises ``InvalidRequest`` for a request that cannot be batched (no inputs, not arrays, 0 rows,
        inputs that disagree on rows, more rows than ``max_batch_size``), ``Overloaded`` when
        ``max_queue`` requests already wait, ``NotReady`` when the batcher is closed, the replica's error when it
        is a ``GpuportError``, else ``ServerError``. Cancelling the call drops a queued request; one
        whose batch already runs is simply not answered.
        """
        start = time.perf_counter_ns()
        try:
            outputs = await self._infer(inputs, rows_checked)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.timings.fail.add(time.perf_counter_ns() - start)
            raise
        self.timings.succeeded(time.perf_counter_ns() - start)
        self.timings.last_inference = time.time_ns() // 1_000_000
        return outputs

    async def _infer(self, inputs: Inputs, rows_checked: int | None) -> Inputs:
        if self._closed:
            raise self._closed_error()
        rows, key = self._check(inputs, rows_checked) if self._batching else (_rows_or_one(inputs), None)
        if len(self._queue) >= self._max_queue:
            raise Overloaded(
                f"{self._label} is overloaded: {len(self._queue)} requests already wait (max_queue "
                f"{self._max_queue}) — retry later, or deploy it with more replicas"
            )
        loop = asyncio.get_running_loop()
        request = _Request(inputs, rows, key, loop.time(), loop.create_future(), time.perf_counter_ns())
        self._queue.append(request)
        self._notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            if request in self._queue:  # still waiting: nobody will run it now
                self._queue.remove(request)
                self._notify()
            raise

    def _check(self, inputs: Inputs, rows_checked: int | None) -> tuple[int, _Key]:
        count = rows_checked if rows_checked is not None else self._rows_of(inputs)
        if count == 0:
            raise InvalidRequest("the request has 0 rows: send at least one")
        if count > self._max_batch_size:
            raise InvalidRequest(
                f"the request has {count} rows, more than {self._label} takes in one batch "
                f"(max_batch_size {self._max_batch_size}) — split it into requests of at most "
                f"{self._max_batch_size} rows"
            )
        key = tuple(sorted((name, array.dtype, array.shape[1:]) for name, array in inputs.items()))
        return count, key

    def _rows_of(self, inputs: Inputs) -> int:
        """The rows of a request whose inputs nobody checked yet; InvalidRequest where they are no batch."""
        if not isinstance(inputs, Mapping) or not inputs:
            raise InvalidRequest("a prediction request needs at least one named input")
        rows: dict[str, int] = {}
        for name, array in inputs.items():
            if not isinstance(name, str):
                raise InvalidRequest(f"input names are strings, not {type(name).__name__} ({name!r})")
            if not isinstance(array, np.ndarray):
                raise InvalidRequest(f"input {name!r} is a {type(array).__name__}, not an array")
            if array.ndim == 0:
                raise InvalidRequest(f"input {name!r} is a scalar: {self._label} wants rows (a batch dimension)")
            rows[name] = array.shape[0]
        counts = set(rows.values())
        if len(counts) > 1:
            each = ", ".join(f"{name!r} has {n}" for name, n in rows.items())
            raise InvalidRequest(f"the inputs disagree on their number of rows (first dimension): {each}")
        (count,) = counts
        return count

    # ---- the replicas' side -----------------------------------------------------------------------

    def start(self) -> None:
        """Start one task per replica on the running loop. Raises RuntimeError when started or closed."""
        if self._tasks or self._closed:
            raise RuntimeError("this batcher was already started" if self._tasks else "this batcher is closed")
        self._tasks = [
            asyncio.create_task(self._serve(index), name=f"batcher replica {index}")
            for index in range(len(self._replicas))
        ]

    def replace(self, index: int, replica: Replica) -> None:
        """Send the next batches of replica ``index`` to ``replica`` (a restarted worker)."""
        if not 0 <= index < len(self._replicas):
            raise IndexError(f"no replica {index}: this batcher has {len(self._replicas)}")
        self._replicas[index] = replica

    def pause(self, index: int) -> None:
        """Give replica ``index`` no batch while another replica takes them (its worker is gone and
        restarting); ``resume`` ends it. Raises ``IndexError`` for an unknown replica."""
        self._set_paused(index, True)

    def resume(self, index: int) -> None:
        """Give replica ``index`` batches again (its worker answers). Raises ``IndexError``."""
        self._set_paused(index, False)

    def _set_paused(self, index: int, paused: bool) -> None:
        if not 0 <= index < len(self._replicas):
            raise IndexError(f"no replica {index}: this batcher has {len(self._replicas)}")
        if (index in self._paused) == paused:
            return
        (self._paused.add if paused else self._paused.discard)(index)
        self._unpaused.set()  # those waiting look again
        self._unpaused = asyncio.Event()
        self._notify()  # the forming replica may be the paused one: it lets another form

    def _may_take(self, index: int) -> bool:
        return index not in self._paused or len(self._paused) == len(self._replicas)

    async def close(self, *, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        """Stop: queued and new requests fail with ``NotReady`` at once; batches already
        running get ``grace`` seconds to finish before they are cancelled (and their callers fail
        the same way). Calling it again does no harm."""
        self._closed = True
        self._unpaused.set()
        queued, self._queue = self._queue, []
        for request in queued:
            if not request.future.done():
                request.future.set_exception(self._closed_error())
        self._notify()
        if not self._tasks:
            return
        _, running = await asyncio.wait(self._tasks, timeout=grace)
        for task in running:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def stats(self) -> BatcherStats:
        """A snapshot of the counters (``BatcherStats``)."""
        return BatcherStats(
            batches=self._batches,
            requests=self._requests,
            rows=self._rows,
            failed_batches=self._failed,
            mean_batch_size=self._rows / self._batches if self._batches else 0.0,
            queue_length=len(self._queue),
        )

    async def _serve(self, index: int) -> None:
        while True:
            while not self._closed and not self._may_take(index):
                await self._unpaused.wait()
            async with self._forming:
                batch = await self._next_batch(index)
            if batch is None:
                return
            if batch:
                await self._run(index, batch)

    async def _next_batch(self, index: int) -> list[_Request] | None:
        """Wait until a batch is due, take it out of the queue and return it (None once closed; empty
        when replica ``index`` was paused meanwhile, and leaves it to another)."""
        loop = asyncio.get_running_loop()
        due = False  # the timer for the oldest request's deadline went off
        while not self._closed:
            if not self._may_take(index):
                return []
            batch, full = self._select()
            deadline = None
            if batch:
                deadline = batch[0].arrival + self._max_queue_delay
                if full or due or loop.time() >= deadline:
                    self._take(batch)
                    return batch
            due = await self._wait(deadline)
        return None

    def _select(self) -> tuple[list[_Request], bool]:
        """The batch the queue holds now, and whether it is full (can grow no more)."""
        if not self._queue:
            return [], False
        head = self._queue[0]
        if not self._batching or head.rows >= self._max_batch_size:
            return [head], True
        batch, rows = [head], head.rows
        for request in itertools.islice(self._queue, 1, None):
            if request.key != head.key:
                continue  # left for a later batch, in its place
            if rows + request.rows > self._max_batch_size:
                return batch, True  # FIFO among the compatible: the next one starts the next batch
            batch.append(request)
            rows += request.rows
            if rows == self._max_batch_size:
                return batch, True
        return batch, False

    def _take(self, batch: list[_Request]) -> None:
        if self._queue[len(batch) - 1] is batch[-1]:  # a prefix of the queue, the common case
            del self._queue[: len(batch)]
        else:
            taken = set(map(id, batch))
            self._queue = [r for r in self._queue if id(r) not in taken]

    async def _wait(self, deadline: float | None) -> bool:
        """Wait for a change in the queue (or the batcher), or until ``deadline`` on the loop's clock;
        True when the deadline's timer ended the wait. A loop's timers may go off early by up to their
        resolution (uvloop's are in whole milliseconds): the timer going off is the deadline, else the
        wait would start again and spin until the clock agrees."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_at(deadline, _wake, waiter, True) if deadline is not None else None
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _notify(self) -> None:
        if self._waiter is not None:
            _wake(self._waiter, False)

    async def _run(self, index: int, batch: list[_Request]) -> None:
        batch = [r for r in batch if not r.future.done()]  # a caller may have gone in the meantime
        if not batch:
            return
        rows = sum(r.rows for r in batch)
        self._batches += 1
        self._requests += len(batch)
        self._rows += rows
        taken = time.perf_counter_ns()
        for request in batch:
            self.timings.queue.add(taken - request.queued_ns)
        try:
            joined = _concatenate(batch)
            ran = time.perf_counter_ns()
            outputs = await self._replicas[index](joined)
            split = time.perf_counter_ns()
            parts = self._split(outputs, batch, rows)
            self._count_compute(len(batch), rows, ran - taken, split - ran, time.perf_counter_ns() - split)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            if cancelling is None or cancelling():  # this task is being cancelled: close() or the loop's end
                _fail(batch, self._closed_error)
                raise
            # The replica itself raised CancelledError (a cancelled call inside it): a failed batch.
            self._failed += 1
            _fail(batch, lambda: ServerError(f"{self._label}'s replica {index} was cancelled in a batch"))
        except GpuportError as e:
            self._failed += 1
            same = e  # every caller gets the model's own error, as is
            _fail(batch, lambda: same)
        except Exception as e:
            self._failed += 1
            log.warning("%s: replica %d failed a batch of %d rows", self._label, index, rows, exc_info=True)
            message = f"{self._label} failed: {type(e).__name__}: {e}"
            _fail(batch, lambda: ServerError(message))
        else:
            for request, part in zip(batch, parts):
                if not request.future.done():
                    request.future.set_result(part)

    def _count_compute(self, requests: int, rows: int, joining: int, running: int, splitting: int) -> None:
        t = self.timings
        t.compute_input.add(joining * requests, requests)
        t.compute_infer.add(running * requests, requests)
        t.compute_output.add(splitting * requests, requests)
        per_size = t.batches.setdefault(rows, (Duration(), Duration(), Duration()))
        for duration, ns in zip(per_size, (joining, running, splitting)):
            duration.add(ns)

    def _split(self, outputs: Any, batch: list[_Request], rows: int) -> list[Inputs]:
        """Each request's rows of the batch's outputs; ServerError when they are not per row."""
        if not isinstance(outputs, Mapping):
            raise ServerError(f"{self._label} returned a {type(outputs).__name__}, not a dict of named arrays")
        arrays = {name: np.asarray(value) for name, value in outputs.items()}
        if not self._batching:
            return [arrays]
        for name, array in arrays.items():
            if array.ndim == 0 or array.shape[0] != rows:
                raise ServerError(
                    f"{self._label} returned output {name!r} with shape {array.shape} for a batch of {rows} "
                    f"rows: the model does not keep the batch dimension (its outputs' first dimension "
                    f"must be the batch) — deploy it with max_batch_size 0 to turn batching off"
                )
        parts, start = [], 0
        for request in batch:
            parts.append({name: array[start : start + request.rows] for name, array in arrays.items()})
            start += request.rows
        return parts

    def _closed_error(self) -> GpuportError:
        return NotReady(
            f"{self._label} stopped serving before answering (undeployed, or the server is shutting "
            f"down) — retry once it is deployed again"
        )


def _rows_or_one(inputs: Inputs) -> int:
    """Rows of a request when batching is off, for the counters: the common first dimension, else 1."""
    try:
        counts = {array.shape[0] for array in inputs.values()}
    except (AttributeError, IndexError, TypeError):
        return 1
    return counts.pop() if len(counts) == 1 else 1


def _concatenate(batch: list[_Request]) -> Inputs:
    if len(batch) == 1:
        return batch[0].inputs
    return {name: np.concatenate([r.inputs[name] for r in batch]) for name in batch[0].inputs}


def _fail(batch: list[_Request], error: Callable[[], BaseException]) -> None:
    for request in batch:
        if not request.future.done():
            request.future.set_exception(error())


def _wake(waiter: asyncio.Future[bool], timed_out: bool) -> None:
    if not waiter.done():
        waiter.set_result(timed_out)
