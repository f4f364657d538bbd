"""Both implementations in the C sources (AVX-512 and AVX2 + FMA, chosen by the compiler from
the target) always compile, whatever this machine runs: each is built here for a CPU that
picks it, without being run, and must export every symbol the Python side binds."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import kvstack.kernels
from kvstack.kernels import build

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler (cc)")

TARGETS = {  # name -> (compiler target flags, the implementation it must select)
    # Ice Lake server: AVX-512 F/BW/VNNI; the bf16 dot product is enabled per function.
    "avx512": (("-march=icelake-server",), "avx512"),
    # Sapphire Rapids' extensions spelled out, for compilers that predate its -march name.
    "avx512-bf16": (("-march=skylake-avx512", "-mavx512vnni", "-mavx512bf16"), "avx512"),
    "avx2": (("-march=haswell",), "avx2"),
}


def _exported(library: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_sources_compile_for_each_instruction_set(target: str, tmp_path: Path) -> None:
    folder = Path(kvstack.kernels.__file__).parent
    sources = [folder / name for name in build.SOURCES]
    library = tmp_path / "lib.so"
    arch, isa = TARGETS[target]
    cmd = build.compile_command(sources, library, arch=(*arch, "-Werror"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    symbols = _exported(library)
    missing = build.expected_symbols() - symbols
    assert not missing, f"{target} build lacks {sorted(missing)}"
    # kvstack_gemv_isa() returns a string constant naming the implementation compiled in.
    binary = library.read_bytes()
    other = ({"avx512", "avx2"} - {isa}).pop()
    assert f"{isa}\0".encode() in binary and f"{other}\0".encode() not in binary
