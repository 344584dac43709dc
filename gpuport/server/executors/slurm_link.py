"""The link of a Slurm job whose workers the server talks to (a session's), inside its allocation.

On a real cluster the job's folder is on NFS, where a Unix socket of one node cannot be reached from
another: the server reaches the worker's endpoints over TCP, through this. The job's supervisor
(``worker/supervisor.py``, the spec's ``link``) starts it before anything of the job runs::

    python -m gpuport.server.executors.slurm_link JOB_DIR

It reads and removes the secret the server left in ``JOB_DIR/link.secret``, listens on the node's
address (``node_link.NodeListener``: a certificate made here, never written anywhere; the secret asked
of every connection), writes ``JOB_DIR/link.json`` (its address, port, certificate fingerprint and
Slurm node, with an HMAC of them under the secret: a file the job wrote in its place does not pass
the server's check, ``verified``), says ``ready`` on its stdout, and then serves connections to this
job's endpoints only (``connect_endpoint``: the socket must be one of the job's processes') until
the supervisor ends (its parent-death signal) or kills it once the job has ended.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gpuport._files import atomic_write

LINK_FILE = "link.json"  # in the job's folder: where its link listens, signed (see ``sign``)
SECRET_FILE = "link.secret"  # in the job's folder until the link has read it: hex
_FIELDS = ("job", "node", "address", "port", "fingerprint")


def sign(secret: str, info: dict[str, Any]) -> str:
    """The HMAC-SHA256 (hex) under ``secret`` of what ``link.json`` says."""
    text = "|".join(str(info.get(name, "")) for name in _FIELDS)
    return hmac.new(bytes.fromhex(secret), text.encode(), hashlib.sha256).hexdigest()


def verified(secret: str, job_id: str, data: bytes) -> dict[str, Any]:
    """What a job's ``link.json`` says, once its HMAC under ``secret`` and its job id are checked:
    ``PermissionError`` for one the link of this job did not write (the job's own folder is the
    job's to write, as its user's)."""
    try:
        info = json.loads(data)
        ok = isinstance(info, dict) and hmac.compare_digest(str(info.get("mac", "")), sign(secret, info))
    except (ValueError, TypeError):
        ok = False
    if not ok or info.get("job") != job_id:
        raise PermissionError(f"the link file of job {job_id} was not written by its link: refused")
    return info


def node_address(node: str) -> str:
    """The IPv4 address of the Slurm node ``node`` on the cluster's network: its NodeAddr as Slurm has
    it (where slurmctld reaches it), else this machine's name, resolved. Raises ``OSError``."""
    host = ""
    if node:
        scontrol = shutil.which("scontrol") or "scontrol"
        try:
            out = subprocess.run(
                [scontrol, "show", "node", "-o", node], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        found = re.search(r"\bNodeAddr=(\S+)", out)
        host = found.group(1) if found else ""
    host = host or socket.gethostname()
    return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def _die_with_parent() -> None:
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def serve(job_dir: Path) -> None:
    """Listen for the server's connections to the job's endpoints (see the module's docstring);
    raises ``OSError`` or ``ValueError`` when it cannot."""
    from gpuport.server.executors.base import Stream
    from gpuport.server.executors.node_link import NodeListener, node_endpoint
    from gpuport.server.executors.workspace import connect_endpoint

    job_id = job_dir.name
    secret_file = job_dir / SECRET_FILE
    secret = secret_file.read_text().strip()
    secret_file.unlink()  # read before anything of the job runs; kept by the server only from now
    bytes.fromhex(secret)  # ValueError: not one

    def connect(asked: str, name: str) -> Stream:
        if asked != job_id:
            raise PermissionError(f"this link serves job {job_id}, not {asked[:40]!r}")
        return node_endpoint(connect_endpoint(job_dir, name), name)

    node = os.environ.get("SLURMD_NODENAME", "")
    address = node_address(node)
    listener = NodeListener(address, connect)
    opened = listener.open(secret)
    info: dict[str, Any] = {"job": job_id, "node": node, "address": address, **opened}
    info["mac"] = sign(secret, info)
    atomic_write(job_dir / LINK_FILE, json.dumps(info).encode(), 0o644, durable=False)


def main(argv: list[str]) -> int:
    _die_with_parent()
    parent = os.getppid()
    try:
        serve(Path(argv[1]))
    except (OSError, ValueError, IndexError) as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdout.close()
    if os.getppid() != parent:  # the supervisor ended before the parent-death signal was set
        return 0
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
