"""Fair over a week: the pure scheduler (``plan``) driven by a simulated clock, the same jobs under
three policies (four with ``--quick`` or ``--all``) in one run.

The workload (seeded): 1,000 users with 1 to 4 shares (uniform) submit 100,000 jobs over one
simulated week to 8 nodes of 8 GPUs (a ``Cluster``: a job runs on one node, an 8-GPU job takes a
whole one). Users' activity is heavy-tailed (lognormal weights), independent of their shares, so
some ask for far more than their share and many for less. Each job asks for 1, 2, 4 or 8 GPUs
(55/20/15/10 %) and runs a bounded-Pareto time (alpha 1.2, 1 minute to 8 hours, scaled so that the
jobs ask for ``--load`` times what the GPUs give in the week: 1.3 by default). Arrivals are uniform
over the week. ``--quick``: 100 users, 10,000 jobs, 2 nodes of 8 GPUs, one day.

Event-driven, as the server runs: at each submit and each end, a pass of ``plan`` over the kept
``Queue``, skipped as the server skips it when ``could_start`` says nothing queued fits what is
free; what the pass starts starts now (its end is an event), and a job the pass says reserves gets
``reserved_at`` as the server records it. The pass is ``--depth`` deep (1 by default; the server's
is ``LOOK_AHEAD``, 100): plan() decides at least that many jobs, then goes on while a job further
back could still start, so what starts and which job reserves are the same at any depth (plan's
docstring; ``--depth 100`` gives the same figures): only the reasons of jobs that wait, which the
simulation does not read, are left out. Past ``--reach`` jobs that wait (the server's ``REACH``,
500), no job further back starts, as in the server; FIFO, the anchor, has none (``--reach 0``: the
fair shares have none either). The policies run in processes of their own (``--processes``).

Preemption, as the server does it: half the jobs (``--preemptible``) are marked preemptible, and
``preempt()`` (the server's rule, with its default ``--preempt-after`` of 10 minutes) is asked at
the first event of each simulated minute (the server asks at every event: here a job may wait up
to a minute longer before it preempts) which running jobs to stop. A victim stops at once (the
grace period is not simulated), loses the work since its last checkpoint (one every 5 minutes of
its run), and is queued again with its place and age, to run what is left.

The policies, each over the same jobs:
(a) decayed fair share: ``plan(..., fair=FairShare(...))`` with each user's decayed use (the
    server's formula in services/usage.py, advanced with the simulated clock, exact at each pass),
    their shares, and the server's defaults (half-life 7 days, age weight 1 with a maximum age of
    7 days), with preemption; a second row without it shows what preemption costs and gives;
(b) FIFO: every job given one owner, so the order is submission order (the reservation rule kept);
(c) today's instantaneous fair share: ``fair=None`` (dominant share of what runs now, no shares).

Jain's index "relative to shares": a user cannot be given more than they asked for, so each user's
fair amount is the weighted max-min (water-filling) allocation of the GPU-hours the policy
delivered: ``fair_i = min(demand_i, level * shares_i)``, the level chosen so the fair amounts sum
to what was delivered; ``x_i = got_i / fair_i`` over every user who asked for anything, and
``J = (sum x)^2 / (n sum x^2)``. A user who asked for less than their share is fair when given
what they asked for; a saturated user, when given ``level * shares``. (Restricting to saturated
users alone would drop the light users a bad policy starves.) ``demand_i``: the GPU-hours their
jobs would hold inside the week if started at submission (a job near the week's end counts only
to the end).

Figures, within the week: Jain's index (goal >= 0.95), the median wait of 1-GPU jobs until their
first start (jobs still queued at the end count as waiting until the end: a lower bound), GPU
utilisation (GPU-hours held, lost work included, / GPU-hours in the window; goal: fair share >=
95% of FIFO's), and the work lost to preemption (goal <= 2% of the GPU-hours held).

Differences from the server, named: a pass that ``could_start`` says starts nothing is skipped
after a submit too (the server runs it for the reply's reasons; it can record a reservation, which
the next pass here records instead); after a pass that started nothing and stopped short of its
reach, a submit of a kind of request already queued has no pass either (no queued kind fits what is
free less the reservation, which sticks, so that pass would decide nothing new); preemption as above. ``--hours`` simulates
only the window's start, for the figures' trend and the cost per pass; each policy prints its
progress a simulated day at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import heapq
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from _report import ROWS, Row, print_table, say

from gpuport.defaults import DEFAULT_AGE_WEIGHT, DEFAULT_FAIRSHARE_HALF_LIFE, DEFAULT_MAX_AGE, DEFAULT_PREEMPT_AFTER
from gpuport.server.scheduler import (
    LOOK_AHEAD,
    REACH,
    Cluster,
    FairShare,
    Holding,
    Machine,
    Pending,
    Queue,
    Request,
    could_start,
    plan,
    preempt,
)

GiB = 2**30
HOUR = 3600.0
DAY = 24 * HOUR
T0 = 1_700_000_000.0  # the simulated clock's start (a ``created_at`` of 0 means no age)
SIZES = ((1, 0.55), (2, 0.20), (4, 0.15), (8, 0.10))
CHECKPOINT_EVERY = 300.0  # a preemptible job saves a checkpoint every 5 minutes of its run
PREEMPT_EVERY = 60.0  # preempt() looks at the first event of each simulated minute


@dataclass(frozen=True)
class Job:
    job_id: str
    owner: str
    gpus: int
    submit: float  # seconds after T0
    duration: float
    preemptible: bool = False


@dataclass
class Workload:
    users: list[str]
    shares: dict[str, float]
    jobs: list[Job]
    cluster: Cluster
    gpus: int
    span: float  # seconds of the simulated window


def bounded_pareto(rng: random.Random, alpha: float, low: float, high: float) -> float:
    u = rng.random()
    ratio = (low / high) ** alpha
    return low / (1 - u * (1 - ratio)) ** (1 / alpha)


def workload(
    users: int, jobs: int, nodes: int, span: float, load: float, preemptible: float = 0.5, seed: int = 36
) -> Workload:
    rng = random.Random(seed)
    names = [f"user{i:04d}" for i in range(users)]
    shares = {u: float(rng.randint(1, 4)) for u in names}
    weights = [rng.lognormvariate(0.0, 1.0) for _ in names]
    owners = rng.choices(names, weights=weights, k=jobs)
    sizes = rng.choices([s for s, _ in SIZES], weights=[w for _, w in SIZES], k=jobs)
    submits = sorted(rng.uniform(0, span) for _ in range(jobs))
    durations = [bounded_pareto(rng, 1.2, 60.0, 8 * HOUR) for _ in range(jobs)]
    gpus = nodes * 8
    scale = load * gpus * span / sum(g * d for g, d in zip(sizes, durations, strict=True))
    cluster = Cluster(tuple((f"node{n}", Machine((80 * GiB,) * 8, 64.0, 512 * GiB)) for n in range(nodes)))
    flags = [rng.random() < preemptible for _ in range(jobs)]
    listed = [Job(f"j{i}", owners[i], sizes[i], submits[i], durations[i] * scale, flags[i]) for i in range(jobs)]
    return Workload(names, shares, listed, cluster, gpus, span)


class Decayed(Mapping[str, float]):
    """Each user's decayed use at the simulated ``now`` (set by ``at``), worked out when asked
    (``FairShare.turn`` asks only for the users with queued jobs): the server's formula
    (services/usage.py), a run of dominant share ``s`` from ``a`` to ``b`` counting ``s *
    (2^-(now-b)/h - 2^-(now-a)/h)``, kept as sums against the fixed origin T0 so that advancing the
    clock costs nothing; the sums over all users too, for the average use per share (the age
    factor's unit, ``FairShare.per_share``)."""

    def __init__(self, half_life: float, shares: Mapping[str, float]) -> None:
        self.h = half_life
        self.shares = shares
        self.ended: dict[str, float] = {}  # sum of s * (2^(b/h) - 2^(a/h)) of ended runs
        self.held: dict[str, float] = {}  # sum of s of running runs
        self.began: dict[str, float] = {}  # sum of s * 2^(a/h) of running runs
        self.totals = [0.0, 0.0, 0.0, 0.0]  # the three sums over every user, and those users' shares
        self.now = 0.0
        self.f = 1.0  # 2^(-now/h)

    def at(self, now: float) -> None:
        self.now, self.f = now, 2 ** (-now / self.h)

    def start(self, user: str, share: float, at: float) -> None:
        if user not in self.held:
            self.held[user] = self.began[user] = self.ended[user] = 0.0
            self.totals[3] += self.shares[user]
        began = share * 2 ** (at / self.h)
        self.held[user] += share
        self.began[user] += began
        self.totals[1] += share
        self.totals[2] += began

    def end(self, user: str, share: float, began: float, at: float) -> None:
        a, b = share * 2 ** (began / self.h), share * 2 ** (at / self.h)
        self.held[user] -= share
        self.began[user] -= a
        self.ended[user] += b - a
        self.totals[0] += b - a
        self.totals[1] -= share
        self.totals[2] -= a

    def per_share(self) -> float:
        ended, held, began, shares = self.totals
        return ((ended - began) * self.f + held) / shares if shares else 0.0

    def get(self, user: str, default: float = 0.0) -> float:  # type: ignore[override]
        held = self.held.get(user)
        return default if held is None else (self.ended[user] - self.began[user]) * self.f + held

    def __getitem__(self, user: str) -> float:
        if user not in self.held:
            raise KeyError(user)
        return self.get(user)

    def __iter__(self) -> Iterator[str]:
        return iter(self.held)

    def __len__(self) -> int:
        return len(self.held)


@dataclass
class Outcome:
    name: str
    got: dict[str, float] = field(default_factory=dict)  # user → GPU-seconds held inside the window
    waits: list[float] = field(default_factory=list)  # 1-GPU jobs
    passes: int = 0
    skipped: int = 0
    seconds: float = 0.0  # wall time of the simulation
    plan_seconds: float = 0.0
    preempted: int = 0  # runs stopped by preempt()
    lost: float = 0.0  # GPU-seconds of work lost to preemption (since each victim's last checkpoint)
    preempt_seconds: float = 0.0
    preempt_calls: int = 0


@dataclass(frozen=True)
class Policy:
    label: str
    kind: str  # 'fair', 'fifo' or 'now'
    age_weight: float = DEFAULT_AGE_WEIGHT
    preempt: bool = False  # call preempt() (the preemptible jobs' flag is the workload's)
    reach: int | None = REACH  # plan()'s: the server's (FIFO, the anchor, has none)


def simulate(w: Workload, policy: Policy, depth: int | None = 1) -> Outcome:
    """Run ``w`` under ``policy`` until the window's end. ``depth``: plan()'s (see the module's docstring)."""
    started = time.perf_counter()
    out = Outcome(policy.label)
    kind = policy.kind
    cluster, span = w.cluster, w.span
    jobs = {j.job_id: j for j in w.jobs}
    queue = Queue()
    running: dict[str, Holding] = {}
    began: dict[str, float] = {}
    left = {j.job_id: j.duration for j in w.jobs}  # work still to do (less what checkpoints saved)
    seqs: dict[str, int] = {}
    run = dict.fromkeys(left, 0)  # each job's current run: an end of an earlier (preempted) run is stale
    free = w.gpus
    decayed = Decayed(DEFAULT_FAIRSHARE_HALF_LIFE, w.shares)
    ends: list[tuple[float, str, int]] = []
    submits = w.jobs
    next_look = 0.0  # when preempt() looks next
    # After a pass that started nothing: no kind of request queued fits what is free less the
    # reservation (which sticks: the next pass reserves the same), so a pass after a submit of one of
    # these kinds would decide nothing new and is skipped; any other event forgets it.
    settled = False
    next_day = DAY
    i, seq = 0, 0
    while True:
        next_submit = submits[i].submit if i < len(submits) else math.inf
        next_end = ends[0][0] if ends else math.inf
        now = min(next_submit, next_end)
        if now >= span:
            break
        if now >= next_day:  # progress, for a run that takes long
            print(
                f"    {policy.label}: day {next_day / DAY:g} at {time.perf_counter() - started:.0f} s "
                f"({time.process_time():.0f} s CPU; "
                f"{out.passes:,} passes, {out.plan_seconds:.0f} s in plan(), {out.preempt_seconds:.0f} s in "
                f"preempt(); {len(queue):,} jobs of {len({p.owner for p in queue.values()}):,} users queued)",
                flush=True,
            )
            next_day += DAY
        if next_end <= next_submit:
            _, job_id, n = heapq.heappop(ends)
            if n != run[job_id]:
                continue
            del running[job_id]
            settled = False
            job = jobs[job_id]
            free += job.gpus
            out.got[job.owner] = out.got.get(job.owner, 0.0) + job.gpus * (now - began[job_id])
            decayed.end(job.owner, job.gpus / w.gpus, began[job_id], now)
        else:
            job = submits[i]
            i += 1
            seq += 1
            seqs[job.job_id] = seq
            owner = "everyone" if kind == "fifo" else job.owner
            request = Request(gpus=job.gpus)
            if settled and not queue.kinds()[request]:
                settled = False  # a kind not queued: it may fit
            queue.add(Pending(job.job_id, owner, request, 0, seq, created_at=T0 + job.submit))
        fair = None
        if kind == "fair":
            decayed.at(now)
            fair = FairShare(decayed, w.shares, T0 + now, policy.age_weight, per_share=decayed.per_share())
        if policy.preempt and now >= next_look and queue:
            next_look = now + PREEMPT_EVERY
            t = time.perf_counter()
            holdings = list(running.values())
            victims = preempt(queue, holdings, cluster, T0 + now, DEFAULT_PREEMPT_AFTER, fair)
            out.preempt_seconds += time.perf_counter() - t
            out.preempt_calls += 1
            settled = settled and not victims
            for victim, _ in victims:
                job = jobs[victim]
                held = now - began[victim]
                saved = held - held % CHECKPOINT_EVERY
                out.preempted += 1
                out.lost += job.gpus * (held - saved)
                left[victim] -= saved
                run[victim] += 1
                del running[victim]
                free += job.gpus
                out.got[job.owner] = out.got.get(job.owner, 0.0) + job.gpus * held
                decayed.end(job.owner, job.gpus / w.gpus, began[victim], now)
                # queued again, as the server does: its place (seq) and its age kept
                queue.add(
                    Pending(victim, job.owner, Request(gpus=job.gpus), 0, seqs[victim], created_at=T0 + job.submit)
                )
        if not free or not queue or settled:
            out.skipped += 1
            continue
        holdings = list(running.values())
        if not could_start(queue.kinds(), holdings, cluster):
            out.skipped += 1
            continue
        t = time.perf_counter()
        decisions = plan(queue, holdings, cluster, depth=depth, fair=fair, reach=policy.reach)
        out.plan_seconds += time.perf_counter() - t
        out.passes += 1
        # Nothing started, and not for the reach (a job that fits further back could come within it).
        settled = all(d.gpu_indices is None for d in decisions) and (
            policy.reach is None or len(decisions) < policy.reach
        )
        for d in decisions:
            pending = queue[d.job_id]
            if d.reserves and pending.reserved_at is None:
                queue.add(dataclasses.replace(pending, reserved_at=T0 + now))
            if d.gpu_indices is None:
                continue
            job = jobs[d.job_id]
            queue.pop(d.job_id)
            running[d.job_id] = Holding(
                d.job_id, pending.owner, pending.request, d.gpu_indices, node=d.node, preemptible=job.preemptible
            )
            began[d.job_id] = now
            free -= job.gpus
            decayed.start(job.owner, job.gpus / w.gpus, now)
            heapq.heappush(ends, (now + left[d.job_id], d.job_id, run[d.job_id]))
            if job.gpus == 1 and not run[d.job_id]:
                out.waits.append(now - job.submit)
    for job_id in running:
        job = jobs[job_id]
        out.got[job.owner] = out.got.get(job.owner, 0.0) + job.gpus * (span - began[job_id])
    out.waits += [span - p.created_at + T0 for p in queue.values() if p.request.gpus == 1 and not run[p.job_id]]
    out.seconds = time.perf_counter() - started
    return out


def demand(w: Workload) -> dict[str, float]:
    """Each user's GPU-seconds asked for inside the window (a job counts to the window's end)."""
    asked: dict[str, float] = {}
    for j in w.jobs:
        if j.submit < w.span:
            asked[j.owner] = asked.get(j.owner, 0.0) + j.gpus * min(j.duration, w.span - j.submit)
    return asked


def fair_amounts(asked: Mapping[str, float], shares: Mapping[str, float], total: float) -> dict[str, float]:
    """Weighted max-min (water-filling) of ``total``: each user gets min(asked, level * shares)."""
    users = sorted(asked, key=lambda u: asked[u] / shares[u])
    level, left, weight = 0.0, total, sum(shares[u] for u in users)
    fair: dict[str, float] = {}
    for k, u in enumerate(users):
        capped = asked[u] / shares[u]
        if capped * weight >= left:  # the level is reached before this user's demand: all the rest saturated
            level = left / weight
            for v in users[k:]:
                fair[v] = level * shares[v]
            return fair
        fair[u] = asked[u]
        left -= asked[u]
        weight -= shares[u]
    return fair


def jain(out: Outcome, asked: Mapping[str, float], shares: Mapping[str, float]) -> tuple[float, int]:
    fair = fair_amounts(asked, shares, sum(out.got.values()))
    x = [out.got.get(u, 0.0) / fair[u] for u in asked if fair[u] > 0]
    saturated = sum(1 for u in asked if fair[u] < asked[u] - 1e-6)
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)), saturated


def _simulate(args: tuple[Workload, Policy, int | None]) -> Outcome:
    return simulate(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 users, 10,000 jobs, 16 GPUs, one day")
    parser.add_argument("--load", type=float, default=1.3, help="GPU-hours asked / GPU-hours in the window")
    parser.add_argument("--preemptible", type=float, default=0.5, help="the part of the jobs marked preemptible")
    parser.add_argument("--profile", action="store_true", help="profile the decayed fair share's run")
    parser.add_argument("--hours", type=float, help="simulate only the window's first HOURS (a cost estimate)")
    parser.add_argument(
        "--depth", type=int, default=1, help=f"plan()'s depth (the server's: {LOOK_AHEAD}; what starts is the same)"
    )
    parser.add_argument("--seed", type=int, default=36, help="the workload's seed (default 36)")
    parser.add_argument(
        "--reach", type=int, default=REACH, help=f"plan()'s reach but FIFO's (the server's: {REACH}; 0: none)"
    )
    parser.add_argument("--all", action="store_true", help="the fair share without preemption too (--quick runs it)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="policies simulated at once")
    parser.add_argument("--save", type=Path, help="write each user's figures under each policy to this JSON file")
    args = parser.parse_args()
    if not 0 <= args.preemptible <= 1:
        parser.error(f"--preemptible is a part of the jobs, 0 to 1, not {args.preemptible}")
    if args.depth < 1:
        parser.error(f"--depth is at least 1, not {args.depth}")
    if args.quick:
        w = workload(100, 10_000, 2, DAY, args.load, args.preemptible, args.seed)
    else:
        w = workload(1_000, 100_000, 8, 7 * DAY, args.load, args.preemptible, args.seed)
    if args.hours:
        w = dataclasses.replace(w, span=min(w.span, args.hours * HOUR))
    say(
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; load average at the start: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + (" (--quick)" if args.quick else "")
    )
    say(
        f"{len(w.users):,} users (shares 1-4), {len(w.jobs):,} jobs ({args.preemptible:.0%} preemptible), {w.gpus} "
        f"GPUs ({len(w.cluster.nodes)} nodes of 8), {w.span / DAY:g} simulated days, asked {args.load:g}x "
        f"the GPU-hours (seed {args.seed}); plan() {args.depth} deep, reach {args.reach or 'none'}; "
        f"half-life {DEFAULT_FAIRSHARE_HALF_LIFE / DAY:g} days, age weight {DEFAULT_AGE_WEIGHT:g} (max age {DEFAULT_MAX_AGE / DAY:g} days), preempt after "
        f"{DEFAULT_PREEMPT_AFTER / 60:g} min, checkpoints every {CHECKPOINT_EVERY / 60:g} min"
    )
    reach = args.reach or None
    policies = [
        Policy("decayed fair share", "fair", preempt=True, reach=reach),
        Policy("FIFO", "fifo", 0.0, reach=None),
        Policy("instantaneous fair share", "now", 0.0, reach=reach),
    ]
    if args.quick or args.all:
        policies.insert(1, Policy("decayed fair share, no preemption", "fair", reach=reach))
    outcomes: dict[str, Outcome] = {}
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(simulate, w, policies[0], args.depth)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(
        max(1, min(args.processes, len(policies))), mp_context=multiprocessing.get_context("fork")
    ) as pool:
        for out in pool.map(_simulate, [(w, p, args.depth) for p in policies]):
            outcomes[out.name] = out
            say(
                f"  {out.name}: {out.seconds:.1f} s ({out.passes:,} passes, "
                f"{out.plan_seconds / max(out.passes, 1) * 1e3:.2f} ms each; {out.skipped:,} events without a pass"
                + (
                    f"; {out.preempt_calls:,} preempt() calls, {out.preempt_seconds / max(out.preempt_calls, 1) * 1e3:.2f} "
                    f"ms each, {out.preempted:,} runs preempted"
                    if out.preempt_calls
                    else ""
                )
                + ")"
            )
    say(f"  all: {time.perf_counter() - started:.1f} s, {args.processes} at once")
    asked = demand(w)
    if args.save:
        jobs_of: dict[str, list[Job]] = {}
        for j in w.jobs:
            if j.submit < w.span:
                jobs_of.setdefault(j.owner, []).append(j)
        fairs = {k: fair_amounts(asked, w.shares, sum(o.got.values())) for k, o in outcomes.items()}
        users = {
            u: {
                "shares": w.shares[u],
                "asked": asked[u],
                "jobs": len(jobs_of[u]),
                "gpu_seconds_asked": sum(j.gpus * j.duration for j in jobs_of[u]),
                "longest": max(j.duration for j in jobs_of[u]),
                "got": {k: o.got.get(u, 0.0) for k, o in outcomes.items()},
                "fair": {k: fairs[k][u] for k in outcomes},
            }
            for u in asked
        }
        args.save.write_text(json.dumps({"span": w.span, "gpus": w.gpus, "users": users}))
        say(f"each user's figures: {args.save}")
    fifo = outcomes["FIFO"]
    capacity = w.gpus * w.span
    util = {k: sum(o.got.values()) / capacity for k, o in outcomes.items()}
    say()
    say(f"{'policy':<34} {'Jain':>6} {'saturated':>9} {'1-GPU wait':>11} {'util':>6} {'lost':>6}")
    indexes = {}
    for k, o in outcomes.items():
        index, saturated = jain(o, asked, w.shares)
        indexes[k] = index
        wait = statistics.median(o.waits) if o.waits else 0.0
        lost = o.lost / max(sum(o.got.values()), 1.0)
        say(f"{k:<34} {index:>6.3f} {saturated:>9} {wait / 60:>9.1f} m {util[k]:>6.1%} {lost:>6.2%}")
    tag = " (quick)" if args.quick else ""
    tag += f" ({args.hours:g} h)" if args.hours else ""
    main_row = policies[0].label
    for k in outcomes:
        if k == "FIFO":
            continue
        goal = ">= 0.95" if k == main_row else "-"
        met = indexes[k] >= 0.95 if k == main_row else None
        ROWS.append(Row(f"Jain index: {k}{tag}", indexes[k], indexes["FIFO"], "FIFO", goal, met, "cores"))
    for k, o in outcomes.items():
        if k != "FIFO":
            wait = statistics.median(o.waits)
            ROWS.append(Row(f"median wait, 1 GPU: {k}{tag}", wait, statistics.median(fifo.waits), "FIFO", "-", None))
    for k in outcomes:
        if k == "FIFO":
            continue
        goal = ">= 0.95x FIFO" if k.startswith("decayed") else "-"
        met = util[k] >= 0.95 * util["FIFO"] if k.startswith("decayed") else None
        ROWS.append(Row(f"GPU utilisation: {k}{tag}", util[k], util["FIFO"], "FIFO", goal, met, "cores"))
    o = outcomes[main_row]
    held = sum(o.got.values())
    lost = o.lost / held if held else 0.0
    ROWS.append(
        Row(
            f"work lost to preemption{tag}",
            lost,
            None,
            "-",
            "<= 2% of GPU-hours",
            lost <= 0.02,
            "cores",
            note=f"{o.preempted:,} runs preempted, {o.lost / HOUR:,.1f} of {held / HOUR:,.0f} GPU-hours lost",
        )
    )
    print_table(
        ["Jain", "median wait", "GPU util", "work lost"],
        60,
        "Jain's index, utilisation and work lost as fractions (utilisation: GPU-hours held / GPU-hours in the "
        "window; work lost: of the GPU-hours held), waits in seconds; anchor: the same jobs under FIFO",
    )


if __name__ == "__main__":
    main()
