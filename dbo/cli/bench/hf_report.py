"""Outputs of `dbo bench --hf` (rank 0): the table, CSV and JSON files, the final JSON line.

Files, under `out_dir`: `bench_hf_<arch>_w<world>_<regime tag>.{csv,json}` (regime tag as
`dbo.cli.bench.report`). A CPU run is a functional check: its ratios (the gated speedup
and `gated_never_slower_than_1pct` too) are null and the table says so. Each point
carries its gate (`dbo.cli.bench.hf_gate`: off, sbo, dbo or joined, the reason, the gated time
and speedup, the trials); the table shows the gate column and the gated speedup (GPU).
Below the table, one line per point whose DBO step is host-bound (`host_bound_lines`,
also used by the decode table), one per reason some points have no SBO step
(`sbo_lines`, also the decode table's), one per reason the ceiling probe did not
measure some points (`probe_lines`; on CPU every point's), then the gate's decision per
point and why, and the summary (`gate_lines`).
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Callable, Optional

from dbo.cli.bench.config import CPU_REGIME, EMULATED_REGIME, GRAPH_BACKENDS
from dbo.cli.bench.hf_config import capacity_note
from dbo.cli.bench.hf_sweep import HFSweepResult
from dbo.cli.bench.point import DEFINITIONS as BENCH_DEFINITIONS
from dbo.cli.bench.report import FUNCTIONAL_NOTE, MAX_GATED_SLOWDOWN, _num, _opt
from dbo.cli.bench.sweep import PROBE_MEASURED
from dbo.cli.bench.timing import HOST_BOUND_SHARE

HOST_DEFINITIONS = {
    "host_hf_ms/host_nodbo_ms/host_dbo_ms": (
        "the host's time to issue one step (call to return, not waiting for the device), "
        "unconverted / DBO off / DBO on, median, slowest rank; on CPU the step time"),
    "dbo_host_bound": (f"host_dbo_ms >= {HOST_BOUND_SHARE:g} * t_dbo_ms: the device waits "
                       f"for the host's launches; null in a functional run"),
}
DEFINITIONS = {
    "t_hf": ("the unconverted transformers model, every expert on every rank, running "
             "this rank's batch (no expert parallelism)"),
    "t_nodbo / t_dbo": ("the converted model (expert parallelism), DBO off / on; with "
                        "cuda_graph replayed from CUDA graphs"),
    "t_sbo": ("the converted model as DBO off, through DBORunner(model, DBOConfig("
              "overlap=\"sbo\")): one ubatch, shared experts under the dispatch, the "
              "combine overlapped as the table's SBO line says (a2a_ll: --combine-chunks / "
              "--combine-groups); null where it did not run (sbo_note says why)"),
    "speedup_sbo": "T_noDBO / T_SBO (null in a functional run or without an SBO step)",
    "sbo_note": "why the point has no SBO step (the model offers none, or the runner "
                "did not run one), or empty",
    "t_joined": ("DBO with joined experts: the DBO-on step through DBORunner(model, "
                 "DBOConfig(..., joined_experts=True)), each MoE layer's experts run once "
                 "over both ubatches' rows (each expert's weights read once per step); "
                 "joined_split: whether it was split (joined_split_reason: why)"),
    "speedup_joined": "T_noDBO / T_joined (null in a functional run)",
    "t_hf_eager / t_hf_graph": ("with cuda_graph: the unconverted model eagerly / as a "
                                "replayed graph (null where it did not capture: "
                                "hf_graph_note); t_hf is the faster"),
    "max_tokens_per_ubatch": "a2a_ll's capacity of one DBO ubatch, null otherwise",
    "step_time": ("per rank, the median over rounds of the median over iters of its "
                  "steps; the max over ranks unless *_rank0"),
    "tokens_per_s": "tokens per rank * world size / step time",
    "speedup": "T_noDBO / T_DBO",
    "gate": ("off, sbo, dbo or joined, as the layer bench's gate chooses: DBO and joined "
             "on the token threshold (--gate-min-tokens), the probe's ceiling >= 1 + "
             "--min-gain (where the probe ran) and the worst of the rounds' separate "
             "trials of each (>= 1.01x); SBO on the worst of its trials alone; of those "
             "that pass, the fastest worst trial (ties: sbo, joined, dbo); gate_reason "
             "says which rule decided"),
    "trial_speedups / sbo_trial_speedups / joined_trial_speedups": (
        "the gate's trials, one per round: that round's T_noDBO over a separate short "
        "timing (--gate-trial-iters steps) of DBO on / SBO / joined, never the reported "
        "steps"),
    "gated": ("T_gated, the reported time of the gate's mode (T_DBO, T_SBO, T_joined or "
              "T_noDBO); gated_speedup = T_noDBO / T_gated"),
    "dbo_vs_hf": "T_hf / T_DBO", "nodbo_vs_hf": "T_hf / T_noDBO",
    "max_tokens_per_rank": ("the converted layers' capacity (moe.hf.convert), for the "
                            "backends that need one; null otherwise"),
    "logits_diff": ("DBO off / on / SBO / joined: max |logits - unconverted logits| / max "
                    "|unconverted logits| on the same batch, the largest over ranks"),
    "t_compute / t_comm / t_both": (
        "the ceiling probe, once per point after its rounds (GPU, backends made of "
        "torch.distributed collectives): the DBO-off step with every collective replaced "
        "by its recorded result (compute alone), its recorded collectives replayed (comm "
        "alone), both on two CUDA streams; with cuda_graph each captured and replayed; "
        "null where not measured (probe_note says why)"),
    "t_split": BENCH_DEFINITIONS["t_split"],
    "ceiling": "(T_compute + T_comm) / T_both",
    "eta": BENCH_DEFINITIONS["eta"] + "; eta_note says why it is null or above 1",
    "probe_note": ("why the probe did not measure this point (its fields are null), or "
                   "empty"),
    **HOST_DEFINITIONS,
}
PROBE_COLUMNS = [("comp ms", 8), ("comm ms", 8), ("both ms", 8), ("split ms", 8),
                 ("ceiling", 7), ("eta", 6)]
HOST_COLUMNS = [("host unconv", 11), ("host noDBO", 10), ("host DBO", 8)]
HOST_LEGEND = ("  host unconv / host noDBO / host DBO: the host's time to issue one step (not "
               "waiting for the device), slowest rank; on CPU the step time itself")


GRAPH_LEGEND = ("  CUDA graphs: the converted model's steps are replayed (DBO off: one "
                "captured forward; DBO on: GraphedRunner, the vote then a replay); the "
                "unconverted model eagerly and graphed where it captures, unconv ms the "
                "faster; attention without a mask (hf_graphs.use_mask_free_sdpa)")


def eager_graph_cell(point: Any) -> str:
    """The unconverted model's eager/graphed times ("" outside a --cuda-graph run)."""
    if point.t_hf_eager_ms is None:
        return ""
    graph = "-" if point.t_hf_graph_ms is None else f"{point.t_hf_graph_ms:.3f}"
    return f"{point.t_hf_eager_ms:.3f}/{graph}"


def step_cells(point: Any) -> dict[str, str]:
    """The step-time cells of a point (prefill or decode): unconverted, DBO off and DBO
    on as rank 0/max, then the `HOST_COLUMNS`."""
    return {"unconv ms": f"{point.t_hf_ms_rank0:.3f}/{point.t_hf_ms:.3f}",
            "noDBO ms": f"{point.t_nodbo_ms_rank0:.3f}/{point.t_nodbo_ms:.3f}",
            "DBO ms": f"{point.t_dbo_ms_rank0:.3f}/{point.t_dbo_ms:.3f}",
            "host unconv": _opt(point.host_hf_ms), "host noDBO": _opt(point.host_nodbo_ms),
            "host DBO": _opt(point.host_dbo_ms)}


def host_bound_lines(points: list[Any], label: Callable[[Any], str]) -> list[str]:
    """One line per point whose DBO step is host-bound (`point.dbo_host_bound`), saying
    so and why; `label(point)` names the point ("a2a T=4096"). A backend that reads on the
    host within the step (not in `GRAPH_BACKENDS`: a2a its counts) makes the host wait
    for the device there, so its host time only bounds the issue time from above: the
    line says so."""
    lines = []
    for p in points:
        if not p.dbo_host_bound:
            continue
        waits = ("" if p.backend in GRAPH_BACKENDS else
                 f"; {p.backend} reads on the host, so this includes waits for the device")
        lines.append(f"  {label(p)}: the DBO step is host-bound (issued in {p.host_dbo_ms:.3g} "
                     f"of {p.t_dbo_ms:.3g} ms; DBO off: {p.host_nodbo_ms:.3g} of "
                     f"{p.t_nodbo_ms:.3g} ms{waits}): each ubatch runs the model's Python, "
                     f"so DBO pays the host's launch cost twice per step; larger batches per "
                     f"rank or CUDA graphs would help")
    return lines


def probe_cells(point: Any) -> dict[str, str]:
    """The `PROBE_COLUMNS` cells of a prefill point, "-" where not measured."""
    return {"comp ms": _opt(point.t_compute_ms), "comm ms": _opt(point.t_comm_ms),
            "both ms": _opt(point.t_both_ms), "split ms": _opt(point.t_split_ms),
            "ceiling": _opt(point.ceiling), "eta": _opt(point.eta, "{:.2f}")}


def max_logits_diff(point: Any) -> float:
    """The largest of a point's logit differences: DBO off, DBO on, SBO and joined (where
    run)."""
    diffs = [point.logits_diff_nodbo, point.logits_diff_dbo, point.logits_diff_sbo,
             point.logits_diff_joined]
    return max(d for d in diffs if d is not None)


def sbo_cell(point: Any) -> str:
    """The SBO step's time as rank 0/max, "-" where it did not run."""
    if point.t_sbo_ms is None:
        return "-"
    return f"{point.t_sbo_ms_rank0:.3f}/{point.t_sbo_ms:.3f}"


def joined_cell(point: Any) -> str:
    """The joined step's time as rank 0/max, "-" where it was not timed."""
    if point.t_joined_ms is None:
        return "-"
    return f"{point.t_joined_ms_rank0:.3f}/{point.t_joined_ms:.3f}"


JOINED_LEGEND = ("  joined: DBO with joined experts, the DBO-on step with each MoE layer's "
                 "experts run once over both ubatches' rows (DBOConfig(joined_experts=True))")


def joined_split_lines(points: list[Any], label: Callable[[Any], str]) -> list[str]:
    """One line per point whose joined step was timed but not split, saying why."""
    return [f"  {label(p)}: joined step NOT split: {p.joined_split_reason}"
            for p in points if p.t_joined_ms is not None and not p.joined_split]


def sbo_legend(cfg: Any) -> str:
    """The table's line on what the SBO step is (prefill or decode)."""
    return (f"  SBO: the DBO-off model through DBOConfig(overlap=\"sbo\"), one ubatch: shared "
            f"experts under the dispatch, {cfg.sbo_form()}")


def sbo_lines(points: list[Any], label: Callable[[Any], str]) -> list[str]:
    """One line per reason some points have no SBO step, naming them (`label(point)`:
    "a2a T=4096")."""
    missing: dict[str, list[str]] = {}
    for p in points:
        if p.sbo_note:
            missing.setdefault(p.sbo_note, []).append(label(p))
    return [f"  {', '.join(labels)}: SBO {note}" for note, labels in missing.items()]


def gate_lines(result: HFSweepResult) -> list[str]:
    """The gate's decision per point and why, then the summary line: the worst gated
    speedup and the <= 1% check (GPU), or that a functional run gates on noise."""
    lines = ["gate decisions:"]
    lines += [f"  {p.backend:>7} T={p.tokens_per_rank:<6} {p.gate:>6}: {p.gate_reason}"
              for p in result.points]
    s = summarize(result)
    if result.config.functional:
        lines.append(f"summary: functional run, {s['points']} points ran, gated on DBO at "
                     f"{s['points_gated_on']}, SBO at {s['points_gated_sbo']}, joined at "
                     f"{s['points_gated_joined']} (CPU trials: nothing overlaps, measure the "
                     f"gate on GPUs)  [{result.config.regime}]")
    else:
        lines.append(f"summary: speedup {s['min_speedup']:.3f}-{s['max_speedup']:.3f}x; "
                     f"worst gated speedup {s['min_gated_speedup']:.3f}x; gated never >1% "
                     f"slower: {s['gated_never_slower_than_1pct']}  [{result.config.regime}]")
    return lines


def probe_lines(points: list[Any]) -> list[str]:
    """One line per reason the probe did not measure some points, naming them; one per
    probed point whose eta is null or above 1, saying why (`eta_note`)."""
    skipped: dict[str, list[str]] = {}
    for p in points:
        if p.probe_note:
            skipped.setdefault(p.probe_note, []).append(f"{p.backend} T={p.tokens_per_rank}")
    lines = [f"  {', '.join(labels)}: {note}" for note, labels in skipped.items()]
    lines += [f"  {p.backend} T={p.tokens_per_rank}: " + ("eta n/a: " if p.eta is None else "")
              + p.eta_note for p in points if p.t_both_ms is not None and p.eta_note]
    return lines


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null, floats keep 6 significant digits (the
    logit differences are ~1e-7 in float32: decimal rounding would print 0)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _capacity_note(result: Any) -> Optional[str]:
    """`hf_config.capacity_note` for the run's backends (prefill or decode result)."""
    return capacity_note(result.config.backends, world_size=result.world_size)


def file_stem(result: Any, kind: str = "hf") -> str:
    """`bench_<kind>_<arch>_w<world>_<regime tag>` (`kind`: "hf" or "hf_decode")."""
    cfg = result.config
    tag = {CPU_REGIME: "cpu", EMULATED_REGIME: "p2p-disabled"}.get(cfg.regime, "nvlink")
    graphs = "_graphs" if getattr(cfg, "cuda_graph", False) else ""
    return f"bench_{kind}_{cfg.arch}_w{result.world_size}_{tag}{graphs}"


def header(result: Any, mode: str = "hf") -> dict[str, Any]:
    """The fields every output of an HF bench run starts with (prefill or decode)."""
    cfg = result.config
    return {"bench": "dbo", "mode": mode, "regime": cfg.regime, "arch": cfg.arch,
            "world_size": result.world_size, "device": cfg.device,
            "timings": "functional" if cfg.functional else "performance",
            **({"note": FUNCTIONAL_NOTE} if cfg.functional else {}),
            **({"capacity_note": note} if (note := _capacity_note(result)) else {}),
            "shapes": result.shapes}


def write_files(result: Any, *, mode: str, definitions: dict[str, Any],
                summary: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the run's CSV (one row per point, `Point.row()`) and JSON (`header`, config,
    `definitions`, `summary`, `points`) under `out_dir`; return {"csv": path, "json":
    path}. `mode`: "hf" or "hf_decode"."""
    os.makedirs(result.config.out_dir, exist_ok=True)
    stem = os.path.join(result.config.out_dir, file_stem(result, mode))
    files = {"csv": stem + ".csv", "json": stem + ".json"}
    rows = [p.row() for p in result.points]
    with open(files["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    doc = {**header(result, mode), "config": result.config.summary(),
           "definitions": definitions, "summary": summary, "points": points, "files": files}
    with open(files["json"], "w") as f:
        json.dump(_clean(doc), f, indent=2)
        f.write("\n")
    return files


def json_line(result: Any, *, mode: str, summary: dict[str, Any],
              points: list[dict[str, Any]], files: dict[str, Any]) -> str:
    """The one JSON line for programs (stdout, last line) of an HF bench run."""
    doc = {**header(result, mode), "summary": summary, "points": points, "files": files}
    return json.dumps(_clean(doc), separators=(",", ":"))


def summarize(result: HFSweepResult) -> dict[str, Any]:
    """What ran and how the gate chose; the ratios, the worst gated speedup and the
    <= 1% gated-slowdown check (issue 46) only in a performance run."""
    points = result.points
    sbo = [p.speedup_sbo for p in points if p.speedup_sbo is not None]
    gated = {"points_gated_on": sum(p.gate == "dbo" for p in points),
             "points_gated_sbo": sum(p.gate == "sbo" for p in points),
             "points_gated_joined": sum(p.gate == "joined" for p in points)}
    joined = [p.speedup_joined for p in points if p.speedup_joined is not None]
    if result.config.functional:
        return {"functional": True, "points": len(points),
                "points_split": sum(p.dbo_split for p in points),
                "points_sbo": sum(p.t_sbo_ms is not None for p in points), **gated,
                "gated_never_slower_than_1pct": None}
    worst = min(points, key=lambda p: p.gated_speedup)  # type: ignore[arg-type,return-value]
    return {"points": len(points),
            **({"min_speedup_sbo": min(sbo), "max_speedup_sbo": max(sbo)} if sbo else {}),
            **({"min_speedup_joined": min(joined), "max_speedup_joined": max(joined)}
               if joined else {}),
            "min_speedup": min(p.speedup for p in points),  # type: ignore[type-var]
            "max_speedup": max(p.speedup for p in points),  # type: ignore[type-var]
            **gated, "min_gated_speedup": worst.gated_speedup,
            "min_gated_speedup_at": {"backend": worst.backend,
                                     "tokens_per_rank": worst.tokens_per_rank},
            "gated_never_slower_than_1pct": all(
                p.gated_speedup >= 1.0 / (1.0 + MAX_GATED_SLOWDOWN)  # type: ignore[operator]
                for p in points),
            "min_dbo_vs_hf": min(p.dbo_vs_hf for p in points),  # type: ignore[type-var]
            "min_nodbo_vs_hf": min(p.nodbo_vs_hf for p in points)}  # type: ignore[type-var]


def write_outputs(result: HFSweepResult) -> dict[str, Any]:
    """Write the CSV and JSON; return {"csv": path, "json": path}."""
    return write_files(result, mode="hf", definitions=DEFINITIONS, summary=summarize(result),
                       points=[{**p.row(), **_trials(p), "per_rank_ms": p.per_rank_ms,
                                "rounds_ms": p.rounds_ms} for p in result.points])


def final_line(result: HFSweepResult, files: dict[str, Any]) -> str:
    """The one JSON line for programs (stdout, last line)."""
    return json_line(result, mode="hf", summary=summarize(result),
                     points=[{**p.row(), **_trials(p)} for p in result.points], files=files)


def _trials(point: Any) -> dict[str, list[float]]:
    """The gate's trials of a prefill point (lists: not in its CSV row)."""
    return {"trial_speedups": point.trial_speedups,
            "sbo_trial_speedups": point.sbo_trial_speedups,
            "joined_trial_speedups": point.joined_trial_speedups}


def format_table(result: HFSweepResult) -> str:
    cfg, s = result.config, result.shapes
    lines = [
        f"dbo bench --hf {cfg.arch}: world={result.world_size} regime={cfg.regime}",
        f"  shapes: {s['model_type']} H={s['hidden_size']} experts={s['num_experts']} "
        f"({s['experts_per_rank']}/rank converted, all on every rank unconverted) "
        f"top_k={s['top_k']} I={s['intermediate_size']} layers={s['layers']} {s['dtype']}; "
        f"unconverted experts: {s['hf_experts_implementation']}",
        f"  prefill, {cfg.requests} sequences per rank; times in ms, median of {cfg.iters} "
        f"steps after {cfg.warmup} warmup" +
        (f", median of {cfg.rounds} rounds" if cfg.rounds > 1 else "") +
        "; shown rank0/max over ranks; ratios use the max",
        HOST_LEGEND,
        *([GRAPH_LEGEND] if cfg.cuda_graph else []),
        *([f"  ceiling probe: {PROBE_MEASURED}"]
          if any(p.t_both_ms is not None for p in result.points) else []),
        *([f"  {FUNCTIONAL_NOTE}"] if cfg.functional else []),
        *([f"  capacity: {note}"] if (note := _capacity_note(result)) else []),
        sbo_legend(cfg),
        JOINED_LEGEND,
        "",
    ]
    cols = [("T/rank", 7), ("backend", 7), ("unconv ms", 15), ("noDBO ms", 15),
            ("DBO ms", 15), ("SBO ms", 15), ("joined ms", 15), *HOST_COLUMNS,
            ("speedup", 7), ("SBO speedup", 11), ("joined speedup", 14), ("gate", 6),
            ("gated", 6), ("DBO/unconv", 10), ("noDBO/unconv", 12), ("tok/s DBO", 9),
            *PROBE_COLUMNS, ("diff", 8)]
    if cfg.functional:
        cols = [c for c in cols if c[0] not in ("speedup", "SBO speedup", "joined speedup",
                                                 "gated", "DBO/unconv", "noDBO/unconv")]
    if cfg.cuda_graph:
        cols.insert(3, ("unconv eager/graph", 18))
    lines.append("  ".join(f"{name:>{w}}" for name, w in cols))
    for p in result.points:
        cells = {"T/rank": str(p.tokens_per_rank), "backend": p.backend, **step_cells(p),
                 "SBO ms": sbo_cell(p), "speedup": f"{p.speedup or 0:.3f}",
                 "SBO speedup": _opt(p.speedup_sbo), "gate": p.gate,
                 "joined ms": joined_cell(p), "joined speedup": _opt(p.speedup_joined),
                 "gated": _opt(p.gated_speedup), "DBO/unconv": f"{p.dbo_vs_hf or 0:.3f}",
                 "noDBO/unconv": f"{p.nodbo_vs_hf or 0:.3f}",
                 "tok/s DBO": _num(p.tokens_per_s_dbo),
                 "diff": f"{max_logits_diff(p):.1e}",
                 "unconv eager/graph": eager_graph_cell(p), **probe_cells(p)}
        lines.append("  ".join(f"{cells[name]:>{w}}" for name, w in cols))
    not_split = [p for p in result.points if not p.dbo_split]
    for p in not_split:
        lines.append(f"  {p.backend} T={p.tokens_per_rank}: DBO-on step NOT split: "
                     f"{p.dbo_split_reason}")
    lines += joined_split_lines(result.points, lambda p: f"{p.backend} T={p.tokens_per_rank}")
    lines += host_bound_lines(result.points, lambda p: f"{p.backend} T={p.tokens_per_rank}")
    lines += sbo_lines(result.points, lambda p: f"{p.backend} T={p.tokens_per_rank}")
    lines += probe_lines(result.points)
    notes = {p.tokens_per_rank: p.hf_graph_note for p in result.points if p.hf_graph_note}
    lines += [f"  unconverted T={t}: no graph: {note}" for t, note in notes.items()]
    lines += gate_lines(result)
    lines.append("  speedup = noDBO/DBO; SBO speedup = noDBO/SBO; joined speedup = "
                 "noDBO/joined; gated = noDBO/(the gate's choice: off, SBO, DBO or joined); "
                 "DBO/unconv = "
                 "unconverted/DBO (above 1: the converted model with DBO is faster); "
                 "diff = largest logit difference to the unconverted model, relative; "
                 "comp/comm/both/split: the ceiling probe, ceiling = (comp + comm) / both, "
                 "eta = (noDBO - DBO) / (noDBO - both)")
    return "\n".join(lines)
