"""Isolation: a job is not the server, and one user's job is not another's.

Every job, session worker and model replica runs inside a sandbox made by bubblewrap (``bwrap``):
its own mount, pid and IPC namespaces, and a network namespace of its own with only loopback (and,
with ``slirp4netns`` installed, a route out that cannot reach the host's loopback). It sees the
system read-only (/usr, /etc), this server's Python environment read-only, its own work and output
folders, its datasets read-only, a private /tmp and /dev/shm, and the GPU devices; the state dir,
other jobs' folders and sockets, and every other process are not there.

When the server runs as root (the systemd unit's way), each gpuport user's work also runs under a
Unix uid of its own, from ``--job-uids`` (61000-61999 by default), recorded in the database: a job
cannot signal, ptrace or read the files of another user's job, nor of the server. Without root,
bwrap makes the namespaces with an unprivileged user namespace, and jobs keep the server's uid.
Without bwrap (or user namespaces), there is no isolation: the server says ``isolation: none``, and
it refuses to make tokens that are not admin tokens, since any job could act as the server.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gpuport
from gpuport.protocol.errors import InvalidRequest, ResourceUnavailable
from gpuport.server.store import Store

DEFAULT_JOB_UIDS = (61000, 61999)  # uids given to gpuport users' work when the server runs as root
# What a sandbox shows of the system, read-only: where programs, libraries and their settings live.
_SYSTEM = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_GPU_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri")


def parse_uid_range(text: str) -> tuple[int, int]:
    """``61000-61999`` → (61000, 61999); raises ``InvalidRequest`` saying what is wrong."""
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        raise InvalidRequest(f"--job-uids {text!r}: give a range of uids, such as 61000-61999") from None
    if not 1000 <= low <= high < 2**31:
        raise InvalidRequest(f"--job-uids {text!r}: uids from 1000 up, the first no larger than the last")
    return low, high


@dataclass(frozen=True)
class Sandbox:
    """How this server isolates work: ``mode`` is "uids" (root: a sandbox and a uid per user),
    "sandbox" (no root: a sandbox, the server's uid) or "none"; ``why`` says what is missing."""

    mode: str
    why: str = ""
    bwrap: str = ""
    slirp4netns: str = ""
    uids: tuple[int, int] = DEFAULT_JOB_UIDS
    python_paths: tuple[str, ...] = field(default_factory=tuple)

    @property
    def isolated(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        """One line for the server's banner."""
        if not self.isolated:
            return f"none: {self.why}; every token is an admin token"
        network = "private, out through slirp4netns" if self.slirp4netns else "private, loopback only"
        who = f"uids {self.uids[0]}-{self.uids[1]}, one per user" if self.mode == "uids" else "the server's uid"
        return f"bubblewrap sandbox, {who}, network {network}"

    def argv(
        self, *, uid: int | None, writable: list[Path], readable: list[Path], cwd: Path, host_network: bool = False
    ) -> list[str]:
        """The command prefix that runs a program in a new sandbox: ``writable`` and ``readable``
        folders appear at their own paths, ``cwd`` is the working directory, and with ``uid`` the
        program runs as that uid and its group, with no supplementary groups and no capabilities.
        ``host_network``: the machine's network (a job whose processes on other nodes reach it)."""
        argv = [self.bwrap, "--die-with-parent", "--as-pid-1", "--new-session"]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-cgroup-try"]
        if not host_network:
            argv.append("--unshare-net")
        for path in _SYSTEM:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        argv += ["--ro-bind-try", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev"]
        argv += ["--tmpfs", "/tmp", "--tmpfs", "/dev/shm", "--tmpfs", "/run"]
        for pattern in _GPU_DEVICES:
            for device in sorted(glob.glob(pattern)):
                argv += ["--dev-bind", device, device]
        made = {"/", "/tmp", "/dev", "/run", "/proc", "/sys", *_SYSTEM}
        binds = [("--ro-bind", p) for p in self.python_paths]
        binds += [("--ro-bind", str(f)) for f in readable] + [("--bind", str(f)) for f in writable]
        for how, path in binds:
            # bwrap would make the folders on the way 0700 (root's, here): the job's uid could not pass.
            for parent in reversed(Path(path).parents):
                if str(parent) not in made and not any(str(parent).startswith(m + "/") for m in _SYSTEM):
                    argv += ["--perms", "0755", "--dir", str(parent)]
                    made.add(str(parent))
            argv += [how, path, path]
        argv += ["--chdir", str(cwd)]
        if uid is None:
            return [*argv, "--cap-drop", "ALL", "--"]
        # bwrap runs as root here (no user namespace): setpriv takes the uid after bwrap's set-up,
        # and every capability with it. A change of uid clears the parent-death signal that
        # --die-with-parent set: setpriv sets it again, so that the job never outlives its sandbox.
        setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--pdeathsig=KILL"]
        return [*argv, "--", *setpriv, "--inh-caps=-all", "--bounding-set=-all", "--"]


def detect(uids: tuple[int, int] = DEFAULT_JOB_UIDS) -> Sandbox:
    """What this machine allows: probes bwrap once with the namespaces a job gets."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return Sandbox("none", "bubblewrap is not installed (apt-get install bubblewrap)")
    root = os.geteuid() == 0
    if root and not shutil.which("setpriv"):
        return Sandbox("none", "setpriv is not installed (apt-get install util-linux)")
    probe = [bwrap, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--", "true"]
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        return Sandbox("none", f"bubblewrap cannot make namespaces here ({reason}); run the server as root")
    return Sandbox(
        "uids" if root else "sandbox",
        bwrap=bwrap,
        slirp4netns=shutil.which("slirp4netns") or "",
        uids=uids,
        python_paths=_python_paths(),
    )


def clean_python_paths() -> tuple[str, ...]:
    """``_python_paths`` as a fresh ``python -I`` sees them from /: for a process whose sys.path was
    added to by its host (a Ray worker's holds its driver's folders)."""
    code = "import json, gpuport.server.isolation as i; print(json.dumps(i._python_paths()))"
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd="/", check=True)
    return tuple(json.loads(done.stdout))


def _python_paths() -> tuple[str, ...]:
    """The folders this server's Python needs, outermost only, and not already under /usr."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    wanted.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    wanted.add(str(Path(gpuport.__file__).resolve().parent.parent))
    # Not the folder the server was started from (`python -m` puts it on sys.path): a home folder,
    # say, whose files jobs have no business reading.
    wanted.update(p for p in sys.path if p and os.path.isdir(p) and os.path.abspath(p) != os.getcwd())
    resolved = sorted({os.path.realpath(p) for p in wanted} | wanted)
    kept: list[str] = []
    for path in resolved:
        if path.startswith("/usr/") or any(path == k or path.startswith(k + "/") for k in kept):
            continue
        if os.path.isdir(path):
            kept.append(path)
    return tuple(kept)


class UidMap:
    """Which Unix uid each gpuport user's work runs as: the lowest free uid of the range, kept in
    the database so that it never changes (files a job left in its outputs keep their owner)."""

    def __init__(self, store: Store, uids: tuple[int, int]) -> None:
        self.store = store
        self.low, self.high = uids

    def uid(self, owner: str) -> int:
        row = self.store.query_one("SELECT uid FROM unix_users WHERE owner = ?", (owner,))
        if row is not None:
            return int(row["uid"])
        with self.store.transaction() as db:
            taken = {r["uid"] for r in db.execute("SELECT uid FROM unix_users")}
            for uid in range(self.low, self.high + 1):
                if uid in taken or uid == os.getuid() or _has_account(uid):
                    continue
                db.execute("INSERT INTO unix_users (owner, uid) VALUES (?, ?)", (owner, uid))
                return uid
        raise ResourceUnavailable(
            f"every uid of --job-uids {self.low}-{self.high} is given to a user or an account: "
            "restart the server with a larger range"
        )


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True
