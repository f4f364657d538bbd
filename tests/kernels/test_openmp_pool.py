"""release_pool hands a thread's OpenMP workers back (the engine thread's pool stays alone)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from kvstack.kernels.openmp import loaded_libgomps, mapped_path, release_pool


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(before: int, more_than: int) -> int:
    """Threads beyond `before`, waiting for released workers to exit (they leave on their own)
    until fewer than `more_than` are left."""
    for _ in range(200):
        if _num_threads() - before < more_than:
            break
        time.sleep(0.01)
    return _num_threads() - before


def _parallel_work() -> None:
    torch.set_num_threads(2)  # a 2-thread team even on a 1-CPU machine: one pool worker
    x = torch.ones(1 << 22)
    assert float((x * 2).sum()) == 2.0 * (1 << 22)


def test_a_thread_that_ran_torch_hands_its_workers_back() -> None:
    seen: dict[str, object] = {}

    def work() -> None:
        before = _num_threads()
        _parallel_work()
        seen["with_pool"] = _num_threads() - before
        seen["released"] = release_pool()
        seen["after"] = _settled(before, more_than=int(seen["with_pool"]))
        _parallel_work()  # a later parallel region builds a new pool and still computes
        seen["rebuilt"] = _num_threads() - before
        release_pool()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"] is True
    assert isinstance(seen["with_pool"], int) and seen["with_pool"] >= 1
    # Fewer threads once the pool is freed (torch may start a thread of its own on first use,
    # which stays), and the same number again once a parallel region rebuilt the pool.
    assert isinstance(seen["after"], int) and seen["after"] < seen["with_pool"]
    assert seen["rebuilt"] == seen["with_pool"]


def test_release_inside_no_pool_is_harmless() -> None:
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(release_pool()))
    thread.start()
    thread.join()
    assert results == [True]  # nothing to free is still a success for libgomp


def test_a_maps_line_is_read_by_its_format() -> None:
    base = "7f4ba2800000-7f4ba2837000 r-xp 00000000 fe:00 5351264"
    assert mapped_path(f"{base}    /srv/a new user/kvstack/libgomp.so.1") == (
        "/srv/a new user/kvstack/libgomp.so.1")
    assert mapped_path(f"{base} /x/two  spaces/libgomp.so.1 (deleted)") == (
        "/x/two  spaces/libgomp.so.1")
    assert mapped_path("7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]") is None
    assert mapped_path("7ffd1000-7ffd2000 rw-p 00000000 00:00 0") is None


# Loads a copy of torch's own libgomp from a folder whose name has spaces before torch does:
# the dynamic loader then resolves torch's `libgomp.so.1` to that copy by its soname, so the
# pool torch's threads build lives in the library behind the space-containing path.
_SPACED_POOL = """
import ctypes, json, os, sys, threading, time
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import torch
from kvstack.kernels.openmp import loaded_libgomps, release_pool

def count():
    return len(os.listdir("/proc/self/task"))

seen = {"libgomps": loaded_libgomps()}
def work():
    before = count()
    torch.set_num_threads(2)
    assert float((torch.ones(1 << 22) * 2).sum()) == 2.0 * (1 << 22)
    seen["with_pool"] = count() - before
    seen["released"] = release_pool()
    for _ in range(200):
        if count() - before < seen["with_pool"]:
            break
        time.sleep(0.01)
    seen["after"] = count() - before
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps(seen))
"""


def test_torch_libgomp_under_a_path_with_spaces_is_released(tmp_path: Path) -> None:
    torch_libgomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not torch_libgomp.exists():  # a torch built against the system's libgomp
        torch_libgomp = Path(next(p for p in loaded_libgomps()))
    folder = tmp_path / "a new user" / "lib  two spaces"
    folder.mkdir(parents=True)
    spaced = folder / "libgomp.so.1"
    shutil.copy(torch_libgomp, spaced)
    done = subprocess.run([sys.executable, "-c", _SPACED_POOL, str(spaced)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["libgomps"] == [str(spaced)]  # torch's pool lives in the copy, none beside it
    assert seen["released"] is True
    assert seen["with_pool"] >= 1 and seen["after"] < seen["with_pool"]
