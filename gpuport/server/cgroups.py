"""Limits the kernel enforces: each job, session worker and model replica in a cgroup of its own.

A job's group holds every process of the job (bubblewrap, the job, all it forks) and limits:

- memory: the job's ``--memory``, or by default what the machine has above its memory floor (see
  ``JobService.memory_floor``); swap does not stretch it. Past it the kernel's OOM killer ends a
  process of that job, never the server's or another job's; the job then ends ``killed``, "exceeded
  its memory limit of 256MiB". All jobs of a server together sit in a parent group limited to the
  machine's memory less the floor, so that together they cannot take the server's memory either.
- processes and threads: the pids controller's count, at most the owner's quota (``gpuport quota
  set USER --processes N``; by default ``DEFAULT_PROCESSES_PER_JOB``). A fork past it fails (EAGAIN).
- CPU, where the ``cpu`` controller is there too: divided between users, not processes. Each user's
  jobs share one group of that user's, and every user's group weighs the same: one user's six jobs
  get together what another user's one job gets, when both want more than there is. An idle
  machine's CPUs are anyone's. On cgroup v1 a user's group sits beside the server, in the server's
  own cpu group (``gpuport-<key>-u-<name>``), and weighs what one of its processes does: one user's
  busy jobs leave another user the share of a process of the host's, as when they were alone (in a
  ``gpuport`` group of their own, all users together weighed one process, and one busy user halved
  the others' share; the server, in turn, now meets as many of its processes' weights as users are
  busy). The supervisor and all it starts (bubblewrap, slirp4netns, the job) run in the
  user's group from the supervisor's start: the server moves it there as it starts it. On v2 the
  job's group is made inside its user's (``.../gpuport/<key>/u-<name>/<job id>``), the supervisor
  stays out.

Three kinds of machine:

- cgroup v2 (a ``cgroup2`` hierarchy with the memory and pids controllers): the server needs a group
  it may manage, which systemd gives a service with ``Delegate=yes`` (the printed unit has it). Jobs'
  groups are made in ``<the delegated group>/gpuport/<key>/``; a group with children may hold no
  process, so the server runs in ``<the delegated group>/server``: systemd 254+ puts it there
  (``DelegateSubgroup=server``); outside systemd, the server moves itself there. (A service of an
  older systemd would not start again once its group has children: its server goes without.) A
  job's group kills all its processes on an OOM (``memory.oom.group``).
- cgroup v1 with the ``memory`` and ``pids`` controllers mounted (as in many containers): the job's
  groups are ``<the server's group>/gpuport/<key>/<job id>`` in each hierarchy (and the user's in the
  ``cpu`` one: ``<the server's group>/gpuport-<key>-u-<name>``); the supervisor is
  woken by an OOM in the job's group (an eventfd on ``memory.oom_control``) and kills the job.
- neither, or none writable (a server that is not root, v2 without delegation): no group; the
  banner says why, and the watchdog polls each limited job's resident memory as before.

``<key>`` stands for one server (its jobs folder): servers on one machine keep apart. The server
makes a job's groups and writes the limits before its launch (``Cgroups.make``); the job's supervisor
(``worker/supervisor.py``, which cannot import this module) joins them just before it starts the
job's first process and leaves them again, reads why the job ended and removes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gpuport.protocol.units import format_size

_REMOVE_TIMEOUT = 1.0  # seconds to wait for a group's last processes to go before it can be removed


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of each cgroup file system mounted here."""
    found = []
    with contextlib.suppress(OSError):
        for line in _read("/proc/self/mountinfo").splitlines():
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                root, point = fields[3], fields[4].replace("\\040", " ")
                found.append((root, point, tail[0], set(tail[2].split(","))))
    return found


def _own_groups() -> dict[str, str]:
    """This process's group in each hierarchy: controller name (``""``: v2) → path in the hierarchy."""
    groups = {}
    with contextlib.suppress(OSError):
        for line in _read("/proc/self/cgroup").splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                groups[name] = path
    return groups


def _folder(root: str, point: str, path: str) -> str | None:
    """The folder of group ``path`` under a mount of the hierarchy's ``root`` at ``point``; None when
    the mount does not show it (a container sees its own part of the hierarchy)."""
    if root != "/" and path != root and not path.startswith(root + "/"):
        return None
    rest = path[len(root) :] if root != "/" else path
    return os.path.join(point, rest.lstrip("/")).rstrip("/") or "/"


def server_key(root: Path) -> str:
    """The name of one server's parent group: its jobs folder, hashed."""
    return hashlib.sha256(str(root.absolute()).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Cgroups:
    """Where this server makes its jobs' groups. ``version`` 2, 1, or 0 (none: ``why`` says why)."""

    version: int = 0
    why: str = ""
    controllers: tuple[str, ...] = ()  # of "memory", "pids"
    parents: tuple[str, ...] = ()  # the folder job groups are made in, one per hierarchy (v1) or one (v2)
    homes: tuple[str, ...] = ()  # the server's own groups, where a supervisor goes back to, the same way
    room: int = 0  # bytes all jobs may use together: the machine's memory less the floor (0: no limit)
    cpu_parent: str = ""  # where the users' cpu groups are made ("": no cpu controller)
    cpu_prefix: str = ""  # the start of their names there (v1: "gpuport-<key>-", beside the server)

    @property
    def memory(self) -> bool:
        """Whether the kernel holds each job to its memory limit (else the watchdog polls)."""
        return "memory" in self.controllers

    @property
    def pids(self) -> bool:
        return "pids" in self.controllers

    def describe(self) -> str:
        """One line for the banner."""
        if not self.version:
            return f"none: {self.why}; memory limits are polled (2 Hz), processes not capped"
        if self.memory:
            default = f"default {format_size(self.room)}" if self.room else "no default"
            parts = [f"each job's memory held to its --memory ({default})"]
        else:
            parts = ["memory polled (no memory controller)"]
        parts.append("its processes to the quota" if self.pids else "processes not capped (no pids controller)")
        parts.append("CPU shared equally by users" if self.cpu_parent else "CPU not divided (no cpu controller)")
        return f"cgroup v{self.version}: {', '.join(parts)}"

    def default_memory(self) -> int:
        """The memory limit of a job that asks for none (0: none)."""
        return self.room

    def make(self, job_id: str, memory: int, processes: int, owner: str = "") -> dict | None:
        """Make job ``job_id``'s group(s) with its limits (``memory`` 0: the default), and its owner's
        cpu group where there is none yet; returns what its supervisor needs (the spec's ``cgroup``),
        or None without cgroups. Raises ``OSError``."""
        if not self.version:
            return None
        limit = memory or self.room
        cpu = ""
        if self.cpu_parent:
            cpu = os.path.join(self.cpu_parent, self.cpu_prefix + user_group(owner))
            with contextlib.suppress(FileExistsError):
                os.mkdir(cpu)
                if self.version == 2:  # the job's group in it gets all three
                    _enable(cpu, ("cpu", *_WANTED))
        if self.version == 2 and cpu:
            dirs = [os.path.join(cpu, job_id)]
        else:
            dirs = [os.path.join(parent, job_id) for parent in self.parents]
        for folder in dirs:
            with contextlib.suppress(FileExistsError):  # a job started again on this node
                os.mkdir(folder)
        memory_dir = pids_dir = ""
        if self.version == 2:
            memory_dir = pids_dir = dirs[0]
            if limit:
                _write(os.path.join(dirs[0], "memory.max"), str(limit))
                with contextlib.suppress(OSError):  # no swap accounting: nothing to hold back
                    _write(os.path.join(dirs[0], "memory.swap.max"), "0")
            _write(os.path.join(dirs[0], "memory.oom.group"), "1")  # an OOM ends the whole job
            _write(os.path.join(dirs[0], "pids.max"), str(processes))
        else:
            for controller, folder in zip(self.controllers, dirs):
                if controller == "memory":
                    memory_dir = folder
                    value = str(limit) if limit else "-1"
                    _write(os.path.join(folder, "memory.limit_in_bytes"), value)
                    with contextlib.suppress(OSError):  # memory + swap: only where swap is accounted
                        _write(os.path.join(folder, "memory.memsw.limit_in_bytes"), value)
                else:
                    pids_dir = folder
                    _write(os.path.join(folder, "pids.max"), str(processes))
        if not limit:
            own = "ran out of memory"
        elif memory:
            own = f"exceeded its memory limit of {format_size(limit)}"
        else:
            own = f"exceeded its memory limit of {format_size(limit)} (the default: ask for more with --memory)"
        together = (
            f"ran out of memory: all jobs together may use {format_size(self.room)}, the machine's memory "
            "less its memory floor"
            if self.room
            else "ran out of memory: the machine has no more"
        )
        return {
            "version": self.version,
            "cpu": cpu if self.version == 1 else "",  # v1: the supervisor's own, from its start
            "dirs": dirs,
            "homes": list(self.homes),
            "memory": memory_dir,
            "pids": pids_dir,
            "processes": processes if pids_dir else 0,
            "oom_own": own,
            "oom_other": together,
        }

    def group(self, job_id: str, controller: str) -> str | None:
        """The folder of a job's group in the hierarchy of ``controller`` (None: none here)."""
        if controller not in self.controllers:
            return None
        if self.version == 2:
            return self._v2_group(job_id)
        return os.path.join(self.parents[self.controllers.index(controller)], job_id)

    def _v2_group(self, job_id: str) -> str:
        """v2: the job's group, in its owner's group where CPU is divided (found by looking)."""
        if self.cpu_parent:
            with contextlib.suppress(OSError), os.scandir(self.cpu_parent) as users:
                for user in users:
                    folder = os.path.join(user.path, job_id)
                    if user.name.startswith("u-") and os.path.isdir(folder):
                        return folder
        return os.path.join(self.parents[0], job_id)

    def memory_used(self, job_id: str) -> int | None:
        """Bytes the job's group is charged now (its processes' memory and page cache); None: unknown."""
        folder = self.group(job_id, "memory")
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            return int(_read(os.path.join(folder, name))) if folder else None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        """Remove this server's parent groups once no job's group is left in them (at its stop)."""
        if self.cpu_parent and self.cpu_prefix:  # v1: the users' groups beside the server; never its own
            _remove_empty(self.cpu_parent, itself=False, prefix=self.cpu_prefix)
        for parent in dict.fromkeys((self.cpu_parent if not self.cpu_prefix else "", *self.parents)):
            if not parent:
                continue
            _remove_empty(parent)
            with contextlib.suppress(OSError):  # gpuport/ too, unless another server's are in it
                os.rmdir(os.path.dirname(parent))

    def remove(self, job_id: str) -> None:
        """Remove a job's groups, killing what is left in them (its supervisor does so first; this is
        for one that was killed itself). A user's cpu group stays: another job of theirs may be in it."""
        if self.version == 2:
            remove_group(self._v2_group(job_id))
            return
        for parent in self.parents:
            remove_group(os.path.join(parent, job_id))


def write_tasks(folder: str, tid: int) -> None:
    """Move thread ``tid`` (a process of one thread: all of it) into the v1 group ``folder``. Raises ``OSError``."""
    _write(os.path.join(folder, "tasks"), str(tid))


def user_group(owner: str) -> str:
    """The name of a user's cpu group: ``u-`` and the name (lower case, as names are unique regardless
    of case), or its hash where the name has characters a folder's name should not."""
    name = owner.lower()
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        name = "h" + hashlib.sha256(owner.encode()).hexdigest()[:16]
    return f"u-{name}"


def _remove_empty(parent: str, itself: bool = True, prefix: str = "") -> None:
    """Remove the empty users' groups under ``parent`` (named ``<prefix>u-...``), then (``itself``)
    ``parent`` when it is empty.
    Never a job's group, even empty: its supervisor may not have joined it yet (a server stopped, or
    started, just after a launch), and would then fail to start the job. A job's groups go with its
    supervisor, or, where that was killed, when the server tidies the job (``remove``). Never kills:
    a busy group stays."""
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in list(entries):
            if entry.name.startswith(prefix + "u-") and entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):  # busy: a job of the user's is in it
                    os.rmdir(entry.path)
    if itself:
        with contextlib.suppress(OSError):
            os.rmdir(parent)


def remove_group(folder: str, timeout: float = _REMOVE_TIMEOUT) -> bool:
    """SIGKILL every process left in the group, then remove it; False when it stays (busy, or gone)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(folder)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            if time.monotonic() > deadline:
                return False
        try:
            pids = [int(p) for p in _read(os.path.join(folder, "cgroup.procs")).split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _enable(folder: str, controllers: tuple[str, ...]) -> None:
    """Hand ``controllers`` down to the children of a v2 group."""
    _write(os.path.join(folder, "cgroup.subtree_control"), " ".join(f"+{c}" for c in controllers))


_WANTED = ("memory", "pids")


def _detect_v2(key: str, room: int, mounts: list, own: dict[str, str]) -> Cgroups | str:
    """The v2 groups, or why not."""
    mount = next((m for m in mounts if m[2] == "cgroup2"), None)
    if mount is None or "" not in own:
        return "no cgroup v2 hierarchy"
    folder = _folder(mount[0], mount[1], own[""])
    if folder is None:
        return f"the server's cgroup {own['']} is outside the cgroup2 mount at {mount[1]}"
    try:
        offered = set(_read(os.path.join(folder, "cgroup.controllers")).split())
    except OSError as e:
        return f"cannot read {folder}/cgroup.controllers: {e.strerror}"
    missing = [c for c in _WANTED if c not in offered]
    if missing:
        return f"cgroup v2 at {folder} has no {' or '.join(missing)} controller"
    base = folder
    try:
        if os.path.basename(folder) == "server":  # our own leaf (DelegateSubgroup=server, or an earlier start)
            base = os.path.dirname(folder)
        elif os.environ.get("INVOCATION_ID"):  # a systemd service: its next start must find its group empty
            return (
                f"the server runs in {folder}, not in a server/ subgroup of it: give its systemd unit "
                "Delegate=yes and DelegateSubgroup=server (systemd 254 or later)"
            )
        else:
            others = [p for p in _read(os.path.join(folder, "cgroup.procs")).split() if int(p) != os.getpid()]
            if others:
                return (
                    f"the server's cgroup {folder} holds other processes too: run it as a systemd service "
                    "with Delegate=yes (gpuport server --print-systemd-unit)"
                )
            os.makedirs(os.path.join(folder, "server"), exist_ok=True)
            _write(os.path.join(folder, "server", "cgroup.procs"), str(os.getpid()))
        home = os.path.join(base, "server")
        parent = os.path.join(base, "gpuport", key)
        wanted = ("cpu", *_WANTED) if "cpu" in offered else _WANTED
        for level in (base, os.path.dirname(parent), parent):
            os.makedirs(level, exist_ok=True)
            _enable(level, wanted)
        _write(os.path.join(parent, "memory.max"), str(room) if room else "max")
    except OSError as e:
        return f"cannot manage cgroup v2 at {base}: {e.strerror} (a systemd service needs Delegate=yes)"
    return Cgroups(2, "", _WANTED, (parent,), (home,), room, parent if "cpu" in wanted else "")


def _detect_v1(key: str, room: int, mounts: list, own: dict[str, str]) -> Cgroups | str:
    """The v1 memory and pids groups (either alone, where the other is missing), or why neither."""
    controllers, parents, homes, why = [], [], [], []
    for controller in _WANTED:
        mount = next((m for m in mounts if m[2] == "cgroup" and controller in m[3]), None)
        if mount is None or controller not in own:
            why.append(f"no cgroup v1 {controller} controller")
            continue
        home = _folder(mount[0], mount[1], own[controller])
        if home is None:
            why.append(f"the server's {controller} cgroup {own[controller]} is outside its mount at {mount[1]}")
            continue
        parent = os.path.join(home, "gpuport", key)
        try:
            os.makedirs(parent, exist_ok=True)
            if controller == "memory":
                for level in (os.path.dirname(parent), parent):  # before it has children: else refused
                    with contextlib.suppress(OSError):  # 1 already, or fixed by the kernel
                        _write(os.path.join(level, "memory.use_hierarchy"), "1")
                _write(os.path.join(parent, "memory.limit_in_bytes"), str(room) if room else "-1")
            else:
                _write(os.path.join(parent, "pids.max"), "max")
        except OSError as e:
            why.append(f"cannot make cgroups in {home}: {e.strerror}")
            continue
        controllers.append(controller)
        parents.append(parent)
        homes.append(home)
    if not controllers:
        return "; ".join(why)
    cpu_parent = ""
    mount = next((m for m in mounts if m[2] == "cgroup" and "cpu" in m[3]), None)
    if mount is not None and "cpu" in own:
        home = _folder(mount[0], mount[1], own["cpu"])
        if home is not None and os.access(home, os.W_OK):  # else CPU goes undivided; the banner says so
            cpu_parent = home
    return Cgroups(1, "", tuple(controllers), tuple(parents), tuple(homes), room, cpu_parent, f"gpuport-{key}-")


def detect(key: str, room: int) -> Cgroups:
    """This machine's cgroups, made ready for jobs: v2 where it has the memory and pids controllers,
    else the v1 ones, else none (with why). ``key``: this server's parent group's name; ``room``:
    the memory of all jobs together and of a job that asks for none (0: no limit)."""
    mounts, own = _mounts(), _own_groups()
    found = _detect_v2(key, room, mounts, own)
    if isinstance(found, str):
        v1 = _detect_v1(key, room, mounts, own)
        if isinstance(v1, str):
            return Cgroups(0, f"{found}; {v1}" if "no cgroup v2" not in found else v1)
        found = v1
    for parent in dict.fromkeys((found.cpu_parent, *found.parents)):  # users' groups left empty
        if parent:
            _remove_empty(parent, itself=False, prefix=found.cpu_prefix if parent == found.cpu_parent else "")
    return found


NONE = Cgroups(0, "--no-cgroups was given")
