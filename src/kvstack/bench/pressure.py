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
    progress,
)
from kvstack.bench.format import fmt, fmt_x, per_second, ratio
from kvstack.bench.plots import new_figure, save_figure
from kvstack.bench.throughput import sizes as throughput_sizes
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams
from kvstack.units import format_bytes

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

    runs, outputs = _measure(subject, options, prompts, budgets, block_size, new_tokens)
    identical = sum(a == b for a, b in zip(outputs["constrained"], outputs["unconstrained"],
                                           strict=True))
    tput_ratio = ratio(runs["constrained"]["output_tok_s"], runs["unconstrained"]["output_tok_s"])
    plot = _plot(options, runs)
    config = {"model": options.model, "quick": options.quick, "num_requests": n,
              "prompt_tokens": prompt_len, "new_tokens": new_tokens, "block_size": block_size,
              "needed_blocks": need_blocks, "constrained_blocks": budget_blocks,
              "budget_fraction": f"1/{BUDGET_FRACTION}", "greedy": True,
              "weights": subject.weight_format}
    results = {**runs, "throughput_ratio": tput_ratio, "identical_outputs": identical,
               "all_identical": identical == n}
    return CaseResult(
        case="pressure",
        summary=_summary(config, results, budgets),
        config=config,
        results=results,
        plots=[plot],
        table=[_table_row(config, results)],
    )


def _measure(subject: Subject, options: BenchOptions, prompts: list[list[int]],
             budgets: dict[str, float], block_size: int,
             new_tokens: int) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[int]]]]:
    """Per KV budget: the run's numbers, and every request's output tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    with progress(options, 2, "pressure") as bar:
        for name, budget in budgets.items():
            llm = subject.llm(kv_cache_memory=budget, block_size=block_size,
                              max_num_seqs=len(prompts))
            runs[name], outputs[name] = _all_at_once(llm, prompts, params, new_tokens)
            del llm
            bar.update(1)
    return runs, outputs


def _all_at_once(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                 new_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Every prompt submitted at once: (the run's numbers, each request's output tokens)."""
    llm.generate({"prompt_token_ids": prompts[0][:8]},
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    before = llm.stats().num_preemptions
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    token_ids = [o.outputs[0].token_ids for o in outs]
    complete = sum(len(o.outputs[0].token_ids) == new_tokens
                   and o.outputs[0].finish_reason == "length" for o in outs)
    return {
        "kv_cache_bytes": stats.kv_cache_bytes,
        "num_blocks": stats.num_blocks_total,
        "elapsed_s": elapsed,
        "output_tokens": sum(len(t) for t in token_ids),
        "output_tok_s": per_second(sum(len(t) for t in token_ids), elapsed),
        "num_preemptions": stats.num_preemptions - before,
        "num_complete": complete,
        "num_failed": len(outs) - complete,
    }, token_ids


def _summary(config: dict[str, Any], results: dict[str, Any], budgets: dict[str, float]
             ) -> str:
    c, u = results["constrained"], results["unconstrained"]
    return (
        f"pressure: {config['num_requests']} requests (~{config['prompt_tokens']}-token prompts, "
        f"{config['new_tokens']} new tokens) in "
        f"{config['constrained_blocks']} of the {config['needed_blocks']} KV blocks they need "
        f"({format_bytes(budgets['constrained'])} of {format_bytes(budgets['unconstrained'])})"
        f" | {fmt(c['output_tok_s'], 0)} vs {fmt(u['output_tok_s'], 0)} "
        f"tok/s unconstrained ({fmt_x(results['throughput_ratio'])})"
        f" | preemptions: {c['num_preemptions']} | failed: {c['num_failed']}"
        f" | outputs identical to unconstrained: "
        f"{results['identical_outputs']}/{config['num_requests']}"
    )


def _table_row(config: dict[str, Any], results: dict[str, Any]) -> TableRow:
    c, n = results["constrained"], config["num_requests"]
    return TableRow(
        f"{n} requests in {config['constrained_blocks']} of the {config['needed_blocks']} KV "
        "blocks they need",
        f"{fmt(c['output_tok_s'], 0)} tok/s, {fmt_x(results['throughput_ratio'])} of "
        f"unconstrained; {c['num_preemptions']} preemptions, {c['num_failed']} failed, "
        f"{results['identical_outputs']}/{n} outputs identical",
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
