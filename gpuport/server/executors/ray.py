"""The Ray executor: jobs run on the nodes of an existing Ray cluster (``gpuport server --ray ADDRESS``).

The server stays the only door users see (TLS, tokens, sync, the fair queue, logs, outputs); it
joins the cluster as a Ray driver, and gpuport's scheduler picks each job's node and GPUs. On every
node the server starts one agent (``ray_agent.py``): a detached, named Ray actor
(``gpuport-agent-<node id>``, with no CPU or GPU of its own) that does there what the local executor
does here (``workspace.py``): it makes the job's folders, runs the job under the same supervisor and
sandbox, and answers for its log, exit status, outputs and usage. A restarted server finds the
agents by name, and through them the jobs it left running.

- **Files**: a job's snapshot and datasets reach its node as blobs, content-addressed: the agent
  keeps a blob store of its own and is sent only the blobs it lacks, so a dataset crosses the
  network once per node, not once per job.
- **Logs and outputs**: read from the agent while the job runs; at its end the log and exit status
  are copied into the server's state dir (``jobs/<id>/``) and its outputs into the blob store.
- **Faults**: a job's supervisor gets SIGUSR1 (kill at once) when its agent's process ends, so a
  job never outlives its node's agent (a raylet killed with SIGKILL takes its workers, and with
  them the agent); the server records the job as failed with "node lost: <node>".
- **Workers** (a session's): the server reaches a worker's endpoint through one TLS link per node
  to its agent (``node_link.py``: the agent's own certificate, pinned; a secret given by a Ray call),
  which connects to the endpoint as the local executor does and relays bytes; its files by actor
  calls. Values cross as bytes: no memory is shared with a worker on another machine.
- **Security**: the server refuses a cluster that answers without Ray's token (``RAY_AUTH_MODE=token``)
  unless told ``--ray-insecure`` for a cluster on loopback; jobs never see Ray's variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from gpuport._files import atomic_write
from gpuport.protocol.errors import ConfigError, InvalidRequest
from gpuport.server.blobs import BlobStore, read_parts
from gpuport.server.executors.base import (
    ENDPOINT_NAME,
    Executor,
    Ingest,
    JobLaunch,
    Node,
    NodeLost,
    OnExit,
    Stream,
    Usage,
)
from gpuport.server.executors.node_link import LinkError, dial
from gpuport.server.executors.ray_agent import NodeAgent, import_ray
from gpuport.server.inventory import GpuInfo
from gpuport.server.worker.supervisor import peer_envs, roles_of

log = logging.getLogger(__name__)

NAMESPACE = "gpuport"
_PART_BYTES = 8 << 20  # blob bytes per call to an agent
_READ_BYTES = 8 << 20  # output bytes per call
_CALL_TIMEOUT = 30.0  # seconds for an agent's answer
_START_TIMEOUT = 300.0  # seconds for a node to set a job up (checked out, its environment built) and start it
# Seconds for an answer the server's event loop waits for (a running job's log, the GPUs): a node
# that hangs must not hold every other request for long.
_QUICK_TIMEOUT = 3.0
_SIZES_EVERY = 1.0  # seconds between asks of the nodes for the log sizes listings showed
_SIZES_KEPT = 60.0  # seconds a job's log size is kept asked for after a listing last showed it
_LOST_AFTER = 6.0  # seconds an agent may stay unreachable before its node counts as lost
_REFRESH = 2.0  # seconds between looks at the cluster's nodes


def _token() -> str:
    """The Ray token this process would send: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    with contextlib.suppress(OSError):
        return Path(path).read_text().strip()
    return ""


def check_cluster(address: str, insecure: bool) -> None:
    """Refuse a cluster that is unreachable, or that answers without a token (unless ``insecure`` on
    loopback): unauthenticated Ray is remote code execution for anyone who reaches its port
    (CVE-2023-48022). Asks the cluster's GCS for its id, without a token and with ours."""
    import grpc

    from gpuport.protocol.sockets import is_loopback

    if _token():  # read by Ray when it is first imported: the driver then sends the token
        os.environ["RAY_AUTH_MODE"] = "token"
    import_ray()
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    host = address.rsplit(":", 1)[0]
    channel = grpc.insecure_channel(address)
    stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
    try:
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10)
            open_door = True
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise ConfigError(
                    f"cannot reach the Ray cluster at {address} ({e.code().name}: {e.details()}) — is "
                    "`ray start --head` running there, and is that its GCS address (host:port)?"
                ) from None
            open_door = False
        if open_door:
            if not insecure:
                raise ConfigError(
                    f"the Ray cluster at {address} accepts requests without a token: anyone who reaches "
                    "it can run code on every node (CVE-2023-48022). Start each node with "
                    "RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN (see the README's scale-out section); "
                    "--ray-insecure allows it for a cluster on loopback only"
                )
            if not is_loopback(host):
                raise ConfigError(f"--ray-insecure is refused for {address}: it is allowed on loopback only")
            return
        token = _token()
        if not token:
            raise ConfigError(
                f"the Ray cluster at {address} wants a token: give the server the cluster's token in "
                "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token)"
            )
        try:
            stub.GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10
            )
        except grpc.RpcError as e:
            raise ConfigError(
                f"the Ray cluster at {address} refused this server's token ({e.details()}): give it the "
                "cluster's token in RAY_AUTH_TOKEN"
            ) from None
    finally:
        channel.close()


# ---- on the server --------------------------------------------------------------------------------


class _RemoteFile(io.RawIOBase):
    """An output file read from its node in parts, as the snapshot service ingests it."""

    def __init__(self, read: Callable[[int, int], bytes | None], mode: int) -> None:
        self._read, self._offset = read, 0
        self.file_mode = mode  # read by SnapshotService.ingest_folder

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._read(self._offset, min(len(buffer), _READ_BYTES)) or b""
        buffer[: len(data)] = data
        self._offset += len(data)
        return len(data)


class _Stopping(Exception):
    """The server is stopping: a job's watch ends without recording anything."""


class _LogPump:
    """Copies the new whole lines of each part's log (a job over several nodes) into the job's log on
    the server; a part of one process each has its lines prefixed with its rank, as the supervisor
    prefixes those of a part of several."""

    def __init__(self, ray: Any, folder: Path, handles: list[Any], per: int) -> None:
        self.ray, self.folder, self.handles, self.per = ray, folder, handles, per
        self.job_id = folder.name
        try:  # where an earlier server's pump stopped
            self.offsets = json.loads((folder / "pump.json").read_text())
        except (OSError, ValueError):
            self.offsets = [0] * len(handles)
        self.partial = [b""] * len(handles)

    def round(self, final: bool = False) -> None:
        out: list[bytes] = []
        for r, handle in enumerate(self.handles):
            prefix = f"[{r * self.per}] ".encode() if self.per == 1 else b""
            while handle is not None:
                try:
                    read = handle.read_log.remote(self.job_id, self.offsets[r], _READ_BYTES)
                    data = self.ray.get(read, timeout=_CALL_TIMEOUT)
                except Exception:
                    break  # its node is gone: what it said so far stays
                if not data:  # the end so far, or a part cut from a log past its limit: then past it
                    try:
                        start = self.ray.get(
                            handle.log_data_offset.remote(self.job_id, self.offsets[r]), timeout=_CALL_TIMEOUT
                        )
                    except Exception:
                        break
                    if start <= self.offsets[r]:
                        break
                    self.offsets[r] = start
                    continue
                self.offsets[r] += len(data)
                *lines, self.partial[r] = (self.partial[r] + data).split(b"\n")
                out += [prefix + line + b"\n" for line in lines]
            if final and self.partial[r]:
                out.append(prefix + self.partial[r] + b"\n")
                self.partial[r] = b""
        if out:
            with open(self.folder / "log", "ab") as log:
                log.write(b"".join(out))
            kept = [offset - len(partial) for offset, partial in zip(self.offsets, self.partial)]
            atomic_write(self.folder / "pump.json", json.dumps(kept).encode(), 0o600, durable=False)


class RayExecutor(Executor):
    kind = "ray"
    uid_per_user = True
    spans_nodes = True
    runs_here = False

    def __init__(self, address: str, root: Path, blobs: BlobStore, *, insecure: bool = False) -> None:
        check_cluster(address, insecure)
        ray = self._ray = import_ray()
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                logging_level=logging.WARNING,
                log_to_driver=False,
                configure_logging=False,
            )
        except Exception as e:
            raise ConfigError(f"cannot join the Ray cluster at {address}: {e}") from None
        self.address = address
        self.root = root
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.blobs = blobs
        self._agents: dict[str, Any] = {}  # node id → actor handle
        self._described: dict[str, dict[str, Any]] = {}  # node id → its agent's description
        self._nodes: list[Node] = []
        self._ids: dict[str, str] = {}  # node name → node id
        self._lost: set[str] = set()  # node ids whose agent stopped answering (Ray may not know yet)
        self._links: dict[str, dict[str, Any]] = {}  # node id → its link to workers (see ``_link``)
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._stopped = threading.Event()
        # The log sizes of jobs running on a node, as last asked (known_log_size): job → size, and
        # when a listing last wanted each; asked by a thread of their own, never by the listing.
        self._log_sizes: dict[str, int] = {}
        self._sizes_wanted: dict[str, float] = {}
        self._sizes_asked = threading.Event()
        self._sizer: threading.Thread | None = None
        self.refresh()
        if not self._nodes:
            log.warning("the Ray cluster at %s has no node gpuport can use yet", address)
        threading.Thread(target=self._watch, name="ray nodes", daemon=True).start()

    # ---- the cluster ------------------------------------------------------------------------------

    def _agent(self, node_id: str, ray_name: str, address: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self._ray.remote(num_cpus=0, max_concurrency=256, max_restarts=0)(NodeAgent)
        return actor.options(
            name=f"gpuport-agent-{node_id}",
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(ray_name, address)

    def refresh(self) -> None:
        """Look at the cluster's nodes: start an agent on each new one, drop those that left."""
        with self._refreshing:
            self._refresh()

    def _refresh(self) -> None:
        ray = self._ray
        alive = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] not in self._lost]
        pending = {}
        for n in alive:
            node_id = n["NodeID"]
            if node_id not in self._described:
                handle = self._agents.get(node_id) or self._agent(node_id, n["NodeName"], n["NodeManagerAddress"])
                self._agents[node_id] = handle
                pending[node_id] = handle.describe.remote()
        for node_id, ref in pending.items():
            try:
                self._described[node_id] = ray.get(ref, timeout=60)
            except Exception as e:
                log.warning("the gpuport agent of Ray node %s did not start: %s", node_id, e)
                self._agents.pop(node_id, None)
        ids = {n["NodeID"] for n in alive}
        nodes, names = [], {}
        for node_id, info in sorted(self._described.items(), key=lambda item: item[1]["name"]):
            if node_id not in ids:
                continue
            name = info["name"]
            if name in names:  # two nodes of one name (the default, their address, on one host)
                name = f"{name}-{node_id[:6]}"
            if not info["isolated"]:
                log.warning("node %s has no sandbox (%s): no work is placed there", name, info["sandbox"])
                continue
            names[name] = node_id
            nodes.append(Node(name, info["machine"], info["address"]))
        with self._lock:
            changed = nodes != self._nodes
            self._nodes, self._ids = nodes, names
            for node_id in set(self._described) - ids:
                self._described.pop(node_id, None)
                self._agents.pop(node_id, None)
                self._links.pop(node_id, None)
        if changed and self.on_change is not None:
            self.on_change()

    def _lose(self, node_id: str) -> None:
        """Stop placing work on a node whose agent cannot be reached (before Ray marks it dead)."""
        with self._lock:
            self._lost.add(node_id)
        self.refresh()

    def _watch(self) -> None:
        while not self._stopped.wait(_REFRESH):
            try:
                self.refresh()
            except Exception:
                log.exception("looking at the Ray cluster's nodes failed")

    def nodes(self) -> list[Node]:
        with self._lock:
            return self._nodes

    def _handle(self, job_id: str) -> tuple[str, Any | None]:
        """The job's node name and its agent (None when that node is gone)."""
        placed = self._placement(job_id)
        if placed is None:
            return "", None
        node_id, name = placed["node_id"], placed["node"]
        with self._lock:
            handle = self._agents.get(node_id)
        if handle is None:
            try:
                handle = self._ray.get_actor(f"gpuport-agent-{node_id}", namespace=NAMESPACE)
            except ValueError:
                return name, None
        return name, handle

    def _handles(self, job_id: str) -> list[Any]:
        """The agents of every node the job runs on (a job over several nodes has more than one)."""
        placed = self._placement(job_id) or {}
        handles = []
        for part in placed.get("parts") or ([placed] if placed else []):
            with self._lock:
                handle = self._agents.get(part["node_id"])
            if handle is not None:
                handles.append(handle)
        return handles

    def _placement(self, job_id: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / job_id / "placement.json").read_text())
        except (OSError, ValueError):
            return None

    def _call(self, job_id: str, method: str, *args: Any, default: Any = None) -> Any:
        """A short read from the agent of the job's node; ``default`` when it does not answer soon."""
        _, handle = self._handle(job_id)
        if handle is None:
            return default
        try:
            return self._ray.get(getattr(handle, method).remote(*args), timeout=_QUICK_TIMEOUT)
        except Exception as e:
            log.debug("job %s: %s on its node failed: %s", job_id, method, e)
            return default

    # ---- jobs -------------------------------------------------------------------------------------

    def start(self, job: JobLaunch, on_exit: OnExit) -> None:
        try:
            if job.parts:
                self._start_gang(job)
            else:
                self._start_one(job)
        except Exception as e:
            silent = self._silent_nodes([p.node for p in job.parts] or [job.placement.node])
            if silent:  # not the job's doing: it is queued again, for the nodes left
                raise NodeLost(f"node {', '.join(silent)} left while the job was started there ({e})") from e
            raise
        self.reattach(job.job_id, on_exit)

    def _silent_nodes(self, names: list[str]) -> list[str]:
        """Of the nodes ``names``, those gone or whose agent does not answer (then no longer used)."""
        silent = []
        for name in names:
            with self._lock:
                node_id = self._ids.get(name)
                handle = self._agents.get(node_id or "")
            if handle is None:
                silent.append(name)
            elif not self._answers(handle):
                with contextlib.suppress(Exception):
                    self._lose(node_id or "")
                silent.append(name)
        return silent

    def _watched(self, handle: Any, ref: Any, timeout: float) -> Any:
        """The answer of a call to ``handle``'s agent (``ref``), waited for up to ``timeout`` seconds
        (a start may build an environment), while asking the agent every ``_LOST_AFTER`` seconds
        whether it still answers: a node that stops answering is seen in seconds, not at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _ = self._ray.wait([ref], timeout=max(0.0, min(_LOST_AFTER, left)))
            if ready:
                return self._ray.get(ref)
            if left <= _LOST_AFTER:
                raise TimeoutError(f"its node's gpuport agent did not answer in {timeout:g}s")
            if not self._answers(handle):
                raise ConnectionError("its node's gpuport agent stopped answering")

    def _start_one(self, job: JobLaunch) -> None:
        with self._lock:
            node_id = self._ids.get(job.placement.node)
            handle = self._agents.get(node_id or "")
        if handle is None:
            raise RuntimeError(f"node {job.placement.node} has left the cluster")
        self._send_files(handle, job)
        folder = self.root / job.job_id
        folder.mkdir(mode=0o700, exist_ok=True)
        for name in ("log", "exit.json"):
            (folder / name).unlink(missing_ok=True)
        placed = {"node_id": node_id, "node": job.placement.node}
        atomic_write(folder / "placement.json", json.dumps(placed).encode(), 0o600)
        self._watched(handle, handle.start.remote(job), _START_TIMEOUT)

    def _start_gang(self, job: JobLaunch) -> None:
        """A job over several nodes: a part of ``nprocs // len(parts)`` processes on each, all told
        where the others listen (TF_CONFIG, MASTER_ADDR/PORT, ranks), on their nodes' networks."""
        ray = self._ray
        with self._lock:
            ids = [self._ids.get(part.node) for part in job.parts]
            handles = [self._agents.get(node_id or "") for node_id in ids]
            addresses = [self._described.get(node_id or "", {}).get("address", "") for node_id in ids]
        gone = [part.node for part, handle in zip(job.parts, handles) if handle is None]
        if gone:
            raise RuntimeError(f"node {gone[0]} has left the cluster")
        for handle in handles:
            self._send_files(handle, job)
        per = job.nprocs // len(job.parts)
        ports = [
            ray.get(handle.free_ports.remote(per + (1 if r == 0 else 0)), timeout=_CALL_TIMEOUT)
            for r, handle in enumerate(handles)
        ]
        endpoints = [f"{addresses[rank // per]}:{ports[rank // per][rank % per]}" for rank in range(job.nprocs)]
        peers = peer_envs(
            roles_of(job.tf_roles, job.nprocs), endpoints, (addresses[0], ports[0][-1]), per, nodes=addresses
        )
        folder = self.root / job.job_id
        folder.mkdir(mode=0o700, exist_ok=True)
        for name in ("exit.json", "pump.json"):
            (folder / name).unlink(missing_ok=True)
        (folder / "log").write_bytes(b"")  # the parts' logs are pumped into it as they run
        placed = [{"node_id": node_id, "node": part.node} for node_id, part in zip(ids, job.parts)]
        record = {**placed[0], "parts": placed, "per_node": per}
        atomic_write(folder / "placement.json", json.dumps(record).encode(), 0o600)
        started = []
        try:
            for r, (part, handle) in enumerate(zip(job.parts, handles)):
                gpus = [list(part.gpu_indices)] * per
                if len(part.gpu_indices) >= per:
                    each = len(part.gpu_indices) // per
                    gpus = [list(part.gpu_indices[i * each : (i + 1) * each]) for i in range(per)]
                rank_env = [
                    {**peers[r * per + local], "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus[local]))}
                    for local in range(per)
                ]
                piece = dataclasses.replace(
                    job,
                    placement=part,
                    nprocs=per,
                    tf_roles=None,
                    rank_gpus=None,
                    parts=(),
                    rank_env=rank_env,
                    rank_base=r * per,
                    host_network=True,
                    outputs=job.outputs if r == 0 else [],
                )
                self._watched(handle, handle.start.remote(piece), _START_TIMEOUT)
                started.append(handle)
        except BaseException:
            for handle in started:
                handle.kill.remote(job.job_id, "another node of the job could not start its part")
            raise

    def _send_files(self, handle: Any, job: JobLaunch) -> None:
        ray = self._ray
        files = [job.workdir] if job.workdir else []
        files += list(job.datasets.values())
        wanted = sorted({e[1] for f in files for e in f.entries if e[1]})
        if not wanted:
            return
        missing = ray.get(handle.missing.remote(wanted), timeout=_CALL_TIMEOUT)
        batch: list[tuple[str, int, bytes, bool]] = []
        size = 0
        for part in read_parts(self.blobs, missing, _PART_BYTES):
            batch.append(part)
            size += len(part[2])
            if size >= _PART_BYTES or not part[3] and len(batch) > 1:
                # A blob's later parts go alone: they continue that blob's writer on the agent.
                ray.get(handle.write.remote(batch), timeout=300)
                batch, size = [], 0
        if batch:
            ray.get(handle.write.remote(batch), timeout=300)
        if missing:
            log.info("job %s: sent %d blobs to node %s", job.job_id, len(missing), job.placement.node)

    def reattach(self, job_id: str, on_exit: OnExit) -> None:
        threading.Thread(target=self._wait, args=(job_id, on_exit), name=f"job {job_id}", daemon=True).start()

    def _wait(self, job_id: str, on_exit: OnExit) -> None:
        with contextlib.suppress(_Stopping):  # nothing recorded: the next server finds the job as it is
            self._watch_job(job_id, on_exit)

    def _watch_job(self, job_id: str, on_exit: OnExit) -> None:
        placed = self._placement(job_id) or {}
        if len(placed.get("parts") or ()) > 1:
            self._wait_gang(job_id, placed, on_exit)
            return
        name, handle = self._handle(job_id)
        status, handle = self._wait_part(job_id, handle)
        folder = self.root / job_id
        if handle is None:
            with contextlib.suppress(Exception):
                self._lose(placed["node_id"])
            status = {"lost": f"node lost: {name} (its gpuport agent cannot be reached)", "ended_at": time.time()}
        else:
            with contextlib.suppress(Exception):
                self._copy_log(handle, job_id)
        if status is not None:
            atomic_write(folder / "exit.json", json.dumps(status).encode(), 0o600)
        on_exit()

    def _wait_gang(self, job_id: str, placed: dict[str, Any], on_exit: OnExit) -> None:
        """Wait for every part of a job over several nodes, pumping their logs into the job's log.
        The first part to fail stops the others (SIGTERM, then SIGKILL after the grace), and its status
        is the job's."""
        parts, per = placed["parts"], int(placed.get("per_node") or 1)
        handles = []
        for part in parts:
            with self._lock:
                handle = self._agents.get(part["node_id"])
            if handle is None:
                with contextlib.suppress(ValueError):
                    handle = self._ray.get_actor(f"gpuport-agent-{part['node_id']}", namespace=NAMESPACE)
            handles.append(handle)
        statuses: list[dict[str, Any] | None] = [None] * len(parts)
        done = [threading.Event() for _ in parts]
        first_failure: list[int] = []
        lock = threading.Lock()

        def wait(r: int) -> None:
            try:
                status, handle = self._wait_part(job_id, handles[r])
            except _Stopping:
                return
            if handle is None:
                with contextlib.suppress(Exception):
                    self._lose(parts[r]["node_id"])
                status = {"lost": f"node lost: {parts[r]['node']} (its gpuport agent cannot be reached)"}
                status["ended_at"] = time.time()
            status = status or {"exit_code": 127, "error": "its part recorded no exit status"}
            statuses[r] = status
            with lock:
                failed = status.get("lost") or status.get("exit_code") != 0
                if failed and not first_failure:
                    first_failure.append(r)
                    for other, handle in enumerate(handles):
                        if other != r and handle is not None and not done[other].is_set():
                            handle.cancel.remote(job_id)
            done[r].set()

        for r in range(len(parts)):
            threading.Thread(target=wait, args=(r,), name=f"job {job_id} part {r}", daemon=True).start()
        pump = _LogPump(self._ray, self.root / job_id, handles, per)
        while not all(event.is_set() for event in done):
            if self._stopped.is_set():
                raise _Stopping()
            pump.round()
            time.sleep(0.25)
        pump.round(final=True)
        if first_failure:
            r = first_failure[0]
            status = dict(statuses[r] or {})
            if not status.get("lost"):
                status["failed_rank"] = r * per + int(status.get("failed_rank") or 0)
        else:
            status = {"exit_code": 0, "ended_at": max(float(s.get("ended_at") or 0) for s in statuses if s)}
        started = [float(s["started_at"]) for s in statuses if s and s.get("started_at")]
        if started:
            status["started_at"] = min(started)
        atomic_write(self.root / job_id / "exit.json", json.dumps(status).encode(), 0o600)
        on_exit()

    def _wait_part(self, job_id: str, handle: Any) -> tuple[dict[str, Any] | None, Any]:
        """The status of the job's part on ``handle``'s node once it has ended; (None, None) when that
        node is lost."""
        ray = self._ray
        status = None
        unreachable_since = None
        ref = None
        while handle is not None:
            try:
                ref = ref or handle.wait.remote(job_id)
                status = ray.get(ref, timeout=0.5 if unreachable_since else _LOST_AFTER)
                break
            except TimeoutError:  # still running, or its node went without Ray telling this call yet
                if self._stopped.is_set():
                    raise _Stopping() from None
                asked = time.monotonic()
                try:
                    ray.get(handle.ping.remote(), timeout=_LOST_AFTER)
                    unreachable_since = None
                except Exception:  # two pings unanswered in a row: the node is gone (a load delays one)
                    unreachable_since = unreachable_since or asked
                    if time.monotonic() - unreachable_since >= 2 * _LOST_AFTER:
                        handle = None
                continue
            except Exception as e:  # the agent is unreachable: for a moment, or its node is gone
                ref = None
                if self._stopped.is_set():  # this server is stopping: the next one watches the job
                    raise _Stopping() from None
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= _LOST_AFTER or "ActorDiedError" in type(e).__name__:
                    handle = None
                    break
                time.sleep(0.5)
                with contextlib.suppress(Exception):
                    ray.get(handle.ping.remote(), timeout=2)
                    unreachable_since = None
        # An answer can still come from an agent whose node is going: the job then ended because
        # the agent did. The reason pre-written for that says so for certain (the supervisor reads it
        # only when the agent's end kills it): its node is lost, whether or not the agent still
        # answers a ping while it goes. No status, or a job killed by a signal nobody here sent, is
        # a lost node when the agent then goes too (its answer raced its node's end: a retried job
        # must be queued again, not failed).
        if handle is not None and status is not None and str(status.get("killed") or "").startswith("node lost:"):
            return None, None
        ended_with_agent = status is None or (
            int(status.get("exit_code") or 0) < 0 and not status.get("cancelled") and not status.get("killed")
        )
        if handle is not None and ended_with_agent and not self._answers(handle):
            return None, None
        return status, handle

    def _answers(self, handle: Any) -> bool:
        """Whether an agent answers a ping within ``_LOST_AFTER`` seconds."""
        deadline = time.monotonic() + _LOST_AFTER
        while time.monotonic() < deadline:
            try:
                self._ray.get(handle.ping.remote(), timeout=2)
                return True
            except Exception:
                time.sleep(0.5)
        return False

    def _copy_log(self, handle: Any, job_id: str) -> None:
        """Bring an ended job's log into the server's state dir."""
        ray = self._ray
        temp = self.root / job_id / "log.part"
        with open(temp, "wb") as f:
            while True:
                data = ray.get(handle.read_log.remote(job_id, f.tell(), _READ_BYTES), timeout=_CALL_TIMEOUT)
                if not data:  # the end, or a part cut from a log past its limit: left a hole here too
                    start = ray.get(handle.log_data_offset.remote(job_id, f.tell()), timeout=_CALL_TIMEOUT)
                    if start <= f.tell():
                        break
                    f.seek(start)
                    continue
                f.write(data)
        os.replace(temp, self.root / job_id / "log")

    def is_running(self, job_id: str) -> bool:
        """Whether the job runs (or is being launched) on its nodes. A node that does not answer in
        time counts as running it: watching the job then tells whether it ends or its node is lost,
        where a False would fail a job that still runs."""
        placed = self._placement(job_id) or {}
        if len(placed.get("parts") or ()) > 1:
            handles = self._handles(job_id)
        else:
            handles = [h for h in [self._handle(job_id)[1]] if h is not None]
        if not handles:
            return False
        try:
            return any(self._ray.get([h.is_running.remote(job_id) for h in handles], timeout=_QUICK_TIMEOUT))
        except Exception as e:
            log.warning("job %s: its node did not say whether it runs (%s): watching it", job_id, e)
            return True

    def was_started(self, job_id: str) -> bool:
        """Whether the job was launched on its node: a server stopped after placing it but before
        its node had it launches it again. A node gone or not answering counts as started (the job
        then ends as its node lost)."""
        placed = self._placement(job_id)
        if placed is None:
            return False
        if len(placed.get("parts") or ()) > 1:
            return True  # a part may have started: its end is the watcher's to record
        _, handle = self._handle(job_id)
        if handle is None:
            return True
        try:
            return bool(self._ray.get(handle.was_started.remote(job_id), timeout=_CALL_TIMEOUT))
        except Exception:
            return True

    def cancel(self, job_id: str) -> None:
        for handle in self._handles(job_id):  # not waited for: a node that stopped answering must not hold anyone
            handle.cancel.remote(job_id)

    def kill(self, job_id: str, reason: str) -> None:
        for handle in self._handles(job_id):
            handle.kill.remote(job_id, reason)

    def read_log(self, job_id: str, offset: int, limit: int) -> bytes:
        local = self.root / job_id / "log"
        if local.exists():
            with open(local, "rb") as f:
                with contextlib.suppress(OSError):  # stop before a hole, as JobFolders.read_log does
                    limit = min(limit, os.lseek(f.fileno(), offset, os.SEEK_HOLE) - offset)
                f.seek(offset)
                return f.read(max(0, limit))
        return self._call(job_id, "read_log", job_id, offset, limit, default=b"")

    def log_data_offset(self, job_id: str, offset: int) -> int:
        local = self.root / job_id / "log"
        if local.exists():
            with open(local, "rb") as f, contextlib.suppress(OSError):  # ENXIO: at or past its end
                return max(offset, os.lseek(f.fileno(), offset, os.SEEK_DATA))
            return offset
        return int(self._call(job_id, "log_data_offset", job_id, offset, default=offset))

    def log_size(self, job_id: str) -> int:
        with contextlib.suppress(OSError):
            return (self.root / job_id / "log").stat().st_size
        if self._placement(job_id) is None:
            return 0
        return int(self._call(job_id, "log_size", job_id, default=0))

    def known_log_size(self, job_id: str) -> int:
        """The log's size here (an ended job's log, or one pumped from its nodes), else as its node
        last said: asked by ``_ask_sizes`` off the caller's thread, so a node that hangs holds no one."""
        with contextlib.suppress(OSError):
            return (self.root / job_id / "log").stat().st_size
        with self._lock:
            self._sizes_wanted[job_id] = time.monotonic()
            size = self._log_sizes.get(job_id)
            if self._sizer is None:
                self._sizer = threading.Thread(target=self._ask_sizes, name="ray log sizes", daemon=True)
                self._sizer.start()
        if size is None:
            self._sizes_asked.set()  # a job not sized yet: ask now rather than at the next round
        return size or 0

    def _ask_sizes(self) -> None:
        """Ask the nodes for the log sizes that listings want, every ``_SIZES_EVERY`` seconds (at once
        for a job not sized yet), all at once and each within ``_QUICK_TIMEOUT``."""
        while not self._stopped.is_set():
            self._sizes_asked.wait(_SIZES_EVERY)
            self._sizes_asked.clear()
            now = time.monotonic()
            with self._lock:
                for job_id in [j for j, when in self._sizes_wanted.items() if now - when > _SIZES_KEPT]:
                    del self._sizes_wanted[job_id]
                    self._log_sizes.pop(job_id, None)
                wanted = list(self._sizes_wanted)
            refs: dict[Any, str] = {}
            for job_id in wanted:
                _, handle = self._handle(job_id)
                if handle is not None:
                    refs[handle.log_size.remote(job_id)] = job_id
            if not refs:
                continue
            try:
                ready, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=_QUICK_TIMEOUT)
                sizes = dict(zip((refs[r] for r in ready), self._ray.get(ready))) if ready else {}
            except Exception as e:
                log.debug("asking the nodes for log sizes failed: %s", e)
                continue
            with self._lock:
                for job_id, size in sizes.items():
                    if job_id in self._sizes_wanted:
                        self._log_sizes[job_id] = int(size)

    def exit_status(self, job_id: str) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.root / job_id / "exit.json").read_text())
        name, handle = self._handle(job_id)
        if handle is None:
            return {"lost": f"node lost: {name or 'unknown'}", "ended_at": time.time()}
        try:
            return self._ray.get(handle.exit_status.remote(job_id), timeout=_CALL_TIMEOUT)
        except Exception as e:
            log.warning("job %s: its node did not give its exit status: %s", job_id, e)
            return None

    def collect_outputs(self, job_id: str, declared: list[str], ingest: Ingest) -> tuple[str, list[str]]:
        ray = self._ray
        name, handle = self._handle(job_id)
        if handle is None:
            return "", [f"(its node {name} was lost)"] if declared else []
        found, missing = ray.get(handle.outputs.remote(job_id, declared), timeout=_CALL_TIMEOUT)
        if not found and not declared:
            return "", missing

        def opened(base: str, path: str, mode: int) -> BinaryIO:
            def read(offset: int, size: int) -> bytes | None:
                return ray.get(handle.read_output.remote(job_id, base, path, offset, size), timeout=_CALL_TIMEOUT)

            return _RemoteFile(read, mode)  # type: ignore[return-value]

        return ingest((path, opened(base, below, mode)) for path, base, below, mode in found), missing

    def usage(self, job_ids: list[str]) -> dict[str, Usage]:
        by_node: dict[str, list[str]] = {}
        for job_id in job_ids:
            placed = self._placement(job_id) or {}
            for part in placed.get("parts") or ([placed] if placed else []):
                by_node.setdefault(part["node_id"], []).append(job_id)
        out: dict[str, Usage] = {}
        for node_id, ids in by_node.items():
            handle = self._agents.get(node_id)
            if handle is None:
                continue
            with contextlib.suppress(Exception):
                for job_id, used in self._ray.get(handle.usage.remote(ids), timeout=_CALL_TIMEOUT).items():
                    before = out.get(job_id)  # a job over several nodes: what all its parts use
                    if before is not None:
                        enforced = before.memory_enforced and used.memory_enforced
                        used = Usage(before.rss + used.rss, before.gpu_memory + used.gpu_memory, enforced)
                    out[job_id] = used
        return out

    def gpus(self, job_ids: list[str]) -> dict[str, list[GpuInfo]]:
        with self._lock:
            names = dict(self._ids)
        refs = {}
        for name, node_id in names.items():
            handle = self._agents.get(node_id)
            if handle is not None:
                refs[name] = handle.gpus.remote(job_ids)
        if not refs:
            return {}
        # All asked at once, and waited for together: a node that does not answer soon is left out.
        ready, _ = self._ray.wait(list(refs.values()), num_returns=len(refs), timeout=_QUICK_TIMEOUT)
        out = {}
        for name, ref in refs.items():
            if ref in ready:
                with contextlib.suppress(Exception):
                    out[name] = self._ray.get(ref)
        return out

    def tidy(self, job_id: str) -> None:
        everything = (self.root / job_id / "log").exists()  # the whole folder once its log is here
        for handle in self._handles(job_id):
            handle.tidy.remote(job_id, everything=everything)

    # ---- workers the server talks to ----------------------------------------------------------------

    def workers_problem(self) -> str:
        return ""

    def connect(self, job_id: str, name: str, direct: bool = False) -> Stream:
        """Through the link to the agent of the job's node (``node_link.py``): opened at the first
        connection to a worker there, and again when the agent no longer takes it (a new agent)."""
        if not ENDPOINT_NAME.fullmatch(name):
            raise InvalidRequest(f"{name[:40]!r} is not an endpoint's name")
        placed = self._placement(job_id)
        if placed is None:
            raise FileNotFoundError(f"job {job_id} has no node yet")
        node, handle = self._handle(job_id)
        if handle is None:
            raise ConnectionError(f"node {node} of job {job_id} has left the cluster")
        link = self._link(placed["node_id"], handle, fresh=False)
        try:
            return dial(link["address"], link["port"], link["fingerprint"], link["secret"], job_id, name, direct)
        except LinkError:  # a new agent there, or one that took another server's secret since: open it again
            link = self._link(placed["node_id"], handle, fresh=True)
            return dial(link["address"], link["port"], link["fingerprint"], link["secret"], job_id, name, direct)

    def _link(self, node_id: str, handle: Any, fresh: bool) -> dict[str, Any]:
        """Where the node's link listens, its pinned fingerprint and this server's secret for it."""
        with self._lock:
            link = self._links.get(node_id)
            address = self._described.get(node_id, {}).get("address", "")
        if link is not None and not fresh:
            return link
        secret = secrets.token_hex(32)
        try:
            opened = self._ray.get(handle.open_link.remote(secret), timeout=_CALL_TIMEOUT)
        except Exception as e:
            raise LinkError(f"the gpuport agent of node {node_id[:8]} did not open its link: {e}") from None
        link = {**opened, "address": address, "secret": secret}
        with self._lock:
            self._links[node_id] = link
        return link

    def read_file(self, job_id: str, name: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        if not ENDPOINT_NAME.fullmatch(name):
            raise InvalidRequest(f"{name[:40]!r} is not a worker's file")
        return bytes(self._call(job_id, "read_file", job_id, name, offset, limit, default=b""))

    def file_size(self, job_id: str, name: str) -> int:
        if not ENDPOINT_NAME.fullmatch(name):
            raise InvalidRequest(f"{name[:40]!r} is not a worker's file")
        return int(self._call(job_id, "file_size", job_id, name, default=0))

    def stats(self, node: str) -> dict[str, int]:
        """What the agent of ``node`` counted (bytes of blobs received)."""
        with self._lock:
            node_id = self._ids[node]
        return self._ray.get(self._agents[node_id].stats.remote(), timeout=_CALL_TIMEOUT)

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(Exception):
            self._ray.shutdown()
