"""Outputs of the comm benchmark (rank 0): the table for people, CSV and JSON files, the
PNG (latency vs tokens per rank, log-log, one line per backend) and the final JSON line.

Files under `out_dir`: `bench_comm_w<W>_<tag>.{csv,json,png}` (tag: nvlink, cpu, ...),
`bench_comm_w<W>_<tag>_graphs.*` for a `--cuda-graph` run. A CPU run is a functional check
(gloo, host wall times): its outputs say so. Every output carries the mode (`cuda_graph`)
and says what its columns mean (`definitions`).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from typing import Any, Optional

from moe.bench.comm import CommResult, Point, Skip

FUNCTIONAL_NOTE = ("CPU gloo run: a functional check; its times are host wall times of "
                   "gloo collectives, not performance figures")

DEFINITIONS = {
    "latency": "CUDA-event time of the call (perf_counter on CPU); per rank the median of "
               "the timed calls, reported: the slowest rank's median",
    "host": "perf_counter around the call, without waiting for the GPU (the host waits "
            "only where the engine does); host_total_us: per call of dispatch + combine "
            "(one layer), the median of their sum; the slowest rank's median",
    "algbw": "DeepEP test_intranode's definition: bytes of the rows this rank receives "
             "(one per token and destination rank, H x element size) / the rank's median "
             "time, GB/s = 1e9 B/s; d+c counts the bytes twice; mean over ranks",
    "algbw_ll": "DeepEP test_low_latency's definition: bytes of the (token, expert) slots "
                "this rank sends, dispatch + combine / the rank's median d+c time (bf16 "
                "both ways); mean over ranks",
    "sms": "largest min(grid blocks, SM count) over the comm kernels (names matching "
           "traces.classify's comm patterns) of one dispatch or combine, from "
           "torch.profiler's kernel events (args.grid); most over ranks",
}

GRAPH_DEFINITIONS = {
    "latency": "N (graph_layers) dispatch + combine pairs captured in one CUDA graph: "
               "total_us = device time of one replay (CUDA events around it, replays back "
               "to back, so no per-call host launch cost) / N; dispatch_us, combine_us = "
               "the median over all pairs of replays run one at a time of the time "
               "between external events recorded inside the graph around each call; per "
               "rank the median, reported: the slowest rank's median",
    "host": "host_total_us = perf_counter around one replay call, the GPU idle, / N: host "
            "time per layer; no host time per dispatch or combine call (None); the "
            "slowest rank's median",
}

COLUMNS = ("backend", "tokens", "dispatch_us", "combine_us", "total_us", "host_dispatch_us",
           "host_combine_us", "host_total_us", "algbw_dispatch_gbps", "algbw_combine_gbps",
           "algbw_total_gbps", "algbw_ll_total_gbps", "sms_dispatch", "sms_combine")


def folded_skips(result: CommResult) -> list[Skip]:
    """The skips, one per backend where every point of it was skipped for one reason."""
    out: list[Skip] = []
    points = set(result.config.tokens)
    for name in dict.fromkeys(s.backend for s in result.skipped):
        mine = [s for s in result.skipped if s.backend == name]
        reasons = {s.reason for s in mine}
        if len(reasons) == 1 and {s.tokens for s in mine} in ({None}, points):
            out.append(Skip(name, None, reasons.pop()))
        else:
            out.extend(mine)
    return out


def file_stem(result: CommResult) -> str:
    regime = result.config.regime.lower()
    tag = "cpu" if result.functional else ("p2p-disabled" if "p2p" in regime else "nvlink")
    mode = "_graphs" if result.config.cuda_graph else ""
    return f"bench_comm_w{result.world_size}_{tag}{mode}"


def definitions(result: CommResult) -> dict[str, str]:
    """What each figure of this run means (the graphed latency and host differ)."""
    return {**DEFINITIONS, **(GRAPH_DEFINITIONS if result.config.cuda_graph else {})}


def _row(result: CommResult, p: Point) -> dict[str, Any]:
    return {"regime": result.config.regime, **{k: getattr(p, k) for k in COLUMNS}}


def header(result: CommResult) -> dict[str, Any]:
    cfg = result.config
    return {"bench": "comm", "regime": cfg.regime, "device": result.device,
            "world_size": result.world_size, "sm_count": result.sm_count,
            "functional": result.functional,
            "shapes": {"hidden": cfg.hidden, "top_k": cfg.top_k,
                       "num_experts": cfg.num_experts, "dtype": str(cfg.dtype).split(".")[-1],
                       "routing": cfg.routing, "seed": cfg.seed},
            "iters": cfg.iters, "warmup": cfg.warmup, "cuda_graph": cfg.cuda_graph,
            "graph_layers": cfg.graph_layers if cfg.cuda_graph else None}


def write_outputs(result: CommResult) -> dict[str, Any]:
    """Write CSV, JSON and (unless --no-plot) PNG; return their paths (png None with
    `png_note` saying why)."""
    os.makedirs(result.config.out_dir, exist_ok=True)
    stem = os.path.join(result.config.out_dir, file_stem(result))
    files: dict[str, Any] = {"csv": stem + ".csv", "json": stem + ".json", "png": None}
    with open(files["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["regime", *COLUMNS])
        writer.writeheader()
        writer.writerows(_row(result, p) for p in result.points)
    doc = {**header(result), "definitions": definitions(result),
           "points": [dataclasses.asdict(p) for p in result.points],
           "skipped": [dataclasses.asdict(s) for s in folded_skips(result)]}
    if result.functional:
        doc["note"] = FUNCTIONAL_NOTE
    with open(files["json"], "w") as f:
        json.dump(doc, f, indent=1)
    if not result.config.plot:
        files["png_note"] = "not drawn: --no-plot"
    elif not result.points:
        files["png_note"] = "not drawn: no point ran"
    else:
        try:
            plot(result, stem + ".png")
            files["png"] = stem + ".png"
        except ImportError as exc:
            files["png_note"] = f"not drawn: {exc}"
    return files


def plot(result: CommResult, path: str) -> None:
    """Left: dispatch + combine latency vs tokens per rank (log-log), dispatch dotted;
    right: algorithmic bandwidth of dispatch + combine (log x)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the plot needs matplotlib (pip install matplotlib), or pass "
                          "--no-plot") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(p.backend for p in result.points))
    for i, name in enumerate(names):
        pts = sorted((p for p in result.points if p.backend == name), key=lambda p: p.tokens)
        xs, c = [p.tokens for p in pts], colours[i % len(colours)]
        ax_lat.plot(xs, [p.total_us for p in pts], "o-", color=c, lw=2,
                    label=f"{name} dispatch+combine")
        ax_lat.plot(xs, [p.dispatch_us for p in pts], ":", color=c, lw=1)
        ax_bw.plot(xs, [p.algbw_total_gbps or float("nan") for p in pts], "o-", color=c,
                   lw=2, label=name)
    ax_lat.set_xscale("log", base=2)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (us); dotted: dispatch alone")
    ax_bw.set_xscale("log", base=2)
    ax_bw.set_ylabel("algorithmic bandwidth, dispatch+combine (GB/s)")
    for ax in (ax_lat, ax_bw):
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    cfg = result.config
    note = " - functional check, not performance" if result.functional else ""
    mode = f", CUDA graph of {cfg.graph_layers} pairs" if cfg.cuda_graph else ""
    fig.suptitle(f"dbo bench-comm [{cfg.regime}{mode}] {result.device}, {result.world_size} ranks, "
                 f"H={cfg.hidden} top-{cfg.top_k} {cfg.num_experts} experts{note}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _legend(result: CommResult) -> list[str]:
    cfg = result.config
    if not cfg.cuda_graph:
        return [f"  latency: median of {cfg.iters} back-to-back calls after {cfg.warmup} "
                f"warmup, slowest rank; host: perf_counter per dispatch call, per combine "
                f"call, and per layer (both); GB/s: DeepEP's received-rows bytes / time, "
                f"mean over ranks; SMs: comm kernels' grids (dispatch/combine)"]
    n = cfg.graph_layers
    return [f"  CUDA graphs: {n} dispatch+combine pairs (layers) captured in one graph, "
            f"{cfg.warmup} warmup replays; slowest rank's medians:",
            f"  d+c us = device time of one replay / {n} ({cfg.iters} replays back to back: "
            f"no per-call host launch cost);",
            f"  disp us, comb us = each call's time between events recorded inside the graph "
            f"(median over the pairs of {cfg.iters} replays run one at a time);",
            f"  host/layer = perf_counter around one replay call / {n} (the GPU idle); no "
            f"per-call host time (host d, host c: -);",
            "  GB/s: DeepEP's received-rows bytes / time, mean over ranks; SMs: comm "
            "kernels' grids of one eager dispatch/combine"]


def format_table(result: CommResult) -> str:
    cfg = result.config
    lines = [
        f"dbo bench-comm: regime={cfg.regime} device={result.device} "
        f"world={result.world_size}" + (f" SMs={result.sm_count}" if result.sm_count else "")
        + (" cuda_graph=true" if cfg.cuda_graph else ""),
        f"  shapes: H={cfg.hidden} top_k={cfg.top_k} experts={cfg.num_experts} "
        f"({cfg.num_experts // result.world_size}/rank) {header(result)['shapes']['dtype']} "
        f"routing={cfg.routing} seed={cfg.seed}",
        *_legend(result),
        *([f"  {FUNCTIONAL_NOTE}"] if result.functional else []),
        "",
    ]
    head = (f"{'backend':<14} {'T':>5} {'disp us':>9} {'comb us':>9} {'d+c us':>9} "
            f"{'host d':>8} {'host c':>8} {'host/layer':>10} {'GB/s d':>8} {'GB/s c':>8} "
            f"{'GB/s d+c':>8} {'SMs d/c':>8}")
    lines += [head, "-" * len(head)]
    for p in result.points:
        sms = ("-" if p.sms_dispatch is None and p.sms_combine is None else
               f"{_cell(p.sms_dispatch, 'd')}/{_cell(p.sms_combine, 'd')}")
        lines.append(
            f"{p.backend:<14} {p.tokens:>5} {p.dispatch_us:>9.1f} {p.combine_us:>9.1f} "
            f"{p.total_us:>9.1f} {_cell(p.host_dispatch_us, '.1f'):>8} "
            f"{_cell(p.host_combine_us, '.1f'):>8} {p.host_total_us:>10.1f} "
            f"{_cell(p.algbw_dispatch_gbps, '.2f'):>8} {_cell(p.algbw_combine_gbps, '.2f'):>8} "
            f"{_cell(p.algbw_total_gbps, '.2f'):>8} {sms:>8}")
    for s in folded_skips(result):
        where = "" if s.tokens is None else f" T={s.tokens}"
        lines.append(f"skipped {s.backend}{where}: {s.reason}")
    return "\n".join(lines)


def final_line(result: CommResult, files: dict[str, Any]) -> str:
    """The one JSON line for programs (stdout, last line)."""
    doc = {**header(result),
           "points": [{k: getattr(p, k) for k in COLUMNS} for p in result.points],
           "skipped": [dataclasses.asdict(s) for s in folded_skips(result)],
           "files": files}
    return json.dumps(doc, separators=(",", ":"))
