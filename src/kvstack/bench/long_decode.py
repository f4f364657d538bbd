"""`bench long_decode`: decode after a long context (where an agent's warm turn spends its
time), our engine in each KV dtype against llama.cpp's `llama-bench -p 0 -n N -d CONTEXT` on
the same GGUF file and threads, in the same run, with what each step reads per part.

For each context (16,384 and 32,768 tokens by default, those the model holds; a shorter model,
the longest context it holds with the new tokens: SmolLM2's 8,128): a prompt of
that many tokens (the start of the prefix case's document), then `new` greedy tokens; decode
tok/s is new tokens after the first over their time (the engines' own inter-token gaps; for
llama.cpp its tg figure). Our engines run twice per context around llama-bench's run (the
first time cold, the second a prefix hit), and the better of each engine's runs counts.

Bytes per step per part (`decode_bytes.py`): the layers' weights, the vocabulary head, and the
K/V attention reads (full layers the whole context, sliding layers their window), for our KV
dtype and for llama.cpp's f16 cache; achieved = bytes x tok/s, against this machine's read
bandwidth (a torch sum over 1 GiB, best of 3, before and after the engines: the better).
Seconds per part (`decode_parts.py`): the head and the attention calls timed alone; the rest
of the step is the layers' products, norms and the Python around the step.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress
from kvstack.bench.decode_bytes import llamacpp, ours
from kvstack.bench.decode_parts import step_parts
from kvstack.bench.peers import llama_bench
from kvstack.bench.peers.workloads import measure_read_bandwidth
from kvstack.bench.prefix import document
from kvstack.errors import InvalidRequestError
from kvstack.kv.groups import KVLayout
from kvstack.kv.sizing import KVShape
from kvstack.sampling_params import SamplingParams
from kvstack.weights import is_gguf_model, resolve_model

KV_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class Sizes:
    contexts: tuple[int, ...]
    new_tokens: int
    peer_repetitions: int
    probe_bytes: int


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes((96,), 4, 1, 64 << 20)
    return Sizes((16384, 32768), 64, 3, 1 << 30)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    s = sizes(options.quick)
    contexts = _contexts(s, subject.max_model_len)
    text = document(subject, max(contexts))
    while len(text) < max(contexts):  # a short document: repeated to the length
        text += text
    torch.set_num_threads(options.threads)
    probes = [measure_read_bandwidth(s.probe_bytes)]
    peer, peer_skipped = _peer(options)
    engines = {kv: _engine(subject, kv, max(contexts) + s.new_tokens) for kv in KV_DTYPES}
    results: dict[str, Any] = {}
    bar = progress(options, len(contexts) * (2 * len(engines) + 1), "long_decode")
    for n in contexts:
        prompt = text[:n]
        runs: dict[str, list[float]] = {kv: [] for kv in engines}
        for kv, llm in engines.items():
            runs[kv].append(_decode(llm, prompt, s.new_tokens))
            bar.update()
        llama = _llama(peer, options, n, s) if peer_skipped is None else None
        bar.update()
        for kv, llm in engines.items():
            runs[kv].append(_decode(llm, prompt, s.new_tokens))
            bar.update()
        results[str(n)] = _context_result(subject, engines, runs, n, llama, peer_skipped)
    bar.close()
    del engines
    gc.collect()
    torch.set_num_threads(options.threads)
    probes.append(measure_read_bandwidth(s.probe_bytes))
    bandwidth = max(probes)
    _add_bandwidth(results, bandwidth)
    return CaseResult(
        case="long_decode",
        summary=_summary(results, bandwidth),
        config={"contexts": contexts, "new_tokens": s.new_tokens, "kv_dtypes": list(KV_DTYPES),
                "llama_bench_repetitions": s.peer_repetitions, "threads": options.threads},
        results={"machine_read_bandwidth_bytes_per_s": bandwidth,
                 "machine_read_bandwidth_probes": probes, "contexts": results},
        table=_table(results),
    )


def _contexts(s: Sizes, max_model_len: int) -> list[int]:
    """The sizes' contexts the model holds with the new tokens; where none fits (SmolLM2's
    8,192 positions), the longest one that does."""
    fits = [n for n in s.contexts if n + s.new_tokens <= max_model_len]
    if fits:
        return fits
    if max_model_len - s.new_tokens < min(s.contexts) // 4:
        raise InvalidRequestError(
            f"the long_decode benchmark needs at least {min(s.contexts) // 4 + s.new_tokens} "
            f"tokens of context and the model has {max_model_len}; use --quick or a model with "
            "a longer context")
    return [max_model_len - s.new_tokens]


def _peer(options: BenchOptions) -> tuple[Any, str | None]:
    """(llama-bench's path, None), or (None, why it cannot run)."""
    if not is_gguf_model(options.model):
        return None, f"llama-bench needs a GGUF file and {options.model} is not one"
    binary = llama_bench.llama_bench_binary()
    if binary is None:
        return None, f"llama-bench is not installed; {llama_bench.INSTALL_HINT}"
    return binary, None


def _engine(subject: Subject, kv_dtype: str, seq_len: int) -> Any:
    """An engine holding one sequence of `seq_len` tokens twice over (the repeat's own new
    blocks beside the cached prompt), prefix caching on."""
    config = subject.checkpoint.config
    dtype = subject.options.dtype or "float32"
    resolved = dtype if kv_dtype == "auto" else kv_dtype
    shape = KVShape.of(config, resolved, KVLayout.of(config.layer_windows(), resolved))
    return subject.llm(kv_cache_dtype=kv_dtype, enable_prefix_caching=True, max_num_seqs=1,
                       max_num_batched_tokens=2048,
                       kv_cache_memory=shape.bytes_for(seq_len + 64, batch=2) + (8 << 20))


def _decode(llm: Any, prompt: list[int], new_tokens: int) -> float:
    """Decode tok/s of one greedy stream after `prompt` (the gaps after the first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    gaps = out.metrics.inter_token_latencies
    return len(gaps) / sum(gaps) if gaps and sum(gaps) > 0 else 0.0


def _llama(binary: Any, options: BenchOptions, context: int, s: Sizes) -> dict[str, Any]:
    try:
        got = llama_bench.run(binary, resolve_model(options.model), context, s.new_tokens,
                              options.threads, s.peer_repetitions)
    except llama_bench.LlamaBenchError as err:
        return {"skipped": str(err)}
    return {"tokens_per_s": max(got.tokens_per_s), "samples": got.tokens_per_s,
            "type_k": got.type_k, "type_v": got.type_v, "flash_attn": got.flash_attn,
            "build": got.build}


def _context_result(subject: Subject, engines: dict[str, Any], runs: dict[str, list[float]],
                    context: int, llama: dict[str, Any] | None,
                    peer_skipped: str | None) -> dict[str, Any]:
    config = subject.checkpoint.config
    windows = config.layer_windows()
    shape = (config.num_kv_heads, config.head_dim)
    out: dict[str, Any] = {}
    for kv, llm in engines.items():
        model, resolved = llm.engine.model, llm.engine.kv_cache_dtype
        rate = max(runs[kv])
        out[f"kvstack_{kv}"] = {
            "kv_dtype": resolved, "tokens_per_s": rate, "runs": runs[kv],
            "bytes_per_step": ours(model, windows, *shape, resolved, context),
            "seconds_per_step": step_parts(model, resolved, windows, context,
                                           config.num_heads, *shape, config.hidden_size,
                                           1 / rate if rate else None),
        }
    if llama is None:
        out["llamacpp"] = {"skipped": peer_skipped}
    else:
        out["llamacpp"] = llama
        if "skipped" not in llama:
            llama["bytes_per_step"] = llamacpp(resolve_model(subject.options.model), windows,
                                               *shape, context)
            for kv in engines:
                ours_rate = out[f"kvstack_{kv}"]["tokens_per_s"]
                out[f"kvstack_{kv}"]["over_llamacpp"] = ours_rate / llama["tokens_per_s"]
    return out


def _add_bandwidth(results: dict[str, Any], bandwidth: float) -> None:
    """Each engine's achieved read rate (bytes per step x steps/s) and its share of the probe."""
    for per_context in results.values():
        for engine in per_context.values():
            if "bytes_per_step" in engine and engine.get("tokens_per_s"):
                achieved = engine["bytes_per_step"]["total"] * engine["tokens_per_s"]
                engine["achieved_bytes_per_s"] = achieved
                engine["share_of_probe"] = achieved / bandwidth


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def _summary(results: dict[str, Any], bandwidth: float) -> str:
    parts = []
    for n, per in results.items():
        cells = []
        for name, e in per.items():
            if "tokens_per_s" not in e:
                cells.append(f"{name} skipped")
                continue
            b = e["bytes_per_step"]
            vs = f" ({e['over_llamacpp']:.2f}x llama.cpp)" if "over_llamacpp" in e else ""
            cells.append(f"{name} {e['tokens_per_s']:.1f} tok/s{vs}, reads weights/head/KV "
                         f"{_mb(b['weights'])}/{_mb(b['head'])}/{_mb(b['kv'])} MB, "
                         f"{e['share_of_probe']:.0%} of the probe")
        parts.append(f"after {n} tokens: " + "; ".join(cells))
    return (f"long_decode: read bandwidth probe {bandwidth / 1e9:.1f} GB/s; "
            + " | ".join(parts))


def _table(results: dict[str, Any]) -> list[TableRow]:
    rows = []
    for n, per in results.items():
        llama = per.get("llamacpp", {})
        peer = f"{llama['tokens_per_s']:.1f}" if "tokens_per_s" in llama else "n/a"
        for name, e in per.items():
            if name == "llamacpp" or "tokens_per_s" not in e:
                continue
            vs = f"{e['over_llamacpp']:.2f}x" if "over_llamacpp" in e else ""
            rows.append(TableRow(f"decode tok/s after {n} tokens, KV {e['kv_dtype']}",
                                 f"{e['tokens_per_s']:.1f}", peer, vs))
    return rows
