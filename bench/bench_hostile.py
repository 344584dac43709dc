"""What hostile uploads cost everyone else: archive bombs posted over REST, against a quiet server.

    .venv/bin/python bench/bench_hostile.py [--quick]

One server on 127.0.0.1 with fake GPUs. One user posts six .tar.gz archives at once to
POST /v1/snapshots, each 1,000,000 folder headers in about 5 MB (refused at the member limit);
meanwhile another user launches `true` again and again.
(a) the server's peak memory (RSS of its process) during the bombs, over its RSS before.
    Goal: at most +128 MiB.
(b) the other user's job launch (submit to end, as the client sees it) during the bombs, median,
    against the same launch on the quiet server. Goal: <= 2x.
"""

from __future__ import annotations

import argparse
import gzip
import ssl
import sys
import tarfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from _report import MB, ROWS, Row, banner, connect, gpuport_server, isolated_workdir, median, print_table, say

import gpuport

BOMBS = 6
FOLDERS = 1_000_000


def folders_bomb(count: int) -> bytes:
    """A .tar.gz of ``count`` folder headers: 1,000 distinct ones gzipped once and repeated."""
    block = b""
    for i in range(1000):
        info = tarfile.TarInfo(f"d{i:06d}")
        info.type = tarfile.DIRTYPE
        block += info.tobuf(format=tarfile.USTAR_FORMAT)
    return gzip.compress(block, mtime=0) * (count // 1000) + gzip.compress(b"\0" * 1024, mtime=0)


def launch(client: gpuport.Client) -> float:
    start = time.perf_counter()
    job = client.submit(["true"], workdir=None).wait(300)
    assert job.exit_code == 0, list(job.logs())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer quiet launches")
    args = parser.parse_args()
    banner("archive bombs vs a quiet server", args.quick)
    bomb = folders_bomb(FOLDERS)
    with isolated_workdir() as work, gpuport_server(work, "hostile") as server, connect(server) as admin:
        bomber = admin.create_token("bomber").token
        with connect(server) as other:
            launch(other)  # warm
            quiet = [launch(other) for _ in range(5 if args.quick else 15)]
            process = psutil.Process(server.process.pid)
            before = peak = process.memory_info().rss
            trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
            answers: list[int] = []

            def post() -> None:
                with httpx.Client(verify=trust, timeout=600) as http:
                    answer = http.post(
                        f"{server.http_url}/v1/snapshots",
                        content=bomb,
                        headers={"authorization": f"Bearer {bomber}", "content-type": "application/gzip"},
                    )
                    answers.append(answer.status_code)

            posts = [threading.Thread(target=post) for _ in range(BOMBS)]
            started = time.perf_counter()
            for thread in posts:
                thread.start()
            sampling = True

            def sample() -> None:
                nonlocal peak
                while sampling:
                    peak = max(peak, process.memory_info().rss)
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            during = []
            while any(thread.is_alive() for thread in posts):
                during.append(launch(other))
            bombs_took = time.perf_counter() - started
            sampling = False
            sampler.join()
    say(f"{BOMBS} bombs of {len(bomb) / MB:.1f} MB ({FOLDERS:,} folder headers each): answered {sorted(answers)} "
        f"in {bombs_took:.1f} s; {len(during)} launches meanwhile")  # fmt: skip
    grown = (peak - before) / MB
    ROWS.append(Row(f"server memory growth, {BOMBS} archive bombs", grown, None, "-", "<= +134 MB (128 MiB)",
                    grown <= 128 * 1024**2 / MB, unit="MB",
                    note=f"{before / MB:.0f} -> {peak / MB:.0f} MB"))  # fmt: skip
    ours, anchor = median(during), median(quiet)
    ROWS.append(Row("other user's job launch during bombs", ours, anchor, "quiet server", "<= 2x",
                    ours <= 2 * anchor))  # fmt: skip
    print_table(["server memory", "other user's"], 44, "times: medians; ratio: during the bombs / quiet")


if __name__ == "__main__":
    main()
