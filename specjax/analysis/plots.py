"""Figures of the analysis' numbers, drawn on matplotlib axes the caller owns (a notebook's
`plt.subplots()`, or `spec_figure`'s own figure for the bench). matplotlib is imported only
here: `pip install -e ".[notebooks]"` (or `.[plot]`) installs it."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from specjax.analysis.acceptance import al_by_depth, alpha, predicted_al

MATPLOTLIB = 'the plots need matplotlib: pip install -e ".[plot]"'


def plot_ar(ax, curves: Mapping[str, Sequence[float]], legend: bool = True) -> None:
    """AR_k against draft position k, one line per method (colours C0, C1, ... in order)."""
    for i, (label, ar) in enumerate(curves.items()):
        ax.plot(np.arange(1, len(ar) + 1), ar, marker="o", label=label, color=f"C{i % 10}")
    ax.set(xlabel="draft position k", ylabel="AR_k = P(accepted >= k)", ylim=(0, 1.02),
           title="acceptance per draft position")
    ax.set_xticks(np.arange(1, max(map(len, curves.values()), default=1) + 1))
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def plot_al_histogram(ax, label: str, shares: Sequence[float]) -> None:
    """Shares of steps by acceptance length 1 .. D + 1 (`al_histogram`)."""
    ax.bar(np.arange(1, len(shares) + 1), shares)
    ax.set(xlabel="tokens per step (AL)", ylabel="share of steps", title=label, ylim=(0, 1))


def plot_al_vs_depth(ax, depths: Sequence[int], measured: Sequence[float],
                     ar: Sequence[float], label: str = "") -> None:
    """Measured AL at each depth D against (1 - a^(D+1)) / (1 - a) with a from the per-position
    rates `ar` (measured at the largest depth), and 1 + AR_1 + ... + AR_D."""
    d = np.asarray(depths)
    a = alpha(ar)
    ax.plot(d, measured, "o-", label=f"{label} measured".strip())
    ax.plot(d, predicted_al(a, d), "--", label=f"(1 - a^(D+1)) / (1 - a), a = {a:.2f}")
    ax.plot(d, al_by_depth(ar, d), ":", label="1 + AR_1 + ... + AR_D")
    ax.set(xlabel="draft length D", ylabel="acceptance length", title="AL vs D")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_speedups(ax, labels: Sequence[str], speedup: Sequence[float],
                  decode_speedup: Sequence[float], colors: Sequence[str] | None = None) -> None:
    """Horizontal bars per method: end-to-end speedup over plain decoding (solid) and decode
    speedup (lighter), in `colors` (one per method) if given."""
    y = np.arange(len(labels))
    ax.barh(y - 0.2, speedup, 0.4, label="end to end", color=colors)
    ax.barh(y + 0.2, decode_speedup, 0.4, label="decode (lighter)", color=colors, alpha=0.45)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="speedup over plain decoding (x)", title="speedup")
    ax.legend(fontsize=7)


def spec_figure(rows: Sequence[Mapping], title: str = ""):
    """The bench's figure: AR_k per method (left) and its speedups (right, labelled, in the
    colour of its AR_k line). Each row: label, ar, speedup, decode_speedup. A
    `matplotlib.figure.Figure` (no pyplot: no display needed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit(MATPLOTLIB) from None
    fig = Figure(figsize=(12, 0.35 * len(rows) + 3), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(2, 3))
    plot_ar(left, {r["label"]: r["ar"] for r in rows}, legend=False)
    plot_speedups(right, [r["label"] for r in rows], [r["speedup"] for r in rows],
                  [r["decode_speedup"] for r in rows], [f"C{i % 10}" for i in range(len(rows))])
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
