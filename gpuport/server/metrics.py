"""Prometheus metrics for ``GET /metrics``: read from the server's own state at each scrape.

One collector reads the job table, the GPU inventory, the batchers' timings and the transfer
counters when Prometheus asks, so nothing is counted twice and nothing runs between scrapes.
Names follow Prometheus's conventions (base units, ``_total`` for counters); labels say whose.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuport.server.services.auth import Identity
from gpuport.server.serving.batcher import LATENCY_BUCKETS

if TYPE_CHECKING:
    from gpuport.server.app import ServerApp

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds a job waited in the queue: from a blink to an hour.
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_SERVER = Identity("metrics", admin=True)  # the collector reads as the server does: everything


class Transfers:
    """Bytes moved in and out, by path: ``data_port`` (sessions' values), ``grpc`` (sessions'
    values when the data port cannot be reached), ``snapshots`` (synced files and outputs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = {}

    def add(self, path: str, direction: str, n: int) -> None:
        with self._lock:
            key = (path, direction)
            self._bytes[key] = self._bytes.get(key, 0) + n

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._bytes)


class _Collector(Collector):
    def __init__(self, app: ServerApp) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        yield from self._gpus()
        yield from self._models()
        transfers = CounterMetricFamily(
            "gpuport_transfer_bytes", "Bytes moved by the server, by path and direction", labels=["path", "direction"]
        )
        for (path, direction), n in sorted(self.app.transfers.snapshot().items()):
            transfers.add_metric([path, direction], n)
        yield transfers

    def _jobs(self) -> Iterator[Metric]:
        store = self.app.store
        jobs = GaugeMetricFamily(
            "gpuport_jobs", "Jobs by state and user (every job the server has recorded)", labels=["state", "user"]
        )
        for row in store.query("SELECT state, owner, COUNT(*) AS n FROM jobs WHERE kind = 'job' GROUP BY state, owner"):
            jobs.add_metric([row["state"], row["owner"]], row["n"])
        yield jobs
        sessions = GaugeMetricFamily("gpuport_sessions", "Live sessions by state and user", labels=["state", "user"])
        live = "kind = 'session' AND state IN ('queued', 'running')"
        for row in store.query(f"SELECT state, owner, COUNT(*) AS n FROM jobs WHERE {live} GROUP BY state, owner"):
            sessions.add_metric([row["state"], row["owner"]], row["n"])
        yield sessions
        now = time.time()
        queued = store.query(
            "SELECT kind, COUNT(*) AS n, MIN(created_at) AS oldest FROM jobs WHERE state = 'queued' GROUP BY kind"
        )
        length = GaugeMetricFamily(
            "gpuport_queue_length", "Work waiting to start, by kind (job, session, model)", labels=["kind"]
        )
        oldest = GaugeMetricFamily(
            "gpuport_queue_oldest_wait_seconds", "How long the oldest waiting work has waited", labels=["kind"]
        )
        for row in queued:
            length.add_metric([row["kind"]], row["n"])
            oldest.add_metric([row["kind"]], max(0.0, now - row["oldest"]))
        yield length
        yield oldest
        buckets = ", ".join(
            f"SUM(CASE WHEN started_at - created_at <= {bound} THEN 1 ELSE 0 END)" for bound in WAIT_BUCKETS
        )
        row = store.query_one(
            f"SELECT COUNT(*), COALESCE(SUM(started_at - created_at), 0), {buckets} FROM jobs "
            "WHERE kind = 'job' AND started_at IS NOT NULL"
        )
        assert row is not None
        count, total, *cumulative = (row[i] or 0 for i in range(len(WAIT_BUCKETS) + 2))
        wait = HistogramMetricFamily("gpuport_queue_wait_seconds", "How long started jobs waited in the queue")
        wait.add_metric(
            [], [(str(b), c) for b, c in zip(WAIT_BUCKETS, cumulative, strict=True)] + [("+Inf", count)], total
        )
        yield wait

    def _gpus(self) -> Iterator[Metric]:
        listing = self.app.gpus(_SERVER)
        labels = ["gpu", "node", "uuid", "name"]
        utilization = GaugeMetricFamily(
            "gpuport_gpu_utilization_percent", "GPU utilization (NVML), percent", labels=labels
        )
        used = GaugeMetricFamily("gpuport_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        total = GaugeMetricFamily("gpuport_gpu_memory_total_bytes", "GPU memory in all", labels=labels)
        held = GaugeMetricFamily(
            "gpuport_job_gpu_share",
            "The part of each GPU a running job holds: 1 whole, a slice's memory over the GPU's",
            labels=["job", "user", "gpu", "node"],
        )
        job_used = GaugeMetricFamily(
            "gpuport_job_gpu_memory_used_bytes",
            "GPU memory a running job's processes use",
            labels=["job", "user", "gpu", "node"],
        )
        for place, gpu in enumerate(listing.gpus):
            values = [str(gpu.index), gpu.node, gpu.uuid, gpu.name]
            if gpu.utilization is not None:
                utilization.add_metric(values, gpu.utilization)
            used.add_metric(values, gpu.memory_used)
            total.add_metric(values, gpu.memory_total)
            for allocation in listing.allocations.get(place, []):
                job = [allocation.job_id, allocation.owner, str(gpu.index), gpu.node]
                share = allocation.memory / gpu.memory_total if allocation.memory and gpu.memory_total else 1.0
                held.add_metric(job, share)
                job_used.add_metric(job, allocation.memory_used)
        yield from (utilization, used, total, held, job_used)

    def _models(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        requests = CounterMetricFamily(
            "gpuport_model_requests", "Prediction requests by outcome", labels=[*labels, "outcome"]
        )
        rows = CounterMetricFamily("gpuport_model_rows", "Rows predicted (inference count)", labels=labels)
        latency = HistogramMetricFamily(
            "gpuport_model_request_duration_seconds", "Successful requests, from arrival to answer", labels=labels
        )
        batches = HistogramMetricFamily(
            "gpuport_model_batch_rows", "Rows in each batch run on a replica", labels=labels
        )
        for record, timings in self.app.serving.statistics():
            model = [record.name, str(record.version)]
            requests.add_metric([*model, "success"], timings.success.count)
            requests.add_metric([*model, "fail"], timings.fail.count)
            rows.add_metric(model, sum(size * infer.count for size, (_, infer, _) in timings.batches.items()))
            cumulative = 0
            points = []
            for bound, n in zip(LATENCY_BUCKETS, timings.latency, strict=False):
                cumulative += n
                points.append((str(bound), cumulative))
            latency.add_metric(model, [*points, ("+Inf", timings.success.count)], timings.success.ns / 1e9)
            sizes = sorted(timings.batches.items())
            count = sum(infer.count for _, (_, infer, _) in sizes)
            batch_points = []
            for bound in _batch_bounds(int(record.spec.get("max_batch_size", 0))):
                batch_points.append(
                    (str(float(bound)), sum(infer.count for size, (_, infer, _) in sizes if size <= bound))
                )
            batch_sum = sum(size * infer.count for size, (_, infer, _) in sizes)
            batches.add_metric(model, [*batch_points, ("+Inf", count)], batch_sum)
        yield from (requests, rows, latency, batches)


def _batch_bounds(max_batch_size: int) -> list[int]:
    """Powers of two up to the model's largest batch."""
    bounds, bound = [], 1
    while bound < max(1, max_batch_size):
        bounds.append(bound)
        bound *= 2
    return [*bounds, max(1, max_batch_size)]


class Metrics:
    """The registry ``GET /metrics`` renders: the server's collector and nothing else (not the
    process-wide default registry)."""

    def __init__(self, app: ServerApp) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(app))

    def render(self) -> bytes:
        return generate_latest(self.registry)
