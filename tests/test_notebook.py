"""Notebooks: real .ipynb files executed by nbclient on an ipykernel, whose ``%%gpuport`` cells run in a
session on a real server: variables stay there between cells and across a kernel restart, printed
output arrives in the cell, a remote exception shows its remote traceback, and values move both ways
with ``%gpuport_pull`` / ``%gpuport_push``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gpuport
from tests.conftest import RunningServer

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def _run(tmp_path: Path, name: str, cells: list[str]) -> Any:
    """Execute a notebook of ``cells`` (saved as ``name`` beside it) in a fresh kernel; the executed notebook."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    path = tmp_path / name
    nbformat.write(notebook, path)
    client = nbclient.NotebookClient(
        notebook, timeout=180, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    nbformat.write(notebook, path)  # with its outputs: an artifact to open when a test fails
    return notebook


def _text(cell: Any, kind: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == kind)


def _result(cell: Any) -> str:
    (found,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    return str(found.data["text/plain"])


@pytest.fixture
def kernel_env(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels inherit this process's environment: the server to reach, as GPUPORT_* says it."""
    monkeypatch.setenv("GPUPORT_URL", server.url)
    monkeypatch.setenv("GPUPORT_TOKEN", server.admin_token)
    monkeypatch.setenv("GPUPORT_FINGERPRINT", server.fingerprint)
    monkeypatch.setenv("JPY_SESSION_NAME", str(Path("/home/me/analysis 1.ipynb")))


def test_cells_run_in_a_session_and_keep_their_variables(
    server: RunningServer, admin: gpuport.Client, kernel_env: None, tmp_path: Path
) -> None:
    first = _run(
        tmp_path,
        "first.ipynb",
        [
            "%load_ext gpuport",
            "%%gpuport --cpus 0.5\nimport os, time\nx = 21\nprint('step 1', flush=True)\ntime.sleep(0.3)\n"
            "print('step 2')\nx * 2",
            "print('x' in globals())",  # a local cell: x lives on the server
            "%gpuport_pull x\nprint(x + 1)",
            "y = 100\n%gpuport_push y",
            "%%gpuport\nx + y",
            "%%gpuport\ndef f():\n    return 1 / 0\nf()",
            "%%gpuport --bogus 3\n1",
        ],
    )
    cells = first.cells
    assert _text(cells[1]) == "step 1\nstep 2\n" and _result(cells[1]) == "42"
    assert _text(cells[2]) == "False\n"
    assert _text(cells[3]) == "22\n"
    assert _result(cells[5]) == "121"
    (error,) = [o for o in cells[6].outputs if o.output_type == "error"]
    trace = "\n".join(error.traceback)
    assert error.ename == "CellFailed" and "ZeroDivisionError: division by zero" in trace
    assert '<gpuport cell 3>", line 2, in f' in trace and "_notebook.py" not in trace
    (bad,) = [o for o in cells[7].outputs if o.output_type == "error"]
    assert bad.evalue == (
        "%%gpuport: unrecognized arguments: --bogus 3 — its options: --session NAME, --gpus N, --gpu-memory SIZE, "
        "--cpus N, --memory SIZE, --requirements FILE, --profile NAME"
    )

    # The session is named after the notebook, and outlives the kernel.
    (session,) = [s for s in admin.sessions() if s.name == "notebook-analysis-1"]
    assert session.state == "running"

    # A restarted kernel (a new one here) finds the session, its variables intact; then closes it.
    second = _run(tmp_path, "second.ipynb", ["%load_ext gpuport", "%%gpuport\n(x, y)", "%gpuport_close"])
    assert _result(second.cells[1]) == "(21, 100)"
    assert not [s for s in admin.sessions() if s.name == "notebook-analysis-1" and s.state != "ended"]


def test_a_result_that_cannot_come_back_shows_as_its_repr(
    server: RunningServer, admin: gpuport.Client, kernel_env: None, tmp_path: Path
) -> None:
    ran = _run(
        tmp_path,
        "lock.ipynb",
        ["%load_ext gpuport", "%%gpuport --session nb-lock\nimport threading\nthreading.Lock()", "%gpuport_close"],
    )
    assert _result(ran.cells[1]).startswith("<unlocked _thread.lock object")


def test_pull_and_push_take_the_session_to_use(
    server: RunningServer, admin: gpuport.Client, kernel_env: None, tmp_path: Path
) -> None:
    ran = _run(
        tmp_path,
        "two.ipynb",
        [
            "%load_ext gpuport",
            "%%gpuport --session nb-other --cpus 0.25\nz = 5",
            "%%gpuport --session nb-main --cpus 0.25\nz = 1",
            "%gpuport_pull --session nb-other z\nprint(z)",
            "w = 7\n%gpuport_push --session nb-other w",
            "%%gpuport\n('w' in globals(), z)",  # still nb-main: --session on a pull or push does not switch
            "%%gpuport --session nb-other\nz + w",
            "%gpuport_pull --bogus z",
            "%gpuport_push --session nb-other nowhere",
            "%gpuport_close nb-other\n%gpuport_close nb-main",
        ],
    )
    cells = ran.cells
    assert _text(cells[3]) == "5\n"
    assert _result(cells[5]) == "(False, 1)"
    assert _result(cells[6]) == "12"
    (bad,) = [o for o in cells[7].outputs if o.output_type == "error"]
    assert bad.evalue == (
        "%gpuport_pull: unrecognized arguments: --bogus — its options: --session NAME, --profile NAME, "
        "then the variables' names"
    )
    (missing,) = [o for o in cells[8].outputs if o.output_type == "error"]
    assert missing.evalue == "%gpuport_push nowhere: no variable 'nowhere' here"
    assert not [o for o in cells[9].outputs if o.output_type == "error"]
    assert not [s for s in admin.sessions() if s.name in ("nb-other", "nb-main") and s.state != "ended"]
