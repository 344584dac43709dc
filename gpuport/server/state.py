"""The server's state dir: one private folder holding the TLS key, the database, blobs and jobs.

Layout::

    STATE_DIR/          mode 0700, owned by the user running the server
      tls/cert.pem      the self-signed certificate clients pin
      tls/key.pem       its private key (0600)
      tls/client-ca.pem the CA that signs users' client certificates (gpuport token create --client-cert)
      tls/client-ca.key its private key (0600)
      gpuport.db        SQLite, WAL mode: tokens, snapshots, jobs
      blobs/ab/cdef..   file contents by SHA-256 (read-only), shared by every snapshot and output
      jobs/<id>/        each job's directory: its log, exit status and working copy
      gpu-history.json  the GPUs' last hour, for the dashboard's charts (server/history.py)
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from gpuport.defaults import ENV_STATE_DIR
from gpuport.protocol.errors import ConfigError


def default_state_dir() -> Path:
    """``$GPUPORT_STATE_DIR``, else the platform's per-user data dir for gpuport."""
    return Path(os.environ.get(ENV_STATE_DIR) or platformdirs.user_data_dir("gpuport", appauthor=False))


@dataclass(frozen=True)
class StateDir:
    """Paths inside a state dir that was checked (or created) by ``open_state_dir``."""

    root: Path
    created: bool

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    @property
    def cert_path(self) -> Path:
        return self.tls_dir / "cert.pem"

    @property
    def key_path(self) -> Path:
        return self.tls_dir / "key.pem"

    @property
    def client_ca_path(self) -> Path:
        return self.tls_dir / "client-ca.pem"

    @property
    def client_ca_key_path(self) -> Path:
        return self.tls_dir / "client-ca.key"

    @property
    def db_path(self) -> Path:
        return self.root / "gpuport.db"

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    @property
    def sessions_dir(self) -> Path:
        return self.root / "sessions"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def gpu_history_path(self) -> Path:
        return self.root / "gpu-history.json"

    @property
    def envs_dir(self) -> Path:
        """Python environments built from projects' requirements (``server/environments.py``)."""
        return self.root / "envs"

    @property
    def python_dir(self) -> Path:
        """Readable copies of the server's own code, for jobs, where its folder is closed to them."""
        return self.root / "python"


def open_state_dir(path: Path) -> StateDir:
    """Create ``path`` with mode 0700 if it is missing; refuse one that others could read or write.

    Raises ``ConfigError`` when the folder is not a directory, belongs to another user, or is open
    to group or others: it holds the TLS private key and the token hashes.
    """
    path = path.expanduser().absolute()
    created = False
    if not path.exists():
        path.mkdir(parents=True, mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        created = True
    for folder in (path, path / "tls"):
        if not folder.exists():
            continue
        info = folder.stat()
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"state dir {folder} is not a directory — pass another --state-dir")
        if info.st_uid != os.getuid():
            raise ConfigError(
                f"state dir {folder} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}) — "
                "run the server as its owner, or pass another --state-dir"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"state dir {folder} has unsafe permissions {mode:04o}: it holds the server's TLS key "
                f"and token hashes, so only its owner may read it — run `chmod 700 {folder}` and start again"
            )
    (path / "tls").mkdir(mode=0o700, exist_ok=True)
    return StateDir(root=path, created=created)
