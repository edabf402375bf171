"""One rank's soak loop and the command line (the summary: `dbo.cli.soak.summary`)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner, GraphedRunner, PeerInputError
from dbo.cli import (Parser, check_backend_runs, check_backend_tokens, check_fits_memory,
                     check_out_file)
from dbo.cli.launch import RankContext, launch, resolve_world_size
from dbo.cli.soak.config import BACKENDS, DTYPES, EXPERT_KERNELS, KIB, SoakConfig, memory_need
from dbo.cli.soak.memory import MemoryTracker
from dbo.cli.soak.padding import pad_rows, padded_size, real_rows
from dbo.cli.soak.reference import DenseReference
from dbo.cli.soak.summary import (GRAPH_SPLITS, RankResult, kib, print_summary, summarize,
                                  tolerance_of)
from dbo.cli.soak.workload import SoakModel, bad_input_rank, draw_step_input, widen


# ------------------------------------------------------------------------------ one rank
def run_rank(ctx: RankContext, job: SoakConfig) -> Optional[dict]:
    """Run the soak on this rank; rank 0 returns the summary (a JSON-able dict)."""
    if ctx.world_size < 2:
        raise ValueError(f"the soak runs expert parallelism over 2 or more ranks, got "
                         f"world size {ctx.world_size}: use --world-size 2 (CPU) or 2+ GPUs")
    if job.num_experts % ctx.world_size:
        raise ValueError(f"--num-experts={job.num_experts} is not divisible by the world "
                         f"size {ctx.world_size}")
    if job.cuda_graph and ctx.device.type != "cuda":
        raise ValueError(f"--cuda-graph needs CUDA GPUs; this rank runs on {ctx.device}")
    experts = "reference" if job.experts == "auto" and ctx.device.type == "cpu" else job.experts
    model = SoakModel(job, group=ctx.group, experts=experts, device=ctx.device)
    model.init_weights(job.seed)
    reference = None
    if job.dtype == "bfloat16":
        reference = DenseReference(model, [SoakModel.expert_seed(job.seed, i)
                                           for i in range(job.layers)])
    # split="tokens": rows are independent. A rank with 0 or 1 tokens cannot halve them
    # and votes no, so a step with such a rank runs unsplit everywhere; every rank still
    # calls the runner (the vote is a collective) and runs the MoE collectives.
    runner: DBORunner | GraphedRunner = DBORunner(
        model, DBOConfig(split="tokens", min_prefill_tokens=2, min_decode_tokens=2,
                         joined_experts=job.joined_experts),
        group=ctx.group)
    if job.cuda_graph:
        # Room for every size's graph (the capture sweep makes them all): none is ever
        # evicted and captured again.
        runner = GraphedRunner(runner, max_graphs=GRAPH_SPLITS * len(job.capture_sizes))
    memory = MemoryTracker(ctx.device, trace_python=ctx.device.type == "cpu",
                           trace_window=job.trace_window,
                           workspace_bytes=model.workspace_bytes)
    sample_steps = [done for done in range(job.warmup + 1, job.steps + 1)
                    if (done - job.warmup) % job.report_every == 0 or done == job.steps]
    window_starts = {max(done - job.trace_window, prev)
                     for prev, done in zip([job.warmup, *sample_steps], sample_steps)}
    gen = torch.Generator()
    # Allocated up front: no growth while memory is measured.
    is_zero, is_stopped = bytearray(job.steps), bytearray(job.steps)
    mismatched: list[int] = []
    tokens = split_steps = 0
    max_diff = 0.0
    tolerance = tolerance_of(job)
    captures_at_warmup = None
    t_start = time.perf_counter()
    try:
        for step in range(job.steps):
            if step == job.warmup:
                memory.start(step)
                captures_at_warmup = _captures(runner)
            if step in window_starts:
                memory.begin_window()
            bad_rank = bad_input_rank(job, step, ctx.world_size)
            if bad_rank is not None:
                num_tokens, split = 0, False
                diff, is_stopped[step] = _stopped_step(job, step, ctx, runner, gen, bad_rank)
            else:
                num_tokens, split, diff = _step(job, step, ctx, model, runner, reference, gen)
            tokens += num_tokens
            split_steps += split
            is_zero[step] = num_tokens == 0 and bad_rank is None
            if not diff <= tolerance:  # NaN is a mismatch too
                mismatched.append(step)
            max_diff = max(max_diff, diff) if not math.isnan(diff) else math.inf
            done = step + 1
            if done in sample_steps:
                memory.record(done)
                if ctx.is_main:
                    _progress(job, done, split_steps, sum(is_stopped), max_diff, mismatched,
                              memory, time.perf_counter() - t_start)
    finally:
        memory.stop()
    t_end = time.perf_counter()
    zero_steps = [step for step, zero in enumerate(is_zero) if zero]
    captured = _captures(runner)
    stopped = [step for step, stop in enumerate(is_stopped) if stop]
    result = RankResult(rank=ctx.rank, zero_token_steps=zero_steps, stopped_steps=stopped,
                        tokens=tokens, split_steps=split_steps, max_abs_diff=max_diff,
                        mismatched_steps=mismatched, samples=memory.samples,
                        memory=memory.verdict(job.bound_kib * KIB), wall_s=t_end - t_start,
                        graphs_captured=captured,
                        graphs_captured_after_warmup=(None if captured is None
                                                      else captured - captures_at_warmup))
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, result)
    _release(job, ctx, runner)
    if not ctx.is_main:
        return None
    return summarize(job, ctx, experts, gathered)


def _release(job: SoakConfig, ctx: RankContext, runner: DBORunner | GraphedRunner) -> None:
    """Drop the graphs, then tear down the group's DeepEP buffers, on every rank before
    the group goes (`moe.backends.deepep_support.destroy_buffers`)."""
    if isinstance(runner, GraphedRunner):
        runner.reset()
    if job.backend.startswith("deepep"):
        from moe.backends import destroy_buffers
        torch.cuda.synchronize(ctx.device)
        dist.barrier()
        destroy_buffers(ctx.group)

def _captures(runner: DBORunner | GraphedRunner) -> Optional[int]:
    return runner.num_captures if isinstance(runner, GraphedRunner) else None


def _step(job: SoakConfig, step: int, ctx: RankContext, model: SoakModel,
          runner: DBORunner | GraphedRunner, reference: Optional[DenseReference],
          gen: torch.Generator) -> tuple[int, bool, float]:
    """One step: (real tokens here, whether DBO split, its error: float32 max |DBO - the
    model without DBO|, bfloat16 `DenseReference.error`). A padded step runs on its
    tokens padded up to a capture size and checks the real rows only. No tensor of the
    step outlives this call, so memory samples between steps see none of them."""
    x_TH = draw_step_input(job, step, ctx.rank, gen).to(ctx.device, job.torch_dtype)
    num_tokens = x_TH.shape[0]
    x_in = pad_rows(x_TH, padded_size(num_tokens, job.capture_sizes)) if job.padded else x_TH
    with torch.no_grad():
        if reference is None:
            ref_TH = model(x_TH)[0]
        out = runner(x_in)
        if out[0].shape[0] != x_in.shape[0]:
            return num_tokens, bool(runner.last_decision.split), math.inf
        out_TH, hidden_TLH, logits_TLE = real_rows(out, num_tokens)
        if reference is not None:
            diff = reference.error(out_TH, hidden_TLH, logits_TLE)
        elif out_TH.numel() == 0:
            diff = 0.0
        else:
            # Both paths are fp32 with the same weights: they differ only in summation
            # order (each ubatch's GEMMs block by its own row count; expert partial sums
            # arrive per ubatch), i.e. in the last bits; routing is per token.
            diff = (out_TH - ref_TH).abs().max().item()
    return num_tokens, bool(runner.last_decision.split), diff


def _stopped_step(job: SoakConfig, step: int, ctx: RankContext,
                  runner: DBORunner | GraphedRunner, gen: torch.Generator,
                  bad_rank: int) -> tuple[float, bool]:
    """A step whose input rank `bad_rank` rejects (`bad_input_rank`): (0.0, True) where the
    vote stopped it as it must, on every rank together (that rank raising its own
    ValueError, the others `PeerInputError`), leaving the group usable; (inf, False) where
    it ran or stopped otherwise. Any other error ends the soak."""
    x_TH = draw_step_input(job, step, ctx.rank, gen).to(ctx.device, job.torch_dtype)
    if ctx.rank == bad_rank:
        x_TH = widen(x_TH)
    x_in = pad_rows(x_TH, padded_size(x_TH.shape[0], job.capture_sizes)) if job.padded else x_TH
    expected = ValueError if ctx.rank == bad_rank else PeerInputError
    try:
        with torch.no_grad():
            runner(x_in)
    except (ValueError, PeerInputError) as exc:
        if type(exc) is expected and getattr(exc, "dbo_stopped_together", False):
            return 0.0, True
        return math.inf, False
    return math.inf, False


def _progress(job: SoakConfig, done: int, split_steps: int, stopped_steps: int,
              max_diff: float, mismatched: list[int], memory: MemoryTracker,
              elapsed: float) -> None:
    first, last = memory.samples[0], memory.samples[-1]
    if last.cuda_allocated is not None:
        mem = f"cuda {kib(last.cuda_allocated - first.cuda_allocated)}"
    elif first.traced_bytes is not None:
        mem = f"tracemalloc {kib(last.traced_bytes - first.traced_bytes)}"
    else:
        mem = f"tracemalloc {kib(last.traced_bytes)} in the last {job.trace_window} steps"
    rss = None if last.rss_bytes is None else last.rss_bytes - first.rss_bytes
    stopped = f"stopped {stopped_steps}  " if job.bad_every else ""
    print(f"soak: step {done}/{job.steps}  split {split_steps}  {stopped}max|diff| "
          f"{max_diff:.1e}  mismatched {len(mismatched)}  {mem}  "
          f"objects {last.objects - first.objects:+d}  "
          f"tensors {last.tensors - first.tensors:+d}  rss {kib(rss)}  "
          f"{elapsed / done * 1e3:.1f} ms/step", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ CLI
DESCRIPTION = """\
Runs many DBO steps, each rank drawing its own random token count (zero included), and
checks every step against the same step without DBO, while it samples memory and holds
its growth to bounds. Prints progress, a table per rank, then one JSON line; exits with
1 on a mismatched step or memory growth past a bound."""

EXAMPLES = """\
examples:
  dbo soak                                     # CPU: 2 ranks, 2000 steps
  dbo soak --steps 500 --backend a2a_ll --layers 1
  dbo soak --steps 20000 --max-tokens 512      # GPUs: one rank per GPU
  dbo soak --backend a2a_ll --cuda-graph       # GPUs: steps replayed from CUDA graphs
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser("dbo soak", description=DESCRIPTION, epilog=EXAMPLES)
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
                   help="largest |DBO - reference| at any element of any step (float32)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="model dtype; bfloat16 checks each layer against a float32 dense "
                        "reference (dbo.cli.soak.reference)")
    p.add_argument("--joined-experts", action="store_true",
                   help="the DBO steps run each MoE layer's experts once over both "
                        "ubatches' rows (DBOConfig.joined_experts)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="run the DBO steps as CUDA graph replays, each padded up to a "
                        "graph size (GPUs)")
    p.add_argument("--graph-sizes", type=_sizes, default=None,
                   help="comma-separated capture sizes, the last = --max-tokens (default: "
                        "powers of two from 2, then --max-tokens)")
    p.add_argument("--bound-kib", type=int, default=d.bound_kib,
                   help="largest memory growth after warmup, KiB")
    p.add_argument("--trace-window", type=int, default=d.trace_window,
                   help="tracemalloc only in the last N steps before each sample (CPU; "
                        "0: every step after warmup)")
    p.add_argument("--bad-every", type=int, default=d.bad_every, metavar="N",
                   help="every N-th step one rank (in turn) gets rows its input check "
                        "rejects: every rank stops at the vote, the group is reused (0: never)")
    p.add_argument("--json-out", default=None, help="also write the full summary here")
    return p


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. "
                                         f"2,8,32,64") from None


def check_devices(job: SoakConfig, world_size: int) -> None:
    """ValueError or ImportError, before any rank starts, for what this machine cannot
    run: graphs without CUDA, a backend it cannot run (`dbo.cli.check_backend_runs`),
    deepep_ll's capacity above NVSHMEM's queue depth, more memory than a rank has."""
    if job.cuda_graph and not torch.cuda.is_available():
        raise ValueError("--cuda-graph needs CUDA GPUs, and none is visible here: drop "
                         "--cuda-graph to run eager steps")
    check_backend_tokens(job.backend, "--max-tokens", job.max_tokens, world_size,
                         backend_option=f"--backend={job.backend}")
    check_backend_runs(job.backend, world_size)
    fixed, per_token = memory_need(job, world_size)
    check_fits_memory("--max-tokens", job.max_tokens, unit="token", per_unit_bytes=per_token,
                      model=(f"the soak model ({job.layers} layers of {job.num_experts} "
                             f"experts over {world_size} ranks, --hidden={job.hidden}, "
                             f"--intermediate={job.intermediate})"), fixed_bytes=fixed,
                      shape_fix="use fewer --layers, a smaller --hidden or --intermediate, "
                                "or more ranks", world_size=world_size)


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
        check_devices(job, world_size)
        if args.json_out is not None:
            check_out_file("--json-out", args.json_out)
        from moe.experts import make_experts
        make_experts(job.experts, "cuda" if torch.cuda.is_available() else "cpu")
    except (ImportError, ValueError) as exc:
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
