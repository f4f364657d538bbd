"""Qwen3.5 (Gated DeltaNet + gated attention) inside the engine against transformers'
Qwen3_5ForCausalLM on a tiny random model: logits, greedy tokens alone, batched and chunked
(chunk ends off block boundaries)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_qwen3_5 import make_tiny_qwen3_5_folder
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.engine.core import LLMEngine

ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5_folder(tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def tiny_llm(folder: Path, **kwargs: Any) -> LLM:
    kwargs = {"kv_cache_memory": "8MiB", "block_size": 4, "max_num_seqs": 8} | kwargs
    return LLM(model=str(folder), skip_tokenizer_init=True, **kwargs)


def sequences(lengths: Sequence[int], seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from full forwards (no EOS handling: `ignore_eos` on our side)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def greedy(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_logits(engine: LLMEngine, seqs: Sequence[list[int]], num_prompt: Sequence[int]
                  ) -> list[torch.Tensor]:
    """Teacher-forced logits at every position, through the engine's hooks (the recurrent
    states are a hook's)."""
    engine.reset_prefix_cache()
    reqs = [engine.add_request(s[:n], SamplingParams(max_tokens=len(s) - n + 1))
            for s, n in zip(seqs, num_prompt, strict=True)]
    index = {r.request_id: i for i, r in enumerate(reqs)}
    rows: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
    while engine.scheduler.has_unfinished():
        batch = engine.scheduler.schedule()
        engine.hooks.run_before_run(batch.scheduled)
        ids, pos, meta, _ = engine.runner._prepare(batch)
        logits = engine.model.compute_logits(engine.model.forward(ids, pos, meta,
                                                                  engine.kv_storage))
        sampled = [s.samples for s in batch.scheduled]
        engine.scheduler.after_step(batch)
        engine.hooks.run_after_step(batch.scheduled)
        row = 0
        for s, samples in zip(batch.scheduled, sampled, strict=True):
            i = index[s.request.request_id]
            for j in range(row, row + s.num_new_tokens):
                rows[i][int(pos[j])] = logits[j]
            row += s.num_new_tokens
            if samples:
                if s.request.num_tokens < len(seqs[i]):
                    s.request.output_token_ids.append(seqs[i][s.request.num_tokens])
                else:
                    engine.abort(s.request.request_id)
    return [torch.stack([r[p] for p in range(len(s))]) for r, s in zip(rows, seqs, strict=True)]


def test_logits_match_transformers_batched_and_chunked(folder: Path, hf: Any) -> None:
    # 7-token chunks over 4-token blocks: chunk ends fall off block boundaries
    llm = tiny_llm(folder, max_num_batched_tokens=7)
    seqs = sequences([70, 23, 9])
    got = engine_logits(llm.engine, seqs, [50, 11, 9])
    worst = 0.0
    for seq, logits in zip(seqs, got, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        worst = max(worst, (logits - ref).abs().max().item())
    assert worst < ATOL, worst


def test_greedy_alone_batched_chunked(folder: Path, hf: Any) -> None:
    prompts = sequences([37, 5, 22], seed=3)
    want = [hf_greedy(hf, p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = tiny_llm(folder, enable_prefix_caching=False)
    assert [greedy(alone, [p], params)[0] for p in prompts] == want
    chunked = tiny_llm(folder, max_num_batched_tokens=6)
    assert greedy(chunked, prompts, params) == want


def test_estimate_counts_attention_kv_and_recurrent_state(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstack.cli.main import main

    assert main(["estimate", "--model", str(folder), "--seq-len", "64",
                 "--kv-cache-memory", "8MiB", "--max-num-seqs", "8", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    # K/V: the 2 attention layers only; state: 6 linear layers x (4 value heads x 16 x 8
    # float32 + 96 conv channels x 3 taps float32)
    assert "2 layers x 2 KV heads x 16 head dim" in out
    assert "6 linear-attention layers" in out and "(19,200 B)" in out
    # the engine sizes its pool the same way
    llm = tiny_llm(folder, kv_cache_memory="8MiB", max_num_seqs=8)
    assert llm.engine.model.state_nbytes == 19200
    assert f"= {llm.engine.kv_manager.num_blocks} blocks" in out
