"""Numbers as the benchmarks compute and print them: rates, ratios, medians, short text."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def per_second(count: float, seconds: float | None) -> float | None:
    return count / seconds if seconds else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def fmt_x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
