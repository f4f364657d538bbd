"""`bench scale`'s random real-shape GGUF files (here at a tiny shape): they load and run as
their blocks, and a decode token's bytes count only the top-k experts of a MoE layer."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvstack import LLM, SamplingParams
from kvstack.bench.scale import decode_bytes
from kvstack.bench.scale_files import SHAPES, Shape, write_scale_file
from kvstack.layers.moe import SparseMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_MOE = Shape("qwen3moe", 256, 4, 2, 64, 0, 512, 2, tied=False, experts=16, top_k=4,
                 expert_inter=128)
TINY_DENSE = Shape("qwen3", 256, 4, 2, 64, 512, 512, 2, tied=False)


def test_real_shapes_are_the_published_ones() -> None:
    moe = SHAPES["qwen3-30b-a3b"]
    assert (moe.hidden, moe.experts, moe.top_k, moe.expert_inter, moe.layers) == (
        2048, 128, 8, 768, 48)
    assert SHAPES["qwen3-30b-a3b-active-dense"].inter == moe.top_k * moe.expert_inter


@pytest.mark.parametrize("shape", [TINY_MOE, TINY_DENSE], ids=["moe", "dense"])
def test_random_file_runs_and_counts_the_bytes_a_token_reads(tmp_path: Path,
                                                             shape: Shape) -> None:
    path = tmp_path / "tiny.gguf"
    write_scale_file(path, shape, 2)
    llm = LLM(model=str(path), quantization="gguf", skip_tokenizer_init=True,
              kv_cache_memory="4MiB")
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    model = llm.engine.model
    q4 = 18 / 32  # Q4_0 bytes per weight
    attention = (2 * 4 * 64 * 256 + 2 * 2 * 64 * 256) * q4
    head = 512 * 256 * q4
    if shape.experts:
        mlps = 4 * 3 * 128 * 256 * q4 + 16 * 256 * 4  # top-4 experts + the f32 router
        assert all(isinstance(ly.mlp, SparseMoE) for ly in model.layers)
    else:
        mlps = 3 * 512 * 256 * q4
    norms = 4 * (2 * 256 + 2 * 64)
    assert decode_bytes(model) == 2 * (attention + mlps + norms) + head + 4 * 256


def test_copied_fields_reach_the_file(tmp_path: Path) -> None:
    """bench scale_llamacpp gives its file the embedded model's tokenizer (llama.cpp needs one)."""
    from kvstack.weights.resolve import resolve_model

    source = gguf.GGUFReader(resolve_model("smollm2-135m"))
    fields = {n: f for n, f in source.fields.items() if n.startswith("tokenizer.")}
    path = tmp_path / "tok.gguf"
    write_scale_file(path, TINY_DENSE, 1, extra=fields)
    copied = gguf.GGUFReader(path).fields
    for name in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert copied[name].contents() == fields[name].contents()
