"""The small supervisor that runs one job, detached from the server.

Started as ``python -I -S supervisor.py JOB_DIR`` in its own session: it needs only the standard
library, so it starts in a few milliseconds, and it outlives a server that is killed or restarted.
It reads ``JOB_DIR/spec.marshal``, runs the job's processes, each in its own process group, appends
their output to ``JOB_DIR/log``, and writes ``JOB_DIR/exit.json`` (atomically) when they have ended.

The spec holds ``argv``, ``cwd``, ``env``, ``grace`` (seconds from SIGTERM to SIGKILL),
``time_limit`` (seconds; 0 or null: none) and ``log_limit`` (bytes of the log kept on disk, its
first and last halves, see ``_LogCap``; 0 or null: all of it), and optionally, for distributed
training on this machine:

- ``nprocs``: how many processes (ranks) run ``argv``; default 1.
- ``tf_roles``: ``[[role, count], ...]`` adding up to ``nprocs``, e.g. ``[["chief", 1], ["worker", 2]]``;
  ranks take the roles in that order. Default: every rank is a ``worker``. With a ``chief``, the
  job ends when the chief has exited 0: parameter servers (and the workers of
  ParameterServerStrategy) serve until they are stopped, so the others are then stopped and the
  job succeeds.
- ``rank_gpus``: one list of GPU indices per rank, which becomes that rank's CUDA_VISIBLE_DEVICES
  (an empty list: no GPU). Default: every rank keeps the one in ``env``.
- ``inherit``: prefixes of variables of this process's own environment that the job's gets too
  (a Slurm allocation's ``CUDA_VISIBLE_DEVICES`` and ``SLURM_*``); default: none.
- ``srun``: a job over the nodes of the Slurm allocation this runs in: ``srun``, ``scontrol`` and
  ``scancel`` (the commands' paths), ``per_node`` (ranks on each node) and ``gpus`` (GPUs on each
  node). Each rank starts through ``srun`` on its node (see ``_srun_ranks``), and a stop reaches
  the ranks through ``scancel``, since srun ends its step with SIGKILL at once when it gets SIGTERM.
- ``link``: ``{"argv": [...], "env": {...}}``, a program that serves the job's worker endpoints to
  the server over the network (a Slurm job's: ``executors/slurm_link.py``). It starts before
  anything of the job, with this process's environment and ``env``; its first line of output is
  ``ready`` (else what went wrong: the job does not start, and exit.json gives it as ``error``);
  it ends with this process (its parent-death signal), and is killed once the job has ended.
- ``cgroup``: the job's cgroups, made by the server with its limits (``server/cgroups.py``). The
  job's first process starts in them (this process joins them just before, and leaves right
  after); an OOM kill in them ends the whole job; once it has ended, what is left in them is
  killed and they are removed.

One process (the default) writes its stdout and stderr straight to the log, with nothing added to
its environment. With ``nprocs`` N > 1, rank r also gets TF_CONFIG (a cluster of one free
127.0.0.1 port per rank, and its own task), MASTER_ADDR and MASTER_PORT (one more free port, for
torch.distributed), RANK, LOCAL_RANK, GPUPORT_RANK (all r), WORLD_SIZE, LOCAL_WORLD_SIZE and
GPUPORT_NPROCS (all N). A thread per rank copies the rank's output into the log, whole lines
prefixed with ``[r] ``. The first rank that fails (a non-zero exit code or a signal) stops the
others, since the rest of a collective would wait for it forever: the job's exit code is that
rank's, and exit.json names it in ``failed_rank``.

While it runs it holds an exclusive ``flock`` on ``JOB_DIR/supervisor.lock``: a restarted server
knows the job is still running when it cannot take that lock, with no pid-reuse guesswork, and
``JOB_DIR/supervisor.json`` gives ``pid`` (its own), ``child`` (rank 0's pid), ``children`` (every
rank's pid), ``started_at`` and, in a sandbox, ``init`` (its pid 1, as the host sees it: bubblewrap's
child, whose namespaces are the job's).

Signals: SIGTERM or SIGINT (cancel) is passed to every rank's process group; after the grace period,
SIGKILL follows. A job past its time limit is stopped the same way, by the supervisor itself (so the
limit holds while no server runs). SIGUSR1 kills the job at once, with SIGKILL and no grace, for the
reason the server wrote to ``JOB_DIR/kill.json`` (``{"reason": "..."}``, e.g. from its GPU memory
watchdog); the log ends with ``gpuport: job killed: <reason>``. Send it only once supervisor.json
exists: until its handler is in place, SIGUSR1 would end the supervisor itself. Once the ranks have
ended, whatever they left running in their process groups is killed, so that it holds no GPU.

exit.json holds ``started_at``, ``ended_at`` and ``exit_code`` (the first failing rank's return code,
negative for a signal; 0 when every rank exited 0), and where they apply ``cancelled`` (true),
``timed_out`` (true), ``killed`` (the reason: the server's, or the kernel's OOM killer's in the
job's cgroup, "exceeded its memory limit of 256MiB", then with ``oom`` true), ``failed_rank`` (N > 1 only), ``error`` (the
job could not start; exit code 127) and ``process_cap`` (a fork failed at the job's cap of
processes, which it gives).
"""

from __future__ import annotations

# Every import here is on the path from a job's start to its first line, so there are few:
# - not subprocess, whose imports took 25 ms of a 45 ms start: os.posix_spawn does what is needed
#   (a new session, the log as stdout and stderr, /dev/null as stdin) and raises OSError for a
#   command that cannot start;
# - _signal, the module under signal, whose Signals enum costs 8 ms more to import;
# - the spec in marshal, not JSON (the server's Python writes it, this same Python reads it);
#   json, for what the server reads back, is imported once the job runs.
import _signal as signal
import fcntl
import marshal
import os
import select
import sys
import threading
import time

_LOG_CHECK_INTERVAL = 1.0  # seconds between looks at a running job's log size, when it has a limit
_LOG_CUT_STEP = 1 << 20  # bytes: a log past its limit is cut by at least this much at a time
_BLOCK = 4096  # a hole is punched in whole blocks: one the note lies in stays data
_READ_SIZE = 1 << 16  # bytes read from a rank's pipe at once: what a pipe holds by default
_LONGEST_LINE = 1 << 20  # bytes of a line without a newline kept back before it is written anyway
_DRAIN_TIMEOUT = 5.0  # seconds to wait for the ranks' last output once their process groups are gone
_FAILED_RANK_OUTPUT_WAIT = 0.5  # seconds to wait for a failed rank's last lines (its traceback)
_LINK_START_TIMEOUT = 120.0  # seconds for a job's link to say it is ready (a busy node imports slowly)


def _write_json(path: str, data: dict, durable: bool = True) -> None:
    import json

    _replace(path, json.dumps(data), durable)


def _replace(path: str, text: str, durable: bool = True) -> None:
    """``path`` holds ``text`` at once, whole (written beside it, then renamed over it)."""
    temp = f"{path}.tmp"
    with open(temp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(temp, path)


def _write_new(path: str, data: bytes) -> None:
    """Write a new file ``path`` in a folder the job can write: never through a link it left there
    (O_NOFOLLOW, and O_EXCL once whatever was there is gone), never into a FIFO it made."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(path, flags, 0o644)
    try:
        with os.fdopen(fd, "wb", buffering=0, closefd=False) as f:
            _write_all(f, data)
    finally:
        os.close(fd)


class _LogCap:
    """Keeps a job's log within ``limit`` bytes on disk while the job appends to it: its first half
    stays, and once what follows passes the other half, the bytes between are punched out of the
    file (``fallocate``: a hole, which holds no disk and which readers skip), ending in a note of
    how much was cut. The log's length and every offset in it stay as they were, so a follower
    goes on where it was. Where the file system cannot punch holes, the log is left whole."""

    def __init__(self, path: str, limit: int) -> None:
        # Its own descriptor, without O_APPEND: Linux's pwrite appends on one that has it.
        self.log = os.open(path, os.O_WRONLY | os.O_CLOEXEC) if limit else -1
        self.limit = limit
        self.head = max(_BLOCK, limit // 2 // _BLOCK * _BLOCK)  # kept from the start
        self.punched = self.head  # the hole ends here (its note starts here)
        self.next_check = time.monotonic() + _LOG_CHECK_INTERVAL
        self._fallocate = None

    def check(self) -> None:
        self.next_check = time.monotonic() + _LOG_CHECK_INTERVAL
        if self.log < 0 or not self.limit:
            return
        size = os.fstat(self.log).st_size
        note_at = (size - (self.limit - self.head) + _BLOCK) // _BLOCK * _BLOCK  # the tail then fits
        if note_at - self.punched < _LOG_CUT_STEP:
            return
        if self._fallocate is None:
            import ctypes  # here: most logs never reach their limit

            libc = ctypes.CDLL(None, use_errno=True)
            libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            self._fallocate = libc.fallocate
        note = ""
        for _ in range(2):  # the note's own bytes are cut from the job's too
            cut = note_at + len(note) - self.head
            note = f"\n[gpuport: {cut:,} bytes of this log were cut here, to keep it within {self.limit:,} bytes]\n"
        if self._fallocate(self.log, 3, self.head, note_at - self.head) != 0:  # PUNCH_HOLE | KEEP_SIZE
            self.limit = 0  # not on this file system: the log stays whole
            return
        os.pwrite(self.log, note.encode(), note_at)  # over the job's bytes there, which are cut too
        self.punched = note_at

    def close(self) -> None:
        if self.log >= 0:
            os.close(self.log)


def _write_all(log, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[log.write(view) :]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on 127.0.0.1 now."""
    import socket  # only distributed jobs need it

    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", 0))
        # All held at once, so the kernel hands out distinct ports; all closed (by `finally`) just
        # before the ranks start, so that they can bind them.
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def roles_of(tf_roles: list | tuple | None, nprocs: int) -> list[str]:
    """Each rank's TF_CONFIG role, from (role, count) pairs (None: all workers)."""
    roles = [role for role, count in tf_roles or [["worker", nprocs]] for _ in range(count)]
    assert len(roles) == nprocs, f"tf_roles {tf_roles} must count {nprocs} processes"
    return roles


def peer_envs(
    roles: list[str], endpoints: list[str], master: tuple[str, int], per_node: int, nodes: list[str] | None = None
) -> list[dict[str, str]]:
    """What each rank of a distributed job needs to find its peers: TF_CONFIG (rank r listens at
    ``endpoints[r]``), MASTER_ADDR/MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and
    GPUPORT_RANK/GPUPORT_NPROCS; over several ``nodes`` (their addresses, ``per_node`` ranks on each)
    NODE_RANK, GPUPORT_NODE_RANK and GPUPORT_NODE_IPS too. Used here for the ranks on one machine
    and by the Ray executor for a job over several nodes."""
    import json

    cluster: dict[str, list[str]] = {}
    tasks = []
    for role, endpoint in zip(roles, endpoints):
        listed = cluster.setdefault(role, [])
        tasks.append({"type": role, "index": len(listed)})
        listed.append(endpoint)
    nprocs = len(roles)
    envs = []
    for rank in range(nprocs):
        env = {
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": tasks[rank]}),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GPUPORT_RANK": str(rank),
            "GPUPORT_NPROCS": str(nprocs),
        }
        if nodes is not None:
            env["NODE_RANK"] = env["GPUPORT_NODE_RANK"] = str(rank // per_node)
            env["GPUPORT_NODE_IPS"] = ",".join(nodes)
        envs.append(env)
    return envs


# The ports of a node, as a probe run there by srun prints them: its name, then the ports.
_PORTS_PROBE = """import os, socket
held = [socket.socket() for _ in range(%d)]
for s in held:
    s.bind(("", 0))
print(os.environ.get("SLURMD_NODENAME", ""), *(s.getsockname()[1] for s in held))
"""


def _srun_ranks(spec: dict, nprocs: int) -> None:
    """Set the spec's ``rank_env`` and ``rank_argv`` for a job over the nodes of the Slurm allocation
    this runs in (the spec's ``srun``): the nodes from ``scontrol show hostnames $SLURM_JOB_NODELIST``,
    their addresses from ``scontrol show node``, ports free on each node now (one srun step that
    asks them all), and the rank variables from ``peer_envs``. Rank r runs on node ``r // per_node``
    through ``srun`` as a step of one task: with GPUs to spare, ``gpus // per_node`` of its node's of
    its own (``--exact``); with fewer GPUs than ranks, the node's GPUs shared (``--overlap``).
    Raises ``OSError`` or ``RuntimeError`` when Slurm's commands fail."""
    import subprocess  # only a job over several nodes needs it

    slurm = spec["srun"]
    env = spec["env"]

    def output(argv: list) -> str:
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{os.path.basename(argv[0])} {argv[1]} did not answer in 120 s") from None
        if done.returncode:
            said = (done.stderr or done.stdout).strip()[-500:]
            raise RuntimeError(f"{os.path.basename(argv[0])} {argv[1]} exited with {done.returncode}: {said}")
        return done.stdout

    names = output([slurm["scontrol"], "show", "hostnames", env["SLURM_JOB_NODELIST"]]).split()
    per = int(slurm["per_node"])
    if len(names) * per != nprocs:
        raise RuntimeError(f"the allocation has {len(names)} nodes for {nprocs} processes, {per} on each")
    addresses = {}
    for line in output([slurm["scontrol"], "-o", "show", "node", ",".join(names)]).splitlines():
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        addresses[fields.get("NodeName", "")] = fields.get("NodeAddr", "")
    ips = [addresses.get(name) or name for name in names]
    probe = [slurm["srun"], "--overlap", f"--nodes={len(names)}", f"--ntasks={len(names)}", "--ntasks-per-node=1"]
    ports = {}
    for line in output([*probe, sys.executable, "-I", "-S", "-c", _PORTS_PROBE % (per + 1)]).splitlines():
        name, *found = line.split()
        ports[name] = [int(port) for port in found]
    missing = [name for name in names if len(ports.get(name, ())) != per + 1]
    if missing:
        raise RuntimeError(f"node {missing[0]} did not say which ports are free there")
    endpoints = [f"{ips[rank // per]}:{ports[names[rank // per]][rank % per]}" for rank in range(nprocs)]
    roles = roles_of(spec.get("tf_roles"), nprocs)
    peers = peer_envs(roles, endpoints, (ips[0], ports[names[0]][per]), per, nodes=ips)
    gpus = int(slurm.get("gpus") or 0)
    step = ["--exact", f"--gres=gpu:{gpus // per}", "--mem=0"] if gpus >= per and gpus else ["--overlap"]
    spec["rank_env"] = [{**peers[rank], "GPUPORT_NODE": names[rank // per]} for rank in range(nprocs)]
    spec["rank_argv"] = [
        [slurm["srun"], "--nodes=1", "--ntasks=1", f"--nodelist={names[rank // per]}", *step, "--"]
        for rank in range(nprocs)
    ]


def _rank_envs(spec: dict, nprocs: int) -> list[dict[str, str]]:
    """The environment of each rank: the job's, plus what distributed training needs to find its peers."""
    rank_gpus = spec.get("rank_gpus")
    roles = roles_of(spec.get("tf_roles"), nprocs)
    assert rank_gpus is None or len(rank_gpus) == nprocs, f"rank_gpus must have {nprocs} lists"
    given = spec.get("rank_env")  # a part of a job over several nodes: its peers are on other nodes
    if nprocs > 1 and not given:
        *ports, master_port = _free_ports(nprocs + 1)
        peers = peer_envs(roles, [f"127.0.0.1:{port}" for port in ports], ("127.0.0.1", master_port), nprocs)
    envs = []
    for rank in range(nprocs):
        env = dict(spec["env"])
        if given:
            env.update(given[rank])
        elif nprocs > 1:
            env.update(peers[rank])
        if rank_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in rank_gpus[rank])
        envs.append(env)
    return envs


class _Rank:
    """One process of the job, started in a session of its own (so that a stop reaches every process
    it starts); ``output`` is the read end of its stdout+stderr pipe when it has one."""

    def __init__(self, argv: list, env: dict, stdout: int | None) -> None:
        self.output: int | None = None
        if stdout is None:
            self.output, stdout = os.pipe()
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, stdout, 1)]
        actions.append((os.POSIX_SPAWN_DUP2, stdout, 2))
        try:
            # The search for argv[0] uses this process's PATH: the job's, set in main().
            self.pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True)
        finally:
            if self.output is not None:
                os.close(stdout)  # the child holds the write end now
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once it has ended (negative: the signal that killed it), else None."""
        if self.returncode is None:
            _reap()
            self.returncode = _reaped.pop(self.pid, None)
        return self.returncode


_reaped: dict[int, int] = {}  # exit codes of children that ended, by pid, until their _Rank reads them


def _reap() -> None:
    """Collect every child that has ended: the ranks, and in a sandbox, where this process is pid 1,
    whatever the job left orphaned (which would otherwise stay a zombie)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        _reaped[pid] = os.waitstatus_to_exitcode(status)


def _copy_lines(fd: int, prefix: bytes, log, log_lock: threading.Lock) -> None:
    """Copy a rank's output into the log, prefixed line by line, until every writer has closed it.

    Only whole lines are written, each batch in one write under ``log_lock``, so that the lines
    of different ranks never mix. A last line without a newline gets one.
    """
    separator = b"\n" + prefix
    pending = bytearray()  # the start of a line whose end has not come yet

    def write(lines: bytes) -> None:
        try:
            with log_lock:
                _write_all(log, prefix + lines.replace(b"\n", separator) + b"\n")
        except OSError:  # a full disk: the output is lost, but the rank must not block on a full pipe
            pass

    while chunk := os.read(fd, _READ_SIZE):
        end = chunk.rfind(b"\n")
        if end < 0:
            pending += chunk
            if len(pending) >= _LONGEST_LINE:  # progress bars redrawn with \r: memory stays bounded
                write(bytes(pending))
                pending.clear()
            continue
        write(bytes(pending) + chunk[:end])
        pending = bytearray(chunk[end + 1 :])
    if pending:
        write(bytes(pending))
    os.close(fd)


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # gone already
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already
        pass


class _Groups:
    """The job's cgroups, as the server made them (the spec's ``cgroup``; see server/cgroups.py).

    ``enter`` before the job's first process starts and ``leave`` right after: the job and all it
    forks are inside, held to its limits, while this process stays outside, so that it outlives an
    OOM kill of the job's and reports it. On cgroup v1, ``fd`` (an eventfd) wakes the loop on an OOM
    in the job's group, which then ends the whole job, as ``memory.oom.group`` does on v2.
    """

    def __init__(self, spec: dict | None) -> None:
        self.spec = spec or {}
        self.fd: int | None = None
        self._control: int | None = None

    def enter(self) -> str:
        """Put this process in the job's groups; returns an error ('' : done)."""
        for folder in self.spec.get("dirs", ()):
            try:
                self._move(folder)
            except OSError as e:
                self.leave()
                return f"cannot enter the job's cgroup {folder}: {e.strerror}"
        return ""

    def join_user(self) -> None:
        """v1: go into the job's owner's cpu group, for good (all this process starts goes with it):
        its CPU time is that user's share. Moved as one thread, without the lock (see ``_move``)."""
        if self.spec.get("cpu") and threading.active_count() == 1:
            try:
                _write_file(os.path.join(self.spec["cpu"], "tasks"), "0")
            except OSError:  # the job runs all the same, its CPU time not divided by user
                pass

    def leave(self) -> None:
        for folder in self.spec.get("homes", ()):
            try:
                self._move(folder)
            except OSError:  # stays in the job's group: its memory is small, and counted there
                pass

    def _move(self, folder: str) -> None:
        # A write to cgroup.procs takes a lock that waits for an RCU grace period: 12-20 ms of each
        # job's start, for the two moves in each of two v1 hierarchies. On v1, the calling thread
        # moves itself without it ("0" to ``tasks``): the whole process, while it has one thread.
        if self.spec.get("version") == 1 and threading.active_count() == 1:
            _write_file(os.path.join(folder, "tasks"), "0")
        else:
            _write_file(os.path.join(folder, "cgroup.procs"), str(os.getpid()))

    def watch(self) -> None:
        """v1: have the kernel signal ``fd`` on each OOM in the job's group (or above it)."""
        memory = self.spec.get("memory")
        if self.spec.get("version") != 1 or not memory:
            return
        try:
            self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._control = os.open(os.path.join(memory, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
            _write_file(os.path.join(memory, "cgroup.event_control"), f"{self.fd} {self._control}")
        except OSError:  # the end still finds an OOM kill in the counters
            self.close_fds()

    def woken(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except (OSError, TypeError):
            pass

    def _counter(self, name: str, key: str) -> int:
        folder = self.spec.get("pids" if name == "pids.events" else "memory")
        if not folder:
            return 0
        try:
            with open(os.path.join(folder, name)) as f:
                text = f.read()
        except OSError:
            return 0
        if not key:
            return int(text.strip() or 0)
        for line in text.splitlines():
            field, _, value = line.partition(" ")
            if field == key:
                return int(value)
        return 0

    def oom_kills(self) -> int:
        """Processes of the job the kernel's OOM killer has ended."""
        return self._counter("memory.oom_control" if self.spec.get("version") == 1 else "memory.events", "oom_kill")

    def oom_reason(self) -> str:
        """Why: the job's own limit (its group hit it), or the memory of all jobs together."""
        if self.spec.get("version") == 1:  # its peak reached its limit (failcnt misses memory + swap's)
            peak = max(
                self._counter("memory.max_usage_in_bytes", ""), self._counter("memory.memsw.max_usage_in_bytes", "")
            )
            own = peak >= self._counter("memory.limit_in_bytes", "") - _NEAR_LIMIT
        else:
            own = self._counter("memory.events", "oom") > 0
        return self.spec["oom_own"] if own else self.spec["oom_other"]

    def capped(self) -> int:
        """The job's cap of processes and threads when a fork failed at it, else 0."""
        return self.spec.get("processes", 0) if self._counter("pids.events", "max") else 0

    def close_fds(self) -> None:
        for fd in (self.fd, self._control):
            if fd is not None:
                os.close(fd)
        self.fd = self._control = None

    def remove(self) -> None:
        """Kill whatever is left in the job's groups (a process that left its process group is still
        there), then remove them; one that stays busy is the server's to remove (``tidy``)."""
        self.close_fds()
        for folder in self.spec.get("dirs", ()):
            deadline = time.monotonic() + 1.0
            while True:
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                try:
                    with open(os.path.join(folder, "cgroup.procs")) as f:
                        left = [int(pid) for pid in f.read().split()]
                except (OSError, ValueError):
                    left = []
                for pid in left:
                    if pid != os.getpid():  # this one is never there (``leave``), but never killed
                        _signal_pid(pid, signal.SIGKILL)
                time.sleep(0.005)


# Bytes below its v1 limit at which a job's peak counts as having reached it: charges come in batches.
_NEAR_LIMIT = 4 << 20
# The log's last line when a fork failed at the job's cap (``pids.max``).
_CAPPED = "the job reached its cap of {} processes and threads, and a fork failed (`gpuport quota list` shows it)"


def _write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _kill_reason(job_dir: str) -> str:
    import json

    try:
        with open(os.path.join(job_dir, "kill.json")) as f:
            return str(json.load(f)["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return "by the server (no reason given)"


def _describe(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    import signal as signals  # the enum of names: only now, when one is needed

    try:
        return f"was killed by signal {-code} ({signals.Signals(-code).name})"
    except ValueError:
        return f"was killed by signal {-code}"


def _start_ranks(spec: dict, nprocs: int, log, log_lock: threading.Lock):
    """Start every rank (and, for N > 1, its log thread); stop at the first that cannot start.

    Returns the processes started, their log threads, and the error that stopped the start, if any.
    """
    ranks: list[_Rank] = []
    readers: list[threading.Thread] = []
    # posix_spawn has no working directory of its own: the children inherit this process's, and
    # look their command up on the job's PATH.
    os.chdir(spec["cwd"])
    os.environ["PATH"] = spec["env"].get("PATH", os.defpath)
    if spec.get("srun") and not spec.get("rank_argv"):
        try:
            _srun_ranks(spec, nprocs)
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            return ranks, readers, f"the Slurm allocation's nodes could not be set up: {e}"
    prefixes = spec.get("rank_argv")
    for rank, env in enumerate(_rank_envs(spec, nprocs)):
        argv = [*prefixes[rank], *spec["argv"]] if prefixes else spec["argv"]
        try:
            process = _Rank(argv, env, log.fileno() if nprocs == 1 else None)
        except OSError as e:
            return ranks, readers, f"cannot start {spec['argv'][0]!r}: {e.strerror}"
        ranks.append(process)
        if nprocs > 1:
            prefix = f"[{spec.get('rank_base', 0) + rank}] ".encode()
            readers.append(threading.Thread(target=_copy_lines, args=(process.output, prefix, log, log_lock)))
            readers[-1].daemon = True  # never keeps the supervisor: see _DRAIN_TIMEOUT
            readers[-1].start()
    return ranks, readers, None


# What the server asked for by signal (SIGTERM/SIGINT: "cancel", SIGUSR1: "kill"), kept from the
# supervisor's first moment to its end, across a sandbox set up again: no request is lost.
_REQUESTED: set = set()


def _listen() -> None:
    """Take note of the server's requests; the loops that run the job act on them."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _REQUESTED.add("cancel"))
    signal.signal(signal.SIGINT, lambda signum, frame: _REQUESTED.add("cancel"))
    signal.signal(signal.SIGUSR1, lambda signum, frame: _REQUESTED.add("kill"))


def _announce(job_dir: str, info: dict) -> None:
    """Write supervisor.json (the server signals this process once it exists), then take up a
    request the server left as a file before it: ``cancel``, or ``kill`` (its reason in kill.json).
    Written without the json module (``_flat_json``): a sandboxed job's is written before the job
    may start, and that import would come first."""
    _replace(os.path.join(job_dir, "supervisor.json"), _flat_json(info), durable=False)
    for request in ("cancel", "kill"):
        if os.path.exists(os.path.join(job_dir, request)):
            _REQUESTED.add(request)


def _start_link(link: dict) -> tuple[int | None, str]:
    """Start the job's link (the spec's ``link``) and wait for its first line: its pid, and what
    went wrong ("": it is ready)."""
    read, write = os.pipe()
    env = dict(os.environ)
    env.update(link.get("env") or {})
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, write, 1)]
    try:
        pid = os.posix_spawn(link["argv"][0], link["argv"], env, file_actions=actions)
    except OSError as e:
        os.close(read)
        return None, f"the job's link to the server could not start: {e.strerror}"
    finally:
        os.close(write)
    said = b""
    deadline = time.monotonic() + _LINK_START_TIMEOUT
    try:
        while b"\n" not in said and len(said) < 4096:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                break
            chunk = os.read(read, 4096)
            if not chunk:
                break
            said += chunk
    finally:
        os.close(read)
    line = said.split(b"\n", 1)[0].decode(errors="replace").strip()
    if line == "ready":
        return pid, ""
    _signal_pid(pid, signal.SIGKILL)
    return None, f"the job's link to the server did not start: {line or 'it said nothing'}"


def main(job_dir: str) -> int:
    _listen()
    job_dir = os.path.abspath(job_dir)  # the ranks' working directory becomes this process's
    lock = open(os.path.join(job_dir, "supervisor.lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another supervisor runs this job", file=sys.stderr)
        return 1
    with open(os.path.join(job_dir, "spec.marshal"), "rb") as f:
        spec = marshal.load(f)
    inherit = tuple(spec.get("inherit") or ())
    if inherit:  # what the cluster's allocation set for it (Slurm's GPUs and SLURM_*)
        spec["env"].update((k, v) for k, v in os.environ.items() if k.startswith(inherit))
    link, problem = _start_link(spec["link"]) if spec.get("link") else (None, "")
    _Groups(spec.get("cgroup")).join_user()
    if problem:
        now = time.time()
        with open(os.path.join(job_dir, "log"), "ab", buffering=0) as log:
            _write_all(log, f"gpuport: {problem}\n".encode())
        status = {"started_at": now, "ended_at": now, "exit_code": 127, "error": problem}
    elif spec.get("sandbox"):
        status = _run_sandboxed(job_dir, spec)
    else:
        with open(os.path.join(job_dir, "log"), "ab", buffering=0) as log:

            def started(info: dict) -> None:
                _announce(job_dir, info)  # read while it runs

            cap = _LogCap(os.path.join(job_dir, "log"), int(spec.get("log_limit") or 0))
            status = _run(spec, log, started, lambda: _kill_reason(job_dir), cap=cap)
            cap.check()
            cap.close()
    if link is not None:
        _signal_pid(link, signal.SIGKILL)
    import resource

    spent = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the job, once reaped
    status["cpu_seconds"] = spent.ru_utime + spent.ru_stime  # for the usage accounting
    _write_json(os.path.join(job_dir, "exit.json"), status)
    return 0


# bubblewrap 0.8 now and then fails to set up a new namespace's loopback, the more often the more
# namespaces are made at once: tries, waiting a little longer before each (at most 1 s, with jitter,
# so that launches that failed together do not try again together): up to about 5 s in all.
_SANDBOX_TRIES = 9


def _run_sandboxed(job_dir: str, spec: dict) -> dict:
    """``_sandboxed_once``, again when bubblewrap failed to set the sandbox up for a passing reason
    before the job started (seen: "bwrap: loopback: Failed RTM_NEWADDR" when many namespaces are
    made at once). Bubblewrap's own messages go to ``setup.log``, never to the job's log, so a
    follower of the log sees the job's bytes only. A cancel or a kill asked for meanwhile ends it:
    the job never started."""
    for attempt in range(_SANDBOX_TRIES):
        status = _sandboxed_once(job_dir, spec, last=attempt == _SANDBOX_TRIES - 1)
        if not status.pop("transient", False):
            break
        if _REQUESTED:
            status = {"started_at": status["started_at"], "ended_at": time.time(), "exit_code": -signal.SIGTERM}
            if "kill" in _REQUESTED:
                status.update(killed=_kill_reason(job_dir), exit_code=-signal.SIGKILL)
            else:
                status["cancelled"] = True
            break
        time.sleep(min(1.0, 0.05 * 2**attempt) * (0.5 + os.urandom(1)[0] / 255))
    _Groups(spec.get("cgroup")).remove()
    return status


def _sandboxed_once(job_dir: str, spec: dict, last: bool = True) -> dict:
    """Run the job in the sandbox ``spec["sandbox"]`` (a bubblewrap command prefix the server made);
    returns the status.

    This one stays outside, as the server's user: it holds the lock, writes supervisor.json with the
    pids as the host sees them (bubblewrap's, whose descendants are the job's), and exit.json.

    A job of one process runs under bubblewrap's own pid 1, which reaps in the job's pid namespace
    (a second Python supervisor inside cost each job 20 ms): the job's environment reaches it as a
    file that ``/bin/sh`` reads once it runs as the job's uid (never as root: an LD_PRELOAD of the
    job's would run in bubblewrap or setpriv), and it ``exec``s the command. This one passes a cancel
    or the time limit on as SIGTERM to the job's process group (that pid 1 leads it), then SIGKILL
    after the grace period to that pid 1, whose end ends every process there, and reads the exit
    code bubblewrap reports.
    A job of several processes gets a second supervisor inside (``--inner``, as its pid 1) that runs
    the ranks as ``_run`` does and reports their status; this one passes a cancel on to it.
    """
    log = os.open(os.path.join(job_dir, "log"), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    # bubblewrap's (and setpriv's) stderr; the job's is the log, from its shell's `exec 2>&1` on
    setup_log = os.open(os.path.join(job_dir, "setup.log"), os.O_RDWR | os.O_TRUNC | os.O_CREAT, 0o600)
    spec_r, spec_w = os.pipe()
    status_r, status_w = os.pipe()
    pids_r, pids_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()  # the write end stays here, never written: its end is this process's
    inner_spec = {k: v for k, v in spec.items() if k not in ("sandbox", "network", "pidns_file", "cgroup")}
    sandbox = spec["sandbox"]
    direct = int(spec.get("nprocs") or 1) == 1
    if direct:  # the environment goes in on fd 3 (bubblewrap copies it to _ENV_FILE), then the command
        cut = sandbox.index("--")
        setup = [a for a in sandbox[1:cut] if a != "--as-pid-1"]
        run = [*sandbox[cut:], "/bin/sh", "-c", _EXEC_WITH_ENV, "gpuport-job", *spec["argv"]]
        argv = [sandbox[0], "--json-status-fd", "5", *setup, "--file", "3", _ENV_FILE, *run]
        passed: tuple = ((log, 1), (setup_log, 2), (spec_r, 3), (pids_w, 5))
    else:
        argv = [sandbox[0], "--json-status-fd", "5", *sandbox[1:], sys.executable, "-I", "-S", __file__, "--inner"]
        passed = ((log, 1), (setup_log, 2), (spec_r, 3), (status_w, 4), (pids_w, 5), (lifeline_r, 6))
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    actions += [(os.POSIX_SPAWN_DUP2, fd, target) for fd, target in passed]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    requested = _REQUESTED
    _listen()
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    started_at = time.time()
    start = time.monotonic()
    # bubblewrap makes the folders leading to its mounts with this umask: the server's 077 would hide
    # them from the job's uid.
    umask = os.umask(0o022)
    groups = _Groups(spec.get("cgroup"))
    try:
        error = groups.enter()  # bubblewrap, and all that runs in the sandbox, starts in the job's groups
        if error:
            raise OSError(error)
        try:
            bwrap = os.posix_spawn(argv[0], argv, {"PATH": os.defpath}, file_actions=actions, setsid=True)
        finally:
            groups.leave()
    except OSError as e:
        error = str(e) if e.strerror is None else f"cannot start the sandbox ({argv[0]}): {e.strerror}"
        os.write(log, f"gpuport: {error}\n".encode())
        return {"started_at": started_at, "exit_code": 127, "error": error, "ended_at": time.time()}
    finally:
        os.umask(umask)
        for fd in (spec_r, status_w, pids_w, lifeline_r):
            os.close(fd)
    groups.watch()
    inner = None
    with os.fdopen(pids_r, "rb", buffering=0, closefd=False) as f:
        line = f.readline()  # bubblewrap's first report: the pid, as the host sees it, of its child
    if line:  # { "child-pid": 123, ... }: read without the json module, whose import would come first
        inner = int(line.split(b'"child-pid":', 1)[1].split(b",", 1)[0].strip(b" }\n"))
    helpers = []
    if inner is not None:
        if spec.get("pidns_file"):
            try:
                _write_new(spec["pidns_file"], os.readlink(f"/proc/{inner}/ns/pid").encode())
            except OSError:  # the job made it impossible: its fake GPUs see none of its use
                pass
        if spec.get("network"):
            helpers.append(_connect_network(spec["network"], inner))
    # Announced before the job may start: the server checks that whoever listens on a worker's
    # socket is one of the job's processes, read from this file (a worker up before it was refused).
    info = {"pid": os.getpid(), "child": bwrap, "children": [bwrap], "started_at": started_at}
    if inner is not None:
        info["init"] = inner  # the sandbox's pid 1: `gpuport exec` and forwards enter its namespaces
    _announce(job_dir, info)
    try:  # what runs inside waits for it: the job starts once the network is up
        with os.fdopen(spec_w, "wb") as f:
            f.write(_shell_exports(spec["env"], spec["cwd"]) if direct else marshal.dumps(inner_spec))
    except BrokenPipeError:  # the sandbox did not start: bubblewrap's message is in the log
        pass
    import json  # noqa: F401 (imported now, while the job starts, for its end: exit.json, the status read back)

    grace = float(spec.get("grace", 5.0))
    time_limit = float(spec.get("time_limit") or 0)
    # An inner supervisor runs as the job's user: it enforces the time limit, and this one makes
    # sure of it a little later, whatever the job did to it. A job run direct is stopped from here.
    backstop = start + time_limit + grace + 10 if time_limit > 0 and not direct else None
    limit_at = start + time_limit if time_limit > 0 and direct else None
    cap = _LogCap(os.path.join(job_dir, "log"), int(spec.get("log_limit") or 0))
    stopped: dict = {}  # why this process stopped a job run direct: cancelled or timed_out
    kill_at = None
    killed = oom = False
    oom_check_at = None  # an OOM was signalled before its kill was counted: look again then
    code = None
    while code is None:
        if "kill" in requested and not killed and inner is not None:
            killed = True
            _signal_pid(inner, signal.SIGKILL)
        if oom_check_at is not None and time.monotonic() >= oom_check_at:
            oom_check_at = None
            if not oom and groups.oom_kills():  # a process of the job was ended: the whole job goes
                oom = True
                _signal_pid(inner, signal.SIGKILL)
        if limit_at is not None and not stopped and time.monotonic() >= limit_at:
            stopped["timed_out"] = True
        elif "cancel" in requested and not stopped and direct:
            stopped["cancelled"] = True
        if (stopped or "cancel" in requested) and kill_at is None and inner is not None:
            if direct:  # bubblewrap's pid 1 leads the job's group, and lets a SIGTERM pass it by
                _signal_group(inner, signal.SIGTERM)
                kill_at = time.monotonic() + grace
            else:
                _signal_pid(inner, signal.SIGTERM)
                kill_at = time.monotonic() + grace + 5
        now = time.monotonic()
        for deadline in (kill_at, backstop):
            if deadline is not None and now >= deadline and inner is not None:
                _signal_pid(inner, signal.SIGKILL)
        pid, wait_status = os.waitpid(bwrap, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(wait_status)
            break
        if cap.limit and now >= cap.next_check:
            cap.check()
        checks = cap.next_check if cap.limit else None
        deadlines = [
            d - now for d in (kill_at, backstop, None if stopped else limit_at, oom_check_at, checks) if d is not None
        ]
        watched = [wake_r] if groups.fd is None else [wake_r, groups.fd]
        ready, _, _ = select.select(watched, [], [], max(0.0, min(deadlines)) if deadlines else None)
        if groups.fd is not None and groups.fd in ready:
            groups.woken()
            oom_check_at = time.monotonic()
            if not groups.oom_kills():  # woken as the kernel picks a victim: counted once it is killed
                oom_check_at += 0.05
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
    cap.check()  # what the job wrote since the last look, too
    cap.close()
    for helper in helpers:  # not waited for: its end took up to 20 ms, and init reaps it once this one exits
        _signal_pid(helper, signal.SIGKILL)
    with os.fdopen(pids_r, "rb") as f:
        reports = f.read(1 << 16)  # and bubblewrap's last: { "exit-code": N }
    with os.fdopen(status_r, "rb") as f:
        reported = _direct_status(reports, started_at, stopped, log) if direct else _reported_status(f.read(1 << 16))
    status = reported or {"started_at": started_at}
    oom = oom or groups.oom_kills() > 0
    oom_reason = groups.oom_reason() if oom else ""
    capped = groups.capped()
    groups.close_fds()  # the groups go once no new try is made (``_run_sandboxed``)
    if killed:
        status["killed"] = reason = _kill_reason(job_dir)
        status["exit_code"] = -signal.SIGKILL
        os.write(log, f"gpuport: job killed: {reason}\n".encode())
    elif oom:
        status["killed"] = reason = oom_reason
        status["oom"] = True
        status.setdefault("exit_code", -signal.SIGKILL)
        os.write(log, f"gpuport: job killed: {reason}\n".encode())
    elif not reported:
        status["exit_code"] = 127
        said = _last_line(setup_log) if code else ""  # bubblewrap's own message, when it failed
        status["error"] = f"the job's sandbox ended without its status (bubblewrap {_describe(code)}{said})"
        status["transient"] = said.startswith(": bwrap: loopback:") and not last
        if not status["transient"]:  # the job's log says why it never ran, once
            os.write(log, f"gpuport: {status['error']}\n".encode())
    if capped:
        status["process_cap"] = capped
        os.write(log, f"gpuport: {_CAPPED.format(capped)}\n".encode())
    status.setdefault("ended_at", time.time())
    signal.set_wakeup_fd(-1)
    for fd in (log, setup_log, wake_r, wake_w, lifeline_w):
        os.close(fd)
    return status


# Where the environment of a job run direct is, in its sandbox, and what reads it: /bin/sh, as the
# job's uid, sources it and runs the command in its place, found on the job's PATH.
_ENV_FILE = "/run/gpuport-env"
_EXEC_WITH_ENV = f'exec 2>&1; . {_ENV_FILE} && exec "$@"'


def _shell_exports(env: dict, cwd: str) -> bytes:
    """``env`` as lines /bin/sh sources: ``export NAME='value'``, single quotes inside closed and
    reopened; names that are not shell names (which no job's env has: the server checks them) are
    left out. The working directory is bubblewrap's ``--chdir``; PWD is set to it as a shell would."""
    lines = []
    for name, value in {**env, "PWD": cwd}.items():
        if name[:1].isdigit() or not name.replace("_", "a").isalnum() or not name.isascii():
            continue
        quoted = "'" + value.replace("'", "'\\''") + "'"
        lines.append(f"export {name}={quoted}\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


_NOT_STARTED = ": exec: "  # in the shell's words for a command that cannot run: "gpuport-job: 1: exec: x: not found"


def _direct_status(reports: bytes, started_at: float, stopped: dict, log: int) -> dict | None:
    """The status of a job run direct, from bubblewrap's reports; None without an exit code (the
    sandbox did not start). Bubblewrap reports a death by signal as a shell does, 128 + the signal:
    read back as one, negative, as ``_run`` reports it (a job that exits 130 itself reads as SIGINT)."""
    import json

    code = None
    for line in reports.splitlines():
        try:
            code = json.loads(line).get("exit-code", code)
        except (ValueError, AttributeError):
            continue
    if not isinstance(code, int) or isinstance(code, bool):
        return None
    status: dict = {"started_at": started_at, **stopped}
    said = _last_line(log, ("gpuport-job: ",))
    if code in (126, 127) and _NOT_STARTED in said:
        command, _, reason = said.split(_NOT_STARTED, 1)[1].rpartition(": ")
        reason = "No such file or directory" if reason == "not found" else reason
        status["error"] = f"cannot start {command!r}: {reason}"
        os.write(log, f"gpuport: {status['error']}\n".encode())
        code = 127
    elif 128 < code <= 128 + 64:
        code = 128 - code
    status["exit_code"] = code
    status["ended_at"] = time.time()
    return status


def _last_line(log: int, starts: tuple = ("bwrap",)) -> str:
    """The log's last line, to name why a sandbox failed (": bwrap: Can't ..."), or ""."""
    end = os.lseek(log, 0, os.SEEK_END)
    tail = os.pread(log, min(end, 4096), max(0, end - 4096)) if end else b""
    lines = tail.decode(errors="replace").strip().splitlines()
    return f": {lines[-1][:300]}" if lines and lines[-1].startswith(starts) else ""


# What exit.json may hold, by type: the inner supervisor runs as the job's user, so what it reports
# is read as a claim about the job itself, and nothing else passes.
_STATUS_FIELDS = {
    "started_at": (int, float),
    "ended_at": (int, float),
    "exit_code": (int,),
    "cancelled": (bool,),
    "timed_out": (bool,),
    "failed_rank": (int,),
    "error": (str,),
}


def _reported_status(data: bytes) -> dict | None:
    """The inner supervisor's status, its known fields of the right types; None for anything else."""
    import json

    try:
        reported = json.loads(data)
    except ValueError:
        return None
    if not isinstance(reported, dict):
        return None
    status = {}
    for key, value in reported.items():
        kinds = _STATUS_FIELDS.get(key)
        # bool is an int: a flag must be a bool, and a number must not be one
        if kinds is not None and isinstance(value, kinds) and isinstance(value, bool) == (kinds == (bool,)):
            status[key] = value
    return status if "exit_code" in status else None


_NETWORK_READY_TIMEOUT = 10.0  # seconds for slirp4netns to give a job's namespace its way out
_LIFELINES: list = []  # write ends of the helpers' exit pipes: closed when this process ends


def _connect_network(command: list, inner: int) -> int:
    """Start ``command`` (slirp4netns) for the network namespace of ``inner``, and wait until it is
    ready; returns its pid. The job's only route out then goes through it, never to the host's
    loopback (where the server and other jobs' forwarded ports would be)."""
    ready_r, ready_w = os.pipe()
    # Its lifeline: the write end stays open in this process only, so slirp4netns ends with it
    # however it ends (SIGKILL too), instead of holding the job's namespace open for ever.
    exit_r, exit_w = os.pipe()
    _LIFELINES.append(exit_w)
    null = os.open(os.devnull, os.O_RDWR)
    actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]
    actions += [(os.POSIX_SPAWN_DUP2, ready_w, 3), (os.POSIX_SPAWN_DUP2, exit_r, 4)]
    argv = [*command, "--ready-fd=3", "--exit-fd=4", str(inner), "tap0"]
    try:
        pid = os.posix_spawn(argv[0], argv, {}, file_actions=actions)
    finally:
        os.close(null)
        os.close(ready_w)
        os.close(exit_r)
    select.select([ready_r], [], [], _NETWORK_READY_TIMEOUT)
    os.close(ready_r)
    return pid


def _inner() -> int:
    """The supervisor inside a job's sandbox, as pid 1 of its pid namespace and the job's uid: the
    spec comes on fd 3, the log is fd 1, and the status goes out on fd 4 (see ``_run_sandboxed``)."""
    with os.fdopen(3, "rb") as f:
        spec = marshal.load(f)
    for fd in (4, 5, 6):  # the ranks get none of these (bubblewrap may have closed its own, 5)
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass
    os.dup2(1, 2)  # bubblewrap's stderr is not the log: the ranks' is
    log = os.fdopen(1, "ab", buffering=0, closefd=False)
    # Killed by the server: the outer supervisor kills this process (pid 1) itself; the lifeline
    # ends when the outer one has ended, and nobody is left to report to.
    status = _run(spec, log, lambda info: None, lambda: "its supervisor outside the sandbox ended", lifeline=6)
    try:
        with os.fdopen(4, "w") as out:
            out.write(_flat_json(status))
    except BrokenPipeError:
        pass
    return 0


def _flat_json(status: dict) -> str:
    """``status`` (str keys; bool, int, finite float, str or list of int values) as JSON, without
    the json module: importing it (and the re module under it) took 5-8 ms of each sandboxed job's end."""
    items = []
    for key, value in status.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, list):
            text = "[" + ", ".join(str(int(item)) for item in value) + "]"
        else:
            text = _json_string(str(value))
        items.append(f"{_json_string(key)}: {text}")
    return "{" + ", ".join(items) + "}"


def _json_string(text: str) -> str:
    out = []
    for char in text:
        code = ord(char)
        if char.isalnum() and code < 0x80 or char in " .,:;-_()/'=+*#@!?[]{}<>|~^$%&`":
            out.append(char)
        elif code > 0xFFFF:  # as a UTF-16 surrogate pair, as JSON spells it
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
        else:
            out.append(f"\\u{code:04x}")
    return '"' + "".join(out) + '"'


def _run(spec: dict, log, started, kill_reason, lifeline: int | None = None, cap: _LogCap | None = None) -> dict:
    """Run the job's ranks to their end; returns the status for exit.json. ``started(info)`` gets the
    pids once they run; ``kill_reason()`` says why, when SIGUSR1 asked for a kill. ``lifeline``: an
    fd whose end (EOF) kills the job too (the supervisor outside a sandbox has ended). The ranks
    start in the job's cgroups when the spec has them (without a sandbox; inside one, they are
    in them already)."""
    nprocs = int(spec.get("nprocs") or 1)
    log_lock = threading.Lock()  # one writer at a time: the ranks' log threads and this one

    def note(text: str) -> None:
        with log_lock:
            _write_all(log, f"gpuport: {text}\n".encode())

    started_at = time.time()
    start = time.monotonic()
    status: dict[str, object] = {"started_at": started_at}
    grace = float(spec.get("grace", 5.0))
    time_limit = float(spec.get("time_limit") or 0)

    # Signal handlers only take note, and the loop below acts: one place decides what happens, and
    # no handler can deadlock on the log's lock held by the code it interrupted. The wakeup fd,
    # written by Python's C-level handler (for SIGCHLD too), wakes that loop from its select().
    requested = _REQUESTED
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    _listen()
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # with SIG_DFL, a rank's end would not wake the loop

    groups = _Groups(spec.get("cgroup"))
    error = groups.enter()
    if error:
        ranks, readers = [], []
    else:
        try:
            ranks, readers, error = _start_ranks(spec, nprocs, log, log_lock)
        finally:
            groups.leave()
        groups.watch()
    stopping = False  # SIGTERM or SIGKILL has been sent: what follows is no rank's own failure
    kill_at = None  # monotonic time at which SIGKILL follows the SIGTERM of a stop

    slurm = spec.get("srun")

    def signal_all(sig: int) -> None:
        if slurm and sig == signal.SIGTERM and ranks:
            # srun would end its step with SIGKILL at once: Slurm passes the SIGTERM to every step
            # of the job (each rank, on its node) but the batch step, which this process runs in.
            argv = [slurm["scancel"], "--signal=TERM", spec["env"]["SLURM_JOB_ID"]]
            try:
                os.posix_spawn(argv[0], argv, spec["env"])
            except OSError as e:
                note(f"scancel could not be started: {e}")
            return
        for process in ranks:
            _signal_group(process.pid, sig)

    def stop() -> None:
        nonlocal stopping, kill_at
        stopping = True
        signal_all(signal.SIGTERM)
        kill_at = time.monotonic() + grace

    if error:
        note(error)
        status.update(exit_code=127, error=error)
        if nprocs > 1:
            status["failed_rank"] = len(ranks)
        stopping = True
        signal_all(signal.SIGKILL)  # the ranks started, if any, have run for a moment: no grace
    else:
        pids = {"pid": os.getpid(), "child": ranks[0].pid, "children": [p.pid for p in ranks]}
        started({**pids, "started_at": started_at})

    codes = [None] * len(ranks)
    first_failure = None  # (rank, code) of the first rank seen to exit with a non-zero code
    killed = oom = False
    oom_check_at = None  # an OOM was signalled before its kill was counted: look again then
    roles = roles_of(spec.get("tf_roles"), nprocs)
    chief = roles.index("chief") if "chief" in roles and len(ranks) == nprocs else None
    chief_done = False  # the chief exited 0: the others are stopped, and their codes are no failure
    while None in codes:
        if "kill" in requested and not killed:
            killed = stopping = True
            signal_all(signal.SIGKILL)
            kill_at = None
        if "cancel" in requested and not stopping:
            status["cancelled"] = True
            stop()
        if oom_check_at is not None and time.monotonic() >= oom_check_at:
            oom_check_at = None
            if not oom and groups.oom_kills():  # a process of the job was ended: the whole job goes
                oom = stopping = True
                signal_all(signal.SIGKILL)
        for rank, process in enumerate(ranks):
            if codes[rank] is not None or (code := process.poll()) is None:
                continue
            codes[rank] = code
            if code != 0 and first_failure is None and not chief_done:
                first_failure = (rank, code)
                if nprocs > 1 and not stopping:
                    status["failed_rank"] = rank
                    readers[rank].join(_FAILED_RANK_OUTPUT_WAIT)  # its traceback first, then why the others stop
                    note(f"rank {rank} {_describe(code)}; stopping the other processes")
                    stop()
        if None not in codes:
            break
        if chief is not None and codes[chief] == 0 and not stopping:
            chief_done = True
            note("the chief has finished; stopping the other processes")
            stop()
        now = time.monotonic()
        if time_limit > 0 and not stopping and now >= start + time_limit:
            status["timed_out"] = True
            stop()
        if kill_at is not None and now >= kill_at:
            signal_all(signal.SIGKILL)
            kill_at = None
        if cap is not None and cap.limit and now >= cap.next_check:
            cap.check()
        checks = cap.next_check if cap is not None and cap.limit else None
        limit_at = None if stopping or time_limit <= 0 else start + time_limit
        deadlines = [t for t in (limit_at, kill_at, oom_check_at, checks) if t is not None]
        watched = [fd for fd in (wake_r, lifeline, groups.fd) if fd is not None]
        ready, _, _ = select.select(watched, [], [], max(0.0, min(deadlines) - now) if deadlines else None)
        if lifeline is not None and lifeline in ready:
            requested.add("kill")
            lifeline = None
        if groups.fd is not None and groups.fd in ready:
            groups.woken()
            oom_check_at = time.monotonic() + (0 if groups.oom_kills() else 0.05)
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:  # drained
            pass

    # What a rank left behind in its group would hold the GPU and the log open.
    signal_all(signal.SIGKILL)
    oom = oom or groups.oom_kills() > 0
    oom_reason = groups.oom_reason() if oom else ""
    capped = groups.capped()
    groups.remove()  # and what left its process group, but not its cgroup
    drain_until = time.monotonic() + _DRAIN_TIMEOUT
    for reader in readers:  # bounded: a process that left its group could hold a pipe open forever
        reader.join(max(0.0, drain_until - time.monotonic()))
    if killed:
        status["killed"] = reason = kill_reason()
        note(f"job killed: {reason}")
    elif oom:
        status["killed"] = oom_reason
        note(f"job killed: {oom_reason}")
    if capped:
        status["process_cap"] = capped
        note(_CAPPED.format(capped))
    status.setdefault("exit_code", first_failure[1] if first_failure else 0)
    status["ended_at"] = time.time()
    signal.set_wakeup_fd(-1)
    for fd in (wake_r, wake_w):
        os.close(fd)
    return status


if __name__ == "__main__":
    code = _inner() if sys.argv[1] == "--inner" else main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and closed: the interpreter's clean-up would only add 10 ms to each job.
    os._exit(code)
