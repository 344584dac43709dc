"""Every tunable default of gpuport, in one place. Client, server and CLI read them from here."""

from __future__ import annotations

# Port of the gRPC API (control calls, uploads, log streams, KServe v2 gRPC).
DEFAULT_GRPC_PORT = 7600
# Port of the HTTP API (REST, prediction protocols, dashboard, metrics).
DEFAULT_HTTP_PORT = 7601
# Address the server binds when none is given: loopback, so nothing is exposed by accident.
DEFAULT_HOST = "127.0.0.1"
# Name of the client profile used when none is named.
DEFAULT_PROFILE = "default"
# Seconds a client waits to connect and complete its first call before calling the server unreachable.
DEFAULT_CONNECT_TIMEOUT = 10.0
# Seconds a client waits for an ordinary control call.
DEFAULT_CALL_TIMEOUT = 30.0
# Seconds the server gives in-flight calls to finish on SIGINT/SIGTERM before cutting them off.
DEFAULT_SHUTDOWN_GRACE = 5.0
# Years the server's self-signed certificate stays valid; clients pin it, so it should rarely change.
DEFAULT_CERT_VALID_YEARS = 10
# Seconds a dashboard login link (`gpuport dashboard`) stays good; it logs in once.
DEFAULT_LOGIN_LINK_SECONDS = 60.0
# Prefix of every token, so that one pasted into a chat or a log is recognisable (and greppable).
TOKEN_PREFIX = "gp_"
# Random bytes in a token: 256 bits.
TOKEN_BYTES = 32
# Longest token or user name accepted.
MAX_NAME_LENGTH = 64
# Largest gRPC message either side accepts; bulk data travels as streams of chunks below this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Bytes either side lets a stream send ahead of what it has read (HTTP/2 flow control): with gRPC's
# 64 KiB default, an upload waited on window updates and ran ~20% slower.
STREAM_WINDOW_BYTES = 16 * 1024 * 1024

# Environment variables read by the client (they override the saved profile).
ENV_URL = "GPUPORT_URL"
ENV_TOKEN = "GPUPORT_TOKEN"
ENV_FINGERPRINT = "GPUPORT_FINGERPRINT"
ENV_PROFILE = "GPUPORT_PROFILE"
# Folder holding the client's config.json (default: the platform's user config dir).
ENV_CONFIG_DIR = "GPUPORT_CONFIG_DIR"
# Environment variables read by the server.
ENV_STATE_DIR = "GPUPORT_STATE_DIR"
# A fake GPU inventory for tests and demos, e.g. "2x16GiB" or "16GiB,24GiB".
ENV_FAKE_GPUS = "GPUPORT_FAKE_GPUS"

# ---- jobs and sync ----
# Folder (under the current directory) where `gpuport run` puts each job's outputs: ./gpuport-outputs/<job-id>/.
DEFAULT_OUTPUT_DIR = "gpuport-outputs"
# Seconds a cancelled job gets between SIGTERM and SIGKILL.
DEFAULT_CANCEL_GRACE = 5.0
# Longest time limit a job may ask for (30 days).
MAX_TIME_LIMIT = 30 * 24 * 3600.0
# Seconds `gpuport run` waits after a first Ctrl-C for a second one that cancels the job.
DEFAULT_DETACH_WINDOW = 2.0
# Most files in one snapshot (a project, a dataset, a job's outputs).
MAX_SNAPSHOT_FILES = 200_000
# Longest path inside a snapshot, in bytes.
MAX_PATH_BYTES = 1024
# Largest single file a snapshot may hold.
MAX_BLOB_BYTES = 64 * 1024**3
# Bytes of blob data per message of an upload or download stream (many small files share one message).
BLOB_BATCH_BYTES = 4 * 1024 * 1024
# Most bytes of a job's command line, environment or hyperparameters (each).
MAX_SPEC_BYTES = 256 * 1024
# Largest JSON body the REST API accepts.
MAX_REST_BODY_BYTES = 1024 * 1024
# An archive posted to POST /v1/snapshots (a project or dataset, without the CLI), as sent and unpacked.
MAX_ARCHIVE_BYTES = 8 * 1024**3
MAX_ARCHIVE_UNPACKED_BYTES = 32 * 1024**3
# An archive unpacks to at most this many times its own size (a gzip or zip bomb is refused as it
# unpacks), or to MAX_ARCHIVE_UNPACKED_FLOOR whatever its size, and never past MAX_ARCHIVE_UNPACKED_BYTES.
MAX_ARCHIVE_EXPANSION = 100
MAX_ARCHIVE_UNPACKED_FLOOR = 256 * 1024**2
# Most entries of any kind (files, folders, links) in one archive: folders are entries to read too.
MAX_ARCHIVE_MEMBERS = MAX_SNAPSHOT_FILES + MAX_SNAPSHOT_FILES // 4
# Archives unpacked at once, each in a process of its own at a lower priority: more wait their turn.
DEFAULT_ARCHIVE_PROCESSES = 2
# Jobs (sessions' workers and model replicas count) one user runs at once unless an admin sets
# otherwise: the quota of '*' a new state dir starts with (`gpuport quota set '*' --jobs N`).
DEFAULT_JOBS_PER_USER = 16
# Jobs one user may have queued (waiting) at once, unless an admin sets otherwise for them or '*'
# (`gpuport quota set USER --queued N`): a submit past it is refused, and nothing is stored.
DEFAULT_QUEUED_PER_USER = 1_000
# Most tasks one job array or sweep may have (each is a job; the queued cap applies to them as well).
MAX_ARRAY_TASKS = 10_000
# Highest index of a job array's task (Slurm's MaxArraySize is 1001 by default; ours is wider).
MAX_ARRAY_INDEX = 999_999
# Processes and threads each job may run at once, where the kernel counts them (cgroups' pids
# controller): the quota of '*' a new state dir starts with (`gpuport quota set '*' --processes N`).
DEFAULT_PROCESSES_PER_JOB = 4096
# Storage each user may keep (the blobs of their snapshots, datasets, outputs and uploads, and their
# jobs' logs) unless an admin sets otherwise: this share of the state dir's filesystem.
DEFAULT_STORAGE_SHARE = 0.25
# Seconds a blob no snapshot refers to is kept (an upload in flight becomes a snapshot within it)
# before the storage sweep removes it (`gpuport server --blob-grace`).
DEFAULT_BLOB_GRACE = 3600.0
# Seconds between two storage sweeps (the first runs as the server starts).
DEFAULT_SWEEP_INTERVAL = 3600.0
# Work that reserves no memory waits while the machine has less than this free: the smaller of
# the two (`gpuport server --memory-floor`). With cgroups, the machine's memory less the floor is
# also what a job without --memory may use, and what all jobs together may use.
DEFAULT_MEMORY_FLOOR_FRACTION = 0.05
DEFAULT_MEMORY_FLOOR_MAX = 2 * 1024**3
# Bytes of log per message of a log stream.
LOG_CHUNK_BYTES = 1024 * 1024
# Bytes of a job's log kept on disk: its first half and its last, with a note of what was cut between.
DEFAULT_LOG_LIMIT = 256 * 1024**2
# Seconds between looks at a running job's log file when a follower has read everything.
LOG_POLL_INTERVAL = 0.02
# Seconds a client keeps retrying a dropped log stream (e.g. while the server restarts) before giving up.
DEFAULT_RECONNECT_WINDOW = 60.0
# Folder for the client's cache of file hashes (default: the platform's user cache dir).
ENV_CACHE_DIR = "GPUPORT_CACHE_DIR"
# Environment every job gets: its id, where to write outputs, where datasets are.
ENV_JOB_ID = "GPUPORT_JOB_ID"
ENV_OUTPUT_DIR = "GPUPORT_OUTPUT_DIR"
# The folder of a job's worker endpoints (sockets the server connects to) and the files it reads of a
# worker (a session's output, a replica's load error): the executor's, reached by name through it.
ENV_RUN_DIR = "GPUPORT_RUN_DIR"
ENV_DATASETS_DIR = "GPUPORT_DATASETS_DIR"
# The file that appears (holding "1") in a job the server preempts, before its SIGTERM:
# `gpuport.preempted()` reads it.
ENV_PREEMPTED_FILE = "GPUPORT_PREEMPTED_FILE"
# The name of the node the job runs on, as `gpuport gpus` shows it (this machine's hostname on one machine).
ENV_NODE = "GPUPORT_NODE"
# A job array's task: its index and its array's id and task count; and the same under Slurm's names,
# so that scripts written for `sbatch --array` run unchanged.
ENV_ARRAY_INDEX = "GPUPORT_ARRAY_INDEX"
ENV_ARRAY_ID = "GPUPORT_ARRAY_ID"
ENV_ARRAY_COUNT = "GPUPORT_ARRAY_COUNT"

# ---- GPU sharing ----
# What a job holding a slice of a GPU gets: the bytes each of its processes may use on its GPU, and
# the same as a fraction of the GPU (read by the job's bootstrap to cap TensorFlow and PyTorch).
ENV_GPU_MEMORY = "GPUPORT_GPU_MEMORY"
ENV_GPU_MEMORY_FRACTION = "GPUPORT_GPU_MEMORY_FRACTION"
# With the fake inventory: the folder where a job's process may declare the fake GPU memory it
# "uses" (a file named by its pid holding "GPU_INDEX BYTES"), so that tests can trip the watchdog.
ENV_FAKE_GPU_DIR = "GPUPORT_FAKE_GPU_DIR"
# Seconds between the watchdog's readings of GPU (NVML) and RAM use of jobs with a slice or a memory limit.
DEFAULT_WATCHDOG_INTERVAL = 0.5

# ---- sessions and remote functions ----
# Seconds a session may go without a call before the server ends it and frees what it holds.
DEFAULT_SESSION_IDLE_TIMEOUT = 30 * 60.0
# Seconds an unnamed session outlives its last client (a dropped connection comes back within them).
SESSION_DETACHED_GRACE = 60.0
# Values up to this many bytes travel inside a call's message; larger ones stream in chunks of this size.
SESSION_INLINE_BYTES = 4 * 1024 * 1024
# Values from this many bytes on show a progress bar (when stderr is a terminal).
SESSION_PROGRESS_BYTES = 64 * 1024 * 1024
# Memory that large values arrived in, once they are gone, is kept for the next ones: up to this many
# bytes per session (on the server) or per client (for results), for this many seconds. Receiving into
# memory first touched costs page faults that take about as long as the transfer itself.
SESSION_REUSE_BYTES = 4 * 1024 * 1024 * 1024
SESSION_REUSE_SECONDS = 60.0
# Seconds a tunnel's TLS relay (TensorFlow's remote device: on the laptop and in the server) keeps
# polling after it forwarded bytes, yielding the CPU between polls, before it sleeps. An RPC's
# messages come in bursts, and the next one waking a sleeping thread costs a wake-up on another CPU:
# 25-50 us on a VM whose idle CPUs halt. The same figure as Linux's busy_poll. 0: never spin.
TUNNEL_SPIN_SECONDS = 50e-6
# ---- model serving ----
# A deployment coalesces concurrent requests into batches of up to this many rows, waiting at most
# this long (seconds) after the oldest arrived, unless told otherwise.
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_QUEUE_DELAY = 0.002
# Requests waiting for a deployment's replicas beyond this many are refused (the model is overloaded).
MAX_SERVING_QUEUE = 4096
# A prediction request's body (REST) or message (gRPC) may have at most this many bytes.
MAX_INFER_BYTES = 64 * 1024 * 1024
# Environment a session's worker sets for the code it runs: the folder of its endpoints (its run folder).
ENV_SESSION_DIR = "GPUPORT_SESSION_DIR"
# ... and gets: where its stdout and stderr start ("OUT,ERR": where the session's earlier worker's ended).
ENV_SESSION_OUTPUT = "GPUPORT_SESSION_OUTPUT"
# ... and its idle timeout in seconds: a worker whose server is gone ends itself once idle well past it.
ENV_SESSION_IDLE_TIMEOUT = "GPUPORT_SESSION_IDLE_TIMEOUT"

# ---- environments (server/environments.py) ----
# Share of the state dir's filesystem that built environments may take before the least recently
# used ones not in use are evicted (`gpuport server --env-cache SIZE` sets bytes instead).
DEFAULT_ENV_CACHE_SHARE = 0.25
# Seconds an environment's build may take (resolving and installing) before it is stopped and fails.
DEFAULT_ENV_BUILD_TIMEOUT = 1800.0

# ---- fair share over weeks (server/services/usage.py, server/scheduler.py) ----
# Seconds after which a user's past use counts half in the fair-share order (Slurm's
# PriorityDecayHalfLife); `gpuport server --fairshare-half-life` sets it.
DEFAULT_FAIRSHARE_HALF_LIFE = 7 * 24 * 3600.0
# How long a job waits for what preemptible jobs hold before they are preempted for it (`gpuport
# server --preempt-after`).
DEFAULT_PREEMPT_AFTER = 600.0
# Seconds before a job's first retry (after its node was lost, the server restarted, or it exited with
# a code of its --retry-on-exit); each next retry waits twice as long, at most DEFAULT_RETRY_BACKOFF_MAX.
DEFAULT_RETRY_BACKOFF = 1.0
# The exit code --retry-on-exit names to retry a job the kernel's OOM killer ended (128 + SIGKILL, as a
# shell reports it; the server tells an OOM kill from its own kills).
OOM_EXIT_CODE = 137
DEFAULT_RETRY_BACKOFF_MAX = 300.0
# How much a user's turn improves once their next job has waited DEFAULT_MAX_AGE, in units of the
# machine's average decayed use per share (what a user at exactly their share has used): 1 puts a
# user at twice their share whose job waited a week level with one at their share who just asked.
DEFAULT_AGE_WEIGHT = 1.0
# Seconds of waiting after which a job's age counts no more (Slurm's PriorityMaxAge): the age factor
# grows linearly to it, then stays. What keeps a heavy user from waiting forever is the decay itself.
DEFAULT_MAX_AGE = 7 * 24 * 3600.0
# A user's shares of the machine when no quota gives them some (`gpuport quota set USER --shares N`).
DEFAULT_SHARES = 1.0
