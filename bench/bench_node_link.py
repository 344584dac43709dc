"""A node's link in front of a real session worker: a small request and its reply, relayed byte for
byte (as a tunnel is) against carried as frames (``executors/node_values.py``, a session's worker),
alternated call by call in the same run.

    .venv/bin/python bench/bench_node_link.py            # 3000 round trips each: about 10 s
    .venv/bin/python bench/bench_node_link.py --quick    # 500

No Ray: a ``NodeListener`` on 127.0.0.1 and ``python -m gpuport.server.worker.session`` in a temp dir.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from gpuport.defaults import ENV_RUN_DIR
from gpuport.server.executors.base import Stream
from gpuport.server.executors.node_link import NodeListener, dial
from gpuport.server.worker import wire

_SECRET = "ab" * 32


def main() -> None:
    rounds = 500 if "--quick" in sys.argv else 3000
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, ENV_RUN_DIR: folder, "GPUPORT_JOB_ID": "j-1"}
        worker = subprocess.Popen([sys.executable, "-m", "gpuport.server.worker.session"], env=env, cwd=folder)
        try:
            deadline = time.monotonic() + 60
            while not (Path(folder) / "worker.sock").exists():
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise RuntimeError("the session worker did not start")
                time.sleep(0.02)
            frames = {"on": False}

            def connect(job_id: str, name: str) -> Stream:
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(str(Path(folder) / "worker.sock"))
                return Stream(sock, passes_fds=frames["on"])  # descriptors: a session's frames

            listener = NodeListener("127.0.0.1", connect)
            opened = listener.open(_SECRET)
            links = {}
            for kind in ("relayed", "frames"):
                frames["on"] = kind == "frames"
                stream = dial("127.0.0.1", opened["port"], opened["fingerprint"], _SECRET, "j-1", "worker", True)
                links[kind] = stream.sock
            times: dict[str, list[float]] = {kind: [] for kind in links}
            for i in range(rounds + 100):
                for kind, sock in links.items():
                    start = time.perf_counter()
                    wire.send(sock, {"op": "refs", "inline": True, "ref_ids": []})
                    wire.recv(sock)
                    if i >= 100:  # the first 100: warm-up
                        times[kind].append(time.perf_counter() - start)
            median = {kind: statistics.median(t) for kind, t in times.items()}
            for kind, t in median.items():
                print(f"{kind:8} median {t * 1e6:.0f} µs")
            print(f"frames / relayed: {median['frames'] / median['relayed']:.2f}x")
            listener.close()
        finally:
            worker.kill()
            worker.wait()


if __name__ == "__main__":
    main()
