"""A real one-node Slurm cluster on this machine, for the Slurm executor's tests and benchmark.

Debian's ``slurm-wlm`` and ``munge``, run as root with everything in a temporary folder: a
``slurm.conf`` named by ``SLURM_CONF``, ``munged --force`` with its own key and socket, and
``slurmctld -D`` + ``slurmd -D`` on free ports. The node has 2 fake GPUs: gres of ``File=`` plain
files, with ``AutoDetect=off``. Slurm's completion records go to ``jobcomp.txt`` (``jobcomp/filetxt``:
``sacct --completion`` reads them, without a database). Ended by killing each daemon by its pid.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT = 60.0
NODE_CPUS = 4  # more than this machine may have: slurmd takes the config's word (config_overrides)
NODE_MEMORY_MB = 4000
# A job that says it started, then runs until SIGTERM, which it answers with exit code 7.
UNTIL_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(7)))\n"
    "print('started', flush=True)\n"
    "while True: time.sleep(0.05)\n"
)
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
REST_USER = "nobody"  # slurmrestd refuses root and SlurmUser: it drops to this user once its socket is open


def missing() -> str:
    """Why a Slurm cluster cannot be started here ("": it can)."""
    absent = [tool for tool in TOOLS if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root"
    return ""


def rest_missing() -> str:
    """Why slurmrestd cannot be started here beside the cluster ("": it can)."""
    if missing():
        return missing()
    if shutil.which("slurmrestd") is None and not Path("/usr/sbin/slurmrestd").exists():
        return "slurmrestd is not installed: apt-get install -y slurmrestd (make test-tools does, as root)"
    return ""


def _free_port() -> int:
    """A port free now, below the kernel's range of ephemeral ports (one from that range can be handed
    to some connection's local end before the daemon binds it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below {low}")


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    base: Path
    node: str  # the one node's name: this machine's
    conf: Path  # slurm.conf, for SLURM_CONF
    nodes: list[str] = field(default_factory=list)  # every node's name, the first one's first
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    rest_url: str = ""  # slurmrestd's, where ``start_cluster(rest=True)`` started it
    rest_socket: str = ""  # the same slurmrestd's unix socket (unix:/path)
    rest_dir: Path | None = None  # slurmrestd's readable copy of slurm.conf (it reads it as REST_USER)

    def token(self, user: str = "root", lifespan: int = 3600) -> str:
        """A JWT of slurmctld's for ``user`` (``scontrol token``), for slurmrestd's X-SLURM-USER-TOKEN."""
        out = self.run("scontrol", "token", f"username={user}", f"lifespan={lifespan}").stdout
        return out.strip().split("=", 1)[1]

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment, with the cluster's SLURM_CONF."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUPORT_"))}
        env.update(SLURM_CONF=str(self.conf), **extra)
        return env

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, check=check, timeout=60)

    def _start(self, name: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.base / f"{name}.out", "ab") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(**(env or {})), start_new_session=True
            )
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        parts = []
        for path in (self.base / f"{name}.out", self.base / f"{name}.log"):
            with contextlib.suppress(OSError):
                parts.append(path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def wait_idle(self) -> None:
        """Until the node takes jobs."""
        deadline = time.monotonic() + START_TIMEOUT
        last = ""
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} ended:\n{self.log('slurmctld')}\n{self.log('slurmd')}")
            done = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
            last = done.stdout + done.stderr
            if done.returncode == 0 and set(done.stdout.split()) <= {"idle", "mixed", "allocated"} and done.stdout:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm node is not idle in {START_TIMEOUT}s ({last.strip()}):\n{self.log('slurmd')}")

    def cancel_all(self) -> None:
        """Cancel every job of the cluster (between tests)."""
        self.run("scancel", "--full", "-u", "root", check=False)

    def close(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        if self.rest_dir is not None:
            shutil.rmtree(self.rest_dir, ignore_errors=True)


def start_cluster(base: Path, tries: int = 3, nodes: int = 1, shards: bool = True, rest: bool = False) -> SlurmCluster:
    """munged, slurmctld and one slurmd per node (``nodes``) with a config in ``base``, each GPU cut into
    4 shards (gres/shard) unless not ``shards``; ready when this returns. With ``rest``, slurmctld also
    takes JWTs (``AuthAltTypes=auth/jwt``, a key made here) and slurmrestd listens on ``rest_url``
    and ``rest_socket`` (``-a rest_auth/jwt``, as ``REST_USER``; its log is ``slurmrestd.out``). A daemon that lost its
    port to another process in between is started again, on other ports."""
    for attempt in range(tries):
        try:
            return _start_cluster(base, nodes, shards, rest)
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _start_cluster(base: Path, count: int = 1, shards: bool = True, rest: bool = False) -> SlurmCluster:
    base.mkdir(parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    for folder in ("state", "spool", "munge"):
        (base / folder).mkdir(mode=0o700, exist_ok=True)
    for left in ("munge/munge.sock", "munge/munge.key", *(f"{d}.{e}" for d in TOOLS[:3] for e in ("out", "log"))):
        (base / left).unlink(missing_ok=True)  # an earlier try's
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = base / "munge" / "munge.sock"
    # The first node is this machine's name; the others (node2, ...) are more slurmd on this machine,
    # each for its own NodeName (slurmd -N), on a port of its own.
    names = [node] + [f"node{n}" for n in range(2, count + 1)]
    gpus = [base / f"{'' if n == node else n + '-'}gpu{i}" for n in names for i in range(2)]
    for gpu in gpus:  # character devices (slurmd wants them), /dev/null's: nothing to touch behind them
        with contextlib.suppress(FileNotFoundError):
            gpu.unlink()
        os.mknod(gpu, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    conf = base / "slurm.conf"
    each = "-%n" if count > 1 else ""  # a spool folder, pid and log file per slurmd
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname={node} NodeAddr=127.0.0.1"
        + (f" Port={_free_port()}" if count > 1 else "")
        + f" CPUs={NODE_CPUS} RealMemory={NODE_MEMORY_MB} Gres=gpu:2{',shard:4' if shards else ''} State=UNKNOWN"
        for n in names
    )
    conf.write_text(
        f"""ClusterName=gpuport-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base / "state"}
SlurmdSpoolDir={base / "spool"}{each}
SlurmctldPidFile={base / "slurmctld.pid"}
SlurmdPidFile={base / "slurmd"}{each}.pid
SlurmctldLogFile={base / "slurmctld.log"}
SlurmdLogFile={base / "slurmd"}{each}.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=100
GresTypes=gpu{",shard" if shards else ""}
ReturnToService=2
KillWait=5
MinJobAge=30
JobCompType=jobcomp/filetxt
JobCompLoc={base / "jobcomp.txt"}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MaxJobCount=20000
{node_lines}
PartitionName=debug Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes={",".join(names)} MaxTime=10 State=UP
"""
    )
    gres = "".join(
        f"NodeName={n} Name=gpu File={base}/{'' if n == node else n + '-'}gpu[0-1]\n"
        + (f"NodeName={n} Name=shard Count=4 File={base}/{'' if n == node else n + '-'}gpu[0-1]\n" if shards else "")
        for n in names
    )
    if rest:
        jwt_key = base / "state" / "jwt.key"  # slurmctld's alone: it signs and checks the tokens
        jwt_key.unlink(missing_ok=True)
        jwt_key.write_bytes(os.urandom(64))
        jwt_key.chmod(0o400)
        with conf.open("a") as f:
            f.write(f"AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key={jwt_key}\n")
    (base / "gres.conf").write_text(f"AutoDetect=off\n{gres}")
    cluster = SlurmCluster(base, node, conf, names)
    try:
        cluster._start(
            "munged",
            _tool("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={base / 'munge' / 'munged.pid'}",
            f"--log-file={base / 'munge' / 'munged.log'}",
            f"--seed-file={base / 'munge' / 'munged.seed'}",
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not sock.exists():
            if time.monotonic() > deadline or cluster.processes[0].poll() is not None:
                raise RuntimeError(f"munged did not start:\n{cluster.log('munged')}")
            time.sleep(0.05)
        cluster._start("slurmctld", _tool("slurmctld"), "-D", "-i", "-f", str(conf))
        for name in names:
            if count > 1:
                (base / f"spool-{name}").mkdir(mode=0o700, exist_ok=True)
            extra = ("-N", name) if count > 1 else ()
            cluster._start(
                "slurmd" if name == node else f"slurmd-{name}", _tool("slurmd"), "-D", "-f", str(conf), *extra
            )
        cluster.wait_idle()
        if rest:
            cluster.rest_url = start_rest(cluster)
            cluster.rest_socket = f"unix:{cluster.rest_dir / 'slurmrestd.sock'}"
    except BaseException:
        cluster.close()
        raise
    return cluster


def start_rest(cluster: SlurmCluster, apis: str = "openapi/v0.0.38,openapi/v0.0.37", name: str = "slurmrestd") -> str:
    """A slurmrestd (its log: ``name``.out) on a free port of 127.0.0.1 and on the unix socket
    ``name``.sock, taking JWTs, offering the API versions ``apis`` (not the dbv0.0.* ones: this
    cluster has no slurmdbd), as REST_USER once its sockets are open; its URL. Ended with the cluster."""
    port = _free_port()
    (cluster.base / f"{name}.out").unlink(missing_ok=True)
    # It reads slurm.conf and binds its unix socket once it is REST_USER, who cannot enter the test's
    # (private) folder: a folder of its own.
    if cluster.rest_dir is None:
        cluster.rest_dir = Path(tempfile.mkdtemp(prefix="gpuport-slurmrestd-"))
        cluster.rest_dir.chmod(0o755)
        user = pwd.getpwnam(REST_USER)
        os.chown(cluster.rest_dir, user.pw_uid, user.pw_gid)  # its unix socket is made there, as REST_USER
        shutil.copyfile(cluster.conf, cluster.rest_dir / "slurm.conf")
        (cluster.rest_dir / "slurm.conf").chmod(0o644)
    process = cluster._start(
        name,
        _tool("slurmrestd"),
        "-f",
        str(cluster.rest_dir / "slurm.conf"),
        "-a",
        "rest_auth/jwt",
        "-s",
        apis,
        "-u",
        REST_USER,
        "-vv",
        f"127.0.0.1:{port}",
        f"unix:{cluster.rest_dir / (name + '.sock')}",
        env={"SLURM_JWT": "daemon"},
    )
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"slurmrestd ended:\n{cluster.log(name)}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"slurmrestd does not listen in {START_TIMEOUT}s:\n{cluster.log(name)}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"
