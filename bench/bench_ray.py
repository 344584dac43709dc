"""Scale-out on Ray: the launch of a job through the Ray executor, against its anchors in the same run.

    .venv/bin/python bench/bench_ray.py            # about two minutes on 2 cores
    .venv/bin/python bench/bench_ray.py --quick

(a) submit -> exit of `python -c pass` through the Python API (gpu.submit(...) + job.wait(), on an
    open connection), alternated one by one between a gpuport server that places jobs on a 2-node
    Ray cluster (`--ray`; nodes on this machine: tests/_ray.py) and a one-machine gpuport server.
    Goal: the Ray executor adds at most 150 ms.
(b) the same job as a whole process: `gpuport run -- python -c pass` through the Ray executor,
    against `ray job submit -- python -c pass` to a Ray head with its job server (token auth, on
    127.0.0.1). Goal: at least 10x faster.
(c) a 2-node TensorFlow MultiWorkerMirroredStrategy training step (bench/_jobs/mwms_step.py: a
    dense 64x256x1 model, 256 rows per worker, RING all-reduce over gRPC; the median of 50 steps after
    10), through gpuport (`--nodes 2`) against the same script started by hand as two processes with
    TF_CONFIG on the nodes' addresses. Alternated, 2 runs each. Goal: at most 1.05x.

Every cluster, head and server runs in a temp dir removed at the end, and is stopped in `finally`
by the pids it started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _peers
from _report import (
    ROWS,
    Row,
    connect,
    gpuport_server,
    isolated_workdir,
    median,
    ms,
    print_table,
    ray_bench_start,
    ray_cluster,
    rotate,
    say,
    timed,
)

PASS = ["python", "-c", "pass"]


def main() -> None:
    quick = ray_bench_start(__doc__)
    n = 8 if quick else 20
    with isolated_workdir() as work:
        with (
            ray_cluster(work) as cluster,
            gpuport_server(work, "ray-server", ["--ray", cluster.address]) as on_ray,
            gpuport_server(work, "local-server") as local,
        ):
            bench_api(n, work, on_ray, local)
            cli_s = bench_cli(n, work, on_ray)
            bench_mwms(on_ray, 2)
        bench_ray_submit(work, cli_s, max(3, n // 4))
    print_table(["launch: API", "launch: CLI", "2-node MWMS"], 40, "")


def bench_api(n: int, work: Path, on_ray: object, local: object) -> None:
    say("== (a) launch: API submit+wait of `python -c pass` (a 1-file workdir), Ray executor vs local executor")
    workdir = work / "project"
    workdir.mkdir()
    (workdir / "train.py").write_text("print('hello')\n")
    with connect(on_ray) as ray_gpu, connect(local) as local_gpu:  # type: ignore[arg-type]

        def run(gpu: object) -> Callable[[], None]:
            def once() -> None:
                job = gpu.submit(PASS, workdir=workdir)  # type: ignore[attr-defined]
                job.wait()
                if job.info.exit_code != 0:
                    raise RuntimeError(f"job {job.id} ended {job.info.state}: {job.info.message}")

            return once

        rotate(3, {"ray": timed(run(ray_gpu)), "local": timed(run(local_gpu))})  # warm-up
        t = rotate(n, {"ray": timed(run(ray_gpu)), "local": timed(run(local_gpu))})
    ray_s, local_s = median(t["ray"]), median(t["local"])
    say(f"  Ray executor median {ms(ray_s)} (min {ms(min(t['ray']))}), local median {ms(local_s)} of {n} each")
    extra = ray_s - local_s
    ROWS.append(Row("launch: API, Ray executor", ray_s, local_s, "local executor", "<= local + 150 ms", extra <= 0.150))


MWMS = Path(__file__).parent / "_jobs"


def _step_ms(text: str) -> float:
    return float(text.split("step median ", 1)[1].split()[0]) / 1000


def bench_mwms(on_ray: object, runs: int) -> None:
    say("== (c) a 2-node MultiWorkerMirroredStrategy step: through gpuport --nodes 2, and by hand")
    if importlib.util.find_spec("tensorflow") is None:
        say("  tensorflow: not installed (pip install 'gpuport[tf]'): skipped")
        return
    with connect(on_ray) as gpu:  # type: ignore[arg-type]
        gpu.push(MWMS, name="bench-mwms")

        def through_gpuport() -> float:
            job = gpu.submit(["python", "mwms_step.py"], workdir=None, project="bench-mwms", nodes=2).wait(600)
            log = "\n".join(job.logs())
            if job.info.state != "succeeded":
                raise RuntimeError(f"the MWMS job ended {job.info.state}: {job.info.message}\n{log[-3000:]}")
            return _step_ms(log)

        def by_hand() -> float:
            addresses = ["127.0.0.2", "127.0.0.3"]
            ports = []
            for address in addresses:
                with socket.socket() as s:
                    s.bind((address, 0))
                    ports.append(s.getsockname()[1])
            cluster = {"worker": [f"{a}:{p}" for a, p in zip(addresses, ports)]}
            workers = []
            for index in range(2):
                env = {
                    **os.environ,
                    "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                }
                workers.append(
                    subprocess.Popen(
                        [sys.executable, str(MWMS / "mwms_step.py")], env=env, stdout=subprocess.PIPE, text=True
                    )
                )
            out = [w.communicate(timeout=600)[0] for w in workers]
            return _step_ms(out[0])

        t = rotate(runs, {"gpuport": through_gpuport, "by hand": by_hand})
    ours, anchor = median(t["gpuport"]), median(t["by hand"])
    say(f"  step median through gpuport {ms(ours)}, by hand {ms(anchor)} ({runs} runs each, alternated)")
    ROWS.append(
        Row("2-node MWMS step", ours, anchor, "the script by hand on both nodes", "<= 1.05x", ours <= anchor * 1.05)
    )


def bench_cli(n: int, work: Path, on_ray: object) -> float:
    say("== (b) launch: `gpuport run -- python -c pass` through the Ray executor, as a whole process")
    cwd = work / "cli-cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPORT_")}
    env.update(
        GPUPORT_URL=on_ray.url,  # type: ignore[attr-defined]
        GPUPORT_TOKEN=on_ray.token,  # type: ignore[attr-defined]
        GPUPORT_FINGERPRINT=on_ray.fingerprint,  # type: ignore[attr-defined]
        GPUPORT_CONFIG_DIR=str(work / "config"),
        GPUPORT_AGENT="0",  # its own process (no CLI helper), as this figure was first measured
    )

    def once() -> None:
        subprocess.run(
            [sys.executable, "-m", "gpuport", "run", "--", *PASS], cwd=cwd, env=env, check=True, capture_output=True
        )

    times = [timed(once)() for _ in range(n // 2 + 1)][1:]
    cli_s = median(times)
    say(f"  gpuport run median {ms(cli_s)} (min {ms(min(times))}) of {len(times)}")
    return cli_s


def bench_ray_submit(work: Path, cli_s: float, n: int) -> None:
    say("== (b) the peer: `ray job submit -- python -c pass` to a Ray head with its job server")
    folder = work / "ray-cwd"
    folder.mkdir()
    head = _peers.start_ray(work)
    try:
        head.submit(PASS, folder)  # warm-up
        times = [head.submit(PASS, folder) for _ in range(n)]
    finally:
        head.stop()
    ray_s = median(times)
    say(f"  ray job submit median {ms(ray_s)} (min {ms(min(times))}) of {n}")
    ROWS.append(
        Row("launch: CLI via Ray vs ray job submit", cli_s, ray_s, "ray job submit", "<= 0.1x", cli_s <= ray_s / 10)
    )


if __name__ == "__main__":
    main()
