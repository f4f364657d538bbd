"""Routing requests across engine replicas by the KV blocks each one holds.

Pure parts, no Ray: `events` (what a replica publishes about its resident blocks),
`residency` (the replica side that records it), `index` (the router side that answers "how
many leading blocks of this request does each replica hold"), `decisions` (the router's
short-lived memory of its own choices), `scoring` (pure ranking functions: cache-aware and the
baselines), `router` (index + record + loads + scoring in one object), `text_trie` (an
approximate text-prefix policy for comparison), `trace` and `simulate` (a seeded workload and a
cluster model to compare policies).

Routing is only a hint: a replica serves any request it gets, whatever the index believes.
"""
