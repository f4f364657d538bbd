"""Test modules need unique basenames and one conftest: the test folders are not packages, so
pytest imports each module by its basename (a clash stops collection) and a second conftest
shadows the first for `from conftest import ...`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py")
                    if p.name.startswith("test_") and "__pycache__" not in p.parts)
    assert not [n for n, k in names.items() if k > 1], "repeated test module names"


def test_one_conftest() -> None:
    found = [p.relative_to(TESTS) for p in TESTS.rglob("conftest.py")]
    assert found == [Path("conftest.py")], f"conftest files: {found}"
