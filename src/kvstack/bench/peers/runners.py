"""The engines `bench peers` measures, behind one interface: ours in each weight format,
transformers (our weights in float32) and llama.cpp (the model's GGUF file)."""

from __future__ import annotations

import time
from typing import Any

from kvstack.bench.common import BenchOptions, Subject
from kvstack.bench.peers import llamacpp
from kvstack.bench.peers.workloads import Workloads
from kvstack.sampling_params import SamplingParams

# Each engine first runs a short request: lazy set-up (kernel builds, thread pools, first
# allocations) is not billed to the measured runs.
WARMUP_TOKENS = 4



class Runner:
    """One engine under test, loaded and warmed up: `info` (what it runs, bytes it reads) and
    one run of each workload. `batch` returns None where the engine runs single streams."""

    info: dict[str, Any]

    def decode(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float | None,
                                                                  list[float]]:
        """(token ids, TTFT, gaps between tokens) of one greedy stream."""
        raise NotImplementedError

    def prefill(self, prompt: list[int]) -> float:
        """TTFT of the prompt with one new token, nothing cached."""
        raise NotImplementedError

    def batch(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float] | None:
        """(output tokens, seconds) of all prompts at once."""
        return None


class OursRunner(Runner):
    def __init__(self, subject: Subject, work: Workloads, kwargs: dict[str, str]) -> None:
        s = work.sizes
        need = max(len(work.document), len(work.chat) + s.decode_new_tokens,
                   sum(len(p) + s.batch_new_tokens + 16 for p in work.batch),
                   *(len(p) + s.long_new_tokens for p in work.long.values()))
        self.llm = subject.llm(**kwargs, enable_prefix_caching=False, max_num_seqs=s.batch,
                               max_num_batched_tokens=max(2048, len(work.document) + 1),
                               kv_cache_memory=subject.kv_shape().bytes_for(need + 64))
        stats = self.llm.stats()
        self.info = {
            "weight_bytes": self.llm.info.num_weight_bytes,
            # Allocated bytes per token slot: whatever the KV dtype, scales included.
            "kv_bytes_per_token": stats.kv_cache_bytes / (stats.num_blocks_total
                                                          * stats.block_size),
        }
        self._generate([work.chat[:8]], WARMUP_TOKENS)

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    def decode(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float | None,
                                                                  list[float]]:
        out = self._generate([prompt], max_tokens)[0]
        return out.outputs[0].token_ids, out.metrics.ttft, out.metrics.inter_token_latencies

    def prefill(self, prompt: list[int]) -> float:
        ttft = self._generate([prompt], 1)[0].metrics.ttft
        assert ttft is not None
        return ttft

    def batch(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        start = time.perf_counter()
        outs = self._generate(prompts, max_tokens)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


class TransformersRunner(Runner):
    def __init__(self, subject: Subject) -> None:
        self.peer = subject.peer()
        self.info = {
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.peer.model.parameters()),
            "kv_bytes_per_token": subject.kv_shape("float32").bytes_per_token,
        }
        self.peer.generate([subject.encode("warm up")], WARMUP_TOKENS)

    def decode(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float | None,
                                                                  list[float]]:
        run = self.peer.generate([prompt], max_tokens)
        return run.token_ids[0], run.ttft, run.inter_token_latencies

    def prefill(self, prompt: list[int]) -> float:
        return self.peer.generate([prompt], 1).ttft

    def batch(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        run = self.peer.generate(prompts, max_tokens)
        return sum(len(t) for t in run.token_ids), run.elapsed


class LlamaCppRunner(Runner):
    def __init__(self, subject: Subject, options: BenchOptions, work: Workloads) -> None:
        self.peer = llamacpp.LlamaCppPeer(options.model, n_ctx=work.max_len + 64,
                                          threads=options.threads)
        self.info = {
            "weights": self.peer.path.name,
            "weight_type": self.peer.weight_type,
            "weight_bytes": self.peer.num_weight_bytes,
            # llama.cpp's default KV cache is f16: 2 bytes per element.
            "kv_bytes_per_token": subject.kv_shape("float16").bytes_per_token,
            "batch": {"skipped": "llama.cpp runs single streams in this benchmark"},
        }
        self.peer.generate(work.chat[:8], WARMUP_TOKENS)

    def decode(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float | None,
                                                                  list[float]]:
        run = self.peer.generate(prompt, max_tokens)
        return run.token_ids[0], run.ttft, run.inter_token_latencies

    def prefill(self, prompt: list[int]) -> float:
        return self.peer.generate(prompt, 1).ttft
