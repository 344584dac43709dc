"""GET /metrics: Prometheus's text format, read by prometheus_client's own parser, from a real server:
jobs by state and user, the queue, GPUs and the jobs holding them (also as the DCGM exporter names
them), bytes moved, and a model's requests, latency and batch sizes (also as Triton names them). An
admin token or a scrape token reads it; a scrape token reads nothing else. A real Prometheus (Debian's
package) scrapes it over TLS and answers every query of the sample Grafana dashboard."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

import gpuport
from gpuport import __version__
from tests.conftest import JobFlag, RunningServer, start_server
from tests.test_serving_errors import _doubler_file

parser = pytest.importorskip("prometheus_client.parser")
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
DASHBOARD = Path(__file__).parent.parent / "examples" / "grafana-dashboard.json"
# The scrape job's name: Prometheus's `job` label on every series it scrapes from the server.
SCRAPE_JOB = "gpuport"


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
                shares = {
                    dict(labels)["job_id"]: v for (n, labels), v in samples.items() if n == "gpuport_job_gpu_share"
                }
                assert shares == {holding.id: 0.25}
                assert _value(samples, "gpuport_jobs_ended_total", state="succeeded", user="alice") == 1
                assert _value(samples, "gpuport_jobs_ended_total", state="failed", user="alice") == 1
                assert _value(samples, "gpuport_jobs_ended_total", state="running", user="alice") == 0  # not ended
                assert _value(samples, "gpuport_gpu_seconds_total", user="alice") > 0  # the slice, held until now
                assert _value(samples, "gpuport_build_info", version=__version__) == 1
                # No label of ours is Prometheus's `job` (it would become `exported_job`).
                assert not [key for key in samples if "job" in dict(key[1])]
                # The DCGM exporter's names, labels and units (MiB), for NVIDIA's dashboards.
                dcgm = {"gpu": "0", "UUID": "GPU-fake-0", "device": "nvidia0", "modelName": "Fake GPU"}
                hostname = next(dict(k[1])["Hostname"] for k in samples if k[0] == "DCGM_FI_DEV_FB_FREE")
                assert _value(samples, "DCGM_FI_DEV_FB_FREE", **dcgm, Hostname=hostname) == 16 * 1024
                assert _value(samples, "DCGM_FI_DEV_FB_USED", **dcgm, Hostname=hostname) == 0
                assert (("DCGM_FI_DEV_GPU_UTIL", tuple(sorted({**dcgm, "Hostname": hostname}.items())))) in samples
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
        text = server.rest("GET", "/metrics", scrape).text
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
        # Triton's names: counters without _total (prometheus_client's parser would add it, so read the lines).
        triton = {
            m[1]: float(m[2])
            for m in re.finditer(r'^(nv_\w+)\{model="doubler",version="1"\} (\S+)$', text, re.MULTILINE)
        }
        assert "# TYPE nv_inference_count counter" in text and "nv_inference_count_total" not in text
        assert triton["nv_inference_request_success"] == 5
        assert triton["nv_inference_request_failure"] == 1
        assert triton["nv_inference_count"] == 15  # rows of the batches that ran
        assert triton["nv_inference_exec_count"] == 5  # one request at a time: a batch each
        for duration in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
            assert triton[f"nv_inference_{duration}_duration_us"] > 0, duration
        assert triton["nv_inference_request_duration_us"] < 60e6


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


def _dashboard_targets() -> list[dict[str, Any]]:
    return [target for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def test_the_sample_grafana_dashboard_asks_only_for_metrics_there_are(server: RunningServer) -> None:
    """examples/grafana-dashboard.json: every metric its queries name is one the server exposes."""
    asked = {name for target in _dashboard_targets() for name in re.findall(r"\bgpuport_[a-z_]+", target["expr"])}
    response = server.rest("GET", "/metrics", server.admin_token)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exposed = {  # a family is announced (HELP, TYPE) even while it has no samples, as a model's before any
        f.name + suffix for f in parser.text_string_to_metric_families(response.text) for suffix in suffixes[f.type]
    }
    assert len(asked) >= 12 and asked <= exposed, sorted(asked - exposed)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _prometheus(folder: Path, server: RunningServer, token: str) -> Iterator[httpx.Client]:
    """Debian's Prometheus on 127.0.0.1, scraping the server's /metrics every second over TLS (its
    certificate the CA, the scrape token as bearer), as the README's scrape config says; its API."""
    folder.mkdir()
    (folder / "token").write_text(token)
    config = {  # YAML reads JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": SCRAPE_JOB,
                "scheme": "https",
                "tls_config": {"ca_file": str(server.state_dir / "tls" / "cert.pem")},
                "authorization": {"credentials_file": str(folder / "token")},
                "static_configs": [{"targets": [urlsplit(server.http_url).netloc]}],
            }
        ],
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))
    address = f"127.0.0.1:{_free_port()}"
    with (folder / "log").open("w") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address={address}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://{address}", timeout=10) as api:
            _poll(lambda: _ready(api, process, folder / "log"), "Prometheus ready")
            yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(api: httpx.Client, process: subprocess.Popen[bytes], log: Path) -> bool:
    assert process.poll() is None, f"prometheus exited ({process.returncode}):\n{log.read_text()}"
    try:
        return api.get("/-/ready").status_code == 200
    except httpx.TransportError:
        return False


def _poll(condition: Any, what: str, timeout: float = 60.0) -> Any:
    """``condition()`` every quarter second until it is true, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout}s")


def _query(api: httpx.Client, expr: str) -> list[dict[str, Any]]:
    answer = api.get("/api/v1/query", params={"query": expr}).json()
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


@pytest.mark.skipif(
    not os.path.exists(PROMETHEUS),
    reason="prometheus is not installed: apt-get install prometheus (make test-tools does, as root)",
)
def test_prometheus_scrapes_it_and_every_dashboard_query_finds_series(
    own_server: RunningServer, tmp_path: Path
) -> None:
    server = own_server
    with server.connect() as admin:
        scrape = admin.create_token("prometheus", scrape=True).token
        alice = admin.create_token("alice").token
        workdir = tmp_path / "work"
        workdir.mkdir()
        (workdir / "data.txt").write_text("bytes that travel\n" * 100)
        admin.deploy("doubler", _doubler_file(tmp_path), max_queue_delay=0.001)  # no GPU: starts at once
        x = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": [1.0] * 12}]}
        for _ in range(3):
            assert server.rest("POST", "/v2/models/doubler/infer", alice, json=x).status_code == 200
        with server.connect(alice) as gpu:
            assert gpu.submit(["python", "-c", "print('done')"], workdir=workdir).wait(timeout=60).status == "succeeded"
            flag = JobFlag(server.state_dir)
            try:
                holding = gpu.submit(
                    ["python", "-c", f"import os, time\nwhile not os.path.exists('{flag}'): time.sleep(0.05)"],
                    workdir=None,
                    gpu_memory="4GiB",
                )
                waiting = gpu.submit(["true"], workdir=None, gpus=2)  # both GPUs: waits for the slice
                _poll(lambda: holding.status == "running", "the holding job running")
                with _prometheus(tmp_path / "prometheus", server, scrape) as api:
                    _the_dashboard_reads_series(api, holding.id)
            finally:
                flag.close()
                admin.undeploy("doubler")  # its replica would outlive the server, as a job does
            waiting.wait(timeout=60)


def _the_dashboard_reads_series(api: httpx.Client, holding: str) -> None:
    """The target is up; every dashboard query finds series, with the labels its legend reads; our
    labels arrive as they were named (no `exported_job`); DCGM's and Triton's names are there."""
    targets = _poll(
        lambda: [t for t in api.get("/api/v1/targets").json()["data"]["activeTargets"] if t["health"] == "up"],
        "the server's target up",
    )
    assert [t["labels"]["job"] for t in targets] == [SCRAPE_JOB], targets
    for target in _dashboard_targets():
        expr = target["expr"].replace("$__rate_interval", "10s")  # Grafana's is 4 scrape intervals at least
        series = _poll(lambda expr=expr: _query(api, expr), f"series for {expr}")
        legend = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
        assert "job" not in legend, target  # Prometheus's own: the scrape job's name, the same on every series
        for one in series:
            assert legend <= one["metric"].keys(), (expr, target["legendFormat"], one["metric"])

    held = _query(api, "gpuport_job_gpu_memory_used_bytes")
    assert [s["metric"]["job_id"] for s in held] == [holding], held
    assert {s["metric"]["job"] for s in held} == {SCRAPE_JOB}
    assert _query(api, '{exported_job=~".+"}') == []  # no label of ours was renamed
    free = _query(api, 'DCGM_FI_DEV_FB_FREE{gpu="0"}')
    assert [float(s["value"][1]) for s in free] == [16 * 1024], free  # MiB, as DCGM says
    assert {"UUID", "Hostname", "modelName"} <= free[0]["metric"].keys()
    rows = _query(api, 'nv_inference_count{model="doubler",version="1"}')
    assert [float(s["value"][1]) for s in rows] == [9], rows
    assert _query(api, f'gpuport_build_info{{version="{__version__}"}}')
