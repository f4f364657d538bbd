"""Gemma 3's one-call decode step (`kernels/gemma_step.py`) against its decode-sized per-op
path (the same C loops one call at a time): the same bits, on dense float32 tiny models (MQA,
GQA; windows of 8 crossed) and on the 270M's GGUF type mix (Q5_0 + Q8_0 QKV in parts), once
per ISA the CPU runs; greedy text the same through batches with prefill rows, which take the
per-op path, and alone, which take the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.exactness import teacher_forced_logits
from helpers.tiny_gemma3 import make_tiny_gemma3_folder, write_tiny_gemma3_gguf

from kvstack import LLM, SamplingParams
from kvstack.kernels import gemma_step

pytestmark = pytest.mark.usefixtures("one_torch_thread", "kernel_isa")

MIX = {"attn_q": QType.Q5_0, "attn_k": QType.Q5_0, "attn_v": QType.Q8_0,
       "attn_output": QType.Q4_K, "ffn_gate": QType.Q5_0, "ffn_up": QType.Q5_0,
       "ffn_down": QType.Q6_K}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, str]]]:
    root = tmp_path_factory.mktemp("gemma3-step")
    mqa = make_tiny_gemma3_folder(root / "mqa", "mqa")
    types = {f"blk.{i}.{part}.weight": t for i in range(6) for part, t in MIX.items()}
    return {
        "mqa": (mqa, {}),
        "gqa": (make_tiny_gemma3_folder(root / "gqa", "gqa"), {}),
        "gguf-mix": (write_tiny_gemma3_gguf(mqa / "mix.gguf", mqa, QType.Q8_0, types),
                     {"quantization": "gguf"}),
    }


def make(path: Path, **kw: str) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, kv_cache_memory="4MiB", block_size=4,
               max_num_batched_tokens=64, **kw)


class StepCounter:
    """Counts the one-call steps run, or (off) makes every step take the per-op path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, off: bool = False) -> None:
        self.calls = 0
        run = gemma_step.GemmaDecodeStep.__call__

        def counted(step: gemma_step.GemmaDecodeStep, *args: object) -> None:
            assert not off, "the one-call step ran though it was turned off"
            self.calls += 1
            run(step, *args)

        monkeypatch.setattr(gemma_step.GemmaDecodeStep, "__call__", counted)


def sequences() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (50, 30, 12)], [20, 9, 3]


@pytest.mark.parametrize(("name", "kv"), [("mqa", "auto"), ("gqa", "auto"), ("gguf-mix", "auto"),
                                          ("mqa", "int8"), ("gqa", "fp8"), ("gguf-mix", "int8")])
def test_step_is_the_per_op_path_bit_for_bit(models: dict[str, tuple[Path, dict[str, str]]],
                                             name: str, kv: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized caches too: the step stores the codes and reads them with the per-op path's
    kernels, so the logits and the cache match bit for bit."""
    path, kw = models[name]
    seqs, num_prompt = sequences()
    llm = make(path, kv_cache_dtype=kv, **kw)
    counter = StepCounter(monkeypatch)
    with_step = teacher_forced_logits(llm.engine, seqs, num_prompt)
    assert counter.calls > 20  # most steps are decodes only past the prompts
    monkeypatch.undo()
    model = llm.engine.model
    monkeypatch.setattr(model, "_run_decode_step", lambda *args: False)
    per_op = teacher_forced_logits(llm.engine, seqs, num_prompt)
    assert all(torch.equal(a, b) for a, b in zip(with_step, per_op, strict=True))
    llm.engine.check_integrity()


@pytest.mark.parametrize("name", ["mqa", "gguf-mix"])
def test_greedy_same_batched_with_prefills_and_alone(
        models: dict[str, tuple[Path, dict[str, str]]], name: str) -> None:
    path, kw = models[name]
    llm = make(path, **kw)
    seqs, _ = sequences()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": s} for s in seqs]
    # A 64-token budget: the long prompts' chunks share steps with the others' decodes.
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    assert llm.engine.stats().num_blocks_used == 0
    llm.engine.check_integrity()


def test_step_off_for_bfloat16_and_torch_kernels(
        models: dict[str, tuple[Path, dict[str, str]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 models, kernels="torch" and a bfloat16 cache keep the per-op path (the step
    is float32 C over float32, int8 or fp8 caches)."""
    path, _ = models["mqa"]
    StepCounter(monkeypatch, off=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for kw in ({"dtype": "bfloat16"}, {"kernels": "torch"}, {"kv_cache_dtype": "bfloat16"}):
        out = make(path, **kw).generate([{"prompt_token_ids": [5, 6, 7]}], params)
        assert len(out[0].outputs[0].token_ids) == 6
