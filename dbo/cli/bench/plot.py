"""The sweep's PNG: throughput and DBO speedup vs tokens per rank, one colour per backend.

Left: tokens/s with DBO off (thin, circles), DBO on (solid, squares) and the measured
ceiling, all ranks' tokens / T_both (dashed). Right: speedup T_noDBO / T_DBO (solid), SBO's
T_noDBO / T_SBO (dash-dot, triangles), joined's T_noDBO / T_joined (dashed, diamonds), the
gated speedup (dotted) and the ceiling T_serial / T_both (dashed), with 1.0 marked.
The title carries the regime label. matplotlib is imported here only (Agg backend). A
CPU run is not drawn (`BenchConfig.functional`: its times are no performance figures).
"""
from __future__ import annotations

from typing import Any

from dbo.cli.bench.sweep import SweepResult


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the bench plot needs matplotlib: pip install matplotlib "
                          "(or pip install 'dbo-runtime[plot]'), or pass --no-plot") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(result: SweepResult, path: str) -> None:
    """Write the two-panel PNG of `result` to `path`; ValueError for a functional run."""
    cfg = result.config
    if cfg.functional:
        raise ValueError(f"{cfg.regime} run: a functional check, nothing overlaps there; "
                         f"its times are no performance figures and are not plotted")
    plt = _pyplot()
    fig, (ax_tps, ax_speed) = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    has_ceiling = False
    for i, backend in enumerate(cfg.backends):
        pts = sorted((p for p in result.points if p.backend == backend),
                     key=lambda p: p.tokens_per_rank)
        if not pts:
            continue
        c = colours[i % len(colours)]
        xs = [p.tokens_per_rank for p in pts]
        ax_tps.plot(xs, [p.tokens_per_s_nodbo for p in pts], "o-", color=c, lw=1, alpha=0.6,
                    label=f"{backend} DBO off")
        dbo = [p for p in pts if p.speedup is not None]
        if dbo:
            ax_tps.plot([p.tokens_per_rank for p in dbo], [p.tokens_per_s_dbo for p in dbo],
                        "s-", color=c, lw=2, label=f"{backend} DBO on")
            ax_speed.plot([p.tokens_per_rank for p in dbo], [p.speedup for p in dbo], "s-",
                          color=c, lw=2, label=f"{backend} DBO on")
        sbo = [p for p in pts if p.speedup_sbo is not None]
        if sbo:
            ax_speed.plot([p.tokens_per_rank for p in sbo], [p.speedup_sbo for p in sbo],
                          "^-.", color=c, lw=1.5, label=f"{backend} SBO")
        joined = [p for p in pts if p.speedup_joined is not None]
        if joined:
            ax_speed.plot([p.tokens_per_rank for p in joined],
                          [p.speedup_joined for p in joined], "d--", color=c, lw=1.5,
                          label=f"{backend} joined")
        ax_speed.plot(xs, [p.gated_speedup for p in pts], ":", color=c, lw=1.5,
                      label=f"{backend} gated")
        ceil = [(p.tokens_per_rank, p.tokens_per_s_ceiling, p.ceiling) for p in pts
                if p.ceiling is not None]
        if ceil:
            has_ceiling = True
            ax_tps.plot([x for x, _, _ in ceil], [t for _, t, _ in ceil], "--", color=c,
                        lw=1.5, label=f"{backend} ceiling (T_both)")
            ax_speed.plot([x for x, _, _ in ceil], [s for _, _, s in ceil], "--", color=c,
                          lw=1.5, label=f"{backend} ceiling")
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    for ax in (ax_tps, ax_speed):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_tps.set_ylabel(f"tokens/s (all {result.world_size} ranks)")
    ax_speed.set_ylabel("speedup vs DBO off")
    note = "" if has_ceiling else "  (ceiling not measured: " + result.probe.split(":")[0] + ")"
    fig.suptitle(f"dbo bench [{cfg.regime}] {cfg.mode} mode, {cfg.preset}, "
                 f"{result.world_size} ranks{', CUDA graphs' if cfg.cuda_graph else ''}{note}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
