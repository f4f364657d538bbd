"""`bench cache`: what the KV cache buys inside one request.

One chat prompt, greedy, a fixed number of new tokens. Our engine with the KV cache and without
it (every step recomputes the whole sequence), and transformers' `generate` with `use_cache`
on and off, in the same run. Without a cache the per-token latency climbs with the position;
with one it stays flat. Two plots: per-token latency against position, and the total time to
produce the first N new tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstack.bench.common import (
    CHAT_QUESTION,
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    progress,
)
from kvstack.bench.format import fmt, fmt_x, per_second, ratio
from kvstack.bench.peers.hf import PeerRun
from kvstack.bench.plots import new_figure, save_figure
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.units import common_prefix_len

_WARMUP_TOKENS = 2


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    new_tokens = 8 if options.quick else 100
    prompt = subject.chat_prompt(CHAT_QUESTION)
    subject.require_context(len(prompt) + new_tokens, "the cache benchmark")
    ours = {
        "kv_cache": _ours(subject, options, prompt, new_tokens, use_kv_cache=True),
        "no_kv_cache": _ours(subject, options, prompt, new_tokens, use_kv_cache=False),
    }
    peer = {
        "kv_cache": _peer(subject, options, prompt, new_tokens, use_cache=True),
        "no_kv_cache": _peer(subject, options, prompt, new_tokens, use_cache=False),
    }
    cached_ids = ours["kv_cache"]["token_ids"]
    ratios = {
        "ours_over_transformers_decode_kv_cache": ratio(ours["kv_cache"]["decode_tok_s"],
                                                        peer["kv_cache"]["decode_tok_s"]),
        "ours_over_transformers_decode_no_kv_cache": ratio(ours["no_kv_cache"]["decode_tok_s"],
                                                           peer["no_kv_cache"]["decode_tok_s"]),
        "kv_cache_speedup_ours": ratio(ours["kv_cache"]["decode_tok_s"],
                                       ours["no_kv_cache"]["decode_tok_s"]),
        "kv_cache_speedup_transformers": ratio(peer["kv_cache"]["decode_tok_s"],
                                               peer["no_kv_cache"]["decode_tok_s"]),
        "total_time_transformers_over_ours_kv_cache": ratio(peer["kv_cache"]["total_s"],
                                                            ours["kv_cache"]["total_s"]),
    }
    agreement = {
        "ours_kv_cache_vs_no_kv_cache": common_prefix_len(cached_ids,
                                                      ours["no_kv_cache"]["token_ids"]),
        "ours_vs_transformers": common_prefix_len(cached_ids, peer["kv_cache"]["token_ids"]),
    }
    plots = [_plot_latency(options, len(prompt), ours, peer),
             _plot_total(options, len(prompt), ours, peer)]
    summary = (
        f"cache: {len(prompt)}-token prompt, {new_tokens} new tokens, {options.threads_text}"
        f" | ours {fmt(ours['kv_cache']['decode_tok_s'])} tok/s with KV cache, "
        f"{fmt(ours['no_kv_cache']['decode_tok_s'])} without "
        f"({fmt_x(ratios['kv_cache_speedup_ours'])})"
        f" | transformers {fmt(peer['kv_cache']['decode_tok_s'])} / "
        f"{fmt(peer['no_kv_cache']['decode_tok_s'])} "
        f"({fmt_x(ratios['kv_cache_speedup_transformers'])})"
        f" | ours/theirs {fmt_x(ratios['ours_over_transformers_decode_kv_cache'])} cached, "
        f"{fmt_x(ratios['ours_over_transformers_decode_no_kv_cache'])} uncached"
        f" | {new_tokens} tokens in {fmt(ours['kv_cache']['total_s'], 2)} s, "
        f"{fmt(ours['no_kv_cache']['total_s'], 2)} s without cache "
        f"(transformers {fmt(peer['kv_cache']['total_s'], 2)} s, "
        f"{fmt(peer['no_kv_cache']['total_s'], 2)} s)"
        f" | same tokens as transformers: {agreement['ours_vs_transformers']}/{new_tokens}"
    )
    return CaseResult(
        case="cache",
        summary=summary,
        config={"model": options.model, "quick": options.quick, "question": CHAT_QUESTION,
                "prompt_tokens": len(prompt), "new_tokens": new_tokens, "greedy": True,
                "ignore_eos": True, "weights": subject.weight_format,
                "transformers_dtype": "float32"},
        results={"ours": ours, "transformers": peer, "ratios": ratios,
                 "matching_tokens": agreement},
        plots=plots,
        table=_table(len(prompt), new_tokens, ours, peer, ratios),
    )


def _table(prompt_len: int, new_tokens: int, ours: dict[str, Any], peer: dict[str, Any],
           ratios: dict[str, float | None]) -> list[TableRow]:
    rows = [
        TableRow(f"decode tok/s, {prompt_len}-token chat prompt, {new_tokens} new tokens, "
                 f"{label}", fmt(ours[key]["decode_tok_s"]),
                 f"transformers {fmt(peer[key]['decode_tok_s'])}",
                 fmt_x(ratios[f"ours_over_transformers_decode_{key}"]))
        for key, label in (("kv_cache", "KV cache"), ("no_kv_cache", "no KV cache"))
    ]
    rows.append(TableRow(
        f"total time for {new_tokens} new tokens, KV cache / no KV cache",
        f"{fmt(ours['kv_cache']['total_s'], 2)} s / {fmt(ours['no_kv_cache']['total_s'], 2)} s",
        f"transformers {fmt(peer['kv_cache']['total_s'], 2)} s / "
        f"{fmt(peer['no_kv_cache']['total_s'], 2)} s",
        f"{fmt_x(ratio(peer['kv_cache']['total_s'], ours['kv_cache']['total_s']))} / "
        f"{fmt_x(ratio(peer['no_kv_cache']['total_s'], ours['no_kv_cache']['total_s']))}",
    ))
    return rows


def _ours(subject: Subject, options: BenchOptions, prompt: list[int], new_tokens: int,
          use_kv_cache: bool) -> dict[str, Any]:
    num_tokens = len(prompt) + new_tokens
    # Prefix caching off: the warm-up must not make the measured prefill a cache hit.
    llm = subject.llm(use_kv_cache=use_kv_cache, enable_prefix_caching=False,
                      kv_cache_memory=subject.kv_shape().bytes_for(num_tokens + 64))
    llm.generate({"prompt_token_ids": prompt[:8]}, _params(_WARMUP_TOKENS))
    label = "ours, KV cache" if use_kv_cache else "ours, no KV cache"
    final: RequestOutput | None = None
    with progress(options, new_tokens, label) as bar:
        for out in llm.stream({"prompt_token_ids": prompt}, _params(new_tokens)):
            final = out
            bar.update(1)
    assert final is not None and final.metrics.first_token_time is not None
    m = final.metrics
    end = m.finished_time or m.last_token_time
    assert end is not None  # the request produced its tokens
    return _record(
        token_ids=final.outputs[0].token_ids,
        ttft=m.ttft,
        total=end - m.arrival_time,
        latencies=m.inter_token_latencies,
        prompt_len=len(prompt),
    )


def _peer(subject: Subject, options: BenchOptions, prompt: list[int], new_tokens: int,
          use_cache: bool) -> dict[str, Any]:
    peer = subject.peer()
    peer.generate([prompt[:8]], _WARMUP_TOKENS, use_cache=use_cache)
    label = "transformers, use_cache" if use_cache else "transformers, use_cache=False"
    with progress(options, new_tokens, label) as bar:
        result: PeerRun = peer.generate([prompt], new_tokens, use_cache=use_cache,
                                        on_token=lambda: bar.update(1))
    return _record(
        token_ids=result.token_ids[0],
        ttft=result.ttft,
        total=result.elapsed,
        latencies=result.inter_token_latencies,
        prompt_len=len(prompt),
    )


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _record(token_ids: list[int], ttft: float | None, total: float, latencies: list[float],
            prompt_len: int) -> dict[str, Any]:
    """One run's numbers. Latency i is the gap before output token i+1, whose step reads
    `context_tokens[i]` = prompt_len + i + 1 positions."""
    return {
        "num_new_tokens": len(token_ids),
        "ttft_s": ttft,
        # After the first token: decode only (the first token pays the prefill, in TTFT).
        "decode_tok_s": per_second(len(latencies), sum(latencies)),
        "total_s": total,
        "inter_token_latencies_ms": [round(t * 1000, 3) for t in latencies],
        "context_tokens": [prompt_len + i + 1 for i in range(len(latencies))],
        "token_ids": list(token_ids),
    }


_SERIES = (("kvstack", "-"), ("transformers", "--"))
_MODES = (("kv_cache", "KV cache"), ("no_kv_cache", "no KV cache"))


def _plot_latency(options: BenchOptions, prompt_len: int, ours: dict[str, Any],
                  peer: dict[str, Any]) -> str:
    def series(run: dict[str, Any]) -> tuple[list[int], list[float]]:
        return run["context_tokens"], run["inter_token_latencies_ms"]

    return _plot_runs(options, ours, peer, series, "cache_latency.png",
                      f"Per-token latency vs position ({prompt_len}-token prompt, "
                      f"{options.threads_text})", "context length (tokens)",
                      "time per token (ms)")


def _plot_total(options: BenchOptions, prompt_len: int, ours: dict[str, Any],
                peer: dict[str, Any]) -> str:
    """Seconds from the request to its N-th new token: TTFT, then the running sum of the
    per-token latencies."""
    def series(run: dict[str, Any]) -> tuple[list[int], list[float]]:
        elapsed = [run["ttft_s"]]
        for ms in run["inter_token_latencies_ms"]:
            elapsed.append(elapsed[-1] + ms / 1000)
        return list(range(1, len(elapsed) + 1)), elapsed

    return _plot_runs(options, ours, peer, series, "cache_total_time.png",
                      f"Total time for N new tokens ({prompt_len}-token prompt, "
                      f"{options.threads_text})", "new tokens generated (N)",
                      "time since the request (s)")


def _plot_runs(options: BenchOptions, ours: dict[str, Any], peer: dict[str, Any],
               series: Callable[[dict[str, Any]], tuple[list[int], list[float]]], name: str,
               title: str, xlabel: str, ylabel: str) -> str:
    """One line per engine (kvstack solid, transformers dashed) and mode (KV cache or not)."""
    fig, ax = new_figure(title, xlabel, ylabel)
    for (engine, style), runs in zip(_SERIES, (ours, peer), strict=True):
        for key, label in _MODES:
            xs, ys = series(runs[key])
            ax.plot(xs, ys, style, label=f"{engine}, {label}",
                    color="C0" if key == "kv_cache" else "C3",
                    alpha=1.0 if engine == "kvstack" else 0.6)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend()
    return save_figure(fig, options, name)
