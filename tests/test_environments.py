"""Per-project Python environments (issue 34): a job runs with what its project declares, built once on
the server with uv from the index this machine is configured for, shared read-only."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuport
from gpuport.server.environments import interpreters
from tests.conftest import RunningServer, needs_users, server_env, start_server

UV = str(Path(sys.executable).parent / "uv")
# Small pure-Python packages of this machine's index that the server's environment lacks.
ABSENT = ("tomli-w", "toolz", "tabulate")
# The index as files on this machine's disk: builds need no network at all.
INDEX = "file:///opt/pypi/simple"

pytestmark = pytest.mark.skipif(not Path(UV).exists(), reason="uv is not installed (gpuport[server] brings it)")


def _absent() -> None:
    for name in ABSENT:
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(name)
    if not Path(INDEX.removeprefix("file://"), "tomli-w").is_dir():
        pytest.skip(f"this machine has no package index at {INDEX}")


@pytest.fixture(scope="module")
def envs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    _absent()
    state = tmp_path_factory.mktemp("envs") / "gpuport"
    running = start_server(state, env=server_env(GPUPORT_FAKE_GPUS="2x16GiB", UV_INDEX_URL=INDEX))
    yield running
    running.stop()


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel of a one-module package made here, with nothing to download."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _log(job: gpuport.Job) -> str:
    return "\n".join(job.logs())


_PRINT = "import importlib.metadata as m, sys; print(sys.prefix); " + "; ".join(
    f"print({n!r}, m.version({n!r}))" for n in ("tomli-w", "toolz")
)


def test_requirements_txt_runs_in_its_environment_built_once_for_two_users(
    envs_server: RunningServer, tmp_path: Path
) -> None:
    """The same requirements from two users build one environment; the second job reuses it."""
    needs_users()
    mark = uuid.uuid4().hex[:8]
    (tmp_path / "requirements.txt").write_text(f"tomli-w==1.2.0\ntoolz\n# {mark}\n")
    with envs_server.connect() as admin:
        tokens = [admin.create_token(f"envs-{mark}-{i}").token for i in range(2)]
    jobs = []
    for token in tokens:
        with envs_server.connect(token) as gpu:
            job = gpu.submit(["python", "-c", _PRINT], tmp_path, requirements="auto")
            jobs.append(job.wait(timeout=300))
            log = _log(job)
            assert job.info.state == "succeeded", log
            assert "tomli-w 1.2.0" in log and "toolz 1.1.0" in log
            assert job.info.environment and job.info.environment in log
    assert jobs[0].info.environment == jobs[1].info.environment
    first, second = (_log(envs_server.connect(t).job(j.id)) for t, j in zip(tokens, jobs, strict=True))
    assert "building environment" in first and "(2 packages" in first
    assert "building environment" not in second


def test_pyproject_group_and_lock_and_own_wheel(envs_server: RunningServer, tmp_path: Path) -> None:
    """pyproject.toml's dependencies and a named group; a uv.lock; a wheel of the project's own, found
    through --find-links in its requirements."""
    project = tmp_path / "p"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "0.1"\nrequires-python = ">=3.9"\ndependencies = ["tomli-w"]\n'
        '[dependency-groups]\nextra = ["toolz"]\n'
    )
    with envs_server.connect() as gpu:
        job = gpu.submit(["python", "-c", _PRINT], project, requirements="auto", groups=["extra"]).wait(timeout=300)
        assert job.info.state == "succeeded", _log(gpu.job(job.id))
        subprocess.run([UV, "lock", "-q"], cwd=project, check=True, env={**server_env(), "UV_INDEX_URL": INDEX})
        (project / "pyproject.toml").write_text((project / "pyproject.toml").read_text() + "# locked\n")
        locked = gpu.submit(["python", "-c", _PRINT], project, requirements="uv.lock", groups=["extra"])
        assert locked.wait(timeout=300).info.state == "succeeded", _log(locked)
        assert "tomli-w 1.2.0" in _log(locked) and "toolz 1.1.0" in _log(locked)
        own = tmp_path / "own"
        _wheel(own / "wheels", "gpuport_test_pkg", "0.3")
        (own / "requirements.txt").write_text("--find-links ./wheels\ngpuport-test-pkg==0.3\n")
        code = "import gpuport_test_pkg; print('own', gpuport_test_pkg.VERSION)"
        ran = gpu.submit(["python", "-c", code], own, requirements="auto").wait(timeout=300)
        assert ran.info.state == "succeeded", _log(gpu.job(ran.id))
        assert "own 0.3" in _log(gpu.job(ran.id))


def test_bad_requirement_fails_with_uvs_words(envs_server: RunningServer, tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("no-such-package-gpuport-test==1.0\n")
    with envs_server.connect() as gpu:
        job = gpu.submit(["python", "-c", "print('ran')"], tmp_path, requirements="auto").wait(timeout=300)
        log = _log(gpu.job(job.id))
    assert job.info.state == "failed"
    assert "could not be built" in job.info.message and "no-such-package-gpuport-test" in job.info.message
    assert "no-such-package-gpuport-test" in log and "ran" not in log
    assert not job.info.environment


def test_pinned_version_shadows_the_servers(envs_server: RunningServer, tmp_path: Path) -> None:
    """A version the project pins wins over the server's; the server's other packages stay importable."""
    have = importlib.metadata.version("fsspec")
    assert have != "2026.6.0"
    (tmp_path / "requirements.txt").write_text("fsspec==2026.6.0\n")
    code = "import fsspec, numpy; print('fsspec', fsspec.__version__)"
    with envs_server.connect() as gpu:
        job = gpu.submit(["python", "-c", code], tmp_path, requirements="auto").wait(timeout=300)
        log = _log(gpu.job(job.id))
        assert job.info.state == "succeeded", log
        assert "fsspec 2026.6.0" in log
        bare = gpu.submit(["python", "-c", code], tmp_path).wait(timeout=120)
        assert f"fsspec {have}" in _log(gpu.job(bare.id))


def test_a_changed_included_requirements_file_is_another_environment(
    envs_server: RunningServer, tmp_path: Path
) -> None:
    """``-r`` names a file whose lines count as the including file's: changing it builds anew."""
    (tmp_path / "requirements.txt").write_text("-r pins/common.txt\n")
    (tmp_path / "pins").mkdir()
    code = "import tabulate; print('tabulate', tabulate.__version__)"
    seen = {}
    with envs_server.connect() as gpu:
        for version in ("0.8.10", "0.10.0"):
            (tmp_path / "pins" / "common.txt").write_text(f"tabulate=={version}\nhumanize\n")  # no other test's set
            job = gpu.submit(["python", "-c", code], tmp_path, requirements="auto").wait(timeout=300)
            log = _log(gpu.job(job.id))
            assert job.info.state == "succeeded", log
            assert f"tabulate {version}" in log
            seen[version] = job.info.environment
    assert seen["0.8.10"] != seen["0.10.0"]


def test_isolated_env_has_only_what_the_project_names(envs_server: RunningServer, tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("six\n")
    code = "import six; import importlib.util as u; print('numpy' if u.find_spec('numpy') else 'no numpy')"
    with envs_server.connect() as gpu:
        job = gpu.submit(["python", "-c", code], tmp_path, requirements="auto", isolated_env=True).wait(timeout=300)
        log = _log(gpu.job(job.id))
    assert job.info.state == "succeeded", log
    assert "no numpy" in log


def test_another_users_job_cannot_write_the_environment(envs_server: RunningServer, tmp_path: Path) -> None:
    needs_users()
    (tmp_path / "requirements.txt").write_text("tabulate==0.8.10\n")
    code = (
        "import tabulate, os, pathlib; p = pathlib.Path(tabulate.__file__)\n"
        "for target in (p, p.parent / 'new.py'):\n"
        "    try:\n"
        "        open(target, 'a').write('x = 1')\n"
        "        print('WROTE', target)\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
    )
    with envs_server.connect() as admin:
        tokens = [admin.create_token(f"writer-{uuid.uuid4().hex[:8]}").token for _ in range(2)]
    for token in tokens:
        with envs_server.connect(token) as gpu:
            job = gpu.submit(["python", "-c", code], tmp_path, requirements="auto").wait(timeout=300)
            log = _log(gpu.job(job.id))
            assert job.info.state == "succeeded", log
            assert "WROTE" not in log and log.count("refused") == 2


def test_environment_survives_a_restart(tmp_path: Path) -> None:
    _absent()
    state = tmp_path / "gpuport"
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "requirements.txt").write_text("toolz==1.1.0\n")
    env = server_env(GPUPORT_FAKE_GPUS="2x16GiB", UV_INDEX_URL=INDEX)
    hashes, token = [], ""
    for _ in range(2):
        running = start_server(state, env=env)
        token = token or running.admin_token
        try:
            with running.connect(token) as gpu:
                job = gpu.submit(["python", "-c", "import toolz"], tmp_path / "w", requirements="auto")
                assert job.wait(timeout=300).info.state == "succeeded", _log(job)
                hashes.append((job.info.environment, "building environment" in _log(job)))
        finally:
            running.stop()
    assert hashes[0][0] == hashes[1][0] and hashes[0][1] and not hashes[1][1]


def test_requirements_as_text_over_rest(envs_server: RunningServer, tmp_path: Path) -> None:
    with envs_server.connect() as gpu:
        snapshot = gpu.submit(["true"], tmp_path).info.id  # any job: its workdir's snapshot is reused below
        record = gpu.job(snapshot)
    body = {"command": ["python", "-c", "import toolz; print('toolz here')"], "requirements": "toolz\n"}
    reply = envs_server.rest("POST", "/v1/jobs", envs_server.admin_token, json=body)
    assert reply.status_code in (200, 201), reply.text
    job_id = reply.json()["job_id"]
    with envs_server.connect() as gpu:
        job = gpu.job(job_id).wait(timeout=300)
        assert job.info.state == "succeeded", _log(gpu.job(job_id))
        assert job.info.environment
    assert record.info.state


def test_python_version_the_box_lacks_is_a_clear_error(envs_server: RunningServer, tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("six\n")
    with (
        envs_server.connect() as gpu,
        pytest.raises(gpuport.InvalidRequest, match=r"Python 3\.2 is not on this server"),
    ):
        gpu.submit(["true"], tmp_path, requirements="auto", python="3.2")


def test_scripts_run_from_the_built_environment_and_another_python(envs_server: RunningServer, tmp_path: Path) -> None:
    """A package's console script runs from the environment once it has its hash's name, on the
    environment's interpreter (uv wrote it for the one that installed it, the server rewrote its first
    lines); a build over another interpreter of the box runs on that one.
    (Isolated: the layered environment of these pins is test_cli_envs_lists_and_prune_removes's.)"""
    mark = uuid.uuid4().hex[:8]
    (tmp_path / "requirements.txt").write_text(f"tabulate==0.10.0\n# {mark}\n")
    script = ["sh", "-c", 'command -v tabulate; printf "a b\\n1 2\\n" | tabulate -1']
    code = "import sys, tabulate; print('on', sys.version.split()[0], sys.prefix)"
    with envs_server.connect() as gpu:
        job = gpu.submit(script, tmp_path, requirements="auto", isolated_env=True).wait(timeout=300)
        log = _log(gpu.job(job.id))
        assert job.info.state == "succeeded", log
        assert f"/{job.info.environment}/bin/tabulate" in log and "-  -" in log
        others = [v for v, path in interpreters().items() if path != sys.executable]
        if not others:
            # The console script's half above has run; the build over another interpreter needs one.
            pytest.skip(
                "no Python but the server's found (`uv python list`): the build over a second interpreter "
                "needs one, e.g. Debian's python3 (apt-get install python3)"
            )
        other = gpu.submit(["python", "-c", code], tmp_path, requirements="auto", python=others[0]).wait(timeout=300)
        log = _log(gpu.job(other.id))
        assert other.info.state == "succeeded", log
        assert f"on {others[0]} " in log and f"/{other.info.environment}" in log


def test_cli_envs_lists_and_prune_removes(envs_server: RunningServer, tmp_path: Path, cli: Any) -> None:
    (tmp_path / "requirements.txt").write_text("tabulate==0.10.0\n")
    with envs_server.connect() as gpu:
        job = gpu.submit(["python", "-c", "import tabulate"], tmp_path, requirements="auto").wait(timeout=300)
        assert job.info.state == "succeeded", _log(gpu.job(job.id))
        name = job.info.environment
        listed = {e["hash"]: e for e in gpu.environments()}
        assert listed[name]["jobs"] == 1 and "tabulate==0.10.0" in listed[name]["packages"]
    env = {"GPUPORT_URL": envs_server.url, "GPUPORT_TOKEN": envs_server.admin_token}
    env["GPUPORT_FINGERPRINT"] = envs_server.fingerprint
    shown = cli("envs", **env)
    assert shown.code == 0 and name in shown.stdout and "tabulate==0.10.0" in shown.stdout, shown.output
    pruned = cli("envs", "prune", **env)
    assert pruned.code == 0 and f"removed {name}" in pruned.stdout, pruned.output + envs_server.banner[-3000:]
    with envs_server.connect() as gpu:
        assert name not in {e["hash"] for e in gpu.environments()}
        again = gpu.submit(["python", "-c", "import tabulate"], tmp_path, requirements="auto").wait(timeout=300)
        assert again.info.state == "succeeded" and "building environment" in _log(gpu.job(again.id))


def test_session_and_function_with_requirements(envs_server: RunningServer, tmp_path: Path) -> None:
    """A session's worker, and a function's, import what their requirements name and the server lacks."""

    def versions() -> tuple[str, str]:
        import importlib.metadata

        import tomli_w

        return importlib.metadata.version("tomli-w"), tomli_w.dumps({"a": 1})

    (tmp_path / "requirements.txt").write_text("toolz==1.1.0\ntomli-w==1.2.0\n")
    with envs_server.connect() as gpu:
        with gpu.session(requirements=["tomli-w==1.2.0"]) as session:
            assert session.call(versions) == ("1.2.0", "a = 1\n")
            assert gpu.job(session.info().job_id).info.environment
        remote = gpu.function(requirements=tmp_path / "requirements.txt")(versions)
        assert remote() == ("1.2.0", "a = 1\n")
        # No requirements: the server's own environment, without tomli-w.
        with gpu.session() as bare, pytest.raises(ModuleNotFoundError):
            bare.call(versions)


def test_deployment_with_requirements(envs_server: RunningServer, tmp_path: Path, cli: Any) -> None:
    """A model whose class imports a package the server lacks, deployed with requirements (CLI too)."""

    class Toml:  # defined here: pickled by value, as a user's class is
        inputs = (("x", "FP32", (-1,)),)
        outputs = (("y", "FP32", (-1,)),)

        def load(self) -> None:
            import tomli_w

            self.factor = len(tomli_w.dumps({"a": 1}))  # "a = 1\n": 6

        def predict(self, batch: dict[str, Any]) -> dict[str, Any]:
            return {"y": batch["x"] * self.factor}

    import cloudpickle

    (tmp_path / "model.pkl").write_bytes(cloudpickle.dumps(Toml()))
    (tmp_path / "requirements.txt").write_text("tomli-w==1.2.0\n")
    body = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    with envs_server.connect() as gpu:
        with pytest.raises(gpuport.ServerError, match="tomli_w"):
            gpu.deploy("toml-bare", tmp_path / "model.pkl", timeout=120)
        info = gpu.deploy("toml-api", tmp_path / "model.pkl", requirements="tomli-w==1.2.0", timeout=300)
        assert info.state == "ready"
    env = {"GPUPORT_URL": envs_server.url, "GPUPORT_TOKEN": envs_server.admin_token}
    env["GPUPORT_FINGERPRINT"] = envs_server.fingerprint
    shown = cli(
        "deploy", "toml-cli", str(tmp_path / "model.pkl"), "--requirements", str(tmp_path / "requirements.txt"), **env
    )
    assert shown.code == 0, shown.output
    for name in ("toml-api", "toml-cli"):
        reply = envs_server.rest("POST", f"/v2/models/{name}/infer", envs_server.admin_token, json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["data"] == [6.0, 12.0]


def test_run_env_of_reruns_in_the_same_environment(envs_server: RunningServer, tmp_path: Path, cli: Any) -> None:
    """`gpuport run --env-of JOB` runs in JOB's environment, with nothing to resolve, from a folder with no
    requirements; `gpuport jobs --json` lists its hash; a job without one, or a hash unknown, is an error."""
    mark = uuid.uuid4().hex[:8]
    (tmp_path / "requirements.txt").write_text(f"tomli-w==1.2.0\n# {mark}\n")
    with envs_server.connect() as gpu:
        first = gpu.submit(["python", "-c", "import tomli_w"], tmp_path, requirements="auto")
        assert first.wait(timeout=300).info.state == "succeeded", _log(first)
        (tmp_path / "none").mkdir()
        bare = gpu.submit(["true"], tmp_path / "none").wait(timeout=60)
    env = {"GPUPORT_URL": envs_server.url, "GPUPORT_TOKEN": envs_server.admin_token}
    env["GPUPORT_FINGERPRINT"] = envs_server.fingerprint
    code = "import importlib.metadata as m; print('tomli-w', m.version('tomli-w'))"
    again = cli("run", "--env-of", first.id, "--", "python", "-c", code, **env)
    assert again.code == 0 and "tomli-w 1.2.0" in again.stdout, again.output
    assert "resolving" not in again.output and "building environment" not in again.output
    listed = cli("jobs", "--json", **env)
    assert listed.code == 0, listed.output
    hashes = [j["environment"] for j in json.loads(listed.stdout) if j["command"][-1] == code]
    assert hashes == [first.info.environment]
    with envs_server.connect() as gpu:
        by_hash = gpu.submit(["python", "-c", code], tmp_path / "none", env_of=first.info.environment)
        assert by_hash.wait(timeout=120).info.environment == first.info.environment
        with pytest.raises(gpuport.InvalidRequest, match="server's own environment"):
            gpu.submit(["true"], tmp_path / "none", env_of=bare.id)
        with pytest.raises(gpuport.NotFound, match="not on this server"):
            gpu.submit(["true"], tmp_path / "none", env_of="0123456789abcdef")
    refused = cli("run", "--env-of", first.id, "--requirements", "r.txt", "--", "true", **env)
    assert refused.code != 0 and "--env-of" in refused.output


def test_run_shows_a_build_as_a_status_line_on_a_terminal(
    envs_server: RunningServer, cli: Any, stdio: str, tmp_path: Path
) -> None:
    """`gpuport run` on a terminal: "building environment (2 packages)…" with its time while the
    environment builds, in place of uv's lines, then the job's output. Piped: the log as it is."""
    own = f"gp_cli_{uuid.uuid4().hex[:8]}"  # a package of its own: an environment never built before
    project = tmp_path / "p"
    _wheel(project / "wheels", own, "0.1")
    (project / "requirements.txt").write_text(
        f"--find-links ./wheels\ntabulate==0.10.0\n{own.replace('_', '-')}==0.1\n"
    )
    login = cli("login", envs_server.url, "--token", envs_server.admin_token, "--fingerprint", envs_server.fingerprint)
    assert login.code == 0, login.output
    done = cli("run", "python", "-c", f"import {own}; print('job says hi')", cwd=project, stdio=stdio)
    assert done.code == 0, done.output
    assert "job says hi" in done.stdout
    if stdio == "terminal":
        assert "building environment (2 packages)…" in done.raw
        assert re.search(r"building environment \(2 packages\)… \S*0:00:\d\d", done.stdout), done.raw
        # the build's lines, uv's among them: under the status line
        assert "gpuport: building environment" not in done.stdout and "Installed 2 packages" not in done.stdout
        assert "built in" in done.stdout and done.stdout.index("built in") < done.stdout.index("job says hi")
    else:
        assert "gpuport: building environment" in done.stdout and "(2 packages: " in done.stdout
        assert "Installed 2 packages" in done.stdout
        assert "building environment (2 packages)…" not in done.output


def test_run_on_a_terminal_shows_a_failed_builds_words(envs_server: RunningServer, cli: Any, tmp_path: Path) -> None:
    """A build that fails under the status line: its lines (uv's error) are shown after all."""
    (tmp_path / "requirements.txt").write_text("no-such-package-gpuport-test==1.0\n")
    login = cli("login", envs_server.url, "--token", envs_server.admin_token, "--fingerprint", envs_server.fingerprint)
    assert login.code == 0, login.output
    done = cli("run", "python", "-c", "print('ran')", cwd=tmp_path, stdio="terminal")
    assert done.code != 0, done.output
    assert "resolving requirements.txt…" in done.raw
    assert (
        "gpuport: resolving requirements.txt with uv" in done.stdout and "no-such-package-gpuport-test" in done.stdout
    )
    assert "ran\n" not in done.stdout
