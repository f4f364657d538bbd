"""quantization="gguf": the model runs a GGUF file's own quantized blocks (`GGUFLinear`).

Two references: the same engine on the dequantized file with PyTorch ops only (kernels="torch"),
which the GGUF model's own PyTorch path must match exactly (same weights, same F.linear: this
checks the Q/K un-permutation, fusion, the tied embedding used in place and the fallbacks), and
which its C-kernel path must stay close to: the kernels round activations to int8 per 32-value
block (as llama.cpp does), an approximation whose measured error the bounds below state.
Tests of the C-kernel path run once per implementation the CPU executes (`kernel_isa`).
"""

from __future__ import annotations

import logging
import pydoc_data.topics
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.exactness import assert_chats_part_only_at_near_ties, teacher_forced_logits
from helpers.tiny_models import make_tiny_hf_folder, write_tiny_gguf

from kvstack import LLM, SamplingParams
from kvstack.cli.main import main
from kvstack.config import EngineConfig
from kvstack.errors import InvalidRequestError
from kvstack.kernels.gguf import ConcatLinear, GGUFLinear
from kvstack.kernels.linear import Linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")
per_isa = pytest.mark.usefixtures("kernel_isa")

# The embedded model (Q4_1 linears, Q8_0 tied embedding), kernels vs the dequantized reference,
# teacher-forced over 2 sequences (84 positions, logits up to ~36): measured relative RMS error
# 0.022, max |error| 1.32, argmax agreement 0.964.
EMBEDDED_REL_RMS = 0.035
EMBEDDED_MAX_ABS = 2.0
EMBEDDED_ARGMAX_AGREEMENT = 0.9
# Greedy chat continuations may part from the reference only at a near-tie: where the
# reference's winner led the GGUF model's choice by at most this (measured 0.08 and 0.11 at
# the two prompts that part; the third follows all 24 tokens).
NEAR_TIE = 0.5
# Tiny random models (logits ~3), kernels vs the dequantized reference: measured relative RMS
# 0.0086-0.0097 for Q8_0, Q4_0, Q4_1 and Q4_K alike (the error is the activations' rounding).
TINY_REL_RMS = 0.02


def embedded_sequences(llm: LLM) -> tuple[list[list[int]], list[int]]:
    tok = llm.get_tokenizer()
    sequences = [tok.encode(pydoc_data.topics.topics["if"])[:70],
                 tok.encode("The capital of France is Paris. The capital of Italy is Rome.")]
    return sequences, [40, 5]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(kv_cache_memory="64MiB", kernels="torch")


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.slow
def test_embedded_gguf_holds_the_files_blocks() -> None:
    llm = LLM(quantization="gguf", kv_cache_memory="64MiB")
    model = llm.engine.model
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.qtype == QType.Q8_0
    assert model.embed is model.lm_head  # the tied table, used in place for both
    layer = model.layers[0]
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(lin, GGUFLinear) and lin.qtype == QType.Q4_1
    assert layer.qkv.out_features == (9 + 2 * 3) * 64  # q, k, v fused
    # Fused GGUF layers run inside the one-call decode step (tests/kernels checks it against
    # the per-op path bit for bit).
    assert model._decode_step(llm.engine.kv_storage) is not None
    assert llm.info.num_weight_bytes < 100 * 2**20  # fp32: 513 MiB
    assert llm.info.quantization == "gguf"
    assert llm.info.fingerprint != LLM(kv_cache_memory="16MiB").info.fingerprint


@pytest.mark.slow
def test_embedded_gguf_torch_path_is_the_dequantized_model(reference: LLM) -> None:
    llm = LLM(quantization="gguf", kernels="torch", kv_cache_memory="64MiB")
    sequences, num_prompt = embedded_sequences(reference)
    got = teacher_forced_logits(llm.engine, sequences, num_prompt)
    want = teacher_forced_logits(reference.engine, sequences, num_prompt)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.slow
@per_isa
def test_embedded_gguf_kernels_close_to_dequantized_reference(reference: LLM) -> None:
    llm = LLM(quantization="gguf", kv_cache_memory="64MiB")
    sequences, num_prompt = embedded_sequences(reference)
    got = torch.cat(teacher_forced_logits(llm.engine, sequences, num_prompt))
    want = torch.cat(teacher_forced_logits(reference.engine, sequences, num_prompt))
    assert rel_rms(got, want) <= EMBEDDED_REL_RMS
    assert (got - want).abs().max().item() <= EMBEDDED_MAX_ABS
    agreement = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    assert agreement >= EMBEDDED_ARGMAX_AGREEMENT

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert_chats_part_only_at_near_ties(
        reference, llm, params, NEAR_TIE,
        lambda seq, n, pos: teacher_forced_logits(reference.engine, [seq], [n])[0][pos])


@pytest.mark.slow
def test_embedded_gguf_pool_integrity() -> None:
    llm = LLM(quantization="gguf", kv_cache_memory="16MiB", max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = pydoc_data.topics.topics["while"][:600]
    first = llm.generate([prompt, prompt + " Again."], params)
    again = llm.generate(prompt, params)  # a prefix-cache hit, chunked prefill, decodes
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert llm.engine.stats().num_blocks_used == 0
    llm.engine.check_integrity()


# -- tiny files: every fusion case, fallbacks, errors ------------------------------------------


def tiny_pair(path: Path) -> tuple[LLM, LLM, LLM]:
    """(gguf kernels, gguf PyTorch path, dequantized PyTorch path) on one file."""
    def make(**kw: str) -> LLM:
        return LLM(model=str(path), skip_tokenizer_init=True, kv_cache_memory="4MiB", **kw)
    return (make(quantization="gguf"), make(quantization="gguf", kernels="torch"),
            make(kernels="torch"))


def tiny_logits(llm: LLM) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    sequences = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (80, 20)]
    return torch.cat(teacher_forced_logits(llm.engine, sequences, [70, 4]))


def check_against_reference(path: Path) -> LLM:
    fast, torch_path, ref = tiny_pair(path)
    want = tiny_logits(ref)
    assert torch.equal(tiny_logits(torch_path), want)
    assert rel_rms(tiny_logits(fast), want) <= TINY_REL_RMS
    fast.engine.check_integrity()
    return fast


@per_isa
@pytest.mark.parametrize(("variant", "qtype"), [
    ("gqa", QType.Q4_0), ("qkv_bias", QType.Q8_0), ("tied", QType.Q4_1),
    ("untied", QType.Q8_0), ("mha", QType.Q4_K)], ids=lambda x: getattr(x, "name", x))
def test_tiny_gguf_matches_dequantized(tmp_path: Path, variant: str, qtype: QType) -> None:
    folder = make_tiny_hf_folder(tmp_path, variant)
    llm = check_against_reference(write_tiny_gguf(tmp_path / "t.gguf", folder, qtype))
    model = llm.engine.model
    assert isinstance(model.layers[1].qkv, GGUFLinear) and model.layers[1].qkv.qtype == qtype
    assert isinstance(model.lm_head, GGUFLinear)
    assert (model.embed is model.lm_head) == (variant == "tied")


@per_isa
def test_mixed_types_and_fallback_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    # q/k Q4_0 with v Q8_0 (as Q4_K_M mixes them) cannot fuse; up as Q5_K has no kernel.
    types = {f"blk.{i}.{name}.weight": t for i in range(2)
             for name, t in (("attn_v", QType.Q8_0), ("ffn_up", QType.Q5_K))}
    path = write_tiny_gguf(tmp_path / "mixed.gguf", make_tiny_hf_folder(tmp_path, "gqa"),
                           QType.Q4_0, types)
    with caplog.at_level(logging.WARNING, logger="kvstack.weights"):
        llm = check_against_reference(path)
    notices = [r.getMessage() for r in caplog.records if r.name == "kvstack.weights"]
    assert len(notices) == 1 and "2 Q5_K" in notices[0] and "\n" not in notices[0]
    model = llm.engine.model
    assert model._decode_step(llm.engine.kv_storage) is None  # unfused parts: layer by layer
    layer = model.layers[0]
    assert isinstance(layer.qkv, ConcatLinear)
    assert [type(p) for p in layer.qkv.parts] == [GGUFLinear] * 3
    assert isinstance(layer.gate_up, ConcatLinear)
    assert [type(p) for p in layer.gate_up.parts] == [GGUFLinear, Linear]


def test_unquantized_file_falls_back_to_the_one_call_decode_step(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "f16.gguf", make_tiny_hf_folder(tmp_path, "gqa"),
                           QType.F16)
    llm = LLM(model=str(path), skip_tokenizer_init=True, kv_cache_memory="4MiB",
              quantization="gguf")
    plain = LLM(model=str(path), skip_tokenizer_init=True, kv_cache_memory="4MiB")
    model = llm.engine.model
    assert all(isinstance(lin, Linear) for lin in (model.lm_head, model.layers[0].qkv))
    assert (model._decode_step(llm.engine.kv_storage) is None) == (
        plain.engine.model._decode_step(plain.engine.kv_storage) is None)
    assert torch.equal(tiny_logits(llm), tiny_logits(plain))


def test_gguf_refuses_a_hugging_face_folder(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    with pytest.raises(InvalidRequestError, match="not a .gguf file") as err:
        LLM(model=str(folder), skip_tokenizer_init=True, quantization="gguf")
    assert "\n" not in str(err.value)
    code = main(["generate", "--model", str(folder), "--quantization", "gguf", "--prompt", "hi"])
    assert code == 2


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="'int8', 'gguf' or None"):
        EngineConfig(model="smollm2-135m", quantization="q4_1")
