from __future__ import annotations

import pytest

from gpuport import InvalidRequest, format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("16g", 16 * 2**30),
        (" 2 TiB ", 2 * 2**40),
        (1024, 1024),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 parsecs", "-1GiB", "1e3"])
def test_parse_size_rejects_with_an_example(text: str) -> None:
    with pytest.raises(InvalidRequest, match="8GiB"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "text"), [(8 * 2**30, "8GiB"), (int(1.5 * 2**30), "1.5GiB"), (512 * 2**20, "512MiB"), (900, "900B")]
)
def test_format_size_reads_back(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(text) == n


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("2h", 7200), ("1h30m", 5400), ("250ms", 0.25), ("15m", 900), ("45", 45), ("1d", 86400)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "2hours", "h2", "1h30x"])
def test_parse_duration_rejects_with_an_example(text: str) -> None:
    with pytest.raises(InvalidRequest, match="90s"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0.25, 90, 5400, 86400 + 3 * 3600])
def test_format_duration_reads_back(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds
