"""Slices on a real GPU (marker ``gpu``: skipped without NVML): a server with the NVML inventory,
real PyTorch/JAX jobs, the framework caps and the watchdog."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuport
from tests.conftest import RunningServer, server_env, start_server, touch_in_job, wait_for

pytestmark = pytest.mark.gpu

# Allocates argv[1] (a fraction of the GPU) with torch, says so, then holds until argv[2] exists.
# With argv[3] == "uncapped" it first lifts the cap the bootstrap set, as careless code might.
TORCH_ALLOC = textwrap.dedent(
    """
    import os, sys, time
    import torch
    if sys.argv[3:] == ["uncapped"]:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        x = torch.empty(int(total * float(sys.argv[1])), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        print("OutOfMemoryError", str(e).splitlines()[0], flush=True)
        sys.exit(3)
    print("allocated", sys.argv[1], flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    """
)


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("gpu") / "state", env=server_env())  # NVML, no fake GPUs
    yield running
    running.stop()


@pytest.fixture
def gpu(gpu_server: RunningServer) -> Iterator[gpuport.Client]:
    with gpu_server.connect() as client:
        yield client


def _slice(gpu: gpuport.Client, fraction: float) -> int:
    return int(gpu.gpus()[0].memory_total * fraction)


def test_two_torch_jobs_with_40_percent_slices_run_on_one_gpu_at_once(
    gpu_server: RunningServer, gpu: gpuport.Client, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    (tmp_path / "alloc.py").write_text(TORCH_ALLOC)
    size = _slice(gpu, 0.4)
    jobs = [gpu.submit(["python", "alloc.py", "0.3", "go"], workdir=tmp_path, gpu_memory=size) for _ in range(2)]
    for job in jobs:
        wait_for(lambda job=job: "allocated 0.3" in "\n".join(job.logs()), timeout=120, what=f"{job.id} allocating")
    assert jobs[0].info.gpu_indices == jobs[1].info.gpu_indices
    held = {a.job_id: a for g in gpu.gpus() for a in g.allocations}
    assert {held[j.id].memory for j in jobs} == {size}
    wait_for(lambda: all({a.job_id: a for g in gpu.gpus() for a in g.allocations}[j.id].memory_used for j in jobs))
    for job in jobs:
        touch_in_job(gpu_server.state_dir, job.id, "go")
    assert [j.wait(60).info.state for j in jobs] == ["succeeded", "succeeded"]


def test_the_torch_cap_stops_an_allocation_past_the_slice(gpu: gpuport.Client, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "alloc.py").write_text(TORCH_ALLOC)
    job = gpu.submit(["python", "alloc.py", "0.2", "go"], workdir=tmp_path, gpu_memory=_slice(gpu, 0.1))
    info = job.wait(120).info
    assert info.state == "failed" and info.exit_code == 3
    assert any(line.startswith("OutOfMemoryError") for line in job.logs())


def test_a_job_that_lifts_its_cap_and_allocates_past_its_slice_is_killed(gpu: gpuport.Client, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "alloc.py").write_text(TORCH_ALLOC)
    size = _slice(gpu, 0.1)
    command = ["python", "alloc.py", "0.2", "never", "uncapped"]
    info = gpu.submit(command, workdir=tmp_path, gpu_memory=size).wait(120).info
    assert info.state == "killed"
    assert info.message.startswith(f"exceeded its GPU memory slice of {gpuport.format_size(size)} (used ")


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_the_jax_cap_holds_where_tensorflow_is_not_installed(gpu: gpuport.Client, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        total = jax.devices()[0].memory_stats()["bytes_limit"]
        print("limit", total, flush=True)
        try:
            x = jnp.zeros(int(total * 1.5) // 4, dtype=jnp.float32).block_until_ready()
        except Exception as e:
            print("refused", type(e).__name__, flush=True)
        """
    )
    size = _slice(gpu, 0.1)
    job = gpu.submit(["python", "-c", script], workdir=None, gpu_memory=size).wait(120)
    lines = list(job.logs())
    limit = int(next(line for line in lines if line.startswith("limit")).split()[1])
    assert limit <= size * 1.05  # XLA's allocator is capped at the slice
    assert any(line.startswith("refused") for line in lines)


# ---- sessions on the GPU -----------------------------------------------------------------------------


def _device_of(tensor: object) -> str:
    return str(tensor.device)  # type: ignore[attr-defined]


def _gram(tensor: object) -> object:
    return tensor @ tensor.T  # type: ignore[attr-defined]


def _allocate(fraction: float) -> int:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    block = torch.empty(int(total * fraction), dtype=torch.uint8, device="cuda")
    return int(block.numel())


def test_a_session_keeps_torch_tensors_on_its_gpu_and_computes_with_them(gpu: gpuport.Client) -> None:
    torch = pytest.importorskip("torch")
    with gpu.session(gpu_memory=_slice(gpu, 0.2)) as s:
        matrix = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        ref = s.put(matrix, device="gpu")
        assert s.call(_device_of, ref) == "cuda:0"
        product = s.call(_gram, ref, keep=True)  # computed on the GPU, and kept there
        assert s.call(_device_of, product) == "cuda:0"
        back = s.get(product)
        assert back.device.type == "cpu" and torch.equal(back, matrix @ matrix.T)
        worker = s.info().job_id
        assert worker in {a.job_id for g in gpu.gpus() for a in g.allocations}


def test_a_sessions_gpu_slice_caps_what_its_calls_allocate(gpu: gpuport.Client) -> None:
    pytest.importorskip("torch")
    with gpu.session(gpu_memory=_slice(gpu, 0.1)) as s:
        assert s.call(_allocate, 0.05) > 0
        with pytest.raises(gpuport.RemoteError) as raised:
            s.call(_allocate, 0.2)
        assert "OutOfMemoryError" in raised.value.remote_type
        assert s.call(_allocate, 0.05) > 0  # the worker lives on, within its slice


# ---- a deployment on the GPU ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_deployment_runs_its_batches_on_its_gpu_slice(
    gpu: gpuport.Client, gpu_server: RunningServer, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")

    class Where(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            on_gpu = torch.full((x.shape[0], 1), float(x.is_cuda), device=x.device)
            return x * 2, on_gpu

    torch.jit.script(Where()).save(str(tmp_path / "where.pt"))
    spec = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "on_gpu", "datatype": "FP32", "shape": [-1, 1]},
        ],
    }
    (tmp_path / "gpuport-model.json").write_text(json.dumps(spec))
    info = gpu.deploy("where", tmp_path / "where.pt", gpu_memory=_slice(gpu, 0.1))
    try:
        body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": list(range(8))}]}
        reply = gpu_server.rest("POST", "/v2/models/where/infer", token=gpu_server.admin_token, json=body)
        assert reply.status_code == 200, reply.text
        outputs = {o["name"]: o["data"] for o in reply.json()["outputs"]}
        assert outputs["y"] == [float(2 * v) for v in range(8)] and outputs["on_gpu"] == [1.0, 1.0]
        held = {a.job_id: a for g in gpu.gpus() for a in g.allocations}
        assert held[info.jobs[0]].memory == _slice(gpu, 0.1) and held[info.jobs[0]].memory_used > 0
    finally:
        gpu.undeploy("where")
