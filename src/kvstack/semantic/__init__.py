"""Semantic cache: answer a repeated question without running the model, and never wrongly.

`SemanticCache` (cache.py) keeps finished answers keyed by an embedding of the question
(embedder.py) in a vector index (index.py) persisted next to a SQLite store (store.py); a
lexical guard (guard.py) refuses near-misses the embedding cannot tell apart, and a swap guard
(swap.py) questions that differ by one or two swapped words unless the model shows them to
mean the same. `kvstack eval semantic` (eval.py) measures it on the labelled pairs in
data/pairs.jsonl (tuning) and data/pairs_holdout.jsonl (held out).
"""

from kvstack.semantic.cache import (
    DEFAULT_THRESHOLD,
    Lookup,
    SemanticCache,
    SemanticCacheConfig,
    SemanticCacheError,
)
from kvstack.semantic.entry import Answer, Entry, Scope

__all__ = ["DEFAULT_THRESHOLD", "Answer", "Entry", "Lookup", "Scope", "SemanticCache",
           "SemanticCacheConfig", "SemanticCacheError"]
