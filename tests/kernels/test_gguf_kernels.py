"""The GGUF-native kernels (`kernels/gguf.c`, `kernels/gguf.py`) against the `gguf` package:
every type's blocks decode to exactly the package's dequantized values; products equal the
dequantized weight times the activations as the kernel rounds them (int8 per 32-block) on
awkward shapes; a row's result does not depend on its step or the thread count; shapes and
types without a kernel are refused; the fallbacks (large steps, kernels off) and the
embedding row lookup; the embedded model's own Q4_1 and Q8_0 tensors; and the portable C
path, built without AVX2. Tests of the kernels run once per implementation this CPU executes
(`kernel_isa`)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

import kvstack.kernels
from kvstack.kernels import build, isa
from kvstack.kernels.gguf import (
    KERNEL_TYPES,
    MAX_KERNEL_ROWS,
    GGUFLinear,
    UnsupportedGGUFTensor,
    block_layout,
)
from kvstack.kernels.gguf_bench import random_blocks
from kvstack.weights.resolve import resolve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_kernels = pytest.mark.usefixtures("kernel_isa")  # skipped where none can run

TYPES = list(KERNEL_TYPES)
X8_TYPES = [QType.Q4_0, QType.Q4_1, QType.Q8_0]  # repacked 8 rows at a time (gguf_x8.c)
LEGACY = [t for t in TYPES if KERNEL_TYPES[t] == 32]
# (rows of x, out, in): rows and out not multiples of 4 or 8; legacy K = 32 x odd.
LEGACY_SHAPES = [(1, 37, 96), (3, 61, 608), (7, 4, 32), (13, 9, 160)]
K_SHAPES = [(1, 37, 256), (5, 61, 768), (10, 3, 512)]


def shapes_of(qtype: QType) -> list[tuple[int, int, int]]:
    return LEGACY_SHAPES if KERNEL_TYPES[qtype] == 32 else K_SHAPES


def dequantized(raw: np.ndarray, qtype: QType, shape: tuple[int, int]) -> torch.Tensor:
    """The gguf package's reading of the blocks, fp32 [out, in]."""
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)


def block_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: each 32-element block to int8 with scale amax / 127, in the
    kernel's own fp32 steps (d = amax / 127, round(x * (1 / d)), ties to even), so an element
    near a rounding boundary lands where the kernel puts it (in double one sometimes did not,
    and its row then missed the bound)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(blocks * (1 / scale)).double() * scale.double()).reshape(x.shape)


def assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x @ w.T with x rounded per block as the kernel does, to fp32 rounding of the sum
    (the integer dot products are exact), and within int8 rounding of the plain product."""
    xr = block_rounded(x)
    exact = xr @ w.double().T
    bound = xr.abs() @ w.double().abs().T  # sum of |terms| per output
    assert ((y.double() - exact).abs() <= 1e-5 * bound + 1e-30).all()
    plain = x.double() @ w.double().T
    assert (y.double() - plain).abs().max() <= 0.02 * plain.abs().max() + 1e-6


def assert_fp32_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None) -> None:
    """y is x @ w.T (+ bias) to fp32 rounding (relative to the sum of |terms|)."""
    exact = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    bound = x.double().abs() @ w.double().abs().T + 1
    assert ((y.double() - exact).abs() <= 1e-5 * bound).all()


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None) -> None:
    """y is x @ w.T with x and w rounded to bf16 and the sum rounded to bf16 once (+ bias)."""
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    bound = x.double().abs() @ w.double().abs().T + 1
    expected = exact + (bias.double() if bias is not None else 0)
    assert ((y.double() - expected).abs() <= 2**-8 * exact.abs() + 1e-5 * bound).all()
    # ... and not the fp32 product: the roundings show
    assert not torch.allclose(y.double(), x.double() @ w.double().T
                              + (bias.double() if bias is not None else 0), rtol=1e-6, atol=0)


def weight(qtype: QType, out: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    raw = random_blocks(qtype, out, k, np.random.default_rng(seed))
    return raw, dequantized(raw, qtype, (out, k))


# -- block layouts ------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_decode_to_the_gguf_packages_values(qtype: QType) -> None:
    out, k = 13, 512
    raw, expected = weight(qtype, out, k, 1)
    lin = GGUFLinear(raw, qtype, (out, k))
    assert torch.equal(lin.dequantize(), expected)  # the vector decoders
    lib = build.load()
    assert lib is not None
    ref = torch.empty(out, k)
    assert lib.gguf_dequantize_reference(int(qtype), lin.file_blocks().data_ptr(), k, None, out,
                                         ref.data_ptr()) == 0
    assert torch.equal(ref, expected)  # the scalar decoder, which the portable path runs
    elems, nbytes = block_layout(qtype)
    size = ctypes.c_int64()
    assert lib.gguf_block_size(int(qtype), ctypes.byref(size)) == elems
    assert size.value == nbytes and lin.num_bytes == out * k // elems * nbytes


@needs_kernels
@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_blocks_from_the_gguf_quantizer(qtype: QType) -> None:
    """Real quantizer output (Q8_0's -127..127, Q4's spread of values), not random bytes."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(19, 160, generator=gen) * 0.1
    raw = gguf.quants.quantize(w.numpy(), qtype)
    lin = GGUFLinear(raw, qtype, (19, 160))
    deq = dequantized(raw, qtype, (19, 160))
    assert torch.equal(lin.dequantize(), deq)
    x = torch.randn(6, 160, generator=gen)
    assert_product(lin(x), x, deq)


@needs_kernels
def test_activations_round_per_block_to_nearest_even() -> None:
    """The (vectorized) activation quantizer: int8 = x * (1 / d) rounded half to even with
    d = amax / 127 per block of 32, and sx = d * sum(int8), exactly as the reference; ties
    included (x = d * (n + 0.5) for a power-of-two d)."""
    lib = build.load()
    assert lib is not None
    fn = lib.gguf_quantize_x
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=gen) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[1, :31] = torch.arange(31) - 15 + 0.5  # -14.5 .. 15.5, and amax 127: d = 1, all ties
    x[1, 31] = 127.0
    x[2, 32:64] = 0  # an all-zero block: d = 1
    xq = torch.empty(3, 96, dtype=torch.int8)
    dx, sx = torch.empty(3, 3), torch.empty(3, 3)
    fn(x.data_ptr(), 3, 96, xq.data_ptr(), dx.data_ptr(), sx.data_ptr())
    blocks = x.reshape(3, 3, 32)
    amax = blocks.abs().amax(-1)
    d = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(blocks * (1 / d)[..., None])
    assert torch.equal(dx, d)
    assert torch.equal(xq.reshape(3, 3, 32), q.to(torch.int8))
    assert torch.equal(sx, d * q.sum(-1))
    assert xq[1, 14:17].tolist() == [0, 0, 2]  # -0.5, 0.5, 1.5: ties to even


# -- products -------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_product_is_the_dequantized_product(qtype: QType) -> None:
    for i, (rows, out, k) in enumerate(shapes_of(qtype)):
        raw, w = weight(qtype, out, k, 10 + i)
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, rows)[:, None]
        x[0, :32] = 0  # an all-zero block
        bias = torch.randn(out, generator=gen)
        lin = GGUFLinear(raw, qtype, (out, k), bias=bias)
        assert lin.kernel == ("gguf_gemv_x8" if qtype in X8_TYPES else "gguf_gemv")
        assert rows <= lin.max_kernel_rows
        y = lin(x)
        assert y.shape == (rows, out) and y.dtype == torch.float32
        assert_product(y - bias, x, w)


@needs_kernels
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q6_K], ids=lambda t: t.name)
def test_bfloat16_activations(qtype: QType) -> None:
    raw, w = weight(qtype, 29, 256, 3)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = GGUFLinear(raw, qtype, (29, 256))(x)
    assert y.dtype == torch.bfloat16  # the fp32 product rounded once to bf16
    exact = block_rounded(x.float()) @ w.double().T
    assert (y.double() - exact).abs().max() <= 1e-2 * exact.abs().max()


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_does_not_depend_on_its_step_or_threads(qtype: QType) -> None:
    raw, _ = weight(qtype, 45, 512, 4)
    lin = GGUFLinear(raw, qtype, (45, 512))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    together = lin(x)
    for r in (0, 4, 8):
        assert torch.equal(lin(x[r : r + 1]), together[r : r + 1])
        assert torch.equal(lin(x[: r + 1])[r], together[r])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(lin(x), together)  # output rows split between threads
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-matmul", "bf16-matmul"])
def test_prefill_sized_steps_take_the_dequantized_matmul(qtype: QType, bf16: bool) -> None:
    """In fp32 (the dequantized model's product), or in bf16 where the CPU has bf16 dot
    products (`bf16_prefill`, chosen by the CPU; both run on any CPU here)."""
    raw, w = weight(qtype, 21, 256, 6)
    bias = torch.randn(21)
    lin = GGUFLinear(raw, qtype, (21, 256), bias=bias)
    assert lin.bf16_prefill == isa.fast_bf16_matmul()
    lin.bf16_prefill = bf16
    x = torch.randn(MAX_KERNEL_ROWS + 5, 256)
    (assert_bf16_product if bf16 else assert_fp32_product)(lin(x), x, w, bias)
    # The same rows a few at a time go through the kernel (int8 activations).
    assert_product(lin(x[:4]) - bias, x[:4], w)


@needs_kernels
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_1], ids=lambda t: t.name)
def test_fusing_and_reordering_rows(qtype: QType) -> None:
    """Parts of 13 and 6 rows: fused, the x8 layout's groups of 8 straddle the parts."""
    (raw_a, w_a), (raw_b, w_b) = weight(qtype, 13, 256, 30), weight(qtype, 6, 256, 31)
    a = GGUFLinear(raw_a, qtype, (13, 256), bias=torch.arange(13.0))
    b = GGUFLinear(raw_b, qtype, (6, 256), bias=torch.arange(6.0) + 20)
    fused = GGUFLinear.cat([a, b])
    assert fused.out_features == 19 and torch.equal(fused.dequantize(), torch.cat([w_a, w_b]))
    x = torch.randn(2, 256)
    assert torch.equal(fused(x), torch.cat([a(x), b(x)], dim=1))
    index = torch.tensor([18, 0, 9, 9, 3, 12, 17, 1, 5])
    picked = fused.take_rows(index)
    assert torch.equal(picked(x), fused(x)[:, index])
    other = GGUFLinear(weight(QType.Q6_K, 2, 256, 32)[0], QType.Q6_K, (2, 256))
    with pytest.raises(UnsupportedGGUFTensor, match="different types"):
        GGUFLinear.cat([a, other])


@needs_kernels
@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_x8_layout_moves_the_files_bytes(qtype: QType) -> None:
    """Q4_0 / Q4_1 / Q8_0 are held repacked 8 rows at a time: the same bytes, moved (whole
    groups only; the last 21 % 8 rows stay as they are), back to the file's layout exactly;
    rows looked up in place (a tied embedding) and the whole dequantized weight (prefill) are
    the file's values."""
    raw, w = weight(qtype, 21, 96, 8)
    lin = GGUFLinear(raw, qtype, (21, 96))
    assert lin.x8 and lin.blocks.shape == (21, raw.size // 21)
    file_rows = torch.from_numpy(raw.copy()).reshape(21, -1)
    assert not torch.equal(lin.blocks[:16], file_rows[:16])
    assert torch.equal(lin.blocks[16:], file_rows[16:])
    assert torch.equal(torch.sort(lin.blocks.flatten()).values,
                       torch.sort(file_rows.flatten()).values)
    assert torch.equal(lin.file_blocks(), file_rows)
    ids = torch.tensor([20, 0, 7, 8, 15, 16, 3])
    assert torch.equal(lin.file_blocks(ids), file_rows[ids])
    assert torch.equal(lin.rows(ids), w[ids])
    assert torch.equal(lin.dequantize(), w)  # straight from the x8 layout, tail included
    with pytest.raises(IndexError):
        lin.file_blocks(torch.tensor([21]))
    off = GGUFLinear(raw, qtype, (21, 96), use_kernels=False)
    assert not off.x8 and torch.equal(off.blocks, file_rows)


# -- what is refused ----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K], ids=lambda t: t.name)
def test_k_quants_need_rows_of_whole_super_blocks(qtype: QType) -> None:
    with pytest.raises(UnsupportedGGUFTensor, match="multiple"):
        GGUFLinear(np.zeros(3 * 210, np.uint8), qtype, (3, 288))


@pytest.mark.parametrize("qtype", [QType.F16, QType.Q2_K, QType.Q5_K, QType.BF16],
                         ids=lambda t: t.name)
def test_types_without_a_kernel_are_refused(qtype: QType) -> None:
    with pytest.raises(UnsupportedGGUFTensor, match="no GGUF kernel"):
        GGUFLinear(np.zeros(1024, np.uint8), qtype, (2, 256))


def test_blocks_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(UnsupportedGGUFTensor, match="bytes"):
        GGUFLinear(np.zeros(100, np.uint8), QType.Q8_0, (3, 64))
    with pytest.raises(UnsupportedGGUFTensor, match="multiple"):
        GGUFLinear(np.zeros(3 * 34, np.uint8), QType.Q8_0, (3, 40))
    with pytest.raises(UnsupportedGGUFTensor, match="uint8"):
        GGUFLinear(torch.zeros(3 * 34, dtype=torch.int8), QType.Q8_0, (3, 32))


@needs_kernels
def test_the_c_kernel_refuses_what_it_cannot_run() -> None:
    lib = build.load()
    assert lib is not None
    x, w, y = torch.zeros(1, 288), torch.zeros(210 * 2, dtype=torch.uint8), torch.zeros(1, 1)
    assert lib.gguf_gemv(int(QType.Q6_K), x.data_ptr(), 1, 288, w.data_ptr(), 1, None,
                         y.data_ptr(), 1) == -1
    assert lib.gguf_gemv(int(QType.F16), x.data_ptr(), 1, 256, w.data_ptr(), 1, None,
                         y.data_ptr(), 1) == -1
    assert lib.gguf_dequantize(int(QType.Q2_K), w.data_ptr(), 256, None, 1, y.data_ptr(),
                               1) == -1


# -- fallbacks ------------------------------------------------------------------------------


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVSTACK_KERNELS", "0")
    yield


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q6_K], ids=lambda t: t.name)
def test_without_kernels_the_dequantized_weight_is_used(qtype: QType, kernels_off: None
                                                        ) -> None:
    raw, w = weight(qtype, 11, 256, 8)
    bias = torch.randn(11)
    lin = GGUFLinear(raw, qtype, (11, 256), bias=bias)
    assert lin.kernel is None
    x = torch.randn(2, 256)
    assert_fp32_product(lin(x), x, w, bias)
    assert torch.equal(lin.dequantize(), w)
    ids = torch.tensor([10, 0, 3, 3])
    assert torch.equal(lin.rows(ids), w[ids])
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_use_kernels_false_is_the_same_fallback() -> None:
    raw, w = weight(QType.Q5_0, 7, 64, 9)
    lin = GGUFLinear(raw, QType.Q5_0, (7, 64), use_kernels=False)
    x = torch.randn(1, 64)
    assert lin.kernel is None
    assert_fp32_product(lin(x), x, w)


# -- the embedded model's tensors -----------------------------------------------------------


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(resolve_model("smollm2-135m"))


@needs_kernels
def test_q8_0_embedding_rows_in_place(reader: gguf.GGUFReader) -> None:
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type == QType.Q8_0
    table = GGUFLinear.from_reader_tensor(tensor)
    vocab, hidden = table.out_features, table.in_features
    assert (vocab, hidden) == (49152, 576)
    ids = torch.tensor([0, 49151, 17, 17, 30000])
    expected = dequantized(np.asarray(tensor.data)[ids.numpy()], QType.Q8_0, (5, hidden))
    assert torch.equal(table.rows(ids), expected)
    assert table.rows(ids, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(IndexError):
        table.rows(torch.tensor([vocab]))
    # The tied head: one decode row against the whole vocabulary.
    x = torch.randn(1, hidden)
    assert_product(table(x), x, dequantized(np.asarray(tensor.data), QType.Q8_0,
                                            (vocab, hidden)))


@needs_kernels
def test_the_models_q4_1_layers(reader: gguf.GGUFReader) -> None:
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight",
             "blk.0.ffn_down.weight"]
    tensors = {t.name: t for t in reader.tensors}
    for name in names:
        tensor = tensors[name]
        assert tensor.tensor_type == QType.Q4_1
        lin = GGUFLinear.from_reader_tensor(tensor)
        w = dequantized(np.asarray(tensor.data), QType.Q4_1,
                        (lin.out_features, lin.in_features))
        x = torch.randn(3, lin.in_features)
        assert_product(lin(x), x, w)


def test_a_1d_reader_tensor_is_refused(reader: gguf.GGUFReader) -> None:
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")
    with pytest.raises(UnsupportedGGUFTensor):
        GGUFLinear.from_reader_tensor(norm)


# -- the portable C path --------------------------------------------------------------------


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_portable_c_path_without_avx2(tmp_path: Path) -> None:
    """gguf.c built for baseline x86-64 (no AVX2, no F16C: scalar decoders, software fp16)
    computes the same products; gguf_x8.c builds there and declines its layout."""
    folder = Path(kvstack.kernels.__file__).parent
    library = tmp_path / "portable.so"
    cmd = build.compile_command([folder / "gguf.c", folder / "gguf_x8.c"], library,
                                arch=("-march=x86-64", "-Werror"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lib = ctypes.CDLL(str(library))
    lib.gguf_gemv.argtypes = build._PLAIN["gguf_gemv"][0]
    lib.gguf_gemv.restype = ctypes.c_int
    assert not any(lib.gguf_x8_supported(int(qtype)) for qtype in TYPES)
    for qtype in TYPES:
        rows, out, k = shapes_of(qtype)[1]
        raw, w = weight(qtype, out, k, 20)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
        y = torch.empty(rows, out)
        blocks = torch.from_numpy(raw.copy())
        assert lib.gguf_gemv(int(qtype), x.data_ptr(), rows, k, blocks.data_ptr(), out, None,
                             y.data_ptr(), 1) == 0
        assert_product(y, x, w)
