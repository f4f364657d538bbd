"""`kvstack bench`: benchmarks of the KV-cache stack against its peers, in the same run.

Each case prints one summary line, writes `<out>/<case>.json` and PNG plots: `cache` (decode
with and without the KV cache), `throughput` (output tok/s vs concurrency), `prefix` (TTFT with
a cached document), `pressure` (a third of the KV memory it needs), `tiers` (KV restored from
disk and Redis), `serve` (HTTP load), `ttft` (TTFT vs prompt length) and `peers` (transformers
and llama.cpp in every weight format, with decode memory bandwidth). `report` writes the
docs' benchmark page and the README's headline table from the JSON.
"""
