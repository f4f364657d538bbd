"""Gemma 3 inside the engine (paged KV, chunked prefill, batching, prefix cache) against
transformers' Gemma3ForCausalLM on tiny random models (tests/helpers/tiny_gemma3.py): MQA like
the 270M and GQA, a window of 8 under 4-token blocks, local/global RoPE bases far apart, a
linearly scaled global RoPE and query_pre_attn_scalar unlike head_dim, so a mix-up of any pair,
a window one key too wide or narrow, or a missing "1 +" in a norm moves logits by 1e-2 or more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.exactness import assert_logits_close, reference_logits, teacher_forced_logits
from helpers.tiny_gemma3 import LAYER_TYPES, VARIANTS, WINDOW, make_tiny_gemma3_folder
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.errors import InvalidRequestError, UnsupportedModelError
from kvstack.kernels import build, isa
from kvstack.models.gemma3 import Gemma3ForCausalLM
from kvstack.models.gemma3_config import FULL, SLIDING, Gemma3Config, gemma3_config
from kvstack.weights import load_checkpoint

ATOL = 1e-4  # tiny models' logits are ~5; measured in the report
NUM_NEW = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequences(lengths: Sequence[int], seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-gemma3")


_folders: dict[tuple[Path, str], Path] = {}


def tiny_folder(tiny_dir: Path, variant: str) -> Path:
    if (tiny_dir, variant) not in _folders:
        _folders[tiny_dir, variant] = make_tiny_gemma3_folder(tiny_dir, variant)
    return _folders[tiny_dir, variant]


def tiny_llm(folder: Path, **kwargs: Any) -> LLM:
    kwargs = {"kv_cache_memory": "4MiB", "block_size": 4} | kwargs
    return LLM(model=str(folder), skip_tokenizer_init=True, **kwargs)


def hf_model(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_config_maps_every_gemma_field(tiny_dir: Path) -> None:
    ckpt = load_checkpoint(str(tiny_folder(tiny_dir, "mqa")))
    config = ckpt.config
    assert isinstance(config, Gemma3Config)
    assert list(config.layer_types) == LAYER_TYPES
    assert config.layer_windows() == (WINDOW, None, WINDOW, WINDOW, WINDOW, None)
    assert config.rope(SLIDING) == (1e4, None)
    assert config.rope(FULL) == (1e6, {"rope_type": "linear", "factor": 4.0})
    assert config.attn_scale == 48**-0.5
    assert config.num_kv_heads == 1
    # transformers < 5 wrote the same model with flat rope keys and a pattern.
    old = {k: v for k, v in ckpt.hf_config.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    old_config = gemma3_config(old, Path("config.json"))
    assert old_config.layer_types == (SLIDING,) * 5 + (FULL,)
    assert dataclasses.replace(old_config, layer_types=config.layer_types) == config


@pytest.mark.parametrize(("key", "value"), [
    ("final_logit_softcapping", 30.0),
    ("attn_logit_softcapping", 50.0),
    ("hidden_activation", "gelu"),
    ("use_bidirectional_attention", True),
    ("layer_types", ["chunked_attention"] * 6),
])
def test_unimplemented_gemma_options_are_refused(tiny_dir: Path, key: str, value: Any) -> None:
    hf = load_checkpoint(str(tiny_folder(tiny_dir, "mqa"))).hf_config | {key: value}
    with pytest.raises(UnsupportedModelError, match=key if key != "layer_types" else "chunked"):
        gemma3_config(hf, Path("config.json"))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_logits_match_transformers(
    tiny_dir: Path, variant: str, max_num_batched_tokens: int, kernels: str
) -> None:
    """Prefills of 5x, 2x and under the window, then one-token decodes, all batched; a budget
    of 7 tokens cuts prefills into chunks that end mid-block and mid-window. Decode rows take
    the C decode-attention kernel (kernels=auto) or SDPA (torch)."""
    folder = tiny_folder(tiny_dir, variant)
    seqs, num_prompt = sequences([60, 30, 12]), [40, 17, 5]
    llm = tiny_llm(folder, max_num_batched_tokens=max_num_batched_tokens, kernels=kernels)
    ours = teacher_forced_logits(llm.engine, seqs, num_prompt)
    assert_logits_close(ours, reference_logits(hf_model(folder), seqs), num_prompt, ATOL, ATOL)


def test_window_one_key_off_is_caught(tiny_dir: Path) -> None:
    """The window counts the query itself: one key more or fewer moves the logits."""
    folder = tiny_folder(tiny_dir, "mqa")
    seqs, num_prompt = sequences([30]), [20]
    want = reference_logits(hf_model(folder), seqs)
    llm = tiny_llm(folder)
    for window in (WINDOW - 1, WINDOW + 1):
        shifted = Gemma3ForCausalLM(
            dataclasses.replace(llm.engine.model.config, sliding_window=window), torch.float32)
        shifted.load_weights(load_checkpoint(str(folder)).tensors)
        got = teacher_forced_logits(llm.engine, seqs, num_prompt, model=shifted)
        assert (got[0] - want[0]).abs().max().item() > 1e-2


def hf_greedy(hf: Any, prompt: Sequence[int], num_new: int) -> list[int]:
    """transformers' greedy continuation (its own sliding-window KV cache), EOS ignored."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=num_new, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    llm.engine.check_integrity()
    assert llm.engine.stats().num_blocks_used == 0
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_with_and_without_prefix_cache_and_batching(
    tiny_dir: Path
) -> None:
    """Prompts sharing a 24-token prefix (three windows): run together, one at a time (the
    later ones hit the prefix cache), and with the cache off; all as transformers generates."""
    folder = tiny_folder(tiny_dir, "mqa")
    shared = sequences([24], seed=7)[0]
    prompts = [shared + tail for tail in sequences([9, 3, 14], seed=8)]
    want = [hf_greedy(hf_model(folder), p, NUM_NEW) for p in prompts]
    cached = tiny_llm(folder, max_num_batched_tokens=16)
    assert greedy(cached, prompts) == want
    assert [greedy(cached, [p])[0] for p in prompts] == want
    assert cached.engine.stats().prefix_cache_hit_tokens >= 2 * 24
    uncached = tiny_llm(folder, enable_prefix_caching=False)
    assert greedy(uncached, prompts) == want


def test_window_mode_is_refused_for_gemma3(tiny_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="kv_window"):
        tiny_llm(tiny_folder(tiny_dir, "mqa"), kv_window=16)


def test_greedy_survives_preemption(tiny_dir: Path) -> None:
    """A pool too small for all three requests at once: some are preempted and recomputed,
    and every token is still transformers'."""
    folder = tiny_folder(tiny_dir, "gqa")
    prompts = sequences([33, 30, 35], seed=9)
    want = [hf_greedy(hf_model(folder), p, NUM_NEW) for p in prompts]
    # Hybrid layout: pages of 2 layers x 2 KV heads x 64 x 4 B x K,V x 4 tokens = 8 KiB: 48
    # pages, where the three requests hold 15 (full group) + 2 x 3 (window groups) each at
    # the end, 63 together. 16-token chunks let all three in before they grow.
    llm = tiny_llm(folder, kv_cache_memory="384KiB", max_num_batched_tokens=16)
    assert llm.engine.kv_manager is not None and llm.engine.kv_manager.num_blocks == 48
    assert greedy(llm, prompts) == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_int8_kv_cache_stays_near_the_float_logits(tiny_dir: Path) -> None:
    """A lossy (int8) cache goes through the same windowed attention (read back, prefills
    included): logits near the float ones (measured 0.056 on logits of ~5)."""
    folder = tiny_folder(tiny_dir, "mqa")
    seqs, num_prompt = sequences([40]), [25]
    want = reference_logits(hf_model(folder), seqs)
    llm = tiny_llm(folder, kv_cache_dtype="int8")
    got = teacher_forced_logits(llm.engine, seqs, num_prompt)
    err = (got[0] - want[0]).abs().max().item()
    assert 0 < err < 0.15


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_quantized_prefill_attends_in_bf16_where_its_products_do(
        tiny_dir: Path, quantization: str | None) -> None:
    """As for Llama (`kernels.linear.prefill_attention_dtype`): int8 weights whose prefill
    products round to bf16 attend in bf16 too; float weights keep the model dtype."""
    llm = tiny_llm(tiny_folder(tiny_dir, VARIANTS[0]), quantization=quantization)
    bf16 = quantization is not None and isa.fast_bf16_matmul() and build.load() is not None
    assert llm.engine.model.prefill_dtype == (torch.bfloat16 if bf16 else None)
    out = llm.generate([{"prompt_token_ids": sequences([20])[0]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
