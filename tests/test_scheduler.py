"""The scheduler's rules, on the pure planning function: priority, reservation, fair share, quotas, slices."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from gpuport.server.scheduler import (
    Cluster,
    Decision,
    Holding,
    Machine,
    Pending,
    Queue,
    Quota,
    Request,
    could_start,
    decided_alike,
    plan,
    queue_order,
)

GiB = 2**30
MACHINE = Machine(gpu_memory=(16 * GiB, 16 * GiB), cpus=2.0, memory=24 * GiB)


def _by_id(decisions: list[Decision]) -> dict[str, Decision]:
    return {d.job_id: d for d in decisions}


def _jobs(owner: str, count: int, request: Request, start: int = 0, priority: int = 0) -> list[Pending]:
    return [Pending(f"{owner}{i}", owner, request, priority, start + i) for i in range(count)]


def test_whole_gpus_start_on_the_lowest_free_ones_and_cpu_jobs_start_at_once() -> None:
    queued = [Pending("a", "u", Request(gpus=1), seq=1), Pending("b", "u", Request(), seq=2)]
    running = [Holding("r", "v", Request(gpus=1), (0,))]
    decisions = _by_id(plan(queued, running, MACHINE))
    assert decisions["a"].gpu_indices == (1,)
    assert decisions["b"].gpu_indices == ()


def test_a_waiting_job_says_what_it_needs_what_is_free_and_how_many_are_ahead() -> None:
    queued = _jobs("alice", 3, Request(gpus=2))
    running = [Holding("r", "bob", Request(gpus=1), (0,))]
    decisions = plan(queued, running, MACHINE)
    assert [d.position for d in decisions] == [1, 2, 3]
    assert decisions[0].reason == "needs 2 GPUs, 1 free"
    assert decisions[2].reason.endswith("2 jobs ahead") and all(d.gpu_indices is None for d in decisions)


def test_priority_goes_first() -> None:
    queued = [*_jobs("low", 2, Request(gpus=1)), Pending("high", "v", Request(gpus=1), priority=5, seq=9)]
    running = [Holding("r", "w", Request(gpus=1), (0,))]
    decisions = plan(queued, running, MACHINE)
    assert decisions[0].job_id == "high" and decisions[0].gpu_indices == (1,)


def test_fair_share_one_users_many_jobs_do_not_starve_anothers_single_job() -> None:
    queued = [*_jobs("alice", 50, Request(gpus=1)), Pending("bob0", "bob", Request(gpus=1), seq=100)]
    order = [p.job_id for p in queue_order(queued, [], MACHINE)]
    assert order.index("bob0") == 1  # bob's one job comes right after alice's first
    # With alice already holding a GPU, bob's job is first.
    running = [Holding("r", "alice", Request(gpus=1), (0,))]
    decisions = plan(queued, running, MACHINE)
    assert decisions[0].job_id == "bob0" and decisions[0].gpu_indices == (1,)


def test_fair_share_counts_what_users_hold_by_their_dominant_share() -> None:
    # carol holds one of two GPUs (share 0.5); dave a 4GiB slice of a 16GiB one (share 0.125): dave first.
    running = [
        Holding("c", "carol", Request(gpus=1), (0,)),
        Holding("d", "dave", Request(gpu_memory=4 * GiB), (1,)),
    ]
    queued = [
        Pending("c1", "carol", Request(gpu_memory=GiB), seq=1),
        Pending("d1", "dave", Request(gpu_memory=GiB), seq=2),
    ]
    assert [p.job_id for p in queue_order(queued, running, MACHINE)] == ["d1", "c1"]


def test_a_large_request_reserves_what_is_free_so_small_ones_cannot_overtake_it_forever() -> None:
    queued = [Pending("big", "alice", Request(gpus=2), seq=1), *_jobs("bob", 3, Request(gpus=1), start=2)]
    running = [Holding("r", "carol", Request(gpus=1), (0,))]
    decisions = plan(queued, running, MACHINE)
    first, *rest = decisions
    assert first.job_id == "big" and first.reserves and first.gpu_indices is None
    assert all(d.gpu_indices is None and "reserved for big" in d.reason for d in rest)
    # When the running job ends, the big one gets both GPUs.
    later = plan([Pending("big", "alice", Request(gpus=2), seq=1, reserved_at=1.0), *queued[1:]], [], MACHINE)
    assert later[0].job_id == "big" and later[0].gpu_indices == (0, 1)


def test_the_reservation_sticks_ahead_of_the_fair_share_order() -> None:
    # alice holds a GPU, so fair share alone would put bob's job first; alice's reserved job stays ahead.
    queued = [
        Pending("big", "alice", Request(gpus=2), seq=1, reserved_at=5.0),
        Pending("b", "bob", Request(gpus=1), seq=2),
    ]
    running = [Holding("r", "alice", Request(gpus=1), (0,))]
    decisions = plan(queued, running, MACHINE)
    assert [d.job_id for d in decisions] == ["big", "b"]
    assert decisions[1].gpu_indices is None


def test_slices_pack_onto_the_fullest_gpu_that_fits_and_leave_whole_gpus_free() -> None:
    running = [Holding("s", "u", Request(gpu_memory=8 * GiB), (1,))]
    queued = [Pending("slice", "u", Request(gpu_memory=6 * GiB), seq=1), Pending("whole", "v", Request(gpus=1), seq=2)]
    decisions = _by_id(plan(queued, running, MACHINE))
    assert decisions["slice"].gpu_indices == (1,)
    assert decisions["whole"].gpu_indices == (0,)


def test_several_slices_share_one_gpu_and_a_slice_too_big_waits() -> None:
    queued = [Pending(f"s{i}", "u", Request(gpu_memory=int(6.4 * GiB)), seq=i) for i in range(5)]
    decisions = _by_id(plan(queued, [Holding("w", "v", Request(gpus=1), (0,))], MACHINE))
    assert decisions["s0"].gpu_indices == decisions["s1"].gpu_indices == (1,)
    assert decisions["s2"].gpu_indices is None
    assert "needs a 6.4GiB GPU slice, at most 3.2GiB free on one" in decisions["s2"].reason
    assert decisions["s3"].gpu_indices is None


def test_a_whole_gpu_is_not_given_while_a_slice_of_it_is_held() -> None:
    running = [Holding("s0", "u", Request(gpu_memory=GiB), (0,)), Holding("s1", "u", Request(gpu_memory=GiB), (1,))]
    decisions = plan([Pending("w", "v", Request(gpus=1), seq=1)], running, MACHINE)
    assert decisions[0].gpu_indices is None and decisions[0].reason == "needs 1 GPU, 0 free"


def test_cpus_and_memory_are_counted_when_asked_for() -> None:
    queued = [
        Pending("a", "u", Request(cpus=1.5), seq=1),
        Pending("b", "u", Request(cpus=1), seq=2),
        Pending("c", "u", Request(memory=30 * GiB), seq=3),
        Pending("d", "u", Request(), seq=4),
    ]
    decisions = _by_id(plan(queued, [], Machine((), 2.0, 24 * GiB)))
    assert decisions["a"].gpu_indices == ()
    assert decisions["b"].gpu_indices is None and "needs 1 CPUs, 0.5 free" in decisions["b"].reason
    assert decisions["c"].gpu_indices is None and "needs 30GiB of memory" in decisions["c"].reason
    assert decisions["d"].gpu_indices == ()  # asks for nothing: shares what is left


def test_quotas_hold_jobs_back_with_their_reason_and_reserve_nothing() -> None:
    queued = [*_jobs("alice", 3, Request(gpus=1)), Pending("bob0", "bob", Request(gpus=1), seq=10)]
    quotas = {"alice": Quota(gpus=1)}
    decisions = _by_id(plan(queued, [], MACHINE, quotas))
    started = [d for d in decisions.values() if d.gpu_indices]
    assert sorted(d.job_id for d in started) == ["alice0", "bob0"]
    assert decisions["alice1"].reason.startswith("over quota: alice holds 1 of 1 GPUs")
    assert not decisions["alice1"].reserves


def test_job_quota_and_the_default_quota_for_everyone() -> None:
    queued = [*_jobs("alice", 3, Request()), *_jobs("bob", 3, Request(), start=10)]
    decisions = _by_id(plan(queued, [], MACHINE, {"*": Quota(jobs=1), "bob": Quota(jobs=2)}))
    assert sum(1 for d in decisions.values() if d.job_id.startswith("alice") and d.gpu_indices == ()) == 1
    assert sum(1 for d in decisions.values() if d.job_id.startswith("bob") and d.gpu_indices == ()) == 2
    assert "over quota: alice runs 1 job" in decisions["alice1"].reason


def test_could_start_tells_when_a_pass_would_start_nothing() -> None:
    full = [Holding("a", "u", Request(gpus=1), (0,)), Holding("b", "u", Request(gpu_memory=15 * GiB), (1,))]
    assert not could_start([Request(gpus=1), Request(gpu_memory=2 * GiB)], full, MACHINE)
    assert could_start([Request(gpus=1), Request(gpu_memory=GiB)], full, MACHINE)
    assert could_start([Request()], full, MACHINE)


def test_the_order_depends_only_on_what_the_store_holds() -> None:
    queued = [*_jobs("alice", 4, Request(gpus=1)), *_jobs("bob", 2, Request(gpus=2), start=10)]
    running = [Holding("r", "alice", Request(gpus=1), (0,))]
    first = plan(queued, running, MACHINE)
    again = plan(list(reversed(queued)), running, MACHINE)
    assert first == again


def test_below_the_memory_floor_only_work_that_reserves_memory_starts() -> None:
    low = "free memory is below the floor"
    queued = [Pending("none", "u", Request(), seq=1), Pending("some", "u", Request(memory=GiB), seq=2)]
    decisions = _by_id(plan(queued, [], MACHINE, low_memory=low))
    assert decisions["none"].gpu_indices is None and decisions["none"].reason == low
    assert not decisions["none"].reserves  # it holds nothing back from others
    assert decisions["some"].gpu_indices == ()
    assert not could_start([Request()], [], MACHINE, low_memory=low)
    assert could_start([Request(), Request(memory=GiB)], [], MACHINE, low_memory=low)
    assert _by_id(plan(queued, [], MACHINE))["none"].gpu_indices == ()  # no floor: it starts


def test_a_job_over_several_nodes_starts_only_when_each_node_has_its_share() -> None:
    cluster = Cluster((("a", Machine((16 * GiB,) * 2, 4, 64 * GiB)), ("b", Machine((16 * GiB,) * 2, 4, 64 * GiB))))
    gang = Pending("gang", "ann", Request(gpus=2, nodes=2), seq=2)
    running = [Holding("one", "bob", Request(gpus=1), (0,), "a")]
    [waiting] = plan([gang], running, cluster)
    assert waiting.gpu_indices is None and waiting.reserves
    assert waiting.reason == "needs 2 nodes with 2 GPUs free, 1 has it"
    [started] = plan([gang], [], cluster)
    assert started.placement == (("a", (0, 1)), ("b", (0, 1))) and (started.node, started.gpu_indices) == ("a", (0, 1))
    # Held, it takes both nodes: a 1-GPU job waits.
    holding = Holding("gang", "ann", Request(gpus=2, nodes=2), (0, 1), "a", started.placement)
    [small] = plan([Pending("small", "bob", Request(gpus=1), seq=3)], [holding], cluster)
    assert small.gpu_indices is None
    # Its share counts both nodes: 4 of the cluster's 4 GPUs.
    assert cluster.gpu_share(Request(gpus=2, nodes=2)) == 4


def _fair_share_by_definition(queued: list[Pending], running: list[Holding], machine: Machine) -> list[Pending]:
    """The queue order as the rules say it, step by step: each priority level from the highest, its
    reserved jobs first (oldest reservation first), then turn by turn the user using least of the
    machine (then the one whose next job is oldest) places their oldest job, their use growing by it
    within the level (what runs and what holds a reservation counts in every level)."""
    cluster = Cluster.of(machine)
    usage: dict[str, float] = {}
    for h in running:
        usage[h.owner] = usage.get(h.owner, 0.0) + cluster.dominant_share(h.request)
    order: list[Pending] = []
    for priority in sorted({p.priority for p in queued}, reverse=True):
        level = [p for p in queued if p.priority == priority]
        reserved = sorted((p for p in level if p.reserved_at is not None), key=lambda p: (p.reserved_at, p.seq))
        order += reserved
        for p in reserved:
            usage[p.owner] = usage.get(p.owner, 0.0) + cluster.dominant_share(p.request)
        rest = sorted((p for p in level if p.reserved_at is None), key=lambda p: p.seq)
        share = dict(usage)
        while rest:
            users = {p.owner for p in rest}
            nxt = {u: next(p for p in rest if p.owner == u) for u in users}
            user = min(users, key=lambda u: (share.get(u, 0.0), nxt[u].seq))
            order.append(nxt[user])
            rest.remove(nxt[user])
            share[user] = share.get(user, 0.0) + cluster.dominant_share(nxt[user].request)
    return order


def test_the_queue_order_is_the_rules_order_on_random_queues() -> None:
    import random

    rng = random.Random(3)
    requests = [Request(gpus=1), Request(gpus=2), Request(gpu_memory=4 * GiB), Request(cpus=1.0), Request()]
    for _ in range(200):
        users = [f"u{i}" for i in range(rng.randint(1, 6))]
        running = [
            Holding(f"r{i}", rng.choice(users), rng.choice(requests[:3]), (i % 2,)) for i in range(rng.randint(0, 3))
        ]
        queued = [
            Pending(
                f"j{s}",
                rng.choice(users),
                rng.choice(requests),
                rng.choice([0, 0, 0, 5]),
                s,
                reserved_at=float(rng.randint(1, 3)) if rng.random() < 0.05 else None,
            )
            for s in range(rng.randint(0, 40))
        ]
        assert queue_order(queued, running, MACHINE) == _fair_share_by_definition(queued, running, MACHINE)


def _random_queue(rng: Any) -> tuple[list[Holding], list[Pending]]:
    """Up to 5 users, up to 2 of the GPUs held, up to 30 jobs of mixed kinds at two priorities."""
    requests = [Request(gpus=1), Request(gpus=2), Request(gpu_memory=4 * GiB), Request(cpus=1.0), Request()]
    users = [f"u{i}" for i in range(rng.randint(1, 5))]
    running = [Holding(f"r{i}", rng.choice(users), Request(gpus=1), (i,)) for i in range(rng.randint(0, 2))]
    queued = [
        Pending(f"j{s}", rng.choice(users), rng.choice(requests), rng.choice([0, 0, 5]), s)
        for s in range(rng.randint(0, 30))
    ]
    return running, queued


def test_a_pass_that_looks_only_so_deep_starts_what_a_whole_pass_starts() -> None:
    import random

    rng = random.Random(5)
    for _ in range(300):
        running, queued = _random_queue(rng)
        quotas = {"u0": Quota(jobs=1)} if rng.random() < 0.3 else None
        low = "low" if rng.random() < 0.2 else ""
        whole = plan(queued, running, MACHINE, quotas, low)
        depth = rng.randint(0, 5)
        bounded = plan(Queue(queued), running, MACHINE, quotas, low, depth=depth)
        assert bounded == whole[: len(bounded)] and len(bounded) >= min(depth, len(whole))
        started = [d for d in whole if d.gpu_indices is not None]
        assert [d for d in bounded if d.gpu_indices is not None] == started
        # Nothing the bounded pass left undecided could have started (the whole pass says so).
        assert all(d.gpu_indices is None for d in whole[len(bounded) :])


def test_past_its_reach_a_pass_starts_no_job_that_asks_for_a_gpu() -> None:
    # Two nodes of two GPUs, one held on each: 2-GPU jobs wait for room (the first reserves node a's
    # free GPU); behind them a 1-GPU job would fit node b's, and a job that asks for no GPU fits anyway.
    node = Machine((16 * GiB,) * 2, 4, 64 * GiB)
    two = Cluster((("a", node), ("b", node)))
    running = [Holding("r0", "x", Request(gpus=1), (0,), "a"), Holding("r1", "x", Request(gpus=1), (0,), "b")]
    queued = [*_jobs("alice", 3, Request(gpus=2)), Pending("bob0", "bob", Request(gpus=1), seq=10)]
    queued += [Pending("bob1", "bob", Request(), seq=11)]
    assert [p.job_id for p in queue_order(queued, running, two)][:2] == ["alice0", "bob0"]
    whole = _by_id(plan(queued, running, two))
    assert whole["bob0"].gpu_indices == (1,) and whole["bob1"].gpu_indices == ()
    # The reservation holds what alice0 waits for; the 1-GPU job fits what is left out of turn, not
    # once a pass goes no further than the first job that waits.
    near = _by_id(plan(queued, running, two, reach=1))
    assert "bob0" not in near and near["bob1"].gpu_indices == ()  # no GPU: it still starts
    assert near["alice0"].reserves and near["alice0"].gpu_indices is None
    # Jobs that wait for a dependency, a quota or their array's cap are not counted.
    blocked = [dataclasses.replace(p, blocked="waits for j0") if p.owner == "alice" else p for p in queued]
    assert _by_id(plan(blocked, running, two, reach=1))["bob0"].gpu_indices == (1,)


def test_a_pass_with_a_reach_decides_as_a_whole_pass_up_to_it() -> None:
    import random

    rng = random.Random(17)
    cut = 0
    for _ in range(300):
        running, queued = _random_queue(rng)
        whole = plan(queued, running, MACHINE)
        reach = rng.randint(1, 6)
        bounded = plan(Queue(queued), running, MACHINE, reach=reach, depth=rng.choice([None, rng.randint(0, 5)]))
        # Up to the reach-th job that waits, the same decisions; after it, no job with a GPU.
        waits = [n for n, d in enumerate(whole) if d.gpu_indices is None]
        if len(waits) < reach:
            assert [d for d in bounded if d.gpu_indices is not None] == [d for d in whole if d.gpu_indices is not None]
            continue
        cut += 1
        upto = waits[reach - 1] + 1
        shown = min(upto, len(bounded))  # a depth may stop it sooner, where nothing behind can start
        assert bounded[:shown] == whole[:shown]
        assert [d for d in bounded[:shown] if d.gpu_indices is not None] == [
            d for d in whole[:upto] if d.gpu_indices is not None
        ]
        gpu = {p.job_id for p in queued if p.request.gpus or p.request.gpu_memory}
        assert not any(d.job_id in gpu for d in bounded[upto:])
    assert cut > 100


def test_the_queue_kept_across_passes_orders_as_a_fresh_one() -> None:
    import random

    rng = random.Random(7)
    queue, alive = Queue(), {}
    for step in range(2000):
        if alive and rng.random() < 0.4:
            gone = rng.choice(sorted(alive))
            assert queue.pop(gone) == alive.pop(gone)
        else:
            seq = rng.randint(0, 10_000)  # a job queued again keeps its (older) place
            reserved = float(step) if rng.random() < 0.05 else None
            owner, request = f"u{rng.randint(0, 6)}", Request(gpus=rng.randint(0, 2))
            job = Pending(f"j{step}", owner, request, rng.choice([0, 3]), seq, reserved)
            queue.add(job)
            alive[job.job_id] = job
        if step % 100 == 0:
            assert queue_order(queue, [], MACHINE) == queue_order(list(alive.values()), [], MACHINE)
            assert len(queue) == len(alive) and sum(queue.kinds().values()) == len(alive)
    replaced = dataclasses.replace(next(iter(alive.values())), reserved_at=1e9)
    queue.add(replaced)  # the same id again: replaced, not added
    assert len(queue) == len(alive) and queue[replaced.job_id] == replaced


def test_a_submit_behind_a_settled_pass_is_decided_alike_without_one() -> None:
    """What lets a submit into a deep queue skip its pass: whenever ``decided_alike`` says so, a
    pass with the new job queued decides exactly what the last pass did, and nothing for the job."""
    import random

    rng = random.Random(11)
    requests = [Request(gpus=1), Request(gpus=2), Request(gpu_memory=4 * GiB), Request(cpus=1.0), Request()]
    taken = skipped = 0
    for _ in range(400):
        users = [f"u{i}" for i in range(rng.randint(1, 3))]
        running = [Holding(f"r{i}", rng.choice(users), Request(gpus=1), (i,)) for i in range(rng.randint(1, 2))]
        kinds = rng.sample(requests, rng.randint(1, 3))
        queued = Queue(
            Pending(f"j{s}", rng.choice(users), rng.choice(kinds), rng.choice([0, 0, 0, 5]), s)
            for s in range(rng.randint(0, 60))
        )
        quotas = {"u0": Quota(jobs=1)} if rng.random() < 0.2 else None
        low = "low" if rng.random() < 0.2 else ""
        depth = rng.randint(1, 8)
        reach = rng.choice([None, None, rng.randint(1, 10)])  # the server's is REACH
        for _ in range(3):  # as the server does: a pass records its reservation, the next one settles
            decisions = plan(queued, running, MACHINE, quotas, low, depth, reach=reach)
            fresh = [d for d in decisions if d.reserves and queued[d.job_id].reserved_at is None]
            for d in fresh:
                queued.add(dataclasses.replace(queued[d.job_id], reserved_at=1.0))
            if not fresh:
                break
        if fresh or any(d.gpu_indices is not None for d in decisions):
            continue  # not settled: a submit runs its own pass
        decided = Counter(queued[d.job_id].request for d in decisions)
        seq = len(queued) + 100
        for _ in range(5):  # submits in a row, each behind the last
            seq += 1
            # Mostly the kinds queued, and the owner with most jobs queued: what makes a deep queue.
            owner = max(users, key=lambda u: sum(p.owner == u for p in queued.values())) if rng.random() < 0.7 else None
            request = rng.choice(kinds if rng.random() < 0.8 else requests)
            job = Pending(f"n{seq}", owner or rng.choice(users), request, rng.choice([0, 0, 0, 5]), seq)
            alike = decided_alike(job, queued, decided, depth)
            queued.add(job)
            if not alike:
                skipped += 1
                break
            taken += 1
            assert plan(queued, running, MACHINE, quotas, low, depth, reach=reach) == decisions
    assert taken > 100 and skipped > 50  # both ways, often
