"""`bench peers`: the same three workloads on our engine in every weight format it offers, on
transformers (the same weights in float32) and on llama.cpp (the model's GGUF file), in one run.
Our `gguf` format runs the GGUF file's own quantized blocks: the same bytes llama.cpp runs.

- decode: the 46-token chat prompt, 128 new tokens, greedy, one stream: decode tok/s (the
  steps after the first token).
- prefill: a ~1,800-token document, one new token: prompt tokens / TTFT.
- batch: 32 distinct ~128-token prompts at once, 64 new tokens each: output tok/s. llama.cpp
  runs single streams only here.
- decode_1000, decode_4000: decode again after a 1,000- and a 4,000-token prompt (the start
  of the same document), 32 new tokens: where real chats, agents and RAG run, and where the
  KV cache read per step rivals the weights.

Our engines run the C kernels `KVSTACK_KERNELS` selects (`--isa avx2|avx512` sets it; default:
the best this CPU runs); the summary line and the JSON's `config.kernels` name the
implementation, its compiler flags and the CPU's AVX-512 / VNNI / BF16 flags.

Decode reads every weight and the whole KV cache once per step, so it is bound by memory
bandwidth: achieved = (weight bytes + KV bytes read per step) x steps/s, against this machine's
read bandwidth measured in the same run (a sum over a 1 GiB tensor, best of 3, before and
after the engines).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kvstack.bench.common import (
    CHAT_QUESTION,
    BenchOptions,
    CaseResult,
    Subject,
    distinct_prompts,
    progress,
    supports_quantization,
)
from kvstack.bench.format import per_second, ratio
from kvstack.bench.peers import display, llamacpp
from kvstack.bench.peers.display import PEERS, rate, workloads
from kvstack.bench.peers.runners import LlamaCppRunner, OursRunner, Runner, TransformersRunner
from kvstack.bench.peers.workloads import (
    BANDWIDTH_REPEATS,
    Workloads,
    long_workload,
    measure_read_bandwidth,
    sizes,
)
from kvstack.bench.prefix import document
from kvstack.errors import UnsupportedModelError
from kvstack.kernels import build
from kvstack.kernels.allocator import keep_freed_memory
from kvstack.units import common_prefix_len
from kvstack.weights import is_gguf_model

# Our engine's weight formats: name -> LLM keyword arguments.
FORMATS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
}
# Each engine first runs a short request: lazy set-up (kernel builds, thread pools, first
# allocations) is not billed to the measured runs.
_WARMUP_TOKENS = 4


def engine_formats(options: BenchOptions) -> dict[str, dict[str, str] | str]:
    """Our engines to run: name -> LLM keyword arguments, or why that format is skipped.
    --dtype or --quantization picks one format; by default every format runs."""
    if options.dtype or options.quantization:
        return {options.quantization or options.dtype or "float32": {}}
    formats: dict[str, dict[str, str] | str] = dict(FORMATS)
    if not supports_quantization():
        formats["int8"] = "this kvstack's LLM has no `quantization` option yet"
    if not is_gguf_model(options.model):
        formats["gguf"] = f"{options.model} is not a GGUF file"
    return formats


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    s = sizes(options.quick)
    work = Workloads(
        chat=subject.chat_prompt(CHAT_QUESTION),
        document=document(subject, s.prefill_tokens),
        batch=distinct_prompts(subject, s.batch, s.batch_prompt_tokens),
        sizes=s,
    )
    text = document(subject, max(s.long_contexts, default=0))
    work.long = {n: text[:n] for n in s.long_contexts if len(text) >= n}
    subject.require_context(work.max_len, "the peers benchmark")
    formats = engine_formats(options)
    kernels = build.describe()  # raises the one-line error for a forced ISA this CPU lacks
    torch.set_num_threads(options.threads)
    # Our engines set it when built; set first, transformers (same process) runs under it too.
    keep_freed_memory()
    # Probed before and after the engines: other jobs' memory traffic lowers a probe, never
    # raises it, so the better of the two is the closer estimate of the bound.
    probes = [measure_read_bandwidth(s.bandwidth_probe_bytes)]
    runners, engines = _load_engines(subject, options, work, formats)
    _measure(runners, engines, work, options)
    del runners
    gc.collect()
    torch.set_num_threads(options.threads)
    probes.append(measure_read_bandwidth(s.bandwidth_probe_bytes))
    bandwidth = max(probes)
    reference = _finish_decode_records(engines, bandwidth)
    ratios = _ratios(engines, work)
    return CaseResult(
        case="peers",
        summary=display.summary(engines, ratios, bandwidth, work, kernels),
        config=_config(options, work, formats) | {"kernels": kernels},
        results={"machine_read_bandwidth_bytes_per_s": bandwidth,
                 "machine_read_bandwidth_probes": probes, "engines": engines,
                 "ratios": ratios, "token_reference": reference},
        plots=[display.plot(options, engines, bandwidth, work)],
        table=display.table(engines, ratios, bandwidth, work),
    )


def _load_engines(subject: Subject, options: BenchOptions, work: Workloads,
                  formats: dict[str, dict[str, str] | str]
                  ) -> tuple[dict[str, Runner], dict[str, dict[str, Any]]]:
    """Every engine loaded (and warmed up) before any is measured; engines that cannot run
    get {"skipped": why}. Ours first, in format order, then transformers and llama.cpp."""
    engines: dict[str, dict[str, Any]] = {}
    runners: dict[str, Runner] = {}

    def add(key: str, make: Callable[[], Runner] | None, skipped: str | None = None) -> None:
        if skipped is not None or make is None:
            engines[key] = {"skipped": skipped}
            return
        try:
            runners[key] = make()
        except UnsupportedModelError as err:  # a format this model file cannot run
            engines[key] = {"skipped": str(err)}
            return
        engines[key] = runners[key].info

    for name, kwargs in formats.items():
        if isinstance(kwargs, str):
            add(f"kvstack_{name}", None, kwargs)
        else:
            add(f"kvstack_{name}", partial(OursRunner, subject, work, kwargs))
    add("transformers", lambda: TransformersRunner(subject))
    add("llamacpp", lambda: LlamaCppRunner(subject, options, work),
        llamacpp.unavailable_reason(options.model))
    return runners, engines


def _finish_decode_records(engines: dict[str, dict[str, Any]], bandwidth: float) -> str:
    """Bandwidth achieved and greedy agreement per engine; returns the reference engine (our
    first format's, float32 unless --dtype says) whose tokens the others are compared with."""
    reference = next(k for k in engines if "decode" in engines[k])
    for engine in engines.values():
        for key in [k for k in engine if k.startswith("decode")]:
            d = engine[key]
            d["bandwidth_bytes_per_s"] = d["bytes_per_step"] * d["decode_tok_s"]
            d["bandwidth_fraction"] = d["bandwidth_bytes_per_s"] / bandwidth
            d["matching_tokens_vs_reference"] = common_prefix_len(
                engines[reference][key]["token_ids"], d["token_ids"])
    return reference


def _config(options: BenchOptions, work: Workloads,
            formats: dict[str, dict[str, str] | str]) -> dict[str, Any]:
    s = work.sizes
    return {
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
        "long_decode": {long_workload(n): {"prompt_tokens": len(p),
                                           "new_tokens": s.long_new_tokens}
                        for n, p in work.long.items()},
        "kvstack_formats": dict(formats),
        "transformers_dtype": "float32",
        "llamacpp_weights": "the model's GGUF file as is (the same bytes as kvstack_gguf; other "
                            "formats: different weights and arithmetic)",
        "bandwidth_probe": f"torch.sum over {s.bandwidth_probe_bytes >> 20} MiB, best of "
                           f"{BANDWIDTH_REPEATS}, before and after the engines",
    }


def _measure(runners: dict[str, Runner], engines: dict[str, dict[str, Any]], work: Workloads,
             options: BenchOptions) -> None:
    """Every workload `repeats` times on every engine in turn; each engine keeps its best run
    (fastest decode, prefill and batch) in `engines[key]`."""
    s = work.sizes
    names = workloads(work)
    prompts = {"decode": (work.chat, s.decode_new_tokens)} | {
        long_workload(n): (p, s.long_new_tokens) for n, p in work.long.items()}
    total = s.repeats * len(runners) * len(names)
    with progress(options, total, "peers") as bar:
        for workload in names:
            for _ in range(s.repeats):
                for key, runner in runners.items():
                    info = engines[key]
                    record: dict[str, Any] | None
                    if workload in prompts:
                        prompt, new_tokens = prompts[workload]
                        ids, ttft, gaps = runner.decode(prompt, new_tokens)
                        record = _decode_record(ids, ttft, gaps, len(prompt),
                                                info["weight_bytes"], info["kv_bytes_per_token"])
                    elif workload == "prefill":
                        record = _prefill_record(len(work.document),
                                                 runner.prefill(work.document))
                    else:
                        done = runner.batch(work.batch, s.batch_new_tokens)
                        record = None if done is None else _batch_record(*done)
                    bar.update(1)
                    best = rate(info, workload)
                    new = rate({workload: record}, workload) if record is not None else None
                    if record is not None and (best is None
                                               or (new is not None and new > best)):
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


def _ratios(engines: dict[str, dict[str, Any]], work: Workloads
            ) -> dict[str, dict[str, float | None]]:
    """ours / peer for every (our format, peer, workload): > 1 means kvstack is faster."""
    return {
        ours: {f"{workload}_over_{peer}": ratio(rate(engines[ours], workload),
                                               rate(engines[peer], workload))
               for peer in PEERS for workload in workloads(work)}
        for ours in engines if ours.startswith("kvstack_")
    }
