"""`bench rag`: TTFT of RAG prompts whose documents come back in a new order every time.

Each query is an instruction, 6 documents of ~300 tokens (pydoc topics) drawn from a pool of
8 in a fresh seeded order, and a question. Prefix caching is on for every arm. Arms:
- `full_prefill`: the prefix cache is reset before each query (nothing reused);
- `prefix_cache`: the exact prefix cache alone, after a priming pass over every document (a
  reordered prompt still hits only its shared start);
- `blend_default`, `blend_first_k`, `blend_0.05`: APPROXIMATE blending (`blend/`) with the
  chunk entries in memory (precomputed), at the default setting, EPIC's first 8 tokens of each
  chunk, and kv_deviation at ratio 0.05;
- `blend_disk`: the default setting in a fresh process (`python -m kvstack.bench.rag`) whose
  chunk entries are restored from the disk tier, written by an engine in this process; its
  memory chunk cache is emptied before each query, so every query reads its entries from disk.
TTFT is the wall time of a one-token request; quality is KL(full || arm) in nats and top-1
agreement with full prefill at that token; compute is prompt token-layers computed over full
prefill's.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    in_fresh_process,
    progress,
    topic_texts,
)
from kvstack.bench.format import fmt_x, median, ratio
from kvstack.bench.plots import new_figure, save_figure
from kvstack.blend.params import BlendParams, Chunk
from kvstack.units import format_ms

INSTRUCTION = "Answer the question using the documents below.\n\n"
QUESTIONS = ("Which statement is described first?", "What does the documentation say about "
             "scoping?", "Name one keyword mentioned above.", "What is evaluated first?",
             "Which construct raises an exception?", "What is the purpose of the else clause?")
BLEND_ARMS = {"blend_default": BlendParams(), "blend_first_k": BlendParams(
    selector="first_k", first_k=8), "blend_0.05": BlendParams(recompute_ratio=0.05)}


def sizes(quick: bool) -> tuple[int, int, int, int]:
    """(documents per query, pool size, tokens per document, queries)."""
    return (3, 4, 40, 2) if quick else (6, 8, 300, 6)


def documents(subject: Subject, pool: int, num_tokens: int) -> list[list[int]]:
    docs = []
    for text in topic_texts():
        ids = subject.encode(text)
        if len(ids) >= num_tokens:
            docs.append(ids[:num_tokens])
        if len(docs) == pool:
            break
    return docs


def queries(docs: list[list[int]], per_query: int, num: int, subject: Subject
            ) -> list[list[Any]]:
    rng = random.Random(0)
    out = []
    for i in range(num):
        segments: list[Any] = [subject.encode(INSTRUCTION)]
        for d in rng.sample(range(len(docs)), per_query):
            segments += [Chunk(token_ids=tuple(docs[d])), subject.encode("\n\n")]
        segments.append(subject.encode(f"Question: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"))
        out.append(segments)
    return out


def _timed(llm: Any, segments: list[Any], blend: BlendParams | None) -> dict[str, Any]:
    start = time.perf_counter()
    scored = llm.score({"segments": segments}, 1, blend=blend)[0]
    ttft = time.perf_counter() - start
    usage = scored.output.blend
    return {"ttft_s": ttft, "logprobs": scored.logprobs[0],
            "cached_tokens": scored.output.num_cached_tokens,
            "compute": usage.compute if usage else None,
            "recomputed_tokens": usage.recomputed_tokens if usage else 0}


def _arm(subject: Subject, qs: list[list[Any]], name: str, bar: Any, **kwargs: Any
         ) -> list[dict[str, Any]]:
    longest = max(sum(len(s.token_ids or ()) if isinstance(s, Chunk) else len(s) for s in q)
                  for q in qs) + 1
    llm = subject.llm(enable_prefix_caching=True, max_num_batched_tokens=max(2048, longest),
                      kv_cache_memory=subject.kv_shape().bytes_for(longest, 4), **kwargs)
    blend = BLEND_ARMS.get(name, BLEND_ARMS["blend_default"] if name == "blend_disk" else None)
    chunks = [s for q in qs for s in q if isinstance(s, Chunk)]
    if name.startswith("blend") and name != "blend_disk":
        llm.precompute_chunks(chunks)
    elif name == "prefix_cache":  # every document once, in pool order (not a query's)
        pooled = [s for q in qs for s in q if isinstance(s, Chunk)]
        llm.generate({"segments": [qs[0][0], *dict.fromkeys(pooled)]}, _one())
    llm.generate({"prompt_token_ids": subject.encode("warm up")}, _one())
    out = []
    for q in qs:
        if name == "full_prefill":
            llm.reset_prefix_cache()
        elif name == "blend_disk":  # every query restores its entries from the disk tier
            llm.reset_chunk_cache()
        out.append(_timed(llm, q, blend))
        bar.update(1)
    llm.engine.check_integrity()
    llm.close()
    return out


def _in_fresh_process(options: BenchOptions, qs: list[list[Any]], disk_dir: str
                      ) -> list[dict[str, Any]]:
    """The `blend_disk` arm in a new Python process that never computed an entry: only the
    disk directory is shared."""
    spec = {"options": {k: v for k, v in asdict(options).items() if k in (
        "model", "threads", "dtype", "quantization")}, "disk_dir": disk_dir,
        "queries": [[{"ids": list(s.token_ids or ()), "chunk": True} if isinstance(s, Chunk) else
                     {"ids": list(s), "chunk": False} for s in q] for q in qs]}
    rows = in_fresh_process("kvstack.bench.rag", spec, "rag benchmark's disk arm")
    return [r | {"logprobs": torch.tensor(r["logprobs"])} for r in rows]


def _disk_probe(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run in the fresh process: the disk arm over the spec's queries."""
    options = BenchOptions(out=Path(spec["disk_dir"]), show_progress=False, **spec["options"])
    qs = [[Chunk(token_ids=tuple(s["ids"])) if s["chunk"] else s["ids"] for s in q]
          for q in spec["queries"]]
    with progress(options, len(qs), "rag disk") as bar:
        rows = _arm(Subject(options), qs, "blend_disk", bar, kv_disk_dir=Path(spec["disk_dir"]))
    return [r | {"logprobs": r["logprobs"].tolist()} for r in rows]


def _one() -> Any:
    from kvstack.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    per_query, pool, doc_tokens, num = sizes(options.quick)
    docs = documents(subject, pool, doc_tokens)
    qs = queries(docs, per_query, num, subject)
    arms = ["full_prefill", "prefix_cache", *BLEND_ARMS, "blend_disk"]
    samples: dict[str, list[dict[str, Any]]] = {}
    with progress(options, len(arms) * num, "rag") as bar, tempfile.TemporaryDirectory() as d:
        for name in arms[:-1]:
            samples[name] = _arm(subject, qs, name, bar)
        writer = subject.llm(kv_disk_dir=Path(d))
        writer.precompute_chunks([s for q in qs for s in q if isinstance(s, Chunk)])
        writer.close()
        samples["blend_disk"] = _in_fresh_process(options, qs, d)
        bar.update(num)
    rows = _rows(samples)
    plot = _plot(options, rows)
    base = rows["full_prefill"]["median_ttft_s"]
    summary = (f"rag: {num} queries x {per_query} reordered ~{doc_tokens}-token documents, "
               "median TTFT | " + " | ".join(
                   f"{k} {format_ms(r['median_ttft_s'])} ({fmt_x(ratio(base, r['median_ttft_s']))}"
                   + (f", KL {r['mean_kl']:.3f}" if k.startswith("blend") else "") + ")"
                   for k, r in rows.items()) + " | blending is approximate")
    return CaseResult(
        case="rag", summary=summary,
        config={"model": options.model, "quick": options.quick, "documents_per_query":
                per_query, "pool": pool, "document_tokens": doc_tokens, "queries": num,
                "prefix_caching": True, "blend_arms": {k: vars(v) for k, v in
                                                        BLEND_ARMS.items()}},
        results={"arms": rows}, plots=[plot],
        table=[TableRow(f"RAG TTFT, {per_query} reordered {doc_tokens}-token documents: full "
                        "prefill / prefix cache / blend (approximate)",
                        f"{format_ms(base)} / {format_ms(rows['prefix_cache']['median_ttft_s'])}"
                        f" / {format_ms(rows['blend_default']['median_ttft_s'])}", "",
                        fmt_x(ratio(base, rows["blend_default"]["median_ttft_s"])))],
    )


def _rows(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    ref = samples["full_prefill"]
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in samples.items():
        kls = [float((r["logprobs"].exp() * (r["logprobs"] - a["logprobs"])).sum())
               for r, a in zip(ref, runs, strict=True)]
        top1 = [int(r["logprobs"].argmax()) == int(a["logprobs"].argmax())
                for r, a in zip(ref, runs, strict=True)]
        computes = [a["compute"] for a in runs if a["compute"] is not None]
        rows[name] = {"median_ttft_s": median([a["ttft_s"] for a in runs]),
                      "ttft_s": [a["ttft_s"] for a in runs],
                      "mean_kl": sum(kls) / len(kls), "top1_agreement": sum(top1) / len(top1),
                      "mean_compute": sum(computes) / len(computes) if computes else None,
                      "median_cached_tokens": median([a["cached_tokens"] for a in runs])}
    for r in rows.values():
        r["speedup_vs_full"] = ratio(rows["full_prefill"]["median_ttft_s"], r["median_ttft_s"])
        r["speedup_vs_prefix_cache"] = ratio(rows["prefix_cache"]["median_ttft_s"],
                                             r["median_ttft_s"])
    return rows


def _plot(options: BenchOptions, rows: dict[str, dict[str, Any]]) -> str:
    fig, ax = new_figure("RAG: TTFT vs compute (reordered documents)",
                         "prompt compute (share of full prefill)", "median TTFT (ms)")
    kl_ax = ax.twinx()
    kl_ax.set_ylabel("KL vs full prefill (nats), x markers")
    for name, r in rows.items():
        compute = r["mean_compute"] if r["mean_compute"] is not None else 1.0
        ax.scatter([compute], [1000 * r["median_ttft_s"]], label=name)
        kl_ax.scatter([compute], [r["mean_kl"]], marker="x", color="black")
    ax.legend(fontsize=8)
    return save_figure(fig, options, "rag.png")


if __name__ == "__main__":
    print(json.dumps(_disk_probe(json.loads(sys.argv[1]))))
