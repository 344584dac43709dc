"""``Client``: one authenticated, encrypted connection to a gpuport server."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from gpuport.client._config import Settings, resolve_settings
from gpuport.client._jobs import ArrayInfo, Job, JobArray, JobInfo
from gpuport.client._models import ModelInfo
from gpuport.client._transport import Progress, Transport
from gpuport.client._types import GPU, NewToken, QuotaInfo, ServerStatus, Snapshot, TokenInfo, UsageReport
from gpuport.defaults import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUE_DELAY,
)
from gpuport.protocol import gpuport_pb2 as pb
from gpuport.protocol.errors import InvalidRequest, ServerError
from gpuport.protocol.units import parse_duration, parse_size

if TYPE_CHECKING:
    from gpuport.client._sessions import RemoteFunction, Session, SessionInfo
    from gpuport.client._tensorflow import RemoteTensorFlow

_EMPTY = pb.Empty()  # requests are only read, never changed: one instance serves every call


class Client:
    """A connection to a gpuport server, made by ``gpuport.connect()``.

    ``user`` and ``admin`` say who the token belongs to. Use it as a context manager, or ``close()``
    it. Every method raises a ``GpuportError`` subclass on failure.
    """

    def __init__(self, settings: Settings, *, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        self.transport = Transport(settings, timeout=timeout)
        hello = self.transport.hello
        self.url = self.transport.url
        self.profile = settings.profile
        self.fingerprint = self.transport.fingerprint
        self.user: str = hello.user
        self.admin: bool = hello.admin
        self.server_version: str = hello.server_version
        self.server_python: str = hello.python_version
        self.hostname: str = hello.hostname
        self.server_cloudpickle: str = hello.cloudpickle_version

    def ping(self) -> float:
        """Make one authenticated no-op call; return its round trip in seconds."""
        start = time.perf_counter()
        self.transport.call(self.transport.control.Ping, _EMPTY)
        return time.perf_counter() - start

    def gpus(self) -> list[GPU]:
        """Every GPU of the server, read live (an empty list on a machine without GPUs)."""
        reply = self.transport.call(self.transport.control.ListGpus, _EMPTY)
        return [GPU._from_message(g) for g in reply.gpus]

    def environments(self, prune: bool = False) -> list[dict[str, Any]]:
        """The Python environments the server built for jobs: hash, size, python_version, created_at,
        last_used, jobs (how many ran in it), layered, packages. ``prune`` (admins) removes first
        those no running job uses. Raises ``PermissionDenied``."""
        reply = self.transport.call(self.transport.control.ListEnvironments, pb.EnvironmentsRequest(prune=prune))
        fields = ("hash", "size", "python_version", "created_at", "last_used", "jobs", "layered")
        return [
            {**{f: getattr(e, f) for f in fields}, "packages": list(e.packages), "removed": False}
            for e in reply.environments
        ] + [{"hash": h, "removed": True} for h in reply.removed]

    def status(self) -> ServerStatus:
        """The server's version, machine, GPUs, and who you are to it."""
        s = self.transport.call(self.transport.control.Status, _EMPTY)
        return ServerStatus(
            url=self.url,
            server_version=s.server_version,
            python_version=s.python_version,
            hostname=s.hostname,
            started_at=s.started_at,
            cpus=s.cpus,
            memory_total=s.memory_total,
            memory_available=s.memory_available,
            inventory=s.gpus.inventory,
            note=s.gpus.note,
            gpus=tuple(GPU._from_message(g) for g in s.gpus.gpus),
            user=s.user,
            admin=s.admin,
        )

    def dashboard_url(self) -> str:
        """A link that logs a browser in to the server's web dashboard as you, once, within a minute
        (``gpuport dashboard`` opens it). Its code is in the URL's fragment, which the browser never
        sends: the page posts it, and the server swaps it for its usual login cookie.

        Raises ``InvalidRequest`` through an ``ssh://`` URL, whose tunnel does not carry the dashboard's port.
        """
        reply = self.transport.call(self.transport.control.CreateDashboardLink, _EMPTY)
        target = self.transport.target
        if target.via:
            raise InvalidRequest(
                f"{target.url} is reached through SSH, which forwards the gRPC port only: forward the "
                f"dashboard's port too (ssh -N -L {reply.http_port}:127.0.0.1:{reply.http_port} HOST), open "
                f"https://127.0.0.1:{reply.http_port}/ and log in with your token"
            )
        host = f"[{target.host}]" if ":" in target.host else target.host
        return f"{target.scheme}://{host}:{reply.http_port}/#code={reply.code}"

    def create_token(
        self, name: str, *, admin: bool = False, client_cert: bool = False, scrape: bool = False
    ) -> NewToken:
        """Create a token for user ``name`` (admin only). Its secret is in the result, shown once.

        With ``client_cert``, also a client certificate signed by the server's CA that stands for the
        token, for clients that speak TLS but send no header (Triton's examples): its key is in the
        result, shown once too. Revoking the token revokes it. A ``scrape`` token reads the server's
        Prometheus metrics (``GET /metrics``) and nothing else.

        Raises ``PermissionDenied`` for a non-admin, ``InvalidRequest`` for a bad name, ``Conflict``
        when the name is taken.
        """
        request = pb.CreateTokenRequest(name=name, admin=admin, client_cert=client_cert, scrape=scrape)
        reply = self.transport.call(self.transport.tokens.Create, request)
        return NewToken(
            reply.info.name,
            reply.info.admin,
            reply.token,
            reply.cert_pem,
            reply.key_pem,
            reply.server_cert_pem,
            reply.cert_port,
        )

    def tokens(self, *, include_revoked: bool = False) -> list[TokenInfo]:
        """Every token (admin only); revoked ones too with ``include_revoked``."""
        reply = self.transport.call(self.transport.tokens.List, pb.ListTokensRequest(include_revoked=include_revoked))
        return [TokenInfo._from_message(t) for t in reply.tokens]

    def revoke_token(self, name: str, *, end_work: bool = False) -> TokenInfo:
        """Revoke the token named ``name`` (admin only): it stops working at once, and the connections
        it holds open (session channels, log streams) close. Its jobs and sessions go on, unless
        ``end_work``: then its queued and running jobs are cancelled and its sessions closed.

        Raises ``NotFound`` when no valid token has that name, ``Conflict`` for the last admin token.
        """
        request = pb.RevokeTokenRequest(name=name, end_work=end_work)
        return TokenInfo._from_message(self.transport.call(self.transport.tokens.Revoke, request))

    # ---- sync ---------------------------------------------------------------------------------------

    def push(self, folder: str | os.PathLike[str], name: str, *, progress: Progress | None = None) -> Snapshot:
        """Upload ``folder`` as a snapshot named ``name`` (a project or dataset for later jobs).

        Only files the server lacks are sent. Pushing again under the same name moves the name to
        the new snapshot. Raises ``InvalidRequest`` for a bad name or a symlink leaving the folder.
        """
        if not name:
            raise InvalidRequest("a pushed snapshot needs a name")
        return self.transport.sync(Path(folder), name, progress)

    def snapshots(self) -> list[Snapshot]:
        """Your named snapshots (made with ``push``)."""
        reply = self.transport.call(self.transport.snapshots.List, _EMPTY)
        return [Snapshot(s.snapshot_id, s.name, s.files, s.bytes) for s in reply.snapshots]

    def remove_snapshot(self, name_or_id: str) -> Snapshot:
        """Remove your snapshot named ``name_or_id`` (the snapshot itself goes too, unless another
        name or queued or running work uses it), or the snapshot with that id (a job's outputs: its
        ``output_snapshot_id``) and its names. Its files stop counting against your storage once
        nothing else of yours has them. Raises ``NotFound``, ``InvalidRequest`` (one in use)."""
        by_id = len(name_or_id) == 64 and all(c in "0123456789abcdef" for c in name_or_id)
        ref = pb.SnapshotRef(snapshot_id=name_or_id) if by_id else pb.SnapshotRef(name=name_or_id)
        s = self.transport.call(self.transport.snapshots.Delete, ref)
        return Snapshot(s.snapshot_id, s.name, s.files, s.bytes)

    # ---- jobs ---------------------------------------------------------------------------------------

    @overload
    def submit(
        self,
        cmd: str | Sequence[str],
        workdir: str | os.PathLike[str] | None = ".",
        gpus: int = 0,
        env: dict[str, str] | None = None,
        outputs: Sequence[str] | None = None,
        name: str | None = None,
        *,
        array: None = None,
        sweep: None = None,
        **options: Any,
    ) -> Job: ...

    @overload
    def submit(
        self,
        cmd: str | Sequence[str],
        workdir: str | os.PathLike[str] | None = ".",
        gpus: int = 0,
        env: dict[str, str] | None = None,
        outputs: Sequence[str] | None = None,
        name: str | None = None,
        *,
        array: str | None = None,
        sweep: Mapping[str, Sequence[Any]] | None = None,
        **options: Any,
    ) -> JobArray: ...

    def submit(
        self,
        cmd: str | Sequence[str],
        workdir: str | os.PathLike[str] | None = ".",
        gpus: int = 0,
        env: dict[str, str] | None = None,
        outputs: Sequence[str] | None = None,
        name: str | None = None,
        *,
        project: str | None = None,
        datasets: Sequence[str] = (),
        time_limit: float | str | None = None,
        gpu_memory: int | str | None = None,
        cpus: float = 0,
        memory: int | str | None = None,
        priority: int = 0,
        nprocs: int = 1,
        tf_roles: dict[str, int] | None = None,
        retries: int = 0,
        retry_on_exit: Sequence[int] = (),
        preemptible: bool | None = None,
        checkpoint: str | None = None,
        nodes: int = 1,
        nprocs_per_node: int = 1,
        after: str | Sequence[str] = (),
        array: str | None = None,
        sweep: Mapping[str, Sequence[Any]] | None = None,
        requirements: str | None = None,
        groups: Sequence[str] = (),
        python: str | None = None,
        isolated_env: bool = False,
        env_of: str | None = None,
        partition: str | None = None,
        progress: Progress | None = None,
    ) -> Job | JobArray:
        """Sync ``workdir`` and run ``cmd`` in it on the server; return the ``Job`` at once.

        ``cmd`` is an argv list, or a string run by ``/bin/sh -c``. ``outputs`` are paths in the
        workdir brought back after the job (everything written to ``$GPUPORT_OUTPUT_DIR`` is too).
        ``project`` runs in a snapshot pushed under that name instead of syncing ``workdir``;
        ``datasets`` are pushed snapshots mounted read-only under ``$GPUPORT_DATASETS_DIR/<name>``.
        ``time_limit`` (seconds, or "90s", "2h") stops the job when it runs longer; it ends as ``timeout``.

        Resources: ``gpus`` whole GPUs, or ``gpu_memory`` ("8GiB") a slice of one GPU, enforced (each
        framework is capped at it; a job that uses more anyway is killed); ``cpus`` and ``memory``
        ("16GiB", enforced too) reserved for it; ``priority`` -100 .. 100 (above 0: admins only).
        ``nprocs`` starts that many processes with TF_CONFIG and RANK/WORLD_SIZE/MASTER_ADDR/
        MASTER_PORT set (the GPUs spread over them); ``tf_roles`` ({"chief": 1, "worker": 2}) names
        their TF_CONFIG roles instead of all workers. ``retries``: the times the job is queued again
        (after a backoff that doubles) instead of failing for a reason outside its code: its node of a
        cluster lost, or a server restart that lost it; and when it exits with a code of
        ``retry_on_exit``. ``preemptible`` (default: when ``priority`` is below 0): the server may
        preempt it for a job that waited longer than its ``--preempt-after``: the job gets SIGTERM
        (``gpuport.preempted()`` is then True in it, ``gpuport.on_preempt`` callbacks run), its grace
        period to save, and is queued again; ``checkpoint``, a folder of the workdir, is kept and put
        back into the next run's workdir (as for a retry). ``nodes`` (a
        cluster's) runs ``nprocs_per_node`` processes on each of that many nodes, as one job: ``gpus``,
        ``cpus`` and ``memory`` are then per node, and the ranks find each other through TF_CONFIG and
        MASTER_ADDR/MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK.

        ``after`` ("JOB", "JOB:ok", "JOB:any", or several): the job waits until those jobs (ids,
        names or arrays of yours) have succeeded (ok, the default) or ended (any); under ok, one
        that fails cancels it, saying why.

        ``array`` (Slurm's syntax: "0-99", "1,3,5", "0-15:4", "%8" at the end for at most 8
        running at once) or ``sweep`` ({"lr": [1e-3, 1e-4], "batch": [32, 64]}: every combination)
        submit a ``JobArray`` instead, one task per index or point, with the workdir synced once.
        Each task gets GPUPORT_ARRAY_INDEX and SLURM_ARRAY_TASK_ID (and GPUPORT_ARRAY_ID,
        SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_COUNT); a sweep's task its point appended to ``cmd`` as
        ``--lr 0.001 --batch 32`` and in GPUPORT_SWEEP_LR, GPUPORT_SWEEP_BATCH. With a sweep,
        ``array`` may be "%N" alone.

        ``requirements`` gives the job a Python environment, built on the server with uv once for
        everyone who asks for the same and reused after: "auto" (the workdir's ``uv.lock``,
        ``pyproject.toml`` or ``requirements.txt``, whichever it has first), a file of the workdir,
        or requirements as text ("six\\ntomli-w==1.2.0"); None: the server's own environment. Its
        packages come first, the server's after them; ``isolated_env`` leaves the server's out.
        ``groups``: pyproject.toml's dependency groups to include; ``python``: a version the server
        has ("3.12"), in an environment of its own. A build that fails ends the job ``failed``,
        with uv's words in its log. ``env_of`` (a job's id or name, or a hash ``environments()``
        lists) runs the job in that job's environment as it was built, without resolving again.

        ``partition``: the Slurm partition of a server in front of Slurm (``gpuport server --slurm``).

        Raises ``InvalidRequest`` (bad path, symlink leaving the workdir, bad env name, malformed
        array ...), ``ResourceUnavailable`` (more than the server has, or than your quota allows:
        an array over your queued cap is refused whole), ``NotFound`` (unknown project, or job to
        wait for), ``PermissionDenied`` (a priority above 0 without an admin token).
        """
        spec = pb.JobSpec(
            gpus=gpus,
            env=env or {},
            outputs=list(outputs or ()),
            name=name or "",
            datasets=list(datasets),
            time_limit=0.0 if time_limit is None else parse_duration(time_limit),
            gpu_memory=0 if gpu_memory is None else parse_size(gpu_memory),
            cpus=cpus,
            memory=0 if memory is None else parse_size(memory),
            priority=priority,
            nprocs=nprocs,
            tf_roles=tf_roles or {},
            retries=retries,
            retry_on_exit=list(retry_on_exit),
            checkpoint=checkpoint or "",
            nodes=nodes,
            nprocs_per_node=nprocs_per_node,
            after=[after] if isinstance(after, str) else list(after),
            requirements=requirements or "",
            env_groups=list(groups),
            python=python or "",
            isolated_env=isolated_env,
        )
        if preemptible is not None:
            spec.preemptible = preemptible
        if partition:
            spec.partition = partition
        if (groups or python or isolated_env) and not requirements:
            spec.requirements = "auto"
        if env_of:
            if spec.requirements:
                raise InvalidRequest("env_of runs the job in an environment built already: give no requirements too")
            spec.environment = self._environment_of(env_of)
        if isinstance(cmd, str):
            spec.shell = cmd
        else:
            spec.command.extend(cmd)
        if project:
            spec.project = project
        elif workdir is not None:
            spec.snapshot_id = self.transport.sync(Path(workdir), "", progress).id
        if array is not None or sweep:
            parameters = [
                pb.SweepParameter(name=key, values=[v if isinstance(v, str) else json.dumps(v) for v in values])
                for key, values in (sweep or {}).items()
            ]
            request = pb.ArraySpec(job=spec, array=array or "", sweep=parameters)
            reply = self.transport.call(self.transport.jobs.SubmitArray, request)
            return JobArray(self.transport, ArrayInfo._from_message(reply))
        return Job(self.transport, JobInfo._from_message(self.transport.call(self.transport.jobs.Submit, spec)))

    def submit_batch(
        self,
        path: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        partition: str | None = None,
        outputs: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        progress: Progress | None = None,
    ) -> Job:
        """Sync the folder of the batch script ``path`` and submit it to the Slurm cluster behind
        the server (``gpuport server --slurm``) with ``args``, its own ``#SBATCH`` lines honoured (job
        name, gres, time, ...); the files its ``--output``/``--error`` name come back as outputs.
        Raises ``InvalidRequest`` (the server is not in front of Slurm, or Slurm refused the job, in
        its words), ``NotFound``.

        >>> gpu.submit_batch("train.sh", ["--epochs", "5"]).wait()
        """
        script = Path(path)
        if not script.is_file():
            raise InvalidRequest(f"batch script {str(path)!r} is not a file")
        spec = pb.JobSpec(
            command=[script.name, *args],
            batch_script=script.name,
            outputs=list(outputs or ()),
            env=env or {},
            partition=partition or "",
        )
        spec.snapshot_id = self.transport.sync(script.parent, "", progress).id
        return Job(self.transport, JobInfo._from_message(self.transport.call(self.transport.jobs.Submit, spec)))

    def _environment_of(self, job_or_hash: str) -> str:
        """The hash of the environment a job ran in (or the hash given)."""
        if re.fullmatch(r"[0-9a-f]{16}", job_or_hash):
            return job_or_hash
        job = self.job(job_or_hash)
        if not job.info.environment:
            raise InvalidRequest(
                f"job {job.id} ran in the server's own environment, or has not started yet: there is no environment "
                "of its to run in"
            )
        return job.info.environment

    def array(self, array_id: str) -> JobArray:
        """The job array or sweep with this id, or yours of this name (the one with tasks queued
        or running, else the newest). Raises ``NotFound``.

        >>> gpu.array("sweep1").counts()
        {'running': 8, 'queued': 90, 'succeeded': 2}
        """
        reply = self.transport.call(self.transport.jobs.GetArray, pb.JobRef(job_id=array_id))
        return JobArray(self.transport, ArrayInfo._from_message(reply))

    def job(self, job_id: str) -> Job:
        """The job with this id (yours, or anyone's for an admin), or your job of this name: the one
        queued or running, else the newest. Raises ``NotFound``.

        >>> gpu.job("train").logs(follow=True)
        """
        return Job(
            self.transport,
            JobInfo._from_message(self.transport.call(self.transport.jobs.Get, pb.JobRef(job_id=job_id))),
        )

    def jobs(
        self,
        *,
        all: bool = False,
        name: str | None = None,
        state: str | Sequence[str] | None = None,
        user: str | None = None,
    ) -> list[Job]:
        """Your queued and running jobs and those of the last day, newest first; with ``all``, every
        one (every user's, for an admin): every queued and running job, and the 500 newest ended.

        Only those named ``name``, in ``state`` (one, or several: queued, running, succeeded,
        failed, cancelled, timeout, killed, lost) or of ``user`` (another's: admins only), where
        given. Raises ``InvalidRequest`` (an unknown state) or ``PermissionDenied``.
        """
        states = [state] if isinstance(state, str) else list(state or ())
        request = pb.ListJobsRequest(all=all, name=name or "", states=states, user=user or "")
        reply = self.transport.call(self.transport.jobs.List, request)
        return [Job(self.transport, JobInfo._from_message(j)) for j in reply.jobs]

    def queue(self) -> list[JobInfo]:
        """Every user's queued jobs in the order they will start, each with its ``position`` and the
        reason it waits (``message``). Other users' jobs come without their command and name."""
        return [JobInfo._from_message(j) for j in self.transport.call(self.transport.jobs.Queue, _EMPTY).jobs]

    # ---- quotas -------------------------------------------------------------------------------------

    def set_quota(
        self,
        user: str,
        *,
        gpus: float | None = None,
        jobs: int | None = None,
        queued: int | None = None,
        processes: int | None = None,
        storage: int | str | None = None,
        shares: float | None = None,
    ) -> QuotaInfo:
        """Limit what ``user`` (``"*"``: everyone without a quota of their own) holds at once: GPUs
        (slices count as their part) and running jobs; None leaves that limit off. ``queued``: the
        most jobs queued at once (None: the default's, 1,000 unless ``"*"`` says). ``processes``:
        the processes and threads each of their jobs may run at once (None: the server's default,
        4096), enforced by the kernel where the server has cgroups. ``storage``: the bytes (or a
        size such as ``"50GiB"``) of snapshots, datasets, outputs and logs they may keep (None: the
        default's: ``"*"``'s, else a quarter of the server's disk). ``shares``: their weight in the
        fair share over weeks (None: the default's, ``"*"``'s else 1). Admin only.

        Jobs over the quota wait, saying so; a submit past the queued cap is refused
        (``ResourceUnavailable``). Raises ``PermissionDenied``, ``InvalidRequest``.
        """
        size = None if storage is None else parse_size(storage)
        request = pb.QuotaInfo(
            user=user, gpus=gpus, jobs=jobs, queued=queued, processes=processes, storage=size, shares=shares
        )
        return QuotaInfo._from_message(self.transport.call(self.transport.quotas.Set, request))

    def quotas(self) -> list[QuotaInfo]:
        """Every quota (admins), or your own and the default one."""
        return [QuotaInfo._from_message(q) for q in self.transport.call(self.transport.quotas.List, _EMPTY).quotas]

    def unset_quota(self, user: str) -> None:
        """Remove ``user``'s quota (admin only). Raises ``NotFound`` when there is none."""
        self.transport.call(self.transport.quotas.Unset, pb.QuotaRef(user=user))

    # ---- usage --------------------------------------------------------------------------------------

    def usage(self, *, since: float | str | None = None, user: str | None = None, by: str = "user") -> UsageReport:
        """What your work held (an admin: everyone's, or ``user``'s) since ``since`` (a duration back
        from now such as ``"7d"`` or ``3600``, in seconds; None: everything recorded), by ``"user"`` or
        ``"day"``, and each user's place in the fair share now. Raises ``PermissionDenied`` for
        another user's usage, ``InvalidRequest`` for an unknown ``by``.

            >>> gpu.usage(since="7d").entries[0].gpu_seconds
        """
        start = 0.0
        if since is not None:
            start = time.time() - (parse_duration(since) if isinstance(since, str) else float(since))
        request = pb.UsageQuery(since=start, user=user or "", by=by)
        return UsageReport._from_message(self.transport.call(self.transport.usage.Report, request))

    # ---- sessions and functions --------------------------------------------------------------------

    def session(
        self,
        *,
        name: str | None = None,
        gpus: int = 0,
        gpu_memory: int | str | None = None,
        cpus: float = 0.0,
        memory: int | str | None = None,
        priority: int = 0,
        idle_timeout: float | str | None = None,
        env: dict[str, str] | None = None,
        requirements: str | os.PathLike[str] | Sequence[str] | None = None,
        wait: bool = True,
        progress: bool | None = None,
    ) -> Session:
        """Open a session: a worker process on the server holding this allocation, which runs your
        functions and keeps your values (``put``, ``call``, ``get``) between calls.

        With ``name``, your live session of that name is re-attached (its values intact) or, if there
        is none, opened under it; a named session outlives this client. Without a name it ends when
        closed (``with`` does it), or when its client has been gone a minute. Any session ends after
        ``idle_timeout`` (default 30 minutes) without a call. With ``wait`` (the default), returns once
        the worker runs, saying on stderr why it waits while it is queued. ``progress`` shows a bar for
        large transfers (None: on a terminal, from 64 MiB). ``requirements`` (a local requirements
        file, its text, or a list of requirements) runs the worker in that Python environment, built
        on the server as a job's is (``submit``), over the server's own packages.

        Raises ``IncompatibleVersions`` when this Python cannot exchange pickles with the server's.
        """
        from gpuport.client._sessions import open_session  # here: cloudpickle loads for sessions only

        return open_session(
            self.transport,
            name=name,
            gpus=gpus,
            gpu_memory=gpu_memory,
            cpus=cpus,
            memory=memory,
            priority=priority,
            idle_timeout=idle_timeout,
            env=env,
            requirements=requirements_text(requirements),
            wait=wait,
            progress=progress,
        )

    def sessions(self) -> list[SessionInfo]:
        """Your live sessions (every user's, for an admin)."""
        from gpuport.client._sessions import SessionInfo

        return [SessionInfo.from_message(m) for m in self.transport.call(self.transport.sessions.List, _EMPTY).sessions]

    def close_session(self, name_or_id: str) -> SessionInfo:
        """End a session by its name or id (``gpuport sessions close``)."""
        from gpuport.client._sessions import SessionInfo

        ref = pb.SessionRef(session_id=name_or_id) if name_or_id.startswith("s-") else pb.SessionRef(name=name_or_id)
        return SessionInfo.from_message(self.transport.call(self.transport.sessions.Close, ref))

    # ---- serving ----------------------------------------------------------------------------------

    def deploy(
        self,
        name: str,
        source: str | os.PathLike[str],
        *,
        version: int | None = None,
        format: str | None = None,
        gpus: int = 0,
        gpu_memory: int | str | None = None,
        cpus: float = 0.0,
        memory: int | str | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_queue_delay: float | str = DEFAULT_MAX_QUEUE_DELAY,
        replicas: int = 1,
        public: bool = False,
        label: str | None = None,
        requirements: str | os.PathLike[str] | Sequence[str] | None = None,
        wait: bool = True,
        timeout: float = 600.0,
    ) -> ModelInfo:
        """Serve a model over KServe v2 and TensorFlow Serving's APIs, as ``name``.

        ``source``: a local file or folder (uploaded), ``job.output("model/")`` / ``"job:<id>:model/"``
        (a job's output), or a pushed snapshot's name (``"NAME"`` or ``"NAME:path/in/it"``). Formats:
        a SavedModel folder, a ``.keras`` file, TorchScript, ONNX, or a pickled Python class with
        ``predict``. With ``wait`` (the default) returns once the model is ready, and raises
        ``ServerError`` with the loader's message when it failed to load. A ``public`` model's
        predictions and metadata need no credentials (over TLS still); deploying and undeploying do.
        ``label`` (e.g. ``"stable"``) names the new version for TensorFlow Serving's clients
        (``/v1/models/NAME/labels/stable:predict``, ``model_spec.version_label``); see ``label``.
        ``requirements`` (a local requirements file, its text, or a list): the replicas' Python
        environment, built on the server as a job's is (``submit``).
        """
        local = Path(os.fspath(source)).expanduser()
        text = os.fspath(source)
        if local.exists():
            text = self._upload_model(local)
        elif text.startswith((".", "/", "~")) or os.sep in text.split(":")[0]:
            raise InvalidRequest(f"{text}: no such file or folder here")
        request = pb.DeployRequest(
            name=name,
            source=text,
            version=version or 0,
            format=format or "",
            gpus=gpus,
            gpu_memory=0 if gpu_memory is None else parse_size(gpu_memory),
            cpus=cpus,
            memory=0 if memory is None else parse_size(memory),
            max_batch_size=max_batch_size,
            max_queue_delay=parse_duration(max_queue_delay),
            replicas=replicas,
            public=public,
            label=label or "",
            requirements=requirements_text(requirements),
        )
        info = ModelInfo.from_message(self.transport.call(self.transport.models.Deploy, request))
        if not wait:
            return info
        deadline = time.monotonic() + timeout
        while info.state == "loading":
            if time.monotonic() > deadline:
                raise ServerError(f"model {name} version {info.version} is still loading after {timeout:g}s")
            time.sleep(0.1)
            info = self.model(name, info.version)
        if info.state == "failed":
            raise ServerError(f"model {name} version {info.version} failed: {info.message}")
        return info

    def _upload_model(self, path: Path) -> str:
        """Upload a local model as an unnamed snapshot; its source for a deployment."""
        if path.is_dir():
            return f"snapshot:{self.transport.sync(path, '', None).id}"
        import shutil
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gpuport-model-") as tmp:
            os.link(path, Path(tmp) / path.name) if _same_device(path, tmp) else shutil.copy2(path, tmp)
            spec = path.parent / "gpuport-model.json"
            if spec.exists():
                shutil.copy2(spec, tmp)
            return f"snapshot:{self.transport.sync(Path(tmp), '', None).id}:{path.name}"

    def model(self, name: str, version: int | None = None) -> ModelInfo:
        """A deployed model (its newest ready version, unless ``version``)."""
        return ModelInfo.from_message(
            self.transport.call(self.transport.models.Get, pb.ModelRef(name=name, version=version or 0))
        )

    def models(self) -> list[ModelInfo]:
        """Every deployed model on the server, each version apart."""
        return [ModelInfo.from_message(m) for m in self.transport.call(self.transport.models.List, _EMPTY).models]

    def label(self, name: str, label: str, version: int) -> ModelInfo:
        """Point version label ``label`` of model ``name`` at ``version`` (its owner or an admin):
        TensorFlow Serving's clients that ask for the label reach that version from now on. Raises
        ``NotFound`` for a version not deployed, ``InvalidRequest`` for a bad label."""
        request = pb.LabelRequest(name=name, label=label, version=version)
        return ModelInfo.from_message(self.transport.call(self.transport.models.Label, request))

    def undeploy(self, name: str, version: int | None = None) -> list[ModelInfo]:
        """Stop serving ``name`` (every version, or just ``version``); returns what was undeployed."""
        reply = self.transport.call(self.transport.models.Undeploy, pb.ModelRef(name=name, version=version or 0))
        return [ModelInfo.from_message(m) for m in reply.models]

    def tensorflow(
        self,
        *,
        gpus: int = 0,
        gpu_memory: int | str | None = None,
        cpus: float = 0.0,
        memory: int | str | None = None,
        connect: bool = True,
    ) -> RemoteTensorFlow:
        """TensorFlow's own remote device on the GPU machine, over gpuport's TLS: an allocation
        queued like a session's (``gpus``, or a ``gpu_memory`` slice; none: the remote CPU), with a
        TensorFlow server in it that only this tunnel reaches. With ``connect`` (the default) this
        process's TensorFlow is connected to it (``tf.config.experimental_connect_to_host``), so that
        ``with tf.device(remote.device("GPU:0")):`` runs ops there. Use it as a context manager:
        the allocation is freed when the block ends (or a minute after this client is gone).

        >>> with gpu.tensorflow(gpus=1) as remote:
        ...     with tf.device(remote.device("GPU:0")):
        ...         y = tf.matmul(x, x)                     # runs on the GPU machine
        """
        from gpuport.client._tensorflow import open_remote

        return open_remote(self.transport, connect, gpus=gpus, gpu_memory=gpu_memory, cpus=cpus, memory=memory)

    def function(
        self,
        function: Callable[..., Any] | None = None,
        *,
        gpus: int = 0,
        gpu_memory: int | str | None = None,
        cpus: float = 0.0,
        memory: int | str | None = None,
        timeout: float | None = None,
        max_workers: int = 4,
        env: dict[str, str] | None = None,
        requirements: str | os.PathLike[str] | Sequence[str] | None = None,
    ) -> Any:
        """Make ``function`` run on the server: ``@gpu.function(gpu_memory="4GiB")`` above a ``def``.

        Each call runs in a worker process holding that allocation; ``f.spawn(...)`` returns a Future
        and ``f.map(xs)`` runs calls in up to ``max_workers`` workers at once. A call past ``timeout``
        seconds raises ``CallTimeout``. Functions of ``__main__``, a notebook or your project's modules
        travel by value; what they import must be installed on the server, or named in ``requirements``
        (a local requirements file, its text, or a list), the workers' environment (see ``session``).
        """
        options = {"gpus": gpus, "gpu_memory": gpu_memory, "cpus": cpus, "memory": memory, "env": env}
        options["requirements"] = requirements_text(requirements)

        from gpuport.client._sessions import RemoteFunction

        def wrap(f: Callable[..., Any]) -> RemoteFunction:
            return RemoteFunction(self.transport, f, options, timeout, max_workers)

        return wrap(function) if function is not None else wrap

    def close(self) -> None:
        """Close the connection, closing the unnamed sessions opened through it. The client cannot be
        used afterwards."""
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpuport.Client {self.url} user={self.user!r}>"


def connect(
    url: str | None = None,
    token: str | None = None,
    profile: str | None = None,
    *,
    fingerprint: str | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> Client:
    """Connect to a gpuport server and check the token.

    Settings come from the arguments, then ``GPUPORT_URL`` / ``GPUPORT_TOKEN`` /
    ``GPUPORT_FINGERPRINT`` / ``GPUPORT_PROFILE``, then the profile saved by ``gpuport login``.

    Raises ``ConfigError`` (nothing configured, bad URL), ``ServerUnreachable``, ``TLSError``,
    ``FingerprintMismatch`` or ``AuthenticationError``.

    >>> with gpuport.connect() as gpu:
    ...     print(gpu.gpus())
    """
    return Client(resolve_settings(url, token, profile, fingerprint), timeout=timeout)


def requirements_text(requirements: str | os.PathLike[str] | Sequence[str] | None) -> str:
    """Requirements as the server takes them for a session or a model: the text of a local file (a
    path, or a name that is one), the text given, or a list joined; "" for none."""
    if requirements is None:
        return ""
    if not isinstance(requirements, (str, os.PathLike)):
        return "".join(f"{line}\n" for line in requirements)
    text = os.fspath(requirements)
    path = Path(text).expanduser()
    if isinstance(requirements, os.PathLike) or ("\n" not in text and path.is_file()):
        try:
            return path.read_text()
        except OSError as e:
            raise InvalidRequest(f"requirements file {text}: {e.strerror or e}") from None
    return text if not text or text.endswith("\n") else text + "\n"


def _same_device(path: Path, folder: str) -> bool:
    try:
        return path.stat().st_dev == os.stat(folder).st_dev
    except OSError:
        return False
