"""The expert benchmark's PNG: one column per shape, tokens per rank on the x axis.

Top row: TFLOP/s of each path (solid, one colour per path) and of the GEMM-only
baselines (dashed: the dense chain black, the balanced batched chain `bmm` grey), on a
log scale, so that a ratio between paths (the triton path against
the per-expert loop, `reference`, at small T) reads as a distance. Bottom row: each
path's share of the dense chain's TFLOP/s at the same point, with issue 4's 75% target
(for T >= 4096) marked where such points exist. Points that failed or were skipped are
left out. matplotlib is imported here only; the figure draws on the Agg canvas directly,
so pyplot's backend is left as it was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

TARGET_SHARE = 0.75
TARGET_MIN_TOKENS = 4096
BASELINE_STYLES = {"dense": dict(color="black", ls="--", marker="x"),
                   "bmm": dict(color="grey", ls="--", marker="+")}


def _figure_class() -> tuple[Any, Any, Any, Any]:
    """(Figure, FigureCanvasAgg, rcParams, FuncFormatter), or ImportError with the
    install hint."""
    try:
        from matplotlib import rcParams
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise ImportError("the expert benchmark's plot needs matplotlib: pip install "
                          "matplotlib (or pip install 'dbo-runtime[plot]')") from exc
    return Figure, FigureCanvasAgg, rcParams, FuncFormatter


def plot_experts(points: Sequence[Any], path: Path, *, title: str) -> bool:
    """Write the PNG of `points` (`moe.bench.experts.Point`s) to `path`; False (and no
    file) when no point has a time to draw."""
    timed = [p for p in points if p.tflops]
    if not timed:
        return False
    Figure, FigureCanvasAgg, rc_params, FuncFormatter = _figure_class()
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 600, not 6 x 10^2
    shapes = list(dict.fromkeys(p.shape for p in timed))
    paths = list(dict.fromkeys(p.path for p in timed if p.path not in BASELINE_STYLES))
    fig = Figure(figsize=(4.2 * len(shapes), 7.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(shapes), squeeze=False, sharex="col")
    colours = rc_params["axes.prop_cycle"].by_key()["color"]
    for col, shape in enumerate(shapes):
        ax_rate, ax_share = axes[0][col], axes[1][col]
        for i, name in enumerate([*paths, *BASELINE_STYLES]):
            pts = sorted((p for p in timed if p.shape == shape and p.path == name),
                         key=lambda p: p.tokens)
            if not pts:
                continue
            xs = [p.tokens for p in pts]
            style = BASELINE_STYLES.get(name) or dict(color=colours[i % len(colours)], ls="-",
                                                      marker="o")
            ax_rate.plot(xs, [p.tflops for p in pts], label=name, **style)
            shares = [(p.tokens, p.vs_dense) for p in pts if p.vs_dense is not None]
            if shares:
                ax_share.plot([x for x, _ in shares], [100 * s for _, s in shares], label=name,
                              **style)
        if max(p.tokens for p in timed if p.shape == shape) >= TARGET_MIN_TOKENS:
            ax_share.axhline(100 * TARGET_SHARE, color="grey", ls=":",
                             label=f"target {TARGET_SHARE:.0%} (T >= {TARGET_MIN_TOKENS})")
        ax_rate.set_title(shape)
        ax_rate.set_ylabel("TFLOP/s")
        ax_share.set_ylabel("% of dense TFLOP/s")
        ax_share.set_xlabel("tokens per rank")
        ax_rate.set_yscale("log")
        ax_rate.yaxis.set_major_formatter(plain)
        ax_rate.yaxis.set_minor_formatter(plain)
        ax_share.set_ylim(0, max(100 * TARGET_SHARE + 5, ax_share.get_ylim()[1]))
        for ax in (ax_rate, ax_share):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plain)
            ax.grid(True, alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
