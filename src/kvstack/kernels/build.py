"""Build and load the C kernels (`gemv.c`, `ops.c`, `gguf.c`) with the machine's C compiler,
once per source and CPU: the library is cached under ~/.cache/kvstack/kernels/<key>/
(`KVSTACK_CACHE_DIR` moves the cache root), so later processes load it in milliseconds.

The kernels need x86-64 with AVX-512 (F, BW) or AVX2 + FMA + F16C; the sources hold one
implementation for each, chosen by the compiler from the target (`-march=native`). Anywhere
else, or without a compiler, or with `KVSTACK_KERNELS=0`, `load()` returns None and the model
uses PyTorch's ops throughout.
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

from kvstack.paths import cache_root

log = logging.getLogger(__name__)

SOURCES = ("gemv.c", "ops.c", "gguf.c", "gguf_x8.c")
# included by the sources from their own folder; part of the cache key
HEADERS = ("avx2.h", "half.h")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_ARCH = ("-march=native",)  # this CPU's instruction set picks the implementation
_NAMES = {"avx512": "AVX-512", "avx2": "AVX2+FMA"}
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
_PLAIN = {
    "kvstack_gemv_isa": ([], ctypes.c_char_p),
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
    # type, src, n, k, dst
    "gguf_x8_pack": ([_INT, _P, _I64, _I64, _P], _INT),
    # type, w, n, k, ids, count, out
    "gguf_x8_unpack": ([_INT, _P, _I64, _I64, _P, _I64, _P], _INT),
    # type, w, n, k, out, threads
    "gguf_x8_dequantize": ([_INT, _P, _I64, _I64, _P, _INT], _INT),
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _supported() -> str | None:
    """Why the kernels cannot run here, or None."""
    if os.environ.get("KVSTACK_KERNELS", "1") == "0":
        return "disabled by KVSTACK_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no kernels for {platform.machine()} (x86-64 only)"
    flags = set(_cpu_flags().split())
    if not ({"avx512f", "avx512bw"} <= flags or {"avx2", "fma", "f16c"} <= flags):
        return "this CPU has neither AVX-512 (avx512f, avx512bw) nor AVX2 + FMA + F16C"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler (cc) on PATH"
    return None


def compile_command(sources: list[Path], output: Path | str,
                    arch: tuple[str, ...] = _ARCH) -> list[str]:
    """The compiler command that builds `sources` into the shared library `output`; `arch`
    replaces `-march=native` (the tests build for other targets than this CPU with it)."""
    return [os.environ.get("CC", "cc"), *_FLAGS, *arch, *map(str, sources), "-o", str(output),
            "-lm"]


def _build(sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = compile_command(sources, tmp)
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


def isa() -> str | None:
    """Which implementation the loaded library holds: "avx512" or "avx2"; None when off."""
    lib = load()
    return lib.kvstack_gemv_isa().decode() if lib is not None else None


def has_vnni() -> bool:
    """AVX512-VNNI (vpdpbusd): int8 decode uses `gemv_q8` (int8 activations) with it."""
    return "avx512_vnni" in _cpu_flags().split()


def has_bf16_dot() -> bool:
    """AVX512-BF16 (vdpbf16ps): bf16 decode uses `gemv_bf16dp` with it."""
    return "avx512_bf16" in _cpu_flags().split()


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None where it cannot run."""
    reason = _supported()
    if reason is not None:
        log.info("kvstack C kernels off: %s", reason)
        return None
    folder = resources.files("kvstack.kernels")
    code = b"".join(folder.joinpath(name).read_bytes() for name in SOURCES + HEADERS)
    flags = " ".join(_FLAGS + _ARCH).encode()
    key = hashlib.sha256(code + flags + _cpu_flags().encode()).hexdigest()
    target = cache_root() / "kernels" / key[:16] / "libkvstack_kernels.so"
    try:
        if not target.exists():
            with ExitStack() as stack:
                paths = [stack.enter_context(resources.as_file(folder.joinpath(name)))
                         for name in SOURCES]
                _build(paths, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("kvstack C kernels off: build failed: %s", detail.strip()[:500])
        return None
    for base, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIXES.get(base, ("f32", "bf16")):
            fn = getattr(lib, f"{base}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if base in ("decode_step", "decode_attention",
                                                 "decode_attention_quant") else None
    for name, (argtypes, restype) in _PLAIN.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def status() -> str:
    """One line for humans: where the kernels come from, or why they are off."""
    reason = _supported()
    if reason is not None:
        return f"C kernels off: {reason}"
    built = isa()
    return f"C kernels: {_NAMES[built]}, built" if built else "C kernels off: build failed"


if __name__ == "__main__":  # `python -m kvstack.kernels.build`: build now (make install does)
    print(status())
