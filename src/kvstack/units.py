"""Sizes and durations as people write and read them: '1GiB' in, '1.50 MiB' and '12 ms' out."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvstack.errors import InvalidRequestError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}

def parse_size(value: int | str) -> int:
    """'1GiB' -> 1073741824; plain ints are bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidRequestError(f"size must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise InvalidRequestError(f"cannot parse size {value!r}; use e.g. '512MiB' or '1GiB'")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise InvalidRequestError(f"size must be positive, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}".replace(".00 ", " ")
        n /= 1024
    raise AssertionError("unreachable")


def format_ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds ('n/a' for None)."""
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
