"""The CLI starts without what its command does not use: `gpuport --version` and `--help` load no gRPC,
protobuf, cloudpickle, asyncio, numpy or rich; a command that talks to the server loads gRPC but no
cloudpickle, numpy or asyncio's event loop of its own. Checked in fresh interpreters; the times are
bench/bench_cli.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import RunningServer, client_env

HEAVY = ("grpc", "google.protobuf", "cloudpickle", "asyncio", "numpy", "rich", "gpuport.client._client")
PROBE = """
import json, sys, runpy
sys.argv = ["gpuport", *json.loads(sys.argv[1])]
try:
    runpy.run_module("gpuport", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules)}), file=sys.stderr)
"""


def _modules(args: list[str], env: dict[str, str] | None = None) -> tuple[int, set[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, env=env, timeout=60
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], set(report["modules"]), done.stdout


def _loaded(modules: set[str], prefix: str) -> bool:
    return any(m == prefix or m.startswith(prefix + ".") for m in modules)


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"]])
def test_version_and_help_load_nothing_heavy(args: list[str]) -> None:
    code, modules, out = _modules(args)
    assert code == 0 and ("gpuport" in out or "Usage" in out), out
    assert [m for m in HEAVY if _loaded(modules, m)] == []


def test_importing_gpuport_loads_the_client_on_first_use() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, gpuport; before = 'grpc' in sys.modules; gpuport.connect; "
            "print(before, 'grpc' in sys.modules, gpuport.NotFound.__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split()[:3] == ["False", "True", "NotFound"], done.stderr


def test_a_server_command_loads_grpc_but_not_sessions(server: RunningServer) -> None:
    code, modules, out = _modules(["status"], env={**os.environ, **client_env(server)})
    assert code == 0 and "gpuport" in out
    assert _loaded(modules, "grpc") and _loaded(modules, "google.protobuf")
    assert [m for m in ("cloudpickle", "numpy", "gpuport.client._sessions") if _loaded(modules, m)] == []
