"""Choosing the C kernels' implementation (`kernels/isa.py`, `KVSTACK_KERNELS`): which ones a
CPU runs, the flags of each build, the one-line refusal of a forced implementation the CPU
lacks (before anything is built or loaded: never an illegal instruction), the best one when
unset, and what `bench peers` reports. CPUs other than this one are described to the code by
their /proc/cpuinfo flags."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstack.bench.peers.display import kernels_text
from kvstack.cli.main import main
from kvstack.kernels import build, isa
from kvstack.kernels.isa import KernelsUnavailableError
from kvstack.kernels.linear import Linear

AVX2_CPU = "flags\t\t: fpu sse2 avx fma f16c avx2 bmi2"  # e.g. AMD Zen 3
AVX512_CPU = AVX2_CPU + " avx512f avx512bw avx512vl avx512_vnni avx512_bf16"  # e.g. Zen 5
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                              reason="the kernels are x86-64 only")


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Lets a test describe another CPU (`cpu.setattr(isa, "cpu_flags_line", ...)`); loaded
    libraries are forgotten before and after, so no other test sees one chosen for it."""
    build._load_setting.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    build._load_setting.cache_clear()


def describe_cpu(patch: pytest.MonkeyPatch, line: str) -> None:
    patch.setattr(isa, "cpu_flags_line", lambda: line)


@pytest.mark.parametrize(("setting", "choice"), [
    ("", "best"), ("1", "best"), ("native", "best"), ("0", None), ("off", None),
    ("avx2", "avx2"), ("AVX512", "avx512"), (" avx2 ", "avx2")])
def test_settings(setting: str, choice: str | None) -> None:
    assert isa.requested(setting) == choice


def test_an_unknown_setting_is_a_one_line_error() -> None:
    with pytest.raises(KernelsUnavailableError, match="avx512, avx2, 0") as err:
        isa.requested("sse4")
    assert "\n" not in str(err.value) and "'sse4'" in str(err.value)


@x86_only
@pytest.mark.parametrize(("flags", "runnable"), [
    (AVX512_CPU, ("avx512", "avx2")),
    (AVX2_CPU + " avx512f avx512bw", ("avx2",)),  # no AVX512VL: its masked loads need it
    ("flags\t\t: fpu sse2 avx", ()),
])
def test_the_implementations_a_cpu_runs(cpu: pytest.MonkeyPatch, flags: str,
                                        runnable: tuple[str, ...]) -> None:
    describe_cpu(cpu, flags)
    assert isa.runnable() == runnable


def test_build_flags_per_implementation() -> None:
    with_dots = {"avx512_vnni", "avx512_bf16"}
    avx2 = isa.compile_flags("avx2", with_dots)
    assert "-mavx2" in avx2 and "-mfma" in avx2 and "-mf16c" in avx2
    assert not any("512" in f or f.startswith("-march") for f in avx2)
    plain = isa.compile_flags("avx512", set())
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl"} <= set(plain)
    assert "-mavx512vnni" not in plain and "-mavx512bf16" not in plain
    assert {"-mavx512vnni", "-mavx512bf16"} <= set(isa.compile_flags("avx512", with_dots))


@x86_only
@pytest.mark.parametrize(("flags", "forced", "hint"), [
    (AVX2_CPU, "avx512", "use KVSTACK_KERNELS=avx2 or unset it"),
    ("flags\t\t: fpu sse2 avx", "avx2", "use KVSTACK_KERNELS=0"),
])
def test_forcing_what_the_cpu_lacks_is_refused_before_any_build(
        cpu: pytest.MonkeyPatch, tmp_path: Path, flags: str, forced: str, hint: str) -> None:
    describe_cpu(cpu, flags)
    cpu.setenv("KVSTACK_CACHE_DIR", str(tmp_path))
    cpu.setenv(isa.ENV, forced)
    with pytest.raises(KernelsUnavailableError) as err:
        build.load()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"KVSTACK_KERNELS={forced}: this CPU lacks")
    assert isa.NEEDS[forced][-1] in message and message.endswith(hint)
    with pytest.raises(KernelsUnavailableError):
        Linear(torch.ones(4, 4), None, torch.float32)  # a model never loads half-accelerated
    assert build.status() == f"C kernels refused: {message}"
    assert not (tmp_path / "kernels").exists()  # nothing was compiled, let alone run


@x86_only
def test_unset_without_any_runnable_implementation_is_off(cpu: pytest.MonkeyPatch) -> None:
    describe_cpu(cpu, "flags\t\t: fpu sse2 avx")
    cpu.delenv(isa.ENV, raising=False)
    assert build.load() is None
    assert build.status() == ("C kernels off: this CPU has neither AVX-512 (avx512f, avx512bw, "
                              "avx512vl) nor AVX2 + FMA + F16C")


@pytest.mark.skipif(not isa.runnable() or shutil.which(os.environ.get("CC", "cc")) is None,
                    reason="no implementation runs here")
def test_unset_runs_the_best_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(isa.ENV, raising=False)
    assert build.isa() == isa.runnable()[0]
    assert build.library_path(isa.runnable()[0]).exists()


def test_prebuild_builds_every_runnable_implementation_unless_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isa.ENV, "0")
    assert build.prebuild() == ["C kernels off: disabled by KVSTACK_KERNELS=0"]
    monkeypatch.delenv(isa.ENV)
    lines = build.prebuild()
    assert lines[0] == build.status()
    if build.isa() is not None:  # `make install` leaves each library the tests load cached
        assert len(lines) == len(isa.runnable()) and all("built" in line for line in lines)
        assert all(build.library_path(name).exists() for name in isa.runnable())


def test_describe_names_the_implementation_and_its_flags(kernel_isa: str) -> None:
    info = build.describe()
    assert info["setting"] == kernel_isa and info["isa"] == kernel_isa
    assert info["compile_flags"] == list(isa.compile_flags(kernel_isa))
    assert build.library_path(kernel_isa).parent.name.startswith(f"{kernel_isa}-")
    assert info["dot_products"] == {"vnni": build.has_vnni(), "bf16": build.has_bf16_dot(),
                                    "amx": build.has_amx()}
    assert kernels_text(info).startswith(f"C kernels {kernel_isa}")


def test_the_bench_summary_names_the_kernels_and_the_cpu_flags() -> None:
    cpu_flags = {"avx2": True, "avx512": True, "avx512_vnni": True, "avx512_bf16": False,
                 "amx": False}
    forced_avx2 = {"isa": "avx2", "dot_products": {"vnni": False, "bf16": False},
                   "cpu": cpu_flags}
    assert kernels_text(forced_avx2) == ("C kernels avx2 (CPU: AVX-512 yes, VNNI yes, BF16 no, "
                                         "AMX no)")
    native = forced_avx2 | {"isa": "avx512", "dot_products": {"vnni": True, "bf16": False}}
    assert kernels_text(native) == ("C kernels avx512 with VNNI dot products (CPU: AVX-512 "
                                    "yes, VNNI yes, BF16 no, AMX no)")
    tiles = native | {"dot_products": {"vnni": True, "bf16": True, "amx": True},
                      "cpu": cpu_flags | {"avx512_bf16": True, "amx": True}}
    assert kernels_text(tiles) == ("C kernels avx512 with VNNI+BF16+AMX dot products (CPU: "
                                   "AVX-512 yes, VNNI yes, BF16 yes, AMX yes)")


@x86_only
def test_bench_peers_isa_the_cpu_lacks_stops_before_any_model(
        cpu: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    describe_cpu(cpu, AVX2_CPU)
    cpu.delenv(isa.ENV, raising=False)
    code = main(["bench", "peers", "--isa", "avx512", "--quick", "--model", "no-such-model",
                 "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: KVSTACK_KERNELS=avx512: this CPU lacks avx512f, "
                                 "avx512bw, avx512vl; use KVSTACK_KERNELS=avx2 or unset it"]
    assert isa.ENV not in os.environ  # the setting is the command's, not the process's
