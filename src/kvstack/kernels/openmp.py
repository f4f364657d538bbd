"""Handing back a thread's OpenMP workers, so the thread that steps the engine keeps its speed.

libgomp (the OpenMP runtime torch and our C kernels share) keeps a pool of worker threads for
every thread that has started a parallel region, for as long as that thread lives. Once the
threads it manages outnumber the CPUs, a waiting worker spins only ~100 times before it sleeps
on a futex (libgomp's "throttled" spin count), so each of a decode step's hundreds of parallel
regions pays a wake-up. A server builds the model in one thread and steps it in another: two
pools, and on 2 CPUs a decode step of the embedded model (GGUF weights, ~800 tokens of context)
measured 11-16 ms in the engine thread against 4.3-5.8 ms once the building thread's pool was
handed back, in the same process.

`release_pool()` frees the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`, soft):
call it from a thread that ran torch work but will not step the engine. A later parallel region
in that thread simply builds a new pool. Where no libgomp is loaded (another OpenMP runtime,
not Linux) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what can be rebuilt

Pause = Callable[[int], int]


def mapped_path(line: str) -> str | None:
    """The file a /proc/<pid>/maps line maps, or None for an anonymous or special mapping.

    A line is `address perms offset dev inode [path]`: the path is everything after the fifth
    field, spaces included (a folder named "a new user" must not cut it), and the kernel appends
    " (deleted)" to a file removed since it was mapped."""
    fields = line.split(maxsplit=5)
    if len(fields) < 6 or not fields[5].startswith("/"):
        return None
    return fields[5].removesuffix(" (deleted)")


def loaded_libgomps() -> list[str]:
    """Paths of every libgomp this process has mapped (torch's wheel ships its own, which the
    C kernels share through its soname; a system one may sit beside it)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to find
        return []
    paths = {mapped_path(line) for line in maps.splitlines()}
    return sorted(p for p in paths if p is not None and Path(p).name.startswith("libgomp"))


@functools.cache
def _pause_functions() -> tuple[Pause, ...]:
    """`omp_pause_resource_all` of every libgomp this process has loaded."""
    found: list[Pause] = []
    for path in loaded_libgomps():
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: same handle
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        found.append(function)
    return tuple(found)


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True if a libgomp did (False: none is
    loaded, or the call came from inside a parallel region)."""
    # torch loads libgomp on import; look only after that, so the cache is not empty.
    import torch  # noqa: F401

    results = [pause(OMP_PAUSE_SOFT) for pause in _pause_functions()]
    return bool(results) and all(rc == 0 for rc in results)
