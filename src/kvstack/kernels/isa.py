"""Which instruction set the C kernels are built for: what this CPU executes, what
`KVSTACK_KERNELS` asks for, and the compiler flags of each.

`KVSTACK_KERNELS` values:
- unset, empty, `1` or `native`: the best instruction set this CPU executes (AVX-512 over AVX2);
  where it runs none, or the build fails, the kernels are off (logged) and PyTorch's ops run.
- `avx512` or `avx2`: exactly that implementation. AVX2 code runs on AVX-512 CPUs (the tests
  and `kvstack bench peers --isa avx2` use this). Forcing one this CPU cannot execute, or one
  that cannot be built here, raises `KernelsUnavailableError`: an explicit request is honoured
  or refused, never silently swapped for another implementation (a benchmark would be mislabelled)
  and never run into an illegal instruction.
- `0` or `off`: no C kernels.

Each build names its flags explicitly (never `-march=native`), so the implementation compiled
in depends only on the choice, not on the machine: the sources pick code by the macros these
flags define (`gemv.c`: `__AVX512F__` and `__AVX512BW__`, else `__AVX2__`, `__FMA__`; `ops.c`'s
decode attention: `__AVX512F__`, else `__AVX2__` and `__FMA__`; the rest of `ops.c`, `gguf.c`,
`gguf_x8.c`, `half.h`: `__AVX2__`, `__FMA__`, `__F16C__`), and an AVX2 build on an
AVX-512 CPU holds no AVX-512 instruction. `-mtune=native` only schedules for this CPU.
"""

from __future__ import annotations

import os
import platform
import shutil
from functools import cache

from kvstack.errors import KvstackError

ENV = "KVSTACK_KERNELS"
ISAS = ("avx512", "avx2")  # best first
NAMES = {"avx512": "AVX-512", "avx2": "AVX2+FMA"}
# /proc/cpuinfo flags each implementation executes. AVX-512 needs VL as well as F and BW: its
# masked 256- and 128-bit loads (K % 16 tails in gemv.c) are AVX512VL instructions.
NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
}
_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"),
}
# Added to an AVX-512 build only where the CPU has them, so that such a library never holds
# them outside the functions that need them on other CPUs. The int8 x int8 (`gemv_q8`,
# vpdpbusd) and bf16 x bf16 (`gemv_bf16dp`, vdpbf16ps) kernels enable them per function anyway,
# and Python calls those only where the CPU has the flag (`dot_products`).
OPTIONAL = {"avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}
_TUNE = ("-mtune=native",)
_OFF = ("0", "off")
BEST = ("", "1", "native")  # settings that mean "the best this CPU runs"


class KernelsUnavailableError(KvstackError):
    """`KVSTACK_KERNELS` names an implementation that cannot run here (or no such thing)."""


@cache
def cpu_flags_line() -> str:
    """The `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> set[str]:
    return set(cpu_flags_line().split())


def missing(isa: str) -> list[str]:
    """The CPU flags `isa` needs that this CPU lacks ([] when it runs `isa`)."""
    flags = cpu_flags()
    return [f for f in NEEDS[isa] if f not in flags]


def runnable() -> tuple[str, ...]:
    """The implementations this CPU executes, best first; () off x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    return tuple(isa for isa in ISAS if not missing(isa))


def compile_flags(isa: str, cpu: set[str] | None = None) -> tuple[str, ...]:
    """The target flags of `isa`'s build on a CPU with the flags `cpu` (default: this one's;
    see OPTIONAL for the AVX-512 extras)."""
    have = cpu_flags() if cpu is None else cpu
    extra = tuple(flag for name, flag in OPTIONAL.items() if name in have)
    return _FLAGS[isa] + (extra if isa == "avx512" else ()) + _TUNE


def requested(setting: str) -> str | None:
    """The implementation a `KVSTACK_KERNELS` value asks for: an ISA, "best" or None (off)."""
    value = setting.strip().lower()
    if value in _OFF:
        return None
    if value in BEST:
        return "best"
    if value in ISAS:
        return value
    raise KernelsUnavailableError(
        f"{ENV}={setting!r} is not a kernel choice: use avx512, avx2, 0 (off) or leave it unset "
        "(the best this CPU runs)")


def check_forced(isa: str) -> None:
    """Raise the one-line error for a forced `isa` that cannot be built or run here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise KernelsUnavailableError(
            f"{ENV}={isa}: no kernels for {platform.machine()} (x86-64 only); unset it")
    lacking = missing(isa)
    if lacking:
        others = [i for i in runnable() if i != isa]
        hint = f"use {ENV}={others[0]} or unset it" if others else f"use {ENV}=0"
        raise KernelsUnavailableError(
            f"{ENV}={isa}: this CPU lacks {', '.join(lacking)}; {hint}")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        raise KernelsUnavailableError(f"{ENV}={isa}: no C compiler (cc) on PATH; use {ENV}=0")


def dot_products(isa: str | None) -> dict[str, bool]:
    """Which dot-product instructions the kernels of `isa` use on this CPU: AVX512-VNNI
    (vpdpbusd: int8 decode's `gemv_q8`), AVX512-BF16 (vdpbf16ps: bf16's `gemv_bf16dp`) and,
    with VNNI, AMX-INT8 (tile products: `gemm_q8.c`, int8 steps of a few rows and more). An
    AVX2 build uses none, whatever the CPU has."""
    flags = cpu_flags()
    on = isa == "avx512"
    vnni = on and "avx512_vnni" in flags
    return {"vnni": vnni, "bf16": on and "avx512_bf16" in flags,
            "amx": vnni and "amx_int8" in flags}


def fast_bf16_matmul() -> bool:
    """Whether PyTorch's bf16 matmul (oneDNN) has bf16 dot products to run on here: AVX512-BF16
    (or AMX-BF16). There it runs prefill-sized products several times faster than fp32 (the
    embedded model's layer shapes at 512 rows, 2 threads, Xeon with AMX: 3-9x); without them
    it runs 5-7x slower than fp32 (AVX2). The CPU's flag, not the kernels' build: PyTorch's
    matmul does not depend on `KVSTACK_KERNELS`."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_summary() -> dict[str, bool]:
    """The CPU's flags that matter to the kernels, for benchmark records."""
    flags = cpu_flags()
    return {"avx2": "avx2" in flags, "avx512": not missing("avx512"),
            "avx512_vnni": "avx512_vnni" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": "amx_bf16" in flags}
