"""The decode attention kernel over long, paged contexts, per layout and KV dtype, against
SDPA over what the storage reads back: contexts crossing many scattered blocks and position
chunks (the split merged afterwards), the plain single-chunk path, Llama's GQA and Gemma 3's
MQA shapes, a group wider than one register tile, head dims with a tail off the vector width,
and float32 queries over a bfloat16 cache (as `read` widens it). Once per implementation this
CPU executes (`kernel_isa`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvstack.config import ModelConfig
from kvstack.kernels import ops as kops
from kvstack.kv.storage import make_kv_storage

pytestmark = pytest.mark.usefixtures("one_torch_thread", "kernel_isa")

BLOCK = 16
# (heads, kv_heads, head_dim): SmolLM2 (GQA), Gemma 3 (MQA), a group of 8 (two register
# tiles of query heads), a dim of 40 (a tail past the AVX-512 width)
LAYOUTS = [(9, 3, 64), (4, 1, 256), (16, 2, 32), (6, 3, 40)]


def _store(heads: int, kv_heads: int, dim: int, kv_dtype: str, num_blocks: int,
           dtype: torch.dtype, gen: torch.Generator):
    shape = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=heads * dim,
                        intermediate_size=16, num_layers=1, num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=dim, max_model_len=1 << 14)
    store = make_kv_storage(shape, num_blocks, BLOCK, kv_dtype, dtype, 1)
    slots = torch.arange(num_blocks * BLOCK)
    k, v = (torch.randn(len(slots), kv_heads, dim, generator=gen) for _ in "kv")
    k[:, :, 3] *= 8  # an outlier channel, as real keys have
    store.write(0, slots, k.to(dtype), v.to(dtype))
    return store


def _paged_slots(lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Each sequence's slots: whole blocks in a random order, as a block table gives them."""
    slots = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        blocks = torch.randperm(num_blocks, generator=gen)[: (n + BLOCK - 1) // BLOCK]
        slots[b, :n] = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:n]
    return slots


def _attend(store, q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    quantized = store.quantized_tensors(0)
    if quantized is not None:
        return kops.decode_attention_quant(q, *quantized, store.basis is not None, slots, lens,
                                           scale)
    return kops.decode_attention(q, *store.stored_tensors(0), slots, lens, scale)


def _reference(store, q: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """SDPA in float32 over the storage's read-back (in the model's basis)."""
    k, v = (x.float() for x in store.read(0, slots[:n]))
    if store.basis is not None:
        k, v = k @ store.basis.float().T, v @ store.basis.float().T
    return F.scaled_dot_product_attention(
        q[:, None].float()[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("kv_dtype", "dtype"), [
    ("float32", torch.float32), ("bfloat16", torch.float32), ("bfloat16", torch.bfloat16),
    ("int8", torch.float32), ("fp8", torch.float32), ("int8", torch.bfloat16)])
def test_long_paged_context_matches_sdpa(layout: tuple[int, int, int], kv_dtype: str,
                                         dtype: torch.dtype) -> None:
    """1,500 positions over 94 scattered blocks (12 chunks merged), beside a 100-position
    sequence (one chunk: the plain softmax) and a 1-position one, in one call."""
    heads, kv_heads, dim = layout
    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks = 110
    store = _store(heads, kv_heads, dim, kv_dtype, num_blocks, dtype, gen)
    lens = [1500, 100, 1]
    slots = _paged_slots(lens, num_blocks, gen)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = _attend(store, q, slots, torch.tensor(lens))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b].float(), _reference(store, q[b], slots[b], n),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8"])
def test_split_result_is_independent_of_threads_and_batch(kv_dtype: str) -> None:
    """A long sequence's output is bit-identical with 1 or 2 threads and alone or beside
    others (units go to whichever thread is free; the split depends on positions only)."""
    gen = torch.Generator().manual_seed(2)
    store = _store(4, 1, 256, kv_dtype, 80, torch.float32, gen)
    lens = [1000, 260, 5]
    slots = _paged_slots(lens, 80, gen)
    q = torch.randn(3, 4, 256, generator=gen)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(_attend(store, q, slots, torch.tensor(lens)))
        alone = _attend(store, q[:1], slots[:1], torch.tensor(lens[:1]))
        assert torch.equal(outs[-1][0], alone[0])
    torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1])


def test_bfloat16_cache_under_float32_equals_the_widened_cache() -> None:
    """fp32 queries over a bfloat16 cache give what fp32 queries over that cache widened to
    float32 give: the kernel widens exactly and computes alike."""
    gen = torch.Generator().manual_seed(4)
    store = _store(9, 3, 64, "bfloat16", 40, torch.float32, gen)
    lens = torch.tensor([600, 37])
    slots = _paged_slots(lens.tolist(), 40, gen)
    q = torch.randn(2, 9, 64, generator=gen)
    k, v = store.stored_tensors(0)
    wide = kops.decode_attention(q, k.float(), v.float(), slots, lens, 0.125)
    assert torch.equal(kops.decode_attention(q, k, v, slots, lens, 0.125), wide)


PROMPTS = [[{"role": "user", "content": q}] for q in
           ("Name three colours.", "What is the capital of France?")]
BF16_KV = {"kv_cache_memory": "64MiB", "kv_cache_dtype": "bfloat16"}


def _greedy(llm: Any, prompts: list[Any]) -> list[list[int]]:
    from kvstack import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.chat(prompts, params)]


@pytest.fixture(scope="module")
def bf16_kv_reference() -> list[list[int]]:
    """The PyTorch path's greedy tokens (the same for every ISA: computed once)."""
    from kvstack import LLM

    return _greedy(LLM(**BF16_KV, kernels="torch"), PROMPTS)


def test_bfloat16_kv_under_float32_decodes_through_the_kernel(
        bf16_kv_reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model in float32 over a bfloat16 KV cache: decode rows take the kernel
    (they took PyTorch's gather + SDPA before) and give the PyTorch path's greedy tokens,
    batched and one request at a time."""
    from kvstack import LLM

    calls: list[torch.dtype] = []
    real = kops.decode_attention

    def counted(q: torch.Tensor, k: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(k.dtype)
        return real(q, k, *args)

    monkeypatch.setattr(kops, "decode_attention", counted)
    fast = LLM(**BF16_KV)
    assert _greedy(fast, PROMPTS) == bf16_kv_reference
    assert [_greedy(fast, [p])[0] for p in PROMPTS] == bf16_kv_reference
    assert calls and set(calls) == {torch.bfloat16}
