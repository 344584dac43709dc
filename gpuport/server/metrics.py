"""Prometheus metrics for ``GET /metrics``: read from the server's own state at each scrape.

One collector reads the job table, the GPU inventory, the batchers' timings and the transfer
counters when Prometheus asks, so nothing is counted twice and nothing runs between scrapes.
Names follow Prometheus's conventions (base units, ``_total`` for counters); labels say whose, and
none is called ``job`` (Prometheus's own label for the scrape job: it would rename ours
``exported_job``). GPUs are also reported as NVIDIA's DCGM exporter names them, and served models
as Triton does (``nv_inference_*``), so the stock dashboards for those read a gpuport server too.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuport._version import __version__
from gpuport.server.services.auth import Identity
from gpuport.server.services.jobs import JobState
from gpuport.server.serving.batcher import LATENCY_BUCKETS

if TYPE_CHECKING:
    from gpuport.server.app import GpuListing, ServerApp

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds a job waited in the queue: from a blink to an hour.
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_SERVER = Identity("metrics", admin=True)  # the collector reads as the server does: everything
# What waits in the queue: every kind is reported, with 0 when none waits, so no series vanishes.
QUEUE_KINDS = ("job", "session", "model")
_MIB = 2**20


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
        self._lock = threading.Lock()
        self._gpu_seconds: dict[str, float] = {}  # the most each user's counter has said

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily(
            "gpuport_build_info", "The server's version (the value is always 1)", labels=["version"]
        )
        build.add_metric([__version__], 1)
        yield build
        listing = self.app.gpus(_SERVER)
        yield from self._jobs()
        yield self._gpu_time({(gpu.node, gpu.index): gpu.memory_total for gpu in listing.gpus})
        yield from self._gpus(listing)
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
        ended = CounterMetricFamily(
            "gpuport_jobs_ended",
            "Jobs that ended, by how (succeeded, failed, cancelled...) and user",
            labels=["state", "user"],
        )
        for row in store.query("SELECT state, owner, COUNT(*) AS n FROM jobs WHERE kind = 'job' GROUP BY state, owner"):
            jobs.add_metric([row["state"], row["owner"]], row["n"])
            if JobState(row["state"]).is_terminal():
                ended.add_metric([row["state"], row["owner"]], row["n"])
        yield jobs
        yield ended
        sessions = GaugeMetricFamily("gpuport_sessions", "Live sessions by state and user", labels=["state", "user"])
        live = "kind = 'session' AND state IN ('queued', 'running')"
        for row in store.query(f"SELECT state, owner, COUNT(*) AS n FROM jobs WHERE {live} GROUP BY state, owner"):
            sessions.add_metric([row["state"], row["owner"]], row["n"])
        yield sessions
        now = time.time()
        queued = {
            row["kind"]: row
            for row in store.query(
                "SELECT kind, COUNT(*) AS n, MIN(created_at) AS oldest FROM jobs WHERE state = 'queued' GROUP BY kind"
            )
        }
        length = GaugeMetricFamily(
            "gpuport_queue_length", "Work waiting to start, by kind (job, session, model)", labels=["kind"]
        )
        oldest = GaugeMetricFamily(
            "gpuport_queue_oldest_wait_seconds", "How long the oldest waiting work has waited", labels=["kind"]
        )
        for kind in sorted({*QUEUE_KINDS, *queued}):
            row = queued.get(kind)
            length.add_metric([kind], row["n"] if row else 0)
            oldest.add_metric([kind], max(0.0, now - row["oldest"]) if row else 0.0)
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

    def _gpu_time(self, sizes: dict[tuple[str, int], int]) -> Metric:
        """GPU-seconds each user's work has held (jobs, session workers, model replicas): whole GPUs,
        and a slice as its part of the GPU it is on, from its start to its end (or now). Read from
        the usage accounting (services/usage.py), as `gpuport usage` is: the two cannot disagree."""
        held = self.app.usage.gpu_seconds(max(sizes.values(), default=0))
        counter = CounterMetricFamily("gpuport_gpu_seconds", "GPU-seconds held, by user", labels=["user"])
        with self._lock:
            # A running job counts until now, and once recorded as ended until its exit, which came
            # a moment earlier: never say less than before, or Prometheus would see a reset.
            for user in sorted(held):
                self._gpu_seconds[user] = max(self._gpu_seconds.get(user, 0.0), held[user])
                counter.add_metric([user], self._gpu_seconds[user])
        return counter

    def _gpus(self, listing: GpuListing) -> Iterator[Metric]:
        labels = ["gpu", "node", "uuid", "name"]
        utilization = GaugeMetricFamily(
            "gpuport_gpu_utilization_percent", "GPU utilization (NVML), percent", labels=labels
        )
        used = GaugeMetricFamily("gpuport_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        total = GaugeMetricFamily("gpuport_gpu_memory_total_bytes", "GPU memory in all", labels=labels)
        held = GaugeMetricFamily(
            "gpuport_job_gpu_share",
            "The part of each GPU a running job holds: 1 whole, a slice's memory over the GPU's",
            labels=["job_id", "user", "gpu", "node"],
        )
        job_used = GaugeMetricFamily(
            "gpuport_job_gpu_memory_used_bytes",
            "GPU memory a running job's processes use",
            labels=["job_id", "user", "gpu", "node"],
        )
        # The DCGM exporter's names, units (MiB, W, degrees C) and labels, for NVIDIA's dashboards.
        dcgm_labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
        dcgm_util = GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels=dcgm_labels)
        dcgm_used = GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels=dcgm_labels)
        dcgm_free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=dcgm_labels)
        dcgm_power = GaugeMetricFamily("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", labels=dcgm_labels)
        dcgm_temp = GaugeMetricFamily("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", labels=dcgm_labels)
        for place, gpu in enumerate(listing.gpus):
            values = [str(gpu.index), gpu.node, gpu.uuid, gpu.name]
            dcgm = [str(gpu.index), gpu.uuid, f"nvidia{gpu.index}", gpu.name, gpu.node]
            if gpu.utilization is not None:
                utilization.add_metric(values, gpu.utilization)
                dcgm_util.add_metric(dcgm, gpu.utilization)
            used.add_metric(values, gpu.memory_used)
            total.add_metric(values, gpu.memory_total)
            dcgm_used.add_metric(dcgm, gpu.memory_used / _MIB)
            dcgm_free.add_metric(dcgm, max(0, gpu.memory_total - gpu.memory_used) / _MIB)
            if gpu.power is not None:
                dcgm_power.add_metric(dcgm, gpu.power)
            if gpu.temperature is not None:
                dcgm_temp.add_metric(dcgm, gpu.temperature)
            for allocation in listing.allocations.get(place, []):
                job = [allocation.job_id, allocation.owner, str(gpu.index), gpu.node]
                share = allocation.memory / gpu.memory_total if allocation.memory and gpu.memory_total else 1.0
                held.add_metric(job, share)
                job_used.add_metric(job, allocation.memory_used)
        yield from (utilization, used, total, held, job_used)
        yield from (dcgm_util, dcgm_used, dcgm_free, dcgm_power, dcgm_temp)

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


class _TritonCollector(Collector):
    """Served models as Triton's ``/metrics`` names them: counters without ``_total``, durations in
    microseconds, labelled ``model`` and ``version``."""

    FAMILIES = (  # name, help; the values follow in this order
        ("nv_inference_request_success", "Number of successful inference requests, all batch sizes"),
        ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes"),
        ("nv_inference_count", "Number of inferences performed (rows, a batch's each counted)"),
        ("nv_inference_exec_count", "Number of model executions performed (batches)"),
        ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds"),
        ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds"),
        ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds"),
        ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds"),
        ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds"),
    )

    def __init__(self, app: ServerApp) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        # Gauges here, made counters as rendered (``Metrics.render``): prometheus_client would add _total.
        families = [GaugeMetricFamily(name, doc, labels=["model", "version"]) for name, doc in self.FAMILIES]
        for record, timings in self.app.serving.statistics():
            sizes = timings.batches.items()
            values = (
                timings.success.count,
                timings.fail.count,
                sum(size * infer.count for size, (_, infer, _) in sizes),
                sum(infer.count for _, (_, infer, _) in sizes),
                timings.success.ns / 1000,
                timings.queue.ns / 1000,
                timings.compute_input.ns / 1000,
                timings.compute_infer.ns / 1000,
                timings.compute_output.ns / 1000,
            )
            for family, value in zip(families, values, strict=True):
                family.add_metric([record.name, str(record.version)], value)
        yield from families


_TYPE_GAUGE = re.compile(rb"^(# TYPE \S+) gauge$", re.MULTILINE)


class Metrics:
    """The registry ``GET /metrics`` renders: the server's collector and nothing else (not the
    process-wide default registry), then Triton's counters."""

    def __init__(self, app: ServerApp) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(app))
        self.triton = CollectorRegistry(auto_describe=False)
        self.triton.register(_TritonCollector(app))

    def render(self) -> bytes:
        return generate_latest(self.registry) + _TYPE_GAUGE.sub(rb"\1 counter", generate_latest(self.triton))
