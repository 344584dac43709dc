"""SQLite (WAL): the one source of truth for the server's state.

Services own their SQL; this module owns the connection, the schema and its migrations. Each
migration runs once, in order, and ``PRAGMA user_version`` records how many have run, so a state
dir made by an older server is upgraded in place on start.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuport.defaults import DEFAULT_JOBS_PER_USER, DEFAULT_PROCESSES_PER_JOB
from gpuport.protocol.errors import ServerError

# Append only: a state dir records how many of these it has applied.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE tokens (
        id          INTEGER PRIMARY KEY,
        name        TEXT NOT NULL,
        hash        TEXT NOT NULL UNIQUE,     -- sha256 hex of the token; the token itself is never kept
        admin       INTEGER NOT NULL DEFAULT 0,
        created_at  REAL NOT NULL,
        revoked_at  REAL                      -- NULL while valid; kept so a revoked token gets a clear error
    );
    CREATE UNIQUE INDEX tokens_active_name ON tokens(name) WHERE revoked_at IS NULL;
    """,
    """
    CREATE TABLE snapshots (
        id          TEXT NOT NULL,            -- sha256 of the canonical manifest
        owner       TEXT NOT NULL,
        created_at  REAL NOT NULL,
        files       INTEGER NOT NULL,
        bytes       INTEGER NOT NULL,
        manifest    TEXT NOT NULL,            -- JSON [[path, blob, size, mode, link], ...], sorted by path
        PRIMARY KEY (id, owner)
    );
    CREATE TABLE snapshot_names (
        owner       TEXT NOT NULL,
        name        TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        updated_at  REAL NOT NULL,
        PRIMARY KEY (owner, name)
    );
    CREATE TABLE jobs (
        seq                 INTEGER PRIMARY KEY,      -- submission order: the queue's order
        id                  TEXT NOT NULL UNIQUE,
        owner               TEXT NOT NULL,
        name                TEXT NOT NULL DEFAULT '',
        state               TEXT NOT NULL,            -- JobState
        command             TEXT NOT NULL,            -- JSON argv
        gpus                INTEGER NOT NULL,
        gpu_indices         TEXT NOT NULL,            -- JSON list, set when it starts
        created_at          REAL NOT NULL,
        started_at          REAL,
        ended_at            REAL,
        exit_code           INTEGER,
        message             TEXT NOT NULL DEFAULT '',
        snapshot_id         TEXT NOT NULL DEFAULT '', -- the workdir; '' for an empty one
        output_snapshot_id  TEXT NOT NULL DEFAULT '',
        outputs             TEXT NOT NULL,            -- JSON list of declared output paths
        spec                TEXT NOT NULL,            -- JSON: env, datasets, hyperparameters
        cancel_requested    INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_owner ON jobs(owner, seq);
    CREATE INDEX jobs_state ON jobs(state);
    """,
    """
    ALTER TABLE jobs ADD COLUMN time_limit REAL NOT NULL DEFAULT 0;   -- seconds; 0: none
    """,
    """
    ALTER TABLE jobs ADD COLUMN gpu_memory INTEGER NOT NULL DEFAULT 0;  -- bytes: a slice of one GPU; 0: none
    ALTER TABLE jobs ADD COLUMN cpus REAL NOT NULL DEFAULT 0;           -- CPUs reserved; 0: none
    ALTER TABLE jobs ADD COLUMN memory INTEGER NOT NULL DEFAULT 0;      -- bytes of RAM reserved; 0: none
    ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN nprocs INTEGER NOT NULL DEFAULT 1;      -- processes of one job (distributed)
    ALTER TABLE jobs ADD COLUMN reserved_at REAL;                       -- when it first held the reservation
    CREATE TABLE quotas (
        user        TEXT PRIMARY KEY,         -- a token name, or '*' for every user without a quota of their own
        gpus        REAL,                     -- GPUs held at once (slices count as their part); NULL: no limit
        jobs        INTEGER,                  -- jobs running at once; NULL: no limit
        updated_at  REAL NOT NULL
    );
    """,
    # 4: sessions, whose workers are jobs of kind 'session'
    """
    ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'job';     -- 'job' or 'session' (a session's worker)
    CREATE TABLE sessions (
        seq           INTEGER PRIMARY KEY,
        id            TEXT NOT NULL UNIQUE,
        owner         TEXT NOT NULL,
        name          TEXT NOT NULL DEFAULT '',
        job_id        TEXT NOT NULL,            -- its current worker
        spec          TEXT NOT NULL,            -- JSON: what each worker is started with
        idle_timeout  REAL NOT NULL,            -- seconds
        created_at    REAL NOT NULL,
        ended_at      REAL,
        message       TEXT NOT NULL DEFAULT ''  -- why it ended
    );
    CREATE UNIQUE INDEX sessions_live_name ON sessions(owner, name) WHERE ended_at IS NULL AND name != '';
    """,
    """
    CREATE TABLE deployments (
        seq           INTEGER PRIMARY KEY,
        id            TEXT NOT NULL UNIQUE,     -- d-<hex>: its folder under STATE_DIR/models
        name          TEXT NOT NULL,            -- the model's name in prediction URLs, the same for every user
        version       INTEGER NOT NULL,
        owner         TEXT NOT NULL,
        source        TEXT NOT NULL,            -- as deployed: snapshot:<id>[:path], a snapshot name, job:<id>:<path>
        snapshot_id   TEXT NOT NULL,
        path          TEXT NOT NULL DEFAULT '', -- the model's path inside the snapshot
        format        TEXT NOT NULL DEFAULT '', -- as asked ('' : found from the files)
        spec          TEXT NOT NULL,            -- JSON: resources, replicas, batching
        state         TEXT NOT NULL,            -- loading, ready, failed (message says why)
        message       TEXT NOT NULL DEFAULT '',
        metadata      TEXT NOT NULL DEFAULT '', -- JSON: the format, inputs and outputs the model published
        jobs          TEXT NOT NULL DEFAULT '[]', -- its replicas' current workers
        created_at    REAL NOT NULL,
        ended_at      REAL                      -- undeployed
    );
    CREATE UNIQUE INDEX deployments_live ON deployments(name, version) WHERE ended_at IS NULL;
    """,
    # 7: who may use which blob. The store keeps a content once for everyone, but a user counts as
    # having it only after sending its bytes, or through a snapshot of theirs (an output of their
    # job): a hash alone neither tells whether someone else has that content nor hands it out.
    """
    CREATE TABLE blob_holders (
        owner   TEXT NOT NULL,
        blob    TEXT NOT NULL,
        PRIMARY KEY (owner, blob)
    ) WITHOUT ROWID;
    INSERT OR IGNORE INTO blob_holders (owner, blob)
        SELECT s.owner, json_extract(e.value, '$[1]') FROM snapshots s, json_each(s.manifest) e
        WHERE json_extract(e.value, '$[1]') != '';
    """,
    # 8: the Unix uid each user's work runs as, when the server runs as root (server/isolation.py)
    """
    CREATE TABLE unix_users (
        owner   TEXT PRIMARY KEY,
        uid     INTEGER NOT NULL UNIQUE
    );
    """,
    # 9: one user cannot take the whole box by default: the quota of every user without their own
    f"""
    INSERT OR IGNORE INTO quotas (user, gpus, jobs, updated_at)
        VALUES ('*', NULL, {DEFAULT_JOBS_PER_USER}, CAST(strftime('%s', 'now') AS REAL));
    """,
    # 10: the node a job runs on (its GPU indices are that node's); '' : this machine, before nodes
    """
    ALTER TABLE jobs ADD COLUMN node TEXT NOT NULL DEFAULT '';
    """,
    # 11: jobs that span nodes: how many, and (once running) each node rank's node and GPUs, as JSON
    """
    ALTER TABLE jobs ADD COLUMN nodes INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE jobs ADD COLUMN placement TEXT NOT NULL DEFAULT '';
    """,
    # 12: a token's client certificate (gpuport token create --client-cert): its sha256:... fingerprint
    """
    ALTER TABLE tokens ADD COLUMN cert_fingerprint TEXT;
    CREATE UNIQUE INDEX tokens_cert ON tokens(cert_fingerprint) WHERE cert_fingerprint IS NOT NULL;
    """,
    # 13: TensorFlow Serving's version labels: a model name's label names one of its versions
    """
    CREATE TABLE model_labels (
        name        TEXT NOT NULL,
        label       TEXT NOT NULL,
        version     INTEGER NOT NULL,
        updated_at  REAL NOT NULL,
        PRIMARY KEY (name, label)
    );
    """,
    # 14: what a token may do: '' everything its user may; 'metrics' read GET /metrics and nothing else
    """
    ALTER TABLE tokens ADD COLUMN scope TEXT NOT NULL DEFAULT '';
    """,
    # 15: jobs a user may have queued at once; NULL: the '*' quota's, else DEFAULT_QUEUED_PER_USER
    """
    ALTER TABLE quotas ADD COLUMN queued INTEGER;
    """,
    # 16: the processes and threads each job of the user may run at once (server/cgroups.py)
    f"""
    ALTER TABLE quotas ADD COLUMN processes INTEGER NOT NULL DEFAULT {DEFAULT_PROCESSES_PER_JOB};
    """,
    # 17: storage: what each held blob weighs (its holder is charged all of it), since when it is
    # held (the sweep spares younger ones), and each user's storage quota (bytes; NULL: the '*'
    # quota's, else DEFAULT_STORAGE_SHARE of the state dir's filesystem)
    """
    ALTER TABLE quotas ADD COLUMN storage INTEGER;
    ALTER TABLE blob_holders ADD COLUMN size INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE blob_holders ADD COLUMN held_at REAL NOT NULL DEFAULT 0;
    UPDATE blob_holders SET size = m.size FROM (
        SELECT s.owner AS owner, json_extract(e.value, '$[1]') AS blob, MAX(json_extract(e.value, '$[2]')) AS size
        FROM snapshots s, json_each(s.manifest) e WHERE json_extract(e.value, '$[1]') != '' GROUP BY 1, 2
    ) m WHERE m.owner = blob_holders.owner AND m.blob = blob_holders.blob;
    """,
    # 18: jobs found by name (a name is unique among its owner's queued and running jobs, checked in
    # the submit's transaction: a unique index would not build where older servers let names repeat),
    # and the snapshot of a running job's outputs taken last (``gpuport download`` on it), dropped
    # once the job has ended
    """
    CREATE INDEX jobs_owner_name ON jobs(owner, name);
    ALTER TABLE jobs ADD COLUMN live_outputs TEXT NOT NULL DEFAULT '';
    """,
    # 19: job arrays and sweeps (each task a job of its own, with its array and index), and the jobs
    # a job waits for (JSON [[job or array id, "ok" | "any"], ...]; '' : none)
    """
    CREATE TABLE arrays (
        seq           INTEGER PRIMARY KEY,
        id            TEXT NOT NULL UNIQUE,     -- j-<hex>, from the jobs' ids' space; its tasks are <id>_<index>
        owner         TEXT NOT NULL,
        name          TEXT NOT NULL DEFAULT '', -- its tasks' name too
        spec          TEXT NOT NULL,            -- as given: Slurm's --array syntax, or %N with a sweep
        max_running   INTEGER NOT NULL DEFAULT 0, -- %N: the most of its tasks running at once; 0: no cap
        sweep         TEXT NOT NULL DEFAULT '', -- JSON {name: [values]} of a sweep; '' : an array
        created_at    REAL NOT NULL
    );
    CREATE INDEX arrays_owner_name ON arrays(owner, name);
    ALTER TABLE jobs ADD COLUMN array_id TEXT NOT NULL DEFAULT '';
    ALTER TABLE jobs ADD COLUMN array_index INTEGER;
    ALTER TABLE jobs ADD COLUMN depends_on TEXT NOT NULL DEFAULT '';
    CREATE INDEX jobs_array ON jobs(array_id, array_index) WHERE array_id != '';
    """,
    # 20: a session's workers in turn, each with where its output starts (its files are its job's)
    """
    ALTER TABLE sessions ADD COLUMN workers TEXT NOT NULL DEFAULT '';  -- JSON [[job id, stdout, stderr]...]
    """,
    # 21: accounting, one row per run of a
    # job, session worker or model replica (a job queued again runs anew): what it held, from when to
    # when (NULL: it still holds it), and the CPU-seconds its processes used where the supervisor could
    # tell; and each user's shares of the machine for the decayed fair share (NULL: the '*' quota's, else 1).
    # The runs recorded before are counted from the jobs table.
    """
    CREATE TABLE usage (
        id          INTEGER PRIMARY KEY,
        job_id      TEXT NOT NULL,
        owner       TEXT NOT NULL,
        kind        TEXT NOT NULL,            -- job | session | model
        started_at  REAL NOT NULL,
        ended_at    REAL,
        gpus        REAL NOT NULL,            -- whole GPUs, times its nodes
        slice_bytes INTEGER NOT NULL,         -- a slice of one GPU (times its nodes)
        slice_of    INTEGER NOT NULL,         -- bytes of the GPU the slice is of; 0: unknown (the largest)
        cpus        REAL NOT NULL,            -- reserved, times its nodes
        memory      INTEGER NOT NULL,         -- bytes reserved, times its nodes
        cpu_used    REAL                      -- CPU-seconds used; NULL: not known
    );
    CREATE INDEX usage_owner ON usage(owner, ended_at);
    CREATE INDEX usage_ended ON usage(ended_at);
    INSERT INTO usage (job_id, owner, kind, started_at, ended_at, gpus, slice_bytes, slice_of, cpus, memory)
        SELECT id, owner, kind, started_at, CASE WHEN state = 'running' THEN NULL ELSE COALESCE(ended_at, started_at) END,
            gpus * nodes, gpu_memory * nodes, 0, cpus * nodes, memory * nodes
        FROM jobs WHERE started_at IS NOT NULL ORDER BY seq;
    ALTER TABLE quotas ADD COLUMN shares REAL;
    """,
    # 22: the cluster's own id of a run whose times its accounting gave (a Slurm job id; '' : the
    # front door timed it), so that what the cluster reports again updates the same row.
    """
    ALTER TABLE usage ADD COLUMN run TEXT NOT NULL DEFAULT '';
    CREATE INDEX usage_job ON usage(job_id);
    """,
]


class Store:
    """One SQLite connection in WAL mode, opened on ``path`` and migrated to the newest schema.

    The event loop and worker threads (a job's outputs are recorded from one) share it: a lock keeps
    a transaction from interleaving with another thread's statements.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except sqlite3.Error as e:
            raise ServerError(f"cannot open the database {path}: {e}") from e

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise ServerError(
                f"the database {self.path} was written by a newer gpuport (schema {version}, this one "
                f"knows {len(MIGRATIONS)}) — upgrade gpuport on the server"
            )
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            try:
                self._db.executescript(f"BEGIN IMMEDIATE;\n{script}\n;PRAGMA user_version = {number};\nCOMMIT;")
            except sqlite3.Error:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (``BEGIN IMMEDIATE``): committed on success, rolled back on error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, params).fetchone()

    def close(self) -> None:
        self._db.close()
