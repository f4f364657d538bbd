"""quantization="gguf" on tiny Gemma 3 GGUFs in the 270M's mix of types (Q8_0 tied table and v,
Q5_0 q/k/gate/up, Q4_K o, Q6_K down): the blocks' PyTorch path is the dequantized model bit for
bit, the C kernels (once per ISA the CPU runs) stay within the GGUF tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.exactness import teacher_forced_logits
from helpers.tiny_gemma3 import make_tiny_gemma3_folder, write_tiny_gemma3_gguf

from kvstack import LLM
from kvstack.kernels.gguf import ConcatLinear, GGUFLinear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Kernels vs the dequantized model, relative RMS over the logits: measured 0.022 (AVX-512) on
# this mix (the activations' int8 rounding; Llama's tiny models: 0.009-0.010).
TINY_REL_RMS = 0.04
MIX = {"attn_q": QType.Q5_0, "attn_k": QType.Q5_0, "attn_v": QType.Q8_0,
       "attn_output": QType.Q4_K, "ffn_gate": QType.Q5_0, "ffn_up": QType.Q5_0,
       "ffn_down": QType.Q6_K}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_gemma3_folder(tmp_path_factory.mktemp("tiny-gemma3-gguf"), "mqa")
    types = {f"blk.{i}.{part}.weight": t for i in range(6) for part, t in MIX.items()}
    return write_tiny_gemma3_gguf(folder / "mix.gguf", folder, QType.Q8_0, types)


def make(path: Path, **kw: str) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, kv_cache_memory="4MiB", block_size=4,
               **kw)


def logits(llm: LLM) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (60, 20)]
    return torch.cat(teacher_forced_logits(llm.engine, seqs, [40, 4]))


def test_torch_path_is_the_dequantized_model(mixed_file: Path) -> None:
    llm = make(mixed_file, quantization="gguf", kernels="torch")
    model = llm.engine.model
    assert isinstance(model.lm_head, GGUFLinear) and model.embed is model.lm_head
    layer = model.layers[0]
    assert isinstance(layer.qkv, ConcatLinear)  # Q5_0 q/k beside a Q8_0 v
    assert [p.qtype for p in layer.qkv.parts] == [QType.Q5_0, QType.Q5_0, QType.Q8_0]
    assert isinstance(layer.gate_up, GGUFLinear) and layer.gate_up.qtype == QType.Q5_0
    assert isinstance(layer.o, GGUFLinear) and layer.o.qtype == QType.Q4_K
    assert isinstance(layer.down, GGUFLinear) and layer.down.qtype == QType.Q6_K
    dense = make(mixed_file, kernels="torch")
    assert llm.info.num_weight_bytes < dense.info.num_weight_bytes / 3
    assert torch.equal(logits(llm), logits(dense))


@pytest.mark.usefixtures("kernel_isa")
def test_kernels_close_to_the_dequantized_model(mixed_file: Path) -> None:
    llm = make(mixed_file, quantization="gguf")
    want = logits(make(mixed_file, kernels="torch"))
    got = logits(llm)
    rel_rms = ((got - want).norm() / want.norm()).item()
    print(f"tiny Gemma 3 GGUF mix, kernels vs dequantized: relative RMS {rel_rms:.4f}")
    assert rel_rms <= TINY_REL_RMS
    llm.engine.check_integrity()
