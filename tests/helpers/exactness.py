"""Logits from inside the engine (its scheduler plans the steps, its runner builds the inputs,
its model runs over its KV storage), the reference's, and their comparison."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstack import LLM, SamplingParams
from kvstack.engine.core import LLMEngine
from kvstack.kv.storage.base import KVCacheStorage


def teacher_forced_logits(
    engine: LLMEngine,
    sequences: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    model: Any = None,
    kv: KVCacheStorage | None = None,
) -> list[torch.Tensor]:
    """float64 logits [len(seq), vocab] at every position of each sequence, all run as one batch.

    Sequence i is prefilled with its first `num_prompt_tokens[i]` tokens (chunked if the step
    budget is small), then decoded one known token per step. `model`/`kv` replace the engine's
    (e.g. a float64 copy) while the engine's scheduler and runner still plan every step.
    """
    model = model or engine.model
    kv = kv or engine.kv_storage
    engine.reset_prefix_cache()  # every position is computed, none served from the cache
    requests = [
        engine.add_request(list(seq[:n]), SamplingParams(max_tokens=len(seq) - n + 1))
        for seq, n in zip(sequences, num_prompt_tokens, strict=True)
    ]
    index = {r.request_id: i for i, r in enumerate(requests)}
    rows: list[dict[int, torch.Tensor]] = [{} for _ in sequences]
    while engine.scheduler.has_unfinished():
        batch = engine.scheduler.schedule()
        input_ids, positions, meta, _ = engine.runner._prepare(batch)
        logits = model.compute_logits(model.forward(input_ids, positions, meta, kv)).double()
        # `samples` compares against the computed count, so read it before the step advances it.
        sampled = [s.samples for s in batch.scheduled]
        engine.scheduler.after_step(batch)
        row = 0
        for s, samples in zip(batch.scheduled, sampled, strict=True):
            i = index[s.request.request_id]
            for j in range(row, row + s.num_new_tokens):
                rows[i][int(positions[j])] = logits[j]
            row += s.num_new_tokens
            if samples:
                if s.request.num_tokens < len(sequences[i]):
                    s.request.output_token_ids.append(sequences[i][s.request.num_tokens])
                else:
                    engine.abort(s.request.request_id)
    assert engine.stats().num_blocks_used == 0
    engine.check_integrity()
    out = []
    for seq, r in zip(sequences, rows, strict=True):
        assert sorted(r) == list(range(len(seq)))
        out.append(torch.stack([r[p] for p in range(len(seq))]))
    return out


def reference_logits(hf: Any, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """transformers' logits over each whole sequence in one forward, as float64."""
    with torch.no_grad():
        return [hf(torch.tensor([list(s)])).logits[0].double() for s in sequences]


def assert_logits_close(
    ours: list[torch.Tensor],
    want: list[torch.Tensor],
    num_prompt_tokens: Sequence[int],
    prefill_atol: float,
    decode_atol: float,
) -> None:
    for got, ref, n in zip(ours, want, num_prompt_tokens, strict=True):
        assert got.shape == ref.shape
        prefill = (got[:n] - ref[:n]).abs().max().item()
        decode = (got[n:] - ref[n:]).abs().max().item()
        assert prefill <= prefill_atol, f"prefill rows of a {len(got)}-token sequence: {prefill}"
        assert decode <= decode_atol, f"decode rows of a {len(got)}-token sequence: {decode}"



# (prompt, one run's output tokens, another's) -> the logits row at a position of a sequence
LogitsAt = Callable[[list[int], int, int], torch.Tensor]


def assert_parts_only_at_near_ties(
    runs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], near_tie: float,
    logits_at: LogitsAt,
) -> int:
    """Each run is (prompt, want, got): two greedy continuations of the prompt. Where they
    part, the logit of want's token beats got's by at most `near_tie` (a near-tie rounding
    may flip, not a wrong token). `logits_at(seq, num_prompt, position)`: the logits row at
    `position` of `seq` (its first `num_prompt` tokens prefilled). Returns how many parted."""
    parted = 0
    for prompt, want, got in runs:
        d = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        if d is None:
            continue
        parted += 1
        row = logits_at([*prompt, *want], len(prompt), len(prompt) - 1 + d)
        assert row[want[d]] - row[got[d]] <= near_tie, (d, list(want), list(got))
    return parted


CHAT_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
                  "How do I sort a list in Python?")


def assert_chats_part_only_at_near_ties(
    reference: LLM, subject: LLM, params: SamplingParams, near_tie: float,
    logits_at: LogitsAt,
) -> None:
    """Greedy chats of a reduced format (`subject`) against its `reference` part only at
    near-ties of the reference's logits (`assert_parts_only_at_near_ties`), and not every
    chat parts."""
    chats = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    runs = [(list(ref.prompt_token_ids), ref.outputs[0].token_ids, out.outputs[0].token_ids)
            for ref, out in zip(reference.chat(chats, params), subject.chat(chats, params),
                                strict=True)]
    assert assert_parts_only_at_near_ties(runs, near_tie, logits_at) < len(chats)
    subject.engine.check_integrity()
