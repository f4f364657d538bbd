"""Build and load the C kernels (`gemv.c`, `ops.c`, `gguf.c`, `gguf_x8.c`) with the machine's C
compiler, once per source, instruction set and CPU: the library is cached under
~/.cache/kvstack/kernels/<isa>-<key>/ (`KVSTACK_CACHE_DIR` moves the cache root), so later
processes load it in milliseconds.

The sources hold two implementations, AVX-512 (F, BW, VL) and AVX2 + FMA + F16C, chosen by the
compiler from the target flags (`isa.py`). `KVSTACK_KERNELS` picks one (`avx512`, `avx2`; unset:
the best this CPU runs; `0`: none); a forced one that cannot run here raises
`KernelsUnavailableError`. Where none runs (not x86-64, no AVX2, no compiler, a failed build)
and none was forced, `load()` returns None and the model uses PyTorch's ops throughout.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from kvstack.kernels import isa as isas
from kvstack.kernels.isa import KernelsUnavailableError
from kvstack.paths import cache_root

log = logging.getLogger(__name__)

SOURCES = ("gemv.c", "gemm_q8.c", "ops.c", "gguf.c", "gguf_x8.c", "gemma_step.c")
# included by the sources from their own folder; part of the cache key
HEADERS = ("avx2.h", "half.h", "products.h", "q8.h")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    # x, rows, k, w, n, scale, bias, y, threads
    "gemv": [_P, _I64, _I64, _P, _I64, _P, _P, _P, _INT],
    # x, residual, rows, d, w, eps, out
    "rms_norm": [_P, _P, _I64, _I64, _P, _F32, _P],
    # x, rows, stride, heads, dim, cos, sin
    "rope": [_P, _I64, _I64, _I64, _I64, _P, _P],
    # gate_up, rows, inter, out
    "silu_mul": [_P, _I64, _I64, _P],
    # k, v, rows, stride, slots, k_cache, v_cache, width
    "store_kv": [_P, _P, _I64, _I64, _P, _P, _P, _I64],
    # dims, layers, h, rows, cos, sin, slot_mapping, slots, lens, max_ctx, pending, threads
    "decode_step": [_P, _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, _INT],
    # q, k, v, slots, lens, seqs, max_ctx, heads, kv_heads, dim, scale, out, threads
    "decode_attention": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P, _INT],
    # q, kv, kv_scale, fp8, rotate, slots, lens, seqs, max_ctx, heads, kv_heads, dim, scale,
    # out, threads
    "decode_attention_quant": [_P, _P, _P, _INT, _INT, _P, _P, _I64, _I64, _I64, _I64, _I64,
                               _F32, _P, _INT],
    # k, v, rows, k_stride, v_stride, slots, kv, kv_scale, fp8, rotate, kv_heads, dim
    "store_kv_quant": [_P, _P, _I64, _I64, _I64, _P, _P, _P, _INT, _INT, _I64, _I64],
}
_SUFFIXES = {"gemv": ("f32", "bf16", "i8", "q8", "bf16dp")}
# Functions without dtype variants: name -> (argtypes, restype).
_PLAIN: dict[str, tuple[list[Any], Any]] = {
    "kvstack_gemv_isa": ([], ctypes.c_char_p),
    # src, dst, count, threads
    "widen_i8_bf16": ([_P, _P, _I64, _INT], None),
    # x, rows, k, w, n, scale, bias, y, threads -> 2 (AMX), 1 (VNNI), 0 (did not run)
    "gemm_q8": ([_P, _I64, _I64, _P, _I64, _P, _P, _P, _INT], _INT),
    # on (1, 0; -1: ask) -> whether gemm_q8 runs on AMX tiles
    "q8_use_amx": ([_INT], _INT),
    "q8_gemm_rows": ([], _INT),
    # type, bytes_out
    "gguf_block_size": ([_INT, _P], _I64),
    # type, x, rows, k, w, n, bias, y, threads
    "gguf_gemv": ([_INT, _P, _I64, _I64, _P, _I64, _P, _P, _INT], _INT),
    # type, w, k, ids, count, out, threads
    "gguf_dequantize": ([_INT, _P, _I64, _P, _I64, _P, _INT], _INT),
    # type, w, k, ids, count, out
    "gguf_dequantize_reference": ([_INT, _P, _I64, _P, _I64, _P], _INT),
    # type, x, rows, k, w (x8 layout), n, bias, y, threads
    "gguf_gemv_x8": ([_INT, _P, _I64, _I64, _P, _I64, _P, _P, _INT], _INT),
    "gguf_x8_supported": ([_INT], _INT),
    # type, count, x, offsets, k, w (count pointers), n, y, threads
    "gguf_gemv_x8_many": ([_INT, _I64, _P, _P, _I64, _P, _I64, _P, _INT], _INT),
    # dims, layers, views, h, rows, cos, sin, threads
    "gemma_decode_step": ([_P, _P, _P, _P, _I64, _P, _P, _INT], _INT),
    # x, count, d, w, eps, out
    "gemma_norm_f32": ([_P, _I64, _I64, _P, _F32, _P], None),
    # h, y, rows, d, w, eps
    "gemma_add_norm_f32": ([_P, _P, _I64, _I64, _P, _F32], None),
    # gate_up, rows, inter, out
    "gemma_gelu_mul_f32": ([_P, _I64, _I64, _P], None),
    # qkv, rows, stride, heads, kv_heads, dim, q_norm, k_norm, eps, cos, sin
    "gemma_qk_norm_rope_f32": ([_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _F32, _P, _P], None),
    # type, src, n, k, dst
    "gguf_x8_pack": ([_INT, _P, _I64, _I64, _P], _INT),
    # type, w, n, k, ids, count, out
    "gguf_x8_unpack": ([_INT, _P, _I64, _I64, _P, _I64, _P], _INT),
    # type, w, n, k, out, threads
    "gguf_x8_dequantize": ([_INT, _P, _I64, _I64, _P, _INT], _INT),
}


def _best_unavailable() -> str | None:
    """Why no implementation can run here when none is forced, or None."""
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return f"no kernels for {machine} (x86-64 only)"
    if not isas.runnable():
        return ("this CPU has neither AVX-512 (avx512f, avx512bw, avx512vl) nor "
                "AVX2 + FMA + F16C")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler (cc) on PATH"
    return None


def compile_command(sources: list[Path], output: Path | str,
                    arch: tuple[str, ...]) -> list[str]:
    """The compiler command that builds `sources` into the shared library `output` for the
    target flags `arch` (`isa.compile_flags(isa)`; the tests pass other CPUs' -march too)."""
    return [os.environ.get("CC", "cc"), *_FLAGS, *arch, *map(str, sources), "-o", str(output),
            "-lm"]


def _build(sources: list[Path], target: Path, arch: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = compile_command(sources, tmp, arch)
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def expected_symbols() -> set[str]:
    """Every function the Python side binds from the library."""
    names = {f"{base}_{suffix}" for base in _SIGNATURES
             for suffix in _SUFFIXES.get(base, ("f32", "bf16"))}
    return names | set(_PLAIN)


def library_path(isa: str) -> Path:
    """Where `isa`'s library for these sources and this CPU is cached."""
    folder = resources.files("kvstack.kernels")
    code = b"".join(folder.joinpath(name).read_bytes() for name in SOURCES + HEADERS)
    flags = " ".join(_FLAGS + isas.compile_flags(isa)).encode()
    key = hashlib.sha256(code + flags + isas.cpu_flags_line().encode()).hexdigest()
    return cache_root() / "kernels" / f"{isa}-{key[:16]}" / "libkvstack_kernels.so"


def load() -> ctypes.CDLL | None:
    """The compiled kernel library `KVSTACK_KERNELS` selects (see `isa.py`), building it on
    first use; None where the kernels are off. Raises `KernelsUnavailableError` for a forced
    implementation that cannot run here. Read per call (one dict look-up), so a changed
    setting takes effect for objects made after it."""
    return _load_setting(os.environ.get(isas.ENV, ""))


@cache
def _load_setting(setting: str) -> ctypes.CDLL | None:
    choice = isas.requested(setting)
    if choice is None:
        log.info("kvstack C kernels off: disabled by %s=%s", isas.ENV, setting)
        return None
    if choice != "best":
        isas.check_forced(choice)
        return _open(choice)
    reason = _best_unavailable()
    if reason is not None:  # an expected state (another CPU, no compiler): not a warning
        log.info("kvstack C kernels off: %s", reason)
        return None
    try:
        return _open(isas.runnable()[0])
    except KernelsUnavailableError as err:
        log.warning("kvstack C kernels off: %s", err)
        return None


def _open(isa: str) -> ctypes.CDLL:
    """`isa`'s library, built if not cached, with every function's signature bound."""
    target = library_path(isa)
    folder = resources.files("kvstack.kernels")
    try:
        if not target.exists():
            with ExitStack() as stack:
                paths = [stack.enter_context(resources.as_file(folder.joinpath(name)))
                         for name in SOURCES]
                _build(paths, target, isas.compile_flags(isa))
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = " ".join((getattr(err, "stderr", "") or str(err)).split())[:300]
        raise KernelsUnavailableError(f"C kernels for {isa}: build failed: {detail}") from None
    _bind(lib)
    built = lib.kvstack_gemv_isa().decode()
    if built != isa:  # the flags and the sources' #if disagree: a bug, never run it
        raise KernelsUnavailableError(f"C kernels for {isa}: the library holds {built} code")
    lib.q8_use_amx(int(isas.dot_products(isa)["amx"]))
    return lib


def _bind(lib: ctypes.CDLL) -> None:
    for base, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIXES.get(base, ("f32", "bf16")):
            fn = getattr(lib, f"{base}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if base in ("decode_step", "decode_attention",
                                                 "decode_attention_quant") else None
    for name, (argtypes, restype) in _PLAIN.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def isa() -> str | None:
    """Which implementation the loaded library holds: "avx512" or "avx2"; None when off."""
    lib = load()
    return lib.kvstack_gemv_isa().decode() if lib is not None else None


def has_vnni() -> bool:
    """The loaded kernels use AVX512-VNNI (vpdpbusd): int8 decode runs `gemv_q8` (int8
    activations) with it. False for an AVX2 build, whatever the CPU has."""
    return isas.dot_products(isa())["vnni"]


def has_amx() -> bool:
    """The loaded kernels run int8 products of several rows on AMX tiles (`gemm_q8.c`)."""
    lib = load()
    return lib is not None and bool(lib.q8_use_amx(-1))


def has_bf16_dot() -> bool:
    """The loaded kernels use AVX512-BF16 (vdpbf16ps): bf16 decode runs `gemv_bf16dp`."""
    return isas.dot_products(isa())["bf16"]


def describe() -> dict[str, object]:
    """What runs, for benchmark records: the setting, the implementation and its compiler
    flags, the dot-product instructions it uses and the CPU's relevant flags."""
    built = isa()
    return {"setting": os.environ.get(isas.ENV, ""), "isa": built,
            "compile_flags": list(isas.compile_flags(built)) if built else [],
            "dot_products": isas.dot_products(built), "cpu": isas.cpu_summary()}


def status() -> str:
    """One line for humans: which implementation runs, or why the kernels are off."""
    try:
        built = isa()
    except KernelsUnavailableError as err:
        return f"C kernels refused: {err}"
    if built is None:
        setting = os.environ.get(isas.ENV, "")
        off = isas.requested(setting) is None
        reason = (f"disabled by {isas.ENV}={setting}" if off
                  else _best_unavailable() or "build failed")
        return f"C kernels off: {reason}"
    used = [name.upper() for name, on in isas.dot_products(built).items() if on]
    return f"C kernels: {isas.NAMES[built]}, built" + (f" with {', '.join(used)}" if used else "")


def prebuild() -> list[str]:
    """Build the library `KVSTACK_KERNELS` selects and, when that is the best one (the setting
    unset), every other implementation this CPU runs (the per-ISA tests and `--isa` load
    each); one line per library for humans."""
    lines = [status()]
    setting = os.environ.get(isas.ENV, "").strip().lower()
    if lines[0].startswith("C kernels: ") and setting in isas.BEST:
        for name in isas.runnable()[1:]:
            try:
                _open(name)
                lines.append(f"C kernels: {isas.NAMES[name]}, built ({isas.ENV}={name})")
            except KernelsUnavailableError as err:
                lines.append(f"C kernels: {err}")
    return lines


if __name__ == "__main__":  # `python -m kvstack.kernels.build`: build now (make install does)
    print("\n".join(prebuild()))
