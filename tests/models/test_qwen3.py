"""Qwen3 and Qwen3-MoE inside the engine (paged KV, chunked prefill, batching, prefix cache,
drafts) against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on tiny random models
(tests/helpers/tiny_qwen3.py), from the HF folder and from GGUF files written from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.exactness import assert_logits_close, reference_logits, teacher_forced_logits
from helpers.tiny_qwen3 import REAL_ROUTING, VARIANTS, make_tiny_qwen3_folder, write_qwen3_gguf
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.errors import UnsupportedModelError
from kvstack.models.qwen3_config import Qwen3Config, qwen3_config
from kvstack.weights import load_checkpoint

ATOL = 1e-4  # fp32 against transformers (measured 2e-6 to 8e-6 on logits of ~5)
NUM_NEW = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequences(lengths: Sequence[int], seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


_folders: dict[str, Path] = {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-qwen3")


def folder_of(tiny_dir: Path, variant: str) -> Path:
    if variant not in _folders:
        _folders[variant] = make_tiny_qwen3_folder(tiny_dir, variant)
    return _folders[variant]


def gguf_of(tiny_dir: Path, variant: str, qtype: QType) -> Path:
    path = tiny_dir / f"{variant}-{qtype.name}.gguf"
    if not path.exists():
        write_qwen3_gguf(path, folder_of(tiny_dir, variant), qtype)
    return path


def tiny_llm(model: Path, **kwargs: Any) -> LLM:
    kwargs = {"kv_cache_memory": "4MiB", "block_size": 4} | kwargs
    return LLM(model=str(model), skip_tokenizer_init=True, **kwargs)


def hf_model(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_config_maps_dense_and_moe_fields(tiny_dir: Path) -> None:
    dense = load_checkpoint(str(folder_of(tiny_dir, "dense"))).config
    assert isinstance(dense, Qwen3Config) and not any(dense.sparse_layers)
    assert (dense.head_dim, dense.num_kv_heads, dense.rope_theta) == (64, 2, 1e6)
    mixed = load_checkpoint(str(folder_of(tiny_dir, "moe_mixed")))
    c = mixed.config
    assert isinstance(c, Qwen3Config)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 3, 256)
    assert c.sparse_layers == (False, True) and c.norm_topk_prob is False
    # decoder_sparse_step: every second layer sparse
    stepped = qwen3_config(mixed.hf_config | {"mlp_only_layers": [], "decoder_sparse_step": 2,
                                              "num_hidden_layers": 4}, Path("config.json"))
    assert stepped.sparse_layers == (False, True, False, True)
    # the GGUF file says the same (dense layers: those without a router), but renormalizes
    # the top-k weights as llama.cpp does for every qwen3moe file
    from_gguf = load_checkpoint(str(gguf_of(tiny_dir, "moe_mixed", QType.F32))).config
    assert isinstance(from_gguf, Qwen3Config) and from_gguf.norm_topk_prob
    assert dataclasses.replace(from_gguf, rms_norm_eps=c.rms_norm_eps,  # float32 in the file
                               eos_token_ids=c.eos_token_ids, norm_topk_prob=False) == c


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("num_local_experts", 4096, "num_experts=4096"),
    ("attention_bias", True, "attention_bias"),
    ("use_sliding_window", True, "sliding"),
    ("architectures", ["Qwen3NextForCausalLM"], "Qwen3NextForCausalLM.*supported: "),
])
def test_unsupported_layouts_are_refused_at_load(tiny_dir: Path, key: str, value: Any,
                                                  match: str) -> None:
    folder = folder_of(tiny_dir, "moe")
    hf = load_checkpoint(str(folder)).hf_config | {key: value}
    from kvstack.weights.checkpoint import model_config_from_hf
    with pytest.raises(UnsupportedModelError, match=match):
        model_config_from_hf(hf, Path("config.json"))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_logits_match_transformers(tiny_dir: Path, variant: str, kernels: str) -> None:
    """Three sequences batched; a 7-token budget cuts the prefills into chunks ending
    mid-block; then one-token decodes (C ops with kernels=auto)."""
    folder = folder_of(tiny_dir, variant)
    seqs, num_prompt = sequences([40, 25, 10]), [24, 13, 4]
    llm = tiny_llm(folder, max_num_batched_tokens=7, kernels=kernels)
    ours = teacher_forced_logits(llm.engine, seqs, num_prompt)
    assert_logits_close(ours, reference_logits(hf_model(folder), seqs), num_prompt, ATOL, ATOL)


@pytest.mark.parametrize("variant", ["tied", "moe"])
def test_float_gguf_matches_the_folder(tiny_dir: Path, variant: str) -> None:
    """An F32 GGUF (qwen3 / qwen3moe arch: QK-norms, router, 3-D experts) is the same model."""
    seqs, num_prompt = sequences([30, 12]), [20, 5]
    want = reference_logits(hf_model(folder_of(tiny_dir, variant)), seqs)
    ours = teacher_forced_logits(tiny_llm(gguf_of(tiny_dir, variant, QType.F32)).engine, seqs,
                                 num_prompt)
    assert_logits_close(ours, want, num_prompt, ATOL, ATOL)


@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0])
def test_gguf_blocks_run_as_they_are(tiny_dir: Path, variant: str, qtype: QType) -> None:
    """quantization="gguf": experts are slices of the 3-D blocks; the PyTorch path on them is
    the dequantized model exactly, the C kernels (int8-rounded activations) near it (measured
    relative RMS 0.015-0.026; a MoE row whose router flips near a tie, up to 0.1)."""
    path = gguf_of(tiny_dir, variant, qtype)
    seqs, num_prompt = sequences([30, 12]), [20, 5]
    want = teacher_forced_logits(tiny_llm(path, kernels="torch").engine, seqs, num_prompt)
    blocks = tiny_llm(path, quantization="gguf", kernels="torch")
    assert blocks.engine.model.num_weight_bytes < tiny_llm(path).engine.model.num_weight_bytes / 3
    got = teacher_forced_logits(blocks.engine, seqs, num_prompt)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    fast = teacher_forced_logits(tiny_llm(path, quantization="gguf").engine, seqs, num_prompt)
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(fast, want, strict=True)]
    assert max(errors) < (0.15 if variant == "moe" else 0.04), errors
    assert min(errors) > 0  # the kernels did run


@pytest.mark.parametrize("kwargs", [{"dtype": "bfloat16"}, {"quantization": "int8"},
                                    {"kv_cache_dtype": "int8"}], ids=["bf16", "int8", "kv-int8"])
@pytest.mark.parametrize("variant", ["dense", "moe_mixed"])
def test_reduced_formats_stay_near_transformers(tiny_dir: Path, kwargs: dict[str, Any],
                                                variant: str) -> None:
    """bf16 weights, int8 weights, an int8 KV cache, on logits of ~5: the dense model's
    measured max error 0.03-0.11; the MoE's up to 0.26 (a router choice near a tie flips)."""
    folder = folder_of(tiny_dir, variant)
    seqs, num_prompt = sequences([30, 12]), [20, 5]
    want = reference_logits(hf_model(folder), seqs)
    got = teacher_forced_logits(tiny_llm(folder, **kwargs).engine, seqs, num_prompt)
    errors = [(a - b).abs().max().item() for a, b in zip(got, want, strict=True)]
    assert 0 < max(errors) < (0.25 if variant == "dense" else 0.6), errors


def hf_greedy(hf: Any, prompt: Sequence[int], num_new: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=num_new, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, prompts: Sequence[Sequence[int]],
           drafts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    inputs = [{"prompt_token_ids": list(p)} | ({"draft_token_ids": list(drafts[i])} if drafts
                                               else {}) for i, p in enumerate(prompts)]
    outputs = llm.generate(inputs, params)
    llm.engine.check_integrity()
    assert llm.engine.stats().num_blocks_used == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_greedy_matches_transformers_alone_batched_chunked_prefix_and_drafts(
        tiny_dir: Path, variant: str) -> None:
    folder = folder_of(tiny_dir, variant)
    shared = sequences([16], seed=7)[0]
    prompts = [shared + tail for tail in sequences([9, 3, 14], seed=8)]
    hf = hf_model(folder)
    want = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    assert len({tuple(w) for w in want}) == len(want)
    cached = tiny_llm(folder, max_num_batched_tokens=8)
    assert greedy(cached, prompts) == want  # batched, chunked
    assert [greedy(cached, [p])[0] for p in prompts] == want  # alone, on a prefix hit
    assert cached.engine.stats().prefix_cache_hit_tokens >= 2 * 16
    # drafts: half-right guesses are verified in one step; greedy keeps its own tokens
    drafts = [w[:4] + [3, 4, 5, 6] for w in want]
    assert greedy(cached, prompts, drafts) == want
    assert greedy(tiny_llm(folder, enable_prefix_caching=False), prompts) == want


def test_gguf_of_an_unsupported_architecture_is_one_line_naming_the_supported(
        tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "qwen3next")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'qwen3next'.*qwen3, qwen3moe") as err:
        load_checkpoint(str(path))
    assert "\n" not in str(err.value)


def test_real_routing_128_experts_top8_from_gguf(tiny_dir: Path) -> None:
    """Qwen3-30B-A3B's routing (128 experts, top-8) from GGUF: F32 within 1e-4 of transformers;
    Q8_0 blocks, experts sliced from the 3-D tensors: PyTorch path = the dequantized model, C
    kernels near it (measured relative RMS 0.011-0.013)."""
    seqs, num_prompt = sequences([30, 12]), [20, 5]
    want = reference_logits(hf_model(folder_of(tiny_dir, REAL_ROUTING)), seqs)
    f32 = teacher_forced_logits(tiny_llm(gguf_of(tiny_dir, REAL_ROUTING, QType.F32)).engine,
                                seqs, num_prompt)
    assert_logits_close(f32, want, num_prompt, ATOL, ATOL)
    path = gguf_of(tiny_dir, REAL_ROUTING, QType.Q8_0)
    ref = teacher_forced_logits(tiny_llm(path, kernels="torch").engine, seqs, num_prompt)
    blocks = teacher_forced_logits(tiny_llm(path, quantization="gguf", kernels="torch").engine,
                                   seqs, num_prompt)
    assert all(torch.equal(a, b) for a, b in zip(blocks, ref, strict=True))
    fast = teacher_forced_logits(tiny_llm(path, quantization="gguf").engine, seqs, num_prompt)
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(fast, ref, strict=True)]
    assert 0 < max(errors) < 0.05, errors
