"""`bench ttft`: time to first token against prompt length, cold and with a prefix hit.

Each prompt is a document (Python's reference docs) cut so that, with a short question after
it, the prompt has the target length. Cold: nothing is cached. Prefix hit: the document alone
ran first, so the prompt reuses the document's full blocks and prefills only the rest (the
document's last partial block and the question). Transformers does the same in the same run: a
full prefill, and `generate` handed a copy of the document's `DynamicCache` (the copy is timed,
as a server would have to make it). One new token per request, so TTFT is the whole request;
each figure is the best of a few runs, the two engines taking turns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress
from kvstack.bench.format import fmt, fmt_x, median, per_second, ratio
from kvstack.bench.peers.hf import TransformersPeer
from kvstack.bench.plots import log_scale_y, new_figure, save_figure
from kvstack.bench.prefix import document
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams
from kvstack.units import format_ms

if TYPE_CHECKING:
    from tqdm import tqdm

LENGTHS = (128, 256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (64, 112)
QUESTION = "\n\nQ: What does the with statement do?\nA:"

Sample = dict[str, Any]  # one measured request: ttft_s, token_ids (and our cached tokens)


def sizes(quick: bool) -> tuple[tuple[int, ...], int]:
    """(prompt lengths in tokens, runs per measurement: the best counts)."""
    return (QUICK_LENGTHS, 1) if quick else (LENGTHS, 2)


def prompts(subject: Subject, length: int) -> tuple[list[int], list[int]]:
    """(document, document + question) with the whole prompt `length` tokens long."""
    question = subject.encode(QUESTION)
    doc = document(subject, length - len(question))
    return doc, doc + question


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    lengths, repeats = sizes(options.quick)
    subject.require_context(max(lengths) + 1, "the ttft benchmark")
    cases = [prompts(subject, n) for n in lengths]

    ours, theirs = _measure(subject, options, lengths, cases, repeats)
    rows = [_row(n, doc, prompt, o, t)
            for n, (doc, prompt), o, t in zip(lengths, cases, ours, theirs, strict=True)]
    plot = _plot(options, rows)
    table = _table(rows)
    cold_x = [r["cold_speedup_over_transformers"] for r in rows]
    hit_x = [r["hit_speedup_over_transformers"] for r in rows]
    return CaseResult(
        case="ttft",
        summary=_summary(options, lengths, rows),
        config={"model": options.model, "quick": options.quick, "prompt_tokens": list(lengths),
                "question": QUESTION, "document_source": "pydoc_data.topics",
                "new_tokens": 1, "best_of": repeats, "greedy": True,
                "weights": subject.weight_format, "transformers_dtype": "float32"},
        results={"lengths": rows,
                 "median_cold_speedup_over_transformers": median(cold_x),
                 "median_hit_speedup_over_transformers": median(hit_x)},
        plots=[plot],
        table=table,
    )


def _measure(subject: Subject, options: BenchOptions, lengths: tuple[int, ...],
             cases: list[tuple[list[int], list[int]]],
             repeats: int) -> tuple[list[dict[str, Sample]], list[dict[str, Sample]]]:
    """(ours, transformers): per length, the best cold run and the best prefix-hit run."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm = subject.llm(enable_prefix_caching=True,
                      max_num_batched_tokens=max(2048, max(lengths)),
                      kv_cache_memory=subject.kv_shape().bytes_for(max(lengths) + 64, 2))
    peer = subject.peer()
    llm.generate({"prompt_token_ids": cases[0][1][-8:]}, params)
    peer.generate([cases[0][1][-8:]], 1)
    ours, theirs = [], []
    # Both engines stay loaded and take turns, so a burst of load from other jobs hits both.
    with progress(options, len(lengths) * repeats * 4, "ttft") as bar:
        for doc, prompt in cases:
            best = _best_runs(llm, peer, doc, prompt, params, repeats, bar)
            ours.append({"cold": best["ours_cold"], "hit": best["ours_hit"]})
            theirs.append({"cold": best["theirs_cold"], "hit": best["theirs_hit"]})
    return ours, theirs


def _best_runs(llm: LLM, peer: TransformersPeer, doc: list[int], prompt: list[int],
               params: SamplingParams, repeats: int, bar: tqdm) -> dict[str, Sample]:
    """One prompt's fastest run of each kind: ours/theirs, cold/hit, the engines in turn."""
    doc_cache, _ = peer.prefill(doc)
    runs: dict[str, list[Sample]] = {"ours_cold": [], "ours_hit": [],
                                     "theirs_cold": [], "theirs_hit": []}
    for _ in range(repeats):
        llm.reset_prefix_cache()
        runs["ours_cold"].append(_ours_once(llm, prompt, params))
        runs["theirs_cold"].append(_peer_once(peer, prompt, None))
        llm.reset_prefix_cache()
        llm.generate({"prompt_token_ids": doc}, params)
        runs["ours_hit"].append(_ours_once(llm, prompt, params))
        runs["theirs_hit"].append(_peer_once(peer, prompt, doc_cache))
        bar.update(4)
    return {name: min(r, key=lambda run: run["ttft_s"]) for name, r in runs.items()}


def _summary(options: BenchOptions, lengths: tuple[int, ...], rows: list[dict[str, Any]]) -> str:
    cold_x = [r["cold_speedup_over_transformers"] for r in rows]
    hit_x = [r["hit_speedup_over_transformers"] for r in rows]

    def series(side: str, kind: str) -> str:
        return "/".join(fmt(r[side][f"{kind}_ttft_s"] * 1000, 0) for r in rows)

    return (
        f"ttft: prompts of {'/'.join(str(n) for n in lengths)} tokens, TTFT in ms, "
        f"{options.threads_text}"
        f" | ours cold {series('ours', 'cold')}, prefix hit {series('ours', 'hit')}"
        f" | transformers cold {series('transformers', 'cold')}, "
        f"prefix hit {series('transformers', 'hit')}"
        f" | ours faster by {'/'.join(fmt_x(x) for x in cold_x)} cold, "
        f"{'/'.join(fmt_x(x) for x in hit_x)} on a hit"
        f" | same first token as transformers: "
        f"{sum(r['ours_equals_transformers'] for r in rows)}/{len(rows)}"
    )


def _ours_once(llm: LLM, prompt: list[int], params: SamplingParams) -> Sample:
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    return {"ttft_s": out.metrics.ttft, "num_cached_tokens": out.num_cached_tokens,
            "token_ids": out.outputs[0].token_ids}


def _peer_once(peer: TransformersPeer, prompt: list[int], cache: Any | None) -> Sample:
    run = peer.generate([prompt], 1, past_key_values=cache)
    return {"ttft_s": run.ttft, "token_ids": run.token_ids[0]}


def _row(length: int, doc: list[int], prompt: list[int], ours: dict[str, Sample],
         theirs: dict[str, Sample]) -> dict[str, Any]:
    o_cold, o_hit, t_cold, t_hit = ours["cold"], ours["hit"], theirs["cold"], theirs["hit"]
    return {
        "target_tokens": length,
        "prompt_tokens": len(prompt),
        "document_tokens": len(doc),
        "ours": {
            "cold_ttft_s": o_cold["ttft_s"],
            "hit_ttft_s": o_hit["ttft_s"],
            "cold_prefill_tok_s": per_second(len(prompt), o_cold["ttft_s"]),
            "cold_num_cached_tokens": o_cold["num_cached_tokens"],
            "hit_num_cached_tokens": o_hit["num_cached_tokens"],
            "hit_speedup": ratio(o_cold["ttft_s"], o_hit["ttft_s"]),
            "hit_equals_cold": o_hit["token_ids"] == o_cold["token_ids"],
        },
        "transformers": {
            "cold_ttft_s": t_cold["ttft_s"],
            "hit_ttft_s": t_hit["ttft_s"],
            "cold_prefill_tok_s": per_second(len(prompt), t_cold["ttft_s"]),
            "hit_num_cached_tokens": len(doc),
            "hit_speedup": ratio(t_cold["ttft_s"], t_hit["ttft_s"]),
        },
        "cold_speedup_over_transformers": ratio(t_cold["ttft_s"], o_cold["ttft_s"]),
        "hit_speedup_over_transformers": ratio(t_hit["ttft_s"], o_hit["ttft_s"]),
        "ours_equals_transformers": o_cold["token_ids"] == t_cold["token_ids"],
    }


def _table(rows: list[dict[str, Any]]) -> list[TableRow]:
    table = []
    for r in rows:
        o, t = r["ours"], r["transformers"]
        table.append(TableRow(
            workload=f"TTFT, {r['prompt_tokens']}-token prompt, cold / prefix hit",
            kvstack=f"{format_ms(o['cold_ttft_s'])} / {format_ms(o['hit_ttft_s'])}",
            peer=f"transformers {format_ms(t['cold_ttft_s'])} / {format_ms(t['hit_ttft_s'])}",
            speedup=f"{fmt_x(r['cold_speedup_over_transformers'])} / "
                    f"{fmt_x(r['hit_speedup_over_transformers'])}",
        ))
    return table


def _plot(options: BenchOptions, rows: list[dict[str, Any]]) -> str:
    fig, ax = new_figure(f"Time to first token vs prompt length ({options.threads_text})",
                         "prompt tokens", "time to first token (ms)")
    lengths = [r["prompt_tokens"] for r in rows]
    for side, name, style in (("ours", "kvstack", "-"), ("transformers", "transformers", "--")):
        for kind, label, marker, color in (("cold", "cold", "o", "C3"),
                                           ("hit", "prefix hit", "s", "C0")):
            ax.plot(lengths, [r[side][f"{kind}_ttft_s"] * 1000 for r in rows],
                    marker + style, color=color, alpha=1.0 if side == "ours" else 0.6,
                    label=f"{name}, {label}")
    ax.set_xscale("log", base=2)
    log_scale_y(ax)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.legend()
    return save_figure(fig, options, "ttft.png")
