"""`bench verify`: what verified drafts buy, from the semantic cache and from prompt lookup.

Semantic cache (64-token greedy answers, the prefix cache emptied before every timed run so
only the semantic cache differs): end-to-end time of an exact repeat, a paraphrase and a
near-miss with the cache off, in trust mode (a hit replays the stored answer) and in verify
mode (a hit's answer is a draft the model verifies in one step). Over labelled pairs (the
project's paraphrases and near-misses): the share of a stored answer the model accepts for
the other question, by similarity, and the verify threshold that saves the most time.

Prompt lookup: decode tok/s with drafts copied from the prompt (`prompt_lookup`) against
none, on answers that quote a ~1,000-token document and on chat answers that quote nothing;
outputs must be identical.
"""

from __future__ import annotations

import time
from typing import Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress
from kvstack.bench.format import fmt, fmt_x, median, ratio
from kvstack.bench.verify_workloads import (
    Pairs,
    best_threshold,
    labelled_pairs,
    quote_prompts,
    semantic_scenarios,
)
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams
from kvstack.semantic.cache import SemanticCache, SemanticCacheConfig
from kvstack.semantic.embedder import MiniLMEmbedder
from kvstack.semantic.entry import Answer, Scope

ANSWER_TOKENS = 64
LOOKUP = 8  # prompt_lookup draft length


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    llm = subject.llm(kv_cache_memory=subject.kv_shape().bytes_for(4096, 4))
    semantic = _semantic(subject, options, llm)
    pairs = _acceptance(subject, options, llm)
    lookup = _prompt_lookup(subject, options, llm)
    llm.close()
    return CaseResult(
        case="verify",
        summary=_summary(semantic, pairs, lookup),
        config={"model": options.model, "quick": options.quick, "answer_tokens": ANSWER_TOKENS,
                "prompt_lookup": LOOKUP, "weights": subject.weight_format,
                "prefix_cache": "emptied before every timed run"},
        results={"semantic": semantic, "acceptance": pairs, "prompt_lookup": lookup},
        table=_table(semantic, pairs, lookup),
    )


# -- semantic cache ----------------------------------------------------------------------------


def _generate(llm: LLM, prompt: list[int], draft: list[int] | None = None,
              max_tokens: int = ANSWER_TOKENS, prompt_lookup: int | None = None
              ) -> tuple[list[int], float, Any]:
    """(output tokens, seconds, output) of one greedy run from a cold prefix cache."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            prompt_lookup=prompt_lookup)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt, "draft_token_ids": draft}, params)[0]
    return out.outputs[0].token_ids, time.perf_counter() - start, out


def _semantic(subject: Subject, options: BenchOptions, llm: LLM) -> dict[str, Any]:
    """Median seconds per scenario and mode, with the lookup's own time included."""
    embedder = MiniLMEmbedder()
    scenarios = semantic_scenarios(options.quick)
    results: dict[str, Any] = {}
    with progress(options, sum(len(v) for v in scenarios.values()), "semantic") as bar:
        for name, cases in scenarios.items():
            runs = [_scenario(subject, llm, embedder, stored, asked) for stored, asked in cases]
            bar.update(len(cases))
            results[name] = {mode: median([r[mode] for r in runs])
                             for mode in ("off", "trust", "verify")}
            results[name]["accepted_share"] = median([r["accepted_share"] for r in runs])
            results[name]["verify_over_off"] = ratio(results[name]["off"],
                                                     results[name]["verify"])
    return results


def _scenario(subject: Subject, llm: LLM, embedder: MiniLMEmbedder, stored: str,
              asked: str) -> dict[str, float]:
    """One stored question and one asked question through off / trust / verify."""
    stored_ids, asked_ids = subject.chat_prompt(stored), subject.chat_prompt(asked)
    answer, _, _ = _generate(llm, stored_ids)
    times: dict[str, float] = {}
    _, times["off"], _ = _generate(llm, asked_ids)
    for mode in ("trust", "verify"):
        cache = SemanticCache(embedder, SemanticCacheConfig(mode=mode))
        scope = Scope("bench", "model")
        cache.store(scope, stored, Answer("", len(answer), "length", None, tuple(answer)))
        start = time.perf_counter()
        lookup = cache.lookup(scope, asked)
        looked = time.perf_counter() - start
        if lookup.hit and mode == "trust":
            times[mode] = looked  # the stored answer is replayed: no model run
        else:
            draft = answer if lookup.hit else None
            _, seconds, out = _generate(llm, asked_ids, draft)
            times[mode] = looked + seconds
            if mode == "verify":
                times["accepted_share"] = (out.num_accepted_tokens / out.num_draft_tokens
                                           if out.num_draft_tokens else 0.0)
        times.setdefault("accepted_share", 0.0)
        cache.close()
    return times


def _acceptance(subject: Subject, options: BenchOptions, llm: LLM) -> dict[str, Any]:
    """Accepted share of a stored answer for the other question of each labelled pair, and
    the verify threshold that saves the most decode steps."""
    pairs: Pairs = labelled_pairs(options.quick)
    embedder = MiniLMEmbedder()
    rows = []
    with progress(options, len(pairs), "pairs") as bar:
        for a, b, label in pairs:
            answer, _, _ = _generate(llm, subject.chat_prompt(a))
            _, _, out = _generate(llm, subject.chat_prompt(b), answer)
            vectors = embedder.embed([a, b])
            rows.append({"label": label, "similarity": float(vectors[0] @ vectors[1]),
                         "accepted": out.num_accepted_tokens, "drafted": out.num_draft_tokens})
            bar.update(1)
    paraphrases = [r for r in rows if r["label"] == "paraphrase"]
    share = (sum(r["accepted"] for r in paraphrases)
             / max(1, sum(r["drafted"] for r in paraphrases)))
    return {"pairs": rows, "paraphrase_acceptance": share,
            "best_verify_threshold": best_threshold(rows)}


# -- prompt lookup -----------------------------------------------------------------------------


def _prompt_lookup(subject: Subject, options: BenchOptions, llm: LLM) -> dict[str, Any]:
    workloads = quote_prompts(subject, options.quick)
    new_tokens = 16 if options.quick else 128
    results: dict[str, Any] = {}
    with progress(options, 2 * sum(len(p) for p in workloads.values()), "lookup") as bar:
        for name, prompts in workloads.items():
            rates: dict[str, list[float]] = {"off": [], "lookup": []}
            same = accepted = drafted = 0
            for prompt in prompts:
                plain, _, out_off = _generate(llm, prompt, max_tokens=new_tokens)
                looked, _, out_on = _generate(llm, prompt, max_tokens=new_tokens,
                                              prompt_lookup=LOOKUP)
                bar.update(2)
                rates["off"].append(out_off.metrics.decode_rate(len(plain)) or 0.0)
                rates["lookup"].append(out_on.metrics.decode_rate(len(looked)) or 0.0)
                same += plain == looked
                accepted += out_on.num_accepted_tokens
                drafted += out_on.num_draft_tokens
            off, on = median(rates["off"]), median(rates["lookup"])
            results[name] = {"decode_tok_s_off": off, "decode_tok_s_lookup": on,
                             "speedup": ratio(on, off), "identical": same,
                             "prompts": len(prompts), "accepted": accepted, "drafted": drafted}
    return results


# -- report ------------------------------------------------------------------------------------


def _summary(semantic: dict[str, Any], pairs: dict[str, Any], lookup: dict[str, Any]) -> str:
    parts = ["verify: 64-token answers, median seconds off/trust/verify"]
    for name, r in semantic.items():
        parts.append(f"{name} {fmt(r['off'], 2)}/{fmt(r['trust'], 2)}/{fmt(r['verify'], 2)} "
                     f"(verify {fmt_x(r['verify_over_off'])} vs off, "
                     f"{fmt(100 * (r['accepted_share'] or 0), 0)}% of the draft accepted)")
    parts.append(f"paraphrase pairs: {fmt(100 * pairs['paraphrase_acceptance'], 0)}% of a "
                 f"stored answer accepted; best verify threshold "
                 f"{fmt(pairs['best_verify_threshold'], 2)}")
    for name, r in lookup.items():
        parts.append(f"prompt lookup {name}: {fmt(r['decode_tok_s_lookup'])} vs "
                     f"{fmt(r['decode_tok_s_off'])} tok/s ({fmt_x(r['speedup'])}), identical "
                     f"{r['identical']}/{r['prompts']}, accepted {r['accepted']}/{r['drafted']}")
    return " | ".join(parts)


def _table(semantic: dict[str, Any], pairs: dict[str, Any],
           lookup: dict[str, Any]) -> list[TableRow]:
    rows = [TableRow(f"semantic cache, {name}: seconds off / trust / verify",
                     f"{fmt(r['off'], 2)} / {fmt(r['trust'], 2)} / {fmt(r['verify'], 2)}",
                     "", f"{fmt_x(r['verify_over_off'])} (verify vs off)")
            for name, r in semantic.items()]
    rows.append(TableRow("semantic cache: share of a stored answer accepted, labelled "
                         "paraphrases", f"{fmt(100 * pairs['paraphrase_acceptance'], 0)}%"))
    rows += [TableRow(f"prompt lookup ({LOOKUP} draft tokens), {name}: decode tok/s",
                      fmt(r["decode_tok_s_lookup"]), f"off {fmt(r['decode_tok_s_off'])}",
                      fmt_x(r["speedup"])) for name, r in lookup.items()]
    return rows
