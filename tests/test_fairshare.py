"""Fair share over weeks: the usage accounting (a real store, the clock injected so a test moves
through a week) and the scheduler's order by decayed use relative to shares, with the age factor."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuport
from gpuport.defaults import DEFAULT_AGE_WEIGHT
from gpuport.protocol.errors import InvalidRequest, PermissionDenied
from gpuport.server.scheduler import (
    Cluster,
    FairShare,
    Holding,
    Machine,
    Pending,
    Request,
    plan,
    queue_order,
)
from gpuport.server.services.auth import Identity
from gpuport.server.services.usage import UsageService
from gpuport.server.store import Store
from tests.conftest import RunningServer, client_env, start_server

GiB = 2**30
HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY
CLUSTER = Cluster.of(Machine(gpu_memory=(16 * GiB,) * 4, cpus=8.0, memory=64 * GiB))
ADMIN = Identity("root", admin=True)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def usage(tmp_path: Path) -> Iterator[tuple[UsageService, Clock]]:
    clock = Clock(1_700_000_000.0)
    store = Store(tmp_path / "state.db")
    yield UsageService(store, half_life=WEEK, age_weight=0.01, clock=clock), clock
    store.close()


def _run(service: UsageService, job_id: str, owner: str, request: Request, start: float, end: float | None) -> None:
    with service.store.transaction() as db:
        service.begin(db, job_id, owner, "job", request, 16 * GiB if request.gpu_memory else 0, start)
    if end is not None:
        service.end(job_id, end, cpu_used=12.5)


def test_a_slice_and_a_whole_gpu_are_accounted_in_gpu_seconds_cpus_and_memory(
    usage: tuple[UsageService, Clock],
) -> None:
    service, clock = usage
    t0 = clock.now
    _run(service, "j1", "alice", Request(gpu_memory=4 * GiB, cpus=2, memory=8 * GiB), t0, t0 + 100)
    _run(service, "j2", "bob", Request(gpus=2, nodes=1), t0, t0 + 50)
    _run(service, "j3", "bob", Request(gpus=1), t0 + 60, None)  # still running: counts until now
    clock.now = t0 + 160
    rows = {r.user: r for r in service.report(ADMIN)}
    assert rows["alice"].gpu_seconds == pytest.approx(25.0)  # a quarter of a GPU for 100 s
    assert rows["alice"].cpu_seconds_reserved == pytest.approx(200.0)
    assert rows["alice"].cpu_seconds_used == pytest.approx(12.5)
    assert rows["alice"].memory_byte_seconds == pytest.approx(8 * GiB * 100)
    assert rows["bob"].gpu_seconds == pytest.approx(2 * 50 + 100)
    assert rows["bob"].runs == 2 and rows["bob"].jobs == 2
    assert service.gpu_seconds(16 * GiB) == {"alice": pytest.approx(25.0), "bob": pytest.approx(200.0)}
    # A span: only what was held within it.
    since = {r.user: r for r in service.report(ADMIN, since=t0 + 90)}
    assert since["alice"].gpu_seconds == pytest.approx(2.5) and since["bob"].gpu_seconds == pytest.approx(70.0)
    # By day: one row per user and day.
    assert [(r.user, r.day) for r in service.report(ADMIN, by="day")] == [
        ("alice", "2023-11-14"),
        ("bob", "2023-11-14"),
    ]


def test_a_user_sees_their_own_usage_and_an_admin_everyones(usage: tuple[UsageService, Clock]) -> None:
    service, clock = usage
    _run(service, "j1", "alice", Request(gpus=1), clock.now - 10, clock.now)
    _run(service, "j2", "bob", Request(gpus=1), clock.now - 10, clock.now)
    assert [r.user for r in service.report(Identity("alice", admin=False))] == ["alice"]
    assert [r.user for r in service.report(ADMIN)] == ["alice", "bob"]
    assert [r.user for r in service.report(ADMIN, user="bob")] == ["bob"]
    with pytest.raises(PermissionDenied, match="sees their own"):
        service.report(Identity("alice", admin=False), user="bob")
    with pytest.raises(InvalidRequest, match="user, day"):
        service.report(ADMIN, by="week")


def test_decayed_use_halves_every_half_life(usage: tuple[UsageService, Clock]) -> None:
    service, clock = usage
    t0 = clock.now
    _run(service, "j1", "alice", Request(gpus=4), t0, t0 + WEEK)  # all of the machine for a week
    clock.now = t0 + WEEK
    assert service.decayed(CLUSTER, clock.now)["alice"] == pytest.approx(0.5)  # 1 - 2**-1
    clock.now = t0 + 2 * WEEK
    assert service.decayed(CLUSTER, clock.now)["alice"] == pytest.approx(0.25)


def test_after_a_simulated_week_the_user_who_held_the_gpus_waits_behind_the_one_who_did_not(
    usage: tuple[UsageService, Clock],
) -> None:
    service, clock = usage
    t0 = clock.now
    # Alice held 3 of the 4 GPUs all week, Bob one for a day at its start.
    for i in range(3):
        _run(service, f"a{i}", "alice", Request(gpus=1), t0, t0 + WEEK)
    _run(service, "b", "bob", Request(gpus=1), t0, t0 + DAY)
    clock.now = t0 + WEEK
    # Alice's jobs were queued first, and hold nothing now: without the week's use she would go first.
    queued = [
        *(Pending(f"alice{i}", "alice", Request(gpus=1), seq=i, created_at=clock.now - 60) for i in range(3)),
        *(Pending(f"bob{i}", "bob", Request(gpus=1), seq=10 + i, created_at=clock.now - 60) for i in range(3)),
    ]
    assert [p.owner for p in queue_order(queued, [], CLUSTER)][:2] == ["alice", "bob"]
    fair = service.fair_share(CLUSTER, {})
    order = [p.job_id for p in queue_order(queued, [], CLUSTER, fair)]
    assert order[:3] == ["bob0", "bob1", "alice0"]  # Bob's turns until his jobs' shares pass Alice's week
    decisions = {d.job_id: d for d in plan(queued, [], CLUSTER, fair=fair)}
    assert all(decisions[f"bob{i}"].gpu_indices is not None for i in range(3))
    assert decisions["alice1"].gpu_indices is None
    assert "fair share: alice has used 0.375 of the machine" in decisions["alice1"].reason
    # With 40 times Bob's shares, Alice's week counts a fortieth: she goes first again.
    fair = service.fair_share(CLUSTER, {"alice": 40.0})
    assert next(p.owner for p in queue_order(queued, [], CLUSTER, fair)) == "alice"
    # Two more weeks on, Alice's use has decayed to a quarter of it.
    clock.now = t0 + 3 * WEEK
    assert service.decayed(CLUSTER, clock.now)["alice"] == pytest.approx(0.375 / 4)


def test_the_age_factor_lets_a_job_that_waited_long_go_first() -> None:
    now = 30 * DAY
    queued = [
        Pending("heavy", "alice", Request(gpus=1), seq=1, created_at=now - WEEK),
        Pending("light", "bob", Request(gpus=1), seq=2, created_at=now - 60),
    ]
    used = {"alice": 0.3, "bob": 0.2}  # 0.25 a share on average: alice is above it, bob below
    fair = FairShare(used=used, now=now, age_weight=0.0)
    assert [p.job_id for p in queue_order(queued, [], CLUSTER, fair)] == ["light", "heavy"]
    aged = FairShare(used=used, now=now, age_weight=1.0)  # a week waited: 1 x 0.25 off her turn
    assert aged.unit == pytest.approx(0.25)
    assert aged.turn("alice", 0.0, now - WEEK) == pytest.approx(0.05)
    assert [p.job_id for p in queue_order(queued, [], CLUSTER, aged)] == ["heavy", "light"]
    # A day's wait is not enough, and a wait past the maximum age counts no more than it.
    day = [dataclasses.replace(queued[0], created_at=now - DAY), queued[1]]
    assert [p.job_id for p in queue_order(day, [], CLUSTER, aged)] == ["light", "heavy"]
    assert aged.turn("alice", 0.0, now - 3 * WEEK) == aged.turn("alice", 0.0, now - WEEK)


def test_the_age_factor_keeps_its_weight_however_many_users_share_the_machine() -> None:
    # 1,000 users, each at their share (a user's decayed use per share is tiny): a job that waited an
    # hour must not go ahead of a user with half the average use per share, as an age weight counted in
    # parts of the whole machine made it do.
    now = 30 * DAY
    used = {f"u{i}": 4e-4 for i in range(1_000)} | {"light": 2e-4}
    queued = [
        Pending("old", "u0", Request(gpus=1), seq=1, created_at=now - HOUR),
        Pending("new", "light", Request(gpus=1), seq=2, created_at=now - 1),
    ]
    fair = FairShare(used=used, now=now, age_weight=DEFAULT_AGE_WEIGHT)
    assert [p.job_id for p in queue_order(queued, [], CLUSTER, fair)] == ["new", "old"]
    # and a user's turn improves by the same part of the average use per share, with 10 users or 1,000.
    few = FairShare(used={f"u{i}": 0.04 for i in range(10)}, now=now, age_weight=DEFAULT_AGE_WEIGHT)
    gain = [f.turn("u0", 0.0, 0.0) - f.turn("u0", 0.0, now - DAY) for f in (fair, few)]
    assert gain[0] / fair.unit == pytest.approx(gain[1] / few.unit) == pytest.approx(DEFAULT_AGE_WEIGHT / 7)


def test_the_default_shares_come_from_the_star_quota() -> None:
    fair = FairShare(used={"alice": 0.4, "bob": 0.4}, shares={"*": 2.0, "bob": 4.0})
    assert fair.shares_of("alice") == 2.0 and fair.shares_of("bob") == 4.0
    assert fair.turn("bob", 0.0, 0.0) < fair.turn("alice", 0.0, 0.0)
    assert FairShare().shares_of("carol") == 1.0


def test_the_service_refuses_a_half_life_of_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    try:
        with pytest.raises(InvalidRequest, match="half-life"):
            UsageService(store, half_life=0)
    finally:
        store.close()


# ---- against a real server: both doors, the Prometheus counter, a restart, the CLI --------------


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(tmp_path / "state")  # two fake 16 GiB GPUs
    yield running
    running.stop()


def _gpu_seconds_metric(server: RunningServer, token: str, user: str) -> float:
    text = server.rest("GET", "/metrics", token).text
    found = re.search(rf'^gpuport_gpu_seconds_total\{{user="{user}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_slice_job_and_a_whole_gpu_job_are_accounted_the_same_by_every_door_and_after_a_restart(
    own_server: RunningServer, cli: Any
) -> None:
    server = own_server
    with server.connect() as admin:
        alice, bob = admin.create_token("alice").token, admin.create_token("bob").token
        scrape = admin.create_token("prometheus", scrape=True).token
        with server.connect(alice) as as_alice, server.connect(bob) as as_bob:
            sleep = ["python", "-c", "import time; time.sleep(1)"]
            sliced = as_alice.submit(sleep, workdir=None, gpu_memory="4GiB")
            whole = as_bob.submit(sleep, workdir=None, gpus=1)
            sliced, whole = sliced.wait(timeout=120), whole.wait(timeout=120)
        assert sliced.status == whole.status == "succeeded"
        held = {
            "alice": 0.25 * (sliced.info.ended_at - sliced.info.started_at),  # a quarter of a 16 GiB GPU
            "bob": 1.0 * (whole.info.ended_at - whole.info.started_at),
        }
        with server.connect(alice) as gpu:  # the SDK: a user sees their own
            report = gpu.usage(since="1h")
            assert [(e.user, e.runs, e.jobs) for e in report.entries] == [("alice", 1, 1)]
            assert report.entries[0].gpu_seconds == pytest.approx(held["alice"], abs=0.01)
            assert report.entries[0].cpu_seconds_used > 0  # its Python ran
            with pytest.raises(gpuport.PermissionDenied):
                gpu.usage(user="bob")
        # REST: the same for bob; an admin sees everyone's, and the Prometheus counter says the same.
        mine = server.rest("GET", "/v1/usage?since=1h", bob).json()
        assert [(e["user"], round(e["gpu_seconds"], 2)) for e in mine["entries"]] == [("bob", round(held["bob"], 2))]
        assert server.rest("GET", "/v1/usage?user=alice", bob).status_code == 403
        everyone = {e.user: e.gpu_seconds for e in admin.usage().entries}
        assert everyone == {
            "alice": pytest.approx(held["alice"], abs=0.01),
            "bob": pytest.approx(held["bob"], abs=0.01),
        }
        for user in ("alice", "bob"):
            assert _gpu_seconds_metric(server, scrape, user) == pytest.approx(everyone[user], abs=1e-6)
        admin.set_quota("alice", shares=2)
    server.stop()
    again = start_server(server.state_dir)  # the accounting and the shares are in the store
    again.admin_token = server.admin_token  # shown on the first start only
    try:
        with again.connect() as admin:
            assert {e.user: e.gpu_seconds for e in admin.usage().entries} == everyone
            fair = {f.user: f for f in admin.usage().fair_share}
            assert fair["alice"].shares == 2 and fair["bob"].shares == 1
            assert fair["alice"].effective_share == pytest.approx(2 / 3, abs=1e-6)  # admin has not used any
            assert fair["bob"].decayed_use > fair["alice"].decayed_use > 0
        done = cli("usage", "--since", "all", "--by", "day", **client_env(again, alice))
        assert done.code == 0, done.output
        assert "alice" in done.stdout and "bob" not in done.stdout and "EFFECTIVE SHARE" in done.stdout
        done = cli("quota", "set", "bob", "--shares", "3", **client_env(again))
        assert done.code == 0 and "3 shares in the fair share" in done.output, done.output
    finally:
        again.stop()


def _fair_order_by_definition(queued: list[Pending], running: list[Holding], fair: FairShare) -> list[Pending]:
    """The order over weeks as ``FairShare`` says it, step by step: each priority level from the
    highest, its reserved jobs first, then turn by turn the user whose ``fair.turn`` (their use now,
    growing by each job placed, and their next job's age) is least, then whose next job is oldest."""
    usage: dict[str, float] = {}
    for h in running:
        usage[h.owner] = usage.get(h.owner, 0.0) + CLUSTER.dominant_share(h.request)
    order: list[Pending] = []
    for priority in sorted({p.priority for p in queued}, reverse=True):
        level = [p for p in queued if p.priority == priority]
        reserved = sorted((p for p in level if p.reserved_at is not None), key=lambda p: (p.reserved_at, p.seq))
        order += reserved
        for p in reserved:
            usage[p.owner] = usage.get(p.owner, 0.0) + CLUSTER.dominant_share(p.request)
        rest = sorted((p for p in level if p.reserved_at is None), key=lambda p: (p.seq, p.job_id))
        while rest:
            nxt: dict[str, Pending] = {}
            for p in rest:
                nxt.setdefault(p.owner, p)
            user = min(nxt, key=lambda u: (fair.turn(u, usage.get(u, 0.0), nxt[u].created_at), nxt[u].seq, u))
            order.append(nxt[user])
            rest.remove(nxt[user])
            usage[user] = usage.get(user, 0.0) + CLUSTER.dominant_share(nxt[user].request)
    return order


def _random_fair_queue(rng: random.Random, users: int) -> tuple[list[Pending], list[Holding], FairShare]:
    """A queue of ``users`` users over weeks: ties in use, shares and age on purpose (users at 0 use,
    jobs queued at the same moment, seq numbers repeated), running jobs, reservations, priorities."""
    now = 40 * DAY
    names = [f"u{i:03d}" for i in range(users)]
    requests = [Request(gpus=1), Request(gpus=2), Request(gpu_memory=4 * GiB), Request(cpus=1.0), Request()]
    used = {u: rng.choice([0.0, 0.01, 0.02, rng.random() / 10]) for u in names if rng.random() < 0.8}
    shares = {u: float(rng.randint(1, 4)) for u in names if rng.random() < 0.5}
    if rng.random() < 0.5:
        shares["*"] = 2.0
    created = [0.0, now - HOUR, now - DAY, now - 3 * WEEK]
    queued = [
        Pending(
            f"j{s}",
            rng.choice(names),
            rng.choice(requests),
            rng.choice([0, 0, 0, 5]),
            s if rng.random() < 0.9 else rng.randint(0, 5),
            reserved_at=float(rng.randint(1, 3)) if rng.random() < 0.03 else None,
            created_at=rng.choice(created) if rng.random() < 0.3 else now - rng.uniform(0, 2 * WEEK),
        )
        for s in range(rng.randint(0, 4 * users))
    ]
    running = [
        Holding(f"r{i}", rng.choice(names), rng.choice(requests[:3]), (i % 4,), priority=rng.choice([0, 5]),
                preemptible=rng.random() < 0.7)
        for i in range(rng.randint(0, 4))
    ]  # fmt: skip
    fair = FairShare(used, shares, now, rng.choice([0.0, 1.0, 3.0]))
    return queued, running, fair


@pytest.mark.parametrize("users", [5, 60, 300])
def test_the_order_over_weeks_is_the_rules_order_on_random_queues(users: int) -> None:
    """The queue read through the users' heap is the order ``FairShare.turn`` gives step by step,
    ties included (equal use, equal ages, repeated seq numbers), with few users or many."""
    rng = random.Random(users)
    for _ in range(60 if users < 100 else 15):
        queued, running, fair = _random_fair_queue(rng, users)
        assert queue_order(queued, running, CLUSTER, fair) == _fair_order_by_definition(queued, running, fair)
