"""Plots of the benchmark cases: one matplotlib figure per plot, saved beside the JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.bench.common import BenchOptions

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def log_scale_y(ax: Any) -> None:
    """A log y axis labelled in plain numbers at 1-2-5 steps (no 4x10^0 minor labels)."""
    from matplotlib.ticker import LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_minor_formatter(NullFormatter())


def save_figure(fig: Figure, options: BenchOptions, name: str) -> str:
    options.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(options.out / name, dpi=120)
    return name
