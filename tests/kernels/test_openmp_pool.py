"""release_pool hands a thread's OpenMP workers back (the engine thread's pool stays alone)."""

from __future__ import annotations

import os
import threading
import time

import torch

from kvstack.kernels.openmp import release_pool


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
