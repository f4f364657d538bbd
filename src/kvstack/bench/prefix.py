"""`bench prefix`: time to first token when a long shared document is already cached.

Every prompt is the same document (Python's reference docs, ~2,000 tokens) followed by a
different short question. Cold: the prefix cache is reset before each question. Warm: one
priming request caches the document, then each question reuses its blocks and prefills only
its own tail. The peer does the same with transformers: a full prefill per question (cold),
and a deep copy of the document's `DynamicCache` handed to `generate` (warm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress, topic_texts
from kvstack.bench.format import fmt, fmt_x, median, ratio
from kvstack.bench.plots import log_scale_y, new_figure, save_figure
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams
from kvstack.units import format_ms

if TYPE_CHECKING:
    from tqdm import tqdm

QUESTIONS = (
    "What does the with statement do?",
    "How is an assert statement evaluated?",
    "When does the else clause of a for loop run?",
    "What is the difference between is and ==?",
    "What does the global statement change?",
)
# Caches the document in the warm pass; never one of the measured questions.
PRIMER = "Summarize the document in one sentence."

Sample = dict[str, Any]  # one measured request: ttft_s, token_ids (and our cached tokens)


def sizes(quick: bool) -> tuple[int, int, int]:
    """(document tokens, questions, new tokens per answer)."""
    return (64, 2, 2) if quick else (2000, len(QUESTIONS), 4)


def document(subject: Subject, num_tokens: int) -> list[int]:
    ids: list[int] = []
    for text in topic_texts():
        ids += subject.encode(text)
        if len(ids) >= num_tokens:
            break
    return ids[:num_tokens]


def with_question(subject: Subject, doc: list[int], question: str) -> list[int]:
    # Encoded apart and joined as ids, so every prompt starts with exactly the same tokens.
    return doc + subject.encode(f"\n\nQuestion: {question}\nAnswer:")


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    doc_len, num_questions, new_tokens = sizes(options.quick)
    doc = document(subject, doc_len)
    questions = QUESTIONS[:num_questions]
    prompts = [with_question(subject, doc, q) for q in questions]
    primer = with_question(subject, doc, PRIMER)
    longest = max(len(p) for p in [*prompts, primer]) + new_tokens
    subject.require_context(longest, "the prefix benchmark")

    with progress(options, 4 * len(prompts) + 2, "prefix") as bar:
        cold, primed, warm = _measure_ours(subject, prompts, primer, new_tokens, longest, bar)
        peer_cold, peer_prefill_s, peer_warm = _measure_peer(subject, doc, prompts, new_tokens,
                                                             bar)

    rows = [_row(q, prompts[i], cold[i], warm[i], peer_cold[i], peer_warm[i])
            for i, q in enumerate(questions)]
    agg = _aggregate(rows)
    plot = _plot(options, rows, len(doc))
    return CaseResult(
        case="prefix",
        summary=_summary(len(doc), rows, agg),
        config={"model": options.model, "quick": options.quick, "document_tokens": len(doc),
                "document_source": "pydoc_data.topics", "questions": list(questions),
                "primer": PRIMER, "new_tokens": new_tokens, "greedy": True,
                "weights": subject.weight_format, "transformers_dtype": "float32"},
        results={"questions": rows, "aggregate": agg,
                 "ours_primer": {"ttft_s": primed["ttft_s"], "prompt_tokens": len(primer)},
                 "transformers_document_prefill_s": peer_prefill_s},
        plots=[plot],
        table=[_table_row(len(doc), rows, agg)],
    )


def _measure_ours(subject: Subject, prompts: list[list[int]], primer: list[int],
                  new_tokens: int, longest: int,
                  bar: tqdm) -> tuple[list[Sample], Sample, list[Sample]]:
    """(cold runs, the priming run, warm runs) on our engine with the prefix cache on."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm = subject.llm(enable_prefix_caching=True,
                      max_num_batched_tokens=max(2048, longest),
                      kv_cache_memory=subject.kv_shape().bytes_for(longest, 4))
    llm.generate({"prompt_token_ids": prompts[0][-8:]}, params)
    cold = []
    for p in prompts:
        llm.reset_prefix_cache()
        cold.append(_ours_once(llm, p, params))
        bar.update(1)
    llm.reset_prefix_cache()
    primed = _ours_once(llm, primer, params)
    bar.update(1)
    warm = []
    for p in prompts:
        warm.append(_ours_once(llm, p, params))
        bar.update(1)
    return cold, primed, warm


def _measure_peer(subject: Subject, doc: list[int], prompts: list[list[int]], new_tokens: int,
                  bar: tqdm) -> tuple[list[Sample], float, list[Sample]]:
    """(cold runs, document prefill seconds, runs on a copied document cache) on transformers."""
    peer = subject.peer()
    peer.generate([prompts[0][-8:]], new_tokens)
    peer_cold = []
    for p in prompts:
        r = peer.generate([p], new_tokens)
        peer_cold.append({"ttft_s": r.ttft, "token_ids": r.token_ids[0]})
        bar.update(1)
    doc_cache, peer_prefill_s = peer.prefill(doc)
    bar.update(1)
    peer_warm = []
    for p in prompts:
        r = peer.generate([p], new_tokens, past_key_values=doc_cache)
        peer_warm.append({"ttft_s": r.ttft, "token_ids": r.token_ids[0]})
        bar.update(1)
    return peer_cold, peer_prefill_s, peer_warm


def _row(question: str, prompt: list[int], cold: Sample, warm: Sample, peer_cold: Sample,
         peer_warm: Sample) -> dict[str, Any]:
    """One question's results on both engines."""
    return {
        "question": question,
        "prompt_tokens": len(prompt),
        "ours": {
            "cold_ttft_s": cold["ttft_s"],
            "warm_ttft_s": warm["ttft_s"],
            "speedup": ratio(cold["ttft_s"], warm["ttft_s"]),
            "cold_num_cached_tokens": cold["num_cached_tokens"],
            "warm_num_cached_tokens": warm["num_cached_tokens"],
            "warm_equals_cold": warm["token_ids"] == cold["token_ids"],
        },
        "transformers": {
            "cold_ttft_s": peer_cold["ttft_s"],
            "warm_ttft_s": peer_warm["ttft_s"],
            "speedup": ratio(peer_cold["ttft_s"], peer_warm["ttft_s"]),
            "warm_equals_cold": peer_warm["token_ids"] == peer_cold["token_ids"],
        },
        "ours_equals_transformers": cold["token_ids"] == peer_cold["token_ids"],
    }


def _aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the questions per engine, and the ratios between the engines."""
    agg: dict[str, Any] = {
        side: {
            "median_cold_ttft_s": median([r[side]["cold_ttft_s"] for r in rows]),
            "median_warm_ttft_s": median([r[side]["warm_ttft_s"] for r in rows]),
        }
        for side in ("ours", "transformers")
    }
    for side in agg.values():
        side["speedup"] = ratio(side["median_cold_ttft_s"], side["median_warm_ttft_s"])
    agg["ours"]["median_warm_num_cached_tokens"] = median(
        [r["ours"]["warm_num_cached_tokens"] for r in rows])
    agg["warm_ttft_transformers_over_ours"] = ratio(agg["transformers"]["median_warm_ttft_s"],
                                                    agg["ours"]["median_warm_ttft_s"])
    agg["cold_ttft_transformers_over_ours"] = ratio(agg["transformers"]["median_cold_ttft_s"],
                                                    agg["ours"]["median_cold_ttft_s"])
    return agg


def _summary(doc_len: int, rows: list[dict[str, Any]], agg: dict[str, Any]) -> str:
    num_equal = sum(r["ours"]["warm_equals_cold"] for r in rows)
    o, t = agg["ours"], agg["transformers"]
    return (
        f"prefix: {doc_len}-token document + {len(rows)} questions "
        f"(median TTFT over questions)"
        f" | ours cold {format_ms(o['median_cold_ttft_s'])}, "
        f"warm {format_ms(o['median_warm_ttft_s'])} "
        f"({fmt_x(o['speedup'])}), {fmt(o['median_warm_num_cached_tokens'], 0)} tokens cached"
        f" | transformers cold {format_ms(t['median_cold_ttft_s'])}, warm "
        f"{format_ms(t['median_warm_ttft_s'])} with a copied DynamicCache ({fmt_x(t['speedup'])})"
        f" | warm TTFT theirs/ours {fmt_x(agg['warm_ttft_transformers_over_ours'])}"
        f" | warm outputs equal cold: {num_equal}/{len(rows)}"
    )


def _table_row(doc_len: int, rows: list[dict[str, Any]], agg: dict[str, Any]) -> TableRow:
    o, t = agg["ours"], agg["transformers"]
    return TableRow(
        f"TTFT, {doc_len}-token document + question, cold / prefix hit (median of "
        f"{len(rows)} questions)",
        f"{format_ms(o['median_cold_ttft_s'])} / {format_ms(o['median_warm_ttft_s'])}",
        f"transformers {format_ms(t['median_cold_ttft_s'])} / "
        f"{format_ms(t['median_warm_ttft_s'])} (copied DynamicCache)",
        f"{fmt_x(agg['cold_ttft_transformers_over_ours'])} / "
        f"{fmt_x(agg['warm_ttft_transformers_over_ours'])}",
    )


def _ours_once(llm: LLM, prompt: list[int], params: SamplingParams) -> Sample:
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    return {"ttft_s": out.metrics.ttft, "num_cached_tokens": out.num_cached_tokens,
            "token_ids": out.outputs[0].token_ids}


def _plot(options: BenchOptions, rows: list[dict[str, Any]], doc_len: int) -> str:
    fig, ax = new_figure(f"TTFT with a {doc_len}-token shared document ({options.threads_text})",
                         "question", "time to first token (ms, log scale)")
    series = (("ours", "cold", "kvstack cold"), ("ours", "warm", "kvstack warm (prefix cache)"),
              ("transformers", "cold", "transformers cold"),
              ("transformers", "warm", "transformers warm (cache copy)"))
    width = 0.8 / len(series)
    for k, (side, kind, label) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r[side][f"{kind}_ttft_s"] * 1000 for r in rows], width, label=label,
               color=f"C{k}")
    ax.set_xticks(range(len(rows)), [f"Q{i + 1}" for i in range(len(rows))])
    log_scale_y(ax)
    ax.legend(fontsize="small")
    return save_figure(fig, options, "prefix_ttft.png")
