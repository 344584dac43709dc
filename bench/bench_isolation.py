"""What the jobs' sandbox costs: a job's launch, and a Keras epoch, sandboxed against not, in one run.

    make bench                      # or: .venv/bin/python bench/bench_isolation.py [--quick]

Servers on 127.0.0.1 with the same fake GPUs: one isolating its jobs (bubblewrap, a uid per
user when run as root, a private network, and a cgroup per job where the machine lets it: see the
banner's "limits" line), one the same with --no-cgroups, and one started with --no-sandbox
--no-cgroups, the anchor.
(a) launch: submit `true` and wait for its end, as the client sees it, median of N rotating
    between the servers. Goal: the sandbox with its cgroup at most 20 ms more than neither; the
    row without the cgroup shows what the cgroup itself adds.
(b) a Keras epoch: one job per server trains a small dense model on synthetic data (TensorFlow on
    the CPU), 1 warm-up epoch then 5, each timed inside the job; the median epoch. Goal: <= 1.02x.
    Skipped where TensorFlow is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import ROWS, Row, banner, connect, gpuport_server, isolated_workdir, median, print_table, rotate, say
from _servers import Gpuport

import gpuport

EPOCH = """
import json, time
import numpy as np
import keras
rng = np.random.default_rng(0)
x = rng.normal(size=(20000, 64)).astype("float32")
y = (x[:, :8].sum(axis=1) > 0).astype("float32")
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
model.compile("adam", "binary_crossentropy")
times = []
for epoch in range(6):
    start = time.perf_counter()
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    times.append(time.perf_counter() - start)
print(json.dumps(times[1:]))
"""


def launch(client: gpuport.Client) -> float:
    start = time.perf_counter()
    job = client.submit(["true"], workdir=None).wait(60)
    assert job.exit_code == 0, list(job.logs())
    return time.perf_counter() - start


def launch_overhead(
    inside: gpuport.Client, outside: gpuport.Client, rounds: int, figure: str = "job launch, submit to end"
) -> Row:
    """Launch `true` ``rounds`` times on each server (``inside`` a sandboxing one, ``outside`` one
    with --no-sandbox), in turns; the median of each, as a row whose goal is at most 20 ms more."""
    launch(inside), launch(outside)  # warm both
    times = rotate(rounds, {"sandbox": lambda: launch(inside), "none": lambda: launch(outside)})
    ours, anchor = median(times["sandbox"]), median(times["none"])
    return Row(figure, ours, anchor, "--no-sandbox", "<= +20 ms", ours - anchor <= 0.020,
               note=f"{(ours - anchor) * 1e3:+.1f} ms")  # fmt: skip


def epochs(client: gpuport.Client) -> list[float]:
    job = client.submit(["python", "-c", EPOCH], workdir=None, cpus=1).wait(600)
    lines = list(job.logs())
    assert job.exit_code == 0, lines[-20:]
    return list(json.loads(lines[-1]))


def _limits(server: Gpuport) -> str:
    """The banner's "limits" line: whether the sandboxed server's jobs get a cgroup here."""
    found = re.search(r"^  limits\s+(.*)$", server.banner, re.MULTILINE)
    return found.group(1) if found else "(not in the banner)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    args = parser.parse_args()
    banner("bubblewrap sandbox vs --no-sandbox", args.quick)
    rounds = 10 if args.quick else 30
    with isolated_workdir() as work:
        with (
            gpuport_server(work, "sandboxed") as boxed,
            gpuport_server(work, "no-cgroups", ["--no-cgroups"]) as plain,
            gpuport_server(work, "open", ["--no-sandbox", "--no-cgroups"]) as open_,
        ):
            say(f"limits: {_limits(boxed)}")
            with connect(boxed) as inside, connect(plain) as uncapped, connect(open_) as outside:
                launch(inside), launch(uncapped), launch(outside)  # warm all
                times = rotate(rounds, {"sandbox": lambda: launch(inside), "no cgroup": lambda: launch(uncapped),
                                        "none": lambda: launch(outside)})  # fmt: skip
                ours, bare, anchor = median(times["sandbox"]), median(times["no cgroup"]), median(times["none"])
                anchor_name = "--no-sandbox --no-cgroups"
                note = f"{(ours - anchor) * 1e3:+.1f} ms; the cgroup {(ours - bare) * 1e3:+.1f} ms"
                ROWS.append(Row("job launch, submit to end", ours, anchor, anchor_name, "<= +20 ms",
                                ours - anchor <= 0.020, note=note))  # fmt: skip
                ROWS.append(Row("job launch, sandbox without cgroup", bare, anchor, anchor_name, "-", None,
                                note=f"{(bare - anchor) * 1e3:+.1f} ms"))  # fmt: skip
                if importlib.util.find_spec("tensorflow") is None:
                    say("TensorFlow is not installed: the Keras epoch is skipped (pip install 'gpuport[tf]')")
                else:
                    per_epoch: dict[str, list[float]] = {"sandbox": [], "none": []}
                    for _ in range(1 if args.quick else 2):
                        per_epoch["sandbox"] += epochs(inside)
                        per_epoch["none"] += epochs(outside)
                    ours, anchor = median(per_epoch["sandbox"]), median(per_epoch["none"])
                    ROWS.append(Row("Keras epoch (20k x 64, dense 256x2)", ours, anchor, "--no-sandbox",
                                    "<= 1.02x", ours <= anchor * 1.02))  # fmt: skip
    print_table(["job launch", "Keras epoch"], 38, "times: medians; ratio: sandboxed / not")


if __name__ == "__main__":
    main()
