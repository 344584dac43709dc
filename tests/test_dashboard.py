"""The web dashboard in a real browser: Debian's Chromium, headless, driven by Playwright (no browser
download), against a real server over TLS. A user logs in, sees the GPUs, follows a running job's
log as its lines arrive, cancels it and sees it end; a model's counters move under load; a wrong
token is refused; another user's job is not there; a job printing markup shows text; a request
without the CSRF token changes nothing; the page fits a phone. A one-time link (gpuport dashboard)
logs in once; a Keras-like log reads as on a terminal; the jobs table filters and pages; a job's
outputs download from its page; the GPUs' history survives a restart. Screenshots go to
``test-artifacts/dashboard/`` (or ``$GPUPORT_TEST_ARTIFACTS``)."""

from __future__ import annotations

import os
import re
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CHROMIUM, RunningServer, start_server, wait_for
from tests.test_serving_errors import _doubler_file

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="chromium is not installed: apt-get install chromium (make test does, as root)"
)
ARTIFACTS = (
    Path(os.environ.get("GPUPORT_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts")) / "dashboard"
)
PRINTER = "import time\nfor i in range(600):\n    print('line', i, flush=True)\n    time.sleep(0.1)\n"
MARKUP = "print('<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">')"


@pytest.fixture
def dash_server(tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(tmp_path / "state")
    yield running
    running.stop()


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _log_in(page: Any, server: RunningServer, token: str) -> None:
    page.goto(server.http_url + "/")
    page.fill("#token", token)
    page.click("#login button[type=submit]")


def test_follow_a_job_cancel_it_and_watch_a_model(dash_server: RunningServer, browser: Any, tmp_path: Path) -> None:
    server = dash_server
    with server.connect() as admin:
        alice = admin.create_token("alice").token
        bob = admin.create_token("bob").token
        admin.deploy("doubler", _doubler_file(tmp_path), max_queue_delay=0.001)
    with server.connect(bob) as gpu:
        bobs = gpu.submit(["python", "-c", "print('bob')"], workdir=None)
    with server.connect(alice) as gpu:
        job = gpu.submit(["python", "-c", PRINTER], workdir=None)
        markup = gpu.submit(["python", "-c", MARKUP], workdir=None)
        markup.wait(timeout=60)

    context = browser.new_context(ignore_https_errors=True)  # the server's own certificate, not a CA's
    page = context.new_page()
    _log_in(page, server, "gp_not-a-token")
    sync_api.expect(page.locator("#login-error")).to_contain_text("not known to this server")
    _log_in(page, server, alice)
    sync_api.expect(page.locator("#board")).to_be_visible()
    sync_api.expect(page.locator("#who")).to_have_text("alice")
    sync_api.expect(page.locator("#gpus .card")).to_have_count(2)
    sync_api.expect(page.locator("#jobs")).to_contain_text(job.id)
    assert bobs.id not in page.locator("#jobs").inner_text()  # another user's job is not there
    cookie = next(c for c in context.cookies() if c["name"] == "gpuport_login")
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # the page's script cannot read it
    _shot(page, "1-board")

    # The log follows the running job: lines arrive while we watch.
    page.locator("#jobs tr", has_text=job.id).click()
    sync_api.expect(page.locator("#log-state")).to_have_text("running", timeout=30_000)
    sync_api.expect(page.locator("#log")).to_contain_text("line 3", timeout=30_000)
    seen = page.locator("#log").inner_text().count("line")
    sync_api.expect(page.locator("#log")).to_contain_text(f"line {seen + 5}", timeout=30_000)
    _shot(page, "2-log")
    page.click("#log-cancel")
    sync_api.expect(page.locator("#log-state")).to_have_text("cancelled", timeout=30_000)
    sync_api.expect(page.locator("#jobs tr", has_text=job.id)).to_contain_text("cancelled", timeout=10_000)
    _shot(page, "3-cancelled")

    # A job printing markup shows it as text.
    page.locator("#jobs tr", has_text=markup.id).click()
    sync_api.expect(page.locator("#log")).to_contain_text("<script>window.pwned = 1</script>", timeout=30_000)
    assert page.evaluate("window.pwned") is None

    # A model's counters move under load.
    x = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 8}]}
    for _ in range(20):
        assert server.rest("POST", "/v2/models/doubler/infer", alice, json=x).status_code == 200
    sync_api.expect(page.locator("#models tr", has_text="doubler")).to_contain_text("20", timeout=15_000)
    _shot(page, "4-model")

    # Without the CSRF header, the login cookie alone changes nothing.
    with server.connect(alice) as gpu:
        other = gpu.submit(["python", "-c", "import time; time.sleep(60)"], workdir=None)
        refused = context.request.post(f"{server.http_url}/ui/jobs/{other.id}/cancel")
        assert refused.status == 403 and "CSRF" in refused.text()
        assert gpu.job(other.id).status in ("queued", "running")
        other.cancel()

    # A phone-sized screen: nothing wider than it.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    _shot(page, "5-phone")

    page.click("#logout")
    sync_api.expect(page.locator("#login")).to_be_visible()
    assert context.request.get(f"{server.http_url}/ui/me").status == 401
    context.close()
    with server.connect() as admin:
        admin.undeploy("doubler")  # its replica would outlive the server, as a job does


def test_a_revoked_token_ends_its_dashboard(dash_server: RunningServer, browser: Any) -> None:
    server = dash_server
    with server.connect() as admin:
        carol = admin.create_token("carol").token
        context = browser.new_context(ignore_https_errors=True)
        page = context.new_page()
        _log_in(page, server, carol)
        sync_api.expect(page.locator("#board")).to_be_visible()
        admin.revoke_token("carol")
        sync_api.expect(page.locator("#login-error")).to_contain_text("revoked", timeout=30_000)
        assert context.request.get(f"{server.http_url}/ui/state").status == 401
        context.close()


def test_a_revoked_login_says_so_to_every_request_after(dash_server: RunningServer) -> None:
    """The request that finds a login revoked is often not the one whose answer the page shows (its
    event stream reconnecting, then asking who it is): each one after it says why, not just
    'not logged in'."""
    server = dash_server
    with server.connect() as admin:
        erin = admin.create_token("erin").token
        login = server.rest("POST", "/ui/login", json={"token": erin})
        assert login.status_code == 200
        cookie = {"cookie": f"gpuport_login={login.cookies['gpuport_login']}"}
        assert server.rest("GET", "/ui/me", headers=cookie).status_code == 200
        admin.revoke_token("erin")
    for path in ("/ui/state", "/ui/me", "/ui/events"):
        refused = server.rest("GET", path, headers=cookie)
        assert refused.status_code == 401 and "was revoked" in refused.json()["error"]["message"], path
    stranger = server.rest("GET", "/ui/me", headers={"cookie": "gpuport_login=" + "x" * 43})
    assert stranger.status_code == 401 and "not logged in" in stranger.json()["error"]["message"]


def test_the_page_is_strict(dash_server: RunningServer) -> None:
    page = dash_server.rest("GET", "/")
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    for asset in ("app.js", "style.css"):
        text = dash_server.rest("GET", f"/ui/static/{asset}").text
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    assert dash_server.rest("GET", "/ui/static/../app.py").status_code == 404
    assert dash_server.rest("GET", "/ui/state").status_code == 401
    big = dash_server.rest("POST", "/ui/login", json={"token": "gp_" + "x" * 10_000})
    assert big.status_code == 413


# ---- the dashboard as people use it -------------------------------------------------------------

# A Keras-like log: a progress bar rewritten in place with "\r", SGR colours and bold, a window
# title (OSC) and a cursor-hiding sequence that a terminal shows nothing of.
KERAS = r"""
import sys
w = sys.stdout.write
w("Epoch 1/2\n")
for i in range(1, 6):
    w(f"\r{i}/5 \x1b[32m" + "=" * i + "\x1b[0m" + "." * (5 - i) + f" - \x1b[1m{i}s\x1b[0m - loss: 0.{9 - i}")
    sys.stdout.flush()
w("\n\x1b]0;a title\x07\x1b[?25ldone \x1b[1;31mred bold\x1b[0m plain <b>markup</b>\n")
"""
# The same renderer fed piece by piece: an escape sequence cut between two chunks still applies.
SPLIT = """() => {
  const pre = document.createElement("pre");
  const t = new Terminal(pre);
  const pieces = ["one\\ntwo\\n", "a\\x1b[", "1mb\\x1b", "[0m c\\r", "C\\n\\x1b]0;x", "y\\x07z\\x1b[31mred\\x1b[K\\n", "still\\n"];
  for (const piece of pieces) t.write(piece);
  return [pre.textContent, [...pre.querySelectorAll("span[class]")].map((s) => [s.className, s.textContent])];
}"""


def _login_code(url: str) -> str:
    assert "#code=" in url, url
    return url.split("#code=", 1)[1]


def test_a_login_link_logs_in_once(dash_server: RunningServer, browser: Any) -> None:
    server = dash_server
    with server.connect() as admin:
        alice = admin.create_token("alice").token
        carol = admin.create_token("carol").token
    with server.connect(alice) as gpu:
        url = gpu.dashboard_url()
    with server.connect(carol) as gpu:
        carols = gpu.dashboard_url()
    assert url.startswith(server.http_url + "/#code=")

    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    page.goto(url)
    sync_api.expect(page.locator("#board")).to_be_visible()
    sync_api.expect(page.locator("#who")).to_have_text("alice")
    assert "code" not in page.url  # the code left the address bar (and the history)
    cookie = next(c for c in context.cookies() if c["name"] == "gpuport_login")
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert context.request.get(f"{server.http_url}/ui/me").json()["user"] == "alice"
    context.close()

    # A second use, in another browser, is refused, and says why.
    other = browser.new_context(ignore_https_errors=True)
    page = other.new_page()
    page.goto(url)
    sync_api.expect(page.locator("#login-error")).to_contain_text("used already")
    assert other.request.get(f"{server.http_url}/ui/me").status == 401
    page.goto(f"{server.http_url}/#code=not-a-code")
    sync_api.expect(page.locator("#login-error")).to_contain_text("not known")

    # A revoked token's link stops working.
    with server.connect() as admin:
        admin.revoke_token("carol")
    page.goto(carols)
    sync_api.expect(page.locator("#login-error")).to_contain_text("revoked")
    other.close()
    # The codes never reach the server's log (it said why it refused them).
    assert _login_code(url) not in server.banner and _login_code(carols) not in server.banner
    assert "not-a-code" not in server.banner


def test_an_expired_login_code_is_refused(tmp_path: Path) -> None:
    from gpuport.protocol.errors import AuthenticationError
    from gpuport.server.services.auth import AuthService, LoginCodes
    from gpuport.server.store import Store

    auth = AuthService(Store(tmp_path / "db"))
    token = auth.create_first_admin()
    assert token
    identity = auth.authenticate(f"Bearer {token}")
    expired = LoginCodes(auth, seconds=-1).create(identity, f"Bearer {token}")
    codes = LoginCodes(auth)
    with pytest.raises(AuthenticationError, match="not known"):
        codes.redeem(expired)  # another server's (or before a restart)
    stale = LoginCodes(auth, seconds=-1)
    with pytest.raises(AuthenticationError, match="expired"):
        stale.redeem(stale.create(identity, f"Bearer {token}"))
    good = codes.create(identity, f"Bearer {token}")
    assert codes.redeem(good)[0] == identity
    with pytest.raises(AuthenticationError, match="used already"):
        codes.redeem(good)


def test_gpuport_dashboard_prints_a_link_that_works_once(dash_server: RunningServer, cli: Any) -> None:
    server = dash_server
    with server.connect() as admin:
        dana = admin.create_token("dana").token
    assert cli("login", server.url, "--token", dana, "--fingerprint", server.fingerprint).code == 0
    done = cli("dashboard", "--print")
    assert done.code == 0, done.stderr
    url = done.stdout.strip()
    assert url.startswith(server.http_url + "/#code=") and "once" in done.stderr
    # Where no browser can be opened, the link is printed too, saying so.
    headless = cli("dashboard", DISPLAY="", WAYLAND_DISPLAY="", BROWSER="")
    assert headless.code == 0 and "No browser" in headless.stderr
    assert headless.stdout.strip().startswith(server.http_url + "/#code=")

    first = server.rest("POST", "/ui/login", json={"code": _login_code(url)})
    assert first.status_code == 200 and first.json()["user"] == "dana"
    assert "gpuport_login" in first.cookies
    again = server.rest("POST", "/ui/login", json={"code": _login_code(url)})
    assert again.status_code == 401 and "used already" in again.json()["error"]["message"]


def test_a_keras_log_reads_as_on_a_terminal(dash_server: RunningServer, browser: Any) -> None:
    server = dash_server
    with server.connect() as admin:
        alice = admin.create_token("alice").token
    with server.connect(alice) as gpu:
        job = gpu.submit(["python", "-c", KERAS], workdir=None)
        assert job.wait(timeout=60).status == "succeeded"

    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, alice)
    page.locator("#jobs tr", has_text=job.id).click()
    log = page.locator("#log")
    sync_api.expect(log).to_contain_text("plain", timeout=30_000)
    lines = log.inner_text().splitlines()
    assert lines[:3] == ["Epoch 1/2", "5/5 ===== - 5s - loss: 0.4", "done red bold plain <b>markup</b>"], lines
    assert "\x1b" not in log.inner_text() and "title" not in log.inner_text()
    sync_api.expect(log.locator("span.ansi-fg-2")).to_have_text("=====")
    sync_api.expect(log.locator("span.ansi-bold")).to_have_text(["5s", "red bold"])
    sync_api.expect(log.locator("span.ansi-bold.ansi-fg-1")).to_have_text("red bold")
    assert log.locator("b").count() == 0  # markup stays text
    _shot(page, "6-keras-log")
    text, spans = page.evaluate(SPLIT)
    assert text == "one\ntwo\nCb c\nzred\nstill\n", text
    assert spans == [["ansi-bold", "b"], ["ansi-fg-1", "red"], ["ansi-fg-1", "still\n"]], spans
    context.close()


def test_the_jobs_table_filters_and_pages(dash_server: RunningServer, browser: Any) -> None:
    server = dash_server
    with server.connect() as admin:
        dana = admin.create_token("dana").token
        erin = admin.create_token("erin").token
    with server.connect(erin) as gpu:
        erins = gpu.submit(["true"], workdir=None, name="erins").wait(timeout=60)
    with server.connect(dana) as gpu:
        ended = [
            gpu.submit(["true"], workdir=None, name="train-a", gpus=1, cpus=0.5, memory="64MiB"),
            gpu.submit(["true"], workdir=None, name="Train-b", gpu_memory="2GiB"),
            gpu.submit(["false"], workdir=None, name="broken"),
        ]
        for job in ended:
            job.wait(timeout=60)
    with server.connect() as admin:
        admin.set_quota("dana", jobs=1)  # behind one that sleeps, what she submits waits: a long table, quickly
    with server.connect(dana) as gpu:
        gpu.submit(["sleep", "600"], workdir=None, name="holder", time_limit="10m")
        for i in range(52):
            gpu.submit(["true"], workdir=None, name=f"wait-{i}")
    try:
        _look_at_jobs(server, browser, dana, erins.id)
    finally:
        with server.connect() as admin:
            admin.revoke_token("dana", end_work=True)  # her queued jobs and the sleeper end with it


def _look_at_jobs(server: RunningServer, browser: Any, dana: str, erins: str) -> None:
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, dana)
    jobs = page.locator("#jobs")
    heads = ["job", "name", "user", "state", "resources", "submitted", "duration", "exit"]
    sync_api.expect(jobs.locator("th")).to_have_text(heads)
    sync_api.expect(page.locator("#jobs-count")).to_have_text("1–50 of 56")
    sync_api.expect(jobs.locator("tr.clickable")).to_have_count(50)
    assert page.locator("#filter-user").is_hidden()  # only admins look at others' jobs
    page.click("#jobs-next")
    sync_api.expect(page.locator("#jobs-count")).to_have_text("51–56 of 56")
    sync_api.expect(jobs.locator("tr.clickable")).to_have_count(6)
    sync_api.expect(page.locator("#jobs-next")).to_be_disabled()
    row = jobs.locator("tr", has_text="train-a")
    sync_api.expect(row).to_contain_text("1 GPU · 0.5 CPU · 64 MiB RAM")
    sync_api.expect(row).to_contain_text("dana")
    sync_api.expect(jobs.locator("tr", has_text="Train-b")).to_contain_text("2.0 GiB GPU slice")
    _shot(page, "7-jobs-page-2")

    page.select_option("#filter-state", "failed")
    sync_api.expect(page.locator("#jobs-count")).to_have_text("1–1 of 1")
    sync_api.expect(jobs.locator("tr.clickable")).to_have_text([re.compile("broken")])
    page.select_option("#filter-state", "")
    page.fill("#filter-name", "TRAIN")
    sync_api.expect(page.locator("#jobs-count")).to_have_text("1–2 of 2")
    sync_api.expect(jobs.locator("tr.clickable")).to_have_count(2)
    context.close()

    # An admin sees everyone's, and picks a user.
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, server.admin_token)
    sync_api.expect(page.locator("#jobs-count")).to_have_text("1–50 of 57")
    page.fill("#filter-user", "erin")
    sync_api.expect(page.locator("#jobs-count")).to_have_text("1–1 of 1")
    sync_api.expect(page.locator("#jobs tr.clickable")).to_contain_text(erins)
    context.close()


def test_outputs_download_from_the_job_page(dash_server: RunningServer, browser: Any, tmp_path: Path) -> None:
    server = dash_server
    with server.connect() as admin:
        alice = admin.create_token("alice").token
        bob = admin.create_token("bob").token
    write = "import os\nos.makedirs('out/sub')\nopen('out/model.txt', 'w').write('weights')\n"
    write += "open('out/sub/w.bin', 'wb').write(bytes(range(256)))\n"
    with server.connect(alice) as gpu:
        job = gpu.submit(["python", "-c", write], workdir=None, outputs=["out/"])
        assert job.wait(timeout=60).status == "succeeded"

    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, alice)
    page.locator("#jobs tr", has_text=job.id).click()
    sync_api.expect(page.locator("#outputs")).to_contain_text("Outputs (2 files)", timeout=30_000)
    with page.expect_download() as started:
        page.click("#outputs a.download")
    archive = tmp_path / "outputs.tar.gz"
    started.value.save_as(archive)
    assert started.value.suggested_filename == f"{job.id}-outputs.tar.gz"
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["out/model.txt", "out/sub/w.bin"]
        member = tar.extractfile("out/sub/w.bin")
        assert member is not None and member.read() == bytes(range(256))
    with page.expect_download() as started:
        page.click("#outputs a:text('out/model.txt')")
    one = tmp_path / "model.txt"
    started.value.save_as(one)
    assert one.read_text() == "weights" and started.value.suggested_filename == "model.txt"
    _shot(page, "8-outputs")
    context.close()

    # Another user's login gets none of them; no login, nothing.
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, bob)
    sync_api.expect(page.locator("#board")).to_be_visible()
    for path in ("outputs", "outputs.tar.gz", "outputs/out/model.txt"):
        assert context.request.get(f"{server.http_url}/ui/jobs/{job.id}/{path}").status == 404
    context.close()
    assert server.rest("GET", f"/ui/jobs/{job.id}/outputs.tar.gz").status_code == 401


def test_the_gpu_history_survives_a_restart(tmp_path: Path, browser: Any) -> None:
    state = tmp_path / "state"
    first = start_server(state)
    token = first.admin_token
    try:
        wait_for(lambda: (state / "gpu-history.json").exists(), what="the GPUs' history kept")
    finally:
        first.stop()
    between = time.time()  # after every reading of the first server, before any of the second
    second = start_server(state)
    try:
        context = browser.new_context(ignore_https_errors=True)
        page = context.new_page()
        _log_in(page, second, token)
        sync_api.expect(page.locator("#gpus .card svg.chart polyline.util")).to_have_count(2)
        gpus = context.request.get(f"{second.http_url}/ui/state").json()["gpus"]
        context.close()
    finally:
        second.stop()
    assert len(gpus) == 2
    for gpu in gpus:
        ats = [r[0] for r in gpu["history"]]
        assert ats == sorted(ats) and ats[0] < between < ats[-1], gpu  # the first server's, then the second's


def test_the_usage_panel_shows_a_user_their_own_gpu_hours_and_an_admin_everyones(
    dash_server: RunningServer, browser: Any
) -> None:
    server = dash_server
    with server.connect() as admin:
        fay = admin.create_token("fay").token
        gus = admin.create_token("gus").token
    for token in (fay, gus):
        with server.connect(token) as gpu:
            gpu.submit(["sleep", "1"], workdir=None, gpus=1).wait(timeout=60)
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, fay)
    usage = page.locator("#usage")
    sync_api.expect(page.locator("#usage-title")).to_have_text("Your usage, last 7 days")
    heads = ["user", "GPU-hours", "CPU-hours", "runs", "shares", "effective share", "decayed use"]
    sync_api.expect(usage.locator("th")).to_have_text(heads)
    sync_api.expect(usage.locator("tr:has(td)")).to_have_count(1)
    cells = usage.locator("tr:has(td) td")
    sync_api.expect(cells.nth(0)).to_have_text("fay")
    assert 1 / 3600 <= float(cells.nth(1).inner_text()) < 0.01  # a GPU for a second or so, in hours
    sync_api.expect(cells.nth(3)).to_have_text("1")
    assert "gus" not in usage.inner_text()  # another user's use is not there
    _shot(page, "usage-user")
    context.close()
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    _log_in(page, server, server.admin_token)
    sync_api.expect(page.locator("#usage-title")).to_have_text("Usage, last 7 days (every user's)")
    sync_api.expect(page.locator("#usage tr:has(td)")).to_have_count(2)
    sync_api.expect(page.locator("#usage")).to_contain_text("gus")
    context.close()
