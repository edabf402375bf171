"""Outputs of `dbo bench --hf NAME --mode decode` (rank 0): the table, CSV and JSON files,
the final JSON line.

Files, under `out_dir`: `bench_hf_decode_<arch>_w<world>_<regime tag>.{csv,json}`. A CPU
run is a functional check: its ratios and `gated_never_slower_than_1pct` are null.
"""
from __future__ import annotations

from typing import Any

from dbo.cli.bench.hf_decode import HFDecodeResult
from dbo.cli.bench.hf_report import (DEFINITIONS as PREFILL_DEFINITIONS, HOST_COLUMNS,
                                     HOST_DEFINITIONS, HOST_LEGEND, JOINED_LEGEND,
                                     _capacity_note, eager_graph_cell, host_bound_lines,
                                     joined_cell, joined_split_lines, json_line,
                                     max_logits_diff, sbo_cell, sbo_legend, sbo_lines, step_cells,
                                     write_files)
from dbo.cli.bench.report import FUNCTIONAL_NOTE, MAX_GATED_SLOWDOWN, _num, _opt

MODE = "hf_decode"  # the JSON's mode and the files' stem

GRAPH_LEGEND = ("  CUDA graphs: the converted model's steps are replayed (DBO off: one "
                "captured step; DBO on and the gate's trials: GraphedRunner, the vote then "
                "a replay), each over a cache it leaves as it found it; the unconverted "
                "model eagerly and graphed where it captures, unconv ms the faster; "
                "attention without a mask (hf_graphs.use_mask_free_sdpa)")

DEFINITIONS = {
    "step": ("one new token per request over its KV cache of `context` tokens; the cache "
             "is put back to `context` tokens after every step, so it never grows"),
    "t_hf": ("the unconverted transformers model, every expert on every rank, running "
             "this rank's requests (no expert parallelism)"),
    "t_nodbo / t_dbo": ("the converted model (expert parallelism), DBO off / on (two "
                        "request groups, each with its own KV cache); with cuda_graph "
                        "replayed from CUDA graphs, the gate's trials too"),
    "t_sbo": ("the DBO-off step (one cache) through DBORunner(..., DBOConfig("
              "overlap=\"sbo\")): one ubatch, shared experts under the dispatch, the "
              "combine overlapped as the table's SBO line says; not gated; null where it "
              "did not run (sbo_note says why)"),
    "speedup_sbo": PREFILL_DEFINITIONS["speedup_sbo"],
    "t_joined": ("DBO with joined experts: the DBO-on step (two request groups, each with "
                 "its own KV cache) through DBOConfig(..., joined_experts=True), each MoE "
                 "layer's experts run once over both groups' rows; not gated; "
                 "joined_split: whether it was split (joined_split_reason: why)"),
    "speedup_joined": PREFILL_DEFINITIONS["speedup_joined"],
    "sbo_note": PREFILL_DEFINITIONS["sbo_note"],
    "t_hf_eager / t_hf_graph": PREFILL_DEFINITIONS["t_hf_eager / t_hf_graph"],
    "step_time": ("per rank, the median over rounds of the median over iters of its "
                  "steps; the max over ranks unless *_rank0"),
    "tokens_per_s": "requests per rank * world size / step time",
    "speedup": "T_noDBO / T_DBO",
    "gate": ("dbo or off: the request threshold (--gate-min-tokens), then the worst of "
             "the rounds' separate DBO trials (below 1.01x: off)"),
    "gated_speedup": "T_noDBO / T_gated, T_gated = T_DBO where the gate chose dbo, else T_noDBO",
    "dbo_vs_hf": "T_hf / T_DBO", "nodbo_vs_hf": "T_hf / T_noDBO",
    "max_tokens_per_rank": ("the converted layers' capacity (moe.hf.convert), for the "
                            "backends that need one; null otherwise"),
    "logits_diff": ("DBO off / on / SBO / joined: max |decode logits - unconverted decode "
                    "logits| / max |unconverted decode logits| over the same cached "
                    "prefix, the largest over ranks"),
    **HOST_DEFINITIONS,
}


def summarize(result: HFDecodeResult) -> dict[str, Any]:
    points = result.points
    common = {"points": len(points), "points_split": sum(p.dbo_split for p in points),
              "points_gated_on": sum(p.gate == "dbo" for p in points),
              "points_sbo": sum(p.t_sbo_ms is not None for p in points),
              "points_joined": sum(p.t_joined_ms is not None for p in points),
              "max_logits_diff": max(max_logits_diff(p) for p in points)}
    if result.config.functional:
        return {"functional": True, **common, "gated_never_slower_than_1pct": None}
    speedups = [p.speedup for p in points]
    gated = [p.gated_speedup for p in points]
    return {**common, "min_speedup": min(speedups), "max_speedup": max(speedups),  # type: ignore[type-var]
            "min_gated_speedup": min(gated),  # type: ignore[type-var]
            "gated_never_slower_than_1pct": all(g >= 1.0 / (1.0 + MAX_GATED_SLOWDOWN)  # type: ignore[operator]
                                                for g in gated),
            "min_dbo_vs_hf": min(p.dbo_vs_hf for p in points),  # type: ignore[type-var]
            "min_nodbo_vs_hf": min(p.nodbo_vs_hf for p in points)}  # type: ignore[type-var]


def write_outputs(result: HFDecodeResult) -> dict[str, Any]:
    """Write the CSV and JSON; return {"csv": path, "json": path}."""
    return write_files(result, mode=MODE, definitions=DEFINITIONS, summary=summarize(result),
                       points=[{**p.row(), "trial_speedups": p.trial_speedups,
                                "per_rank_ms": p.per_rank_ms, "rounds_ms": p.rounds_ms}
                               for p in result.points])


def final_line(result: HFDecodeResult, files: dict[str, Any]) -> str:
    """The one JSON line for programs (stdout, last line)."""
    return json_line(result, mode=MODE, summary=summarize(result),
                     points=[{**p.row(), "trial_speedups": p.trial_speedups}
                             for p in result.points], files=files)


def format_table(result: HFDecodeResult) -> str:
    cfg, s = result.config, result.shapes
    assert cfg.decode is not None
    lines = [
        f"dbo bench --hf {cfg.arch} --mode decode: world={result.world_size} "
        f"regime={cfg.regime}",
        f"  shapes: {s['model_type']} H={s['hidden_size']} experts={s['num_experts']} "
        f"({s['experts_per_rank']}/rank converted, all on every rank unconverted) "
        f"top_k={s['top_k']} I={s['intermediate_size']} layers={s['layers']} {s['dtype']}; "
        f"unconverted experts: {s['hf_experts_implementation']}",
        f"  decode: one token per request over {cfg.decode.context} cached tokens "
        f"({s['kv_cache_layer']}, {s['kv_cache_bytes_per_rank'] / 1e9:.3g} GB/rank at "
        f"{s['max_requests']} requests); times in ms, median of {cfg.iters} steps after "
        f"{cfg.warmup} warmup" + (f", median of {cfg.rounds} rounds" if cfg.rounds > 1 else "")
        + "; shown rank0/max over ranks; ratios use the max",
        HOST_LEGEND,
        *([GRAPH_LEGEND] if cfg.cuda_graph else []),
        *([f"  {FUNCTIONAL_NOTE}"] if cfg.functional else []),
        *([f"  capacity: {note}"] if (note := _capacity_note(result)) else []),
        sbo_legend(cfg),
        JOINED_LEGEND + " (not gated)",
        "",
    ]
    cols = [("R/rank", 6), ("backend", 7), ("unconv ms", 15), ("noDBO ms", 15),
            ("DBO ms", 15), ("SBO ms", 15), ("joined ms", 15), *HOST_COLUMNS, ("speedup", 7),
            ("SBO speedup", 11), ("joined speedup", 14), ("gate", 4), ("gated", 6),
            ("DBO/unconv", 10), ("tok/s DBO", 9), ("diff", 8)]
    if cfg.functional:
        cols = [c for c in cols if c[0] not in ("speedup", "SBO speedup", "joined speedup",
                                                 "gated", "DBO/unconv")]
    if cfg.cuda_graph:
        cols.insert(3, ("unconv eager/graph", 18))
    lines.append("  ".join(f"{name:>{w}}" for name, w in cols))
    for p in result.points:
        cells = {"R/rank": str(p.requests_per_rank), "backend": p.backend, **step_cells(p),
                 "SBO ms": sbo_cell(p), "SBO speedup": _opt(p.speedup_sbo),
                 "joined ms": joined_cell(p), "joined speedup": _opt(p.speedup_joined),
                 "speedup": f"{p.speedup or 0:.3f}", "gate": p.gate,
                 "gated": f"{p.gated_speedup or 0:.3f}",
                 "DBO/unconv": f"{p.dbo_vs_hf or 0:.3f}",
                 "tok/s DBO": _num(p.tokens_per_s_dbo),
                 "diff": f"{max_logits_diff(p):.1e}",
                 "unconv eager/graph": eager_graph_cell(p)}
        lines.append("  ".join(f"{cells[name]:>{w}}" for name, w in cols))
    lines += joined_split_lines(result.points,
                                lambda p: f"{p.backend} R={p.requests_per_rank}")
    lines += host_bound_lines(result.points, lambda p: f"{p.backend} R={p.requests_per_rank}")
    lines += sbo_lines(result.points, lambda p: f"{p.backend} R={p.requests_per_rank}")
    notes = {p.requests_per_rank: p.hf_graph_note for p in result.points if p.hf_graph_note}
    lines += [f"  unconverted R={r}: no graph: {note}" for r, note in notes.items()]
    lines.append("gate decisions:")
    for p in result.points:
        split = "" if p.dbo_split else f" (DBO-on step NOT split: {p.dbo_split_reason})"
        lines.append(f"  {p.backend:>7} R={p.requests_per_rank:<5} {p.gate:>3}: "
                     f"{p.gate_reason}{split}")
    summary = summarize(result)
    if cfg.functional:
        lines.append(f"summary: functional run, {summary['points']} points ran (DBO split "
                     f"the step at {summary['points_split']}); nothing overlaps on CPU: "
                     f"measure DBO on GPUs  [{cfg.regime}]")
    else:
        lines.append(f"summary: speedup {summary['min_speedup']:.3f}-"
                     f"{summary['max_speedup']:.3f}x; worst gated speedup "
                     f"{summary['min_gated_speedup']:.3f}x; gated never >1% slower: "
                     f"{summary['gated_never_slower_than_1pct']}  [{cfg.regime}]")
    lines.append("  speedup = noDBO/DBO; SBO speedup = noDBO/SBO; joined speedup = "
                 "noDBO/joined; gated = noDBO/(the "
                 "gate's choice, off or DBO); DBO/unconv = "
                 "unconverted/DBO; diff = largest decode-logit difference to the "
                 "unconverted model, relative")
    return "\n".join(lines)
