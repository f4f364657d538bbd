"""`bench memory`: what each KV cache dtype holds in one budget, and what it costs in speed.

For every KV dtype (float32, bfloat16, int8, fp8, int4) an engine gets the same KV budget; the
case counts what it allocated (the storage tensors' bytes, scales and int4's window included)
and the tokens its pool holds, then streams one long greedy request and, after every token,
compares the KV bytes in use (blocks in use x allocated bytes per block) with `kvstack
estimate`'s figure for that many tokens (`KVShape`: they must be equal). The same request
times decode with each dtype (one run each); the int8 vs float32 ratio comes from both engines
loaded at once, taking turns for three rounds (best of each), so load from other jobs hits
both alike, at several context lengths (`DECODE_CONTEXTS`: short, the request's, long). A
window-mode run (float32, approximate) shows memory going flat once the window is full. Peak
RSS is the process's high-water mark.
"""

from __future__ import annotations

import gc
import resource
from typing import Any

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    distinct_prompts,
    progress,
)
from kvstack.bench.format import fmt, fmt_x, ratio
from kvstack.bench.plots import new_figure, save_figure
from kvstack.sampling_params import SamplingParams
from kvstack.units import format_bytes

KV_DTYPES = ("float32", "bfloat16", "int8", "fp8", "int4")
MIB = 1024**2


# Sequences the engines may run at once: int4's full-precision window pool has one block each.
_MAX_NUM_SEQS = 64


# Prompt lengths of the int8 vs float32 KV decode comparison (full run; --quick: the first).
DECODE_CONTEXTS = (40, 480, 2000)


def sizes(quick: bool) -> tuple[int, int, int, int]:
    """(KV budget bytes, prompt tokens, new tokens, window tokens)."""
    return (64 * MIB, 40, 24, 20) if quick else (256 * MIB, 480, 128, 256)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    budget, prompt_len, new_tokens, window = sizes(options.quick)
    prompt = distinct_prompts(subject, 1, prompt_len)[0]
    subject.require_context(len(prompt) + new_tokens, "the memory benchmark")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs: dict[str, dict[str, Any]] = {}
    with progress(options, len(KV_DTYPES) + 2, "memory") as bar:
        for kv_dtype in KV_DTYPES:
            runs[kv_dtype] = _measure(subject, budget, prompt, params, kv_cache_dtype=kv_dtype)
            bar.update(1)
        windowed = _measure(subject, budget, prompt, params, kv_window=window)
        bar.update(1)
        decode: dict[int, dict[str, float | None]] = {}
        for length in DECODE_CONTEXTS[:1] if options.quick else DECODE_CONTEXTS:
            if length + new_tokens <= subject.max_model_len:  # tiny models: fewer
                decode[length] = _decode_in_turns(subject, budget,
                                                  distinct_prompts(subject, 1, length)[0],
                                                  params, ("float32", "int8"))
        bar.update(1)
    for r in runs.values():
        r["tokens_vs_float32"] = ratio(r["tokens_per_budget"], runs["float32"]["tokens_per_budget"])
        r["tokens_vs_bfloat16"] = ratio(r["tokens_per_budget"],
                                        runs["bfloat16"]["tokens_per_budget"])
    speed = {n: ratio(d["int8"], d["float32"]) for n, d in decode.items()}
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    all_match = all(r["estimate_matches"] for r in runs.values())
    tokens = " / ".join(f"{r['tokens_per_budget']:,} {k}" for k, r in runs.items())
    summary = (
        f"memory: a {format_bytes(budget)} KV budget holds {tokens} tokens "
        f"(int8 {fmt_x(runs['int8']['tokens_vs_float32'])} float32, "
        f"{fmt_x(runs['int8']['tokens_vs_bfloat16'])} bfloat16) | bytes in use "
        f"{'=' if all_match else 'DIFFER FROM'} kvstack estimate at every token"
        f" | decode int8 KV vs float32 KV: "
        + ", ".join(f"{fmt_x(x)} ({n}-token prompt)" for n, x in speed.items())
        + f" | window {window}: flat at "
        f"{format_bytes(max(windowed['curve']['measured']))}"
        f" | peak RSS {peak_rss:,.0f} MiB"
    )
    return CaseResult(
        case="memory",
        summary=summary,
        config={"model": options.model, "quick": options.quick, "budget_bytes": budget,
                "prompt_tokens": len(prompt), "new_tokens": new_tokens, "kv_window": window,
                "kv_dtypes": list(KV_DTYPES), "greedy": True,
                "weights": subject.weight_format},
        results={"kv_dtypes": runs, "window": windowed, "decode_tok_s_in_turns": decode,
                 "int8_over_float32_decode": speed, "estimate_matches": all_match,
                 "peak_rss_mib": peak_rss},
        plots=[_plot(options, runs, windowed, budget)],
        table=_table(runs, decode, speed, budget),
    )


def _decode_in_turns(subject: Subject, budget: int, prompt: list[int], params: SamplingParams,
                     kv_dtypes: tuple[str, ...], rounds: int = 3) -> dict[str, float | None]:
    """Best decode tok/s of each dtype over `rounds` rounds, the engines taking turns."""
    engines = {name: subject.llm(kv_cache_memory=budget, enable_prefix_caching=False,
                                 kv_cache_dtype=name) for name in kv_dtypes}
    best: dict[str, float | None] = dict.fromkeys(kv_dtypes)
    for _ in range(rounds):
        for name, llm in engines.items():
            out = llm.generate({"prompt_token_ids": prompt}, params)[0]
            rate = out.metrics.decode_rate(len(out.outputs[0].token_ids))
            best[name] = max(best[name] or 0.0, rate or 0.0) or None
    for llm in engines.values():
        llm.close()
    return best


def _measure(subject: Subject, budget: int, prompt: list[int], params: SamplingParams,
             **kv: Any) -> dict[str, Any]:
    """Build an engine, count its allocation, stream the request; KV bytes after each token."""
    llm = subject.llm(kv_cache_memory=budget, enable_prefix_caching=False,
                      max_num_seqs=_MAX_NUM_SEQS, **kv)
    info = llm.info
    shape = info.kv_shape
    assert shape is not None
    allocated = info.kv_cache_bytes  # summed over the storage's tensors as allocated
    per_block = (allocated - shape.window_pool_bytes(_MAX_NUM_SEQS)) / info.num_kv_blocks
    curve: dict[str, list[float]] = {"tokens": [], "measured": [], "estimate": []}
    final = None
    for out in llm.stream({"prompt_token_ids": prompt}, params):
        if out.finished:  # its blocks are already back in the pool
            final = out
            continue
        held = len(prompt) + len(out.outputs[0].token_ids) - 1  # the newest token is not fed
        curve["tokens"].append(held)
        curve["measured"].append(llm.stats().num_blocks_used * per_block)
        curve["estimate"].append(shape.blocks_for(held) * shape.bytes_per_block)
    assert final is not None
    matches = (curve["measured"] == curve["estimate"] if shape.window is None else
               all(m <= e for m, e in zip(curve["measured"], curve["estimate"], strict=True)))
    result = {
        "kv_cache_dtype": info.kv_cache_dtype,
        "kv_window": info.kv_window,
        "num_blocks": info.num_kv_blocks,
        "allocated_bytes": allocated,
        "window_pool_bytes": shape.window_pool_bytes(_MAX_NUM_SEQS),
        "bytes_per_block": per_block,
        "bytes_per_block_estimate": shape.bytes_per_block,
        "tokens_per_budget": info.num_kv_blocks * info.block_size,
        "tokens_per_budget_estimate": shape.max_tokens_for_budget(budget,
                                                                  max_num_seqs=_MAX_NUM_SEQS),
        "estimate_matches": matches,
        "decode_tok_s": final.metrics.decode_rate(len(final.outputs[0].token_ids)),
        "ttft_s": final.metrics.ttft,
        "token_ids": final.outputs[0].token_ids,
        "rss_mib": _rss_mib(),
        "curve": curve,
    }
    llm.close()
    del llm
    gc.collect()
    return result


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _table(runs: dict[str, dict[str, Any]], decode: dict[int, dict[str, float | None]],
           speed: dict[int, float | None], budget: int) -> list[TableRow]:
    f32 = runs["float32"]
    rows = [
        TableRow(f"tokens in a {format_bytes(budget)} KV budget, {name} KV vs float32 KV",
                 f"{r['tokens_per_budget']:,}", f"{f32['tokens_per_budget']:,}",
                 fmt_x(r["tokens_vs_float32"]))
        for name, r in runs.items() if name != "float32"
    ]
    rows += [TableRow(f"decode tok/s, {n}-token prompt, int8 KV vs float32 KV",
                      fmt(d["int8"]), fmt(d["float32"]), fmt_x(speed[n]))
             for n, d in decode.items()]
    return rows


def _plot(options: BenchOptions, runs: dict[str, dict[str, Any]], windowed: dict[str, Any],
          budget: int) -> str:
    fig, ax = new_figure(f"KV bytes in use vs tokens held ({format_bytes(budget)} budget)",
                         "tokens held by the request", "KV MiB in use")
    for i, (name, r) in enumerate(runs.items()):
        c = r["curve"]
        ax.plot(c["tokens"], [b / MIB for b in c["measured"]], color=f"C{i}",
                label=f"{name}: {r['tokens_per_budget']:,} tokens/budget")
        ax.plot(c["tokens"], [b / MIB for b in c["estimate"]], color=f"C{i}", linestyle=":")
    c = windowed["curve"]
    ax.plot(c["tokens"], [b / MIB for b in c["measured"]], color="k",
            label=f"float32, window {windowed['kv_window']} (approximate)")
    ax.legend(fontsize="small", title="solid: measured, dotted: estimate")
    return save_figure(fig, options, "memory.png")
