"""The dashboard's cost to the server, and its first paint, in Debian's Chromium (headless, Playwright).

(a) server CPU: a job prints 1 MB/s of log lines; the server's CPU time (its own process, psutil) is
    measured over --seconds with no browser, then with 5 pages (one browser, 5 logins) following
    that job's log in the dashboard, and with 5 pages showing the board only. Goal: 5 log followers
    cost at most +10% of a core over none.
(b) first paint: `/` loaded in a fresh page (first-contentful-paint of the login form), and from
    the login's click to the GPU cards drawn, median of 5.

Needs chromium (apt-get install chromium) and the playwright package (the dev extra).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _report  # noqa: E402
from _report import ROWS, Row, median, say  # noqa: E402

import gpuport  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
ARGS += ["--disable-sync", "--no-first-run", "--disable-quic"]
# 1 MB/s: 100 lines of 100 bytes every 10 ms.
PRINTER = (
    "import sys, time\nline = 'x' * 99 + '\\n'\nstart = time.monotonic()\n"
    "for i in range(10**9):\n    sys.stdout.write(line * 100)\n    sys.stdout.flush()\n"
    "    time.sleep(max(0.0, start + (i + 1) * 0.01 - time.monotonic()))\n"
)


def server_cpu(pid: int, seconds: float) -> float:
    """Cores the server's own process used over ``seconds`` (1.0: one core busy)."""
    process = psutil.Process(pid)
    before = process.cpu_times()
    start = time.monotonic()
    time.sleep(seconds)
    after = process.cpu_times()
    return (after.user + after.system - before.user - before.system) / (time.monotonic() - start)


def until(page: object, condition: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` (JavaScript) in ``page``: the page's CSP forbids eval, which Playwright's
    wait_for_function uses; evaluate() goes through the debugger instead."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(condition):  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {condition}")
        time.sleep(0.1)


def log_in(page: object, url: str, token: str) -> None:
    page.goto(url + "/")  # type: ignore[attr-defined]
    page.fill("#token", token)  # type: ignore[attr-defined]
    page.click("#login button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector("#gpus .card")  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="each CPU measurement (default 10)")
    parser.add_argument("--pages", type=int, default=5)
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        say("playwright is not installed (pip install playwright): the dashboard figures are skipped")
        return
    if not os.path.exists(CHROMIUM):
        say("chromium is not installed (apt-get install chromium): the dashboard figures are skipped")
        return
    version = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip()
    _report.banner(version, quick=False)
    with _report.isolated_workdir() as work, _report.gpuport_server(work, "server") as server:
        pid = server.process.pid
        with gpuport.connect(server.url, server.token, fingerprint=server.fingerprint) as gpu:
            job = gpu.submit(["python", "-c", PRINTER], workdir=None)
            while job.status == "queued":
                time.sleep(0.1)
            try:
                time.sleep(1)
                idle = server_cpu(pid, args.seconds)
                with sync_playwright() as playwright:
                    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
                    pages = []
                    for _ in range(args.pages):
                        page = browser.new_context(ignore_https_errors=True).new_page()
                        log_in(page, server.http_url, server.token)
                        pages.append(page)
                    time.sleep(1)
                    board = server_cpu(pid, args.seconds)
                    for page in pages:
                        page.locator("#jobs tr", has_text=job.id).click()
                        until(page, "document.getElementById('log').textContent.length > 100000")
                    following = server_cpu(pid, args.seconds)
                    shown = [len(p.evaluate("document.getElementById('log').textContent")) for p in pages]

                    paints, boards = [], []
                    for _ in range(5):
                        page = browser.new_context(ignore_https_errors=True).new_page()
                        page.goto(server.http_url + "/")
                        page.wait_for_selector("#token")
                        paint = page.evaluate(
                            "performance.getEntriesByName('first-contentful-paint').map(e => e.startTime)[0] || 0"
                        )
                        paints.append(paint / 1000)
                        page.fill("#token", server.token)
                        started = time.perf_counter()
                        page.click("#login button[type=submit]")
                        page.wait_for_selector("#gpus .card")
                        boards.append(time.perf_counter() - started)
                        page.context.close()
                    browser.close()
            finally:
                job.cancel()
    say(
        f"  server CPU: {idle:.3f} cores with no page, {board:.3f} with {args.pages} boards, {following:.3f} with "
        f"{args.pages} following the log (each page had {min(shown) / 1e6:.1f}-{max(shown) / 1e6:.1f} MB of it)"
    )
    extra = following - idle
    ROWS.append(
        Row(
            f"server CPU, {args.pages} pages following 1 MB/s of log",
            following,
            idle,
            "no page",
            "<= +0.10 core",
            extra <= 0.10,
            unit="cores",
            note=f"+{extra:.3f} core",
        )
    )
    ROWS.append(
        Row(f"server CPU, {args.pages} pages showing the board", board, idle, "no page", "-", None, unit="cores")
    )
    ROWS.append(Row("first contentful paint of /", median(paints), None, "-", "-", None))
    ROWS.append(Row("login click to GPU cards drawn", median(boards), None, "-", "-", None))
    _report.print_table(
        ["server CPU", "first", "login"], 44, "server CPU in cores (1.0: one core busy); paint: median of 5"
    )


if __name__ == "__main__":
    main()
