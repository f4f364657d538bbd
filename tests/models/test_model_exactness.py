"""Our forward pass against transformers on the same weights: every position's logits, for a
prefill and for one-token decodes through the paged KV cache; tiny models of every variant;
GGUF files of every tensor type.

Logits are taken from inside the engine: its scheduler plans the steps, its runner builds the
batch inputs (positions, slot mapping, block tables), its model runs over its KV storage. The
known continuation is fed back one token per step (teacher forcing), so decodes see exactly the
tokens the reference saw. Tests whose steps run the C kernels run once per implementation the
CPU executes (`kernel_isa`: AVX-512 and AVX2 on an AVX-512 CPU); float64 runs PyTorch's ops only.
"""

from __future__ import annotations

import copy
import pydoc_data.topics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.exactness import assert_logits_close, reference_logits, teacher_forced_logits
from helpers.tiny_models import VARIANTS, make_tiny_hf_folder, write_tiny_gguf
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.bench.peers import transformers_model
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.models import family_of
from kvstack.weights import Checkpoint, load_checkpoint

# Max |ours - transformers| on logits (fp32, same weights; the embedded model's logits reach
# ~40). The weights stay in the reference's [out, in] layout so single-row matmuls round as
# transformers' do (an [in, out] copy measured 1.4e-4 on decode rows). The float64 test below
# holds the same paths to 1e-5, so no real error (a wrong position, mask or slot moves logits
# by 1e-2 or more) hides in the fp32 slack.
PREFILL_ATOL = 1e-4
DECODE_ATOL = 1e-4
FLOAT64_ATOL = 1e-5  # measured 2e-6: rms-norm and rope tables run in fp32 in both models
TINY_ATOL = 1e-4  # tiny models' logits are ~4; measured 5e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")
per_isa = pytest.mark.usefixtures("kernel_isa")


# -- the embedded model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_sequences(embedded_checkpoint: Checkpoint) -> tuple[list[list[int]], list[int]]:
    """Three sequences with where their prefill ends: 150 tokens (9+ blocks), 70, and 14."""
    tok = load_tokenizer(embedded_checkpoint)
    topics = pydoc_data.topics.topics
    sequences = [
        tok.encode(topics["assert"])[:150],
        tok.encode(topics["if"])[:70],
        tok.encode("The capital of France is Paris. The capital of Italy is Rome."),
    ]
    assert [len(s) for s in sequences] == [150, 70, 14]
    # Decodes cross block boundaries (128, 144; 48, 64) and run batched at unequal lengths.
    return sequences, [120, 40, 5]


@pytest.fixture(scope="module")
def embedded_reference(
    hf_embedded: Any, embedded_sequences: tuple[list[list[int]], list[int]]
) -> list[torch.Tensor]:
    return reference_logits(hf_embedded, embedded_sequences[0])


@pytest.mark.slow
@per_isa
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 40], ids=["whole", "chunked"])
def test_embedded_logits_match_transformers(
    embedded_sequences: tuple[list[list[int]], list[int]],
    embedded_reference: list[torch.Tensor],
    max_num_batched_tokens: int,
) -> None:
    # A budget of 40 splits prefills into chunks that end mid-block and attend to their cached
    # prefix, and mixes decodes and prefill chunks in one step.
    llm = LLM(kv_cache_memory="64MiB", max_num_batched_tokens=max_num_batched_tokens,
              skip_tokenizer_init=True)
    sequences, num_prompt = embedded_sequences
    ours = teacher_forced_logits(llm.engine, sequences, num_prompt)
    assert_logits_close(ours, embedded_reference, num_prompt, PREFILL_ATOL, DECODE_ATOL)


@pytest.mark.slow
def test_embedded_float64_matches_transformers_float64(
    embedded_checkpoint: Checkpoint,
    hf_embedded: Any,
    embedded_sequences: tuple[list[list[int]], list[int]],
) -> None:
    """The same engine paths in float64: what is left is the math, not rounding."""
    llm = LLM(kv_cache_memory="64MiB", max_num_batched_tokens=40, skip_tokenizer_init=True)
    ckpt = embedded_checkpoint
    model = family_of(ckpt.config.architecture).create(ckpt.config, torch.float64, None, True)
    model.load_weights(ckpt.tensors)
    storage = llm.engine.kv_storage
    kv = KVCacheStorage(ckpt.config, storage.num_blocks, storage.block_size, torch.float64)
    sequences, _ = embedded_sequences
    # Fewer decodes than in float32 (each float64 step reads ~1 GB of weights); they still
    # cross blocks (144, 64) and run batched at unequal lengths.
    num_prompt = [138, 58, 5]
    ours = teacher_forced_logits(llm.engine, sequences, num_prompt, model=model, kv=kv)
    want = reference_logits(copy.deepcopy(hf_embedded).double(), sequences)
    assert_logits_close(ours, want, num_prompt, FLOAT64_ATOL, FLOAT64_ATOL)


# -- tiny random models of every variant -------------------------------------------------------


def tiny_sequences() -> tuple[list[list[int]], list[int]]:
    """Seeded random token sequences (vocab 256) and where their prefill ends. Two prefills pass
    the llama3 variant's original_max_position_embeddings (32), so its rope scaling matters."""
    g = torch.Generator().manual_seed(1234)
    sequences = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (100, 20, 60)]
    return sequences, [70, 3, 40]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


_folders: dict[tuple[Path, str], Path] = {}


def tiny_folder(tiny_dir: Path, variant: str) -> Path:
    if (tiny_dir, variant) not in _folders:
        _folders[tiny_dir, variant] = make_tiny_hf_folder(tiny_dir, variant)
    return _folders[tiny_dir, variant]


def tiny_llm(model: Path) -> LLM:
    return LLM(model=str(model), skip_tokenizer_init=True, kv_cache_memory="4MiB")


@per_isa
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_variant_logits_match_transformers(tiny_dir: Path, variant: str) -> None:
    folder = tiny_folder(tiny_dir, variant)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sequences, num_prompt = tiny_sequences()
    ours = teacher_forced_logits(tiny_llm(folder).engine, sequences, num_prompt)
    assert_logits_close(ours, reference_logits(hf, sequences), num_prompt, TINY_ATOL, TINY_ATOL)


# -- GGUF files of every tensor type -----------------------------------------------------------

# Relative RMS error of the logits, ||gguf - safetensors|| / ||safetensors||, over all positions.
# Rounding a weight is independent of the input, so each quantized matmul adds a relative RMS
# error near its weights' own (F16 2^-12, BF16 2^-9, Q8_0 ~absmax/127/sqrt(12), Q4_0
# ~absmax/8/sqrt(12), ...); about seven quantized matmuls in a row (embedding, QKV, O, gate/up,
# down per layer, head) leave the logits with 3-5x that. Bounds are 1.35-1.6x the worst measured
# over all eight types x six variants (F16 8.2e-4, BF16 7.3e-3, Q8_0 2.3e-2, Q4_0 0.37, Q4_1
# 0.31, Q4_K 0.32, Q5_K 0.16, Q6_K 0.080); unrelated weights give ~1.4. F32 is bit-for-bit the
# safetensors weights: only our-vs-transformers rounding is left (measured 8e-7).
LOGITS_REL_RMS = {
    QType.F32: 1e-5,
    QType.F16: 1.3e-3,
    QType.BF16: 1e-2,
    QType.Q8_0: 3.3e-2,
    QType.Q4_0: 0.5,
    QType.Q4_1: 0.45,
    QType.Q4_K: 0.45,
    QType.Q5_K: 0.22,
    QType.Q6_K: 0.12,
}
# The largest single-logit error relative to the largest logit, over the relative RMS error:
# measured <= 1.54, allowed 2.
MAX_TO_RMS = 2.0
# Types whose greedy tokens must follow the safetensors model's (up to a near-tie, see below).
TOKEN_EXACT_TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q8_0)
GGUF_CASES = [("gqa", q) for q in LOGITS_REL_RMS] + [
    (v, q) for v in ("mha", "mqa", "qkv_bias", "tied", "llama3_rope") for q in (QType.F32,
                                                                                QType.Q4_K)
]
NUM_NEW_TOKENS = 12


def hf_greedy(hf: Any, prompts: Sequence[Sequence[int]], num_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, EOS ignored, one prompt per call."""
    hf.generation_config.eos_token_id = None  # our own model object: nothing to restore
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([list(p)]), max_new_tokens=num_new, do_sample=False,
                          pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    assert all(len(o) == num_new for o in out)
    return out


def our_greedy(llm: LLM, prompts: Sequence[Sequence[int]], num_new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def gguf_prompts() -> list[list[int]]:
    sequences, num_prompt = tiny_sequences()
    return [s[:n] for s, n in zip(sequences, num_prompt, strict=True)]


@per_isa
@pytest.mark.parametrize(("variant", "qtype"), GGUF_CASES, ids=lambda x: getattr(x, "name", x))
def test_gguf_runs_exactly_like_transformers_on_its_weights(
    tiny_dir: Path, tmp_path: Path, variant: str, qtype: QType
) -> None:
    """Everything past dequantization (config recovery, Q/K un-permutation, rope_freqs, tied
    head) against transformers holding the very tensors our loader produced."""
    path = write_tiny_gguf(tmp_path / f"{variant}.gguf", tiny_folder(tiny_dir, variant), qtype)
    hf = transformers_model(load_checkpoint(str(path)))
    llm = tiny_llm(path)
    prompts = gguf_prompts()
    want = hf_greedy(hf, prompts, NUM_NEW_TOKENS)
    assert our_greedy(llm, prompts, NUM_NEW_TOKENS) == want
    sequences = [p + w for p, w in zip(prompts, want, strict=True)]
    num_prompt = [len(p) for p in prompts]
    ours = teacher_forced_logits(llm.engine, sequences, num_prompt)
    assert_logits_close(ours, reference_logits(hf, sequences), num_prompt, TINY_ATOL, TINY_ATOL)


@per_isa
@pytest.mark.parametrize(("variant", "qtype"), GGUF_CASES, ids=lambda x: getattr(x, "name", x))
def test_gguf_stays_within_quantization_error_of_safetensors(
    tiny_dir: Path, tmp_path: Path, variant: str, qtype: QType
) -> None:
    """The GGUF model against transformers on the original (unquantized) safetensors folder."""
    folder = tiny_folder(tiny_dir, variant)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = tiny_llm(write_tiny_gguf(tmp_path / f"{variant}.gguf", folder, qtype))
    prompts = gguf_prompts()
    want = hf_greedy(hf, prompts, NUM_NEW_TOKENS)
    sequences = [p + w for p, w in zip(prompts, want, strict=True)]
    num_prompt = [len(p) for p in prompts]
    ref_rows = reference_logits(hf, sequences)
    ref = torch.cat(ref_rows)
    err = torch.cat(teacher_forced_logits(llm.engine, sequences, num_prompt)) - ref
    bound = LOGITS_REL_RMS[qtype]
    assert (err.norm() / ref.norm()).item() <= bound
    max_err = max(MAX_TO_RMS * bound * ref.abs().max().item(), TINY_ATOL)
    assert err.abs().max().item() <= max_err
    if qtype not in TOKEN_EXACT_TYPES:
        return  # 4-6 bit: errors of ~0.1-1 on logits of ~4 make most steps near-ties
    # Greedy tokens follow the reference until a step where its winner led our choice by no
    # more than the logit error allows (2 * max_err): random tiny models have such near-ties,
    # and past one the continuations may rightly part.
    got = our_greedy(llm, prompts, NUM_NEW_TOKENS)
    num_agreed = 0
    for p, w, g, rows in zip(prompts, want, got, ref_rows, strict=True):
        d = next((i for i in range(len(w)) if g[i] != w[i]), len(w))
        num_agreed += d
        if d < len(w):
            row = rows[len(p) - 1 + d]  # the logits that chose w[d]
            assert row[w[d]] - row[g[d]] <= 2 * max_err, (d, g, w)
    if qtype is QType.F32:
        assert got == want
    assert num_agreed >= NUM_NEW_TOKENS, (num_agreed, got, want)
