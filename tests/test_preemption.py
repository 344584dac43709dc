"""Preemption that resumes, and retries on one machine (issue 36, points 3 and 4).

The choice of victims is the scheduler's pure ``preempt``, tested directly; the rest runs on a real
server with fake GPUs: a Keras job preempted by a higher-priority job resumes from its checkpoint, a
job that ignores SIGTERM is killed after its grace period and still queued again, a job not marked
preemptible is never touched, and exit codes are retried only when named."""

from __future__ import annotations

import random
import sqlite3
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

import gpuport
from gpuport.protocol.errors import InvalidRequest
from gpuport.server import scheduler
from gpuport.server.scheduler import Cluster, FairShare, Holding, Machine, Pending, Queue, Quota, Request, preempt
from tests.conftest import RunningServer, server_env, start_server

GiB = 2**30
ONE_GPU = Request(gpus=1)
MACHINE = Cluster.of(Machine(gpu_memory=(16 * GiB,) * 2, cpus=8.0, memory=64 * GiB))
NOW = 1_000_000.0
AFTER = 600.0


def _running(job_id: str, owner: str, gpu: int, priority: int = 0, preemptible: bool = True) -> Holding:
    return Holding(job_id, owner, ONE_GPU, (gpu,), priority=priority, preemptible=preemptible)


def _waiting(job_id: str, owner: str, priority: int = 0, waited: float = AFTER + 1, gpus: int = 1) -> Pending:
    return Pending(job_id, owner, Request(gpus=gpus), priority, created_at=NOW - waited)


def test_a_higher_priority_job_that_waited_long_enough_preempts_a_preemptible_one() -> None:
    running = [_running("old", "bob", 0), _running("new", "bob", 1)]
    assert preempt([_waiting("hi", "alice", priority=5)], running, MACHINE, NOW, AFTER) == [("new", "hi")]
    # Not before it has waited --preempt-after.
    assert preempt([_waiting("hi", "alice", priority=5, waited=AFTER - 1)], running, MACHINE, NOW, AFTER) == []
    # Enough for a 2-GPU job: both.
    victims = preempt([_waiting("hi", "alice", priority=5, gpus=2)], running, MACHINE, NOW, AFTER)
    assert sorted(victims) == [("new", "hi"), ("old", "hi")]


def test_jobs_not_marked_preemptible_are_never_chosen() -> None:
    running = [_running("a", "bob", 0, preemptible=False), _running("b", "bob", 1, priority=-5, preemptible=False)]
    assert preempt([_waiting("hi", "alice", priority=50)], running, MACHINE, NOW, AFTER) == []
    # One preemptible is not enough for two GPUs: nothing is stopped for nothing.
    running[1] = _running("b", "bob", 1, priority=-5)
    assert preempt([_waiting("hi", "alice", priority=50, gpus=2)], running, MACHINE, NOW, AFTER) == []


def test_at_the_same_priority_only_a_user_under_their_share_preempts() -> None:
    running = [_running("b1", "bob", 0), _running("b2", "bob", 1)]
    fair = FairShare(used={"bob": 0.5}, now=NOW)
    assert preempt([_waiting("a", "alice")], running, MACHINE, NOW, AFTER, fair) == [("b2", "a")]
    # Bob does not preempt himself, nor a user who has used more than him.
    assert preempt([_waiting("b3", "bob")], running, MACHINE, NOW, AFTER, fair) == []
    heavy = FairShare(used={"alice": 5.0, "bob": 0.5}, now=NOW)
    assert preempt([_waiting("a", "alice")], running, MACHINE, NOW, AFTER, heavy) == []
    # A lower priority never preempts, whatever the shares.
    assert preempt([_waiting("a", "alice", priority=-1)], running, MACHINE, NOW, AFTER, fair) == []


def test_jobs_already_stopping_count_as_free_and_one_victim_serves_one_waiting_job() -> None:
    running = [_running("b1", "bob", 0), _running("b2", "bob", 1)]
    waiting = [_waiting("h1", "alice", priority=5), _waiting("h2", "carol", priority=5)]
    assert sorted(preempt(waiting, running, MACHINE, NOW, AFTER)) == [("b1", "h2"), ("b2", "h1")]
    # b2 is already being stopped (for h1): only b1 is chosen now, for h2.
    assert preempt(waiting, running, MACHINE, NOW, AFTER, stopping={"b2"}) == [("b1", "h2")]


def test_the_fewest_victims_are_those_trying_one_more_at_a_time_finds_on_random_queues() -> None:
    """``preempt`` finds the fewest victims by halving the candidates: the same victims, for the same
    jobs, as trying one more candidate at a time (the first version, kept here), on random queues
    of whole-GPU, multi-GPU, slice and CPU jobs over several nodes, with priorities and fair shares."""
    rng = random.Random(36)
    cluster = Cluster(tuple((f"n{k}", Machine((16 * GiB,) * 4, 8.0, 64 * GiB)) for k in range(3)))
    requests = [Request(gpus=1), Request(gpus=2), Request(gpus=4), Request(gpu_memory=4 * GiB), Request(cpus=2.0)]
    found = 0
    for _ in range(300):
        users = [f"u{i}" for i in range(rng.randint(1, 6))]
        running, free = [], {name: list(range(4)) for name, _ in cluster.nodes}
        for i in range(rng.randint(0, 14)):
            node = rng.choice(sorted(free))
            gpus = rng.choice([1, 1, 2])
            if len(free[node]) < gpus:
                continue
            taken = tuple(free[node][:gpus])
            del free[node][:gpus]
            running.append(
                Holding(f"r{i}", rng.choice(users), Request(gpus=gpus), taken, node, priority=rng.choice([0, 0, -1]),
                        preemptible=rng.random() < 0.8)
            )  # fmt: skip
        waiting = [
            Pending(f"w{s}", rng.choice(users), rng.choice(requests), rng.choice([0, 0, 5]), s,
                    created_at=NOW - rng.choice([AFTER + 1, AFTER - 1, 3 * AFTER]))
            for s in range(rng.randint(0, 12))
        ]  # fmt: skip
        fair = FairShare({u: rng.random() for u in users}, {u: float(rng.randint(1, 3)) for u in users}, NOW, 1.0)
        for share in (fair, None):
            victims = preempt(waiting, running, cluster, NOW, AFTER, share)
            assert victims == _preempt_one_at_a_time(waiting, running, cluster, NOW, AFTER, share)
            found += len(victims)
    assert found > 100  # victims found, often


def _preempt_one_at_a_time(
    queued: Queue | Iterable[Pending],
    running: Sequence[Holding],
    machine: Machine | Cluster,
    now: float,
    after: float,
    fair: FairShare | None = None,
    quotas: Mapping[str, Quota] | None = None,
    stopping: Iterable[str] = (),
    depth: int = scheduler.LOOK_AHEAD,
) -> list[tuple[str, str]]:
    """``preempt`` as it was first written: each candidate victim tried one more at a time."""
    machine = Cluster.of(machine)
    queue = queued if isinstance(queued, Queue) else Queue(queued)
    stopping = set(stopping)
    holding = [h for h in running if h.job_id not in stopping]  # grows by the jobs that would start
    if not any(h.preemptible for h in holding):
        return []
    usage, share_of = scheduler._usage(holding, machine)
    quotas = quotas or {}
    victims: list[tuple[str, str]] = []

    def standing(user: str, held: float) -> float:
        shares = fair.shares_of(user) if fair is not None else 1.0
        return ((fair.used.get(user, 0.0) if fair is not None else 0.0) + held) / shares

    free: scheduler._Free | None = None  # what ``holding`` leaves free: worked out again only when it changes
    without: dict[str, float] = {}  # a running job → its owner's standing without it, while ``usage`` holds
    for position, job in enumerate(queue.order(usage, share_of, fair)):
        if position >= depth:
            break
        if job.blocked or not job.created_at or now - job.created_at < after:
            continue
        if free is None:
            free = scheduler._initial_free(machine, holding)
        fits = free.fit_all(job.request)
        if fits is not None:  # it starts at the next pass, in what is free (or being freed)
            holding.append(scheduler._held(job, fits))
            free = None
            continue
        if scheduler._over_quota(job, free, quotas.get(job.owner, quotas.get("*")), machine):
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
        chosen: list[int] = []
        for i in candidates:
            chosen.append(i)
            left = [h for k, h in enumerate(holding) if k not in chosen]
            if scheduler._initial_free(machine, left).fit_all(job.request) is not None:
                break
        else:
            continue  # even all of them would not make room
        free = None
        without.clear()
        for i in chosen:
            victims.append((holding[i].job_id, job.job_id))
            usage[holding[i].owner] -= share_of(holding[i].request)
        holding = [h for k, h in enumerate(holding) if k not in chosen]
        fits = scheduler._initial_free(machine, holding).fit_all(job.request)
        assert fits is not None
        # The job now holds what it made room for: a job behind it cannot take the same victims' room.
        holding.append(scheduler._held(job, fits))
        usage[job.owner] = usage.get(job.owner, 0.0) + share_of(job.request)
    return victims


# ---- on a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preempting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server with one fake GPU that preempts for a job after it waited 1 s."""
    running = start_server(
        tmp_path_factory.mktemp("state") / "gpuport",
        "--preempt-after",
        "1s",
        env=server_env(GPUPORT_FAKE_GPUS="1x16GiB"),
    )
    yield running
    running.stop()


@pytest.fixture
def client(preempting: RunningServer) -> Iterator[gpuport.Client]:
    with preempting.connect() as c:
        yield c


def _log(job: gpuport.Job) -> str:
    return "\n".join(job.logs())


def _wait_for(predicate, what: str, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


KERAS_JOB = """
import os, signal, sys, time
import numpy as np
import keras
import gpuport

EPOCHS = 6
saved = os.path.join("ckpt", "epochs.txt")

class Note(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        print("epoch-begin", epoch, flush=True)
        time.sleep(1.0)

    def on_epoch_end(self, epoch, logs=None):
        with open(saved, "a") as f:
            f.write(f"{epoch}\\n")
        print("epoch-end", epoch, flush=True)
        if gpuport.preempted():
            sys.exit(0)  # queued again all the same: the server preempted it

# Stop at a safe point, not mid-write: the SIGTERM is noted, and the job ends once the epoch is saved.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
gpuport.on_preempt(lambda: print("preempted", flush=True))
os.makedirs("ckpt", exist_ok=True)
x, y = np.random.rand(64, 4), np.random.rand(64, 1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
# BackupAndRestore before Note: an epoch noted as ended has been saved.
model.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=[keras.callbacks.BackupAndRestore("ckpt/backup"), Note()])
with open(saved) as f, open(os.path.join(os.environ["GPUPORT_OUTPUT_DIR"], "epochs.txt"), "w") as out:
    out.write(f.read())
print("done", flush=True)
"""


def test_a_keras_job_preempted_by_a_higher_priority_job_resumes_at_the_epoch_it_reached(
    client: gpuport.Client, tmp_path: Path
) -> None:
    pytest.importorskip("keras")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(KERAS_JOB)
    job = client.submit(
        [sys.executable, "train.py"], workdir=work, gpus=1, preemptible=True, checkpoint="ckpt", name="keras"
    )
    _wait_for(lambda: "epoch-end 1" in _log(job), "two epochs")
    urgent = client.submit([sys.executable, "-c", "print('urgent')"], workdir=work, gpus=1, priority=10)
    assert urgent.wait(timeout=120).info.state == "succeeded"
    info = job.wait(timeout=300).info
    assert info.state == "succeeded", _log(job)
    assert info.preemptions == 1
    log = _log(job)  # the last run's
    first = int(log.split("epoch-begin ", 1)[1].split()[0])
    assert first >= 2, log  # it resumed where the first run stopped, not at epoch 0
    out = tmp_path / "out"
    job.download(out)
    epochs = [int(e) for e in (out / "epochs.txt").read_text().split()]
    assert epochs == list(range(6)), epochs  # every epoch ran to its end once, over both runs
    listed = client.jobs(name="keras")
    assert [j.info.preemptions for j in listed] == [1]


def test_a_job_that_ignores_sigterm_is_killed_after_its_grace_and_still_queued_again(
    client: gpuport.Client, tmp_path: Path
) -> None:
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('term, preempted file:', open(os.environ["
        "'GPUPORT_PREEMPTED_FILE']).read().strip(), flush=True))\n"
        "os.makedirs('ckpt', exist_ok=True)\n"
        "runs = len(os.listdir('ckpt'))\n"
        "open(f'ckpt/run{runs}', 'w').close()\n"
        "print('run', runs, flush=True)\n"
        "if runs == 0:\n"
        "    while True: time.sleep(0.1)\n"
    )
    stubborn = client.submit([sys.executable, "-c", script], workdir=tmp_path, gpus=1, priority=-1, checkpoint="ckpt")
    assert stubborn.info.preemptible  # the default below priority 0
    _wait_for(lambda: "run 0" in _log(stubborn), "the job to start")
    urgent = client.submit([sys.executable, "-c", "print('urgent')"], workdir=tmp_path, gpus=1)
    assert urgent.wait(timeout=120).info.state == "succeeded"
    info = stubborn.wait(timeout=120).info
    assert info.state == "succeeded" and info.preemptions == 1
    assert "run 1" in _log(stubborn)  # the second run found the first run's checkpoint folder


def test_the_checkpoint_of_a_job_cancelled_while_queued_again_is_discarded(
    preempting: RunningServer, client: gpuport.Client, tmp_path: Path
) -> None:
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "os.makedirs('ckpt', exist_ok=True)\n"
        "open('ckpt/state', 'w').write('saved')\n"
        "print('saved', flush=True)\n"
        "while True: time.sleep(0.1)\n"
    )
    victim = client.submit([sys.executable, "-c", script], workdir=tmp_path, gpus=1, priority=-1, checkpoint="ckpt")
    _wait_for(lambda: "saved" in _log(victim), "the job to save its checkpoint")
    holder = client.submit(["sleep", "120"], workdir=None, gpus=1)  # not preemptible: the victim stays queued

    def kept() -> str:
        with sqlite3.connect(preempting.state_dir / "gpuport.db") as db:
            row = db.execute(
                "SELECT state, json_extract(spec, '$.checkpoint_snapshot') FROM jobs WHERE id = ?", (victim.id,)
            )
            state, snapshot = row.fetchone()
        return snapshot if state == "queued" and snapshot else ""

    snapshot = _wait_for(kept, "the victim queued again with its checkpoint kept")
    try:
        victim.cancel()
        with sqlite3.connect(preempting.state_dir / "gpuport.db") as db:
            left = db.execute("SELECT COUNT(*) FROM snapshots WHERE id = ?", (snapshot,)).fetchone()[0]
        assert left == 0  # its next run will not be: the checkpoint is not kept for it
    finally:
        holder.cancel()
        holder.wait(timeout=60)


def test_a_job_not_marked_preemptible_is_never_touched(client: gpuport.Client, tmp_path: Path) -> None:
    steady = client.submit(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(6)"],
        workdir=tmp_path,
        gpus=1,
        priority=-5,
        preemptible=False,
    )
    _wait_for(lambda: "up" in _log(steady), "the job to start")
    urgent = client.submit([sys.executable, "-c", "print('urgent')"], workdir=tmp_path, gpus=1, priority=10)
    info = steady.wait(timeout=120).info
    assert info.state == "succeeded" and info.preemptions == 0
    assert urgent.wait(timeout=120).info.state == "succeeded"
    assert urgent.refresh().started_at >= info.ended_at


def test_exit_codes_named_by_retry_on_exit_are_retried_and_others_are_not(
    client: gpuport.Client, tmp_path: Path
) -> None:
    # Exits 3 on its first two runs (it counts them in its checkpoint folder), then 0.
    script = (
        "import os, sys\n"
        "os.makedirs('ckpt', exist_ok=True)\n"
        "runs = len(os.listdir('ckpt'))\n"
        "open(f'ckpt/run{runs}', 'w').close()\n"
        "sys.exit(3 if runs < 2 else 0)\n"
    )
    retried = client.submit(
        [sys.executable, "-c", script], workdir=tmp_path, retries=2, retry_on_exit=[3], checkpoint="ckpt"
    )
    info = retried.wait(timeout=120).info
    assert info.state == "succeeded" and info.retried == 2
    # Not named: it fails at once, whatever its retries.
    other = client.submit([sys.executable, "-c", "raise SystemExit(4)"], workdir=tmp_path, retries=2, retry_on_exit=[3])
    info = other.wait(timeout=120).info
    assert info.state == "failed" and info.exit_code == 4 and info.retried == 0
    # More failures than retries: it fails with the last one.
    spent = client.submit([sys.executable, "-c", "raise SystemExit(3)"], workdir=tmp_path, retries=1, retry_on_exit=[3])
    info = spent.wait(timeout=120).info
    assert info.state == "failed" and info.exit_code == 3 and info.retried == 1
    with pytest.raises(InvalidRequest, match="--retries"):
        client.submit([sys.executable, "-c", "pass"], workdir=tmp_path, retry_on_exit=[3])
