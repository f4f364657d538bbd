"""`kvstack eval semantic`: how often the semantic cache hits, and how often it is wrong.

The labelled question pairs come in two splits, kept in separate files:

- data/pairs.jsonl, the tuning split: the threshold and the swap guard's bar are calibrated
  on it, and only on it;
- data/pairs_holdout.jsonl, the held-out split: never tuned on, it checks the chosen values.

Each holds paraphrases (label "paraphrase": should hit) and near-misses that differ in a
number, entity, negation, opposite word, intent, order, or by one or two swapped content words
(label "swap": "sort a dictionary by value" / "by key"). The 173 swaps and 76 paraphrases
added for issue 13 were written before the swap guard and split at random (seed 13): 100
swaps and 44 paraphrases went to the tuning split, 73 and 32 to the held-out one.

For each split it reports, per similarity threshold, the paraphrase hit rate and the near-miss
false-hit rate with the guards (lexical, then swap) and without them (embedding alone), and
the rates at the chosen threshold with each guard's refusals; it recommends a threshold (from
the tuning sweep) and a bar for the swap guard (from the tuning swaps); then it replays every
pair through a real `SemanticCache` at the chosen threshold (one scope holding every first
question: a query may also hit another pair's entry), and compares the lookup latency, and
what a swap check adds to it, with the embedded model's time to first token.
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
from kvstack.semantic.swap import DEFAULT_MIN_SIMILARITY, SwapCheck, SwapGuard
from kvstack.semantic.swap import REASON as SWAP_REASON

SAFETY_MARGIN = 0.02  # added to the lowest threshold with no false hits on the tuning set
SWAP_MARGIN = 0.02  # added to the highest swap similarity of a tuning near-miss
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
    guard: str | None  # why the guards (lexical, then swap) refuse b given a, or None
    swap: SwapCheck | None = None  # the swap guard's finding where the lexical guard passed


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


def score(embedder: Embedder, pairs: list[Pair],
          swap_guard: SwapGuard | None = None) -> list[Scored]:
    """Each pair's similarity and guard verdict, as `SemanticCache.lookup` would give it. The
    swap guard is asked only from the sweep's lowest threshold up (below, nothing hits)."""
    swap_guard = swap_guard or SwapGuard(embedder)
    a = embedder.embed([normalize(p.a) for p in pairs])
    b = embedder.embed([normalize(p.b) for p in pairs])
    sims = np.einsum("nd,nd->n", a, b)
    scored = []
    for p, s, va, vb in zip(pairs, sims, a, b, strict=True):
        reason, found = reject_reason(p.b, p.a), None
        if reason is None and s >= THRESHOLDS[0]:
            found = swap_guard.check(normalize(p.b), normalize(p.a), vb, va)
            reason = None if found is None else swap_guard.verdict(found)
        scored.append(Scored(p, float(s), reason, found))
    return scored


def choose_swap_similarity(scored: list[Scored], margin: float = SWAP_MARGIN) -> float:
    """The swap guard's bar: the highest contextual similarity of a near-miss swap that
    reaches the sweep's lowest threshold (the words that must not pass), plus `margin`."""
    sims = [s.swap.similarity for s in scored if not s.pair.should_hit and s.swap is not None
            and s.swap.similarity is not None and s.similarity >= THRESHOLDS[0]]
    return round(min(1.0, max(sims, default=0.0) + margin), 2)


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


def replay(embedder: Embedder, pairs: list[Pair], threshold: float,
           swap_similarity: float | None = DEFAULT_MIN_SIMILARITY) -> dict[str, Any]:
    """Every pair's first question stored in one scope, every second one looked up."""
    cache = SemanticCache(embedder, SemanticCacheConfig(
        threshold=threshold, ttl_s=None, max_entries=len(pairs) + 1,
        swap_similarity=swap_similarity))
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
        "swap_checks": cache.stats.swap_checks,
        "swap_ms_mean": _rate(1000 * cache.stats.swap_seconds, cache.stats.swap_checks),
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
    parser.add_argument("--swap-similarity", type=float, default=None, metavar="X",
                        help="the swap guard's bar (default: the library default)")
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
    swap_similarity = DEFAULT_MIN_SIMILARITY if args.swap_similarity is None \
        else args.swap_similarity
    swap_guard = SwapGuard(embedder, swap_similarity)
    scored = score(embedder, pairs, swap_guard)
    rows = sweep(scored)
    chosen = choose_threshold(rows)
    swap_chosen = choose_swap_similarity(scored)
    threshold = args.threshold if args.threshold is not None else chosen
    print(f"tuning pairs: {len(pairs)} ({_labels(_count(pairs))})")
    _print_sweep(rows, chosen)
    print(f"recommended threshold {chosen:.2f} (lowest with no false hit at or above it, "
          f"+{SAFETY_MARGIN}); library default {DEFAULT_THRESHOLD:.2f}")
    print(f"swap guard: recommended bar {swap_chosen:.2f} (highest contextual similarity of "
          f"a tuning near-miss swap from {THRESHOLDS[0]:.2f}, +{SWAP_MARGIN}); library "
          f"default {DEFAULT_MIN_SIMILARITY:.2f}; used {swap_similarity:.2f}")
    splits = {"tuning": scored}
    sweeps = {"tuning": rows}
    if holdout:
        splits["holdout"] = score(embedder, holdout, swap_guard)
        sweeps["holdout"] = sweep(splits["holdout"])
        print(f"held-out pairs (never tuned on): {len(holdout)} ({_labels(_count(holdout))})")
        _print_sweep(sweeps["holdout"])
    figures = {name: _figures(split, threshold) for name, split in splits.items()}
    for name, f in figures.items():
        print(f"{name} at {threshold:.2f}: paraphrase hit rate {100 * f['hit_rate']:.1f}% "
              f"({f['hits']}/{f['paraphrases']}), near-miss false-hit rate "
              f"{100 * f['false_hit_rate']:.1f}% ({f['false_hits']}/{f['near_misses']}); "
              f"guard refusals: {_labels(f['guard_refusals'])}")
        print(f"  swap guard ({swap_similarity:.2f}): refused {f['swap_refused_near_misses']} "
              f"near-misses and {f['swap_refused_paraphrases']} paraphrases over the "
              f"threshold; it checked {f['swap_checked']} pairs there")
    replayed, ttft = _replay_and_ttft(args, embedder, pairs + holdout, threshold,
                                      swap_similarity)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "pairs": _count(pairs), "holdout_pairs": _count(holdout),
            "recommended_threshold": chosen, "threshold": threshold,
            "recommended_swap_similarity": swap_chosen, "swap_similarity": swap_similarity,
            "figures": figures,
            "sweeps": {name: [asdict(r) for r in r_] for name, r_ in sweeps.items()},
            "replay": replayed, "ttft_ms": None if ttft is None else ttft * 1000,
            "scored": {name: [_scored_row(s) for s in split] for name, split in splits.items()},
        }, indent=1))
    return 0


def _replay_and_ttft(args: argparse.Namespace, embedder: Embedder, pairs: list[Pair],
                     threshold: float, swap_similarity: float
                     ) -> tuple[dict[str, Any], float | None]:
    """Replay every pair through a real cache and print it, with the model's TTFT beside the
    lookup latency (unless --no-ttft)."""
    replayed = replay(embedder, pairs, threshold, swap_similarity)
    print(f"replay through SemanticCache ({replayed['entries']} entries, one scope, "
          f"{replayed['queries']} lookups): right hits {replayed['right_hits']}, other hits "
          f"{len(replayed['wrong_hits'])} (listed: judge them), missed paraphrases "
          f"{replayed['missed_paraphrases']}")
    for w in replayed["wrong_hits"]:
        print(f"  other hit ({w['similarity']}): {w['query']!r} -> {w['hit']!r}")
    line = (f"lookup latency p50 {replayed['lookup_ms_p50']:.1f} ms, p99 "
            f"{replayed['lookup_ms_p99']:.1f} ms (embedding + search + guards); a swap "
            f"check adds {replayed['swap_ms_mean']:.1f} ms on average "
            f"({replayed['swap_checks']} checks in {replayed['queries']} lookups)")
    ttft = None
    if not args.no_ttft:
        print(f"measuring {args.model} TTFT...", file=sys.stderr)
        ttft = model_ttft(args.model, args.threads)
        line += f" vs {args.model} TTFT p50 {ttft * 1000:.1f} ms (max_tokens=1, cold prefix)"
    print(line)
    return replayed, ttft


def _print_sweep(rows: list[SweepRow], chosen: float | None = None) -> None:
    print(f"{'threshold':>9}  {'hit%':>6}  {'false%':>6}  {'hit% no guard':>13}  "
          f"{'false% no guard':>15}  false hits by kind")
    for r in rows:
        mark = " <- recommended" if r.threshold == chosen else ""
        print(f"{r.threshold:9.2f}  {100 * r.hit_rate:6.1f}  {100 * r.false_hit_rate:6.1f}  "
              f"{100 * r.hit_rate_unguarded:13.1f}  {100 * r.false_hit_rate_unguarded:15.1f}  "
              f"{_labels(r.false_hits_by_label)}{mark}")


def _scored_row(s: Scored) -> dict[str, Any]:
    row = {**asdict(s.pair), "similarity": round(s.similarity, 4), "guard": s.guard}
    if s.swap is not None:
        row["swap"] = {"query_words": s.swap.swap.query_words,
                       "cached_words": s.swap.swap.cached_words,
                       "contrastive": s.swap.contrastive,
                       "similarity": None if s.swap.similarity is None
                       else round(s.swap.similarity, 4)}
    return row


def _figures(scored: list[Scored], threshold: float) -> dict[str, Any]:
    positives = [s for s in scored if s.pair.should_hit]
    negatives = [s for s in scored if not s.pair.should_hit]
    hits = sum(s.similarity >= threshold and s.guard is None for s in positives)
    false_hits = sum(s.similarity >= threshold and s.guard is None for s in negatives)
    refusals: dict[str, int] = defaultdict(int)
    for s in scored:
        if s.similarity >= threshold and s.guard:
            refusals[f"{s.guard} on {s.pair.label}"] += 1
    over = [s for s in scored if s.similarity >= threshold]
    swap_refused = [s for s in over if s.guard == SWAP_REASON]
    return {"paraphrases": len(positives), "hits": hits,
            "hit_rate": _rate(hits, len(positives)), "near_misses": len(negatives),
            "false_hits": false_hits, "false_hit_rate": _rate(false_hits, len(negatives)),
            "guard_refusals": dict(refusals),
            "swap_checked": sum(s.swap is not None for s in over),
            "swap_refused_near_misses": sum(not s.pair.should_hit for s in swap_refused),
            "swap_refused_paraphrases": sum(s.pair.should_hit for s in swap_refused)}


def _count(pairs: list[Pair]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for p in pairs:
        counts[p.label] += 1
    return dict(counts)


def _rate(num: float, total: int) -> float:
    return num / total if total else 0.0


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _labels(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"
