"""A busy machine, to run the test suite beside: a gpuport server of its own on 127.0.0.1, and
``--launches`` threads (6 by default) each submitting a short job and waiting for it, in a loop,
until this process gets SIGTERM or Ctrl-C (or ``--seconds`` pass). Prints how many jobs ran.

    .venv/bin/python bench/busy.py &           # then, beside it:
    .venv/bin/python -m pytest; kill %1
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import start_gpuport  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=6, help="jobs launched at once, each in a loop")
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long (0: when stopped)")
    args = parser.parse_args()

    import gpuport

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    counts = [0] * args.launches
    with tempfile.TemporaryDirectory(prefix="gpuport-busy-") as folder:
        server = start_gpuport(Path(folder))
        try:

            def launch(index: int) -> None:
                with gpuport.connect(server.url, token=server.token, fingerprint=server.fingerprint) as client:
                    while not stop.is_set():
                        client.submit(["python", "-c", "print('busy')"], workdir=None).wait(120)
                        counts[index] += 1

            threads = [threading.Thread(target=launch, args=(i,), daemon=True) for i in range(args.launches)]
            for thread in threads:
                thread.start()
            started = time.monotonic()
            try:
                while not stop.wait(1):
                    if args.seconds and time.monotonic() - started >= args.seconds:
                        stop.set()
            except KeyboardInterrupt:
                stop.set()
            for thread in threads:
                thread.join(130)
            elapsed = time.monotonic() - started
            print(f"busy: {sum(counts)} jobs in {elapsed:.0f} s ({sum(counts) / elapsed:.1f}/s)", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
