"""The soak's per-rank result, the summary across ranks, and its printout."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from dbo.cli.launch import RankContext
from dbo.cli.soak.config import KIB, SoakConfig
from dbo.cli.soak.memory import MemorySample, MemoryVerdict
from dbo.cli.soak.reference import BF16_REL_TOL
from dbo.cli.soak.workload import bad_input_rank

# Splits a graph can be keyed on: DBO split or not (`dbo.graphs`).
GRAPH_SPLITS = 2


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """One rank's soak outcome, gathered on rank 0."""

    rank: int
    zero_token_steps: list[int]
    stopped_steps: list[int]
    """Steps the vote stopped, as it must have, after a rank's rejected input
    (`SoakConfig.bad_every`)."""
    tokens: int
    split_steps: int
    max_abs_diff: float
    """The largest step error (`tolerance_of` says which: float32 absolute, bfloat16
    relative)."""
    mismatched_steps: list[int]
    samples: list[MemorySample]
    memory: MemoryVerdict
    wall_s: float
    graphs_captured: Optional[int]
    """CUDA graphs this rank captured (None: eager steps)."""
    graphs_captured_after_warmup: Optional[int]
    """Of those, captured after the memory baseline (0 after the capture sweep)."""


def tolerance_of(job: SoakConfig) -> float:
    """The bound on `_step`'s error: --atol (float32), else BF16_REL_TOL (relative)."""
    return BF16_REL_TOL if job.dtype == "bfloat16" else job.atol


# ------------------------------------------------------------------------------ summary
def summarize(job: SoakConfig, ctx: RankContext, experts: str,
              results: list[RankResult]) -> dict:
    """The JSON-able summary of every rank's result."""
    split_counts = {r.split_steps for r in results}
    assert len(split_counts) == 1, f"ranks disagree on the number of split steps: {split_counts}"
    mismatched = sorted({s for r in results for s in r.mismatched_steps})
    all_zero = set.intersection(*(set(r.zero_token_steps) for r in results))
    max_diff = max(r.max_abs_diff for r in results)
    memory = []
    for r in results:
        first, last = r.samples[0], r.samples[-1]
        memory.append({
            "rank": r.rank, "ok": r.memory.ok,
            "baseline_step": first.step, "final_step": last.step,
            "checked": {k: {"growth": g, "bound": b} for k, (g, b) in r.memory.checked.items()},
            **{name: {"baseline": getattr(first, name), "final": getattr(last, name),
                      "growth": g}
               for name, g in r.memory.growth.items()
               if g is not None and name != "traced_bytes"},
        })
        if job.trace_window and first.traced_bytes is None:
            memory[-1]["traced_bytes_per_window"] = {
                "window_steps": job.trace_window,
                "bytes": [x.traced_bytes for x in r.samples[1:]]}
        elif first.traced_bytes is not None:
            memory[-1]["traced_bytes"] = {"baseline": first.traced_bytes,
                                          "final": last.traced_bytes,
                                          "growth": r.memory.growth["traced_bytes"]}
        memory[-1]["samples"] = [asdict(x) for x in r.samples]
    # float32: |DBO - the model without DBO|; bfloat16: relative to the dense reference.
    err, bound = ("max_rel_err", "rel_tol") if job.dtype == "bfloat16" else ("max_abs_diff",
                                                                            "atol")
    graphs = None
    if job.cuda_graph:
        limit = GRAPH_SPLITS * len(job.capture_sizes)
        captured = [r.graphs_captured for r in results]
        graphs = {"sizes": list(job.capture_sizes), "captured_per_rank": captured,
                  "captured_after_warmup_per_rank": [r.graphs_captured_after_warmup
                                                     for r in results],
                  "bound": limit, "ok": all(n is not None and n <= limit for n in captured)}
    graphs_ok = graphs is None or graphs["ok"]
    bad = [step for step in range(job.steps)
           if bad_input_rank(job, step, ctx.world_size) is not None]
    stopped = {"expected": len(bad), "per_rank": [len(r.stopped_steps) for r in results],
               "ok": all(r.stopped_steps == bad for r in results)}
    return {
        "job": "dbo soak", "backend": job.backend, "experts": experts,
        "device": ctx.device.type, "world_size": ctx.world_size, "layers": job.layers,
        "dtype": job.dtype, "cuda_graph": job.cuda_graph, "padded": job.padded,
        "joined_experts": job.joined_experts,
        "max_tokens": job.max_tokens, "steps": job.steps, "warmup": job.warmup,
        "split_steps": results[0].split_steps,
        "zero_token_steps": [len(r.zero_token_steps) for r in results],
        "all_ranks_zero_steps": len(all_zero),
        "stopped_steps": stopped,
        "tokens": [r.tokens for r in results],
        err: max_diff if math.isfinite(max_diff) else None,
        f"{err}_per_rank": [r.max_abs_diff if math.isfinite(r.max_abs_diff) else None
                            for r in results],
        bound: tolerance_of(job),
        "mismatched_steps": {"count": len(mismatched), "first": mismatched[:10]},
        "graphs": graphs,
        "memory_ok": all(r.memory.ok for r in results),
        "memory": memory,
        "wall_s": round(max(r.wall_s for r in results), 3),
        "ms_per_step": round(max(r.wall_s for r in results) / job.steps * 1e3, 3),
        "ok": (not mismatched and all(r.memory.ok for r in results) and graphs_ok
               and stopped["ok"]),
        "config": asdict(job),
    }


def print_summary(s: dict) -> None:
    mode = (("CUDA graphs" if s["cuda_graph"] else "eager") + (", padded" if s["padded"] else "")
            + (", joined experts" if s.get("joined_experts") else ""))
    print(f"dbo soak: {s['steps']} steps ({s['warmup']} warmup), {s['world_size']} ranks on "
          f"{s['device']}, backend {s['backend']}, experts {s['experts']}, MoE layers "
          f"{s['layers']}, {s['dtype']}, {mode}, 0..{s['max_tokens']} tokens per rank and step")
    if "rel_tol" in s:
        check = (f"max |layer - fp32 dense reference| / scale {s['max_rel_err']} (bound "
                 f"{s['rel_tol']:.3g})")
    else:
        check = f"max |DBO - reference| {s['max_abs_diff']} (atol {s['atol']})"
    print(f"split steps {s['split_steps']}/{s['steps']}, steps with 0 tokens on every rank "
          f"{s['all_ranks_zero_steps']}; {check}; mismatched steps "
          f"{s['mismatched_steps']['count']} {s['mismatched_steps']['first']}; "
          f"{s['ms_per_step']:.1f} ms/step")
    if s["stopped_steps"]["expected"]:
        st = s["stopped_steps"]
        print(f"steps stopped at the vote by a rank's rejected input, the group reused after "
              f"each: {st['per_rank']} per rank (expected {st['expected']}: "
              f"{'ok' if st['ok'] else 'WRONG'})")
    if s["graphs"] is not None:
        g = s["graphs"]
        print(f"graphs: sizes {g['sizes']}; captured per rank {g['captured_per_rank']} "
              f"(bound {g['bound']} = sizes x splits; after warmup "
              f"{g['captured_after_warmup_per_rank']})")
    print(f"\n{'rank':>4} {'0-token':>7} {'tokens':>7} {'max|diff|':>9} {'memory':>6}  "
          f"growth from step {s['memory'][0]['baseline_step']} to "
          f"{s['memory'][0]['final_step']} (asserted: value/bound)")
    for r, m in zip(range(s["world_size"]), s["memory"]):
        checked = "  ".join(f"{k} {_fmt(k, c['growth'])}/{_fmt(k, c['bound'])}"
                            for k, c in m["checked"].items())
        rss = m.get("rss_bytes")
        diff = s["max_rel_err_per_rank" if "rel_tol" in s else "max_abs_diff_per_rank"][r]
        print(f"{r:>4} {s['zero_token_steps'][r]:>7} {s['tokens'][r]:>7} "
              f"{'inf/nan' if diff is None else f'{diff:.1e}':>9} "
              f"{'flat' if m['ok'] else 'GREW':>6}  {checked}"
              f"  (rss {kib(None if rss is None else rss['growth'])} from the baseline, "
              f"not asserted)")
    print(f"\nverdict: {'PASS' if s['ok'] else 'FAIL'}")


def _fmt(name: str, value: int) -> str:
    return str(value) if name in ("objects", "tensors") else f"{value / KIB:.1f}K"


def kib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / KIB:+.1f} KiB"
