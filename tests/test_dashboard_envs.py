"""The dashboard's environments panel (issue 34, point 4) in Chromium: an environment built for a job's
requirements shows its hash, Python, packages (on hover, and listed once its row is clicked), size,
last use and the jobs running in it now, to an admin and to an ordinary user alike."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CHROMIUM, RunningServer, server_env, start_server
from tests.test_dashboard import _log_in, _shot
from tests.test_environments import INDEX, UV, _absent, _wheel

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed: apt-get install chromium"),
    pytest.mark.skipif(not Path(UV).exists(), reason="uv is not installed (gpuport[server] brings it)"),
]
# Waits on the page for what a build and a job take.
SLOW_MS = 120_000


@pytest.fixture
def envs_dash_server(tmp_path: Path) -> Iterator[RunningServer]:
    _absent()
    running = start_server(tmp_path / "state", env=server_env(GPUPORT_FAKE_GPUS="2x16GiB", UV_INDEX_URL=INDEX))
    yield running
    running.stop()


def test_environments_panel(envs_dash_server: RunningServer, browser: Any, tmp_path: Path) -> None:
    server = envs_dash_server
    own = f"gp_dash_{uuid.uuid4().hex[:8]}"
    project = tmp_path / "project"  # beside the server's state folder, not around it
    _wheel(project / "wheels", own, "0.1")
    (project / "requirements.txt").write_text(
        f"--find-links ./wheels\ntabulate==0.10.0\n{own.replace('_', '-')}==0.1\n"
    )
    with server.connect() as admin:
        erin = admin.create_token("erin").token

    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, erin)
    sync_api.expect(page.locator("#board")).to_be_visible()
    sync_api.expect(page.locator("#environments")).to_contain_text("none")  # nothing built yet

    with server.connect(erin) as gpu:
        code = f"import tabulate, {own}, time; print('in it', flush=True); time.sleep(120)"
        job = gpu.submit(["python", "-c", code], project, requirements="auto")
        try:
            env_row = page.locator("#environments tr[data-env]")
            sync_api.expect(env_row).to_have_count(1, timeout=SLOW_MS)
            envs = gpu.environments()
            assert len(envs) == 1, envs
            env = envs[0]
            # hash (short), Python, packages, size, last used, jobs now: the job runs in it
            sync_api.expect(env_row).to_contain_text(env["hash"][:12])
            sync_api.expect(env_row).to_contain_text(f"Python {env['python_version']}")
            sync_api.expect(env_row).to_contain_text("2 packages")
            sync_api.expect(env_row).to_contain_text("tabulate")
            sync_api.expect(env_row).to_contain_text(" ago")
            sync_api.expect(env_row.locator("td").nth(6)).to_have_text("1", timeout=SLOW_MS)
            title = env_row.get_attribute("title") or ""
            assert "tabulate==0.10.0" in title and f"{own.replace('_', '-')}==0.1" in title, title
            env_row.click()  # its packages, listed under it
            sync_api.expect(page.locator("#environments tr.packages")).to_contain_text("tabulate==0.10.0")
            _shot(page, "envs-1-running")
        finally:
            job.cancel()
        job.wait(timeout=60)
        # the job ended: none runs in it now, one ran in it in all; the packages stay listed
        sync_api.expect(env_row.locator("td").nth(6)).to_have_text("0", timeout=30_000)
        sync_api.expect(env_row.locator("td").nth(7)).to_have_text("1")
        sync_api.expect(page.locator("#environments tr.packages")).to_contain_text("tabulate==0.10.0")

    # An admin sees the same environment.
    admin_page = browser.new_context(ignore_https_errors=True).new_page()
    _log_in(admin_page, server, server.admin_token)
    sync_api.expect(admin_page.locator("#environments tr[data-env]")).to_contain_text(env["hash"][:12])
    _shot(admin_page, "envs-2-admin")
