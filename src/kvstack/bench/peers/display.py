"""How `bench peers` shows its results: the summary line, the benchmark page's rows and the plot."""

from __future__ import annotations

from typing import Any

from kvstack.bench.common import BenchOptions, TableRow
from kvstack.bench.format import fmt, fmt_x
from kvstack.bench.peers.workloads import Workloads, long_workload
from kvstack.bench.plots import save_figure

PEERS = ("transformers", "llamacpp")
PEER_NAMES = {"transformers": "transformers", "llamacpp": "llama.cpp"}
_METRIC = {"decode": "decode_tok_s", "prefill": "prefill_tok_s", "batch": "output_tok_s"}


def workloads(work: Workloads) -> tuple[str, ...]:
    """This run's workloads in the order they run: decode, decode after each long prompt,
    prefill, batch."""
    return ("decode", *(long_workload(n) for n in work.long), "prefill", "batch")


def rate(engine: dict[str, Any], workload: str) -> float | None:
    """The workload's headline figure (tok/s) of one engine's results, None if not run."""
    metric = "decode_tok_s" if workload.startswith("decode") else _METRIC[workload]
    return engine.get(workload, {}).get(metric)


def _long_text(engine: dict[str, Any], ratios: dict[str, float | None], work: Workloads) -> str:
    """", decode after 1000 tokens 120 (1.2x vs llama.cpp, 40% of bandwidth), ..." """
    parts = []
    for n in work.long:
        d = engine.get(long_workload(n))
        if d is None:
            continue
        vs = ratios.get(f"{long_workload(n)}_over_llamacpp")
        parts.append(f"after {n} tokens {fmt(d['decode_tok_s'])} ("
                     + (f"{fmt_x(vs)} vs llama.cpp, " if vs is not None else "")
                     + f"{fmt(d['bandwidth_fraction'] * 100, 0)}% of bandwidth)")
    return "".join(f", decode {p}" for p in parts)


def _ours_names(engines: dict[str, dict[str, Any]]) -> list[str]:
    return [k for k in engines if k.startswith("kvstack_")]


def kernels_text(kernels: dict[str, Any]) -> str:
    """Which C kernels ran and what the CPU has, e.g. "C kernels avx2 (CPU: AVX-512 no,
    VNNI no, BF16 no, AMX no)"; `kernels` is `kernels.build.describe()`."""
    cpu, used = kernels["cpu"], kernels["dot_products"]
    dots = [name.upper() for name in ("vnni", "bf16", "amx") if used.get(name)]
    name = kernels["isa"] or "off (PyTorch ops)"
    return (f"C kernels {name}" + (f" with {'+'.join(dots)} dot products" if dots else "")
            + f" (CPU: AVX-512 {_yes(cpu['avx512'])}, VNNI {_yes(cpu['avx512_vnni'])}, "
            f"BF16 {_yes(cpu['avx512_bf16'])}, AMX {_yes(cpu.get('amx', False))})")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def summary(engines: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float | None]],
            bandwidth: float, work: Workloads, kernels: dict[str, Any]) -> str:
    s = work.sizes
    parts = [
        f"peers: {kernels_text(kernels)}; decode tok/s ({len(work.chat)}-token prompt, "
        f"{s.decode_new_tokens} new), "
        f"prefill tok/s ({len(work.document)} tokens), batch-{s.batch} output tok/s; "
        f"x = ours/theirs (transformers fp32, llama.cpp GGUF); bandwidth of "
        f"{fmt(bandwidth / 1e9)} GB/s measured"
    ]
    for key in _ours_names(engines):
        e, r = engines[key], ratios.get(key, {})
        name = key.removeprefix("kvstack_")
        if "skipped" in e:
            parts.append(f"ours {name}: skipped ({e['skipped']})")
            continue
        parts.append(
            f"ours {name}: decode {fmt(rate(e, 'decode'))} "
            f"({fmt_x(r['decode_over_transformers'])}, {fmt_x(r['decode_over_llamacpp'])}), "
            f"prefill {fmt(rate(e, 'prefill'), 0)} ({fmt_x(r['prefill_over_transformers'])}, "
            f"{fmt_x(r['prefill_over_llamacpp'])}), batch {fmt(rate(e, 'batch'), 0)} "
            f"({fmt_x(r['batch_over_transformers'])}), decode at "
            f"{fmt(e['decode']['bandwidth_fraction'] * 100, 0)}% of bandwidth"
            + _long_text(e, r, work)
        )
    t = engines["transformers"]
    parts.append(f"transformers: decode {fmt(rate(t, 'decode'))}, prefill "
                 f"{fmt(rate(t, 'prefill'), 0)}, batch {fmt(rate(t, 'batch'), 0)}")
    llama = engines["llamacpp"]
    if "skipped" in llama:
        parts.append(f"llama.cpp: skipped ({llama['skipped']})")
    else:
        parts.append(f"{_llamacpp_label(engines)}: decode {fmt(rate(llama, 'decode'))}, "
                     f"prefill {fmt(rate(llama, 'prefill'), 0)}, decode at "
                     f"{fmt(llama['decode']['bandwidth_fraction'] * 100, 0)}% of bandwidth"
                     + _long_text(llama, {}, work))
    return " | ".join(parts)


def table(engines: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float | None]],
          bandwidth: float, work: Workloads) -> list[TableRow]:
    """One row per workload: our formats side by side ("a / b / c"), then the peers."""
    s = work.sizes
    ours = _ours_names(engines)
    names = " / ".join(k.removeprefix("kvstack_") for k in ours)
    labels = {"transformers": "transformers fp32", "llamacpp": _llamacpp_label(engines)}
    titles = {
        "decode": f"decode tok/s, 1 stream, {len(work.chat)}-token chat prompt, "
                  f"{s.decode_new_tokens} new tokens",
        "prefill": f"prefill tok/s, {len(work.document)}-token prompt (TTFT)",
        "batch": f"output tok/s, {s.batch} concurrent ~{s.batch_prompt_tokens}-token prompts, "
                 f"{s.batch_new_tokens} new tokens",
    } | {long_workload(n): f"decode tok/s, 1 stream, {len(p)}-token prompt, "
                           f"{s.long_new_tokens} new tokens" for n, p in work.long.items()}
    rows = []
    for workload in workloads(work):
        ran = [p for p in PEERS if rate(engines[p], workload) is not None]
        rows.append(TableRow(
            f"{titles[workload]}; kvstack {names}",
            " / ".join(fmt(rate(engines[k], workload)) for k in ours),
            "; ".join(f"{labels[p]} {fmt(rate(engines[p], workload))}" for p in ran),
            "; ".join(" / ".join(fmt_x(ratios.get(k, {}).get(f"{workload}_over_{p}"))
                                 for k in ours) + f" vs {PEER_NAMES[p]}" for p in ran),
        ))
    for workload in (w for w in workloads(work) if w.startswith("decode")):
        measured = [k for k in ours if workload in engines[k]]
        context = "the chat prompt" if workload == "decode" else titles[workload].split(", ")[2]
        rows.append(TableRow(
            f"decode memory bandwidth after {context} (weights + KV read per step x steps/s) "
            f"vs {fmt(bandwidth / 1e9)} GB/s measured; kvstack "
            + " / ".join(k.removeprefix("kvstack_") for k in measured),
            " / ".join(_bandwidth_text(engines[k][workload]) for k in measured),
            "; ".join(f"{labels[p]} {_bandwidth_text(engines[p][workload])}" for p in PEERS
                      if workload in engines[p]),
        ))
    return rows


def _llamacpp_label(engines: dict[str, dict[str, Any]]) -> str:
    llama = engines["llamacpp"]
    return "llama.cpp" if "skipped" in llama else f"llama.cpp {llama['weight_type']} GGUF"


def _bandwidth_text(d: dict[str, Any]) -> str:
    percent = fmt(d["bandwidth_fraction"] * 100, 0)
    return f"{fmt(d['bandwidth_bytes_per_s'] / 1e9)} GB/s ({percent}%)"


def plot(options: BenchOptions, engines: dict[str, dict[str, Any]], bandwidth: float,
         work: Workloads) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    labels = {k: (f"kvstack {k.removeprefix('kvstack_')}" if k.startswith("kvstack_")
                  else PEER_NAMES[k]) for k in engines}
    ran = [k for k in engines if "skipped" not in engines[k]]
    colors = {k: f"C{i}" for i, k in enumerate(engines)}
    fig = Figure(figsize=(11, 7), layout="constrained")
    skipped = [labels[k] for k in engines if k not in ran]
    fig.suptitle(f"kvstack vs its peers, {options.threads_text}"
                 + (f" (not run: {', '.join(skipped)})" if skipped else ""))
    axes = fig.subplots(2, 2).flatten()
    s = work.sizes
    panels = (
        ("decode", f"decode tok/s (1 stream, {s.decode_new_tokens} tokens)"),
        ("prefill", f"prefill tok/s ({len(work.document)}-token prompt)"),
        ("batch", f"output tok/s (batch of {s.batch})"),
    )
    for ax, (workload, title) in zip(axes, panels, strict=False):
        keys = [k for k in ran if rate(engines[k], workload) is not None]
        bars = ax.bar([labels[k] for k in keys], [rate(engines[k], workload) for k in keys],
                      color=[colors[k] for k in keys])
        ax.bar_label(bars, [fmt(rate(engines[k], workload), 0) for k in keys],
                     fontsize="small")
        ax.set_title(title)
    ax = axes[3]
    keys = [k for k in ran if "decode" in engines[k]]
    bars = ax.bar([labels[k] for k in keys],
                  [engines[k]["decode"]["bandwidth_bytes_per_s"] / 1e9 for k in keys],
                  color=[colors[k] for k in keys])
    ax.bar_label(bars, [f"{engines[k]['decode']['bandwidth_fraction'] * 100:.0f}%"
                        for k in keys], fontsize="small")
    ax.axhline(bandwidth / 1e9, color="k", linestyle="--", label="measured read bandwidth")
    ax.set_title("decode: GB/s of weights + KV read")
    ax.legend(fontsize="small")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize="small")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    return save_figure(fig, options, "peers.png")
