"""Which queued jobs start now, on which GPUs, and why the others wait.

``plan`` is a pure function of the queue, the running allocations, the machine and the quotas; the
job service calls it after every submit and every end. Between passes a ``Scheduler`` keeps the
queue, the last plan and a count of what changed; the order is derived from what the store holds, so
it is the same after a server restart. A submit skips its pass where ``decided_alike`` shows the
pass would change nothing (and nothing changed since the last): the job lands behind a deep queue
that nothing can enter.

The rules, in this order:

1. **Priority first.** A higher ``priority`` always goes ahead of a lower one.
2. **A reservation.** The first job in queue order that cannot start for lack of resources
   *reserves* what is free for it: jobs behind it may not use those resources, so a large request is
   never starved by a stream of small ones (no backfill: we do not trust run times to be known). The
   reservation sticks (``reserved_at`` in the store): within its priority, a job that once held it
   stays ahead of everything the fair-share order would otherwise put first.
3. **Fair share** within a priority: users take turns, the one using least of the machine first.
   Use is the dominant share (as in DRF): for each running job, the largest of its fractions of the
   GPUs, CPUs and memory; a user's queued jobs count as they are placed in the order, so one user's
   50 queued jobs interleave with another user's single job instead of going ahead of it.
   Over weeks (``FairShare``, given by the server): a user's use also counts what they held before,
   decayed with a half-life (as Slurm's ``PriorityDecayHalfLife``), and is divided by their shares,
   so that someone who held the GPUs all week waits behind someone who did not; a user's turn
   improves the longer their next job has waited, up to a maximum age (the age factor, weighed
   against the machine's average use per share, so that it cannot swamp the fair share).
4. **Quotas** (per user, set by an admin): concurrent GPUs and concurrent jobs. A job over its
   owner's quota waits, saying so, and reserves nothing.
5. **Arrays and dependencies.** A task of a job array is an ordinary job of its owner (fair share
   and quotas count it so); an array's ``%N`` (``caps``) lets at most N of its tasks run at once,
   and a task over it waits, saying so, and reserves nothing. A job whose dependencies are not met
   (``Pending.blocked`` says which) waits the same way.
6. **Preemption** (``preempt``, apart from ``plan``): a job that has waited longer than the
   server's ``--preempt-after`` for what preemptible jobs hold has them stopped and queued again, when
   it has a higher priority than theirs or its owner is under their share of those jobs' owners.
   A job not marked preemptible is never chosen.
7. **A memory floor.** While the machine's free memory is below the server's floor (``low_memory``
   says so), a job that reserves no memory waits, and reserves nothing: work that asks for nothing
   cannot push the box into swap or the OOM killer. A job that reserves memory is counted as before.

Resources: whole GPUs (``gpus``), or a memory slice of one GPU (``gpu_memory``); CPUs and RAM are
counted when asked for (0: the job reserves none and shares what is left). A whole GPU is taken only
when nothing holds any of it; a slice goes to the GPU with the least free memory that fits it (so
that whole GPUs stay free for whole requests).

Scale: the server keeps its queue in a ``Queue`` (each user's jobs in order, per priority), so a pass
reads the order lazily instead of sorting every job, and it looks at most ``LOOK_AHEAD`` jobs deep
(as Slurm's ``default_queue_depth``) unless something further back could still start: a pass stops
once every kind of request left behind has been found not to fit, or, once the reservation is made,
does not fit what is left free (which only shrinks from then on). The decisions are those of a
pass over the whole queue; only the jobs it did not reach have no position or reason of their own.
And it goes past at most ``REACH`` jobs that wait for room (not those that wait for a dependency, a
quota or their array's cap): nothing further back that asks for a GPU starts out of turn (a job
that asks for none still starts where it fits: it takes no GPU the first ones wait for). The jobs
deepest in the order are those of the users furthest over their share, and a job of theirs that
happens to fit what the first ones leave free would take it for as long as it runs (run times are
not known); left free, it goes to the first ones as soon as they fit. A pass's cost is bounded so
too, however deep the queue (without it, a 1,000-user simulation's passes walked 500-2,600 jobs
deep by its second day).

Nodes: the machines of a ``Cluster`` (one, without a cluster engine). A job runs on one node and
all it asks for comes from that node: a 2-GPU job is never split over two. A job with GPUs goes to
the node that fits it most tightly (fewest whole GPUs, or least slice memory, left over), so that
large holes stay whole; a job without GPUs goes to the node with the most CPUs free, so that CPU
work spreads. Shares and quotas count the whole cluster.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from gpuport.defaults import DEFAULT_MAX_AGE, DEFAULT_PROCESSES_PER_JOB, DEFAULT_SHARES
from gpuport.protocol.units import format_size

# A job that asks for nothing still counts a little in its owner's fair share, so that the owner
# of many such jobs takes turns with others.
_MIN_SHARE = 1e-6
# How deep a server's pass looks into the queue while nothing further back can start.
LOOK_AHEAD = 100
# How many jobs that wait for room a server's pass goes past before nothing further back starts (as
# Slurm's backfill looks at most ``bf_max_job_test`` jobs deep, 500 by default).
REACH = 500


@dataclass(frozen=True)
class Request:
    """What a job (or a session, or a deployment) asks for."""

    gpus: int = 0  # whole GPUs
    gpu_memory: int = 0  # bytes: a slice of one GPU; 0: no slice
    cpus: float = 0.0  # 0: none reserved
    memory: int = 0  # bytes of RAM; 0: none reserved
    nodes: int = 1  # a gang over this many nodes, each with all of the above

    def __hash__(self) -> int:  # worked out once: a pass looks requests up in dicts for every job
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.gpus, self.gpu_memory, self.cpus, self.memory, self.nodes))
            object.__setattr__(self, "_hash", found)
        return found

    def describe(self) -> str:
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}")
        if self.gpu_memory:
            parts.append(f"a {format_size(self.gpu_memory)} slice of a GPU")
        if self.cpus:
            parts.append(f"{self.cpus:g} CPU{'s' if self.cpus != 1 else ''}")
        if self.memory:
            parts.append(f"{format_size(self.memory)} of memory")
        if self.nodes > 1:
            return f"{self.nodes} nodes, each with " + (", ".join(parts) or "nothing")
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True)
class Machine:
    """What there is to share: each GPU's memory (by index), CPUs and RAM."""

    gpu_memory: tuple[int, ...]
    cpus: float
    memory: int

    def describe_gpus(self) -> str:
        sizes = self.gpu_memory
        if not sizes:
            return "no GPU"
        if len(set(sizes)) == 1:
            return f"{len(sizes)} x {format_size(sizes[0])}"
        return ", ".join(format_size(s) for s in sizes)

    @cached_property
    def largest_gpu(self) -> int:
        return max(self.gpu_memory, default=0)

    def gpu_share(self, request: Request) -> float:
        """The request in GPUs: whole ones, plus a slice as its part of the largest GPU."""
        largest = self.largest_gpu
        return request.gpus + (request.gpu_memory / largest if largest and request.gpu_memory else 0.0)

    def dominant_share(self, request: Request) -> float:
        shares = [_MIN_SHARE]
        if self.gpu_memory:
            shares.append(self.gpu_share(request) / len(self.gpu_memory))
        if self.cpus:
            shares.append(request.cpus / self.cpus)
        if self.memory:
            shares.append(request.memory / self.memory)
        return max(shares)


@dataclass(frozen=True)
class Cluster:
    """Nodes by name, each a ``Machine``; shares are of the whole cluster."""

    nodes: tuple[tuple[str, Machine], ...]

    @classmethod
    def of(cls, what: Machine | Cluster) -> Cluster:
        return what if isinstance(what, Cluster) else cls((("", what),))

    @property
    def machines(self) -> dict[str, Machine]:
        return dict(self.nodes)

    @cached_property
    def total(self) -> Machine:
        machines = [m for _, m in self.nodes]
        return Machine(
            tuple(g for m in machines for g in m.gpu_memory),
            sum(m.cpus for m in machines),
            sum(m.memory for m in machines),
        )

    def describe_gpus(self) -> str:
        if len(self.nodes) == 1:
            return self.nodes[0][1].describe_gpus()
        return "; ".join(f"{name}: {m.describe_gpus()}" for name, m in self.nodes)

    def gpu_share(self, request: Request) -> float:
        return self.total.gpu_share(request) * request.nodes

    def dominant_share(self, request: Request) -> float:
        return self.total.dominant_share(request) * request.nodes

    def most(self) -> Machine:
        """The most any one node has of each resource: what a single-node request can ever get."""
        machines = [m for _, m in self.nodes] or [Machine((), 0.0, 0)]
        return Machine(
            max((m.gpu_memory for m in machines), key=len),
            max(m.cpus for m in machines),
            max(m.memory for m in machines),
        )


@dataclass(frozen=True)
class Quota:
    """Most a user may hold at once; None: no limit. ``processes``: each of their jobs' cap of
    processes and threads (the kernel enforces it, where the server has cgroups; never None)."""

    gpus: float | None = None
    jobs: int | None = None
    processes: int = DEFAULT_PROCESSES_PER_JOB


# A waiting job's reason names its owner's fair share once their decayed use is at least this part
# of the machine: below it, their past use orders nothing much, and the reason stays as it was.
_FAIR_NOTE_FROM = 0.005


@dataclass(frozen=True)
class FairShare:
    """What orders users over weeks, not just now: each one's decayed past use and shares, and the
    age factor. ``used`` is in parts of the whole machine (its dominant share, as a running job
    counts) averaged over the decay: a user who held all of it for ever counts 1, for one half-life
    0.5. A user's turn comes by ``(used + what they hold now) / shares - age_weight * unit *
    min(waited, max_age) / max_age``, least first, where ``waited`` is how long their next job has
    waited and ``unit`` the machine's average use per share (``per_share``: the users' summed
    ``used`` over their summed shares, what a user at exactly their share has used). So the age
    factor weighs the same against the fair share however many users share the machine: with
    ``age_weight`` 1, a user at twice their share whose job waited ``max_age`` goes level with a
    user at their share who just asked, and no wait counts more than ``max_age`` (as Slurm's
    ``PriorityMaxAge``). Nothing waits forever even so: a user who runs nothing sees their use decay
    until theirs is the least. ``now``: the clock, given, so that the plan stays pure."""

    used: Mapping[str, float] = field(default_factory=dict)
    shares: Mapping[str, float] = field(default_factory=dict)  # absent: DEFAULT_SHARES
    now: float = 0.0
    age_weight: float = 0.0
    max_age: float = DEFAULT_MAX_AGE
    per_share: float | None = None  # the average use per share where the caller keeps it; None: from ``used``

    def shares_of(self, user: str) -> float:
        return self.shares.get(user, self.shares.get("*", DEFAULT_SHARES))

    @cached_property
    def unit(self) -> float:
        """What a wait of ``max_age`` takes off a turn with ``age_weight`` 1: the average use per share."""
        if self.per_share is not None:
            return self.per_share
        users = [u for u, used in self.used.items() if used > 0]
        total = sum(self.shares_of(u) for u in users)
        return sum(self.used[u] for u in users) / total if total else 0.0

    @cached_property
    def _age_rate(self) -> float:  # what a second of waiting takes off a turn, up to max_age
        return self.age_weight * self.unit / self.max_age if self.age_weight and self.max_age > 0 else 0.0

    def turn(self, user: str, held: float, created_at: float) -> float:
        turn = (self.used.get(user, 0.0) + held) / self.shares_of(user)
        rate = self._age_rate
        if rate and created_at:
            turn -= rate * min(max(0.0, self.now - created_at), self.max_age)
        return turn

    def describe(self, user: str) -> str:
        shares = self.shares_of(user)
        used = self.used.get(user, 0.0)
        return (
            f"fair share: {user} has used {used:.3g} of the machine (decayed) on "
            f"{shares:g} share{'s' if shares != 1 else ''}, {used / shares:.3g} a share"
        )


@dataclass(frozen=True)
class Pending:
    job_id: str
    owner: str
    request: Request
    priority: int = 0
    seq: int = 0  # submission order
    reserved_at: float | None = None
    group: str = ""  # the job array it is a task of
    blocked: str = ""  # why it may not start yet whatever is free (a dependency not met); '' : it may
    created_at: float = 0.0  # when it was queued: its age, for the fair share's age factor


@dataclass(frozen=True)
class Holding:
    """A running allocation."""

    job_id: str
    owner: str
    request: Request
    gpu_indices: tuple[int, ...]
    node: str = ""
    placement: tuple[tuple[str, tuple[int, ...]], ...] = ()  # a gang's: (node, GPUs) per node rank
    group: str = ""  # the job array it is a task of
    priority: int = 0
    preemptible: bool = False  # it may be stopped (and queued again) for a job that waited too long


@dataclass(frozen=True)
class Decision:
    job_id: str
    position: int  # 1-based place in the queue's order
    gpu_indices: tuple[int, ...] | None  # None: it waits
    reason: str = ""  # why it waits
    reserves: bool = False  # it holds the reservation
    node: str = ""  # where it starts
    placement: tuple[tuple[str, tuple[int, ...]], ...] = ()  # a gang's: (node, GPUs) per node rank


class Queue:
    """The queued jobs by id, kept as the order reads them: per priority, each user's jobs in
    submission order, and the jobs that hold a reservation apart. Adding and removing a job costs a
    lookup in its user's list, so the server keeps one across passes instead of sorting the whole
    queue for each."""

    def __init__(self, pending: Iterable[Pending] = ()) -> None:
        self._jobs: dict[str, Pending] = {}
        self._users: dict[int, dict[str, list[tuple[int, str]]]] = {}  # priority → user → [(seq, id)]
        self._reserved: dict[int, dict[str, Pending]] = {}  # priority → id → job
        self._kinds: Counter[Request] = Counter()
        self._requests: dict[Request, Request] = {}  # one object per kind of request: lookups by identity
        for p in pending:
            self.add(p)

    def add(self, job: Pending) -> None:
        """Queue ``job``, or replace the job of its id (a reservation recorded, say)."""
        self.pop(job.job_id, None)
        request = self._requests.setdefault(job.request, job.request)
        if request is not job.request:
            job = dataclasses.replace(job, request=request)
        self._jobs[job.job_id] = job
        self._kinds[job.request] += 1
        if job.reserved_at is not None:
            self._reserved.setdefault(job.priority, {})[job.job_id] = job
            return
        jobs = self._users.setdefault(job.priority, {}).setdefault(job.owner, [])
        if not jobs or jobs[-1][0] < job.seq:
            jobs.append((job.seq, job.job_id))  # the usual case: the newest job
        else:
            bisect.insort(jobs, (job.seq, job.job_id))  # a job queued again keeps its place

    def pop(self, job_id: str, default: Pending | None = None) -> Pending | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return default
        self._kinds[job.request] -= 1
        if not self._kinds[job.request]:
            del self._kinds[job.request], self._requests[job.request]
        if job.reserved_at is not None:
            level = self._reserved[job.priority]
            del level[job_id]
            if not level:
                del self._reserved[job.priority]
            return job
        users = self._users[job.priority]
        jobs = users[job.owner]
        del jobs[bisect.bisect_left(jobs, (job.seq, job_id))]
        if not jobs:
            del users[job.owner]
            if not users:
                del self._users[job.priority]
        return job

    def __getitem__(self, job_id: str) -> Pending:
        return self._jobs[job_id]

    def get(self, job_id: str) -> Pending | None:
        return self._jobs.get(job_id)

    def __setitem__(self, job_id: str, job: Pending) -> None:
        assert job.job_id == job_id
        self.add(job)

    def __delitem__(self, job_id: str) -> None:
        if self.pop(job_id) is None:
            raise KeyError(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def values(self) -> Iterable[Pending]:
        return self._jobs.values()

    def kinds(self) -> Counter[Request]:
        """How many queued jobs ask for each request."""
        return self._kinds

    def listed(self, owner: str, priority: int) -> Sequence[tuple[int, str]]:
        """``owner``'s jobs at ``priority`` that hold no reservation, oldest first: (seq, id)."""
        return self._users.get(priority, {}).get(owner, ())

    def order(
        self, usage: Mapping[str, float], share_of: Callable[[Request], float], fair: FairShare | None = None
    ) -> Iterator[Pending]:
        """The jobs in the order they get their turn, read lazily: each priority level from the
        highest, its reserved jobs first (oldest reservation first), then the user using least (then
        the one whose next job is oldest), their use growing by each job as it is placed. A heap of
        the users: one pop and one push per job read, however many users wait. With ``fair``, a
        user's use is their turn by the fair share over weeks (``FairShare.turn``)."""
        usage = dict(usage)
        jobs = self._jobs
        if fair is not None:
            yield from self._fair_order(usage, share_of, fair)
            return
        for priority in sorted(self._users.keys() | self._reserved.keys(), reverse=True):
            reserved = sorted(self._reserved.get(priority, {}).values(), key=lambda p: (p.reserved_at, p.seq))
            for p in reserved:
                usage[p.owner] = usage.get(p.owner, 0.0) + share_of(p.request)
            yield from reserved
            lists = self._users.get(priority, {})
            turns = [(usage.get(user, 0.0), queued[0][0], user, 0) for user, queued in lists.items()]
            heapq.heapify(turns)
            while turns:
                share, _, user, i = turns[0]
                queued = lists[user]
                job = jobs[queued[i][1]]
                if i + 1 < len(queued):
                    heapq.heapreplace(turns, (share + share_of(job.request), queued[i + 1][0], user, i + 1))
                else:
                    heapq.heappop(turns)
                yield job

    def _fair_order(
        self, usage: dict[str, float], share_of: Callable[[Request], float], fair: FairShare
    ) -> Iterator[Pending]:
        jobs = self._jobs
        # ``fair.turn``, its lookups done once: a pass works out the turn of every user with a queued job.
        used, shares = fair.used.get, fair.shares.get
        default = fair.shares.get("*", DEFAULT_SHARES)
        rate, now, max_age = fair._age_rate, fair.now, fair.max_age

        def turn(user: str, held: float, created_at: float) -> float:
            if rate and created_at:
                age = rate * min(max(0.0, now - created_at), max_age)
                return (used(user, 0.0) + held) / shares(user, default) - age
            return (used(user, 0.0) + held) / shares(user, default)

        for priority in sorted(self._users.keys() | self._reserved.keys(), reverse=True):
            reserved = sorted(self._reserved.get(priority, {}).values(), key=lambda p: (p.reserved_at, p.seq))
            for p in reserved:
                usage[p.owner] = usage.get(p.owner, 0.0) + share_of(p.request)
            yield from reserved
            lists = self._users.get(priority, {})
            turns = [
                (turn(user, usage.get(user, 0.0), jobs[queued[0][1]].created_at), queued[0][0], user, 0)
                for user, queued in lists.items()
            ]
            heapq.heapify(turns)
            while turns:
                _, _, user, i = turns[0]
                queued = lists[user]
                job = jobs[queued[i][1]]
                held = usage[user] = usage.get(user, 0.0) + share_of(job.request)
                if i + 1 < len(queued):
                    after = jobs[queued[i + 1][1]]
                    heapq.heapreplace(turns, (turn(user, held, after.created_at), queued[i + 1][0], user, i + 1))
                else:
                    heapq.heappop(turns)
                yield job


@dataclass
class _Pool:
    """What is free (and not reserved) while a plan is made."""

    whole: set[int]  # GPUs nothing holds any of
    slice_free: dict[int, int]  # GPU → bytes free for slices (GPUs held whole are absent)
    cpus: float
    memory: int

    def fit(self, request: Request) -> tuple[int, ...] | None:
        """The GPUs the request would get now, or None when it does not fit."""
        if request.cpus > self.cpus + 1e-9 or request.memory > self.memory:
            return None
        if request.gpus:
            if len(self.whole) < request.gpus:
                return None
            return tuple(sorted(self.whole)[: request.gpus])
        if request.gpu_memory:
            fits = [(free, i) for i, free in self.slice_free.items() if free >= request.gpu_memory]
            return (min(fits)[1],) if fits else None
        return ()

    def take(self, request: Request, gpus: tuple[int, ...]) -> None:
        self.cpus -= request.cpus
        self.memory -= request.memory
        for index in gpus:
            self.whole.discard(index)
            if request.gpus:
                self.slice_free.pop(index, None)
            elif index in self.slice_free:
                self.slice_free[index] -= request.gpu_memory

    def reserve(self, request: Request) -> None:
        """Set aside, for a job that does not fit yet, what it would take of what is free now."""
        self.cpus -= min(self.cpus, request.cpus)
        self.memory -= min(self.memory, request.memory)
        if request.gpus:
            for index in sorted(self.whole)[: request.gpus]:
                self.whole.discard(index)
                self.slice_free.pop(index, None)
        elif request.gpu_memory and self.slice_free:
            index = max(self.slice_free, key=lambda i: (self.slice_free[i], -i))
            self.whole.discard(index)
            del self.slice_free[index]

    def shortfall(self, request: Request) -> list[str]:
        """What is missing for ``request``, in words."""
        missing = []
        if request.gpus and len(self.whole) < request.gpus:
            missing.append(f"needs {request.gpus} GPU{'s' if request.gpus > 1 else ''}, {len(self.whole)} free")
        if request.gpu_memory and not any(f >= request.gpu_memory for f in self.slice_free.values()):
            most = max(self.slice_free.values(), default=0)
            missing.append(
                f"needs a {format_size(request.gpu_memory)} GPU slice, at most {format_size(most)} free on one"
            )
        if request.cpus > self.cpus + 1e-9:
            missing.append(f"needs {request.cpus:g} CPUs, {max(self.cpus, 0):g} free")
        if request.memory > self.memory:
            missing.append(f"needs {format_size(request.memory)} of memory, {format_size(max(self.memory, 0))} free")
        return missing


def _pool(machine: Machine) -> _Pool:
    return _Pool(
        whole=set(range(len(machine.gpu_memory))),
        slice_free=dict(enumerate(machine.gpu_memory)),
        cpus=machine.cpus,
        memory=machine.memory,
    )


@dataclass
class _Free:
    """What is free on each node while a plan is made, and what each user holds in the cluster."""

    pools: dict[str, _Pool]
    held_gpus: dict[str, float] = field(default_factory=dict)  # user → GPUs held (slices as fractions)
    held_jobs: dict[str, int] = field(default_factory=dict)  # user → jobs running

    def copy(self) -> _Free:
        pools = {name: _Pool(set(p.whole), dict(p.slice_free), p.cpus, p.memory) for name, p in self.pools.items()}
        return _Free(pools, dict(self.held_gpus), dict(self.held_jobs))

    def fit(self, request: Request) -> tuple[str, tuple[int, ...]] | None:
        """The node and GPUs the request would get now, or None when it fits no node."""
        placed = self.fit_all(request)
        return placed[0] if placed else None

    def fit_all(self, request: Request) -> list[tuple[str, tuple[int, ...]]] | None:
        """(node, GPUs) for each of the request's nodes (distinct ones), or None when they do not all fit."""
        fits = [(name, gpus) for name, pool in self.pools.items() if (gpus := pool.fit(request)) is not None]
        if len(fits) < request.nodes:
            return None
        if len(fits) == 1:
            return fits

        def left(item: tuple[str, tuple[int, ...]]) -> tuple[float, ...]:
            pool = self.pools[item[0]]
            if request.gpus:
                return (len(pool.whole), -pool.cpus)
            if request.gpu_memory:
                return (pool.slice_free[item[1][0]], -pool.cpus)
            return (-pool.cpus, -pool.memory)

        return sorted(fits, key=left)[: request.nodes]

    def take(self, request: Request, node: str, gpus: tuple[int, ...]) -> None:
        if node in self.pools:
            self.pools[node].take(request, gpus)

    def reserve(self, request: Request) -> None:
        """Set aside, on the nodes nearest to fitting it, what the request would take of what is free."""
        pools = sorted(
            self.pools.values(),
            key=lambda p: (len(p.whole), max(p.slice_free.values(), default=0), p.cpus, p.memory),
            reverse=True,
        )
        for pool in pools[: request.nodes]:
            pool.reserve(request)

    def shortfall(self, request: Request) -> list[str]:
        if request.nodes > 1:
            fit = sum(pool.fit(request) is not None for pool in self.pools.values())
            each = dataclasses.replace(request, nodes=1).describe()
            return [f"needs {request.nodes} nodes with {each} free, {fit} {'has' if fit == 1 else 'have'} it"]
        if len(self.pools) == 1:
            return next(iter(self.pools.values())).shortfall(request)
        # The node missing least: fewest words of shortfall, then most GPUs free.
        nearest = min(self.pools.items(), key=lambda item: (len(item[1].shortfall(request)), -len(item[1].whole)))
        return [f"{what} on {nearest[0]}, the nearest node" for what in nearest[1].shortfall(request)]


def _initial_free(cluster: Cluster, running: Iterable[Holding]) -> _Free:
    free = _Free({name: _pool(machine) for name, machine in cluster.nodes})
    default = cluster.nodes[0][0] if cluster.nodes else ""
    for holding in running:
        for node, gpus in holding.placement or ((holding.node or default, holding.gpu_indices),):
            free.take(holding.request, node, gpus)
        free.held_gpus[holding.owner] = free.held_gpus.get(holding.owner, 0.0) + cluster.gpu_share(holding.request)
        free.held_jobs[holding.owner] = free.held_jobs.get(holding.owner, 0) + 1
    return free


def could_start(
    requests: Iterable[Request], running: Iterable[Holding], machine: Machine | Cluster, low_memory: str = ""
) -> bool:
    """Whether any of ``requests`` fits what is free: when none does, a pass would start nothing."""
    free = _initial_free(Cluster.of(machine), running)
    return any(
        free.fit_all(request) is not None and not (low_memory and not request.memory) for request in set(requests)
    )


def _usage(running: Iterable[Holding], machine: Cluster) -> tuple[dict[str, float], Callable[[Request], float]]:
    """Each user's dominant share of what runs, and a function giving a request's share (worked out
    once per kind of request)."""
    shares: dict[Request, float] = {}

    def share_of(request: Request) -> float:
        found = shares.get(request)
        if found is None:
            found = shares[request] = machine.dominant_share(request)
        return found

    usage: dict[str, float] = {}
    for holding in running:
        usage[holding.owner] = usage.get(holding.owner, 0.0) + share_of(holding.request)
    return usage, share_of


def queue_order(
    queued: Queue | Iterable[Pending],
    running: Iterable[Holding],
    machine: Machine | Cluster,
    fair: FairShare | None = None,
) -> list[Pending]:
    """The queue in the order jobs get their turn: priority, then the reservation, then fair share."""
    queue = queued if isinstance(queued, Queue) else Queue(queued)
    return list(queue.order(*_usage(running, Cluster.of(machine)), fair))


def _over_quota(job: Pending, free: _Free, quota: Quota | None, machine: Cluster) -> str:
    if quota is None:
        return ""
    jobs = free.held_jobs.get(job.owner, 0)
    if quota.jobs is not None and jobs + 1 > quota.jobs:
        return f"over quota: {job.owner} runs {jobs} job{'s' if jobs != 1 else ''}, the most allowed at once"
    gpus = free.held_gpus.get(job.owner, 0.0)
    wanted = machine.gpu_share(job.request)
    if quota.gpus is not None and wanted and gpus + wanted > quota.gpus + 1e-9:
        return f"over quota: {job.owner} holds {gpus:g} of {quota.gpus:g} GPUs allowed at once"
    return ""


def plan(
    queued: Queue | Iterable[Pending],
    running: Sequence[Holding],
    machine: Machine | Cluster,
    quotas: Mapping[str, Quota] | None = None,
    low_memory: str = "",
    depth: int | None = None,
    caps: Mapping[str, int] | None = None,
    fair: FairShare | None = None,
    reach: int | None = None,
) -> list[Decision]:
    """Decide for the queued jobs, in queue order: start it now on these GPUs, or say why it waits.

    ``quotas`` maps a user to its quota; the entry ``"*"`` applies to users without one of their own.
    ``low_memory``, when set, says why jobs that reserve no memory wait (the machine's free memory is
    below the floor). ``depth``: decide for at least this many jobs, then go on only while a job
    further back could still start (None: decide for every job). What starts is the same either way.
    ``caps`` maps a job array to the most of its tasks that may run at once. ``fair``: order users
    by their use over weeks too (see ``FairShare``); a waiting job's reason then says its owner's.
    ``reach``: once this many jobs wait for room, no job further back that asks for a GPU starts or
    is decided for (None: no such limit; the server's is ``REACH``, the module's docstring says why).
    """
    quotas = quotas or {}
    caps = caps or {}
    for_room = 0  # jobs decided that wait for room (not for a dependency, a quota or a cap)
    reached = False  # ``reach`` such jobs were decided: nothing further back takes a GPU
    in_group: Counter[str] = Counter(h.group for h in running if h.group in caps)
    machine = Cluster.of(machine)
    queue = queued if isinstance(queued, Queue) else Queue(queued)
    usage, share_of = _usage(running, machine)
    # While a pass is past ``depth``: the kinds of request still behind, and whether all of them are
    # known not to fit (``why`` says so, or the memory floor holds them): then nothing behind starts.
    behind: Counter[Request] | None = None
    changed, checked = 0, -1  # a count of changes to ``why`` (and to the kinds behind), and the one last checked
    free = _initial_free(machine, running)  # less the reservation, once there is one
    unreserved = free.copy()
    decisions = []
    waiting = 0  # jobs ahead that wait
    reservation: Pending | None = None
    # What is free changes only when a job starts or the reservation is made: until then a request
    # that did not fit does not fit, and waits for the same reason. A long queue of a few kinds of
    # request is decided in one lookup a job.
    why: dict[Request, str] = {}  # request → why it waits, while nothing changes
    notes: dict[str, str] = {}  # user → their fair share, in words
    for position, job in enumerate(queue.order(usage, share_of, fair), start=1):
        if depth is not None and position > depth:
            if behind is None:
                behind = Counter(queue.kinds())
                for decided in decisions:
                    behind[queue[decided.job_id].request] -= 1
            if checked != changed:
                checked = changed
                # Once the reservation is made, what is free only shrinks: a kind that does not fit
                # it now never will in this pass, whether or not a job of it was met yet.
                if all(
                    n <= 0
                    or k in why
                    or (low_memory and not k.memory)
                    or (reservation is not None and free.fit_all(k) is None)
                    or (reached and (k.gpus or k.gpu_memory))
                    for k, n in behind.items()
                ):
                    break
            behind[job.request] -= 1
            if not behind[job.request]:
                changed += 1
        if reached and (job.request.gpus or job.request.gpu_memory):
            continue  # past the reach: not decided here, and it does not start
        quota = quotas.get(job.owner, quotas.get("*"))
        reason = job.blocked or _over_quota(job, free, quota, machine)
        cap = caps.get(job.group, 0) if job.group else 0
        if not reason and cap and in_group[job.group] >= cap:
            reason = f"array {job.group} runs {in_group[job.group]} of its tasks, the most at once (%{cap})"
        if not reason and low_memory and not job.request.memory:
            reason = low_memory
        if not reason:
            reason = why.get(job.request, "")
            fits = None if reason else free.fit_all(job.request)
            if fits is not None:
                for pool in (free, unreserved):
                    for node, gpus in fits:
                        pool.take(job.request, node, gpus)
                free.held_gpus[job.owner] = free.held_gpus.get(job.owner, 0.0) + machine.gpu_share(job.request)
                free.held_jobs[job.owner] = free.held_jobs.get(job.owner, 0) + 1
                if cap:
                    in_group[job.group] += 1
                placement = tuple(fits) if job.request.nodes > 1 else ()
                decisions.append(Decision(job.job_id, position, fits[0][1], node=fits[0][0], placement=placement))
                why.clear()
                changed += 1
                continue
            for_room += 1
            if for_room == reach:
                reached = True  # from here on, no kind with a GPU starts
                changed += 1
            if not reason:
                if reservation is not None and unreserved.fit_all(job.request) is not None:
                    reason = (
                        f"what it needs is reserved for {reservation.job_id} (needs {reservation.request.describe()})"
                    )
                else:
                    reason = "; ".join(unreserved.shortfall(job.request))
                why[job.request] = reason
                changed += 1
            if reservation is None:
                reservation = job
                free.reserve(job.request)
                why.clear()
                changed += 1
        if job.blocked:  # it waits for its dependencies, not behind other jobs: nor do others behind it
            decisions.append(Decision(job.job_id, position, None, reason))
            continue
        if waiting:
            reason += f", {waiting} job{'s' if waiting > 1 else ''} ahead"
        if fair is not None and fair.used.get(job.owner, 0.0) >= _FAIR_NOTE_FROM:
            note = notes.get(job.owner)
            if note is None:
                note = notes[job.owner] = fair.describe(job.owner)
            reason += f"; {note}"
        decisions.append(Decision(job.job_id, position, None, reason, reserves=job is reservation))
        waiting += 1
    return decisions


def decided_alike(job: Pending, queue: Queue, decided: Mapping[Request, int], depth: int) -> bool:
    """Whether a pass over ``queue`` with ``job`` added (as a submit adds it: its owner's newest)
    decides what the last pass decided, and nothing for ``job``, so that a submit need not run one.
    That pass, ``depth`` deep, went over ``queue`` as it is now (nothing changed since), started
    nothing and made no reservation; ``decided`` counts its decisions by kind of request.

    It holds when ``job`` comes after all that pass decided (its owner has as many jobs ahead of it
    at its priority), and jobs of its kind were left undecided. Then that pass stopped short of the
    queue's end knowing that the kind cannot start (it stops only so), and the count of each kind
    behind, which decides where a pass stops, changes nowhere before ``job``."""
    total = sum(decided.values())
    if job.reserved_at is not None or total < depth or job.job_id in queue:
        return False
    ahead = queue.listed(job.owner, job.priority)
    if len(ahead) < total or (ahead and ahead[-1][0] >= job.seq):
        return False
    return queue.kinds()[job.request] > decided.get(job.request, 0)


class Scheduler:
    """What the scheduler keeps between passes: the queue (the store holds the same), the last
    pass's plan, and a count of what changed since.

    Every change to the queue goes through here and is counted, and so is every change the caller
    reports of what the queue depends on (``changed``: a job that moved, a quota, a node, the memory
    floor). A submit skips its pass (``admit``) only when nothing counted since the last one, so no
    path can forget to say it changed something the shortcut rests on.
    """

    def __init__(self, pending: Iterable[Pending] = ()) -> None:
        self.queue = Queue(pending)
        # The last pass's decision for each queued job; None when a pass was skipped because nothing
        # could start: why each job waits is then worked out when someone asks.
        self.plan: dict[str, Decision] | None = {}
        self._changes = 0
        # After a pass that started nothing and reserved nothing: what a submit needs to know that a
        # pass of its own would decide the same (that count, decisions by kind, the memory floor's
        # word, the cluster).
        self._settled: tuple[int, Counter[Request], str, Cluster] | None = None

    def changed(self, replan: bool = False) -> None:
        """Something the queue depends on changed; ``replan``: the plan's reasons may no longer hold
        (worked out again when someone asks, or by the next pass)."""
        self._changes += 1
        if replan:
            self.plan = None

    # ---- the queue --------------------------------------------------------------------------------

    def put(self, job: Pending) -> None:
        """Queue ``job``, or replace the queued job of its id (a reservation, a reason to wait)."""
        self.queue.add(job)
        self._changes += 1

    def update(self, job_id: str, **fields: object) -> Pending | None:
        """Change fields of a queued job (None: it is not queued)."""
        job = self.queue.get(job_id)
        if job is not None:
            self.put(dataclasses.replace(job, **fields))  # type: ignore[arg-type]
        return job

    def drop(self, job_id: str) -> Pending | None:
        """Take a job out of the queue (started, cancelled); the job, or None if it was not there."""
        job = self.queue.pop(job_id, None)
        if job is not None:
            self._changes += 1
            if self.plan:
                self.plan.pop(job_id, None)
        return job

    def admit(self, job: Pending, cluster: Cluster, low_memory: Callable[[], str]) -> bool:
        """Queue a new ``job``; whether a pass would decide what the last one did, and nothing for it
        (a deep queue that nothing can enter, the job behind all the pass looked at): then the job
        needs no pass, and the count stays as it was, so that the next submit may skip one too."""
        settled = self._settled
        if (
            settled is not None
            and settled[0] == self._changes
            and settled[3] is cluster  # every change counts, so: all that can differ
            and not job.blocked
            and settled[2] == low_memory()
            and decided_alike(job, self.queue, settled[1], LOOK_AHEAD)
        ):
            self.queue.add(job)
            return True
        self.put(job)
        return False

    # ---- passes -----------------------------------------------------------------------------------

    def skipped(self) -> None:
        """A pass was skipped: nothing in the queue can start now."""
        self._settled = None
        self.plan = None if self.queue else {}

    def planned(self, decisions: list[Decision], low_memory: str, cluster: Cluster) -> None:
        """A pass decided ``decisions``; a pass that starts nothing and reserves nothing new is
        remembered for ``admit``."""
        self.plan = {d.job_id: d for d in decisions}
        queue = self.queue
        if all(
            d.gpu_indices is None and (not d.reserves or queue[d.job_id].reserved_at is not None) for d in decisions
        ):
            decided = Counter(queue[d.job_id].request for d in decisions)
            self._settled = (self._changes, decided, low_memory, cluster)
        else:
            self._settled = None

    def handed_over(self, held: dict[str, Decision]) -> None:
        """A pass handed every job it could to the cluster's own queue; ``held``: why the others wait."""
        self._settled = None
        self.plan = held


def preempt(
    queued: Queue | Iterable[Pending],
    running: Sequence[Holding],
    machine: Machine | Cluster,
    now: float,
    after: float,
    fair: FairShare | None = None,
    quotas: Mapping[str, Quota] | None = None,
    stopping: Iterable[str] = (),
    depth: int = LOOK_AHEAD,
) -> list[tuple[str, str]]:
    """Which running jobs to stop now so that waiting jobs can start: (victim, the job it makes room
    for), least disruptive first. A queued job qualifies once it has waited ``after`` seconds (since
    ``created_at``), is not blocked nor over its quota, and does not fit what is free; a running job
    may be its victim only when it is ``preemptible`` and either of lower priority, or of the same
    priority and owned by a user whose fair-share standing (their use, less the victim, on their
    shares) stays above the waiting owner's (with it). Victims are taken newest first (the least
    work lost), lowest priority first, until the job fits; a job that would not fit even then takes
    none. ``stopping``: jobs already being stopped, whose resources count as free."""
    machine = Cluster.of(machine)
    queue = queued if isinstance(queued, Queue) else Queue(queued)
    stopping = set(stopping)
    holding = [h for h in running if h.job_id not in stopping]  # grows by the jobs that would start
    if not any(h.preemptible for h in holding):
        return []
    usage, share_of = _usage(holding, machine)
    quotas = quotas or {}
    victims: list[tuple[str, str]] = []

    def standing(user: str, held: float) -> float:
        shares = fair.shares_of(user) if fair is not None else 1.0
        return ((fair.used.get(user, 0.0) if fair is not None else 0.0) + held) / shares

    free: _Free | None = None  # what ``holding`` leaves free: worked out again only when it changes
    without: dict[str, float] = {}  # a running job → its owner's standing without it, while ``usage`` holds
    for position, job in enumerate(queue.order(usage, share_of, fair)):
        if position >= depth:
            break
        if job.blocked or not job.created_at or now - job.created_at < after:
            continue
        if free is None:
            free = _initial_free(machine, holding)
        fits = free.fit_all(job.request)
        if fits is not None:  # it starts at the next pass, in what is free (or being freed)
            holding.append(_held(job, fits))
            free = None
            continue
        if _over_quota(job, free, quotas.get(job.owner, quotas.get("*")), machine):
            continue
        mine = standing(job.owner, usage.get(job.owner, 0.0) + share_of(job.request))

        def may_stop(h: Holding, job: Pending = job, mine: float = mine) -> bool:
            if not h.preemptible or h.priority > job.priority:
                return False
            if h.priority < job.priority:
                return True
            if h.owner == job.owner:
                return False
            found = without.get(h.job_id)
            if found is None:
                found = without[h.job_id] = standing(h.owner, usage.get(h.owner, 0.0) - share_of(h.request))
            return found > mine

        candidates = sorted((i for i, h in enumerate(holding) if may_stop(h)), key=lambda i: (holding[i].priority, -i))
        if not candidates:
            continue

        def room(
            count: int, job: Pending = job, candidates: list[int] = candidates, holding: list[Holding] = holding
        ) -> bool:
            """Whether stopping the first ``count`` candidates makes room for ``job``."""
            gone = set(candidates[:count])
            left = [h for k, h in enumerate(holding) if k not in gone]
            return _initial_free(machine, left).fit_all(job.request) is not None

        if not room(len(candidates)):
            continue  # even all of them would not make room
        # The fewest candidates, in their order, that make room: stopping more only frees more, so
        # halving finds the count that trying one more at a time finds, in a few tries instead of many.
        fewest, most = 1, len(candidates)
        while fewest < most:
            half = (fewest + most) // 2
            if room(half):
                most = half
            else:
                fewest = half + 1
        chosen = candidates[:fewest]
        free = None
        without.clear()
        for i in chosen:
            victims.append((holding[i].job_id, job.job_id))
            usage[holding[i].owner] -= share_of(holding[i].request)
        stopped = set(chosen)
        holding = [h for k, h in enumerate(holding) if k not in stopped]
        fits = _initial_free(machine, holding).fit_all(job.request)
        assert fits is not None
        # The job now holds what it made room for: a job behind it cannot take the same victims' room.
        holding.append(_held(job, fits))
        usage[job.owner] = usage.get(job.owner, 0.0) + share_of(job.request)
    return victims


def _held(job: Pending, fits: list[tuple[str, tuple[int, ...]]]) -> Holding:
    """``job`` as if it ran where ``fits`` places it."""
    return Holding(job.job_id, job.owner, job.request, fits[0][1], fits[0][0], tuple(fits), job.group, job.priority)
