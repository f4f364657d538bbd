"""The int8 products of several rows (`gemm_q8.c`: VNNI, and AMX tiles where the CPU has them)
against the decode kernel `gemv_q8` one row at a time: the same numbers bit for bit, on shapes
with partial tiles and blocks, so a row's result never depends on how many rows share its step;
and both against the exact product of the block-quantized activations. Runs once per C-kernel
implementation this CPU executes; the AVX2 build has no such path (`gemm_q8` declines)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstack.kernels import build, isa
from kvstack.kernels.linear import Linear

pytestmark = pytest.mark.usefixtures("one_torch_thread", "kernel_isa")

# rows across the tile edges (16 x rows per AMX tile, 4 per VNNI block); n with partial groups
# of 32 / 64 W rows; k whole 64-code blocks, a partial last block (VNNI only: AMX needs whole
# blocks and hands over) and tiny
SHAPES = [(2, 100, 64), (3, 1000, 1536), (4, 3, 576), (17, 577, 640), (33, 130, 200),
          (40, 200, 2048), (128, 65, 128), (5, 33, 4)]


def _paths() -> list[str]:
    """The gemm paths this CPU runs: "vnni", and "amx" where it has AMX-INT8."""
    dots = isa.dot_products("avx512")
    return [name for name, on in (("vnni", dots["vnni"]), ("amx", dots["amx"])) if on]


@pytest.fixture(params=_paths() or ["none"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    lib = build.load()
    assert lib is not None
    if request.param == "none" or build.isa() != "avx512":
        yield "none"
        return
    before = lib.q8_use_amx(-1)
    assert lib.q8_use_amx(int(request.param == "amx")) == (request.param == "amx")
    yield request.param
    lib.q8_use_amx(int(before))


def _call(lib: Any, name: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    rows, k = x.shape
    y = torch.full((rows, w.shape[0]), float("nan"))
    ran = getattr(lib, name)(x.data_ptr(), rows, k, w.data_ptr(), w.shape[0], scale.data_ptr(),
                             bias.data_ptr(), y.data_ptr(), 2)
    return y, ran


def _block_quantized(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    out = x.double().clone()
    for lo in range(0, x.shape[1], block):
        part = x[:, lo : lo + block].float()
        step = part.abs().amax(1, keepdim=True) / 127
        out[:, lo : lo + block] = (torch.round(part / step) * step).double()
    return out


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_several_rows_give_each_rows_own_numbers(path: str, rows: int, n: int, k: int) -> None:
    lib = build.load()
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, k)  # blocks of unlike size
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(n, generator=gen) + 0.1, torch.randn(n, generator=gen)
    alone = torch.cat([_call(lib, "gemv_q8", x[r : r + 1].contiguous(), w, scale, bias)[0]
                       for r in range(rows)])
    together, ran = _call(lib, "gemm_q8", x, w, scale, bias)
    expected_path = {"none": 0, "vnni": 1, "amx": 2 if k % 64 == 0 else 1}[path]
    assert ran == expected_path
    if ran:
        assert torch.equal(together, alone)
    via_gemv, _ = _call(lib, "gemv_q8", x, w, scale, bias)  # hands over from a few rows up
    assert torch.equal(via_gemv, alone)
    exact = _block_quantized(x) @ w.double().T * scale.double() + bias.double()
    assert (alone.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_k_not_in_whole_code_groups_stays_on_the_decode_kernel(path: str) -> None:
    lib = build.load()
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 130, generator=gen), torch.randint(-127, 128, (20, 130),
                                                              generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(20, generator=gen), torch.zeros(20)
    assert _call(lib, "gemm_q8", x, w, scale, bias)[1] == 0  # 4-code groups would straddle
    y, _ = _call(lib, "gemv_q8", x, w, scale, bias)
    assert torch.equal(y[3:4], _call(lib, "gemv_q8", x[3:4].contiguous(), w, scale, bias)[0])


def test_int8_linear_takes_the_matrix_path_up_to_its_rows(path: str) -> None:
    """A `Linear` with int8 weights keeps steps up to its `max_kernel_rows` on the C kernels
    (more rows where the gemm runs), each row's result its own at every step size."""
    gen = torch.Generator().manual_seed(9)
    lin = Linear(torch.randn(96, 192, generator=gen) * 0.05, torch.randn(96, generator=gen),
                 torch.float32, quantization="int8")
    if lin.bf16_prefill and path != "none":
        assert lin.max_kernel_rows == (128 if build.has_amx() else 64)
    rows = lin.max_kernel_rows
    x = torch.randn(rows, 192, generator=gen)
    together = lin(x)
    for r in (0, 1, 17, rows - 1):
        assert torch.equal(lin(x[r : r + 1]), together[r : r + 1])
