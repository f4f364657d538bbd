"""`bench score`: an evaluation harness's workload -- multiple-choice questions of 4 choices
behind one shared few-shot preamble, each choice scored as the log-probability of its tokens
given the context (what lm-evaluation-harness asks through echo + logprobs).

Arms, in one run on the same weights: kvstack with the prefix cache (a scored prompt takes
the hit over blocks whose scores are kept: the preamble once, each question's context once
for its 4 choices), kvstack without it (every prompt computed whole), and transformers (a
batched forward of each full sequence, as the harness's `hf` backend does). Reported: prompt
tokens computed, wall time, scored tokens per second, and every score's difference from
transformers'.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress, topic_texts
from kvstack.bench.format import fmt, fmt_x, ratio
from kvstack.sampling_params import SamplingParams

WORDS = ("river", "stone", "garden", "window", "engine", "letter", "forest", "market",
         "bridge", "candle", "island", "ladder", "mirror", "planet", "silver", "tunnel")


def sizes(options: BenchOptions) -> tuple[int, int]:
    """(questions, preamble tokens)."""
    if options.quick:
        return 3, 64
    return options.requests or 200, 600


def workload(subject: Subject, num_questions: int, preamble_tokens: int
             ) -> tuple[list[int], list[tuple[list[int], list[list[int]]]]]:
    """The shared preamble's ids and, per question, its context (preamble + question) and its
    4 choices' ids (seeded: the same every run)."""
    rng = random.Random(0)
    preamble: list[int] = []
    for text in topic_texts():
        line = " ".join(text.split()[:40])
        preamble += subject.encode(f"Question: What does this passage describe? {line}\n"
                                   f"Answer: {rng.choice(WORDS)}\n\n")
        if len(preamble) >= preamble_tokens:
            break
    preamble = preamble[:preamble_tokens]
    questions = []
    for i in range(num_questions):
        a, b = rng.sample(WORDS, 2)
        context = preamble + subject.encode(
            f"Question {i}: Which word names a thing you find near a {a} or a {b}?\nAnswer:")
        choices = [subject.encode(" " + w) for w in rng.sample(WORDS, 4)]
        questions.append((context, choices))
    return preamble, questions


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    num_questions, preamble_tokens = sizes(options)
    preamble, questions = workload(subject, num_questions, preamble_tokens)
    sequences = [(ctx, ctx + c) for ctx, choices in questions for c in choices]
    subject.require_context(max(len(s) for _, s in sequences) + 1, "the score benchmark")
    with progress(options, 3, "score") as bar:
        cached = _ours(subject, sequences, prefix_caching=True)
        bar.update()
        uncached = _ours(subject, sequences, prefix_caching=False)
        bar.update()
        peer = _transformers(subject, sequences)
        bar.update()
    diff_cached = _max_diff(cached["scores"], peer["scores"])
    diff_uncached = _max_diff(uncached["scores"], peer["scores"])
    results: dict[str, Any] = {name: {k: v for k, v in arm.items() if k != "scores"}
               for name, arm in (("kvstack_prefix_cache", cached),
                                 ("kvstack_no_prefix_cache", uncached),
                                 ("transformers", peer))}
    results |= {"computed_ratio": cached["computed_tokens"] / uncached["computed_tokens"],
                "speedup_vs_transformers": peer["wall_s"] / cached["wall_s"],
                "speedup_vs_no_cache": uncached["wall_s"] / cached["wall_s"],
                "max_abs_diff_vs_transformers": diff_cached,
                "max_abs_diff_no_cache_vs_transformers": diff_uncached,
                "targets": {"computed_ratio<=0.2": cached["computed_tokens"]
                            <= 0.2 * uncached["computed_tokens"],
                            "speedup>=3": peer["wall_s"] >= 3 * cached["wall_s"],
                            "diff<=1e-4": diff_cached <= 1e-4}}
    summary = (f"score: {num_questions} questions x 4 choices behind a {len(preamble)}-token "
               f"preamble: prompt tokens computed {cached['computed_tokens']:,} with the cache "
               f"vs {uncached['computed_tokens']:,} without "
               f"({results['computed_ratio']:.3f}x); wall {cached['wall_s']:.1f} s vs "
               f"{uncached['wall_s']:.1f} s vs transformers {peer['wall_s']:.1f} s "
               f"({fmt_x(results['speedup_vs_transformers'])} faster); max |score - "
               f"transformers'| {diff_cached:.1e}")
    return CaseResult(
        case="score", summary=summary,
        config={"model": options.model, "quick": options.quick, "questions": num_questions,
                "choices": 4, "preamble_tokens": len(preamble), "threads": options.threads,
                "weights": subject.weight_format, "transformers_dtype": "float32",
                "preamble_source": "pydoc_data.topics"},
        results=results,
        table=[TableRow("scoring: 4-choice questions behind a shared preamble (scored tok/s)",
                        fmt(cached["scored_tokens_per_s"]), fmt(peer["scored_tokens_per_s"]),
                        fmt_x(ratio(cached["scored_tokens_per_s"],
                                    peer["scored_tokens_per_s"])))])


def _ours(subject: Subject, sequences: list[tuple[list[int], list[int]]],
          prefix_caching: bool) -> dict[str, Any]:
    """Score every sequence's continuation through the engine, as the harness asks."""
    llm = subject.llm(kv_cache_memory="1GiB", enable_prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": s} for _, s in sequences], params)
    wall = time.perf_counter() - start
    scores = [sum(lp for lp in (out.prompt_token_logprobs or [])[len(ctx):] if lp is not None)
              for (ctx, _), out in zip(sequences, outs, strict=True)]
    num_prompt = sum(len(s) for _, s in sequences)
    computed = num_prompt - sum(out.num_cached_tokens for out in outs)
    return {"wall_s": wall, "computed_tokens": computed, "prompt_tokens": num_prompt,
            "scored_tokens_per_s": num_prompt / wall, "scores": scores}


def _transformers(subject: Subject, sequences: list[tuple[list[int], list[int]]],
                  batch: int = 4) -> dict[str, Any]:
    """A batched forward of each full sequence (right-padded), log-softmax, the
    continuation's tokens gathered: the harness's `hf` loglikelihood."""
    model = subject.peer().model
    scores: list[float] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(sequences), batch):
            group = sequences[i:i + batch]
            width = max(len(s) for _, s in group)
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, (_, s) in enumerate(group):
                ids[row, :len(s)], mask[row, :len(s)] = torch.tensor(s), 1
            logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits
                                         .float(), dim=-1)
            for row, (ctx, s) in enumerate(group):
                targets = torch.tensor(s[len(ctx):])
                rows = logprobs[row, len(ctx) - 1:len(s) - 1]
                scores.append(rows.gather(1, targets[:, None]).sum().item())
    wall = time.perf_counter() - start
    num_prompt = sum(len(s) for _, s in sequences)
    return {"wall_s": wall, "computed_tokens": num_prompt, "prompt_tokens": num_prompt,
            "scored_tokens_per_s": num_prompt / wall, "scores": scores}


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
