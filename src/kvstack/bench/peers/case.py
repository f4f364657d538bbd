"""`bench peers`: the same three workloads on our engine in every weight format it offers, on
transformers (the same weights in float32) and on llama.cpp (the model's GGUF file), in one run.

- decode: the 46-token chat prompt, 128 new tokens, greedy, one stream: decode tok/s (the
  steps after the first token).
- prefill: a ~1,800-token document, one new token: prompt tokens / TTFT.
- batch: 32 distinct ~128-token prompts at once, 64 new tokens each: output tok/s. llama.cpp
  runs single streams only here.

Decode reads every weight and the whole KV cache once per step, so it is bound by memory
bandwidth: achieved = (weight bytes + KV bytes read per step) x steps/s, against this machine's
read bandwidth measured in the same run (a sum over a 1 GiB tensor, best of 3, before and
after the engines).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.bench.common import (
    CHAT_QUESTION,
    BenchOptions,
    CaseResult,
    Subject,
    common_prefix,
    distinct_prompts,
    per_second,
    progress,
    ratio,
    supports_quantization,
)
from kvstack.bench.peers import display, llamacpp
from kvstack.bench.peers.display import PEERS, WORKLOADS, rate
from kvstack.bench.prefix import document
from kvstack.sampling_params import SamplingParams

# Our engine's weight formats: name -> LLM keyword arguments.
FORMATS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
}
_BANDWIDTH_REPEATS = 3
# Each engine first runs a short request: lazy set-up (kernel builds, thread pools, first
# allocations) is not billed to the measured runs.
_WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Sizes:
    repeats: int  # runs of each workload on each engine; the best counts
    decode_new_tokens: int
    prefill_tokens: int
    batch: int
    batch_prompt_tokens: int
    batch_new_tokens: int
    bandwidth_probe_bytes: int


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes(1, 4, 48, 2, 16, 4, 64 << 20)
    return Sizes(2, 128, 1800, 32, 128, 64, 1 << 30)


@dataclass
class Workloads:
    chat: list[int]
    document: list[int]
    batch: list[list[int]]
    sizes: Sizes

    @property
    def max_len(self) -> int:
        return max(len(self.chat) + self.sizes.decode_new_tokens, len(self.document) + 1,
                   max(len(p) for p in self.batch) + self.sizes.batch_new_tokens)


def engine_formats(options: BenchOptions) -> dict[str, dict[str, str] | str]:
    """Our engines to run: name -> LLM keyword arguments, or why that format is skipped.
    --dtype or --quantization picks one format; by default every format runs."""
    if options.dtype or options.quantization:
        return {options.quantization or options.dtype or "float32": {}}
    formats: dict[str, dict[str, str] | str] = dict(FORMATS)
    if not supports_quantization():
        formats["int8"] = "this kvstack's LLM has no `quantization` option yet"
    return formats


def measure_read_bandwidth(num_bytes: int, repeats: int = _BANDWIDTH_REPEATS) -> float:
    """Bytes per second that torch reads from memory on the current threads: a sum over a
    tensor far larger than the caches, best of `repeats`."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    s = sizes(options.quick)
    work = Workloads(
        chat=subject.chat_prompt(CHAT_QUESTION),
        document=document(subject, s.prefill_tokens),
        batch=distinct_prompts(subject, s.batch, s.batch_prompt_tokens),
        sizes=s,
    )
    subject.require_context(work.max_len, "the peers benchmark")
    formats = engine_formats(options)
    llamacpp_skip = llamacpp.unavailable_reason(options.model)

    torch.set_num_threads(options.threads)
    # Probed before and after the engines: other jobs' memory traffic lowers a probe, never
    # raises it, so the better of the two is the closer estimate of the bound.
    probes = [measure_read_bandwidth(s.bandwidth_probe_bytes)]
    # Every engine is loaded (and warmed up) before any is measured.
    engines: dict[str, dict[str, Any]] = {}
    runners: dict[str, _Runner] = {}
    for name, kwargs in formats.items():
        if isinstance(kwargs, str):
            engines[f"kvstack_{name}"] = {"skipped": kwargs}
        else:
            runners[f"kvstack_{name}"] = _Ours(subject, work, kwargs)
            engines[f"kvstack_{name}"] = runners[f"kvstack_{name}"].info
    runners["transformers"] = _Transformers(subject)
    engines["transformers"] = runners["transformers"].info
    if llamacpp_skip:
        engines["llamacpp"] = {"skipped": llamacpp_skip}
    else:
        runners["llamacpp"] = _LlamaCpp(subject, options, work)
        engines["llamacpp"] = runners["llamacpp"].info
    _measure(runners, engines, work, options)
    del runners
    gc.collect()
    torch.set_num_threads(options.threads)
    probes.append(measure_read_bandwidth(s.bandwidth_probe_bytes))
    bandwidth = max(probes)

    # Greedy tokens are compared with our first format's (float32 unless --dtype says).
    reference = next(k for k in engines if "decode" in engines[k])
    for engine in engines.values():
        if "decode" in engine:
            d = engine["decode"]
            d["bandwidth_bytes_per_s"] = d["bytes_per_step"] * d["decode_tok_s"]
            d["bandwidth_fraction"] = d["bandwidth_bytes_per_s"] / bandwidth
            d["matching_tokens_vs_reference"] = common_prefix(
                engines[reference]["decode"]["token_ids"], d["token_ids"])
    ratios = _ratios(engines)
    plot = display.plot(options, engines, bandwidth, work)
    config = {
        "model": options.model, "quick": options.quick, "threads": options.threads,
        "decode": {"question": CHAT_QUESTION, "prompt_tokens": len(work.chat),
                   "new_tokens": s.decode_new_tokens, "greedy": True, "ignore_eos": True},
        "prefill": {"prompt_tokens": len(work.document), "document_source": "pydoc_data.topics",
                    "new_tokens": 1},
        "best_of": s.repeats,
        "order": "every engine loaded at once; each repeat of a workload runs every engine in "
                 "turn, so a burst of load from other jobs hits them alike",
        "batch": {"num_prompts": s.batch, "prompt_tokens": s.batch_prompt_tokens,
                  "new_tokens": s.batch_new_tokens, "llamacpp": "not run (single stream)"},
        "kvstack_formats": {name: kwargs for name, kwargs in formats.items()},
        "transformers_dtype": "float32",
        "llamacpp_weights": "the model's GGUF file as is (different weights and arithmetic)",
        "bandwidth_probe": f"torch.sum over {s.bandwidth_probe_bytes >> 20} MiB, best of "
                           f"{_BANDWIDTH_REPEATS}, before and after the engines",
    }
    return CaseResult(
        case="peers",
        summary=display.summary(engines, ratios, bandwidth, work),
        config=config,
        results={"machine_read_bandwidth_bytes_per_s": bandwidth,
                 "machine_read_bandwidth_probes": probes, "engines": engines,
                 "ratios": ratios, "token_reference": reference},
        plots=[plot],
        table=display.table(engines, ratios, bandwidth, work),
    )


# -- the engines ------------------------------------------------------------------------------


class _Runner:
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


class _Ours(_Runner):
    def __init__(self, subject: Subject, work: Workloads, kwargs: dict[str, str]) -> None:
        s = work.sizes
        need = max(len(work.document), len(work.chat) + s.decode_new_tokens,
                   sum(len(p) + s.batch_new_tokens + 16 for p in work.batch))
        self.llm = subject.llm(**kwargs, enable_prefix_caching=False, max_num_seqs=s.batch,
                               max_num_batched_tokens=max(2048, len(work.document) + 1),
                               kv_cache_memory=subject.kv_shape().bytes_for(need + 64))
        stats = self.llm.stats()
        self.info = {
            "weight_bytes": int(self.llm.engine.model.num_weight_bytes),
            # Allocated bytes per token slot: whatever the KV dtype, scales included.
            "kv_bytes_per_token": stats.kv_cache_bytes / (stats.num_blocks_total
                                                          * stats.block_size),
        }
        self._generate([work.chat[:8]], _WARMUP_TOKENS)

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


class _Transformers(_Runner):
    def __init__(self, subject: Subject) -> None:
        self.peer = subject.peer()
        self.info = {
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.peer.model.parameters()),
            "kv_bytes_per_token": subject.kv_shape("float32").bytes_per_token,
        }
        self.peer.generate([subject.encode("warm up")], _WARMUP_TOKENS)

    def decode(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float | None,
                                                                  list[float]]:
        run = self.peer.generate([prompt], max_tokens)
        return run.token_ids[0], run.ttft, run.inter_token_latencies

    def prefill(self, prompt: list[int]) -> float:
        return self.peer.generate([prompt], 1).ttft

    def batch(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        run = self.peer.generate(prompts, max_tokens)
        return sum(len(t) for t in run.token_ids), run.elapsed


class _LlamaCpp(_Runner):
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
        self.peer.generate(work.chat[:8], _WARMUP_TOKENS)

    def decode(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float | None,
                                                                  list[float]]:
        run = self.peer.generate(prompt, max_tokens)
        return run.token_ids[0], run.ttft, run.inter_token_latencies

    def prefill(self, prompt: list[int]) -> float:
        return self.peer.generate(prompt, 1).ttft


def _measure(runners: dict[str, _Runner], engines: dict[str, dict[str, Any]], work: Workloads,
             options: BenchOptions) -> None:
    """Every workload `repeats` times on every engine in turn; each engine keeps its best run
    (fastest decode, prefill and batch) in `engines[key]`."""
    s = work.sizes
    total = s.repeats * len(runners) * len(WORKLOADS)
    with progress(options, total, "peers") as bar:
        for workload in WORKLOADS:
            for _ in range(s.repeats):
                for key, runner in runners.items():
                    info = engines[key]
                    if workload == "decode":
                        ids, ttft, gaps = runner.decode(work.chat, s.decode_new_tokens)
                        record = _decode_record(ids, ttft, gaps, len(work.chat),
                                                info["weight_bytes"], info["kv_bytes_per_token"])
                    elif workload == "prefill":
                        record = _prefill_record(len(work.document),
                                                 runner.prefill(work.document))
                    else:
                        done = runner.batch(work.batch, s.batch_new_tokens)
                        record = None if done is None else _batch_record(*done)
                    bar.update(1)
                    best = rate(info, workload)
                    if record is not None and (best is None
                                               or rate({workload: record}, workload) > best):
                        info[workload] = record


# -- records ----------------------------------------------------------------------------------


def _decode_record(token_ids: list[int], ttft: float | None, latencies: list[float],
                   prompt_len: int, weight_bytes: int,
                   kv_bytes_per_token: float) -> dict[str, Any]:
    # Decode step i (1..n-1) attends over prompt_len + i positions: prompt_len + n/2 on average.
    mean_context = prompt_len + (len(latencies) + 1) / 2
    return {
        "num_new_tokens": len(token_ids),
        "ttft_s": ttft,
        "decode_tok_s": per_second(len(latencies), sum(latencies)),
        "mean_context_tokens": mean_context,
        "bytes_per_step": weight_bytes + kv_bytes_per_token * mean_context,
        "token_ids": list(token_ids),
    }


def _prefill_record(num_tokens: int, ttft: float) -> dict[str, Any]:
    return {"prompt_tokens": num_tokens, "ttft_s": ttft,
            "prefill_tok_s": per_second(num_tokens, ttft)}


def _batch_record(output_tokens: int, elapsed: float) -> dict[str, Any]:
    return {"output_tokens": output_tokens, "elapsed_s": elapsed,
            "output_tok_s": per_second(output_tokens, elapsed)}


def _ratios(engines: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """ours / peer for every (our format, peer, workload): > 1 means kvstack is faster."""
    return {
        ours: {f"{workload}_over_{peer}": ratio(rate(engines[ours], workload),
                                               rate(engines[peer], workload))
               for peer in PEERS for workload in WORKLOADS}
        for ours in engines if ours.startswith("kvstack_")
    }
