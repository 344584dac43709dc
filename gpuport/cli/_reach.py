"""Reaching a running job: ``forward`` (a port of it, here) and ``exec`` (a command in it)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator

import click

from gpuport.cli._common import client
from gpuport.cli._output import err, escape


@click.command("forward")
@click.argument("job_id", metavar="JOB")
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--local", "local_port", type=click.IntRange(0, 65535), default=0, help="The port here (default: PORT).")
@click.pass_context
def forward_command(ctx: click.Context, job_id: str, port: int, local_port: int) -> None:
    """Reach PORT of a running job (a server on its own loopback: TensorBoard, Jupyter, a debugger)
    at 127.0.0.1 here, until Ctrl-C or the job's end. JOB is its id or name; yours only."""
    from gpuport.client._reach import Forward
    from gpuport.protocol.errors import ConnectionFailed

    gpu = client(ctx)
    try:
        forward = Forward(gpu.transport, job_id, port, local_port or port)
    except ConnectionFailed as e:  # PORT is taken here: any free one then, unless --local asked for it
        if local_port or "cannot listen" not in str(e):
            raise
        forward = Forward(gpu.transport, job_id, port, 0)
    with forward:
        print(f"forwarding 127.0.0.1:{forward.local_port} -> {forward.job.id}:{port}", flush=True)
        try:
            forward.wait()
        except KeyboardInterrupt:
            ctx.exit(130)
        err.print(escape(f"forward closed: {forward.why}"))


@click.command("exec", context_settings={"allow_interspersed_args": False})
@click.option("--interactive", "-i", is_flag=True, help="Pass stdin on (with -t: always).")
@click.option("--tty", "-t", is_flag=True, help="Run it on a pseudo-terminal (an interactive shell: -it).")
@click.argument("job_id", metavar="JOB")
@click.argument("command", nargs=-1, required=True)
@click.pass_context
def exec_command(ctx: click.Context, interactive: bool, tty: bool, job_id: str, command: tuple[str, ...]) -> None:
    """Run COMMAND inside a running job: its processes, network and folders, its uid, its
    environment and workdir; exit with its exit code. JOB is its id or name; yours only.

    \b
    gpuport exec train -- nvidia-smi
    gpuport exec -it train -- bash
    gpuport exec train -- py-spy dump --pid 1"""
    from gpuport.client._reach import run_command

    if command[:1] == ("--",):  # after JOB, click keeps it
        command = command[1:]
    if not command:
        raise click.UsageError("give the command to run: gpuport exec JOB -- CMD [ARGS...]")
    gpu = client(ctx)
    stdin = sys.stdin.fileno() if (interactive or tty) else -1
    if stdin < 0 and not sys.stdin.isatty():
        stdin = sys.stdin.fileno()  # piped in: passed on, as ssh does
    local_tty = tty and os.isatty(0) and os.isatty(1)

    def window() -> tuple[int, int]:
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(1)
            return size.lines, size.columns
        return 0, 0

    with _raw_terminal(local_tty) as wake:
        code = run_command(
            gpu.transport,
            job_id,
            list(command),
            tty=tty,
            stdin=stdin if stdin >= 0 else b"",
            on_stdout=_write_all(1),
            on_stderr=_write_all(2),
            window=window if local_tty else None,
            wake=wake,
        )
    ctx.exit(128 - code if code < 0 else min(code, 255))


def _write_all(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return write


@contextlib.contextmanager
def _raw_terminal(raw: bool) -> Iterator[int]:
    """This terminal in raw mode (keys go to the remote one as typed) for the block, and an fd that
    becomes readable when its window is resized; -1 without a terminal."""
    if not raw:
        yield -1
        return
    import termios
    import tty

    saved = termios.tcgetattr(0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    previous = signal.signal(signal.SIGWINCH, lambda signum, frame: None)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    tty.setraw(0, termios.TCSADRAIN)  # not TCSAFLUSH: keys typed ahead go too
    try:
        yield wake_r
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
        signal.set_wakeup_fd(old_wakeup)
        signal.signal(signal.SIGWINCH, previous)
        os.close(wake_r)
        os.close(wake_w)


REACH_COMMANDS = [forward_command, exec_command]
