"""Both implementations in the C sources (AVX-512 and AVX2 + FMA, chosen by the compiler from
the target) always compile, whatever this machine runs: each is built here with the flags
`KVSTACK_KERNELS` would use (`kernels/isa.py`), without being run, must export every symbol
the Python side binds, and must hold the instructions of its own implementation only (an AVX2
build on an AVX-512 CPU runs AVX2 code, not AVX-512 code the CPU happens to have)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kvstack.kernels
from kvstack.kernels import build, isa

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler (cc)")

TARGETS = {  # name -> (the CPU flags the build is for, the implementation it must select)
    "avx2": (set(), "avx2"),
    "avx512": (set(), "avx512"),
    # Where the CPU has VNNI and BF16 the AVX-512 build enables them for the whole library.
    "avx512-vnni-bf16": ({"avx512_vnni", "avx512_bf16"}, "avx512"),
}
# AT&T syntax: a 512-bit register, an opmask, or a register only EVEX can encode.
_AVX512_OPERANDS = re.compile(r"%zmm|\{%k[0-7]\}|%[xy]mm(1[6-9]|2\d|3[01])\b")


def _run(tool: str, *args: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"no {tool} to read the library")
    return subprocess.run([path, *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_sources_compile_for_each_instruction_set(target: str, tmp_path: Path) -> None:
    folder = Path(kvstack.kernels.__file__).parent
    sources = [folder / name for name in build.SOURCES]
    library = tmp_path / "lib.so"
    cpu, name = TARGETS[target]
    flags = isa.compile_flags(name, cpu)
    assert "-march=native" not in flags
    cmd = build.compile_command(sources, library, arch=(*flags, "-Werror"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = _run("nm", "-D", "--defined-only", str(library))
    symbols = {line.split()[-1] for line in out.splitlines() if line.strip()}
    missing = build.expected_symbols() - symbols
    assert not missing, f"{target} build lacks {sorted(missing)}"
    # kvstack_gemv_isa() returns a string constant naming the implementation compiled in.
    binary = library.read_bytes()
    other = ({"avx512", "avx2"} - {name}).pop()
    assert f"{name}\0".encode() in binary and f"{other}\0".encode() not in binary
    code = _run("objdump", "-d", "--no-show-raw-insn", str(library))
    wide = len(_AVX512_OPERANDS.findall(code))
    if name == "avx2":
        assert wide == 0, f"the AVX2 build holds {wide} AVX-512 instructions"
    else:  # gemv.c's 16-lane kernels, and the int8 / bf16 dot products (per function)
        assert wide > 1000 and "vpdpbusd" in code and "vdpbf16ps" in code
