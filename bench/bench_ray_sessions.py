"""Sessions on Ray: a session's worker on a node of a 2-node Ray cluster (reached through the node
agent's TLS link), against a session's worker on a one-machine server, in the same run.

    .venv/bin/python bench/bench_ray_sessions.py            # about three minutes on 2 cores
    .venv/bin/python bench/bench_ray_sessions.py --quick

(a) a no-op call (`s.call(f)` of a function with no arguments, returning None), alternated one by
    one between the two sessions, on open connections. Goal: at most 1.5x.
(b) a 1 GiB array (64 MiB with --quick) put, then got back, alternated likewise with the issue's
    anchor: the same bytes over raw TLS through the same two hops (bench/_tls_hops.py: the client
    to a forwarding process on 127.0.0.1, on to a process on 127.0.0.2 that sends them back).
    Goal: at least 0.7x the anchor's throughput. One machine's figure beside them: on one machine
    the worker maps the server's memory; on a node every byte crosses the link.

Both servers and the cluster run on this machine (tests/_ray.py), in a temp dir removed at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import numpy as np
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
from _tls_hops import hops


def _noop() -> None:
    return None


def main() -> None:
    quick = ray_bench_start(__doc__)
    calls = 200 if quick else 1000
    size = (64 if quick else 1024) << 20  # the 1 GiB, 64 MiB with --quick
    with (
        isolated_workdir() as work,
        ray_cluster(work) as cluster,
        gpuport_server(work, "ray-server", ["--ray", cluster.address]) as on_ray,
        gpuport_server(work, "local-server") as local,
        connect(on_ray) as ray_gpu,
        connect(local) as local_gpu,
        ray_gpu.session() as ray_session,
        local_gpu.session() as local_session,
    ):
        sessions = {"ray": ray_session, "local": local_session}
        for s in sessions.values():
            s.call(_noop)  # started, connected, the function sent
        bench_noop(sessions, calls)
        bench_values(sessions, size, 3, work)
    print_table(["session: no-op", "session: put+get"], 52, "")


def bench_noop(sessions: dict, n: int) -> None:
    say(f"== (a) a no-op call, worker on a Ray node vs on the server's machine ({n} each, alternated)")

    def call(session: object) -> Callable[[], float]:
        return timed(lambda: session.call(_noop))  # type: ignore[attr-defined]

    rotate(50, {name: call(s) for name, s in sessions.items()})  # warm-up
    t = rotate(n, {name: call(s) for name, s in sessions.items()})
    ray_s, local_s = median(t["ray"]), median(t["local"])
    say(f"  on a node median {ms(ray_s)}, on the server's machine {ms(local_s)}")
    ROWS.append(Row("session: no-op call, worker on a node", ray_s, local_s, "worker on the server", "<= 1.5x",
                    ray_s <= 1.5 * local_s))  # fmt: skip


def bench_values(sessions: dict, size: int, n: int, work: Path) -> None:
    say(f"== (b) put+get of {size >> 20} MiB: worker on a Ray node, raw TLS over two hops, worker here ({n} each)")
    value = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)

    def round_trip(session: object) -> Callable[[], float]:
        def once() -> None:
            ref = session.put(value)  # type: ignore[attr-defined]
            back = session.get(ref)  # type: ignore[attr-defined]
            session.delete(ref)  # type: ignore[attr-defined]
            if back.nbytes != size or back[-1] != value[-1]:
                raise RuntimeError("the value came back different")

        return timed(once)

    (work / "hops").mkdir()
    with hops(work / "hops", size) as raw:
        raw()  # the connections warmed
        t = rotate(n, {"tls": timed(raw), **{name: round_trip(s) for name, s in sessions.items()}})
    rates = {name: 2 * size / median(times) / 1e6 for name, times in t.items()}
    say(
        f"  on a node {rates['ray']:.0f} MB/s, raw TLS over the same two hops {rates['tls']:.0f} MB/s, "
        f"on the server's machine {rates['local']:.0f} MB/s (put+get bytes / time)"
    )
    ROWS.append(Row(f"session: put+get {size >> 20} MiB, on a node", rates["ray"], rates["tls"],
                    "raw TLS, same two hops", ">= 0.7x", rates["ray"] >= 0.7 * rates["tls"], unit="MB/s"))  # fmt: skip
    ROWS.append(Row(f"session: put+get {size >> 20} MiB, on the server's machine", rates["local"], rates["tls"],
                    "raw TLS, same two hops", "(no goal: for scale)", None, unit="MB/s"))  # fmt: skip


if __name__ == "__main__":
    main()
