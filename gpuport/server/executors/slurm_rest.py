"""How the Slurm executor talks to Slurm: its commands, or slurmrestd's REST API (``--slurm-rest URL``).

``SlurmClient`` holds the few operations the executor needs of the cluster, and has two kinds:
``SlurmCommands`` (``sbatch``, ``squeue``, ``scancel``, ``sinfo``) and ``SlurmRest`` (slurmrestd:
``POST /slurm/vX/job/submit``, one ``GET /slurm/vX/jobs`` for all jobs, and only when one changed,
``DELETE /slurm/vX/job/{id}`` with a signal, ``GET /slurm/vX/nodes`` and ``/partitions``). Either
raises ``RuntimeError`` with Slurm's own message when Slurm refuses, and ``OSError`` when it cannot
be reached.

slurmrestd reads no ``#SBATCH`` line: ``SlurmRest`` turns the options the executor gives (gpuport's,
then a batch script's own) into the job's properties, for the options in ``REST_OPTIONS``, and refuses
any other naming them. It has no ``sbatch --test-only`` either: a job is checked by submitting it to
begin in a year (Slurm judges it as any submission) and cancelling it at once.

What stays on the commands with ``--slurm-rest`` (they need no slurmrestd): ``scontrol show config``
and ``sacct`` (accounting), ``srun`` inside a multi-node allocation, and the cancel of a multi-node
job, whose signal must reach its batch shell alone (``scancel --batch``; the API signals every step).

Authentication is slurmrestd's: a JWT (``AuthAltTypes=auth/jwt`` in slurm.conf, made with
``scontrol token``) sent as ``X-SLURM-USER-NAME`` and ``X-SLURM-USER-TOKEN``, read from a file
(read again whenever it changes: tokens expire) or from ``SLURM_JWT``; on a ``unix:`` socket,
slurmrestd's local authentication (``-a rest_auth/local``) needs none: slurmrestd takes the
connecting process's uid for the user, and accepts only its own (so the server runs as that user).
"""

from __future__ import annotations

import abc
import contextlib
import http.client
import json
import os
import re
import shlex
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuport.protocol.errors import ConfigError, InvalidRequest

SUPPORTED_VERSIONS = ("v0.0.38",)  # slurmrestd's API versions this client speaks, newest first (Slurm 22.05)
DEFAULT_COMMAND_TIMEOUT = 60.0  # seconds a Slurm command or REST call may take (slurmctld busy)
DEFAULT_CLOCK_MARGIN = 5.0  # seconds slurmctld's clock may lag this server's ("changed since" asks from earlier)
DEFAULT_CHECK_BEGIN = 365 * 86400  # seconds ahead a checked job is told to begin: it never starts
# A job's states in which squeue lists it by default: any other has ended (slurmrestd lists those too).
_LISTED = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "SIGNALING"}
_API = re.compile(r"^/slurm/(v0\.0\.\d+)/job/submit$")


def slurm_epoch(when: str) -> float | None:
    """Slurm's time (``SLURM_TIME_FORMAT=standard``: local time, to the second) in epoch seconds."""
    try:
        return time.mktime(time.strptime(when, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # Unknown, None, N/A: not started
        return None


@dataclass(frozen=True)
class Listed:
    """One job as Slurm's queue lists it (squeue's columns)."""

    slurm_id: str
    state: str  # PENDING, RUNNING, ...
    gres: str  # its gres per node, as squeue's %b: gres:gpu:2
    nodes: int
    cpus: int
    started: float | None  # epoch seconds, once it runs
    where: str  # its nodes, as Slurm writes their list
    reason: str  # why it waits: Resources, Priority, ...


@dataclass(frozen=True)
class NodeInfo:
    """One node as sinfo lists it."""

    name: str
    cpus: float
    memory_mb: int
    gres: str  # gpu:2,shard:4


class SlurmClient(abc.ABC):
    """The operations of Slurm the executor uses (see the module's docstring)."""

    #: how the banner says jobs reach Slurm
    path: str

    @abc.abstractmethod
    def partitions(self) -> list[str]:
        """The partitions' names, the default one marked with ``*`` (as sinfo's %P)."""

    @abc.abstractmethod
    def submit(self, script: Path, options: list[str]) -> str:
        """Submit the batch script at ``script`` (whose ``#SBATCH`` lines are ``options``); its Slurm id."""

    @abc.abstractmethod
    def test(self, options: list[str]) -> None:
        """Whether Slurm would take a job of these options: raises ``RuntimeError`` with Slurm's
        reason when not, ``InvalidRequest`` for an option this client cannot pass on."""

    @abc.abstractmethod
    def queue(self, user: str) -> list[Listed]:
        """Every job of ``user`` Slurm lists (pending, running, completing): one call for all."""

    @abc.abstractmethod
    def cancel(self, slurm_id: str, signal: str = "", batch_only: bool = False) -> None:
        """scancel: the job ended (no ``signal``), or ``signal`` (TERM, KILL) sent to every step of it,
        or to its batch shell alone (``batch_only``)."""

    @abc.abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """Every node of the cluster."""


class SlurmCommands(SlurmClient):
    """Slurm's commands, run on this machine (``SLURM_CONF`` names the cluster)."""

    path = "Slurm's commands (sbatch, squeue)"

    def run(self, argv: list[str], stdin: str | None = None, standard_time: bool = False) -> str:
        """A Slurm command's output (``standard_time``: its times as 2026-11-27T10:00:00, whatever the
        server's own SLURM_TIME_FORMAT). Raises ``RuntimeError`` with its message when it fails."""
        env = {**os.environ, "SLURM_TIME_FORMAT": "standard"} if standard_time else None
        done = subprocess.run(
            argv, check=False, input=stdin, capture_output=True, text=True, timeout=DEFAULT_COMMAND_TIMEOUT, env=env
        )
        if done.returncode:
            said = (done.stderr or done.stdout).strip().replace("sbatch: error: ", "")
            raise RuntimeError(said or f"{argv[0]} exited with {done.returncode}")
        return done.stdout

    def partitions(self) -> list[str]:
        return self.run(["sinfo", "-h", "-o", "%P"]).split()

    def submit(self, script: Path, options: list[str]) -> str:
        return self.run(["sbatch", "--parsable", str(script)]).strip().split(";")[0]

    def test(self, options: list[str]) -> None:
        script = "#!/bin/sh\n" + "".join(f"#SBATCH {line}\n" for line in options) + "true\n"
        try:
            self.run(["sbatch", "--test-only", "--job-name=gpuport-check", "--output=/dev/null"], stdin=script)
        except subprocess.TimeoutExpired as e:
            raise OSError(f"sbatch --test-only took more than {e.timeout:g}s") from None

    def queue(self, user: str) -> list[Listed]:
        out = self.run(["squeue", "-h", "-u", user, "-o", "%i|%T|%b|%D|%C|%S|%N|%r"], standard_time=True)
        found = []
        for line in out.splitlines():
            slurm_id, state, gres, nodes, cpus, start, where, reason = (line.split("|", 7) + [""] * 7)[:8]
            with contextlib.suppress(ValueError):
                found.append(Listed(slurm_id, state, gres, int(nodes), int(cpus), slurm_epoch(start), where, reason))
        return found

    def cancel(self, slurm_id: str, signal: str = "", batch_only: bool = False) -> None:
        which = ["--batch" if batch_only else "--full"] if signal else []
        self.run(["scancel", *([f"--signal={signal}"] if signal else []), *which, slurm_id])

    def nodes(self) -> list[NodeInfo]:
        found = []
        for line in self.run(["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G"]).splitlines():
            name, cpus, memory, gres = (line.split("|") + ["", "", ""])[:4]
            with contextlib.suppress(ValueError):
                found.append(NodeInfo(name, float(cpus), int(memory), gres))
        return found


# ---- slurmrestd ---------------------------------------------------------------------------------------


def _minutes(value: str) -> int:
    """sbatch's --time (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in whole minutes, rounded up."""
    days, _, rest = value.rpartition("-") if "-" in value else ("0", "", value)
    parts = [int(p) for p in rest.split(":")]
    if days != "0" or "-" in value:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        total = int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    elif len(parts) == 1:
        total = parts[0] * 60
    elif len(parts) == 2:
        total = parts[0] * 60 + parts[1]
    else:
        total = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return -(-total // 60)


def _megabytes(value: str) -> int:
    """sbatch's --mem (a number, MB unless it ends in K, M, G or T) in MB."""
    found = re.fullmatch(r"(\d+)([KMGT]?)B?", value.strip().upper())
    if found is None:
        raise ValueError(value)
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1 << 20}[found.group(2)]
    return max(1, int(int(found.group(1)) * scale))


def _node_range(value: str) -> list[int]:
    low, _, high = value.partition("-")
    return [int(low), int(high or low)]


# sbatch's option → (its short form, the job property of slurmrestd's, how its value is read)
REST_OPTIONS: dict[str, tuple[str, str, Any]] = {
    "job-name": ("J", "name", str),
    "output": ("o", "standard_output", str),
    "error": ("e", "standard_error", str),
    "chdir": ("D", "current_working_directory", str),
    "partition": ("p", "partition", str),
    "nodes": ("N", "nodes", _node_range),
    "ntasks": ("n", "tasks", int),
    "ntasks-per-node": ("", "tasks_per_node", int),
    "cpus-per-task": ("c", "cpus_per_task", int),
    "gres": ("", "gres", str),
    "gpus": ("G", "gpus", str),
    "gpus-per-node": ("", "gpus_per_node", str),
    "mem": ("", "memory_per_node", _megabytes),
    "mem-per-cpu": ("", "memory_per_cpu", _megabytes),
    "time": ("t", "time_limit", _minutes),
    "account": ("A", "account", str),
    "qos": ("q", "qos", str),
    "constraint": ("C", "constraints", str),
    "reservation": ("", "reservation", str),
    "comment": ("", "comment", str),
    "mail-type": ("", "mail_type", str),
    "mail-user": ("", "mail_user", str),
}
_SHORT = {short: long for long, (short, _, _) in REST_OPTIONS.items() if short}


def job_properties(options: list[str]) -> dict[str, Any]:
    """slurmrestd's job properties for sbatch's ``options`` (lines of ``#SBATCH``; the last of each
    wins, as with sbatch). Raises ``InvalidRequest`` naming an option it does not pass on."""
    found: dict[str, Any] = {}
    for line in options:
        words = shlex.split(line, comments=False)
        i = 0
        while i < len(words):
            word, value = words[i], None
            if word.startswith("--"):
                name, eq, value = word[2:].partition("=")
                value = value if eq else None
            elif word.startswith("-") and len(word) >= 2:
                name, value = _SHORT.get(word[1], word), word[2:] or None
            else:
                raise InvalidRequest(f"#SBATCH {line!r}: {word!r} is not an option of sbatch's")
            if name not in REST_OPTIONS:
                raise InvalidRequest(
                    f"#SBATCH {word.split('=')[0]} is not passed on through slurmrestd (the server uses "
                    f"--slurm-rest); the options it passes on: {', '.join('--' + o for o in REST_OPTIONS)}. "
                    "Drop the option, or ask the server's admin to run it without --slurm-rest (sbatch reads every one)"
                )
            if value is None:
                i += 1
                if i >= len(words):
                    raise InvalidRequest(f"#SBATCH {line!r}: --{name} needs a value")
                value = words[i]
            _, prop, read = REST_OPTIONS[name]
            try:
                found[prop] = read(value)
            except ValueError:
                raise InvalidRequest(f"#SBATCH --{name}={value}: not a value sbatch reads for --{name}") from None
            i += 1
    return found


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class SlurmRest(SlurmClient):
    """slurmrestd at ``url`` (``http(s)://host:port`` or ``unix:/path``), as ``user``, with the JWT in
    ``token_file`` (read again when it changes) or ``token`` (``SLURM_JWT``), or none on a ``unix:``
    socket (local authentication). ``fallback`` runs what stays on the commands (see the module's
    docstring). Raises ``ConfigError`` saying why when slurmrestd does not answer, refuses the
    token, or speaks none of ``SUPPORTED_VERSIONS``."""

    def __init__(
        self, url: str, user: str, fallback: SlurmCommands, token_file: Path | None = None, token: str = ""
    ) -> None:
        self.url = url
        self.user = user
        self.fallback = fallback
        self._token_file = token_file
        self._token = token
        self._token_seen: tuple[float, int] = (-1.0, -1)
        self._listed: dict[str, tuple[float, list[Listed]]] = {}  # user → (when asked, their jobs then)
        self._lock = threading.Lock()
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme == "unix":
            self._unix = parsed.path or url[len("unix:") :]
            if not self._unix.startswith("/"):
                raise ConfigError(
                    f"--slurm-rest {url}: a unix socket is named by its absolute path: unix:/run/slurmrestd.sock"
                )
        elif parsed.scheme in ("http", "https") and parsed.hostname:
            self._unix = ""
        else:
            raise ConfigError(
                f"--slurm-rest {url!r}: give slurmrestd's address as http(s)://host:port or unix:/path/to/socket"
            )
        self._parsed = parsed
        if not self._unix and token_file is None and not token:
            raise ConfigError(
                f"--slurm-rest {url}: slurmrestd over the network takes a JWT (AuthAltTypes=auth/jwt): give it in "
                "--slurm-rest-token-file FILE or SLURM_JWT (make one with `scontrol token lifespan=SECONDS`)"
            )
        if token_file is not None:
            try:
                self._read_token()
            except OSError as e:
                raise ConfigError(str(e)) from None
        self.version = self._discover()
        self.path = f"slurmrestd at {url} (API {self.version})"
        try:  # one call that reaches slurmctld: the token is checked here, not at the first job
            self._call("GET", "ping")
        except (OSError, RuntimeError) as e:
            raise ConfigError(self._why(e)) from None

    def _why(self, e: Exception) -> str:
        said = f"slurmrestd at {self.url} did not answer as it should: {e}"
        if isinstance(e, RuntimeError) and not self._unix:
            said += (
                f". slurmrestd says no more when slurmctld refuses its token: check the JWT "
                f"({'--slurm-rest-token-file ' + str(self._token_file) if self._token_file else 'SLURM_JWT'}) is a "
                f"current one for {self.user} (`scontrol token username={self.user}`) and that slurm.conf has "
                "AuthAltTypes=auth/jwt"
            )
        return said

    # ---- the wire ------------------------------------------------------------------------------------

    def _read_token(self) -> str:
        """The token, read again from its file when that changed (tokens expire and are replaced).
        Raises ``OSError`` when the file cannot be read."""
        if self._token_file is None:
            return self._token
        try:
            info = self._token_file.stat()
            seen = (info.st_mtime, info.st_size)
            if seen != self._token_seen:
                token = self._token_file.read_text().strip()
                token = token.split("=", 1)[1] if token.startswith("SLURM_JWT=") else token  # scontrol token's
                with self._lock:
                    self._token, self._token_seen = token, seen
        except OSError as e:
            raise OSError(f"--slurm-rest-token-file {self._token_file}: {e.strerror or e}") from None
        return self._token

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        headers = {"Accept": "application/json"}
        token = self._read_token()
        if token:
            headers.update({"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": token})
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        connection: http.client.HTTPConnection
        if self._unix:
            connection = _UnixConnection(self._unix, DEFAULT_COMMAND_TIMEOUT)
        elif self._parsed.scheme == "https":
            context = ssl.create_default_context()
            connection = http.client.HTTPSConnection(
                self._parsed.hostname or "", self._parsed.port, timeout=DEFAULT_COMMAND_TIMEOUT, context=context
            )
        else:
            connection = http.client.HTTPConnection(
                self._parsed.hostname or "", self._parsed.port, timeout=DEFAULT_COMMAND_TIMEOUT
            )
        prefix = self._parsed.path.rstrip("/") if not self._unix else ""
        try:
            connection.request(method, prefix + path, body=data, headers=headers)
            reply = connection.getresponse()
            raw = reply.read()
        except (http.client.HTTPException, OSError) as e:  # the one boundary of the wire's errors
            raise OSError(f"slurmrestd at {self.url}: {e}") from None
        finally:
            connection.close()
        try:
            found = json.loads(raw or b"{}")
        except ValueError:
            found = {"errors": [{"error": raw[:200].decode(errors="replace").strip() or f"HTTP {reply.status}"}]}
        return reply.status, found if isinstance(found, dict) else {}

    def _call(self, method: str, what: str, body: Any = None) -> dict[str, Any]:
        """slurmrestd's answer to ``method /slurm/{version}/{what}``; raises ``RuntimeError`` with
        Slurm's message (its ``errors[].error``) when it refuses."""
        status, found = self._request(method, f"/slurm/{self.version}/{what}", body)
        if status >= 400:
            raise RuntimeError(_errors(found) or f"slurmrestd answered HTTP {status}")
        return found

    def _discover(self) -> str:
        """The newest API version both slurmrestd and this client speak: from its /openapi, else by
        trying each supported one."""
        offered: list[str] = []
        try:
            status, spec = self._request("GET", "/openapi")
        except OSError as e:
            raise ConfigError(f"{e}: is slurmrestd running there?") from None
        if status == 200:
            offered = sorted({m.group(1) for p in spec.get("paths", {}) if (m := _API.match(p))}, reverse=True)
        else:
            for version in SUPPORTED_VERSIONS:
                with contextlib.suppress(OSError):
                    if self._request("GET", f"/slurm/{version}/ping")[0] != 404:
                        offered.append(version)
        for version in SUPPORTED_VERSIONS:
            if version in offered:
                return version
        raise ConfigError(
            f"slurmrestd at {self.url} offers the API versions {', '.join(offered) or 'none it names'}; gpuport speaks "
            f"{', '.join(SUPPORTED_VERSIONS)} (Slurm 22.05's): load that one (slurmrestd -s openapi/"
            f"{SUPPORTED_VERSIONS[0]}), or run the server without --slurm-rest to use Slurm's commands"
        )

    # ---- the operations --------------------------------------------------------------------------------

    def partitions(self) -> list[str]:
        found = []
        for partition in self._call("GET", "partitions").get("partitions", []):
            flags = partition.get("flags") or []
            found.append(str(partition.get("name", "")) + ("*" if "default" in flags else ""))
        return found

    def _job(self, options: list[str]) -> dict[str, Any]:
        job = job_properties(options)
        # sbatch passes the submitter's environment on; slurmrestd has none of its own. Not Slurm's
        # own variables (the token among them), which Slurm sets for the job.
        job["environment"] = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        job.setdefault("current_working_directory", os.getcwd())
        return job

    def submit(self, script: Path, options: list[str]) -> str:
        body = {"script": script.read_text(), "job": self._job(options)}
        found = self._call("POST", "job/submit", body)
        if not found.get("job_id"):
            raise RuntimeError(_errors(found) or "slurmrestd gave no job id")
        return str(found["job_id"])

    def test(self, options: list[str]) -> None:
        job = {**self._job(options), "name": "gpuport-check", "standard_output": "/dev/null"}
        job["begin_time"] = f"now+{DEFAULT_CHECK_BEGIN}"  # as sbatch --begin reads it: seconds from now
        found = self._call("POST", "job/submit", {"script": "#!/bin/sh\ntrue\n", "job": job})
        if found.get("job_id"):
            with contextlib.suppress(OSError, RuntimeError):
                self._call("DELETE", f"job/{found['job_id']}")
        else:
            raise RuntimeError(_errors(found) or "slurmrestd gave no job id")

    def queue(self, user: str) -> list[Listed]:
        # "Changed since": slurmctld answers 304 and nothing when no job changed since then, where a
        # whole list is seconds of its CPU for thousands of jobs. Since the last look's start, less
        # a margin for the controller's clock.
        asked = time.time()
        since = self._listed.get(user)
        what = f"jobs?update_time={int(since[0] - DEFAULT_CLOCK_MARGIN)}" if since else "jobs"
        status, listing = self._request("GET", f"/slurm/{self.version}/{what}")
        if status == 304 and since is not None:
            self._listed[user] = (asked, since[1])
            return since[1]
        if status >= 300:
            raise RuntimeError(_errors(listing) or f"slurmrestd answered HTTP {status}")
        found = []
        for job in listing.get("jobs", []):
            state = str(job.get("job_state", ""))
            if job.get("user_name") != user or state not in _LISTED:
                continue
            started = job.get("start_time") if state in ("RUNNING", "COMPLETING") else None
            found.append(
                Listed(
                    str(job.get("job_id", "")),
                    state,
                    str(job.get("tres_per_node") or ""),
                    int(job.get("node_count") or 1),
                    int(job.get("cpus") or 0),
                    float(started) if started else None,
                    str(job.get("nodes") or ""),
                    str(job.get("state_reason") or ""),
                )
            )
        self._listed[user] = (asked, found)
        return found

    def cancel(self, slurm_id: str, signal: str = "", batch_only: bool = False) -> None:
        if batch_only:  # the API signals every step of the job: scancel --batch
            self.fallback.cancel(slurm_id, signal, batch_only)
            return
        self._call("DELETE", f"job/{slurm_id}" + (f"?signal={signal}" if signal else ""))

    def nodes(self) -> list[NodeInfo]:
        found = []
        for node in self._call("GET", "nodes").get("nodes", []):
            with contextlib.suppress(ValueError, TypeError):
                found.append(
                    NodeInfo(
                        str(node["name"]),
                        float(node.get("cpus") or 0),
                        int(node.get("real_memory") or 0),
                        str(node.get("gres") or ""),
                    )
                )
        return found


def _errors(found: dict[str, Any]) -> str:
    """slurmrestd's errors, as Slurm says them (its ``errors[].error``, and what failed where that adds)."""
    said = []
    for error in found.get("errors") or []:
        if isinstance(error, dict):
            text = str(error.get("error") or "")
            more = str(error.get("description") or "")
            if more and more.lower() != text.lower() and text in ("", "Unspecified error"):
                text = f"{text} ({more})" if text else more
            if text:
                said.append(text)
    return "; ".join(said)
