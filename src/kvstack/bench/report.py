"""`kvstack bench report`: the README's benchmark section, rebuilt from the cases' JSON.

Only the text between the two markers changes; the plots are copied beside the README (a
tracked folder) so that the table's links work on any checkout. The table says when, on what
machine, with how many threads and under what load each figure was measured. Several results
folders (`--out` given again, e.g. a `bench peers --isa avx2` run beside the default one) give
one table each, in order, each with its own provenance and the C kernels it ran. `--section
NAME` rewrites a second, named section instead (`<!-- bench:NAME:start -->` ..
`<!-- bench:NAME:end -->`), so results from another machine (the other ISA's CPU) stand beside
the main section without regenerating it from JSON this machine does not have; its plots are
copied under their folders' names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.errors import KvstackError

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
_COLUMNS = ("case", "workload", "kvstack", "peer", "kvstack speedup", "load (1 min)")


class ReportError(KvstackError):
    """No results to report, or a README without the benchmark markers."""


def load_results(out: Path, cases: Sequence[str]) -> list[dict[str, Any]]:
    """`<out>/<case>.json` of each case that has one, in `cases` order."""
    results = []
    for case in cases:
        path = out / f"{case}.json"
        if not path.is_file():
            continue
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise ReportError(f"cannot read {path} ({err}); rerun `kvstack bench {case}`") from err
    if not results:
        raise ReportError(f"no benchmark results in {out}/; run `kvstack bench all --out {out}` "
                          "first")
    return results


def render(results: Sequence[dict[str, Any]], plots_prefix: str, source: str,
           plot_names: dict[str, str] | None = None) -> str:
    """The Markdown of one results folder: provenance, the table, plot links, summary lines.
    `plot_names` maps a plot to the name it was copied under (default: its own)."""
    names = plot_names or {}
    lines = [_provenance(results), "", "| " + " | ".join(_COLUMNS) + " |",
             "|" + "---|" * len(_COLUMNS)]
    for data in results:
        rows = data.get("table") or [{"workload": data["summary"].split(": ", 1)[-1]}]
        case = f"`bench {data['case']}`" + (" (--quick)" if data["config"].get("quick") else "")
        load = data.get("machine", {}).get("load_average")
        for i, row in enumerate(rows):
            cells = [case if i == 0 else "", row.get("workload", ""), row.get("kvstack", ""),
                     row.get("peer", ""), row.get("speedup", ""),
                     f"{load[0]:.1f}" if i == 0 and load else ""]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    plots = [names.get(p, p) for data in results for p in data.get("plots", [])]
    if plots:
        lines += ["", "Plots: " + " · ".join(
            f"[{Path(p).stem}]({plots_prefix}/{p})" for p in plots)]
    lines += ["", f"<details><summary>Summary lines, as printed ({source})</summary>", "",
              "```text"]
    lines += [data["summary"] for data in results]
    lines += ["```", "", "</details>"]
    return "\n".join(lines)


def markers(name: str | None = None) -> tuple[str, str]:
    """The start and end markers of the main section, or of the section called `name`."""
    if name is None:
        return START, END
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ReportError(f"section name {name!r}: use letters, digits, '-' and '_' only")
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def replace_section(text: str, section: str, name: str | None = None) -> str:
    """`text` with everything between the markers of section `name` (default: the main one)
    replaced by `section`."""
    first, last = markers(name)
    start, end = text.find(first), text.find(last)
    if start < 0 or end < start or text.count(first) != 1 or text.count(last) != 1:
        raise ReportError(f"the README needs one {first} line and, after it, one {last} line "
                          "around the benchmark section; add them where the table goes")
    return text[:start + len(first)] + "\n" + section.strip("\n") + "\n" + text[end:]


def write_report(outs: Sequence[Path], readme: Path, plots_dir: Path,
                 cases: Sequence[str], section: str | None = None) -> str:
    """Copy the plots, rewrite the README's section (the main one, or the one called
    `section`: one table per folder in `outs`); return a one-line account of it."""
    if not readme.is_file():
        raise ReportError(f"no README at {readme}; give its path with --readme")
    sets = [(out, load_results(out, cases)) for out in outs]
    prefix = Path(os.path.relpath(plots_dir.resolve(), readme.resolve().parent)).as_posix()
    sources = " ".join(f"--out {out.as_posix()}" for out in outs)
    if section is not None:
        sources = f"--section {section} {sources}"
    parts = [f"_Generated by `kvstack bench report {sources}` from the cases' JSON (`make bench` "
             "runs every case, then this). Edit outside the markers only._"]
    copies: list[tuple[Path, Path]] = []
    for n, (out, results) in enumerate(sets):
        # A later folder's plots (a named section's, all) keep their folder's name in front,
        # so two peers.png coexist.
        names = {p: p if n == 0 and section is None else f"{out.name}-{p}"
                 for data in results for p in data.get("plots", [])}
        copies += [(out / p, plots_dir / name) for p, name in names.items()]
        parts.append(render(results, prefix, out.as_posix(), names))
    text = replace_section(readme.read_text(), "\n\n".join(parts), section)
    plots_dir.mkdir(parents=True, exist_ok=True)
    copied = 0
    for src, dst in copies:
        if src.is_file():
            shutil.copyfile(src, dst)
            copied += 1
    readme.write_text(text)
    listed = "; ".join(", ".join(data["case"] for data in results) for _, results in sets)
    count = sum(len(results) for _, results in sets)
    where = f"benchmark section {section!r}" if section else "benchmark section"
    return (f"{readme}: {where} rewritten from {count} cases ({listed}); "
            f"{copied} plots copied to {plots_dir}")


def _provenance(results: Sequence[dict[str, Any]]) -> str:
    dates = sorted(data.get("created", "")[:10] for data in results)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    machines: list[str] = []
    commits: dict[str, list[str]] = {}
    for data in results:
        m = data.get("machine", {})
        threads = m.get("threads", "?")
        text = (f"{m.get('cpu', 'unknown CPU')} ({m.get('logical_cpus', '?')} logical CPUs), "
                f"{threads} torch thread{'' if threads == 1 else 's'}, torch "
                f"{m.get('torch', '?')}, transformers {m.get('transformers', '?')}, "
                f"kvstack {m.get('kvstack', '?')}")
        if text not in machines:
            machines.append(text)
        commits.setdefault(m.get("kvstack_commit") or "unknown", []).append(data["case"])
    at = "; ".join(f"{commit} ({', '.join(cases)})" for commit, cases in commits.items())
    kernels = sorted({str(k["isa"]) for data in results
                      if isinstance(k := data["config"].get("kernels"), dict) and k.get("isa")})
    ran = f"; C kernels {', '.join(kernels)}" if kernels else ""
    models = sorted({str(data["config"].get("model")) for data in results
                     if data["config"].get("model")})
    model = f"with {', '.join(models)} " if models else ""
    return (f"Measured {when} (UTC) {model}on {'; '.join(machines)}{ran}; git commit of kvstack "
            f"(-dirty: with uncommitted changes): {at}. The load column is the machine's "
            "1-minute load average when each case finished: above the CPU count, other jobs "
            "shared the cores and the timings are noisy (ratios within one case are measured in "
            "the same run, so they hold up better than absolute figures). Speedup > 1x: kvstack "
            "is faster.")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
