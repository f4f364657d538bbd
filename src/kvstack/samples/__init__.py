"""Parallel samples of one prompt (`SamplingParams(n=..., best_of=...)`).

A request asking for k = best_of (or n) sequences becomes k engine requests, its samples,
with ids `<request id>#<i>`. Sample 0 alone computes the prompt; the others wait on it
(`Request.pending_forks`) and the scheduler forks them in the step that completes the prompt:
each then shares every prompt block by reference count and samples its first token from the
same logits row. A sample's first write into the shared, partly filled last block copies that
block (`KVCacheManager.allocate`); full prompt blocks are never copied. After the fork the
samples are ordinary requests: each may be preempted (and recomputes through the prefix
cache), aborted alone, or finish on its own.

Sample i draws with seed `seed + i`, so its tokens are those of a lone request with that seed.
With best_of > n the n samples of highest cumulative log-probability are returned when all
have finished (nothing is streamed before); otherwise every step's output carries all n.

`groups.py` holds the samples of each request and makes its one output; `feature.py` is what
the engine's hook points call (split, abort, finish, outputs), registered in
`engine/builder.py`.
"""
