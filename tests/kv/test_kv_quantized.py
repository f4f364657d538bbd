"""Quantized KV cache (int8, fp8, int4) and cast KV (bfloat16): error bounds per block, bytes
per block against the estimate, tokens per budget, greedy agreement with the float32 cache on
the embedded model, and the cache's other paths (prefix hits, preemption, disk tier, errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import make_tiny_hf_folder

from kvstack import LLM, SamplingParams
from kvstack.cli.main import main
from kvstack.config import ModelConfig
from kvstack.errors import InvalidRequestError
from kvstack.eval.quality import greedy_agreement, greedy_outputs
from kvstack.kv.sizing import KVShape
from kvstack.kv.storage import make_kv_storage
from kvstack.kv.storage.int4 import Int4KVStorage
from kvstack.kv.tiers.codec import BlockFault, BlockFormat

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8", "int4")
SHAPE = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=8, intermediate_size=16,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_model_len=64)
BS = 16


def kv_rows(n: int, seed: int) -> torch.Tensor:
    """[n, 2, 64] like real keys: mostly ~1, two channels ~12x larger, one row all but zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 64, generator=g)
    x[..., 5] *= 12
    x[..., 40] *= -9
    x[3] *= 1e-4
    return x


def storage(kv_dtype: str, num_blocks: int = 4) -> Any:
    return make_kv_storage(SHAPE, num_blocks, BS, kv_dtype, torch.float32, max_num_seqs=2)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_int8_and_fp8_error_bounds_per_row(kv_dtype: str) -> None:
    kv = storage(kv_dtype)
    k, v = kv_rows(3 * BS, 0), kv_rows(3 * BS, 1)
    slots = torch.arange(BS, 4 * BS)  # blocks 1-3, one write
    kv.write(1, slots, k, v)
    basis = kv.basis
    assert basis is not None and torch.allclose(basis @ basis.T, torch.eye(64), atol=1e-6)
    for x, back in zip((k, v), kv.read(1, slots), strict=True):
        want = x @ basis  # what was quantized, in the basis it is read back in
        amax = want.abs().amax(-1, keepdim=True)
        err = (back - want).abs()
        if kv_dtype == "int8":
            scale = (amax / 127).clamp(min=2.0**-14)
            assert (err <= 0.501 * scale + 1e-7).all()
        else:
            scale = (amax / 448).clamp(min=2.0**-14)
            assert (err <= want.abs() / 16 + scale / 1024 + 1e-6).all()
        # Back in the model's basis the error is small against the row's size.
        rel = (back @ basis.T - x).norm(dim=-1) / x.norm(dim=-1)
        assert rel[torch.arange(len(x)) != 3].max() < (0.01 if kv_dtype == "int8" else 0.04)


def test_kernels_torch_writes_quantized_rows_in_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine with `kernels="torch"` keeps int8 / fp8 writes on the PyTorch definition;
    otherwise (kernels built) every write is one C call."""
    from kvstack.kernels import ops as kernel_ops
    from kvstack.kv.storage.quantized import quantize_rows

    calls: list[int] = []
    monkeypatch.setattr(kernel_ops, "store_kv_quant", lambda *a, **k: calls.append(1))
    k, v = kv_rows(BS, 0), kv_rows(BS, 1)
    torch_only = make_kv_storage(SHAPE, 2, BS, "int8", torch.float32, 2, use_kernels=False)
    torch_only.write(0, torch.arange(BS), k, v)
    assert not calls
    want, scale = quantize_rows(torch.stack((k, v), 1) @ torch_only.basis, "int8")
    assert torch.equal(torch_only.kv[0][:BS], want)
    assert torch.equal(torch_only.scale[0][:BS], scale)
    if kernel_ops.available(torch.float32):
        storage("int8").write(0, torch.arange(BS), k, v)
        assert calls == [1]


def test_int4_keys_per_channel_values_per_token_newest_block_exact() -> None:
    kv = storage("int4")
    assert isinstance(kv, Int4KVStorage)
    k, v = kv_rows(40, 2), kv_rows(40, 3)
    # A 20-token prefill into blocks 2 and 0, then 20 decodes: blocks 2, 0 fill, 3 is partial.
    slots = (torch.tensor([2, 0, 3])[:, None] * BS + torch.arange(BS)).flatten()[:40]
    for layer in range(2):
        kv.write(layer, slots[:20], k[:20], v[:20])
    for i in range(20, 40):
        for layer in range(2):
            kv.write(layer, slots[i:i + 1], k[i:i + 1], v[i:i + 1])
    assert kv.num_window_blocks_used == 1  # only block 3 is still filling
    rk, rv = kv.read(1, slots)
    # The newest 8 tokens (block 3) are exact; full blocks are 4-bit.
    assert torch.equal(rk[32:], k[32:]) and torch.equal(rv[32:], v[32:])
    for block in range(2):
        rows = slice(block * BS, (block + 1) * BS)
        key_step = (k[rows].amax(0) - k[rows].amin(0)) / 15  # per channel over the block
        assert ((rk[rows] - k[rows]).abs() <= 0.5 * key_step + 2e-3 * k[rows].abs().amax(0)
                + 1e-4).all()
        value_step = (v[rows].amax(-1, keepdim=True) - v[rows].amin(-1, keepdim=True)) / 15
        assert ((rv[rows] - v[rows]).abs() <= 0.5 * value_step + 2e-3 * v[rows].abs().amax(
            -1, keepdim=True) + 1e-4).all()
    # Per-channel key ranges keep the small channels fine despite the outliers.
    assert (rk[:32, :, 0] - k[:32, :, 0]).abs().max() < 0.5
    kv.release([3])
    assert kv.num_window_blocks_used == 0


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_block_bytes_round_trip_and_equal_the_estimate(kv_dtype: str) -> None:
    kv, other = storage(kv_dtype), storage(kv_dtype)
    slots = torch.arange(BS, 2 * BS)
    for layer in range(2):
        kv.write(layer, slots, kv_rows(BS, layer), kv_rows(BS, layer + 7))
    shape = KVShape.of(SHAPE, kv_dtype, block_size=BS)
    fmt = BlockFormat("ab" * 32, kv_dtype, 2, 2, 64, BS)
    data = kv.read_block(1)
    assert data.dtype == torch.uint8
    assert data.numel() == kv.block_bytes == shape.bytes_per_block == fmt.payload_bytes
    other.write_blocks([3], data[None])
    for layer in range(2):
        for a, b in zip(kv.read(layer, slots), other.read(layer, slots + 2 * BS), strict=True):
            assert torch.equal(a, b)
    # Every allocated byte is accounted for: blocks (scales included) plus int4's window.
    assert kv.num_bytes == 4 * shape.bytes_per_block + shape.window_pool_bytes(2)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_several_blocks_written_at_once_land_each_in_its_own_block(kv_dtype: str) -> None:
    kv, other = storage(kv_dtype), storage(kv_dtype)
    slots = torch.arange(0, 2 * BS)
    for layer in range(2):
        kv.write(layer, slots, kv_rows(2 * BS, layer), kv_rows(2 * BS, layer + 7))
    before = [other.read_block(b) for b in range(2)]
    # Out of order, as a restore's free blocks come: block 0's bytes into 3, block 1's into 2.
    other.write_blocks([3, 2], torch.stack([kv.read_block(0), kv.read_block(1)]))
    assert torch.equal(other.read_block(3), kv.read_block(0))
    assert torch.equal(other.read_block(2), kv.read_block(1))
    assert all(torch.equal(other.read_block(b), before[b]) for b in range(2))
    for layer in range(2):
        for a, b in zip(kv.read(layer, slots), other.read(layer, torch.cat(
                [slots[BS:] + 2 * BS, slots[:BS] + 2 * BS])), strict=True):
            assert torch.equal(a, b)


def test_a_block_of_another_kv_dtype_is_refused_by_the_codec() -> None:
    int8 = BlockFormat("ab" * 32, "int8", 2, 2, 64, BS)
    data = int8.encode(b"h" * 32, bytes(int8.payload_bytes))
    for dtype in ("float32", "fp8", "int4"):
        with pytest.raises(BlockFault) as fault:
            BlockFormat("ab" * 32, dtype, 2, 2, 64, BS).decode(b"h" * 32, data)
        assert fault.value.kind == "layout"


# -- the embedded model ----------------------------------------------------------------------


def embedded(**kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", "64MiB")
    return LLM("smollm2-135m", num_threads=1, **kwargs)


@pytest.mark.slow
def test_tokens_per_budget_counted_from_the_allocation() -> None:
    """Same budget: int8 holds >= 1.9x the tokens of bfloat16 and >= 3.8x of float32 (scales
    included), counted from the tensors the engine allocated, which match the estimate."""
    budget = 256 * 1024**2
    tokens: dict[str, int] = {}
    for kv_dtype in ("float32", "bfloat16", "int8", "fp8", "int4"):
        llm = embedded(kv_cache_memory=budget, kv_cache_dtype=kv_dtype, skip_tokenizer_init=True)
        kv = llm.engine.kv_storage
        allocated = sum(t.numel() * t.element_size() for t in kv.tensors())
        shape = KVShape.of(llm.model_config, kv_dtype, block_size=BS)
        assert allocated <= budget
        assert allocated - shape.window_pool_bytes(64) == kv.num_blocks * shape.bytes_per_block
        assert kv.num_blocks == shape.num_blocks_for_budget(budget)
        assert llm.stats().kv_cache_bytes == allocated
        tokens[kv_dtype] = kv.num_blocks * kv.block_size
    assert tokens["int8"] >= 1.9 * tokens["bfloat16"]  # 1.94x: 64 B + a 2 B scale per row
    assert tokens["int8"] >= 3.8 * tokens["float32"]  # 3.88x
    assert tokens["fp8"] == tokens["int8"]
    assert tokens["int4"] >= 5 * tokens["float32"]  # 5.8x even after its 64-block window


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return greedy_outputs(embedded(), max_tokens=48)


@pytest.mark.slow
@pytest.mark.parametrize(("kv_dtype", "floor"), [("int8", 0.5), ("fp8", 0.3), ("int4", 0.15)])
def test_greedy_agreement_with_the_float32_cache(
    reference: list[list[int]], kv_dtype: str, floor: float
) -> None:
    """8 chat prompts x 48 greedy tokens (quality.AGREEMENT_PROMPTS), counted up to each
    prompt's first divergence. Measured (AMD EPYC): int8 0.71 (5 of 8 identical), fp8 0.57
    (2 of 8), int4 0.31 (1 of 8); bfloat16 0.97. On an Intel Xeon (AVX-512, AMX) fp8 measured
    0.35 (1 of 8) with either kernel build, and 0.35 on the commit before this session's
    changes too: which near-ties flip follows the CPU's matmul. A broken scale or slot mapping
    drops to ~0.05.
    (Greedy agreement is chaotic: one flipped near-tie ends a prompt's count; perplexity,
    `kvstack eval kv`, is the steadier measure.)"""
    ours = greedy_outputs(embedded(kv_cache_dtype=kv_dtype), max_tokens=48)
    agreement = greedy_agreement(reference, ours)
    assert agreement.token_agreement >= floor, agreement
    # The first tokens agree but for a near-tie or so: a lossy cache flips near-ties.
    assert sum(a[0] == b[0] for a, b in zip(reference, ours, strict=True)) >= 7


PROMPT = "Explain what a hash table is to a beginner, with an example in Python."


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_prefix_hit_reuses_quantized_blocks_with_the_same_output(kv_dtype: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    chat = [{"role": "user", "content": PROMPT}]
    cold = embedded(kv_cache_dtype=kv_dtype, enable_prefix_caching=False).chat(chat, params)[0]
    llm = embedded(kv_cache_dtype=kv_dtype)
    first, second = (llm.chat(chat, params)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.stats().num_blocks_used == 0
    llm.engine.check_integrity()
    if kv_dtype == "int4":
        assert llm.engine.kv_storage.num_window_blocks_used == 0


@pytest.mark.slow
def test_disk_tier_round_trip_int8_and_another_dtype_is_a_counted_miss(tmp_path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    chat = [{"role": "user", "content": PROMPT}]
    outputs = {}
    for kv_dtype in ("int8", "float32"):
        outputs[kv_dtype] = embedded(kv_cache_dtype=kv_dtype).chat(chat, params)[0]
    with embedded(kv_cache_dtype="int8", kv_disk_dir=tmp_path) as llm:
        prompt = llm.apply_chat_template(chat)
        assert llm.warm({"prompt_token_ids": prompt}) == len(prompt) // 16 * 16
    # A fresh int8 engine restores the blocks from disk: same output as computing them.
    with embedded(kv_cache_dtype="int8", kv_disk_dir=tmp_path) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.num_cached_tokens == llm.stats().tier_hit_tokens == len(prompt) // 16 * 16
        assert out.outputs[0].token_ids == outputs["int8"].outputs[0].token_ids
        assert llm.tier_stats()["disk"].faults == {}
    # A float32-KV engine on the same directory finds nothing of its own: a miss, no error.
    with embedded(kv_disk_dir=tmp_path) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        stats = llm.tier_stats()["disk"]
        assert out.num_cached_tokens == 0 and stats.hits == 0 and stats.misses >= 1
        assert out.outputs[0].token_ids == outputs["float32"].outputs[0].token_ids


def test_prefix_hashes_differ_across_kv_dtypes(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    hashes = set()
    for kv_dtype in ("auto", "float32", "int8", "fp8", "int4"):
        llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype=kv_dtype,
                  skip_tokenizer_init=True)
        hashes.add(llm.engine.kv_manager.prefix_hashes(list(range(32)), None)[0])
    assert len(hashes) == 4  # auto is float32 for this model: the same blocks


# -- preemption (tiny model) -----------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4"])
def test_preemption_with_a_quantized_cache(tmp_path: Path, kv_dtype: str) -> None:
    """int8/fp8 quantize each token alone, so a preempted request recomputed as one prefill
    gets the very K/V its decodes wrote: same outputs. int4 quantizes keys over a block once
    it is full, and a prefill chunk reads its own full blocks quantized where decodes read
    the newest block exact: it completes correctly, its tokens may differ."""
    folder = str(make_tiny_hf_folder(tmp_path, "gqa"))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(20 + 9 * i)]}
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(folder, kv_cache_memory="8MiB", kv_cache_dtype=kv_dtype,
                skip_tokenizer_init=True, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    bytes_per_block = KVShape.of(roomy.model_config, kv_dtype).bytes_per_block
    tight = LLM(folder, kv_cache_memory=12 * bytes_per_block
                + KVShape.of(roomy.model_config, kv_dtype).window_pool_bytes(8),
                kv_cache_dtype=kv_dtype, skip_tokenizer_init=True, max_num_seqs=8)
    assert tight.stats().num_blocks_total == 12
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.stats().num_preemptions > 0
    assert [len(g) for g in got] == [40] * len(prompts)
    if kv_dtype == "int4":
        assert tight.engine.kv_storage.num_window_blocks_used == 0
        assert sum(g == w for g, w in zip(got, want, strict=True)) >= len(prompts) // 2
    else:
        assert got == want
    tight.engine.check_integrity()
    assert tight.stats().num_blocks_used == 0


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "mentions"), [
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "int8", "use_kv_cache": False}, "turn the KV cache on"),
])
def test_bad_kv_cache_dtype_is_a_typed_error(kwargs: dict[str, Any], mentions: str) -> None:
    with pytest.raises(InvalidRequestError, match=mentions):
        LLM("no-such-model", **kwargs)  # refused before any model loads


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--kv-cache-dtype", "int3"],
    ["estimate", "--layers", "2", "--kv-heads", "1", "--head-dim", "3", "--seq-len", "8",
     "--kv-cache-dtype", "int4"],
])
def test_cli_refuses_bad_kv_dtypes_in_one_line(capsys: pytest.CaptureFixture[str],
                                               argv: list[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
