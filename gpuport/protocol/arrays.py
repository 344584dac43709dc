"""Job arrays and sweeps, as both sides read them: Slurm's ``--array`` syntax and a sweep's grid.

``parse_array("0-99%8")`` → the indices and the most tasks running at once (0: no cap). The syntax
is Slurm's: ranges ``0-15``, lists ``1,3,5``, steps ``0-15:4``, any mix of them ``1-5,10-20:5``, and
``%N`` at the end. ``sweep_grid`` is the cross product of a sweep's values, in the order given (the
last parameter varies fastest); task ``i`` of a sweep runs point ``i``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence

from gpuport.defaults import MAX_ARRAY_INDEX, MAX_ARRAY_TASKS
from gpuport.protocol.errors import InvalidRequest

_PART = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")
_CAP = re.compile(r"%(\d+)")
_SWEEP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_EXAMPLES = "write it as Slurm does: 0-99, 1,3,5, 0-15:4, with %N to run at most N at once (0-99%8)"


def parse_array(spec: str, *, cap_only: bool = False) -> tuple[list[int], int]:
    """The indices of ``spec`` (sorted, each once) and its ``%N`` (0: none). With ``cap_only``
    (a sweep's: its indices are its grid's), ``spec`` may be ``%N`` alone, or empty.

    Raises ``InvalidRequest`` for a malformed spec, or one over MAX_ARRAY_TASKS tasks.
    """
    text = spec.strip()
    body, sep, cap_text = text.partition("%")
    cap = 0
    if sep:
        if not _CAP.fullmatch(sep + cap_text) or int(cap_text) < 1:
            raise InvalidRequest(f"array {spec[:80]!r}: %N needs a whole number of 1 or more after the % ({_EXAMPLES})")
        cap = int(cap_text)
    if cap_only:
        if body:
            raise InvalidRequest(
                f"array {spec[:80]!r} with a sweep: the sweep's grid gives the tasks; give only %N "
                "(at most N running at once), or leave --array out"
            )
        return [], cap
    if not body:
        raise InvalidRequest(f"array {spec[:80]!r} has no indices: {_EXAMPLES}")
    ranges = []
    for part in body.split(","):
        found = _PART.fullmatch(part.strip())
        if not found:
            raise InvalidRequest(f"array {spec[:80]!r}: {part.strip()[:40]!r} is not an index or a range; {_EXAMPLES}")
        first = int(found[1])
        last = int(found[2]) if found[2] is not None else first
        step = int(found[3]) if found[3] is not None else 1
        if last < first:
            raise InvalidRequest(f"array {spec[:80]!r}: the range {part.strip()!r} ends before it starts")
        if step < 1:
            raise InvalidRequest(f"array {spec[:80]!r}: the step of {part.strip()!r} must be 1 or more")
        if last > MAX_ARRAY_INDEX:
            raise InvalidRequest(f"array {spec[:80]!r}: indices go up to {MAX_ARRAY_INDEX}, not {last}")
        ranges.append(range(first, last + 1, step))
    if sum(len(r) for r in ranges) > MAX_ARRAY_TASKS:  # counted before anything is spelled out
        raise too_many(sum(len(r) for r in ranges))
    indices = sorted(set(itertools.chain.from_iterable(ranges)))
    return indices, cap


def too_many(count: int) -> InvalidRequest:
    return InvalidRequest(
        f"{count} tasks in one array or sweep; the most is {MAX_ARRAY_TASKS}: split it into several arrays"
    )


def sweep_grid(sweep: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    """Every point of the sweep's grid: the cross product of its values, in order. Raises
    ``InvalidRequest`` for a bad name, a parameter without values, or more than MAX_ARRAY_TASKS points."""
    count = 1
    for name, values in sweep.items():
        if not _SWEEP_NAME.fullmatch(name) or len(name) > 64:
            raise InvalidRequest(
                f"sweep parameter {name[:80]!r}: use letters, digits, '_' and '-', starting with a letter or '_'"
            )
        if not values:
            raise InvalidRequest(f"sweep parameter {name!r} has no values: give them as {name}=V1,V2")
        if any(not isinstance(v, str) or "\0" in v for v in values):
            raise InvalidRequest(f"sweep parameter {name!r}: every value must be a string without NUL bytes")
        count *= len(values)
        if count > MAX_ARRAY_TASKS:
            raise too_many(math.prod(len(v) for v in sweep.values()))
    names = list(sweep)
    return [dict(zip(names, point, strict=True)) for point in itertools.product(*(sweep[n] for n in names))]


def sweep_env_name(name: str) -> str:
    """The environment variable holding a sweep parameter's value: ``GPUPORT_SWEEP_`` + its name in
    capitals, '-' as '_' (``batch-size`` → ``GPUPORT_SWEEP_BATCH_SIZE``)."""
    return "GPUPORT_SWEEP_" + name.upper().replace("-", "_")


def sweep_args(point: Mapping[str, str]) -> list[str]:
    """A sweep point as the arguments appended to a task's command: ``--name value`` each."""
    return [arg for name, value in point.items() for arg in (f"--{name}", value)]


def format_indices(indices: Iterable[int]) -> str:
    """Indices as Slurm prints them: ``0-3,5,7-9``."""
    parts: list[str] = []
    run: list[int] = []
    for index in sorted(set(indices)):
        if run and index == run[-1] + 1:
            run.append(index)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [index]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)
