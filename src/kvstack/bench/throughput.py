"""`bench throughput`: offline output tokens per second as concurrency grows.

At each concurrency c, c distinct prompts go to the engine at once (continuous batching) and
to transformers' batched `generate` (left-padded), greedy, a fixed number of new tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    distinct_prompts,
    progress,
)
from kvstack.bench.format import fmt, fmt_x, median, per_second, ratio
from kvstack.bench.peers.hf import TransformersPeer
from kvstack.bench.plots import new_figure, save_figure
from kvstack.engine.llm import LLM
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tqdm import tqdm

CONCURRENCY = (1, 4, 16, 32, 64)
QUICK_CONCURRENCY = (1, 2)


def sizes(quick: bool) -> tuple[tuple[int, ...], int, int]:
    """(concurrency levels, prompt tokens, new tokens) of the workload."""
    return (QUICK_CONCURRENCY, 16, 4) if quick else (CONCURRENCY, 128, 64)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    levels, prompt_len, new_tokens = sizes(options.quick)
    prompts = distinct_prompts(subject, max(levels), prompt_len)
    longest = max(len(p) for p in prompts) + new_tokens
    subject.require_context(longest, "the throughput benchmark")
    peer_max = options.peer_max_batch if options.peer_max_batch is not None else max(levels)

    rows = _measure(subject, options, prompts, levels, new_tokens, peer_max)
    plot = _plot(options, rows, prompt_len, new_tokens)
    return CaseResult(
        case="throughput",
        summary=_summary(rows, levels, prompt_len, new_tokens),
        config={"model": options.model, "quick": options.quick, "concurrency": list(levels),
                "prompt_tokens": prompt_len, "prompt_tokens_range": [min(map(len, prompts)),
                                                                     max(map(len, prompts))],
                "new_tokens": new_tokens, "greedy": True, "ignore_eos": True,
                "peer_max_batch": peer_max, "weights": subject.weight_format,
                "transformers_dtype": "float32"},
        results={"levels": rows},
        plots=[plot],
        table=_table(rows, prompt_len, new_tokens),
    )


def _measure(subject: Subject, options: BenchOptions, prompts: list[list[int]],
             levels: tuple[int, ...], new_tokens: int, peer_max: int) -> list[dict[str, Any]]:
    """One row per concurrency level: ours, and transformers up to `peer_max` requests."""
    longest = max(len(p) for p in prompts) + new_tokens
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm = subject.llm(max_num_seqs=max(levels),
                      kv_cache_memory=subject.kv_shape().bytes_for(longest + 16, max(levels)))
    warmup = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:8]}, warmup)
    peer = subject.peer() if peer_max >= min(levels) else None
    if peer is not None:
        peer.generate([prompts[0][:8]], 2)
    rows: list[dict[str, Any]] = []
    with progress(options, len(levels) * 2, "throughput") as bar:
        for c in levels:
            peer_at_c = peer if peer is not None and c <= peer_max else None
            rows.append(_level(llm, peer_at_c, prompts[:c], params, new_tokens, bar))
    return rows


def _level(llm: LLM, peer: TransformersPeer | None, batch: list[list[int]],
           params: SamplingParams, new_tokens: int, bar: tqdm) -> dict[str, Any]:
    """One concurrency level: the whole batch at once on ours, then on the peer if given."""
    # Prompts repeat across levels: start each level with nothing cached.
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    elapsed = time.perf_counter() - start
    bar.update(1)
    row: dict[str, Any] = {"concurrency": len(batch),
                           "ours": _ours_row(outs, elapsed, new_tokens)}
    if peer is not None:
        row["transformers"] = _peer_row(peer, batch, new_tokens)
        ours_ids = [o.outputs[0].token_ids for o in outs]
        peer_ids = row["transformers"].pop("token_ids")
        row["identical_outputs"] = sum(a == b for a, b in zip(ours_ids, peer_ids, strict=True))
    row["ours_over_transformers"] = ratio(row["ours"]["output_tok_s"],
                                          row.get("transformers", {}).get("output_tok_s"))
    bar.update(1)
    return row


def _summary(rows: list[dict[str, Any]], levels: tuple[int, ...], prompt_len: int,
             new_tokens: int) -> str:
    ours_txt = "/".join(fmt(r["ours"]["output_tok_s"], 0) for r in rows)
    peer_txt = "/".join(fmt(r.get("transformers", {}).get("output_tok_s"), 0) for r in rows)
    ratio_txt = "/".join(fmt_x(r["ours_over_transformers"]) for r in rows)
    return (
        f"throughput: output tok/s at concurrency {'/'.join(str(c) for c in levels)} "
        f"(~{prompt_len}-token prompts, {new_tokens} new tokens)"
        f" | ours {ours_txt} | transformers {peer_txt} | ours/theirs {ratio_txt}"
        f" | median ratio {fmt_x(median([r['ours_over_transformers'] for r in rows]))}"
    )


def _table(rows: list[dict[str, Any]], prompt_len: int, new_tokens: int) -> list[TableRow]:
    return [TableRow(f"output tok/s, {r['concurrency']} concurrent ~{prompt_len}-token "
                     f"prompts, {new_tokens} new tokens", fmt(r["ours"]["output_tok_s"]),
                     "transformers " + fmt(r["transformers"]["output_tok_s"])
                     if "transformers" in r else "not run",
                     fmt_x(r["ours_over_transformers"]))
            for r in rows]


def _ours_row(outs: list[RequestOutput], elapsed: float, new_tokens: int) -> dict[str, Any]:
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tok_s": per_second(generated, elapsed),
        "mean_ttft_s": sum(o.metrics.ttft or 0.0 for o in outs) / len(outs),
        "median_tpot_s": median([o.metrics.tpot for o in outs]),
        "all_complete": all(len(o.outputs[0].token_ids) == new_tokens for o in outs),
    }


def _peer_row(peer: TransformersPeer, batch: list[list[int]], new_tokens: int) -> dict[str, Any]:
    result = peer.generate(batch, new_tokens)
    generated = sum(len(t) for t in result.token_ids)
    return {
        "elapsed_s": result.elapsed,
        "output_tokens": generated,
        "output_tok_s": per_second(generated, result.elapsed),
        "ttft_s": result.ttft,
        "token_ids": result.token_ids,
    }


def _plot(options: BenchOptions, rows: list[dict[str, Any]], prompt_len: int,
          new_tokens: int) -> str:
    fig, ax = new_figure(
        f"Offline throughput (~{prompt_len}-token prompts, {new_tokens} new tokens, "
        f"{options.threads_text})",
        "concurrent requests", "output tokens / s",
    )
    ax.plot([r["concurrency"] for r in rows], [r["ours"]["output_tok_s"] for r in rows],
            "o-", label="kvstack (continuous batching)")
    peer_rows = [r for r in rows if "transformers" in r]
    ax.plot([r["concurrency"] for r in peer_rows],
            [r["transformers"]["output_tok_s"] for r in peer_rows],
            "s--", label="transformers generate (left-padded batch)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["concurrency"] for r in rows], [str(r["concurrency"]) for r in rows])
    ax.set_ylim(bottom=0)
    ax.legend()
    return save_figure(fig, options, "throughput.png")
