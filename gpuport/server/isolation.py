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
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gpuport
from gpuport._files import let_read
from gpuport.protocol.errors import ConfigError, InvalidRequest, ResourceUnavailable
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
    # (a readable copy, the path it shows as): for a folder of the server's Python that the owner
    # keeps closed (a clone made with umask 077), which the job's uid could not read.
    python_copies: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    tmpfs_size: int = 0  # bytes of /tmp and /dev/shm each (0: the kernel's default, half the memory)

    @property
    def isolated(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        """One line for the server's banner."""
        if not self.isolated:
            return f"none: {self.why}; every token is an admin token"
        network = "private, out through slirp4netns" if self.slirp4netns else "private, loopback only"
        who = f"uids {self.uids[0]}-{self.uids[1]}, one per user" if self.mode == "uids" else "the server's uid"
        copied = "".join(f"; {path} (closed to others) shown from a readable copy" for _, path in self.python_copies)
        return f"bubblewrap sandbox, {who}, network {network}{copied}"

    def argv(
        self,
        *,
        uid: int | None,
        writable: list[Path],
        readable: list[Path],
        cwd: Path,
        host_network: bool = False,
        tmpfs_size: int = 0,
        overlays: tuple[tuple[Path, Path], ...] = (),
    ) -> list[str]:
        """The command prefix that runs a program in a new sandbox: ``writable`` and ``readable``
        folders appear at their own paths, ``cwd`` is the working directory, and with ``uid`` the
        program runs as that uid and its group, with no supplementary groups and no capabilities.
        ``host_network``: the machine's network (a job whose processes on other nodes reach it).
        ``tmpfs_size``: bytes of its /tmp and of its /dev/shm (0: ``self.tmpfs_size``).
        ``overlays``: (folder, scratch) pairs, with a uid only: each folder (one of ``readable``) is
        shown writable, its writes kept in ``scratch`` (an overlay mounted by the sandbox's root
        before it takes the uid), the folder itself never changed."""
        if overlays and uid is None:
            raise ValueError("overlays are mounted by the sandbox's root: give a uid")
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
        # /tmp (which is $HOME too) and /dev/shm: the job's own, in memory; with a uid, made its own
        # below (multiprocessing, shared memory, joblib, ~/.cache, pip --user all write there).
        size = ["--size", str(tmpfs_size or self.tmpfs_size)] if tmpfs_size or self.tmpfs_size else []
        argv += ["--perms", "01777", *size, "--tmpfs", "/tmp", "--perms", "01777", *size, "--tmpfs", "/dev/shm"]
        argv += ["--tmpfs", "/run"]
        for pattern in _GPU_DEVICES:
            for device in sorted(glob.glob(pattern)):
                argv += ["--dev-bind", device, device]
        made = {"/", "/tmp", "/dev", "/run", "/proc", "/sys", *_SYSTEM}
        binds = [("--ro-bind", p, p) for p in self.python_paths]
        binds += [("--ro-bind", copy, path) for copy, path in self.python_copies]
        binds += [("--ro-bind", str(f), str(f)) for f in readable] + [("--bind", str(f), str(f)) for f in writable]
        for how, source, path in binds:
            # bwrap would make the folders on the way 0700 (root's, here): the job's uid could not pass.
            for parent in reversed(Path(path).parents):
                if str(parent) not in made and not any(str(parent).startswith(m + "/") for m in _SYSTEM):
                    argv += ["--perms", "0755", "--dir", str(parent)]
                    made.add(str(parent))
            argv += [how, source, path]
        argv += ["--chdir", str(cwd)]
        if uid is None:
            return [*argv, "--cap-drop", "ALL", "--"]
        # bwrap runs as root here (no user namespace): setpriv takes the uid after bwrap's set-up,
        # and every capability with it. A change of uid clears the parent-death signal that
        # --die-with-parent set: setpriv sets it again, so that the job never outlives its sandbox.
        # Before that, still root in the sandbox, its /tmp and /dev/shm are given to the uid: bwrap
        # makes a tmpfs as root, and a folder of root's, even 1777, is not a home.
        own = f"chown {uid}:{uid} /tmp /dev/shm && "
        for folder, scratch in overlays:
            upper, work = shlex.quote(str(scratch / "upper")), shlex.quote(str(scratch / "work"))
            options = shlex.quote(f"lowerdir={folder},upperdir={scratch / 'upper'},workdir={scratch / 'work'}")
            own += f"mkdir -m 0755 {upper} {work} && chown {uid}:{uid} {upper} && "
            own += f"mount -t overlay gpuport-overlay -o {options} {shlex.quote(str(folder))} && "
        own += 'exec "$@"'
        setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--pdeathsig=KILL"]
        return [
            *argv,
            "--",
            "/bin/sh",
            "-c",
            own,
            "gpuport-sandbox",
            *setpriv,
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ]


def detect(uids: tuple[int, int] = DEFAULT_JOB_UIDS, copies: Path | None = None) -> Sandbox:
    """What this machine allows: probes bwrap once with the namespaces a job gets.

    As root, the jobs' uids must be able to read the server's Python environment: gpuport's own
    package, where its folder is closed (a clone made with umask 077), is shown from a readable copy
    made under ``copies`` (None: a probe, which makes none); any other closed folder of it raises
    ``ConfigError`` saying what to do."""
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
    paths, copied = _python_paths(), ()
    if root:
        paths, copied = readable_by_jobs(paths, copies)
    return Sandbox(
        "uids" if root else "sandbox",
        bwrap=bwrap,
        slirp4netns=shutil.which("slirp4netns") or "",
        uids=uids,
        python_paths=paths,
        python_copies=copied,
    )


def _open_to_others(path: str) -> bool:
    """Whether another uid can read the file ``path``, or list and enter the folder (the folders
    above it do not matter: the sandbox makes its own, open ones, on the way to it)."""
    mode = os.stat(path).st_mode
    wanted = 0o005 if stat.S_ISDIR(mode) else 0o004
    return mode & wanted == wanted


def readable_by_jobs(
    paths: tuple[str, ...], copies: Path | None
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """``paths`` split into those the jobs' uids can read as they are, and (copy, path) pairs for
    gpuport's package where it is closed (copies made under ``copies``; None: none made, for a
    probe of what the machine allows). Raises ``ConfigError`` for any other closed folder."""
    package = str(Path(gpuport.__file__).resolve().parent)
    kept: list[str] = []
    copied: list[tuple[str, str]] = []
    for path in paths:
        inside = os.path.join(path, "__init__.py") if path == package else path  # a clone's files: 0600
        closed = not (_open_to_others(path) and _open_to_others(inside))
        if not closed or path == package and copies is None:  # None: a probe, which makes no copy
            kept.append(path)
        elif path == package:
            copied.append((_copy_package(package, copies), package))
        else:
            raise ConfigError(
                f"{path}, a folder of the server's Python environment, is closed to other users "
                f"(mode {os.stat(path).st_mode & 0o777:04o}): jobs run as uids of their own and could not "
                f"start its Python. Open that folder's own modes (chmod -R go+rX {path}, or make it again "
                "with umask 022); the folders that hold it may stay closed, since the sandbox shows jobs "
                "the environment only. Or run the server with --no-sandbox (admin tokens only)"
            )
    return tuple(kept), tuple(copied)


def _copy_package(package: str, copies: Path) -> str:
    """A copy of gpuport's package under ``copies`` that any uid can read (made anew each start; its
    compiled files kept, with the sources' times, so that they stay valid)."""
    dest = copies / "gpuport"
    copies.mkdir(exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(package, dest, symlinks=True)
    let_read(dest)
    return str(dest)


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
    # gpuport's package itself: where it is not installed into the environment (an editable install
    # of a clone), the folder that holds it is the clone, with much that jobs need not see.
    package = Path(gpuport.__file__).resolve().parent
    wanted.add(str(package))
    # Not the folder the server was started from (`python -m` puts it on sys.path): a home folder,
    # say, whose files jobs have no business reading; nor a clone's folder, for its package.
    wanted.update(
        p
        for p in sys.path
        if p
        and os.path.isdir(p)
        and os.path.abspath(p) != os.getcwd()
        and (os.path.realpath(p) != str(package.parent) or package.parent.name in ("site-packages", "dist-packages"))
    )
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
