"""The small supervisor that runs one job, detached from the server.

Started as ``python -I -S supervisor.py JOB_DIR`` in its own session: it needs only the standard
library, so it starts in a few milliseconds, and it outlives a server that is killed or restarted.
It reads ``JOB_DIR/spec.json``, runs the command in its own process group with stdout and stderr
going to ``JOB_DIR/log``, and writes ``JOB_DIR/exit.json`` (atomically) when the command ends.

While it runs it holds an exclusive ``flock`` on ``JOB_DIR/supervisor.lock``: a restarted server
knows the job is still running when it cannot take that lock, with no pid-reuse guesswork.
SIGTERM (cancel) is passed to the job's process group; after the grace period, SIGKILL follows.
A job past its time limit is stopped the same way, by the supervisor itself (so the limit holds
while no server runs), and exit.json says ``timed_out``.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time


def _write_json(path, data, durable=True):
    temp = f"{path}.tmp"
    with open(temp, "w") as f:
        json.dump(data, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(temp, path)


def main(job_dir):
    lock = open(os.path.join(job_dir, "supervisor.lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another supervisor runs this job", file=sys.stderr)
        return 1
    with open(os.path.join(job_dir, "spec.json")) as f:
        spec = json.load(f)
    log = open(os.path.join(job_dir, "log"), "ab", buffering=0)
    started_at = time.time()
    status = {"started_at": started_at}
    grace = float(spec.get("grace", 5.0))
    running = []

    def kill(signum, frame):
        for child in running:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def terminate(signum, frame):
        status["cancelled"] = True
        for child in running:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        signal.signal(signal.SIGALRM, kill)
        signal.setitimer(signal.ITIMER_REAL, grace)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    try:
        child = subprocess.Popen(
            spec["argv"],
            cwd=spec["cwd"],
            env=spec["env"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so that cancel reaches every process it starts
        )
    except OSError as e:
        log.write(f"gpuport: cannot start {spec['argv'][0]!r}: {e.strerror}\n".encode())
        status.update(exit_code=127, ended_at=time.time(), error=f"cannot start {spec['argv'][0]!r}: {e.strerror}")
        _write_json(os.path.join(job_dir, "exit.json"), status)
        return 0
    running.append(child)
    if status.get("cancelled"):  # cancelled while it was being started
        terminate(signal.SIGTERM, None)
    info = {"pid": os.getpid(), "child": child.pid, "started_at": started_at}
    _write_json(os.path.join(job_dir, "supervisor.json"), info, durable=False)  # read only while it runs
    time_limit = float(spec.get("time_limit") or 0)
    if time_limit > 0:
        try:
            child.wait(timeout=max(0.0, started_at + time_limit - time.time()))
        except subprocess.TimeoutExpired:
            status["timed_out"] = True
            terminate(signal.SIGTERM, None)
            status.pop("cancelled", None)
    code = child.wait()
    signal.setitimer(signal.ITIMER_REAL, 0)
    try:  # what the job left behind in its group would hold the GPU and the log open
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    status.update(exit_code=code, ended_at=time.time())
    _write_json(os.path.join(job_dir, "exit.json"), status)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
