"""Environments: what a project declares (``uv.lock``, ``pyproject.toml``, ``requirements.txt``) made
into a Python environment on the box with uv, built once and shared read-only.

A job's ``EnvRequest`` names where its requirements are. ``Environments.ensure`` (called where the
job's workdir has just been written, before its sandbox starts) finds them there and:

1. keys the request by its files' text (and any wheels of the project), the interpreter, the
   platform, the layering and the index settings, and looks the key up in ``keys/``: a warm launch
   reads one small file;
2. on a miss, resolves it in a build sandbox: ``uv export --frozen`` of a lock, else ``uv pip
   compile`` (over the box's own versions as preferences, when layered), and records the resolution
   under the key;
3. hashes what is to be installed (the resolution, less what the box already has at that very
   version when layered), the Python version and the platform: that hash names the environment,
   ``<root>/<hash>/``, so that requests that resolve alike, from any user, share one;
4. builds a missing one under a lock on ``<hash>.lock`` (builds of one hash in flight coalesce: the
   others wait for it, then use it), in the sandbox as the build uid (never root), with uv's cache
   shared (``cache/``) and no network where the index is on this machine's disk, else only a proxy
   to the index's hosts (``index_proxy.py``): ``uv pip install --no-deps --prefix`` of the pins
   into a venv the server made in the scratch, in the same sandbox as the resolution (its shell
   waits for the server between the two); then renames the venv to its hash, points its scripts at
   its own interpreter, makes it the server's and read-only (``seal_tree``), and writes
   ``meta.json`` last: an environment without it is a build that did not finish, made again.

Both uv runs take wheels only (``--no-build``): no package's own code runs while the shared cache is
writable. Where that fails because a package must be built from source, the build is made again
with uv's cache shown through an overlay whose writes are thrown away (or, without root, an empty
cache of its own): a build script can neither plant nor alter what later builds of others copy.

Layered (the default), the environment's ``site-packages`` comes first and the box's after it (a
``.pth`` file): the box's CUDA builds are used, and a version the project pins wins. Isolated, it
holds only what the project names. A failed build raises ``BuildFailed`` with uv's own words; its
folder is removed, and nothing is recorded.

Layout of ``<state dir>/envs/``::

    <hash>/            an environment (bin/python, lib/..., meta.json once complete); its mtime: last use
    <hash>.lock        flock'ed while it is built
    keys/<key>         the hash a request resolved to ("-": the box has all of it)
    cache/             uv's cache, the build uid's
    builds/<random>/   a build's scratch: the resolution, the list to install, the venv until renamed
    builds/<random>.proxy  the Unix socket of its proxy to the index, where the index is not on disk
"""

from __future__ import annotations

import collections
import configparser
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gpuport._files import atomic_write, open_beneath, own_folder, own_tree, read_small_beneath, seal_tree
from gpuport.defaults import DEFAULT_ENV_BUILD_TIMEOUT, DEFAULT_ENV_CACHE_SHARE
from gpuport.protocol.errors import InvalidRequest
from gpuport.protocol.units import format_size
from gpuport.server.index_proxy import BRIDGE_PORT, IndexProxy, index_hosts
from gpuport.server.isolation import Sandbox

log = logging.getLogger(__name__)

# Where requirements are found in a workdir, in this order: a lock says exactly what to install.
REQUIREMENT_FILES = ("uv.lock", "pyproject.toml", "requirements.txt")
AUTO = "auto"  # an EnvRequest's requirements: whatever of REQUIREMENT_FILES the workdir holds
BUILD_OWNER = ":build"  # the UidMap owner whose uid builds environments (no user's name has a ':')
_UV = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv") or ""
_MAX_REQUIREMENTS = 1024 * 1024  # bytes of a requirements file, a pyproject.toml or a lock read
_HASH_CHARS = 16  # an environment's name: the first 64 bits of its hash
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_LAYER_PTH = "_gpuport_box.pth"
_RESOLVED = b"gpuport-build: resolved\n"  # the build's shell says so between its two uv runs
_NAME = re.compile(r"(?m)^Name:[ \t]*(\S+)")  # a distribution's metadata header's fields
_VERSION = re.compile(r"(?m)^Version:[ \t]*(\S+)")
# uv's words where --no-build kept it from building a package (a source archive, a project's own metadata)
_NO_BUILD = re.compile(r"(?i)--no-build\b|building (from source|source distributions) is disabled")
_BRIDGE = str(Path(__file__).with_name("_index_bridge.py"))  # run in a build's sandbox, by path


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class BuildFailed(Exception):
    """An environment could not be built: ``str()`` says why, in uv's own words."""

    output = ""  # uv's last lines, where uv failed


def _wants_a_build(error: BuildFailed) -> bool:
    """Whether uv failed only because ``--no-build`` kept it from building a package from source."""
    return bool(_NO_BUILD.search(error.output))


@dataclass(frozen=True)
class EnvRequest:
    """Where a job's requirements are and how to build them, as a job's spec stores it."""

    requirements: str = AUTO  # AUTO, a file of the workdir, or requirements as text
    groups: tuple[str, ...] = ()  # pyproject.toml's dependency groups to include
    python: str = ""  # a version ("3.12") the box must have; "": the box's own
    isolated: bool = False  # without the box's packages
    hash: str = ""  # a built environment's name: the job runs in it as it is (`gpuport run --env-of JOB`)

    def to_json(self) -> dict[str, Any]:
        return {"requirements": self.requirements, "groups": list(self.groups), "python": self.python,
                "isolated": self.isolated, "hash": self.hash}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EnvRequest:
        groups = tuple(data.get("groups") or ())
        return cls(data["requirements"], groups, data.get("python", ""), data["isolated"], data.get("hash", ""))


def check_request(request: EnvRequest) -> None:
    """Refuse what no workdir could make valid: raises ``InvalidRequest`` saying what to change."""
    if len(request.requirements.encode()) > _MAX_REQUIREMENTS or "\0" in request.requirements:
        raise InvalidRequest("requirements: give a file of the project, or the requirements' text (at most 1 MiB)")
    for group in request.groups:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", group):
            raise InvalidRequest(f"dependency group {group[:80]!r}: a name of pyproject.toml's [dependency-groups]")
    if request.python and not re.fullmatch(r"3(\.[0-9]{1,2}){1,2}", request.python):
        raise InvalidRequest(f"--python {request.python[:40]!r}: give a version such as 3.12")
    if request.hash and not re.fullmatch(f"[0-9a-f]{{{_HASH_CHARS}}}", request.hash):
        raise InvalidRequest(f"environment {request.hash[:40]!r}: give a hash that `gpuport envs` lists")


@dataclass(frozen=True)
class Built:
    """The environment a job runs in: its folder and what it holds."""

    hash: str
    path: Path
    python: str  # its interpreter, as jobs run it
    packages: list[str]  # name==version, as installed in it (layered: over the box's)


@dataclass
class _Claim:
    """A build's hold on the environment it resolved to: its name, its lock's descriptor (held
    until the build is done), the environment where another build had made it already."""

    name: str = ""
    lock: int | None = None
    built: Built | None = None
    started: float = 0.0
    count: int = 0  # the packages it installs


@dataclass(frozen=True)
class _How:
    """How a build goes: on which interpreter, layered or not, and whether uv may build from source."""

    version: str
    python: str
    layered: bool
    from_source: bool


@dataclass
class _Source:
    """A request as found in a workdir: how to resolve it, and what its key covers."""

    kind: str  # "lock", "pyproject" or "requirements"
    file: str  # below the workdir ("" for text, written to the build's scratch)
    text: str
    extra: list[str] = field(default_factory=list)  # what else the key covers: the project's wheels


# ---- the box's configuration, passed to uv explicitly ---------------------------------------------


@dataclass(frozen=True)
class IndexSettings:
    """Where packages come from, as the admin configured this box for pip and uv: uv's arguments,
    the variables it gets, the local folders a build must see, and whether it needs the network."""

    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    folders: tuple[str, ...] = ()
    network: bool = True

    def describe(self) -> str:
        return " ".join(self.args) or "PyPI"


def _pip_config() -> dict[str, str]:
    """pip's settings of the box ([global], then [install]), from the files pip reads, then PIP_*."""
    files = ["/etc/pip.conf", "/etc/xdg/pip/pip.conf", os.path.expanduser("~/.pip/pip.conf")]
    files.append(os.path.expanduser("~/.config/pip/pip.conf"))
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(os.environ["PIP_CONFIG_FILE"])
    parser = configparser.RawConfigParser()
    with contextlib.suppress(configparser.Error):
        parser.read([f for f in files if os.path.isfile(f)])
    found: dict[str, str] = {}
    for section in ("global", "install"):
        if parser.has_section(section):
            found.update(parser.items(section))
    for name in ("index-url", "extra-index-url", "find-links", "cert", "constraint"):
        value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            found[name] = value
    return found


def index_settings() -> IndexSettings:
    """The box's index settings for uv: UV_* first, then pip's (``pip.conf``, PIP_*): the index, its
    extra indexes, find-links folders, a constraints file, the CA bundle, a proxy; and uv's own
    ``uv.toml`` of the server's user (the system's, under /etc, uv finds itself)."""
    pip = _pip_config()
    env = os.environ
    index = env.get("UV_INDEX_URL") or env.get("UV_DEFAULT_INDEX") or pip.get("index-url", "")
    extra = (env.get("UV_EXTRA_INDEX_URL") or env.get("UV_INDEX") or pip.get("extra-index-url", "")).split()
    links = (env.get("UV_FIND_LINKS", "").replace(",", " ") or pip.get("find-links", "")).split()
    constraint = env.get("UV_CONSTRAINT") or pip.get("constraint", "")
    args: list[str] = []
    if index:
        args += ["--index-url", index]
    for url in extra:
        args += ["--extra-index-url", url]
    for link in links:
        args += ["--find-links", link]
    # pip takes each package's best version from all its indexes, uv from the first that has it:
    # indexes set for pip are used as pip would (a package split across them resolves as with pip).
    strategy = env.get("UV_INDEX_STRATEGY") or (
        "unsafe-best-match" if pip.get("extra-index-url") and not env.get("UV_EXTRA_INDEX_URL") else ""
    )
    if strategy:
        args += ["--index-strategy", strategy]
    folders: list[str] = []
    for constraint_file in constraint.split():
        if os.path.isfile(constraint_file):
            args += ["--constraint", constraint_file]
            folders.append(constraint_file)
    passed: dict[str, str] = {}
    cert = env.get("SSL_CERT_FILE") or pip.get("cert", "")
    if cert and os.path.exists(cert):
        passed["SSL_CERT_FILE"] = cert
        folders.append(cert)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "no_proxy"):
        if env.get(name):
            passed[name] = env[name]
    config = env.get("UV_CONFIG_FILE") or os.path.expanduser("~/.config/uv/uv.toml")
    if os.path.isfile(config):
        passed["UV_CONFIG_FILE"] = config
        folders.append(config)
    local = [u for u in [index, *extra, *links] if u]
    for url in local:
        path = url.removeprefix("file://") if url.startswith("file://") else url if "://" not in url else ""
        if path and os.path.exists(path):
            folders.append(path.rstrip("/"))
    # Only an index on this machine's disk (and a configured one: none means PyPI) lets it go without.
    network = not index or any("://" in u and not u.startswith("file://") for u in local) or "UV_CONFIG_FILE" in passed
    return IndexSettings(tuple(args), tuple(sorted(passed.items())), tuple(dict.fromkeys(folders)), network)


def box_packages() -> dict[str, str]:
    """What the server's own environment holds: canonical name → version.

    Read from each distribution's metadata header with a pattern, not ``dist.metadata`` (an email
    parser): a box of 140 distributions took 185 ms that way, 10 ms this way, on each cold build."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        head = text.split("\n\n", 1)[0]
        name, version = _NAME.search(head), _VERSION.search(head)
        if name and version:
            found.setdefault(_canonical(name[1]), version[1])
    return found


def _box_site_dirs() -> list[str]:
    """The folders of the server's environment that a layered one adds after its own."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def interpreters() -> dict[str, str]:
    """The Pythons this box has, by version (``3.12.4``): its own, and those uv finds (on PATH,
    pyenv's, uv's own)."""
    found = {platform.python_version(): sys.executable}
    if _UV:
        done = subprocess.run(
            [_UV, "python", "list", "--only-installed", "--output-format", "json", "--python-preference", "system"],
            capture_output=True,
            text=True,
            check=False,
            env={"PATH": os.environ.get("PATH", ""), "HOME": os.path.expanduser("~")},
        )
        with contextlib.suppress(ValueError, KeyError, TypeError):
            for item in json.loads(done.stdout or "[]"):
                if item.get("path") and item.get("implementation") == "cpython":
                    found.setdefault(item["version"], item["path"])
    return found


def pick_python(wanted: str, have: dict[str, str]) -> tuple[str, str]:
    """The (version, path) of the box's interpreter that ``wanted`` (3.12, or 3.12.4) names; raises
    ``InvalidRequest`` listing the versions the box has otherwise."""
    for version in sorted(have, key=lambda v: [int(p) for p in v.split(".") if p.isdigit()], reverse=True):
        if version == wanted or version.startswith(wanted + "."):
            return version, have[version]
    listed = ", ".join(sorted(have)) or "none"
    raise InvalidRequest(
        f"Python {wanted} is not on this server; it has {listed}: ask for one of those (--python), or ask "
        f"the server's admin to install {wanted} (uv python install {wanted}, or the system's packages)"
    )


def env_cache_default(state_root: Path) -> int:
    """Bytes the environments may take by default: ``DEFAULT_ENV_CACHE_SHARE`` of the state dir's disk."""
    return int(shutil.disk_usage(state_root).total * DEFAULT_ENV_CACHE_SHARE)


# ---- the store of environments -------------------------------------------------------------------


class Environments:
    """The environments of one machine, under ``root`` (see the module's docstring)."""

    def __init__(self, root: Path, sandbox: Sandbox, cache_limit: int = 0) -> None:
        self.root = root
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in ("keys", "builds"):
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
        (self.root / "cache").mkdir(mode=0o700, exist_ok=True)
        self.sandbox = sandbox
        self.cache_limit = cache_limit  # bytes the environments may take; 0: no limit
        self.index = index_settings()
        self._index_hosts = index_hosts(self.index.args, dict(self.index.env))
        self._interpreters: dict[str, str] | None = None
        # The environments that running jobs use (never evicted); and where a job's is recorded.
        self.in_use: Callable[[], set[str]] = set
        self.record: Callable[[str, Built], None] = lambda job_id, built: None

    # ---- a job's environment ---------------------------------------------------------------------

    def python_for(self, wanted: str) -> tuple[str, str]:
        """The (version, path) of the interpreter a request for ``wanted`` ("" : the box's) builds on."""
        if not wanted:
            return platform.python_version(), sys.executable
        if self._interpreters is None:
            self._interpreters = interpreters()
        return pick_python(wanted, self._interpreters)

    def ensure(
        self, request: EnvRequest, work: Path, wheels: list[str], log_file: BinaryIO, build_uid: int | None
    ) -> Built | None:
        """The environment ``request`` names for the workdir ``work`` (built now where it is missing,
        its progress and uv's output written to ``log_file``); None where it names nothing there, or
        (layered) nothing the box lacks. ``wheels``: the project's own wheels and source archives
        (path:blob), which its requirements may name. Raises ``BuildFailed`` or ``InvalidRequest``."""
        if request.hash:
            built = self._load(request.hash)
            if built is None:
                raise BuildFailed(
                    f"environment {request.hash} is no longer on this server (pruned or evicted): run with the "
                    "project's requirements to build it again"
                )
            say(log_file, f"environment {request.hash} (as asked)")
            return built
        source = self._source(request, work, wheels)
        if source is None:
            return None
        version, python = self.python_for(request.python)
        layered = not request.isolated and python == sys.executable
        key = self._key(request, source, version, layered)
        recorded = read_small_beneath(self.root / "keys", key)
        if recorded is not None:
            name = recorded.decode().strip()
            if name == "-":
                return None
            built = self._load(name)
            if built is not None:
                return built
        if build_uid is not None:  # for the build to read (bound read-only); the job's uid gets it after
            own_tree(work, build_uid)
        with self._scratch(build_uid) as scratch:
            say(log_file, f"resolving {source.file or 'the requirements'} with uv")
            box = box_packages() if layered else {}  # read once: the resolution prefers it, the install skips it
            # Wheels only first (no package's own code runs), with uv's shared cache writable; again,
            # building from source, only where that failed for want of a build (see ``_run``).
            for from_source in (False, True):
                try:
                    how = _How(version, python, layered, from_source)
                    return self._build(request, source, work, scratch, key, box, how, log_file, build_uid)
                except BuildFailed as e:
                    if from_source or not _wants_a_build(e):
                        raise
                say(log_file, "a package must be built from source: building again, uv's cache read-only to it")
        raise AssertionError("unreachable")

    def _build(
        self,
        request: EnvRequest,
        source: _Source,
        work: Path,
        scratch: Path,
        key: str,
        box: dict[str, str],
        how: _How,
        log_file: BinaryIO,
        build_uid: int | None,
    ) -> Built | None:
        """One try of ``ensure``'s build in ``scratch``: ``how.from_source``, uv may build packages
        from source (and runs their build scripts, which must not reach uv's shared cache); else
        wheels only."""
        version, python, layered, from_source = how.version, how.python, how.layered, how.from_source
        for name in ("env", "resolved.txt", "install.txt"):  # an earlier try's
            path = scratch / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        resolving = self._resolving(source, request, work, scratch, python, box, from_source)
        # The environment's venv, in the scratch (relocatable: it moves to its hash's name once that
        # is known), made here: `uv venv` would start the interpreter to ask what it is, once more.
        _make_venv(scratch / "env", python, version)
        if build_uid is not None:
            own_tree(scratch, build_uid)
        claim = _Claim()

        def resolved() -> list[str] | None:
            """Once uv has resolved (the sandbox waits): the install's command, or None for none."""
            data = read_small_beneath(scratch, "resolved.txt", 16 * _MAX_REQUIREMENTS)
            if data is None:
                raise BuildFailed("uv wrote no resolution")
            install = self._to_install([line.strip() for line in data.decode(errors="replace").splitlines()], box)
            packages = [line for line in install if _PIN.match(line)]
            if not packages and layered:
                return None
            identity = "\n".join([*sorted(install), version, _platform(), "layered" if layered else "isolated"])
            if layered:
                identity += "\n" + "\n".join(_box_site_dirs())
            claim.name = hashlib.sha256(identity.encode()).hexdigest()[:_HASH_CHARS]
            return self._claim(claim, install, packages, work, scratch, python, log_file, from_source)

        try:
            # One sandbox for both: uv resolves, then (told how, once the environment's name is
            # known and no other build of it is in flight) installs the pins into the venv.
            what = "resolving the requirements"
            self._run(resolving, work, scratch, log_file, build_uid, what, resolved, from_source=from_source)
            if not claim.name:
                say(log_file, "the box's environment has every package the project names")
                atomic_write(self.root / "keys" / key, b"-\n", 0o600)
                return None
            built = claim.built or self._finish(claim, scratch, python, version, layered, log_file)
        finally:
            if claim.lock is not None:
                os.close(claim.lock)
        atomic_write(self.root / "keys" / key, claim.name.encode() + b"\n", 0o600)
        return built

    def _source(self, request: EnvRequest, work: Path, wheels: list[str]) -> _Source | None:
        """What the request names in ``work``: read without following a link (the snapshot is the user's)."""
        names = REQUIREMENT_FILES if request.requirements == AUTO else (request.requirements,)
        for name in names:
            if "\n" in name or name.startswith("/") or ".." in name.split("/"):
                continue  # text, or no file of the workdir
            data = read_small_beneath(work, name, _MAX_REQUIREMENTS + 1)
            if data is None:
                continue
            if len(data) > _MAX_REQUIREMENTS:
                raise InvalidRequest(f"{name} is larger than {format_size(_MAX_REQUIREMENTS)}")
            text = data.decode(errors="replace")
            base = name.rsplit("/", 1)[-1]
            if base == "uv.lock":
                project = read_small_beneath(work, name[: -len("uv.lock")] + "pyproject.toml", _MAX_REQUIREMENTS)
                if project is None:
                    raise BuildFailed(f"{name} has no pyproject.toml beside it: uv exports a lock with its project")
                return _Source("lock", name, text + "\0" + project.decode(errors="replace"))
            if base == "pyproject.toml":
                if request.requirements == AUTO and not re.search(r"(?m)^\s*dependencies\s*=", text):
                    continue  # a pyproject.toml of tools' settings only
                return _Source("pyproject", name, text, wheels)
            return _Source("requirements", name, text, [*wheels, *_included(work, name, text)])
        if request.requirements == AUTO:
            return None
        if "\n" not in request.requirements and re.fullmatch(r"[\w./-]+\.(txt|toml|lock|in)", request.requirements):
            raise InvalidRequest(f"requirements file {request.requirements!r} is not in the job's workdir")
        return _Source("requirements", "", request.requirements, wheels)

    def _key(self, request: EnvRequest, source: _Source, version: str, layered: bool) -> str:
        parts = [source.kind, source.file, source.text, *source.extra, *request.groups, version, _platform()]
        parts += ["layered" if layered else "isolated", self.index.describe(), repr(self.index.env)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def _resolving(
        self,
        source: _Source,
        request: EnvRequest,
        work: Path,
        scratch: Path,
        python: str,
        box: dict[str, str],
        from_source: bool,
    ) -> list[str]:
        """uv's command that writes the resolution to ``resolved.txt`` in the scratch (its files
        written); without ``from_source``, from wheels only (``--no-build``: no package's code runs)."""
        out = scratch / "resolved.txt"
        if source.kind == "lock":
            folder = str(work / source.file).removesuffix("uv.lock") or str(work)
            argv = [_UV, "export", "--frozen", "--no-hashes", "--no-emit-project", "--no-header", "--no-annotate"]
            argv += ["--no-default-groups", "--format", "requirements-txt", "--project", folder, "-o", str(out)]
            for group in request.groups:
                argv += ["--group", group]
        else:
            given = str(work / source.file)
            if not source.file:
                given = str(scratch / "requirements.in")
                atomic_write(Path(given), source.text.encode(), 0o644, durable=False)
            if box:  # layered: the box's versions, as an earlier resolution: uv keeps them where they fit
                pins = "".join(f"{n}=={v}\n" for n, v in sorted(box.items()))
                atomic_write(out, pins.encode(), 0o644, durable=False)
            argv = [_UV, "pip", "compile", given, "-o", str(out), "--python", python, "--emit-find-links"]
            argv += ["--no-header", "--no-annotate", *self.index.args, *([] if from_source else ["--no-build"])]
            if source.kind == "pyproject":
                for group in request.groups:
                    argv += ["--group", group]
            elif request.groups:
                raise InvalidRequest("dependency groups (--group) are pyproject.toml's: this project has none")
        return argv

    def _to_install(self, resolved: list[str], box: dict[str, str]) -> list[str]:
        """The lines to install: options (find-links) and pins, less (layered) the box's own versions."""
        install = []
        for line in resolved:
            if not line or line.startswith("#"):
                continue
            pin = _PIN.match(line)
            if pin and box.get(_canonical(pin[1])) == pin[2]:
                continue
            install.append(line)
        return install

    def _claim(
        self,
        claim: _Claim,
        install: list[str],
        packages: list[str],
        work: Path,
        scratch: Path,
        python: str,
        log_file: BinaryIO,
        from_source: bool,
    ) -> list[str] | None:
        """Take the lock of environment ``claim.name`` (builds of it in flight coalesce: this one waits
        for another); then, where it is built now, note it in ``claim`` and return None; else write the
        pins to install and return uv's command that installs them into the scratch's venv."""
        claim.lock = os.open(self.root / f"{claim.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(claim.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(log_file, f"waiting for environment {claim.name}, being built for another job")
            fcntl.flock(claim.lock, fcntl.LOCK_EX)
        claim.built = self._load(claim.name)
        if claim.built is not None:
            say(log_file, f"environment {claim.name} is built")
            return None
        shutil.rmtree(self.root / claim.name, ignore_errors=True)  # a build that did not finish
        listed = ", ".join(p.split(";")[0].strip() for p in packages[:8]) + (", ..." if len(packages) > 8 else "")
        say(log_file, f"building environment {claim.name} ({len(packages)} packages: {listed})…")
        claim.started, claim.count = time.monotonic(), len(packages)
        lines = "".join(f"{_absolute(line, work)}\n" for line in install)
        atomic_write(scratch / "install.txt", lines.encode(), 0o644, durable=False)
        # The pinned list, without resolving again, into the venv made before resolving: as its prefix,
        # by the interpreter uv has just asked (`--python` of the venv's own would be asked again, and
        # uv does not keep what a venv's says); _finish points the scripts it writes at the venv's.
        argv = [_UV, "pip", "install", "--python", python, "--prefix", str(scratch / "env"), "--no-deps"]
        argv += ["--requirements", str(scratch / "install.txt"), *self.index.args]
        return argv if from_source else [*argv, "--no-build"]

    def _finish(
        self, claim: _Claim, scratch: Path, python: str, version: str, layered: bool, log_file: BinaryIO
    ) -> Built:
        """The scratch's venv, installed, made environment ``claim.name``: renamed, the server's, its
        scripts started by its own interpreter, layered over the box's, sealed, and ``meta.json``
        written last."""
        name, folder = claim.name, self.root / claim.name
        # Under its name first (a folder only the server can change), checked to be a folder, not a
        # link the build left; then the server's, so that no build or job may change it.
        try:
            os.rename(scratch / "env", folder)
        except FileNotFoundError:
            raise BuildFailed("the build left no environment folder") from None
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            os.unlink(folder)
            raise BuildFailed("the build left no environment folder")
        own_tree(folder, os.getuid())
        _relocate_scripts(folder, python)
        if layered:
            _layer(folder, version)
        seal_tree(folder)
        installed = _installed(folder)
        if len(installed) < claim.count:  # uv wrote them where the venv does not look
            raise BuildFailed(f"uv installed {len(installed)} of {claim.count} packages into the environment")
        meta = {
            "hash": name,
            "python_version": version,
            "python": str(folder / "bin" / "python"),
            "platform": _platform(),
            "layered": layered,
            "packages": installed,
            "created_at": time.time(),
            "build_seconds": round(time.monotonic() - claim.started, 3),
            "size": _size(folder),
        }
        path = folder / "meta.json"
        os.chmod(folder, 0o755 | 0o200)  # a moment, to add its last file as the server
        try:
            atomic_write(path, json.dumps(meta, indent=2).encode(), 0o444)
        finally:
            os.chmod(folder, 0o555)
        say(log_file, f"environment {name} built in {meta['build_seconds']:.1f}s ({format_size(meta['size'])})")
        self.evict(keep=name)
        return self._load(name) or _unreadable(name)

    def _run(
        self,
        argv: list[str],
        work: Path,
        scratch: Path,
        log_file: BinaryIO,
        build_uid: int | None,
        what: str,
        then: Callable[[], list[str] | None] | None = None,
        *,
        from_source: bool = False,
    ) -> None:
        """Run uv (``argv``) in a build sandbox: the workdir and the index's folders read-only, the
        scratch writable, as ``build_uid``. ``then``: called once ``argv`` succeeded, while the
        sandbox waits; the command it returns (None: none) runs next, in the same sandbox (one
        sandbox a build: a second would start bwrap, setpriv and a shell once more).

        uv's shared cache is writable where uv alone runs (wheels only, ``--no-build``); where it
        builds from source (``from_source``), the packages' build scripts run too, and see the cache
        through an overlay whose writes are thrown away (a sandbox with a uid: the server is root),
        else get an empty cache of their own in the scratch. The network: none where the index is on
        this machine's disk; else a namespace of the build's own whose only way out is an
        ``IndexProxy`` to the index's hosts, reached through ``_index_bridge.py``."""
        cache = self.root / "cache"
        writable, readable = [scratch], [work, *(Path(f) for f in self.index.folders)]
        overlays: tuple[tuple[Path, Path], ...] = ()
        env = {
            "PATH": os.pathsep.join([os.path.dirname(_UV), "/usr/local/bin:/usr/bin:/bin"]),
            "HOME": "/tmp",
            "UV_CACHE_DIR": str(cache),
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_NO_PROGRESS": "1",
            # Off (uv's default) even where the admin's uv.toml turns it on: it is most of a cold
            # build's time for a large package; a job compiles what it imports, in memory.
            "UV_COMPILE_BYTECODE": "0",
            # Never a hard link into the cache (nor "clone", which falls back to one where the disk
            # cannot clone): sealing the environment would make the cache's files the server's.
            "UV_LINK_MODE": "copy",
            **dict(self.index.env),
        }
        if not from_source or not self.sandbox.isolated:  # no sandbox: nothing is kept from the build
            writable.append(cache)
            if build_uid is not None:
                own_folder(cache, build_uid)
        elif build_uid is not None and not re.search(r"[,:\\\s]", str(cache) + str(scratch)):
            (scratch / "cache-overlay").mkdir(mode=0o755)
            readable.append(cache)
            overlays = ((cache, scratch / "cache-overlay"),)
        else:
            env["UV_CACHE_DIR"] = str(scratch / "cache")
        for name in ("LANG", "LC_ALL"):
            if os.environ.get(name):
                env[name] = os.environ[name]
        # A shell reads the commands from the server as they come, each with its stdin closed.
        script = f"{shlex.join(argv)} </dev/null || exit $?\necho {_RESOLVED.decode().strip()}\n"
        command = ["/bin/sh", "-s"] if then is not None else argv
        proxy: IndexProxy | None = None
        if self.sandbox.isolated:
            if self.index.network:
                proxy = IndexProxy(scratch.with_name(scratch.name + ".proxy"), self._index_hosts, env)
                readable.append(proxy.path)
                bridge = shlex.join([sys.executable, "-I", "-S", _BRIDGE, str(proxy.path), str(BRIDGE_PORT)])
                script = f"{bridge} </dev/null || exit $?\n{script}"
                if then is None:
                    command = ["/bin/sh", "-c", f'{bridge} </dev/null && exec "$@"', "gpuport-build", *argv]
                for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY"):
                    env.pop(name.lower(), None)
                    env[name] = f"http://127.0.0.1:{BRIDGE_PORT}" if name != "NO_PROXY" else ""
            prefix = self.sandbox.argv(
                uid=build_uid,
                writable=writable,
                readable=readable,
                cwd=work,
                overlays=overlays,
            )
            command = [*prefix, *command]
        with proxy or contextlib.nullcontext():
            try:
                self._watch(command, script, then, work, env, log_file, what)
            finally:
                for line in proxy.refused if proxy else ():
                    say(log_file, line.removeprefix("gpuport: "))

    def _watch(
        self,
        command: list[str],
        script: str,
        then: Callable[[], list[str] | None] | None,
        work: Path,
        env: dict[str, str],
        log_file: BinaryIO,
        what: str,
    ) -> None:
        """Run a build's ``command`` (its shell told ``script``, then what ``then`` returns), its
        output into ``log_file``; raises ``BuildFailed`` with uv's words where it fails."""
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if then is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=env,
            start_new_session=True,
        )
        timed_out = threading.Event()
        timer = threading.Timer(DEFAULT_ENV_BUILD_TIMEOUT, lambda: (timed_out.set(), process.kill()))
        timer.start()
        tail: collections.deque[str] = collections.deque(maxlen=40)
        resolved = False
        try:
            assert process.stdout is not None
            if process.stdin is not None:
                _tell(process.stdin, script)
            for line in process.stdout:  # into the job's log as it comes: `gpuport run` shows it live
                if line == _RESOLVED and then is not None and process.stdin is not None:
                    resolved, after = True, then()
                    what = "building the environment"
                    _tell(process.stdin, f"exec {shlex.join(after)} </dev/null\n" if after else "exit 0\n")
                    process.stdin.close()
                    continue
                log_file.write(line)
                tail.append(line.decode(errors="replace").strip())
            code = process.wait()
        finally:
            timer.cancel()
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        if code != 0 or (then is not None and not resolved):
            if timed_out.is_set():
                raise BuildFailed(f"{what} took longer than {DEFAULT_ENV_BUILD_TIMEOUT:.0f}s")
            ended = "failed" if code != 0 else "ended before uv had resolved"
            error = BuildFailed(f"{what} {ended}: {_uv_error(list(tail))}")
            error.output = "\n".join(tail)
            raise error

    @contextlib.contextmanager
    def _scratch(self, build_uid: int | None) -> Iterator[Path]:
        scratch = self.root / "builds" / secrets.token_hex(8)
        scratch.mkdir(mode=0o755)
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # ---- what is here ------------------------------------------------------------------------------

    def _load(self, name: str) -> Built | None:
        if not re.fullmatch(r"[0-9a-f]{16}", name):
            return None
        meta = self.meta(name)
        if meta is None:
            return None
        with contextlib.suppress(OSError):
            os.utime(self.root / name)  # its last use, for `gpuport envs` and eviction
        return Built(name, self.root / name, meta["python"], list(meta["packages"]))

    def meta(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / name / "meta.json").read_text())
        except (OSError, ValueError):
            return None

    def listing(self) -> list[dict[str, Any]]:
        """Every built environment's meta, with ``last_used`` (the newest first)."""
        found = []
        for folder in self.root.iterdir():
            meta = self.meta(folder.name) if re.fullmatch(r"[0-9a-f]{16}", folder.name) else None
            if meta is not None:
                meta["last_used"] = folder.stat().st_mtime
                found.append(meta)
        return sorted(found, key=lambda m: -m["last_used"])

    def remove(self, name: str) -> bool:
        """Remove environment ``name`` unless it is being built or set up now; whether it was removed."""
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            folder = self.root / name
            if not folder.is_dir():
                return False
            # Sealed and the server's: no other uid can swap a folder for a link meanwhile.
            os.chmod(folder, 0o700)
            for top, folders, _ in os.walk(folder):
                for inner in folders:
                    path = os.path.join(top, inner)
                    if not os.path.islink(path):
                        os.chmod(path, 0o700)
            shutil.rmtree(folder, ignore_errors=True)
            (self.root / f"{name}.lock").unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)

    def evict(self, keep: str = "") -> list[str]:
        """Remove the least recently used environments not in use until they fit ``cache_limit``."""
        if not self.cache_limit:
            return []
        in_use = self.in_use()
        envs = self.listing()
        total = sum(m["size"] for m in envs)
        removed = []
        for meta in reversed(envs):  # the least recently used first
            if total <= self.cache_limit:
                break
            if meta["hash"] == keep or meta["hash"] in in_use:
                continue
            if self.remove(meta["hash"]):
                total -= meta["size"]
                removed.append(meta["hash"])
                log.info("environment %s evicted (--env-cache %s)", meta["hash"], format_size(self.cache_limit))
        return removed


def _tell(stdin: BinaryIO, text: str) -> None:
    """Commands for a build's shell; it may have ended already (its output says why)."""
    with contextlib.suppress(BrokenPipeError):
        stdin.write(text.encode())
        stdin.flush()


def say(log_file: BinaryIO, text: str) -> None:
    """A line of gpuport's own in the job's log."""
    log_file.write(f"gpuport: {text}\n".encode())
    log_file.flush()


def _uv_error(lines: list[str]) -> str:
    """uv's error among its last lines of output, for the job's message (the whole is in its log)."""
    lines = [line for line in lines if line and not line.startswith("gpuport:")]
    for index, line in enumerate(lines):
        if line.startswith(("error:", "×", "x ")):
            return " ".join(lines[index:])[:1000]
    return " ".join(lines[-3:])[:1000] or "uv said nothing"


def _absolute(line: str, work: Path) -> str:
    """A --find-links line relative to the project made absolute (uv reads the list from elsewhere)."""
    for flag in ("--find-links ", "-f "):
        if line.startswith(flag):
            where = line[len(flag) :].strip()
            if "://" not in where and not where.startswith("/"):
                return f"{flag}{work / where}"
    return line


def _layer(folder: Path, version: str) -> None:
    """Put the box's folders after the environment's own (a .pth file in its site-packages), through
    descriptors: the tree was the build uid's until a moment ago."""
    major_minor = ".".join(version.split(".")[:2])
    fd = open_beneath(folder, f"lib/python{major_minor}/site-packages")
    if fd is None:
        raise BuildFailed(f"the environment has no lib/python{major_minor}/site-packages")
    try:
        lines = "".join(f"import site; site.addsitedir({path!r})\n" for path in _box_site_dirs())
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open("_gpuport_box.pth", flags, 0o644, dir_fd=fd)
        with open(out, "wb") as file:
            file.write(lines.encode())
    finally:
        os.close(fd)


def _make_venv(folder: Path, python: str, version: str) -> None:
    """A venv at ``folder`` over the interpreter ``python`` (of ``version``), as ``uv venv
    --relocatable`` makes one: ``pyvenv.cfg`` naming the base interpreter's folder (its real path,
    that of the box's own where ``python`` is the server's, itself a venv's), ``bin/python``
    linking to it, an empty ``site-packages``. ``relocatable = true`` makes uv write the scripts it
    installs so that they run from wherever the folder is renamed to."""
    base = sys._base_executable if python == sys.executable else python  # type: ignore[attr-defined]
    base = os.path.realpath(base)
    major_minor = ".".join(version.split(".")[:2])
    (folder / "bin").mkdir(parents=True)
    (folder / "lib" / f"python{major_minor}" / "site-packages").mkdir(parents=True)
    os.symlink("lib", folder / "lib64")
    os.symlink(base, folder / "bin" / "python")
    for name in ("python3", f"python{major_minor}"):
        os.symlink("python", folder / "bin" / name)
    config = f"home = {os.path.dirname(base)}\nimplementation = CPython\nversion_info = {version}\n"
    config += "include-system-site-packages = false\nrelocatable = true\n"
    (folder / "pyvenv.cfg").write_text(config)


# How uv starts a script in a relocatable venv: the interpreter beside it, wherever the venv is.
_RELOCATABLE = b"#!/bin/sh\n'''exec' \"$(dirname -- \"$(realpath -- \"$0\")\")\"/'python' \"$0\" \"$@\"\n' '''\n"


def _relocate_scripts(folder: Path, python: str) -> None:
    """The scripts uv wrote in ``bin`` for the interpreter that installed them (``python``: its
    path in the first line, or after ``exec`` where that line would be too long) made to start the
    environment's own, as in a relocatable venv. Through descriptors, without following a link: the
    tree was the build uid's until a moment ago."""
    fd = open_beneath(folder, "bin")
    if fd is None:
        return
    paths = {python, os.path.realpath(python)}
    heads = [f"#!{p}\n".encode() for p in paths]
    heads += [f"#!/bin/sh\n'''exec' '{p}' \"$0\" \"$@\"\n' '''\n".encode() for p in paths]
    try:
        for name in os.listdir(fd):
            try:
                script = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
            except OSError:
                continue  # a link (bin/python), or what is no file to rewrite
            with open(script, "r+b") as file:
                info = os.fstat(file.fileno())
                if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # uv copies: one link each
                    continue
                text = file.read(_MAX_REQUIREMENTS)
                head = next((h for h in heads if text.startswith(h)), None)
                if head is None or len(text) == _MAX_REQUIREMENTS:
                    continue
                file.seek(0)
                file.write(_RELOCATABLE + text[len(head) :])
                file.truncate()
    finally:
        os.close(fd)


def _platform() -> str:
    libc = "-".join(platform.libc_ver()) or "nolibc"
    return f"{sys.platform}-{platform.machine()}-{libc}"


def _installed(folder: Path) -> list[str]:
    """name==version of each distribution in the environment's own site-packages."""
    found = []
    for info in folder.glob("lib/python*/site-packages/*.dist-info"):
        name, _, rest = info.name.removesuffix(".dist-info").partition("-")
        found.append(f"{_canonical(name)}=={rest}")
    return sorted(found)


def _size(folder: Path) -> int:
    total = 0
    for top, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def _unreadable(name: str) -> Built:
    raise BuildFailed(f"environment {name} was built but its meta.json cannot be read")


# A requirements file's own lines that name another file whose lines count too (pip's and uv's).
_INCLUDE = re.compile(r"^\s*(?:-r|-c|--requirement|--constraint)(?:\s*=\s*|\s+|(?<=-[rc]))(\S+)", re.MULTILINE)
_MAX_INCLUDED = 64  # files a requirements file may pull in, through each other


def _included(work: Path, name: str, text: str) -> list[str]:
    """Each file the requirements file ``name`` includes (``-r``/``-c``, and theirs in turn), as its
    name and text, for the key: a changed ``-r base.txt`` is another environment. Read beneath
    ``work`` only, without following a link; a URL or a file outside the workdir is left to uv (it
    reads what it can, and fails saying why)."""
    found: dict[str, str] = {}
    todo = [(name, text)]
    while todo:
        including, body = todo.pop()
        folder = including.rsplit("/", 1)[0] + "/" if "/" in including else ""
        for target in _INCLUDE.findall(body):
            if len(found) == _MAX_INCLUDED:
                raise InvalidRequest(f"{name} includes more than {_MAX_INCLUDED} files (-r, -c): merge some of them")
            path = os.path.normpath(folder + target)
            if "://" in target or path.startswith(("/", "..")) or path in found or path == name:
                continue
            data = read_small_beneath(work, path, _MAX_REQUIREMENTS + 1)
            if data is None:
                continue
            if len(data) > _MAX_REQUIREMENTS:
                raise InvalidRequest(
                    f"{path} (included by {including}) is larger than {format_size(_MAX_REQUIREMENTS)}"
                )
            found[path] = data.decode(errors="replace")
            todo.append((path, found[path]))
    return [f"{path}\0{body}" for path, body in sorted(found.items())]
