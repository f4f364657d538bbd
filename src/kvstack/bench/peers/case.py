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

from kvstack.bench.cache import QUESTION
from kvstack.bench.common import (
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
from kvstack.bench.peers.hf import PeerRun
from kvstack.bench.prefix import document
from kvstack.llm import LLM
from kvstack.sampling_params import SamplingParams

# Our engine's weight formats: name -> LLM keyword arguments.
FORMATS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
}
_BANDWIDTH_REPEATS = 3


@dataclass(frozen=True)
class Sizes:
    decode_new_tokens: int
    prefill_tokens: int
    batch: int
    batch_prompt_tokens: int
    batch_new_tokens: int
    bandwidth_probe_bytes: int


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes(4, 48, 2, 16, 4, 64 << 20)
    return Sizes(128, 1800, 32, 128, 64, 1 << 30)


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
        chat=subject.chat_prompt(QUESTION),
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
    engines: dict[str, dict[str, Any]] = {}
    total = 3 * (sum(isinstance(f, dict) for f in formats.values()) + 1) + 2 * (not llamacpp_skip)
    with progress(options, total, "peers") as bar:
        for name, kwargs in formats.items():
            key = f"kvstack_{name}"
            if isinstance(kwargs, str):
                engines[key] = {"skipped": kwargs}
                continue
            engines[key] = _ours(subject, work, kwargs, bar)
            gc.collect()
        engines["transformers"] = _transformers(subject, work, bar)
        engines["llamacpp"] = ({"skipped": llamacpp_skip} if llamacpp_skip else
                               _llamacpp(subject, options, work, bar))
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
        "decode": {"question": QUESTION, "prompt_tokens": len(work.chat),
                   "new_tokens": s.decode_new_tokens, "greedy": True, "ignore_eos": True},
        "prefill": {"prompt_tokens": len(work.document), "document_source": "pydoc_data.topics",
                    "new_tokens": 1, "best_of": 2},
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


def _ours(subject: Subject, work: Workloads, kwargs: dict[str, str], bar: Any) -> dict[str, Any]:
    s = work.sizes
    need = max(len(work.document), len(work.chat) + s.decode_new_tokens,
               sum(len(p) + s.batch_new_tokens + 16 for p in work.batch))
    llm = subject.llm(**kwargs, enable_prefix_caching=False, max_num_seqs=s.batch,
                      max_num_batched_tokens=max(2048, len(work.document) + 1),
                      kv_cache_memory=subject.kv_shape().bytes_for(need + 64))
    stats = llm.stats()
    kv_bytes_per_token = stats.kv_cache_bytes / (stats.num_blocks_total * stats.block_size)
    weight_bytes = int(llm.engine.model.num_weight_bytes)
    _generate(llm, [work.chat[:8]], 2)

    out = _generate(llm, [work.chat], s.decode_new_tokens)[0]
    latencies = out.metrics.inter_token_latencies
    decode = _decode_record(out.outputs[0].token_ids, out.metrics.ttft, latencies,
                            len(work.chat), weight_bytes, kv_bytes_per_token)
    bar.update(1)
    ttfts = [_generate(llm, [work.document], 1)[0].metrics.ttft for _ in range(2)]
    prefill = _prefill_record(len(work.document), min(t for t in ttfts if t is not None))
    bar.update(1)
    start = time.perf_counter()
    outs = _generate(llm, work.batch, s.batch_new_tokens)
    batch = _batch_record(sum(len(o.outputs[0].token_ids) for o in outs),
                          time.perf_counter() - start)
    bar.update(1)
    del llm
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "decode": decode, "prefill": prefill, "batch": batch}


def _transformers(subject: Subject, work: Workloads, bar: Any) -> dict[str, Any]:
    s = work.sizes
    peer = subject.peer()
    weight_bytes = sum(p.numel() * p.element_size() for p in peer.model.parameters())
    kv_bytes_per_token = subject.kv_shape("float32").bytes_per_token
    peer.generate([work.chat[:8]], 2)
    run = peer.generate([work.chat], s.decode_new_tokens)
    decode = _decode_run(run, len(work.chat), weight_bytes, kv_bytes_per_token)
    bar.update(1)
    ttfts = [peer.generate([work.document], 1).ttft for _ in range(2)]
    prefill = _prefill_record(len(work.document), min(ttfts))
    bar.update(1)
    run = peer.generate(work.batch, s.batch_new_tokens)
    batch = _batch_record(sum(len(t) for t in run.token_ids), run.elapsed)
    bar.update(1)
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "decode": decode, "prefill": prefill, "batch": batch}


def _llamacpp(subject: Subject, options: BenchOptions, work: Workloads,
              bar: Any) -> dict[str, Any]:
    peer = llamacpp.LlamaCppPeer(options.model, n_ctx=work.max_len + 64,
                                 threads=options.threads)
    # llama.cpp's default KV cache is f16: 2 bytes per element.
    kv_bytes_per_token = subject.kv_shape("float16").bytes_per_token
    peer.generate(work.chat[:8], 2)
    run = peer.generate(work.chat, work.sizes.decode_new_tokens)
    decode = _decode_run(run, len(work.chat), peer.num_weight_bytes, kv_bytes_per_token)
    bar.update(1)
    ttfts = [peer.generate(work.document, 1).ttft for _ in range(2)]
    prefill = _prefill_record(len(work.document), min(ttfts))
    bar.update(1)
    return {"weights": peer.path.name, "weight_type": peer.weight_type,
            "weight_bytes": peer.num_weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token, "decode": decode, "prefill": prefill,
            "batch": {"skipped": "llama.cpp runs single streams in this benchmark"}}


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


# -- records ----------------------------------------------------------------------------------


def _decode_run(run: PeerRun, prompt_len: int, weight_bytes: int,
                kv_bytes_per_token: float) -> dict[str, Any]:
    return _decode_record(run.token_ids[0], run.ttft, run.inter_token_latencies, prompt_len,
                          weight_bytes, kv_bytes_per_token)


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
