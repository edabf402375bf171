"""One rank's soak loop, the summary across ranks, and the command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from dbo.cli import Parser, check_out_file
from dbo.cli.launch import RankContext, launch, resolve_world_size
from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.cli.soak.config import BACKENDS, EXPERT_KERNELS, KIB, SoakConfig
from dbo.cli.soak.memory import MemorySample, MemoryTracker, MemoryVerdict
from dbo.cli.soak.workload import SoakModel, draw_step_input


# ------------------------------------------------------------------------------ one rank
@dataclass(frozen=True, kw_only=True)
class RankResult:
    """One rank's soak outcome, gathered on rank 0."""

    rank: int
    zero_token_steps: list[int]
    tokens: int
    split_steps: int
    max_abs_diff: float
    mismatched_steps: list[int]
    samples: list[MemorySample]
    memory: MemoryVerdict
    wall_s: float


def run_rank(ctx: RankContext, job: SoakConfig) -> Optional[dict]:
    """Run the soak on this rank; rank 0 returns the summary (a JSON-able dict)."""
    if ctx.world_size < 2:
        raise ValueError(f"the soak runs expert parallelism over 2 or more ranks, got "
                         f"world size {ctx.world_size}: use --world-size 2 (CPU) or 2+ GPUs")
    if job.num_experts % ctx.world_size:
        raise ValueError(f"--num-experts={job.num_experts} is not divisible by the world "
                         f"size {ctx.world_size}")
    experts = "reference" if job.experts == "auto" and ctx.device.type == "cpu" else job.experts
    model = SoakModel(job, group=ctx.group, experts=experts, device=ctx.device)
    model.init_weights(job.seed)
    # split="tokens": rows are independent. A rank with 0 or 1 tokens cannot halve them
    # and votes no, so a step with such a rank runs unsplit everywhere; every rank still
    # calls the runner (the vote is a collective) and runs the MoE collectives.
    runner = DBORunner(model, DBOConfig(split="tokens", min_prefill_tokens=2,
                                        min_decode_tokens=2), group=ctx.group)
    memory = MemoryTracker(ctx.device, trace_python=ctx.device.type == "cpu",
                           trace_window=job.trace_window,
                           workspace_bytes=model.workspace_bytes)
    sample_steps = [done for done in range(job.warmup + 1, job.steps + 1)
                    if (done - job.warmup) % job.report_every == 0 or done == job.steps]
    window_starts = {max(done - job.trace_window, prev)
                     for prev, done in zip([job.warmup, *sample_steps], sample_steps)}
    gen = torch.Generator()
    is_zero = bytearray(job.steps)  # allocated up front: no growth while memory is measured
    mismatched: list[int] = []
    tokens = split_steps = 0
    max_diff = 0.0
    t_start = time.perf_counter()
    try:
        for step in range(job.steps):
            if step == job.warmup:
                memory.start(step)
            if step in window_starts:
                memory.begin_window()
            num_tokens, split, diff = _step(job, step, ctx, model, runner, gen)
            tokens += num_tokens
            split_steps += split
            is_zero[step] = num_tokens == 0
            if not diff <= job.atol:  # NaN is a mismatch too
                mismatched.append(step)
            max_diff = max(max_diff, diff) if not math.isnan(diff) else math.inf
            done = step + 1
            if done in sample_steps:
                memory.record(done)
                if ctx.is_main:
                    _progress(job, done, split_steps, max_diff, mismatched, memory,
                              time.perf_counter() - t_start)
    finally:
        memory.stop()
    t_end = time.perf_counter()
    zero_steps = [step for step, zero in enumerate(is_zero) if zero]
    result = RankResult(rank=ctx.rank, zero_token_steps=zero_steps, tokens=tokens,
                        split_steps=split_steps, max_abs_diff=max_diff,
                        mismatched_steps=mismatched, samples=memory.samples,
                        memory=memory.verdict(job.bound_kib * KIB), wall_s=t_end - t_start)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, result)
    if not ctx.is_main:
        return None
    return summarize(job, ctx, experts, gathered)


def _step(job: SoakConfig, step: int, ctx: RankContext, model: SoakModel, runner: DBORunner,
          gen: torch.Generator) -> tuple[int, bool, float]:
    """One step: (tokens here, whether DBO split, max |DBO - reference|). No tensor of the
    step outlives this call, so memory samples between steps see none of them."""
    x_TH = draw_step_input(job, step, ctx.rank, gen).to(ctx.device)
    with torch.no_grad():
        ref_TH = model(x_TH)
        out_TH = runner(x_TH)
    # Both paths are fp32 with the same weights: they differ only in summation order
    # (each ubatch's GEMMs block by its own row count; expert partial sums arrive per
    # ubatch), i.e. in the last bits; routing is per token, so it cannot differ.
    if out_TH.shape != ref_TH.shape:
        diff = math.inf
    elif out_TH.numel() == 0:
        diff = 0.0
    else:
        diff = (out_TH - ref_TH).abs().max().item()
    return x_TH.shape[0], bool(runner.last_decision.split), diff


def _progress(job: SoakConfig, done: int, split_steps: int, max_diff: float,
              mismatched: list[int], memory: MemoryTracker, elapsed: float) -> None:
    first, last = memory.samples[0], memory.samples[-1]
    if last.cuda_allocated is not None:
        mem = f"cuda {_kib(last.cuda_allocated - first.cuda_allocated)}"
    elif first.traced_bytes is not None:
        mem = f"tracemalloc {_kib(last.traced_bytes - first.traced_bytes)}"
    else:
        mem = f"tracemalloc {_kib(last.traced_bytes)} in the last {job.trace_window} steps"
    rss = None if last.rss_bytes is None else last.rss_bytes - first.rss_bytes
    print(f"soak: step {done}/{job.steps}  split {split_steps}  max|diff| {max_diff:.1e}  "
          f"mismatched {len(mismatched)}  {mem}  objects {last.objects - first.objects:+d}  "
          f"tensors {last.tensors - first.tensors:+d}  rss {_kib(rss)}  "
          f"{elapsed / done * 1e3:.1f} ms/step", file=sys.stderr, flush=True)


def _kib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / KIB:+.1f} KiB"


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
    return {
        "job": "dbo soak", "backend": job.backend, "experts": experts,
        "device": ctx.device.type, "world_size": ctx.world_size, "layers": job.layers,
        "max_tokens": job.max_tokens, "steps": job.steps, "warmup": job.warmup,
        "split_steps": results[0].split_steps,
        "zero_token_steps": [len(r.zero_token_steps) for r in results],
        "all_ranks_zero_steps": len(all_zero),
        "tokens": [r.tokens for r in results],
        "max_abs_diff": max_diff if math.isfinite(max_diff) else None,
        "max_abs_diff_per_rank": [r.max_abs_diff if math.isfinite(r.max_abs_diff) else None
                                  for r in results],
        "atol": job.atol,
        "mismatched_steps": {"count": len(mismatched), "first": mismatched[:10]},
        "memory_ok": all(r.memory.ok for r in results),
        "memory": memory,
        "wall_s": round(max(r.wall_s for r in results), 3),
        "ms_per_step": round(max(r.wall_s for r in results) / job.steps * 1e3, 3),
        "ok": not mismatched and all(r.memory.ok for r in results),
        "config": asdict(job),
    }


def print_summary(s: dict) -> None:
    print(f"dbo soak: {s['steps']} steps ({s['warmup']} warmup), {s['world_size']} ranks on "
          f"{s['device']}, backend {s['backend']}, experts {s['experts']}, MoE layers "
          f"{s['layers']}, 0..{s['max_tokens']} tokens per rank and step")
    print(f"split steps {s['split_steps']}/{s['steps']}, steps with 0 tokens on every rank "
          f"{s['all_ranks_zero_steps']}; max |DBO - reference| {s['max_abs_diff']} (atol "
          f"{s['atol']}); mismatched steps {s['mismatched_steps']['count']} "
          f"{s['mismatched_steps']['first']}; {s['ms_per_step']:.1f} ms/step")
    print(f"\n{'rank':>4} {'0-token':>7} {'tokens':>7} {'max|diff|':>9} {'memory':>6}  "
          f"growth from step {s['memory'][0]['baseline_step']} to "
          f"{s['memory'][0]['final_step']} (asserted: value/bound)")
    for r, m in zip(range(s["world_size"]), s["memory"]):
        checked = "  ".join(f"{k} {_fmt(k, c['growth'])}/{_fmt(k, c['bound'])}"
                            for k, c in m["checked"].items())
        rss = m.get("rss_bytes")
        diff = s["max_abs_diff_per_rank"][r]
        print(f"{r:>4} {s['zero_token_steps'][r]:>7} {s['tokens'][r]:>7} "
              f"{'inf/nan' if diff is None else f'{diff:.1e}':>9} "
              f"{'flat' if m['ok'] else 'GREW':>6}  {checked}"
              f"  (rss {_kib(None if rss is None else rss['growth'])}, not asserted)")
    print(f"\nverdict: {'PASS' if s['ok'] else 'FAIL'}")


def _fmt(name: str, value: int) -> str:
    return str(value) if name in ("objects", "tensors") else f"{value / KIB:.1f}K"


# ------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = Parser("dbo soak", description=__doc__)
    d = SoakConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="steps in all, warmup included")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="dispatch/combine backend")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="most tokens per rank and step")
    p.add_argument("--layers", type=int, default=d.layers, help="MoE layers")
    p.add_argument("--seed", type=int, default=d.seed, help="weights, token counts, inputs")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to start (default: every GPU, or 2 CPU ranks)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="steps before the memory baseline")
    p.add_argument("--report-every", type=int, default=d.report_every,
                   help="steps between memory samples and progress lines")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="expert width")
    p.add_argument("--num-experts", type=int, default=d.num_experts,
                   help="routed experts over all ranks, a multiple of the world size")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    p.add_argument("--experts", default=d.experts, choices=EXPERT_KERNELS,
                   help="expert kernel (auto: reference on CPU, the fastest on GPU)")
    p.add_argument("--atol", type=float, default=d.atol,
                   help="largest |DBO - reference| at any element of any step")
    p.add_argument("--bound-kib", type=int, default=d.bound_kib,
                   help="largest memory growth after warmup, KiB")
    p.add_argument("--trace-window", type=int, default=d.trace_window,
                   help="tracemalloc only in the last N steps before each sample (CPU; "
                        "0: every step after warmup)")
    p.add_argument("--json-out", default=None, help="also write the full summary here")
    return p


def run_soak(job: SoakConfig, *, world_size: Optional[int] = None) -> Optional[dict]:
    """Launch the soak on `world_size` ranks; the summary on rank 0 (None elsewhere)."""
    return launch(run_rank, job, world_size=world_size)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in ("world_size", "json_out")}
    try:
        job = SoakConfig(**options)
        if args.world_size is not None and args.world_size < 2:
            raise ValueError(f"--world-size={args.world_size}: the soak needs 2 or more ranks")
        world_size = resolve_world_size(args.world_size)
        if job.num_experts % world_size:
            raise ValueError(f"--num-experts={job.num_experts} is not divisible by "
                             f"--world-size={world_size}: use a multiple of {world_size}")
        if args.json_out is not None:
            check_out_file("--json-out", args.json_out)
        from moe.experts import make_experts
        make_experts(job.experts, "cuda" if torch.cuda.is_available() else "cpu")
    except ValueError as exc:
        parser.error(str(exc))  # one line, exit 2
    summary = run_soak(job, world_size=world_size)
    if summary is None:
        return 0  # a non-zero torchrun rank
    print_summary(summary)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    # The final line: everything but the config and the per-sample series (--json-out).
    line = {k: v for k, v in summary.items() if k != "config"}
    line["memory"] = [{k: v for k, v in m.items() if k != "samples"} for m in line["memory"]]
    print(json.dumps(line))
    return 0 if summary["ok"] else 1
