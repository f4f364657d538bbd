"""Prefill attention in another dtype than the model's: quantized weights' bf16 prefill where
the CPU has bf16 dot products (`kernels.linear.prefill_attention_dtype`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstack.kernels import build, isa
from kvstack.kernels.linear import Linear, prefill_attention_dtype
from kvstack.layers.attention import AttentionMetadata, PrefillSpan, paged_attention


def _meta(tokens: int, dtype: torch.dtype | None) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=None, decode_rows=None, decode_slots=None,
                             decode_mask=None, prefills=[PrefillSpan(0, tokens, tokens, None)],
                             prefill_dtype=dtype)


def test_a_prefill_span_attends_in_the_metadata_dtype() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(40, 6, 32, generator=gen)
    k, v = (torch.randn(40, 2, 32, generator=gen) for _ in range(2))
    plain = paged_attention(0, q, k, v, _meta(40, None), None)
    in_bf16 = paged_attention(0, q, k, v, _meta(40, torch.bfloat16), None)
    assert in_bf16.dtype == torch.float32  # the model's dtype comes back

    def sdpa(dtype: torch.dtype) -> torch.Tensor:
        qs, ks, vs = (t.transpose(0, 1)[None].to(dtype) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1).float()

    torch.testing.assert_close(plain, sdpa(torch.float32), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(in_bf16, sdpa(torch.bfloat16), atol=0, rtol=0)
    assert not torch.equal(in_bf16, plain)
    assert (in_bf16 - plain).abs().max() < 0.05


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_only_quantized_weights_on_a_bf16_cpu_take_it(quantization: str | None) -> None:
    w = torch.randn(40, 64)
    fast = isa.fast_bf16_matmul() and build.load() is not None
    kernels = Linear(w, None, torch.float32, quantization)
    expected = torch.bfloat16 if quantization and fast else None
    assert prefill_attention_dtype(torch.float32, [kernels]) == expected
    reference = Linear(w, None, torch.float32, quantization, use_kernels=False)
    assert prefill_attention_dtype(torch.float32, [reference]) is None
    assert prefill_attention_dtype(torch.bfloat16, [kernels]) is None
