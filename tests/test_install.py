"""The install a user does: the README's quick start, from the built wheel, in clean virtual envs.

The wheel and sdist are built with ``python -m build``; the README's blocks marked
``<!-- quickstart: box -->``, ``<!-- quickstart: laptop -->`` and ``<!-- quickstart: python -->``
are the script. Each ``$`` line runs as written, with the venv's ``bin`` first on ``PATH`` (as an
activated venv has it) and the folder of the unpacked sdist as the clone, except for what a test on
one machine must change, and only that:

- ``pip install '.[server]'`` / ``pip install .`` install the built wheel (non-editable), not ``.``;
- ``gpuport server`` also gets ``--host 127.0.0.1`` and port 0 for its three ports (loopback only,
  free ports), a temporary ``--state-dir``, and ``GPUPORT_FAKE_GPUS=1x16GiB`` so ``--gpus 1`` fits;
- ``https://gpubox:7600`` and ``gp_...`` become the URL and admin token that server printed, and the
  certificate prompt is answered ``y``.

The box (``[server]``) and the laptop (plain ``gpuport``, no test extras) get a venv each, on every
Python minor version from 3.10 that the machine has (a session needs the same minor version on both
sides); a version that is missing is skipped, saying so. The laptop's commands run with warnings as
errors, and print nothing at exit.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import numpy as np
import pytest

import gpuport
from gpuport._packages import BROUGHT_BY, missing_package
from gpuport.server.daemon import parse_banner
from tests.conftest import READY_TIMEOUT, RunningServer, wait_for
from tests.test_serving_errors import _scale_onnx

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
pytestmark = pytest.mark.slow


@dataclass
class Dist:
    wheel: Path
    sdist: Path
    source: Path  # the unpacked sdist: the "clone" the README's commands run in


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The venvs made as most users make them (umask 022), whatever this run's (a clone made with
    umask 077): a root server refuses an environment that its jobs' uids cannot read, saying so
    (tests/test_shared_box.py), and the quick start is not about that."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(out / "src", filter="data")
    (source,) = (out / "src").iterdir()
    return Dist(wheel, sdist, source)


def readme_block(marker: str) -> str:
    """The fenced block right after ``<!-- quickstart: MARKER -->`` in the README."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- quickstart: {marker} -->\n```\w*\n(.*?)\n```", text, re.DOTALL)
    assert match, f"README.md has no block marked quickstart: {marker}"
    return match.group(1)


def commands(marker: str) -> list[list[str]]:
    """The ``$`` lines of a README block, split as a shell would (comments dropped)."""
    return [shlex.split(line[2:], comments=True) for line in readme_block(marker).splitlines() if line.startswith("$ ")]


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (3.12 ...): pyenv's, or one on PATH."""
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        return sys.executable
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = sorted(pyenv.glob(f"versions/{version}.*/bin/python{version}"), reverse=True)
    candidates += [Path(found)] if (found := shutil.which(f"python{version}")) else []
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return str(candidate)
    return None


class Venv:
    """A clean virtual environment, and commands run in it as in an activated one."""

    def __init__(self, python: str, folder: Path, home: Path) -> None:
        self.folder, self.home = folder, home
        done = subprocess.run([python, "-m", "venv", str(folder)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr

    def env(self, strict: bool, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPORT_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(
            PATH=f"{self.folder / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            VIRTUAL_ENV=str(self.folder),
            GPUPORT_CONFIG_DIR=str(self.home / "config"),
            GPUPORT_CACHE_DIR=str(self.home / "cache"),
            COLUMNS="200",
            GPUPORT_AGENT_IDLE="5",  # the CLI's helpers that its commands start end soon after the test
            **extra,
        )
        if strict:
            env["PYTHONWARNINGS"] = "error"
        return env

    def run(self, argv: list[str], cwd: Path, input: str = "", timeout: float = 600) -> str:
        """Run ``argv`` as typed (found on the venv's PATH); fail with its output unless it succeeds
        and prints no warning, traceback or exception at exit. Returns stdout and stderr together."""
        strict = argv[0] != "pip"
        done = subprocess.run(
            argv, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout, env=self.env(strict)
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"`{shlex.join(argv)}` exited with {done.returncode}:\n{output[-4000:]}"
        if strict:
            noise = re.search(r"Exception ignored|Traceback|\w+Warning", done.stderr)
            assert not noise, f"`{shlex.join(argv)}` printed {noise.group(0)!r}:\n{done.stderr[-4000:]}"
        return output


def install(venv: Venv, argv: list[str], wheel: Path, cwd: Path) -> None:
    """``pip install '.[extra]'`` or ``pip install .``, from the wheel instead of the folder."""
    assert argv[:2] == ["pip", "install"] and argv[2].startswith("."), f"not an install of the clone: {argv}"
    venv.run(["pip", "install", "--disable-pip-version-check", "--quiet", f"{wheel}{argv[2][1:]}"], cwd)


@pytest.fixture
def box_server() -> Iterator[list[RunningServer]]:
    started: list[RunningServer] = []
    yield started
    for server in started:
        server.stop()


def start_box(venv: Venv, argv: list[str], state_dir: Path, started: list[RunningServer]) -> RunningServer:
    assert argv[:2] == ["gpuport", "server"], argv
    loopback = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--data-port", "0"]
    process = subprocess.Popen(
        [*argv, *loopback, "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=venv.env(strict=True, GPUPORT_FAKE_GPUS="1x16GiB", PYTHONUNBUFFERED="1"),
    )
    server = RunningServer(process, state_dir)
    started.append(server)
    assert process.stdout is not None

    def ready() -> bool:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the server exited before it was ready:\n{server.banner}"
        server.output.append(line.rstrip("\n"))
        return line.strip() == "ready"

    wait_for(ready, timeout=READY_TIMEOUT, what="the server's ready line")
    banner = parse_banner(server.banner)
    server.url, server.http_url = banner.grpc_url, banner.http_url
    server.fingerprint, server.admin_token = banner.fingerprint or "", banner.admin_token or ""
    server.drain()
    return server


@pytest.mark.timeout(900)  # two clean venvs filled from PyPI where its cache is empty (CI)
@pytest.mark.parametrize("version", VERSIONS)
def test_the_readme_quick_start_from_the_wheel(
    version: str, dist: Dist, tmp_path: Path, box_server: list[RunningServer]
) -> None:
    python = find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (pyenv install {version}, or put python{version} on PATH)")
    clone = tmp_path / "clone"
    shutil.copytree(dist.source, clone)

    # The GPU machine.
    box = Venv(python, tmp_path / "box", tmp_path / "box-home")
    install_line, server_line = commands("box")
    install(box, install_line, dist.wheel, clone)
    version_line = box.run(["gpuport", "--version"], clone)
    assert version_line.strip() == f"gpuport, version {gpuport.__version__}"
    server = start_box(box, server_line, tmp_path / "state", box_server)

    # The laptop: every $ line of its block, in order.
    laptop = Venv(python, tmp_path / "laptop", tmp_path / "laptop-home")
    cwd, outputs = clone, ""
    for argv in commands("laptop"):
        if argv[:2] == ["pip", "install"]:
            install(laptop, argv, dist.wheel, cwd)
        elif argv[0] == "cd":
            cwd = cwd / argv[1]
        elif argv[:2] == ["gpuport", "login"]:
            argv = [
                server.url if a == "https://gpubox:7600" else server.admin_token if a == "gp_..." else a for a in argv
            ]
            said = laptop.run(argv, cwd, input="y\n")
            assert server.fingerprint in said and "Logged in to" in said, said
        else:
            outputs += laptop.run(argv, cwd)
    assert "16GiB" in outputs  # gpuport gpus: the fake GPU
    assert re.search(r"test accuracy 0\.9\d", outputs) and "succeeded" in outputs, outputs
    (job_outputs,) = (cwd / "gpuport-outputs").iterdir()
    assert (job_outputs / "model" / "weights.npz").is_file() and (job_outputs / "metrics.json").is_file()
    assert not laptop_has(laptop, "numpy")  # the plain client brought no server packages

    # The Python block, as a script of the user's.
    script = tmp_path / "quickstart.py"
    script.write_text(readme_block("python") + "\n")
    said = laptop.run(["python", str(script)], clone)
    assert "(499.5, 999.0)" in said, said

    if python == sys.executable:
        check_extras(box, laptop, server, dist, clone, tmp_path)


def laptop_has(venv: Venv, module: str) -> bool:
    probe = [
        str(venv.folder / "bin" / "python"),
        "-c",
        f"import importlib.util as u; print(bool(u.find_spec({module!r})))",
    ]
    return subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "True"


def check_extras(box: Venv, laptop: Venv, server: RunningServer, dist: Dist, clone: Path, tmp_path: Path) -> None:
    """Errors about a missing package name the extra that brings it, and that extra then suffices:
    `gpuport server` from the laptop's install, and serving ONNX before and after `[onnx]`."""
    done = subprocess.run(["gpuport", "server"], capture_output=True, text=True, env=laptop.env(strict=True), cwd=clone)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "not installed here: pip install 'gpuport[server]'" in done.stderr, done.stderr

    model = tmp_path / "scale.onnx"
    _scale_onnx(model)
    deploy = ["gpuport", "deploy", "scale", str(model)]
    env = laptop.env(strict=True, GPUPORT_URL=server.url, GPUPORT_TOKEN=server.admin_token,
                     GPUPORT_FINGERPRINT=server.fingerprint)  # fmt: skip
    refused = subprocess.run(deploy, capture_output=True, text=True, env=env, cwd=clone, timeout=300)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "onnxruntime, which is not installed where the server runs: pip install 'gpuport[onnx]'" in refused.stderr

    install(box, ["pip", "install", ".[onnx]"], dist.wheel, clone)
    deployed = subprocess.run(deploy, capture_output=True, text=True, env=env, cwd=clone, timeout=300)
    try:
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": x.ravel().tolist()}]}
        reply = server.rest("POST", "/v2/models/scale/infer", token=server.admin_token, json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["data"] == (x * 3).ravel().tolist()
    finally:  # a model's replica outlives the server that stops after this test: it goes first
        subprocess.run(["gpuport", "undeploy", "scale"], capture_output=True, env=env, cwd=clone, timeout=120)


def test_the_wheel_carries_what_the_server_reads_and_metadata_fit_to_publish(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = set(wheel.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(wheel.read(info).decode())
    for needed in (
        "gpuport/protocol/gpuport.proto",
        "gpuport/protocol/gpuport_pb2.py",
        "gpuport/protocol/serving/serving.desc",
        "gpuport/protocol/serving/kserve.proto",
        "gpuport/server/worker/bootstrap/sitecustomize.py",
        "gpuport/server/worker/bootstrap/_gpuport_caps.py",
        "gpuport/server/worker/supervisor.py",
        "gpuport/py.typed",
    ):
        assert needed in names, f"{needed} is not in {dist.wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert metadata["Version"] == gpuport.__version__
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["License-Expression"] == "Apache-2.0"
    classifiers = metadata.get_all("Classifier")
    for version in VERSIONS[:-1]:
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert {u.split(",")[0] for u in metadata.get_all("Project-URL")} >= {"Homepage", "Source", "Issues"}
    with tarfile.open(dist.sdist) as sdist:
        members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
    assert {"LICENSE", "README.md", "pyproject.toml", "examples/quickstart/train.py"} <= members


def test_every_third_party_import_is_declared_by_an_extra() -> None:
    """A module gpuport imports is a base dependency, or the table of gpuport/_packages.py names the
    extra that brings it, and that extra in pyproject.toml lists that distribution."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = re.compile(r"[A-Za-z0-9_.-]+")
    base = {name.match(r).group(0).lower() for r in project["dependencies"]}  # type: ignore[union-attr]
    extras = {
        extra: {name.match(r).group(0).lower() for r in requirements}  # type: ignore[union-attr]
        for extra, requirements in project["optional-dependencies"].items()
    }
    for module, (distribution, extra) in BROUGHT_BY.items():
        assert distribution in extras.get(extra, ()), f"{module}: pyproject's [{extra}] does not list {distribution}"

    base_modules = {"grpc": "grpcio", "google": "protobuf", "click": "click", "rich": "rich",
                    "platformdirs": "platformdirs", "pathspec": "pathspec", "cloudpickle": "cloudpickle"}  # fmt: skip
    assert set(base_modules.values()) == base, "the base dependencies changed: update this test's table"
    # Brought by a listed package (pydantic and starlette by fastapi), or imported only where present (ml_dtypes).
    indirect = {"pydantic", "starlette", "ml_dtypes", "_gpuport_caps"}
    imported = set()
    for path in (ROOT / "gpuport").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.partition(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"gpuport", "__future__"}
    undeclared = third_party - set(base_modules) - set(BROUGHT_BY) - indirect
    assert not undeclared, f"imported but brought by no extra: {sorted(undeclared)}"


def test_the_systemd_unit_runs_the_server_as_a_service(tmp_path: Path) -> None:
    """`--print-systemd-unit`: a unit systemd accepts, whose ExecStart starts this server."""
    printed = subprocess.run(
        [sys.executable, "-m", "gpuport", "server", "--host", "0.0.0.0", "--print-systemd-unit"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    unit = configparser.ConfigParser(interpolation=None, comment_prefixes=("#",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(printed.stdout)
    service = unit["Service"]
    assert service["User"] == "root" and service["StateDirectory"] == "gpuport"  # root: a uid per user's jobs
    assert service["KillMode"] == "process" and service["Restart"] == "on-failure"
    assert service["Delegate"] == "yes"  # cgroup v2: a group per job, below the unit's (server/cgroups.py)
    assert shlex.split(service["ExecStart"]) == [
        os.path.abspath(sys.executable), "-m", "gpuport", "server", "--host", "0.0.0.0", "--port", "7600",
        "--http-port", "7601", "--state-dir", "/var/lib/gpuport/state",
    ]  # fmt: skip
    assert unit["Install"]["WantedBy"] == "multi-user.target"

    # With other options: they go into ExecStart, which starts a working server.
    state_dir = tmp_path / "state"
    options = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--http-port",
        "0",
        "--data-port",
        "0",
        "--state-dir",
        str(state_dir),
    ]
    printed = subprocess.run(
        [sys.executable, "-m", "gpuport", "server", *options, "--print-systemd-unit"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    unit_file = tmp_path / "gpuport.service"
    unit_file.write_text(printed.stdout)
    unit = configparser.ConfigParser(interpolation=None, comment_prefixes=("#",))
    unit.read_string(printed.stdout)
    assert "statedirectory" not in unit["Service"]  # a state dir outside /var/lib is the admin's to make
    if shutil.which("systemd-analyze"):
        verified = subprocess.run(["systemd-analyze", "verify", str(unit_file)], capture_output=True, text=True)
        assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr
    exec_start = shlex.split(unit["Service"]["execstart"])
    process = subprocess.Popen(exec_start, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    server = RunningServer(process, state_dir)
    try:
        assert process.stdout is not None
        wait_for(lambda: process.stdout.readline().strip() == "ready", timeout=READY_TIMEOUT, what="ready")  # type: ignore[union-attr]
    finally:
        assert server.stop() == 0


def test_a_package_installed_but_broken_is_not_sent_back_to_the_same_install() -> None:
    broken = ImportError("libgfortran.so.5: cannot open shared object file", name="numpy.linalg")
    message = missing_package(broken, "serving")
    assert message.startswith("serving needs numpy, which is installed here but does not import: libgfortran")
    assert "pip install --force-reinstall numpy" in message and "gpuport[" not in message
