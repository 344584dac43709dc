"""Sizes and durations as people type them: ``8GiB``, ``512MiB``, ``1.5GB``, ``90s``, ``2h``, ``1h30m``."""

from __future__ import annotations

import re

from gpuport.protocol.errors import InvalidRequest

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|min|s|m|h|d)")


def parse_size(text: str | int) -> int:
    """Return the number of bytes in ``text`` (``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4096"``).

    Binary units (KiB, MiB, GiB, TiB, and bare K/M/G/T) are powers of 1024; decimal ones (KB, MB,
    GB, TB) powers of 1000. Raises ``InvalidRequest`` for anything else.

    >>> parse_size("8GiB")
    8589934592
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidRequest(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise InvalidRequest(f"cannot read {text!r} as a size — write it like 8GiB, 512MiB, 1.5GB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(n: int) -> str:
    """Print ``n`` bytes the way ``parse_size`` reads them: ``8GiB``, ``1.5GiB``, ``512MiB``, ``900B``."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def parse_duration(text: str | float) -> float:
    """Return the seconds in ``text`` (``"90s"``, ``"2h"``, ``"1h30m"``, ``"250ms"``, or a number).

    Raises ``InvalidRequest`` for anything else.

    >>> parse_duration("1h30m")
    5400.0
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise InvalidRequest(f"duration must not be negative, got {text}")
        return float(text)
    compact = str(text).strip().replace(" ", "").lower()
    try:
        return float(compact)
    except ValueError:
        pass
    parts = _DURATION_PART_RE.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise InvalidRequest(
            f"cannot read {text!r} as a duration — write it like 90s, 15m, 2h, 1h30m or a number of seconds"
        )
    return float(sum(float(n) * _DURATION_UNITS[u] for n, u in parts))


def format_duration(seconds: float) -> str:
    """Print a duration the way ``parse_duration`` reads it: ``250ms``, ``90s``, ``1h30m``, ``2d3h``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds == int(seconds) else f"{seconds:.1f}s"
    out, rest = "", int(round(seconds))
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, factor)
        if count:
            out += f"{count}{unit}"
    return out
