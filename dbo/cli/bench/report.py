"""Outputs of a sweep (rank 0): a table for people, CSV and JSON files, the PNG, and the
summary dict that becomes the final JSON line on stdout.

Files, under `out_dir`, named `bench_<mode>_<preset>_w<world>_<regime tag>.{csv,json,png}`
(regime tag: nvlink, p2p-disabled, cpu; `_graphs` appended under `--cuda-graph`), so runs
of different regimes sit side by side.
Every output carries the regime label. A CPU run is a functional check
(`BenchConfig.functional`: nothing overlaps on gloo): its outputs say so, carry no
speedup (null in the files), and no plot is drawn.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Optional

from dbo.cli.bench.config import CPU_REGIME, EMULATED_REGIME
from dbo.cli.bench.predicted import CALIBRATION_FILE, prediction_lines, write_calibration
from dbo.cli.bench.point import DEFINITIONS, Point
from dbo.cli.bench.sweep import CLOCKED, SweepResult

MAX_GATED_SLOWDOWN = 0.01
"""The acceptance check: with gating on, no point may be more than 1% slower than DBO off."""

FUNCTIONAL_NOTE = ("functional run, not a performance figure: gloo runs each collective on "
                   "the calling thread, so nothing overlaps on CPU; the times show that "
                   "every point ran, and no speedup is computed from them")
SPEEDUP_FIELDS = ("speedup", "gated_speedup", "speedup_sbo", "speedup_joined", "best_overlap",
                  "best_speedup")
"""Row fields that a functional run leaves out (null)."""


def file_stem(result: SweepResult) -> str:
    cfg = result.config
    tag = {CPU_REGIME: "cpu", EMULATED_REGIME: "p2p-disabled"}.get(cfg.regime, "nvlink")
    graphs = "_graphs" if cfg.cuda_graph else ""
    return f"bench_{cfg.mode}_{cfg.preset}_w{result.world_size}_{tag}{graphs}"


def write_outputs(result: SweepResult) -> dict[str, Any]:
    """Write CSV, JSON and PNG; return {"csv": path, "json": path, "png": path | None,
    "png_note": why not (when missing)}."""
    out_dir = result.config.out_dir
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, file_stem(result))
    files: dict[str, Any] = {"csv": stem + ".csv", "json": stem + ".json", "png": None}
    rows = [_row(result, p) for p in result.points]
    with open(files["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if result.config.functional:
        files["png_note"] = "not drawn: " + FUNCTIONAL_NOTE
    elif result.config.plot:
        try:
            from dbo.cli.bench.plot import plot_sweep
            plot_sweep(result, stem + ".png")
            files["png"] = stem + ".png"
        except ImportError as exc:
            files["png_note"] = str(exc)
    else:
        files["png_note"] = "plot off (--no-plot)"
    files["calibration"] = write_calibration(result, os.path.join(out_dir, CALIBRATION_FILE))
    doc = {**header(result), "definitions": DEFINITIONS, "summary": summarize(result),
           "points": [{**_row(result, p), "per_rank_ms": p.per_rank_ms, "rounds_ms": p.rounds_ms,
                       "eta_rounds": p.eta_rounds, "trial_speedups": p.trial_speedups,
                       "sbo_trial_speedups": p.sbo_trial_speedups,
                       "joined_trial_speedups": p.joined_trial_speedups,
                       "sm_mhz": p.sm_mhz, "capped": p.capped, "phase_ms": p.phase_ms}
                      for p in result.points],
           "files": files}
    with open(files["json"], "w") as f:
        json.dump(_clean(doc), f, indent=2)
        f.write("\n")
    return files


def header(result: SweepResult) -> dict[str, Any]:
    cfg = result.config
    return {"bench": "dbo", "regime": cfg.regime, "mode": cfg.mode, "preset": cfg.preset,
            "world_size": result.world_size, "device": cfg.device,
            "cuda_graph": cfg.cuda_graph,
            "timings": "functional" if cfg.functional else "performance",
            **({"note": FUNCTIONAL_NOTE} if cfg.functional else {}),
            "shapes": result.shapes, "probe": result.probe, "config": cfg.summary()}


def _row(result: SweepResult, p: Point) -> dict[str, Any]:
    """The point's flat fields; a functional run's speedups are null."""
    row = p.row()
    if result.config.functional:
        row.update({name: None for name in SPEEDUP_FIELDS})
    return row


def summarize(result: SweepResult) -> dict[str, Any]:
    """Best raw speedup, worst gated speedup, and the <= 1% gated-slowdown check; for a
    functional run only what ran (no speedup)."""
    points = result.points
    if result.config.functional:
        return {"functional": True, "points": len(points),
                "points_split": sum(p.dbo_split for p in points),
                "points_gated_on": sum(p.gate == "dbo" for p in points),
                "points_gated_sbo": sum(p.gate == "sbo" for p in points),
                "points_gated_joined": sum(p.gate == "joined" for p in points)}
    worst = min(points, key=lambda p: p.gated_speedup)
    timed = [p for p in points if p.speedup is not None]
    best = max(timed, key=lambda p: p.speedup) if timed else None  # type: ignore[arg-type,return-value]
    return {
        "max_speedup": best.speedup if best else None,
        "max_speedup_at": ({"backend": best.backend, "tokens_per_rank": best.tokens_per_rank}
                           if best else None),
        "min_speedup": min((p.speedup for p in timed), default=None),  # type: ignore[type-var]
        "best": [{"backend": p.backend, "tokens_per_rank": p.tokens_per_rank,
                  "best_overlap": p.best_overlap, "best_speedup": p.best_speedup}
                 for p in points],
        "min_gated_speedup": worst.gated_speedup,
        "min_gated_speedup_at": {"backend": worst.backend,
                                 "tokens_per_rank": worst.tokens_per_rank},
        "gated_never_slower_than_1pct": all(p.gated_speedup >= 1.0 / (1.0 + MAX_GATED_SLOWDOWN)
                                            for p in points),
        "points_gated_on": sum(p.gate == "dbo" for p in points),
        "points_gated_sbo": sum(p.gate == "sbo" for p in points),
        "points_gated_joined": sum(p.gate == "joined" for p in points),
        "points": len(points),
    }


def final_line(result: SweepResult, files: dict[str, Any]) -> str:
    """The one JSON line for programs (stdout, last line)."""
    keys = ("backend", "tokens_per_rank", "t_nodbo_ms", "t_dbo_ms", "speedup",
            "t_sbo_ms", "speedup_sbo", "sbo_note", "t_joined_ms", "speedup_joined",
            "joined_note", "joined_split", "best_overlap", "best_speedup",
            "host_nodbo_ms", "host_dbo_ms", "host_sbo_ms", "host_joined_ms",
            "tokens_per_s_nodbo", "tokens_per_s_dbo", "t_compute_ms", "t_comm_ms",
            "t_both_ms", "t_split_ms", "ceiling", "eta", "eta_min", "eta_max", "rounds",
            "eta_note", "dbo_split", "gate", "gate_reason", "gated_speedup",
            "t_nodbo_pred_ms", "t_dbo_pred_ms", "t_sbo_pred_ms", "t_joined_pred_ms",
            "speedup_pred", "pred_err_nodbo", "pred_err_dbo", "pred_err_sbo",
            "pred_err_joined", "pred_choice", "probe_note")
    doc = {**header(result), "summary": summarize(result),
           "points": [{**{k: _row(result, p)[k] for k in keys}, "trial_speedups": p.trial_speedups,
                       "sbo_trial_speedups": p.sbo_trial_speedups,
                       "joined_trial_speedups": p.joined_trial_speedups, "sm_mhz": p.sm_mhz}
                      for p in result.points], "files": files}
    doc.pop("config")
    return json.dumps(_clean(doc), separators=(",", ":"))


def format_table(result: SweepResult) -> str:
    """The table for people: times as rank0/max, medians of `iters` steps."""
    cfg = result.config
    shapes = result.shapes
    lines = [
        f"dbo bench: mode={cfg.mode} preset={cfg.preset} world={result.world_size} "
        f"regime={cfg.regime}" + (" cuda_graph=on" if cfg.cuda_graph else ""),
        f"  shapes: H={shapes['hidden_size']} experts={shapes['num_experts']} "
        f"({shapes['experts_per_rank']}/rank) top_k={shapes['top_k']} "
        f"I={shapes['intermediate_size']} layers={shapes['layers']} {shapes['dtype']}"
        + (f"; decode: R requests/rank x {shapes['context']} cached tokens, heads "
           f"{shapes['num_heads']}/{shapes['num_kv_heads']} kv x {shapes['head_dim']}, "
           f"KV cache {shapes['kv_cache_gb']} GB/rank" if cfg.mode == "decode" else ""),
        "  host noDBO / host DBO: the host's time to issue one step (not waiting for the "
        "device), slowest rank",
        f"  SBO: single-batch overlap (one ubatch; shared experts under the dispatch, "
        f"{cfg.sbo_form()}), SBO x = noDBO / SBO",
        "  joined: DBO with joined experts (each MoE layer's experts once over both "
        "ubatches' rows), joined x = noDBO / joined; gate: off, sbo, dbo or joined, chosen "
        "from separate trials; best: the fastest of the reported times",
        f"  times in ms, median of {cfg.iters} steps after {cfg.warmup} warmup"
        + (f", median of {cfg.rounds} alternating rounds" if cfg.rounds > 1 else "")
        + "; shown rank0/max over ranks; derived figures use the max",
        f"  ceiling probe: {result.probe}",
        *probe_note_lines(result),
        *([f"  {FUNCTIONAL_NOTE}"] if cfg.functional else []),
        "",
    ]
    cols = [("T/rank", 7), ("backend", 7), ("noDBO ms", 15), ("DBO ms", 15), ("speedup", 7),
            ("host noDBO", 10), ("host DBO", 8),
            ("tok/s noDBO", 11), ("tok/s DBO", 11), ("comp ms", 8), ("comm ms", 8),
            ("both ms", 8), ("split ms", 8), ("ceiling", 7), ("eta", 6), ("eta rounds", 10),
            ("SBO ms", 15), ("SBO x", 6), ("joined ms", 15), ("joined x", 8), ("gate", 6),
            ("gated", 6), ("best", 12)]
    if cfg.functional:
        cols = [(name, w) for name, w in cols
                if name not in ("speedup", "gated", "SBO x", "joined x", "best")]
    header = "  ".join(f"{name:>{w}}" for name, w in cols)
    if cfg.mode == "decode":  # one new token per request: T/rank counts the requests
        header = header.replace(" T/rank", " R/rank", 1)
    lines.append(header)
    for p in result.points:
        cells = {"T/rank": str(p.tokens_per_rank), "backend": p.backend,
                 "noDBO ms": f"{p.t_nodbo_ms_rank0:.3f}/{p.t_nodbo_ms:.3f}",
                 "SBO ms": _pair(p.t_sbo_ms_rank0, p.t_sbo_ms), "SBO x": _opt(p.speedup_sbo),
                 "joined ms": _pair(p.t_joined_ms_rank0, p.t_joined_ms),
                 "joined x": _opt(p.speedup_joined),
                 "DBO ms": _pair(p.t_dbo_ms_rank0, p.t_dbo_ms),
                 "speedup": _opt(p.speedup), "host noDBO": _opt(p.host_nodbo_ms),
                 "host DBO": _opt(p.host_dbo_ms), "tok/s noDBO": _num(p.tokens_per_s_nodbo),
                 "tok/s DBO": "-" if p.tokens_per_s_dbo is None else _num(p.tokens_per_s_dbo),
                 "comp ms": _opt(p.t_compute_ms),
                 "comm ms": _opt(p.t_comm_ms), "both ms": _opt(p.t_both_ms),
                 "split ms": _opt(p.t_split_ms), "ceiling": _opt(p.ceiling),
                 "eta": _opt(p.eta, "{:.2f}"), "eta rounds": eta_rounds_cell(p),
                 "gate": p.gate, "gated": f"{p.gated_speedup:.3f}",
                 "best": f"{p.best_overlap} {p.best_speedup:.3f}"}
        lines.append("  ".join(f"{cells[name]:>{w}}" for name, w in cols))
    lines.append("")
    lines.append("gate decisions:")
    for p in result.points:
        split = ("" if p.dbo_split or p.t_dbo_ms is None
                 else f" [DBO-on step NOT split: {p.dbo_split_reason}]")
        sbo = f" [SBO {p.sbo_note}]" if p.sbo_note else ""
        if p.joined_note:
            sbo += f" [joined {p.joined_note}]"
        elif p.t_joined_ms is not None and not p.joined_split:
            sbo += f" [joined step NOT split: {p.joined_split_reason}]"
        note = ""
        if p.eta is None and p.t_both_ms is not None:
            note = f" (eta n/a: {p.eta_note})"
        elif p.eta is not None and p.eta_note:
            note = f" ({p.eta_note})"
        lines.append(f"  {p.backend:>7} T={p.tokens_per_rank:<6} {p.gate:>6}: "
                     f"{p.gate_reason}{note}{split}{sbo}")
    lines.extend(prediction_lines(result))
    clocked = [p for p in result.points if p.sm_mhz]
    if clocked:
        lines.append("SM clock, rank 0 (median MHz, samples held back by the power limit):")
        for p in clocked:
            cells = [f"{label} {p.sm_mhz[name]:.0f} ({p.capped.get(name, '-')})"
                     for name, label in CLOCKED.items() if name in p.sm_mhz]
            lines.append(f"  {p.backend:>7} T={p.tokens_per_rank:<6} " + ", ".join(cells))
    s = summarize(result)
    if cfg.functional:
        lines.append(f"summary: functional run, {s['points']} points ran (DBO split the step "
                     f"at {s['points_split']}); nothing overlaps on CPU: measure DBO on "
                     f"GPUs  [{cfg.regime}]")
    else:
        dbo = "-" if s["max_speedup"] is None else f"{s['max_speedup']:.3f}x"
        best = max(result.points, key=lambda p: p.best_speedup)
        lines.append(f"summary: best DBO speedup {dbo}; best overlap {best.best_overlap} "
                     f"{best.best_speedup:.3f}x ({best.backend}, {best.tokens_per_rank}/rank); "
                     f"worst gated speedup {s['min_gated_speedup']:.3f}x; gated never >1% "
                     f"slower: {s['gated_never_slower_than_1pct']}  [{cfg.regime}]")
    return "\n".join(lines)


def probe_note_lines(result: SweepResult) -> list[str]:
    """One line per distinct reason some points were not probed (`Point.probe_note`)."""
    notes = dict.fromkeys(p.probe_note for p in result.points if p.probe_note)
    return [f"  {note}" for note in notes]


def eta_rounds_cell(p: Point) -> str:
    """eta's lowest..highest over the rounds; "-" with one round, without a probe, or
    where the point's own eta is undefined (no headroom: the rounds' values mean little)."""
    if p.rounds < 2 or p.eta is None or p.eta_min is None or p.eta_max is None:
        return "-"
    return f"{p.eta_min:.2f}..{p.eta_max:.2f}"


def _pair(rank0: Optional[float], most: Optional[float]) -> str:
    """rank0/max of a timing, "-" where it was not timed."""
    return "-" if rank0 is None or most is None else f"{rank0:.3f}/{most:.3f}"


def _num(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def _opt(v: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null, floats rounded to 6 decimals."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
