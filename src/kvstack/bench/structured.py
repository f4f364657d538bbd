"""`bench structured`: what a JSON-schema constraint costs per output token, at batch 1 and 16.

The same chat prompt asks for a JSON object; unconstrained requests ignore the end-of-sequence
token and constrained ones follow a schema whose one string field needs more characters than
the run generates, so both produce exactly `new_tokens` tokens per request. The figure is the
decode time per output token (after the first: prefill is not decode) of each request, median
over requests and over `repeats` runs alternating the two, so load drifts hit both alike.
A third run computes the masks inline, on the engine thread after the forward pass, to show
what overlapping them with the forward pass saves.
"""

from __future__ import annotations

from typing import Any

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    progress,
)
from kvstack.bench.format import fmt, median
from kvstack.bench.plots import new_figure, save_figure
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams, StructuredOutputsParams
from kvstack.structured.feature import StructuredOutputs

QUESTION = "Describe the city of Paris as a JSON object with a long description."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "description"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "description": {"type": "string", "minLength": 2000}}}
MODES = ("free", "constrained", "inline")


def sizes(quick: bool) -> tuple[list[int], int, int]:
    """(batch sizes, new tokens per request, repeats)."""
    return ([1, 2], 8, 1) if quick else ([1, 16], 64, 3)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    batches, new_tokens, repeats = sizes(options.quick)
    prompt = subject.chat_prompt(QUESTION)
    llm = subject.llm(kv_cache_memory="512MiB", max_num_seqs=max(batches))
    _generate(llm, prompt, 1, 4, "constrained")  # warm-up: llguidance's vocabulary, compile
    tpot: dict[str, dict[int, list[float]]] = {m: {b: [] for b in batches} for m in MODES}
    with progress(options, len(batches) * repeats * len(MODES), "structured") as bar:
        for batch in batches:
            for _ in range(repeats):
                for mode in MODES:
                    tpot[mode][batch] += _generate(llm, prompt, batch, new_tokens, mode)
                    bar.update(1)
    llm.engine.check_integrity()
    results: dict[str, Any] = {"tpot_ms": {m: {str(b): median(v) for b, v in per.items()}
                                           for m, per in tpot.items()}}
    free = results["tpot_ms"]["free"]
    for mode in ("constrained", "inline"):
        results[f"{mode}_overhead"] = {
            str(b): _overhead(results["tpot_ms"][mode][str(b)], free[str(b)]) for b in batches}
    config = {"model": options.model, "quick": options.quick, "batches": batches,
              "new_tokens": new_tokens, "repeats": repeats, "prompt_tokens": len(prompt),
              "schema": SCHEMA, "temperature": 0.8, "weights": subject.weight_format}
    return CaseResult(case="structured", summary=_summary(config, results), config=config,
                      results=results, plots=[_plot(options, config, results)],
                      table=_table(config, results))


def _generate(llm: LLM, prompt: list[int], batch: int, new_tokens: int,
              mode: str) -> list[float]:
    """Per request, its decode milliseconds per token after the first."""
    constraint = StructuredOutputsParams(json=SCHEMA) if mode != "free" else None
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=new_tokens,
                             ignore_eos=mode == "free", structured_outputs=constraint)
              for i in range(batch)]
    feature = llm.engine.hooks.features.get("structured")
    backend = feature.backend if isinstance(feature, StructuredOutputs) else None
    if backend is not None:
        backend.overlap = mode != "inline"
    try:
        outs = llm.generate([{"prompt_token_ids": prompt}] * batch, params)
    finally:
        if backend is not None:
            backend.overlap = True
    tpots = []
    for out in outs:
        rate = out.metrics.decode_rate(len(out.outputs[0].token_ids))
        assert len(out.outputs[0].token_ids) == new_tokens, out.outputs[0].text
        if rate:
            tpots.append(1000 / rate)
    return tpots


def _overhead(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base - 1


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def _summary(config: dict[str, Any], results: dict[str, Any]) -> str:
    t = results["tpot_ms"]
    parts = [f"batch {b}: {fmt(t['free'][str(b)], 1)} ms/token free, "
             f"{fmt(t['constrained'][str(b)], 1)} constrained "
             f"({_pct(results['constrained_overhead'][str(b)])}; masks inline "
             f"{_pct(results['inline_overhead'][str(b)])})" for b in config["batches"]]
    return (f"structured: JSON-schema constraint vs free decoding, {config['new_tokens']} "
            f"tokens per request, median of {config['repeats']} runs | " + " | ".join(parts))


def _table(config: dict[str, Any], results: dict[str, Any]) -> list[TableRow]:
    t = results["tpot_ms"]
    return [TableRow(f"decode ms/token, JSON schema vs unconstrained, batch {b}",
                     f"{fmt(t['constrained'][str(b)], 1)} ms",
                     f"unconstrained {fmt(t['free'][str(b)], 1)} ms",
                     f"{_pct(results['constrained_overhead'][str(b)])} per token "
                     f"(masks inline: {_pct(results['inline_overhead'][str(b)])})")
            for b in config["batches"]]


def _plot(options: BenchOptions, config: dict[str, Any], results: dict[str, Any]) -> str:
    fig, ax = new_figure(f"Structured output cost per token ({options.threads_text})",
                         "batch size", "decode ms / token")
    batches = config["batches"]
    width = 0.25
    for k, mode in enumerate(MODES):
        xs = [i + (k - 1) * width for i in range(len(batches))]
        ax.bar(xs, [results["tpot_ms"][mode][str(b)] or 0 for b in batches], width, label=mode)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.legend()
    return save_figure(fig, options, "structured.png")
