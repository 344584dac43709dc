"""Submitting a job array of 100 tasks in one call against 100 separate submits of the same job, on
127.0.0.1, measured in the same run on a fresh server.

    .venv/bin/python bench/bench_arrays.py            # 7 rounds: about a minute on 2 cores
    .venv/bin/python bench/bench_arrays.py --quick    # 3 rounds

A fresh server with two fake GPUs, both held by sleeping jobs, so that every job submitted stays
queued: what is timed is the submit, not the launches. The job: `python train.py` with 1 GPU in a
project folder of 20 small files, as `gpuport run` sends it: the folder is synced (hashed from the
client's cache, the server asked what it lacks: nothing after the first round) and the job
submitted. Separate: 100 calls `gpu.submit(cmd, workdir=project, gpus=1)`, one after another on one
connection, each syncing the folder as a script doing it in a loop would. Array: one call
`gpu.submit(cmd, workdir=project, gpus=1, array="0-99")`: one sync, one request, one transaction,
one scheduling pass. Each round times both, in alternating order, and cancels what it queued (not
timed); the figures are medians over the rounds. Goal: the array takes <= 0.1x of the separate
submits' time. Printed beside it: the same without a folder (workdir=None), where only the submit
calls differ. The holders are cancelled and the server stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import ROWS, Row, banner, connect, gpuport_server, isolated_workdir, median, ms, print_table, say

import gpuport

HOLD = "import time; time.sleep(3600)"
TASKS = 100
COMMAND = ["python", "train.py"]


def project(folder: Path) -> Path:
    """A small project: a script and 19 modules of a few KiB."""
    folder.mkdir()
    (folder / "train.py").write_text("import sys\nprint(sys.argv)\n")
    for i in range(19):
        (folder / f"module_{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 500)
    return folder


def separate(gpu: gpuport.Client, workdir: Path | None) -> tuple[float, list[gpuport.Job]]:
    started = time.perf_counter()
    jobs = [gpu.submit(COMMAND, workdir=workdir, gpus=1) for _ in range(TASKS)]
    return time.perf_counter() - started, jobs


def array(gpu: gpuport.Client, workdir: Path | None) -> tuple[float, gpuport.JobArray]:
    started = time.perf_counter()
    submitted = gpu.submit(COMMAND, workdir=workdir, gpus=1, array=f"0-{TASKS - 1}")
    return time.perf_counter() - started, submitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    banner(f"{TASKS} tasks, {rounds} rounds", args.quick)
    with isolated_workdir() as work, gpuport_server(work, "arrays") as server, connect(server) as gpu:
        folder = project(work / "project")
        holders = [gpu.submit(["python", "-c", HOLD], workdir=None, gpus=1) for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while not all(h.status == "running" for h in holders):
                if time.monotonic() > deadline:
                    raise SystemExit("the two holding jobs did not start")
                time.sleep(0.05)
            gpu.submit(COMMAND, workdir=folder, gpus=1).cancel()  # the folder's blobs are there from now on
            for workdir, what in ((folder, "with a 20-file folder"), (None, "workdir=None")):
                times: dict[str, list[float]] = {"separate": [], "array": []}
                for n in range(rounds):
                    for kind in ("separate", "array") if n % 2 == 0 else ("array", "separate"):
                        if kind == "separate":
                            took, jobs = separate(gpu, workdir)
                            assert all(j.info.state == "queued" for j in jobs)
                            for job in jobs:
                                job.cancel()
                        else:
                            took, submitted = array(gpu, workdir)
                            assert submitted.info.counts() == {"queued": TASKS}
                            submitted.cancel()
                        times[kind].append(took)
                ours, anchor = median(times["array"]), median(times["separate"])
                say(
                    f"  {what}: array of {TASKS} {ms(ours)} (min {ms(min(times['array']))}), "
                    f"{TASKS} submits {ms(anchor)} (min {ms(min(times['separate']))}); ratio {ours / anchor:.3f}"
                )
                goal = workdir is not None
                ROWS.append(
                    Row(
                        f"array of {TASKS} in one call, {what}",
                        ours,
                        anchor,
                        f"{TASKS} separate submits, same run",
                        "<= 0.1x" if goal else "(shown beside it)",
                        ours <= 0.1 * anchor if goal else None,
                    )
                )
        finally:
            for holder in holders:  # jobs outlive a server that stops: they end now
                holder.cancel()
            for holder in holders:
                holder.wait(30)
    print_table(["array"], 48, "medians over the rounds; the ratio is the array's time over the separate submits'")


if __name__ == "__main__":
    main()
