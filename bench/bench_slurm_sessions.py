"""Sessions on Slurm: a session's worker in a Slurm job (reached over TCP through the link its
supervisor starts on the node, executors/slurm_link.py), against a session's worker on a one-machine
server, in the same run.

    .venv/bin/python bench/bench_slurm_sessions.py            # about two minutes on 2 cores (as root,
    .venv/bin/python bench/bench_slurm_sessions.py --quick    # with Debian's slurm-wlm and munge)

(a) open -> first call: `gpu.session()` then a no-op `s.call(f)`, closed after; alternated one by one.
    On Slurm this holds sbatch, Slurm's start of the job, the link's start (its imports, a certificate
    made on the node) and the worker's. No goal: what a Slurm session costs to open.
(b) a no-op call on open sessions, alternated one by one. Goal: at most 1.5x, as for a Ray node.
(c) a 64 MiB array put, then got back (16 MiB with --quick): on one machine the worker maps the
    server's memory; on Slurm every byte crosses the link. No goal: what crossing costs.

A one-node Slurm cluster on this machine (tests/_slurm.py), both servers and the cluster in a temp dir
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import numpy as np
from _report import (
    ROWS,
    Row,
    banner,
    connect,
    gpuport_server,
    isolated_workdir,
    median,
    ms,
    print_table,
    rotate,
    say,
    timed,
)

from tests._slurm import missing, start_cluster


def _noop() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    quick = parser.parse_args().quick
    if missing():
        raise SystemExit(missing())
    with isolated_workdir() as work:
        cluster = start_cluster(work / "cluster")
        banner("Slurm (tests/_slurm.py, one node)", quick)
        try:
            os.environ["SLURM_CONF"] = str(cluster.conf)  # the servers' (start_gpuport passes our env on)
            options = ["--slurm", "--shared-dir", str(work / "shared")]
            with (
                gpuport_server(work, "slurm-server", options) as on_slurm,
                gpuport_server(work, "local-server") as local,
                connect(on_slurm) as slurm_gpu,
                connect(local) as local_gpu,
            ):
                gpus = {"slurm": slurm_gpu, "local": local_gpu}
                bench_open(gpus, 3 if quick else 6)
                with slurm_gpu.session() as slurm_session, local_gpu.session() as local_session:
                    sessions = {"slurm": slurm_session, "local": local_session}
                    for s in sessions.values():
                        s.call(_noop)  # started, connected, the function sent
                    bench_noop(sessions, 200 if quick else 1000)
                    bench_values(sessions, (16 if quick else 64) << 20, 3 if quick else 5)
        finally:
            cluster.cancel_all()
            cluster.close()
    print_table(["session: open", "session: no-op", "session: put+get"], 48, "")


def bench_open(gpus: dict, n: int) -> None:
    say(f"== (a) open -> first call, worker in a Slurm job vs on the server's machine ({n} each, alternated)")

    def opened(gpu: object) -> Callable[[], float]:
        def once() -> None:
            with gpu.session() as s:  # type: ignore[attr-defined]
                s.call(_noop)

        return timed(once)

    t = rotate(n, {name: opened(g) for name, g in gpus.items()})
    slurm_s, local_s = median(t["slurm"]), median(t["local"])
    say(f"  in a Slurm job median {ms(slurm_s)}, on the server's machine {ms(local_s)}")
    ROWS.append(Row("session: open -> first call, in a Slurm job", slurm_s, local_s, "worker on the server",
                    "(no goal: what opening costs)", None))  # fmt: skip


def bench_noop(sessions: dict, n: int) -> None:
    say(f"== (b) a no-op call, worker in a Slurm job vs on the server's machine ({n} each, alternated)")
    rotate(50, {name: timed(lambda s=s: s.call(_noop)) for name, s in sessions.items()})  # warm-up
    t = rotate(n, {name: timed(lambda s=s: s.call(_noop)) for name, s in sessions.items()})
    slurm_s, local_s = median(t["slurm"]), median(t["local"])
    say(f"  in a Slurm job median {ms(slurm_s)}, on the server's machine {ms(local_s)}")
    ROWS.append(Row("session: no-op call, worker in a Slurm job", slurm_s, local_s, "worker on the server", "<= 1.5x",
                    slurm_s <= 1.5 * local_s))  # fmt: skip


def bench_values(sessions: dict, size: int, n: int) -> None:
    say(f"== (c) put+get of {size >> 20} MiB, worker in a Slurm job vs on the server's machine ({n} each)")
    value = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)

    def round_trip(session: object) -> Callable[[], float]:
        def once() -> None:
            ref = session.put(value)  # type: ignore[attr-defined]
            back = session.get(ref)  # type: ignore[attr-defined]
            session.delete(ref)  # type: ignore[attr-defined]
            if back.nbytes != size or back[-1] != value[-1]:
                raise RuntimeError("the value came back different")

        return timed(once)

    t = rotate(n, {name: round_trip(s) for name, s in sessions.items()})
    rates = {name: 2 * size / median(times) / 1e6 for name, times in t.items()}
    say(f"  in a Slurm job {rates['slurm']:.0f} MB/s, on the server's machine {rates['local']:.0f} MB/s")
    ROWS.append(Row(f"session: put+get {size >> 20} MiB, in a Slurm job", rates["slurm"], rates["local"],
                    "worker on the server", "(no goal: the cost of crossing)", None, unit="MB/s"))  # fmt: skip


if __name__ == "__main__":
    main()
