"""Where another user's launch loses its time beside one user's six launches at once: a probe.

    .venv/bin/python bench/probe_launch_flood.py [--launches 8] [--keep DIR]   # about a minute
    .venv/bin/python bench/probe_launch_flood.py --analyse DIR                  # again, from DIR

One server (as bench_hostile.py starts it). The victim launches ``true`` N times on the quiet server,
then N times while a second user, mallory, launches six at once again and again (bench_hostile's
launch flood). Each victim launch is cut into phases by the kernel's own record of its processes
(``perf sched record``, CLOCK_MONOTONIC, the same clock as the client's): submit to the server's fork
of the job's supervisor (the server's own work), the supervisor's start until it spawns bubblewrap,
bubblewrap until the job's command (``true``) runs (namespaces, mounts, slirp4netns), the command's
end until the client saw it (the server noticing, the client's wait). For each phase, each of the
victim's processes' time on a CPU, its run delay (runnable, waiting for a CPU), its sleep (S: waiting
for an event) and its blocked time (D: uninterruptible, a kernel lock or I/O), summed over its
processes (several at once: more than the phase's wall time); then who had the CPUs from the
supervisor's fork to the job's end: the victim's job, mallory's jobs, the server, the two clients,
kernel threads, the rest of the machine. Prints medians, quiet against flooded (a preempted task's
wait counts as run delay: perf's timehist shows it as a wait). Needs root and ``perf``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PHASES = ("server", "supervisor", "sandbox", "job", "after")


def _tree(script: str) -> tuple[dict[int, int], dict[int, float], dict[int, list[tuple[float, str]]], dict[int, float]]:
    """From ``perf script --show-task-events``: parent of each pid, its fork time, its comms (exec), its exit."""
    parent: dict[int, int] = {}
    forked: dict[int, float] = {}
    comms: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    exited: dict[int, float] = {}
    fork = re.compile(
        r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[\d+\]\s+([\d.]+):\s+PERF_RECORD_FORK\((\d+):(\d+)\):\((\d+):(\d+)\)"
    )
    comm = re.compile(
        r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[\d+\]\s+([\d.]+):\s+PERF_RECORD_COMM(?: exec)?: (.*?):(\d+)/(\d+)"
    )
    ex = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[\d+\]\s+([\d.]+):\s+PERF_RECORD_EXIT\((\d+):(\d+)\)")
    for line in script.splitlines():
        if m := fork.match(line):
            child_pid, child_tid, parent_pid = int(m[5]), int(m[6]), int(m[7])
            if child_pid == child_tid:  # a process, not a thread
                parent[child_pid] = parent_pid
                forked[child_pid] = float(m[4])
        elif m := comm.match(line):
            if int(m[6]) == int(m[7]):
                comms[int(m[6])].append((float(m[4]), m[5]))
        elif (m := ex.match(line)) and int(m[5]) == int(m[6]):
            exited[int(m[5])] = float(m[4])
    return parent, forked, comms, exited


def _switches(timehist: str) -> list[tuple[float, int, int, float, float, float, str]]:
    """``perf sched timehist --state`` lines: (time, pid, tid, wait, delay, run, state at switch-out), ms."""
    rows = []
    line_re = re.compile(r"^\s*([\d.]+)\s+\[\d+\]\s+(.*?)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)")
    for line in timehist.splitlines():
        if m := line_re.match(line):
            tid = int(m[3])
            pid = int(m[4]) if m[4] else tid
            rows.append((float(m[1]), pid, tid, float(m[5]), float(m[6]), float(m[7]), m[8]))
    return rows


def _spent(rows: list, tids: set[int], start: float, end: float) -> dict[str, float]:
    """CPU, run delay, sleep (S) and blocked (D) ms of ``tids`` in [start, end] (a switch-out's time
    decides; its wait counts under the state of the task's previous switch-out)."""
    out = {"cpu": 0.0, "delay": 0.0, "sleep": 0.0, "blocked": 0.0}
    last_state: dict[int, str] = {}
    for t, _pid, tid, wait, delay, run, state in rows:
        if tid not in tids:
            continue
        if start <= t <= end:
            out["cpu"] += run
            out["delay"] += delay
            before = last_state.get(tid, "S")  # preempted (R): its wait was for a CPU too
            out["delay" if before.startswith("R") else "blocked" if before.startswith("D") else "sleep"] += wait
        last_state[tid] = state
    return out


def _family(children: dict[int, list[int]], root: int) -> set[int]:
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def analyse(keep: Path) -> None:
    """Print the phases of the victim's launches and who had the CPUs meanwhile, from a probe's files."""
    from _report import say

    launches, supervisors, server_pid = json.loads((keep / "launches.json").read_text())
    parent, forked, comms, exited = _tree((keep / "script.txt").read_text())
    timehist = (keep / "timehist.txt").read_text()
    rows = _switches(timehist)
    names = {}
    for m in re.finditer(r"^\s*[\d.]+\s+\[\d+\]\s+(.*?)\[(\d+)(?:/(\d+))?\]", timehist, re.MULTILINE):
        names[int(m[3] or m[2])] = m[1].strip()
    tids_of: dict[int, set[int]] = collections.defaultdict(set)
    for _t, pid, tid, *_ in rows:
        tids_of[pid].add(tid)
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, up in parent.items():
        children[up].append(child)
    jobs = _family(children, server_pid) - {server_pid}
    probe = parent.get(server_pid, -1)
    clients = _family(children, probe) - _family(children, server_pid) - {probe}  # mallory's flood
    table: dict[str, dict[str, list[float]]] = {"quiet": collections.defaultdict(list), "flood": collections.defaultdict(list)}  # fmt: skip
    whom: dict[str, collections.Counter[str]] = {"quiet": collections.Counter(), "flood": collections.Counter()}
    for kind, job_id, start, end in launches:
        sup = supervisors[job_id]
        family = _family(children, sup)
        bwrap = min((p for p in children.get(sup, []) if any(c == "bwrap" for _, c in comms.get(p, []))), default=None,
                    key=lambda p: forked[p])  # fmt: skip
        ran = [p for p in family if any(c == "true" for _, c in comms.get(p, []))]
        true_at = min((t for p in ran for t, c in comms[p] if c == "true"), default=None)
        true_end = max((exited.get(p, 0.0) for p in ran), default=0.0)
        if sup not in forked or bwrap is None or true_at is None or not true_end:
            say(f"  {job_id}: incomplete record, left out")
            continue
        cuts = [start, forked[sup], forked[bwrap], true_at, true_end, end]
        row = table[kind]
        row["total"].append((end - start) * 1e3)
        tids = {t for p in family for t in tids_of.get(p, {p})}
        for name, a, b in zip(PHASES, cuts, cuts[1:]):
            row[name].append((b - a) * 1e3)
            for what, ms in _spent(rows, tids, a, b).items():
                row[f"{name}.{what}"].append(ms)
        a, b = forked[sup], true_end  # from the supervisor's fork to the job's end: who had the CPUs
        for t, pid, _tid, _wait, _delay, run, _state in rows:
            if not a <= t <= b:
                continue
            name = names.get(pid, "")
            if pid in family:
                who = "the victim's job (supervisor, bwrap, slirp4netns, true)"
            elif pid == server_pid:
                who = "the server"
            elif pid in jobs:
                who = "mallory's jobs (their supervisors, bwrap, ...)"
            elif pid in clients:
                who = "mallory's client"
            elif pid == probe:
                who = "the victim's client"
            elif name.startswith(("kworker", "ksoftirq", "rcu", "migration", "kthreadd")):
                who = "kernel threads"
            else:
                who = "the rest of the machine (other people's work)"
            whom[kind][who] += run
        whom[kind]["(2 CPUs over the window)"] += (b - a) * 2e3
    count = {kind: len(table[kind]["total"]) for kind in table}
    say(
        f"the victim's launch, phase by phase (ms, medians over {count['quiet']} quiet / {count['flood']} flooded launches)"
    )
    say("  phase                              wall          CPU    run delay        sleep  blocked (D)")
    labels = {"total": "submit to seen ended", "server": "submit to the supervisor's fork", "supervisor": "supervisor until bubblewrap",
              "sandbox": "bubblewrap until `true` runs", "job": "`true`", "after": "its end until the client saw it"}  # fmt: skip
    for phase, label in labels.items():
        cells = []
        for what in ("", ".cpu", ".delay", ".sleep", ".blocked"):
            q, f = table["quiet"].get(phase + what), table["flood"].get(phase + what)
            cells.append(f"{statistics.median(q):5.0f} |{statistics.median(f):5.0f}" if q and f else "")
        say(f"  {label:<32} " + "  ".join(f"{c:>11}" for c in cells))
    say("who had the CPUs from the victim's supervisor's fork to its job's end (CPU ms per launch, mean)")
    for who in sorted(whom["flood"], key=lambda w: -whom["flood"][w]):
        q, f = whom["quiet"][who] / max(1, count["quiet"]), whom["flood"][who] / max(1, count["flood"])
        say(f"  {who:<56} {q:7.1f} | {f:7.1f}")


def main() -> None:
    from _report import connect, gpuport_server, isolated_workdir, say
    from bench_hostile import flood

    import gpuport

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=8, help="victim launches, quiet and flooded each")
    parser.add_argument("--keep", default="", help="a folder to keep perf's data and its reports in")
    parser.add_argument("--analyse", default="", help="only print what a kept folder holds")
    args = parser.parse_args()
    if args.analyse:
        analyse(Path(args.analyse))
        return
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with isolated_workdir() as work, gpuport_server(work, "probe") as server, connect(server) as admin:
        keep = Path(args.keep) if args.keep else work / "kept"
        keep.mkdir(parents=True, exist_ok=True)
        mallory = admin.create_token("mallory").token
        victim_token = admin.create_token("victim").token
        jobs_dir = server.state_dir / "jobs"
        data = keep / "sched.data"
        with gpuport.connect(server.url, victim_token, fingerprint=server.fingerprint) as client:
            client.submit(["true"], workdir=None).wait(60)  # warm
            perf = subprocess.Popen(
                ["perf", "sched", "record", "-k", "CLOCK_MONOTONIC", "-a", "-o", str(data)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
            launches: list[tuple[str, str, float, float]] = []  # (kind, job id, submit, seen ended)

            def victim(kind: str) -> None:
                for _ in range(args.launches):
                    start = time.monotonic()
                    job = client.submit(["true"], workdir=None)
                    job.wait(120)
                    launches.append((kind, job.id, start, time.monotonic()))
                    time.sleep(0.05)

            victim("quiet")
            with flood("launches", server.url, server.fingerprint, token=mallory) as counts:
                time.sleep(1.0)
                victim("flood")
            time.sleep(0.5)
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
            say(f"mallory's flood: {counts}")
            supervisors = {}
            for _kind, job_id, _s, _e in launches:
                supervisors[job_id] = json.loads((jobs_dir / job_id / "supervisor.json").read_text())["pid"]
            (keep / "launches.json").write_text(json.dumps([launches, supervisors, server.process.pid]))
        script = subprocess.run(
            ["perf", "script", "-i", str(data), "--show-task-events", "-F", "comm,pid,tid,cpu,time,event"],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        (keep / "script.txt").write_text(script)
        timehist = subprocess.run(
            ["perf", "sched", "timehist", "-i", str(data), "--state"], capture_output=True, text=True, check=False
        ).stdout
        (keep / "timehist.txt").write_text(timehist)
        analyse(keep)


if __name__ == "__main__":
    main()
