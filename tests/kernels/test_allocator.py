"""Freed memory stays in the process for the next step (`kernels/allocator.py`)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A fresh process per setting (mallopt is process-wide): a 48 MB and a 4 MB block allocated,
# written and freed ten times; the minor page faults of each round.
_ROUNDS = """
import json, resource, sys, torch
if sys.argv[1] == "keep":
    from kvstack.kernels.allocator import keep_freed_memory
    assert keep_freed_memory()
counts = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(12 << 20).fill_(1.0)
    y = torch.empty(1 << 20).fill_(2.0)
    del x, y
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(counts))
"""
_PAGES = (13 << 20) * 4 // 4096  # pages one round writes


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    kept, default = _faults("keep"), _faults("default")
    assert kept[0] >= _PAGES * 0.9 and default[0] >= _PAGES * 0.9  # the first round faults
    # glibc's default maps a 48 MB block afresh every round. Kept, the heap grows for the
    # first rounds (1-4 of them, by where the small block landed) until its free lists hold a
    # 48 MB block; from then on every round reuses it.
    assert sum(default[-3:]) >= 2.5 * _PAGES
    assert sum(kept[-3:]) <= _PAGES // 4


def test_it_is_done_once_per_process() -> None:
    from kvstack.kernels.allocator import keep_freed_memory

    first = keep_freed_memory()
    assert keep_freed_memory() is first
    assert first == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
