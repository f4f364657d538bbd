"""The documentation's examples that the test suite does not run, each with its reason: the one
place they are listed. A block is kept out by its fence, ```{.bash .notest} or
```{.python .notest}, and its page says so next to it. tests/docs/test_examples.py holds them to
at most a tenth of all examples and fails on a marked block missing here or an entry whose block
is gone. Key: (page, a piece of the block's text)."""

from __future__ import annotations

NOT_EXECUTED: dict[tuple[str, str], str] = {
    ("docs/serving/scoring.md", "lm_eval run --model local-completions"):
        "downloads the hellaswag data set; tests/eval runs the same harness backend on "
        "tasks it writes itself",
    ("docs/models-qwen3.md", 'LLM(model="Qwen3-4B-Q4_K_M.gguf", quantization="gguf")'):
        "no Qwen3 weights ship with kvstack; tests/models runs small random-weight Qwen3 models",
    ("docs/scaling.md", "kvstack serve --replicas 2 --kv-redis-url redis://127.0.0.1:6379/0"):
        "starts a Ray cluster (minutes on two cores); tests/cluster runs the replicas",
}
