"""The GPU inventory and server status, through both doors and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpuport

from .conftest import RunningServer, server_env, start_server


def _rest_get(server: RunningServer, path: str) -> dict:
    reply = server.rest("GET", path, server.admin_token)
    reply.raise_for_status()
    return reply.json()


@pytest.mark.parametrize("door", ["sdk", "rest"])
def test_gpus_through_both_doors(server: RunningServer, door: str) -> None:
    if door == "sdk":
        with server.connect() as client:
            gpus = [g.__dict__ for g in client.gpus()]
    else:
        gpus = _rest_get(server, "/v1/gpus")["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    for g in gpus:
        assert g["name"] == "Fake GPU" and g["memory_total"] == 16 * 2**30
        assert g["memory_used"] == 0 and g["utilization"] == 0 and list(g["jobs"]) == []


@pytest.mark.parametrize("door", ["sdk", "rest"])
def test_status_through_both_doors(server: RunningServer, door: str) -> None:
    if door == "sdk":
        with server.connect() as client:
            status = client.status().__dict__
            assert len(status["gpus"]) == 2
    else:
        status = _rest_get(server, "/v1/status")
        assert status["gpus"]["inventory"] == "fake" and len(status["gpus"]["gpus"]) == 2
    assert status["user"] == "admin" and status["admin"] is True
    assert status["server_version"] == gpuport.__version__
    assert status["cpus"] >= 1 and status["memory_total"] > status["memory_available"] > 0


def test_cli_gpus_and_status(server: RunningServer, cli, stdio: str) -> None:
    env = {"GPUPORT_URL": server.url, "GPUPORT_TOKEN": server.admin_token, "GPUPORT_FINGERPRINT": server.fingerprint}
    table = cli("gpus", stdio=stdio, **env)
    assert table.code == 0, table.output
    assert "Fake GPU" in table.stdout and "0B / 16GiB" in table.stdout
    lines = table.stdout.splitlines()
    assert lines[0].split()[:2] == ["GPU", "NAME"] and lines[0].rstrip().endswith("JOBS (OWNER, SLICE, MEMORY USED)")
    assert [line.split()[0] for line in lines[1:]] == ["0", "1"]  # one line a GPU, on 100 columns too
    assert [g["index"] for g in json.loads(cli("gpus", "--json", **env).stdout)] == [0, 1]
    status = cli("status", stdio=stdio, **env)
    assert status.code == 0 and "you      admin (admin)" in status.stdout and "GPUs     2 (fake)" in status.stdout
    assert json.loads(cli("status", "--json", **env).stdout)["inventory"] == "fake"


def test_a_machine_without_gpus_says_so(tmp_path: Path, cli) -> None:
    cpu_only = start_server(tmp_path / "state", env=server_env())
    try:
        assert "GPUs         none:" in cpu_only.banner
        with cpu_only.connect() as client:
            assert client.gpus() == []
            status = client.status()
            assert status.inventory == "cpu" and "CPU" in status.note
        env = {
            "GPUPORT_URL": cpu_only.url,
            "GPUPORT_TOKEN": cpu_only.admin_token,
            "GPUPORT_FINGERPRINT": cpu_only.fingerprint,
        }
        done = cli("gpus", **env)
        assert done.code == 0 and "No GPU on" in done.stdout and "run on the CPU" in done.stdout
        assert json.loads(cli("gpus", "--json", **env).stdout) == []
    finally:
        cpu_only.stop()


@pytest.mark.gpu
def test_real_gpus_are_read_live_from_nvml(tmp_path: Path) -> None:
    import pynvml

    real = start_server(tmp_path / "state", env=server_env())
    try:
        with real.connect() as client:
            status = client.status()
        assert status.inventory == "nvml"
        pynvml.nvmlInit()
        try:
            assert len(status.gpus) == pynvml.nvmlDeviceGetCount()
            for g in status.gpus:
                handle = pynvml.nvmlDeviceGetHandleByIndex(g.index)
                assert g.uuid == pynvml.nvmlDeviceGetUUID(handle)
                assert g.memory_total == pynvml.nvmlDeviceGetMemoryInfo(handle).total
                assert 0 <= g.memory_used <= g.memory_total
        finally:
            pynvml.nvmlShutdown()
    finally:
        real.stop()
