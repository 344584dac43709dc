"""The job bootstrap holds TensorFlow and PyTorch to the job's GPU-memory slice when, and only when,
the job imports them; real Python processes with the bootstrap on PYTHONPATH, as the server starts
them. Real torch and TensorFlow where it matters (CPU builds here: no device to cap, so the step that
caps a device is driven by hand with torch's or TensorFlow's device functions replaced), stand-in
packages where only the import machinery is under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpuport.server.worker import bootstrap

BOOTSTRAP = Path(bootstrap.__file__).parent
GiB = 2**30
SLICE = {"GPUPORT_GPU_MEMORY": str(8 * GiB), "GPUPORT_GPU_MEMORY_FRACTION": "0.5"}
# What TensorFlow, JAX and CuPy read, set by the bootstrap from the slice.
FRAMEWORK_ENV = (
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "CUPY_GPU_MEMORY_LIMIT",
)
# Read or set by the bootstrap: never inherited from the test's own environment.
CONTROLLED_ENV = ("GPUPORT_GPU_MEMORY", "GPUPORT_GPU_MEMORY_FRACTION", *FRAMEWORK_ENV, "PYTHONUNBUFFERED", "PYTHONPATH")
FRAMEWORKS = ("tensorflow", "torch", "jax", "cupy")
# The last line a script prints: what it found, as JSON.
REPORT = "import json, sys, sitecustomize\ndef report(**found): print(json.dumps(found))\n"


def job_env(env: dict[str, str], extra_path: Path | None = None) -> dict[str, str]:
    """This environment less what the bootstrap reads or sets, plus ``env``; PYTHONPATH starts with
    the bootstrap folder, then ``extra_path``."""
    full = {k: v for k, v in os.environ.items() if k not in CONTROLLED_ENV}
    path = [str(BOOTSTRAP)] + ([str(extra_path)] if extra_path else [])
    full.update(PYTHONPATH=os.pathsep.join(path), TF_CPP_MIN_LOG_LEVEL="2", **env)
    return full


def run_job_python(script: str, env: dict[str, str], extra_path: Path | None = None) -> tuple[dict[str, Any], str]:
    """Run ``script`` as a job's Python would run; return what it reported, and its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", REPORT + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=job_env(env, extra_path),
        timeout=120,
        check=False,  # its stderr in the assertion below says why it failed
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def stand_in(root: Path, name: str, code: str) -> Path:
    """A package ``name`` under ``root`` with ``code`` as its __init__, found before the real one."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(code))
    (root / name / "nn.py").write_text("")
    return root


# Just what the hooks call: torch's CUDA not started, its lazy calls in `queued`; TensorFlow sees no GPU.
FAKE_TORCH = textwrap.dedent(
    """
    import types
    queued = []
    cuda = types.SimpleNamespace(is_initialized=lambda: False, _lazy_call=queued.append)
    """
)
FAKE_TENSORFLOW = textwrap.dedent(
    """
    import types
    config = types.SimpleNamespace(list_physical_devices=lambda kind: [])
    """
)


def test_with_a_slice_and_no_framework_imported_none_is_and_their_variables_are_set() -> None:
    found, stderr = run_job_python(
        f"""
        import os
        report(modules=[m for m in {FRAMEWORKS!r} if m in sys.modules], caps=sitecustomize.caps,
               env={{k: os.environ.get(k) for k in {FRAMEWORK_ENV!r}}})
        """,
        SLICE,
    )
    assert found == {
        "modules": [],
        "caps": {},
        "env": {
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",
            "CUPY_GPU_MEMORY_LIMIT": str(8 * GiB),
        },
    }
    assert stderr == ""


def test_variables_a_job_set_itself_are_kept_and_a_fraction_alone_gives_cupy_a_percentage() -> None:
    found, _ = run_job_python(
        f"import os\nreport(env={{k: os.environ.get(k) for k in {FRAMEWORK_ENV!r}}})",
        {"GPUPORT_GPU_MEMORY_FRACTION": "0.25", "TF_FORCE_GPU_ALLOW_GROWTH": "false"},
    )
    assert found["env"] == {
        "TF_FORCE_GPU_ALLOW_GROWTH": "false",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25",
        "CUPY_GPU_MEMORY_LIMIT": "25%",
    }


def test_without_a_slice_nothing_is_capped_hooked_or_set(tmp_path: Path) -> None:
    stand_in(tmp_path, "torch", FAKE_TORCH)
    found, stderr = run_job_python(
        f"""
        import os
        modules = [m for m in {FRAMEWORKS!r} if m in sys.modules]
        finders = [type(f).__name__ for f in sys.meta_path]
        import torch
        report(modules=modules, finders=finders, caps=sitecustomize.caps, queued=len(torch.queued),
               env=[k for k in {FRAMEWORK_ENV!r} if k in os.environ])
        """,
        {},
        tmp_path,
    )
    assert found["modules"] == [] and found["env"] == []
    assert "CapOnImport" not in found["finders"]
    assert found["caps"] == {} and found["queued"] == 0
    assert stderr == ""


def test_torch_is_capped_when_cuda_starts_not_at_import() -> None:
    found, stderr = run_job_python(
        """
        import torch
        queued = [call.__qualname__ for call, _ in torch.cuda._queued_calls if call.__module__ == "_gpuport_caps"]
        product = (torch.arange(6.0).reshape(2, 3) @ torch.ones(3)).tolist()
        report(caps=sitecustomize.caps, initialized=torch.cuda.is_initialized(), queued=queued, product=product,
               loader=type(torch.__loader__).__name__, spec_loader=type(torch.__spec__.loader).__name__)
        """,
        SLICE,
    )
    assert found["caps"] == {"torch": {"fraction": 0.5, "memory": 8 * GiB, "deferred": True}}
    assert found["initialized"] is False
    assert found["queued"] == ["_cap_torch.<locals>.cap_torch_at_cuda_start"]
    assert found["product"] == [3.0, 12.0]
    assert found["loader"] == found["spec_loader"] == "SourceFileLoader"  # its own loader, not the hook's
    assert "gpuport" not in stderr  # no device yet: nothing to say


# torch's CUDA bindings answering as a machine with two GPUs of 32 GiB would; the fractions set are
# in `calls`. torch's own Python runs on them: _lazy_init, device_count, set_per_process_memory_fraction.
TWO_GPUS = textwrap.dedent(
    """
    import types
    C, cuda, calls, current = torch._C, torch.cuda, [], [0]
    def start():
        cuda._get_device_properties = lambda device: types.SimpleNamespace(total_memory=32 * 2**30)
    C._cuda_init, C._cuda_getDeviceCount, cuda._cudart = start, lambda: 2, object()
    C._cuda_getDevice, C._cuda_setDevice = lambda: current[0], lambda device: current.__setitem__(0, device)
    def set_fraction(fraction, device):  # leaves `device` current, as older torch did
        calls.append([fraction, device])
        current[0] = device
    C._cuda_setMemoryFraction = set_fraction
    # torch's own queued checks need a real GPU: only the bootstrap's call stays.
    cuda._queued_calls[:] = [queued for queued in cuda._queued_calls if queued[0].__module__ == "_gpuport_caps"]
    """
)


@pytest.mark.parametrize(
    ("slice_env", "fraction", "said"),
    [
        (SLICE, 0.5, "gpuport: PyTorch limited to 8GiB per GPU"),
        ({"GPUPORT_GPU_MEMORY": str(8 * GiB)}, 0.25, "gpuport: PyTorch limited to 8GiB per GPU"),
        ({"GPUPORT_GPU_MEMORY_FRACTION": "0.1"}, 0.1, "gpuport: PyTorch limited to 10% of each GPU"),
    ],
    ids=["both", "bytes-only", "fraction-only"],
)
def test_importing_a_torch_submodule_first_caps_every_gpu_when_cuda_starts(
    slice_env: dict[str, str], fraction: float, said: str
) -> None:
    found, stderr = run_job_python(
        "import torch.nn\n"
        + TWO_GPUS
        + "torch.cuda.init()\n"
        + "report(calls=calls, started=torch.cuda.is_initialized(), current=current[0], caps=sitecustomize.caps)",
        slice_env,
    )
    assert found["calls"] == [[fraction, 1], [fraction, 0]]  # the current device last
    assert found["started"] is True and found["current"] == 0  # as it was
    assert found["caps"]["torch"]["devices"] == 2
    assert stderr.splitlines() == [said]


def test_a_torch_cap_that_fails_at_cuda_start_is_one_line_and_cuda_starts_all_the_same() -> None:
    refuse = textwrap.dedent(
        """
        def refuse(fraction, device):
            raise RuntimeError("CUDA error: invalid device ordinal\\nCUDA kernel errors might be reported later")
        C._cuda_setMemoryFraction = refuse
        torch.cuda.init()
        """
    )
    found, stderr = run_job_python(
        "import torch\n" + TWO_GPUS + refuse + "report(started=torch.cuda.is_initialized(), caps=sitecustomize.caps)",
        SLICE,
    )
    assert found["started"] is True  # an exception out of the queued call would have left CUDA unusable
    assert found["caps"] == {
        "torch": {"fraction": 0.5, "memory": 8 * GiB, "deferred": True, "error": "CUDA error: invalid device ordinal"}
    }
    assert stderr.splitlines() == ["gpuport: could not cap PyTorch at 8GiB: CUDA error: invalid device ordinal"]


def test_tensorflow_is_capped_at_import_and_still_accepts_set_memory_growth() -> None:
    found, stderr = run_job_python(
        """
        import tensorflow as tf
        from tensorflow.python.eager import context
        import _gpuport_caps
        at_import = json.loads(json.dumps(sitecustomize.caps))
        finder_gone = not any(type(f).__name__ == "CapOnImport" for f in sys.meta_path)
        # No GPU in tensorflow-cpu: show it one, cap it as the hook would, and call what most
        # TensorFlow scripts call next.
        ctx = context.context()
        gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
        ctx._physical_devices.append(gpu)
        _gpuport_caps._cap_tensorflow(tf, _gpuport_caps.read_slice({"GPUPORT_GPU_MEMORY": str(8 * 2**30)}))
        limits = [d.memory_limit for d in tf.config.get_logical_device_configuration(gpu)]
        tf.config.experimental.set_memory_growth(gpu, True)
        # A device the job configured itself keeps TensorFlow's own refusal.
        own = tf.config.PhysicalDevice(name="/physical_device:GPU:1", device_type="GPU")
        ctx._physical_devices.append(own)
        tf.config.set_logical_device_configuration(own, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)])
        try:
            tf.config.experimental.set_memory_growth(own, True)
            refused = ""
        except ValueError as error:
            refused = str(error)
        for device in (gpu, own):
            ctx._physical_devices.remove(device)
            del ctx._virtual_device_map[device]
        total = float(tf.reduce_sum(tf.ones([2, 3])).numpy())
        report(at_import=at_import, caps=sitecustomize.caps, limits=limits, refused=refused, total=total,
               finder_gone=finder_gone)
        """,
        SLICE,
    )
    assert found["at_import"] == {"tensorflow": {"devices": 0, "memory_limit_mib": 8192}}
    assert found["caps"] == {"tensorflow": {"devices": 1, "memory_limit_mib": 8192}}
    assert found["limits"] == [8192]
    assert found["refused"] == "Cannot set memory growth on device when virtual devices configured"
    assert found["total"] == 6.0
    assert found["finder_gone"] is False  # torch's hook still waits
    assert "could not cap" not in stderr
    gpuport_lines = [line for line in stderr.splitlines() if line.startswith("gpuport:")]
    assert gpuport_lines == ["gpuport: TensorFlow limited to 8GiB per GPU (memory growth on)"]


def test_the_hook_leaves_once_both_frameworks_are_imported(tmp_path: Path) -> None:
    stand_in(tmp_path, "torch", FAKE_TORCH)
    stand_in(tmp_path, "tensorflow", FAKE_TENSORFLOW)
    found, stderr = run_job_python(
        """
        def hooked():
            return any(type(f).__name__ == "CapOnImport" for f in sys.meta_path)
        import torch.nn
        after_torch = hooked()
        import tensorflow
        report(after_torch=after_torch, after_both=hooked(), caps=sitecustomize.caps, queued=len(torch.queued))
        """,
        SLICE,
        tmp_path,
    )
    assert found == {
        "after_torch": True,
        "after_both": False,
        "caps": {
            "torch": {"fraction": 0.5, "memory": 8 * GiB, "deferred": True},
            "tensorflow": {"devices": 0, "memory_limit_mib": 8192},
        },
        "queued": 1,
    }
    assert stderr == ""


def test_a_cap_that_fails_at_import_is_one_line_and_the_import_succeeds(tmp_path: Path) -> None:
    stand_in(tmp_path, "torch", "cuda = None  # a torch without CUDA support at all\n")
    found, stderr = run_job_python("import torch\nreport(cuda=torch.cuda, caps=sitecustomize.caps)", SLICE, tmp_path)
    assert found == {"cuda": None, "caps": {"torch": {"error": "'NoneType' object has no attribute 'is_initialized'"}}}
    assert stderr.splitlines() == [
        "gpuport: could not cap PyTorch at 8GiB: 'NoneType' object has no attribute 'is_initialized'"
    ]


def test_a_framework_that_fails_to_import_fails_as_it_would_and_is_hooked_when_retried(tmp_path: Path) -> None:
    not_ready = "import os\nif not os.path.exists('ready'):\n    raise ImportError('not ready')\n"
    stand_in(tmp_path, "torch", not_ready + FAKE_TORCH)
    found, stderr = run_job_python(
        f"""
        import os
        os.chdir({str(tmp_path)!r})
        try:
            import torch
        except ImportError as error:
            first = str(error)
        open("ready", "w").close()
        import torch
        report(first=first, caps=sitecustomize.caps)
        """,
        SLICE,
        tmp_path,
    )
    assert found == {"first": "not ready", "caps": {"torch": {"fraction": 0.5, "memory": 8 * GiB, "deferred": True}}}
    assert stderr == ""


def test_the_sitecustomize_it_shadows_still_runs_and_what_it_imports_is_capped(tmp_path: Path) -> None:
    stand_in(tmp_path, "torch", FAKE_TORCH)
    (tmp_path / "sitecustomize.py").write_text("import os, torch\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    found, stderr = run_job_python(
        """
        import os
        report(ran=os.environ.get("SHADOWED_RAN"), ours=hasattr(sitecustomize, "caps"),
               caps=sitecustomize.caps, queued=len(sys.modules["torch"].queued))
        """,
        SLICE,
        tmp_path,
    )
    assert found == {
        "ran": "yes",
        "ours": True,  # sys.modules["sitecustomize"] stays the bootstrap
        "caps": {"torch": {"fraction": 0.5, "memory": 8 * GiB, "deferred": True}},
        "queued": 1,
    }
    assert stderr == ""


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"GPUPORT_GPU_MEMORY_FRACTION": "abc"},
            ["gpuport: ignoring GPUPORT_GPU_MEMORY_FRACTION='abc': expected a number in (0, 1]"],
        ),
        (
            {"GPUPORT_GPU_MEMORY": "8GiB", "GPUPORT_GPU_MEMORY_FRACTION": "2"},
            [
                "gpuport: ignoring GPUPORT_GPU_MEMORY='8GiB': expected a whole number of bytes above 0",
                "gpuport: ignoring GPUPORT_GPU_MEMORY_FRACTION='2': expected a number in (0, 1]",
            ],
        ),
    ],
    ids=["not-a-number", "out-of-range"],
)
def test_values_that_do_not_parse_are_ignored_with_one_line_each(
    tmp_path: Path, env: dict[str, str], said: list[str]
) -> None:
    stand_in(tmp_path, "torch", FAKE_TORCH)
    found, stderr = run_job_python(
        "import os, torch\nreport(caps=sitecustomize.caps, cupy=os.environ.get('CUPY_GPU_MEMORY_LIMIT'))",
        env,
        tmp_path,
    )
    assert found == {"caps": {}, "cupy": None}
    assert stderr.splitlines() == said


def test_one_bad_value_leaves_the_other_in_force(tmp_path: Path) -> None:
    stand_in(tmp_path, "torch", FAKE_TORCH)
    found, stderr = run_job_python(
        "import torch\nreport(caps=sitecustomize.caps)",
        {"GPUPORT_GPU_MEMORY": str(4 * GiB), "GPUPORT_GPU_MEMORY_FRACTION": "nan"},
        tmp_path,
    )
    assert found == {"caps": {"torch": {"fraction": None, "memory": 4 * GiB, "deferred": True}}}
    assert stderr.splitlines() == ["gpuport: ignoring GPUPORT_GPU_MEMORY_FRACTION='nan': expected a number in (0, 1]"]


@pytest.mark.parametrize("slice_env", [{}, SLICE], ids=["no-slice", "slice"])
def test_output_to_one_file_keeps_its_order(tmp_path: Path, slice_env: dict[str, str]) -> None:
    log = tmp_path / "log"
    with log.open("w") as out:
        subprocess.run(
            [sys.executable, "-c", "import sys\nprint('out 1'); print('err', file=sys.stderr); print('out 2')"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=job_env(slice_env),
            timeout=60,
            check=True,
        )
    assert log.read_text().splitlines() == ["out 1", "err", "out 2"]


@pytest.mark.gpu
def test_torch_on_a_gpu_is_held_to_its_fraction() -> None:
    found, stderr = run_job_python(
        """
        import torch
        total = torch.cuda.get_device_properties(0).total_memory  # starts CUDA: the cap is set
        small = torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
        del small
        torch.cuda.empty_cache()
        try:
            torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
            refused = False
        except torch.cuda.OutOfMemoryError:
            refused = True
        report(refused=refused, fraction=torch.cuda.get_per_process_memory_fraction(0), caps=sitecustomize.caps)
        """,
        {"GPUPORT_GPU_MEMORY_FRACTION": "0.1"},
    )
    assert found["refused"] is True
    assert found["fraction"] == pytest.approx(0.1)
    assert found["caps"]["torch"]["devices"] >= 1
    assert "gpuport: PyTorch limited to 10% of each GPU" in stderr.splitlines()
