"""gpuport between two hosts joined by a link of 2 ms round trip and 1 Gbit/s (tests/_link.py: two
network namespaces, a forwarder that delays and paces every packet), against the tools it replaces
on the same link, run on the same laptop against the same box.

Every figure is whole commands or calls run on the laptop; the gpuport server and an sshd listen on
the box's address:

  sync, first      `gpuport push DIR NAME` of a new synthetic project (2000 files of 1-20 KB and 5 of
                   20 MB; a server that has none of it) vs `rsync -a -e ssh DIR/ box:NEW/`.
  sync, unchanged  the same two commands again, nothing changed.
  put 1 GiB        `session.put` of a 1 GiB array (through the data port) vs 1 GiB sent over one
                   TLS connection (Python's ssl, the server's certificate) on the same link.
  get 1 GiB        `session.get` of it back vs 1 GiB received the same way.
  launch           `gpuport run -- true` in a small project (sync, queue, start, exit code back) vs
                   `ssh box true` (a new ssh login).
  log streaming    `gpuport run -- python -c <print 200k lines>` (12 MB of log through the job's log
                   stream) vs `ssh box python -c <the same>`.
  forward          an HTTP request to a job's port through `gpuport forward` (the job in its sandbox
                   on the box), vs the same server's port reached straight across the link (issue
                   33's anchor, from a laptop), alternating: kept alive back to back, kept alive
                   after a 50 ms pause each (at rest), and on a fresh connection each (at rest);
                   beside them, through `ssh -L` to that port (what users run today).

`--only forward` (or sync, bulk, jobs) runs one group of figures.

Needs root (namespaces), ssh + sshd (openssh-server) and rsync; says what is missing and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _report  # noqa: E402
import _servers  # noqa: E402
from _report import ROWS, Row, median, say  # noqa: E402
from bench_jobs import SETTLED_S, make_project  # noqa: E402

from tests import _link  # noqa: E402

LINES = 200_000
PRINT = f"import sys\nfor i in range({LINES}): print('line', i, 'of the log, with some words to stream')"
# The anchor for bulk bytes: one TLS connection (Python's ssl, the server's own certificate, as the data
# port), sending or receiving SIZE bytes in 1 MiB slices; the laptop's side prints the seconds.
FAR_END = """
import socket, ssl, sys
mode, address, size, cert, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
listener = socket.create_server((address, 5001))
print("listening", flush=True)
raw, _ = listener.accept()
raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn = context.wrap_socket(raw, server_side=True)
chunk = memoryview(bytearray(1 << 20))
done = 0
if mode == "receive":
    while done < size:
        done += conn.recv_into(chunk) or size
    conn.sendall(b"K")
else:
    while done < size:
        conn.sendall(chunk[: min(len(chunk), size - done)])
        done += min(len(chunk), size - done)
conn.recv(1)
"""
NEAR_END = """
import socket, ssl, sys, time
mode, address, size, cert = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname = False
context.load_verify_locations(cert)
raw = socket.create_connection((address, 5001))
raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn = context.wrap_socket(raw)
chunk = memoryview(bytearray(1 << 20))
start = time.perf_counter()
done = 0
if mode == "receive":  # the far end receives: send
    while done < size:
        conn.sendall(chunk[: min(len(chunk), size - done)])
        done += min(len(chunk), size - done)
    conn.recv(1)
else:
    while done < size:
        done += conn.recv_into(chunk) or size
print(time.perf_counter() - start)
conn.sendall(b"x")
"""
SESSION = """
import sys, time, numpy as np, gpuport
size = int(sys.argv[1])
x = np.ones(size, dtype=np.uint8)
with gpuport.connect(profile="link") as gpu, gpu.session(progress=False) as s:
    s.call(len, [1])  # the worker runs, its channel is open
    start = time.perf_counter()
    ref = s.put(x)
    put = time.perf_counter() - start
    start = time.perf_counter()
    y = s.get(ref)
    get = time.perf_counter() - start
    assert y.nbytes == size
print(put, get)
"""
# The forward's figures, run on the laptop: a job's HTTP server through `gpuport forward` (the CLI, a
# process of its own as a user runs it: a browser is another process), the same server's code
# listening straight on the box's address, and that one through `ssh -L` (port argv[4] here),
# alternated request by request; prints each figure's median in seconds, as JSON.
FORWARD = """
import json, socket, statistics, subprocess, sys, time, gpuport
sys.path.insert(0, sys.argv[5])
from bench_reach import _free_port, _round_trip, _serving
box, direct_port, rounds, ssh_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
times = {}
def timed(name, call):
    start = time.perf_counter()
    call()
    times.setdefault(name, []).append(time.perf_counter() - start)
def fresh(address, port):
    with socket.create_connection((address, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _round_trip(conn)
with gpuport.connect(profile="link") as gpu:
    job = _serving(gpu, 8080)
    local = _free_port()
    cli = [sys.executable, "-m", "gpuport", "--profile", "link", "forward", job.id, "8080", "--local", str(local)]
    forward = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", local), timeout=1).close()
                break
            except OSError:
                if forward.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("gpuport forward did not start: " + forward.stderr.read().decode()[-500:])
                time.sleep(0.05)
        time.sleep(0.2)  # its spares made again after that first connection
        ends = {"forward": ("127.0.0.1", local), "direct": (box, direct_port),
                "ssh": ("127.0.0.1", ssh_port)}
        kept = {name: socket.create_connection(end) for name, end in ends.items()}
        for conn in kept.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The forward and its anchor alternate, so that each comes right after the other: both find
        # the same code warm (the job's server is the same program), and neither comes after ssh's
        # round trip (other programs), which left whatever came next 0.3-0.6 ms slower here.
        for _ in range(rounds):
            for name in ("forward", "direct"):
                timed(name + " kept", lambda: _round_trip(kept[name]))
        # The same after a pause each, as a user's requests come to a machine at rest: every CPU
        # idle, nothing of either path in its caches.
        for _ in range(max(rounds // 3, 5)):
            for name in ("forward", "direct"):
                time.sleep(0.05)
                timed(name + " rested", lambda: _round_trip(kept[name]))
        for _ in range(rounds):
            timed("ssh kept", lambda: _round_trip(kept["ssh"]))
        for _ in range(max(rounds // 5, 5)):
            for name, end in ends.items():
                time.sleep(0.05)  # each to a machine at rest: the forward's spare made again (bench_reach's _settled)
                timed(name + " fresh", lambda: fresh(*end))
    finally:
        forward.terminate()
        forward.wait(10)
        job.cancel()
print(json.dumps({name: statistics.median(values) for name, values in times.items()}))
"""


def timed(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    elapsed = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout[-500:]}{done.stderr[-2000:]}")
    return elapsed


def missing(only: str | None = None) -> str:
    why = _link.missing()
    if why:
        return why
    for tool, package in (("ssh", "openssh-client"), ("rsync", "rsync")):
        if tool == "rsync" and only not in (None, "sync"):
            continue
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install {package})"
    if not (shutil.which("sshd") or Path("/usr/sbin/sshd").exists()):
        return "sshd not found (apt-get install openssh-server)"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each repeated figure (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="first syncs of a new project (default 2)")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB put and got (default 1)")
    parser.add_argument("--bulk-runs", type=int, default=3, help="runs of put/get and the socket (default 3)")
    parser.add_argument("--rtt-ms", type=float, default=2.0, help="the link's round trip in ms (default 2)")
    parser.add_argument("--forward-rounds", type=int, default=300, help="kept-alive requests of each (default 300)")
    parser.add_argument(
        "--only", choices=["sync", "bulk", "jobs", "forward"], help="run this group of figures alone (default: all)"
    )
    args = parser.parse_args()
    why = missing(args.only)
    if why:
        say(f"the two-host figures are skipped: {why}")
        return
    from tests._sshd import sshd

    rsync = "rsync not needed"
    if args.only in (None, "sync"):
        rsync = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    _report.banner(rsync, quick=False, where="two hosts (network namespaces) joined by one link")
    with _report.isolated_workdir() as work, _link.link(rtt=args.rtt_ms / 1000, gbits=1.0) as link:
        say(f"link: {link.describe()}; laptop {link.laptop.address}, box {link.box.address}")
        laptop = link.laptop.command
        box_launcher = [*link.box.command([]), sys.executable, "-m", "gpuport"]
        server = _servers.start_gpuport(work, box_launcher, ["--host", link.box.address])
        try:
            with sshd(work / "ssh", host=link.box) as config:
                # The CLI as users get it: its server commands (push) through its helper, one of
                # this run's own (in the laptop's namespace), stopped at the end.
                env = {**os.environ, "GPUPORT_SSH": f"ssh -F {config}", **_report.cli_helper_env(work)}
                ssh = ["ssh", "-F", str(config), "gpubox"]
                login = [sys.executable, "-m", "gpuport", "login", server.url, "--token", server.token]
                timed(laptop([*login, "--fingerprint", server.fingerprint, "--profile", "link"]), env)
                env["GPUPORT_PROFILE"] = "link"
                gpuport_cli = [sys.executable, "-m", "gpuport"]
                wanted = lambda group: args.only in (None, group)
                if wanted("sync"):
                    bench_sync(args, work, laptop, gpuport_cli, ssh, config, env)
                if wanted("bulk"):
                    bench_bulk(args, link, server, env)
                if wanted("jobs"):
                    bench_jobs(args, work, laptop, gpuport_cli, ssh, env)
                if wanted("forward"):
                    bench_forward(args, link, ssh, env)
        finally:
            _report.stop_cli_helpers(work)
            server.stop()
    _report.print_table(
        ["sync, first", "sync, unchanged", "put", "get", "launch", "log streaming", "forward, kept", "forward, fresh"],
        40,
        f"ratio: gpuport / the tool it replaces, on the same link ({link.describe()}); whole commands "
        f"run on the laptop, median of {args.runs} (first syncs: of {args.rounds})",
    )


def bench_sync(
    args: argparse.Namespace,
    work: Path,
    laptop: Callable[[list[str]], list[str]],
    gpuport_cli: list[str],
    ssh: list[str],
    config: Path,
    env: dict[str, str],
) -> None:
    rsh = f"ssh -F {config}"
    first: dict[str, list[float]] = {"gpuport": [], "rsync": []}
    again: dict[str, list[float]] = {"gpuport": [], "rsync": []}
    for round_ in range(args.rounds):
        project = work / f"project{round_}"
        make_project(project, 2000, 5, 20, seed=round_)
        time.sleep(SETTLED_S)
        os.sync()
        first["gpuport"].append(timed(laptop([*gpuport_cli, "push", str(project), "--name", f"p{round_}"]), env))
        first["rsync"].append(
            timed(laptop(["rsync", "-a", "-e", rsh, f"{project}/", f"gpubox:{work}/dest{round_}/"]), env)
        )
    project = work / "project0"
    for _ in range(args.runs):
        again["gpuport"].append(timed(laptop([*gpuport_cli, "push", str(project), "--name", "p0"]), env))
        again["rsync"].append(timed(laptop(["rsync", "-a", "-e", rsh, f"{project}/", f"gpubox:{work}/dest0/"]), env))
    say(f"  sync: 2005 files, {sum(f.stat().st_size for f in project.rglob('*') if f.is_file()) / 1e6:.0f} MB")
    ROWS.append(
        Row(
            "sync, first (2005 files, 120 MB)",
            median(first["gpuport"]),
            median(first["rsync"]),
            "rsync over ssh",
            "-",
            None,
        )
    )
    ROWS.append(Row("sync, unchanged", median(again["gpuport"]), median(again["rsync"]), "rsync over ssh", "-", None))


def bench_bulk(args: argparse.Namespace, link: _link.Link, server: _servers.Gpuport, env: dict[str, str]) -> None:
    size = int(args.gib * 2**30)
    cert, key = server.state_dir / "tls" / "cert.pem", server.state_dir / "tls" / "key.pem"
    times: dict[str, list[float]] = {"put": [], "get": [], "receive": [], "send": []}

    def session() -> None:
        out = subprocess.run(
            link.laptop.command([sys.executable, "-c", textwrap.dedent(SESSION), str(size)]),
            capture_output=True,
            text=True,
            env=env,
        )
        if out.returncode:
            raise SystemExit(f"the session's put/get failed: {out.stderr[-2000:]}")
        put, get = map(float, out.stdout.split()[-2:])
        times["put"].append(put)
        times["get"].append(get)

    def socket_(mode: str) -> None:
        far = subprocess.Popen(
            link.box.command([sys.executable, "-c", FAR_END, mode, link.box.address, str(size), str(cert), str(key)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert far.stdout is not None
        far.stdout.readline()
        near = link.laptop.command([sys.executable, "-c", NEAR_END, mode, link.box.address, str(size), str(cert)])
        done = subprocess.run(near, capture_output=True, text=True, check=True)
        far.wait(timeout=60)
        far.stdout.close()
        times[mode].append(float(done.stdout.strip()))

    for _ in range(args.bulk_runs):  # alternated, so that a slow spell of the machine hits both
        session()
        socket_("receive")
        socket_("send")
    label = f"{args.gib:g} GiB"
    anchor = "a TLS socket (Python ssl)"
    ROWS.append(Row(f"put {label} (session)", median(times["put"]), median(times["receive"]), anchor, "-", None))
    ROWS.append(Row(f"get {label} (session)", median(times["get"]), median(times["send"]), anchor, "-", None))
    rates = [size / median(times[k]) / 1e6 for k in ("put", "get", "receive", "send")]
    say("  put {:.0f} MB/s, get {:.0f} MB/s; the TLS socket: {:.0f} / {:.0f} MB/s".format(*rates))


def bench_jobs(
    args: argparse.Namespace,
    work: Path,
    laptop: Callable[[list[str]], list[str]],
    gpuport_cli: list[str],
    ssh: list[str],
    env: dict[str, str],
) -> None:
    small = work / "small"
    small.mkdir()
    (small / "train.py").write_text("print('hello')\n")
    launch: dict[str, list[float]] = {"gpuport": [], "ssh": []}
    logs: dict[str, list[float]] = {"gpuport": [], "ssh": []}
    for _ in range(args.runs):
        launch["gpuport"].append(timed(laptop([*gpuport_cli, "run", "--", "true"]), env, cwd=small))
        launch["ssh"].append(timed(laptop([*ssh, "true"]), env))
        logs["gpuport"].append(timed(laptop([*gpuport_cli, "run", "--", "python", "-c", PRINT]), env, cwd=small))
        logs["ssh"].append(timed(laptop([*ssh, shlex.join([sys.executable, "-c", PRINT])]), env))
    ROWS.append(Row("launch (run true)", median(launch["gpuport"]), median(launch["ssh"]), "ssh box true", "-", None))
    ROWS.append(
        Row(
            f"log streaming ({LINES // 1000}k lines)",
            median(logs["gpuport"]),
            median(logs["ssh"]),
            "ssh box python",
            "-",
            None,
        )
    )


def bench_forward(args: argparse.Namespace, link: _link.Link, ssh: list[str], env: dict[str, str]) -> None:
    from bench_reach import _SERVE

    direct_port, ssh_port = 8081, 18081
    direct = subprocess.Popen(
        link.box.command([sys.executable, "-c", _SERVE, str(direct_port), link.box.address]),
        stdout=subprocess.PIPE,
        text=True,
    )
    tunnel = subprocess.Popen(
        link.laptop.command(
            [
                *ssh[:-1],
                "-N",
                "-o",
                "ExitOnForwardFailure=yes",
                "-L",
                f"{ssh_port}:{link.box.address}:{direct_port}",
                ssh[-1],
            ]
        ),
        env=env,
    )
    try:
        assert direct.stdout is not None and direct.stdout.readline().strip() == "ready", (
            "the straight server did not start"
        )
        deadline = time.monotonic() + 30
        probe = [sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', {ssh_port}), 1)"]
        while subprocess.run(link.laptop.command(probe), check=False, capture_output=True).returncode:
            if tunnel.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("ssh -L did not open its port")
            time.sleep(0.2)
        script = [sys.executable, "-c", textwrap.dedent(FORWARD), link.box.address, str(direct_port)]
        script += [str(args.forward_rounds), str(ssh_port), str(Path(__file__).parent)]
        out = subprocess.run(link.laptop.command(script), check=False, capture_output=True, text=True, env=env)
        if out.returncode:
            raise SystemExit(f"the forward's figures failed: {out.stderr[-2000:]}")
        got = json.loads(out.stdout.splitlines()[-1])
    finally:
        tunnel.terminate()
        direct.terminate()
        for process in (tunnel, direct):
            process.wait(timeout=10)
    figures = (
        ("kept", "forward, kept-alive request"),
        ("rested", "forward, kept-alive request at rest"),
        ("fresh", "forward, fresh connection + request"),
    )
    for kind, label in figures:
        anchor = "the job's port, straight"
        ROWS.append(
            Row(
                label,
                got[f"forward {kind}"],
                got[f"direct {kind}"],
                anchor,
                "<= 1.5x",
                got[f"forward {kind}"] <= 1.5 * got[f"direct {kind}"],
            )
        )
        if f"ssh {kind}" in got:
            say(
                f"  {label}: through ssh -L {got[f'ssh {kind}'] * 1e3:.2f} ms (gpuport {got[f'forward {kind}'] / got[f'ssh {kind}']:.2f}x of it)"
            )


if __name__ == "__main__":
    main()
