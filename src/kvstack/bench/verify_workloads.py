"""The questions and prompts of `bench verify`, and how its verify threshold is chosen.

Semantic-cache questions come from the project's labelled pairs (`semantic/data`, the tuning
split): paraphrases the cache should answer and near-misses (one swapped word, another number
or entity, ...) it must not. Prompt-lookup prompts come from Python's own documentation.
"""

from __future__ import annotations

import random
from typing import Any

from kvstack.bench.common import Subject, topic_texts
from kvstack.eval.semantic import load_pairs

Pairs = list[tuple[str, str, str]]  # (stored question, asked question, label)

# A rejected draft token still costs its row in the verifying step: about this share of a
# decode step's time on this CPU (rows of one step share the weight reads).
REJECTED_TOKEN_COST = 0.1
_THRESHOLDS = tuple(round(0.5 + 0.02 * i, 2) for i in range(21))  # 0.50 .. 0.90
_SEED = 13


def labelled_pairs(quick: bool) -> Pairs:
    """A seeded sample of the labelled pairs: paraphrases and near-misses alike."""
    pairs = [(p.a, p.b, p.label) for p in load_pairs()]
    rng = random.Random(_SEED)
    rng.shuffle(pairs)
    num = 4 if quick else 32
    paraphrases = [p for p in pairs if p[2] == "paraphrase"][: num // 2]
    near_misses = [p for p in pairs if p[2] != "paraphrase"][: num // 2]
    return paraphrases + near_misses


def semantic_scenarios(quick: bool) -> dict[str, list[tuple[str, str]]]:
    """(stored, asked) question pairs per scenario."""
    pairs = labelled_pairs(quick)
    num = 1 if quick else 3
    paraphrases = [(a, b) for a, b, label in pairs if label == "paraphrase"][:num]
    near_misses = [(a, b) for a, b, label in pairs if label == "swap"][:num]
    if len(near_misses) < num:
        near_misses += [(a, b) for a, b, label in pairs if label != "paraphrase"][:num]
    return {"exact repeat": [(a, a) for a, _ in paraphrases],
            "paraphrase": paraphrases, "near-miss": near_misses[:num]}


def quote_prompts(subject: Subject, quick: bool) -> dict[str, list[list[int]]]:
    """Prompts whose answers copy spans of a ~1,000-token document, and chat questions whose
    answers copy nothing."""
    num = 1 if quick else 3
    doc_tokens = 128 if quick else 1000
    texts = [t for t in topic_texts() if len(t) > 8 * doc_tokens][:num]
    quoting = []
    for text in texts:
        # About doc_tokens tokens of the topic (4 characters a token), cut at a line end.
        doc = text[: text.rfind("\n", 0, 4 * doc_tokens)]
        quoting.append(subject.chat_prompt(
            doc + "\n\nRepeat the text above exactly, word for word, from its first line."))
    chats = [subject.chat_prompt(q) for q in (
        "Write a short poem about the autumn wind.",
        "Give me three ideas for a birthday party.",
        "What should I pack for a weekend of hiking?",
    )[:num]]
    return {"quotes a document": quoting, "copies nothing": chats}


def best_threshold(rows: list[dict[str, Any]]) -> float | None:
    """The verify threshold that saves the most decode steps over the pairs: a pair at or
    above it is a hit whose accepted tokens save a step each, while its rejected ones cost
    REJECTED_TOKEN_COST of a step; below it the model decodes as with the cache off."""
    def saved(threshold: float) -> float:
        return sum(r["accepted"] - REJECTED_TOKEN_COST * (r["drafted"] - r["accepted"])
                   for r in rows if r["similarity"] >= threshold)

    if not rows:
        return None
    return max(_THRESHOLDS, key=lambda t: (saved(t), t))
