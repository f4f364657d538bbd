"""`kvstack eval semantic`: how often the semantic cache hits, and how often it is wrong.

On labelled question pairs (data/pairs.jsonl: paraphrases, and near-misses that differ in a
number, entity, negation, opposite word, intent or order) it reports, per similarity
threshold, the paraphrase hit rate and the near-miss false-hit rate with the guard and
without it (embedding alone); then it replays every pair through a real `SemanticCache` at
the chosen threshold (one scope holding every first question: a query may also hit another
pair's entry), and compares the lookup latency with the embedded model's time to first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvstack.argtypes import DEFAULT_MODEL, positive_int
from kvstack.errors import InvalidRequestError
from kvstack.semantic.cache import DEFAULT_THRESHOLD, SemanticCache, SemanticCacheConfig, normalize
from kvstack.semantic.embedder import Embedder
from kvstack.semantic.entry import Answer, Scope
from kvstack.semantic.guard import reject_reason

SAFETY_MARGIN = 0.02  # added to the lowest threshold with no false hits on the tuning set
THRESHOLDS = tuple(round(0.70 + 0.01 * i, 2) for i in range(29))  # 0.70 .. 0.98


@dataclass(frozen=True)
class Pair:
    a: str  # stored first
    b: str  # asked later
    label: str  # "paraphrase" (should hit) or the kind of near-miss

    @property
    def should_hit(self) -> bool:
        return self.label == "paraphrase"


@dataclass(frozen=True)
class Scored:
    pair: Pair
    similarity: float
    guard: str | None  # why the guard refuses b given a, or None


@dataclass(frozen=True)
class SweepRow:
    threshold: float
    hit_rate: float  # paraphrases served
    false_hit_rate: float  # near-misses served
    hit_rate_unguarded: float
    false_hit_rate_unguarded: float
    false_hits_by_label: dict[str, int]


def load_pairs(path: Path | None = None, packaged: str = "pairs.jsonl") -> list[Pair]:
    """Pairs from `path`, or the packaged file `packaged` (pairs.jsonl: the tuning set;
    pairs_holdout.jsonl: a second set, checked at the chosen threshold)."""
    if path is None:
        text = resources.files("kvstack.semantic").joinpath("data", packaged).read_text()
    else:
        try:
            text = path.read_text()
        except OSError as err:
            raise InvalidRequestError(f"cannot read pairs file {path}: {err.strerror}") \
                from err
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append(Pair(str(row["a"]), str(row["b"]), str(row["label"])))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise InvalidRequestError(f"pairs line {n}: give a JSON object with a, b and "
                                      f"label ({err})") from err
    return pairs


def score(embedder: Embedder, pairs: list[Pair]) -> list[Scored]:
    a = embedder.embed([normalize(p.a) for p in pairs])
    b = embedder.embed([normalize(p.b) for p in pairs])
    sims = np.einsum("nd,nd->n", a, b)
    return [Scored(p, float(s), reject_reason(p.b, p.a)) for p, s in zip(pairs, sims,
                                                                           strict=True)]


def sweep(scored: list[Scored], thresholds: tuple[float, ...] = THRESHOLDS) -> list[SweepRow]:
    positives = [s for s in scored if s.pair.should_hit]
    negatives = [s for s in scored if not s.pair.should_hit]
    rows = []
    for t in thresholds:
        over_pos = [s for s in positives if s.similarity >= t]
        over_neg = [s for s in negatives if s.similarity >= t]
        false_hits = [s for s in over_neg if s.guard is None]
        by_label: dict[str, int] = defaultdict(int)
        for s in false_hits:
            by_label[s.pair.label] += 1
        rows.append(SweepRow(
            threshold=t,
            hit_rate=_rate(sum(s.guard is None for s in over_pos), len(positives)),
            false_hit_rate=_rate(len(false_hits), len(negatives)),
            hit_rate_unguarded=_rate(len(over_pos), len(positives)),
            false_hit_rate_unguarded=_rate(len(over_neg), len(negatives)),
            false_hits_by_label=dict(by_label),
        ))
    return rows


def choose_threshold(rows: list[SweepRow], margin: float = SAFETY_MARGIN) -> float:
    """The lowest threshold from which no near-miss is served (at it and every threshold
    above), plus `margin` for questions unlike the labelled ones."""
    safe = max(rows, key=lambda r: r.threshold).threshold
    for r in sorted(rows, key=lambda r: -r.threshold):
        if r.false_hit_rate > 0:
            break
        safe = r.threshold
    return round(min(1.0, safe + margin), 2)


def replay(embedder: Embedder, pairs: list[Pair], threshold: float) -> dict[str, Any]:
    """Every pair's first question stored in one scope, every second one looked up."""
    cache = SemanticCache(embedder, SemanticCacheConfig(threshold=threshold, ttl_s=None,
                                                        max_entries=len(pairs) + 1))
    scope = Scope("eval", "eval")
    stored = list(dict.fromkeys(normalize(p.a) for p in pairs))
    vectors = embedder.embed(stored)
    for text, vector in zip(stored, vectors, strict=True):
        cache.store(scope, text, Answer(text, 1), vector)
    correct: dict[str, set[str]] = defaultdict(set)  # query -> stored texts that answer it
    for p in pairs:
        if p.should_hit:
            correct[normalize(p.b)].add(normalize(p.a))
    queries = list(dict.fromkeys(normalize(p.b) for p in pairs))
    latencies, right, wrong, missed = [], 0, [], 0
    for q in queries:
        lookup = cache.lookup(scope, q)
        latencies.append(lookup.seconds)
        if lookup.entry is None:
            missed += bool(correct[q])
        elif lookup.entry.text in correct[q] or lookup.entry.text == q:
            right += 1
        else:
            wrong.append({"query": q, "hit": lookup.entry.text,
                          "similarity": round(lookup.similarity or 0.0, 4)})
    cache.check_integrity()
    ms = sorted(x * 1000 for x in latencies)
    return {
        "entries": len(cache), "queries": len(queries), "right_hits": right,
        "wrong_hits": wrong, "missed_paraphrases": missed,
        "lookup_ms_p50": statistics.median(ms), "lookup_ms_p99": _percentile(ms, 0.99),
        "guard_rejections": cache.stats.guard_rejections,
    }


def model_ttft(model: str, threads: int, num: int = 5) -> float:
    """Median TTFT of short chat questions on the model (after one warm-up request)."""
    from kvstack.engine.llm import LLM
    from kvstack.sampling_params import SamplingParams

    questions = ["What is the capital of Australia?", "How do I reverse a list in Python?",
                 "Why is the sky blue?", "What causes earthquakes?", "What is inflation?",
                 "How do vaccines work?"]
    with LLM(model=model, num_threads=threads, kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        params = SamplingParams(temperature=0, max_tokens=1)
        ttfts = []
        for q in questions[: num + 1]:
            out = llm.chat([{"role": "user", "content": q}], params)[0]
            ttfts.append(out.metrics.ttft)
    return statistics.median(t for t in ttfts[1:] if t is not None)


# -- command line ----------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "semantic",
        help="semantic cache: hit and false-hit rates by threshold, lookup latency vs TTFT",
        description="Score the labelled question pairs (paraphrases and near-misses) with the "
        "semantic cache's embedder and guard: print a threshold sweep, the recommended "
        "threshold (the lowest with no false hit at or above it, plus a margin), the "
        "held-out figures at it, a replay through a real "
        "cache, and lookup latency next to the model's time to first token.",
    )
    parser.add_argument("--pairs", type=Path, default=None, metavar="FILE",
                        help="JSONL of {a, b, label} to tune on (default: the packaged set)")
    parser.add_argument("--holdout", type=Path, default=None, metavar="FILE",
                        help="JSONL pairs checked at the chosen threshold (default: the "
                        "packaged held-out set, unless --pairs is given)")
    parser.add_argument("--threshold", type=float, default=None, metavar="X",
                        help="replay at this threshold (default: the recommended one)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model whose TTFT the lookup latency is compared with")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help="torch CPU threads")
    parser.add_argument("--no-ttft", action="store_true", help="skip the model run")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="also write the figures as JSON here")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstack.semantic.embedder import MiniLMEmbedder

    torch.set_num_threads(args.threads)
    pairs = load_pairs(args.pairs)
    holdout = [] if args.pairs is not None and args.holdout is None else \
        load_pairs(args.holdout, "pairs_holdout.jsonl")
    embedder = MiniLMEmbedder()
    scored = score(embedder, pairs)
    rows = sweep(scored)
    chosen = choose_threshold(rows)
    threshold = args.threshold if args.threshold is not None else chosen
    print(f"tuning pairs: {len(pairs)} ({_labels(_count(pairs))})")
    print(f"{'threshold':>9}  {'hit%':>6}  {'false%':>6}  {'hit% no guard':>13}  "
          f"{'false% no guard':>15}  false hits by kind")
    for r in rows:
        mark = " <- recommended" if r.threshold == chosen else ""
        print(f"{r.threshold:9.2f}  {100 * r.hit_rate:6.1f}  {100 * r.false_hit_rate:6.1f}  "
              f"{100 * r.hit_rate_unguarded:13.1f}  {100 * r.false_hit_rate_unguarded:15.1f}  "
              f"{_labels(r.false_hits_by_label)}{mark}")
    print(f"recommended threshold {chosen:.2f} (lowest with no false hit at or above it, "
          f"+{SAFETY_MARGIN}); library default {DEFAULT_THRESHOLD:.2f}")
    figures = {"tuning": _figures(scored, threshold)}
    if holdout:
        figures["holdout"] = _figures(score(embedder, holdout), threshold)
    for name, f in figures.items():
        print(f"{name} at {threshold:.2f}: paraphrase hit rate {100 * f['hit_rate']:.1f}% "
              f"({f['hits']}/{f['paraphrases']}), near-miss false-hit rate "
              f"{100 * f['false_hit_rate']:.1f}% ({f['false_hits']}/{f['near_misses']}); "
              f"guard refusals: {_labels(f['guard_refusals'])}")
    replayed = replay(embedder, pairs + holdout, threshold)
    print(f"replay through SemanticCache ({replayed['entries']} entries, one scope, "
          f"{replayed['queries']} lookups): right hits {replayed['right_hits']}, other hits "
          f"{len(replayed['wrong_hits'])} (listed: judge them), missed paraphrases "
          f"{replayed['missed_paraphrases']}")
    for w in replayed["wrong_hits"]:
        print(f"  other hit ({w['similarity']}): {w['query']!r} -> {w['hit']!r}")
    line = (f"lookup latency p50 {replayed['lookup_ms_p50']:.1f} ms, p99 "
            f"{replayed['lookup_ms_p99']:.1f} ms (embedding + search + guard)")
    ttft = None
    if not args.no_ttft:
        print(f"measuring {args.model} TTFT...", file=sys.stderr)
        ttft = model_ttft(args.model, args.threads)
        line += f" vs {args.model} TTFT p50 {ttft * 1000:.1f} ms (max_tokens=1, cold prefix)"
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "pairs": _count(pairs), "recommended_threshold": chosen, "threshold": threshold,
            "figures": figures, "sweep": [asdict(r) for r in rows], "replay": replayed,
            "ttft_ms": None if ttft is None else ttft * 1000,
            "scored": [{**asdict(s.pair), "similarity": round(s.similarity, 4),
                        "guard": s.guard} for s in scored],
        }, indent=1))
    return 0


def _figures(scored: list[Scored], threshold: float) -> dict[str, Any]:
    positives = [s for s in scored if s.pair.should_hit]
    negatives = [s for s in scored if not s.pair.should_hit]
    hits = sum(s.similarity >= threshold and s.guard is None for s in positives)
    false_hits = sum(s.similarity >= threshold and s.guard is None for s in negatives)
    refusals: dict[str, int] = defaultdict(int)
    for s in scored:
        if s.similarity >= threshold and s.guard:
            refusals[f"{s.guard} on {s.pair.label}"] += 1
    return {"paraphrases": len(positives), "hits": hits,
            "hit_rate": _rate(hits, len(positives)), "near_misses": len(negatives),
            "false_hits": false_hits, "false_hit_rate": _rate(false_hits, len(negatives)),
            "guard_refusals": dict(refusals)}


def _count(pairs: list[Pair]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for p in pairs:
        counts[p.label] += 1
    return dict(counts)


def _rate(num: int, total: int) -> float:
    return num / total if total else 0.0


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _labels(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"
