"""GET /metrics: Prometheus's text format, read by prometheus_client's own parser, from a real server:
jobs by state and user, the queue, GPUs and the jobs holding them, bytes moved, and a model's
requests, latency and batch sizes. An admin token or a scrape token reads it; a scrape token
reads nothing else."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import gpuport
from tests.conftest import JobFlag, RunningServer, start_server
from tests.test_serving_errors import _doubler_file

parser = pytest.importorskip("prometheus_client.parser")


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RunningServer]:
    """A server of this test's own (two fake 16 GiB GPUs): counts start from nothing."""
    running = start_server(tmp_path / "state")
    yield running
    running.stop()


def _scrape(server: RunningServer, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``GET /metrics``: (name, sorted labels) → value."""
    response = server.rest("GET", "/metrics", token)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in parser.text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_jobs_gpus_transfers_and_models_are_measured(own_server: RunningServer, tmp_path: Path) -> None:
    server = own_server
    with server.connect() as admin:
        scrape = admin.create_token("prometheus", scrape=True).token
        alice = admin.create_token("alice").token
        assert any(t.name == "prometheus" and t.scrape for t in admin.tokens())

        with server.connect(alice) as gpu:
            gpu.submit(["python", "-c", "print('done')"], workdir=None).wait(timeout=60)
            failed = gpu.submit(["python", "-c", "raise SystemExit(3)"], workdir=None)
            failed.wait(timeout=60)
            with gpu.session() as s:
                big = np.ones(8 * 1024 * 1024, np.uint8)
                assert s.get(s.put(big)).nbytes == big.nbytes  # 8 MiB in and out through the data port
            flag = JobFlag(server.state_dir)
            try:
                holding = gpu.submit(
                    ["python", "-c", f"import os, time\nwhile not os.path.exists('{flag}'): time.sleep(0.05)"],
                    workdir=None,
                    gpu_memory="4GiB",
                )
                waiting = gpu.submit(["true"], workdir=None, gpus=2)  # both GPUs: waits for the slice
                deadline = time.monotonic() + 30
                while holding.status != "running" and time.monotonic() < deadline:
                    time.sleep(0.05)

                samples = _scrape(server, scrape)
                assert _value(samples, "gpuport_jobs", state="succeeded", user="alice") == 1
                assert _value(samples, "gpuport_jobs", state="failed", user="alice") == 1
                assert _value(samples, "gpuport_jobs", state="running", user="alice") == 1
                assert _value(samples, "gpuport_jobs", state="queued", user="alice") == 1
                assert _value(samples, "gpuport_queue_length", kind="job") == 1
                assert _value(samples, "gpuport_queue_oldest_wait_seconds", kind="job") > 0
                assert _value(samples, "gpuport_queue_wait_seconds_count") >= 3
                total = [v for (n, labels), v in samples.items() if n == "gpuport_gpu_memory_total_bytes"]
                assert total == [16 * 2**30, 16 * 2**30], samples
                shares = {dict(labels)["job"]: v for (n, labels), v in samples.items() if n == "gpuport_job_gpu_share"}
                assert shares == {holding.id: 0.25}
                assert _value(samples, "gpuport_transfer_bytes_total", path="data_port", direction="in") >= 8 * 2**20
                assert _value(samples, "gpuport_transfer_bytes_total", path="data_port", direction="out") >= 8 * 2**20
            finally:
                flag.close()
            waiting.wait(timeout=60)

        admin.deploy("doubler", _doubler_file(tmp_path), max_queue_delay=0.001)
        x = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": [1.0] * 12}]}
        for _ in range(5):
            assert server.rest("POST", "/v2/models/doubler/infer", alice, json=x).status_code == 200
        bad = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [-999.0, 0, 0, 0]}]}
        assert server.rest("POST", "/v2/models/doubler/infer", alice, json=bad).status_code >= 500

        samples = _scrape(server, scrape)
        admin.undeploy("doubler")  # its replica would outlive the server, as a job does
        model = {"model": "doubler", "version": "1"}
        assert _value(samples, "gpuport_model_requests_total", **model, outcome="success") == 5
        assert _value(samples, "gpuport_model_requests_total", **model, outcome="fail") == 1
        assert _value(samples, "gpuport_model_rows_total", **model) == 15
        assert _value(samples, "gpuport_model_request_duration_seconds_count", **model) == 5
        assert _value(samples, "gpuport_model_request_duration_seconds_bucket", **model, le="+Inf") == 5
        assert 0 < _value(samples, "gpuport_model_request_duration_seconds_sum", **model) < 60
        assert _value(samples, "gpuport_model_batch_rows_bucket", **model, le="2.0") == 0
        assert _value(samples, "gpuport_model_batch_rows_bucket", **model, le="4.0") == 5
        assert _value(samples, "gpuport_model_batch_rows_sum", **model) == 15


def test_who_may_scrape(server: RunningServer, admin: gpuport.Client, user_token: str) -> None:
    scrape = admin.create_token(f"scraper-{time.monotonic_ns()}", scrape=True).token
    assert _scrape(server, server.admin_token)  # an admin token reads it too
    assert server.rest("GET", "/metrics").status_code == 401
    denied = server.rest("GET", "/metrics", user_token)
    assert denied.status_code == 403 and "--scrape" in denied.json()["error"]["message"]
    # A scrape token reads nothing else, over either protocol.
    other = server.rest("GET", "/v1/status", scrape)
    assert other.status_code == 403 and "scrape token" in other.json()["error"]["message"]
    with_body = server.rest("POST", "/v1/jobs", scrape, json={"command": ["true"]})  # refused before its body
    assert with_body.status_code == 403 and "scrape token" in with_body.json()["error"]["message"]
    x = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    prediction = server.rest("POST", "/v2/models/nothing/infer", scrape, json=x)
    assert prediction.status_code == 403 and "scrape token" in prediction.json()["error"]
    with pytest.raises(gpuport.PermissionDenied, match="scrape token"):
        server.connect(scrape)


def test_the_sample_grafana_dashboard_asks_only_for_metrics_there_are(server: RunningServer) -> None:
    """examples/grafana-dashboard.json: every metric its queries name is one the server exposes."""
    dashboard = json.loads((Path(__file__).parent.parent / "examples" / "grafana-dashboard.json").read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bgpuport_[a-z_]+", target["expr"])
    }
    response = server.rest("GET", "/metrics", server.admin_token)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exposed = {  # a family is announced (HELP, TYPE) even while it has no samples, as a model's before any
        f.name + suffix for f in parser.text_string_to_metric_families(response.text) for suffix in suffixes[f.type]
    }
    assert len(asked) >= 10 and asked <= exposed, sorted(asked - exposed)
