"""`bench pressure`: the throughput workload with a third of the KV memory it needs.

All requests are submitted at once, as in `bench throughput`. Unconstrained, every request
holds its blocks to the end; constrained, the scheduler admits what fits and preempts (frees
and later recomputes) the newest requests when decodes run out of blocks. Expected: fewer
tokens per second, some preemptions, and no failed request: every one finishes with the
asked-for number of tokens, and greedy outputs equal the unconstrained ones.
"""

from __future__ import annotations

import time
from typing import Any

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    distinct_prompts,
    fmt,
    fmt_x,
    new_figure,
    per_second,
    progress,
    ratio,
    save_figure,
)
from kvstack.bench.throughput import sizes as throughput_sizes
from kvstack.kv.sizing import format_bytes
from kvstack.sampling_params import SamplingParams

BUDGET_FRACTION = 3  # the constrained pool holds 1/3 of the blocks the workload needs


def num_requests(quick: bool) -> int:
    return 4 if quick else 32


def constrained_blocks(prompt_lens: list[int], new_tokens: int, block_size: int) -> tuple[int, int]:
    """(blocks the whole workload needs at once, blocks of the constrained pool).

    The pool never drops below the largest single request, which must always fit alone.
    """
    per_request = [-(-(n + new_tokens) // block_size) for n in prompt_lens]
    need = sum(per_request)
    return need, max(-(-need // BUDGET_FRACTION), max(per_request))


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    _, prompt_len, new_tokens = throughput_sizes(options.quick)
    n = num_requests(options.quick)
    prompts = distinct_prompts(subject, n, prompt_len)
    subject.require_context(max(len(p) for p in prompts) + new_tokens, "the pressure benchmark")
    block_size = 16
    need_blocks, budget_blocks = constrained_blocks([len(p) for p in prompts], new_tokens,
                                                    block_size)
    bytes_per_block = subject.kv_shape().bytes_per_token * block_size
    budgets = {"unconstrained": need_blocks * bytes_per_block,
               "constrained": budget_blocks * bytes_per_block}
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    with progress(options, 2, "pressure") as bar:
        for name, budget in budgets.items():
            llm = subject.llm(kv_cache_memory=budget, block_size=block_size, max_num_seqs=n)
            llm.generate({"prompt_token_ids": prompts[0][:8]},
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            before = llm.stats().num_preemptions
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            elapsed = time.perf_counter() - start
            stats = llm.stats()
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            complete = sum(len(o.outputs[0].token_ids) == new_tokens
                           and o.outputs[0].finish_reason == "length" for o in outs)
            runs[name] = {
                "kv_cache_bytes": stats.kv_cache_bytes,
                "num_blocks": stats.num_blocks_total,
                "elapsed_s": elapsed,
                "output_tokens": sum(len(t) for t in outputs[name]),
                "output_tok_s": per_second(sum(len(t) for t in outputs[name]), elapsed),
                "num_preemptions": stats.num_preemptions - before,
                "num_complete": complete,
                "num_failed": len(outs) - complete,
            }
            del llm
            bar.update(1)

    identical = sum(a == b for a, b in zip(outputs["constrained"], outputs["unconstrained"],
                                           strict=True))
    tput_ratio = ratio(runs["constrained"]["output_tok_s"], runs["unconstrained"]["output_tok_s"])
    c = runs["constrained"]
    plot = _plot(options, runs)
    summary = (
        f"pressure: {n} requests (~{prompt_len}-token prompts, {new_tokens} new tokens) in "
        f"{budget_blocks} of the {need_blocks} KV blocks they need "
        f"({format_bytes(budgets['constrained'])} of {format_bytes(budgets['unconstrained'])})"
        f" | {fmt(c['output_tok_s'], 0)} vs {fmt(runs['unconstrained']['output_tok_s'], 0)} "
        f"tok/s unconstrained ({fmt_x(tput_ratio)})"
        f" | preemptions: {c['num_preemptions']} | failed: {c['num_failed']}"
        f" | outputs identical to unconstrained: {identical}/{n}"
    )
    return CaseResult(
        case="pressure",
        summary=summary,
        config={"model": options.model, "quick": options.quick, "num_requests": n,
                "prompt_tokens": prompt_len, "new_tokens": new_tokens, "block_size": block_size,
                "needed_blocks": need_blocks, "constrained_blocks": budget_blocks,
                "budget_fraction": f"1/{BUDGET_FRACTION}", "greedy": True,
                "weights": subject.weight_format},
        results={**runs, "throughput_ratio": tput_ratio, "identical_outputs": identical,
                 "all_identical": identical == n},
        plots=[plot],
        table=[TableRow(
            f"{n} requests in {budget_blocks} of the {need_blocks} KV blocks they need",
            f"{fmt(c['output_tok_s'], 0)} tok/s, {fmt_x(tput_ratio)} of unconstrained; "
            f"{c['num_preemptions']} preemptions, {c['num_failed']} failed, "
            f"{identical}/{n} outputs identical",
        )],
    )


def _plot(options: BenchOptions, runs: dict[str, dict[str, Any]]) -> str:
    fig, ax = new_figure(f"Throughput under KV pressure ({options.threads_text})", "",
                         "output tokens / s")
    names = list(runs)
    bars = ax.bar(names, [runs[k]["output_tok_s"] for k in names], color=["C0", "C3"])
    labels = [f"{runs[k]['num_blocks']} blocks, {runs[k]['num_preemptions']} preemptions"
              for k in names]
    ax.bar_label(bars, labels, padding=3, fontsize="small")
    ax.margins(y=0.2)
    return save_figure(fig, options, "pressure.png")
