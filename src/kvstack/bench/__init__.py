"""`kvstack bench`: benchmarks of the KV-cache stack against transformers, in the same run.

Each case prints one summary line, writes `<out>/<case>.json` and a PNG plot:
`cache` (decode with and without the KV cache), `throughput` (output tok/s vs concurrency),
`prefix` (TTFT with a cached document) and `pressure` (a third of the KV memory it needs).
"""
