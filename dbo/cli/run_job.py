"""`dbo run`: the main job. A preset MoE transformer, DBO on and off, on the same batch.

    dbo run                                   # CPU: 2 gloo ranks, tiny preset
    dbo run                                   # GPUs: deepseek-v3-like, bf16, 4096 tokens
    dbo run --preset tiny --tokens 512 --backend a2a_ll --steps 5 --out dbo_out/run
    torchrun --nproc_per_node=2 -m dbo.cli run --preset qwen3-moe-like --tokens 4096
    dbo run --preset deepseek-v3-like --tokens 1024 --cuda-graph   # GPUs: graph replays
    dbo run --world-size 3 --num-experts 6                         # CPU: 3 gloo ranks
    dbo run --decode-steps 4              # then 4 decode steps over KV caches, off and on

Each rank builds the same model (experts split across ranks), draws its own batch
(ranks get different token counts), and runs it once without DBO and once through the
DBORunner. It checks that the two outputs match (in bf16, tokens that a near-tie in
their top-k choice sent to other experts in one of the runs are counted and left out:
`moe.routing_log`), times `--steps` steps of each after warm-up, captures one DBO step
under torch.profiler with the phase labels, and prints: the timing table, the split
decision, and the order in which the two ubatches issued the phases of one MoE layer.
Into `--out` it writes `summary.json`, the Chrome trace `trace.json` (open in Perfetto),
`trace_analysis.json` and `trace_timeline.png`.

On CPU the step times are those of a functional check, not a performance figure: gloo
runs each collective on the calling thread, so nothing can overlap, and no speedup is
reported.

With `--cuda-graph` (GPUs only) both modes run as CUDA graph replays: DBO off as one
captured forward, DBO on through a `dbo.graphs.GraphedRunner` (the vote still runs every
step). The output check then compares the graphed DBO step with the eager model. The
backend must be capturable: `auto` becomes `a2a_ll` on more than one rank. The trace is
of an eager DBO step, as replays run no host code to label their phases.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner, GraphedRunner, capture_graph
from dbo.cli import Parser
from dbo.cli.bench.config import NVLINK_REGIME, regime_label
from dbo.cli.bench.ranks import p2p_disabled
from dbo.cli.launch import RankContext, align_ranks, launch, resolve_world_size
from dbo.cli.run_decode import decode_summary, print_decode, run_decode_steps, timed_step
from dbo.cli.run_hf import build_hf
from dbo.cli.run_config import (BACKENDS, EXPERTS, PROFILERS, RunConfig, check_job_runs,
                                model_config, run_backend, run_defaults, tokens_for_rank)
from moe import record_routing, routing_ties, spread_in_requests
from moe.hf import REAL_SHAPES, TINY_SIZES
from moe.models import PRESETS
from traces.capture import capture, phase_order

DESCRIPTION = """\
Runs an MoE model (a preset, or a Hugging Face model with --hf / --hf-config) on every
GPU, or on 2 CPU ranks, once without DBO and once with it, on the same batch: checks that
the outputs match, times both, traces one DBO step, and prints the split decision and the
order in which the two micro-batches issued one MoE layer's phases. Writes summary.json,
trace.json (open it in Perfetto), trace_analysis.json and trace_timeline.png into --out.
On CPU the times are a functional check, not a performance figure."""

EXAMPLES = """\
examples:
  dbo run                          # GPUs: deepseek-v3-like, bf16; CPU: 2 ranks, tiny preset
  dbo run --preset qwen3-moe-like --tokens 8192 --cuda-graph
  NCCL_P2P_DISABLE=1 dbo run       # GPUs: the links of a scale-out cluster, emulated
  torchrun --nproc_per_node=8 -m dbo.cli run --backend a2a_ll
  dbo run --hf-config qwen3_moe    # a tiny random Hugging Face model
  dbo run --decode-steps 4         # then 4 decode steps over KV caches, DBO off and on
"""


def _timed(fn: Any, steps: int, device: torch.device) -> list[float]:
    """Seconds per step of `steps` calls (`run_decode.timed_step`: ranks in step)."""
    return [timed_step(fn, device)[1] for _ in range(steps)]


@dataclass
class RankSetup:
    """One rank's model, batch and runner for a job."""

    model: Any
    runner: DBORunner
    args: tuple
    kwargs: dict
    backend: str
    dtype: torch.dtype
    num_tokens: int
    moe_layer_id: Optional[int]
    """The first MoE layer (whose phase order is shown); None without one."""
    num_experts: int
    label: str
    """The model, as the summary names it."""

    def off(self) -> Any:
        return self.model(*self.args, **self.kwargs)

    def on(self) -> Any:
        return self.runner(*self.args, **self.kwargs)

    def graphed(self, device: torch.device, warmup: int) -> tuple[Any, Any]:
        """The two modes as CUDA graph replays: (DBO off, DBO on). Both return a fresh
        tensor, as the eager modes do (DBO on: the GraphedRunner clones its output)."""
        off_graph = capture_graph(self.off, device=device, warmup=max(warmup, 1))
        graphed = GraphedRunner(self.runner, warmup=max(warmup, 1))
        return (lambda: off_graph.replay().clone(),
                lambda: graphed(*self.args, **self.kwargs))


def setup_rank(ctx: RankContext, job: RunConfig) -> RankSetup:
    """Build the preset model (same global weights on every rank), this rank's batch
    and a DBORunner voting over all ranks."""
    from moe.models import MoETransformer, make_batch

    if job.cuda_graph and ctx.device.type != "cuda":
        raise ValueError(f"--cuda-graph needs CUDA GPUs; this rank runs on {ctx.device}")
    backend = run_backend(job, ctx.world_size)
    if job.hf is not None or job.hf_config is not None:
        return RankSetup(**build_hf(
            ctx, job, backend=backend, tokens=tokens_for_rank(job, ctx.rank),
            max_tokens=max(tokens_for_rank(job, r) for r in range(ctx.world_size))))
    config = model_config(job, ctx.world_size)
    config = replace(config, moe=replace(
        config.moe, backend=backend, experts=job.experts))
    model = MoETransformer(config, group=ctx.group, device=ctx.device)
    model.init_weights(job.seed)
    batch = make_batch(config, num_tokens=tokens_for_rank(job, ctx.rank),
                       num_requests=job.requests, seed=job.seed + 1000 + ctx.rank,
                       device=ctx.device)
    # Never split inside a request: the reference model has no KV cache, so the tail of a
    # split request could not attend to its head.
    runner = DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=2,
                                        min_decode_tokens=2, max_imbalance=1.0,
                                        joined_experts=job.joined_experts),
                       group=ctx.group)
    return RankSetup(model, runner, (batch.input_ids_T, batch.positions_T),
                     {"seq_lens": batch.seq_lens}, backend, config.dtype,
                     int(batch.input_ids_T.shape[0]),
                     model.moe_layers[0].layer_id if model.moe_layers else None,
                     config.moe.num_experts, f"preset {job.preset}")


def run_rank(ctx: RankContext, job: RunConfig) -> Optional[dict]:
    job_setup = setup_rank(ctx, job)
    model, runner, backend = job_setup.model, job_setup.runner, job_setup.backend

    with torch.no_grad():
        run_off, run_on = job_setup.off, job_setup.on
        if job.cuda_graph:
            run_off, run_on = job_setup.graphed(ctx.device, job.warmup)
        # Routing is recorded on eager runs (a replay runs no host code; it runs the
        # eager DBO step's kernels, so its routing is the same).
        with record_routing(model) as routed_off:
            out_off = job_setup.off()
        with record_routing(model) as routed_on:
            out_on = job_setup.on()
        if job.cuda_graph:
            out_on = run_on()
        decision = runner.last_decision
        # fp32: only summation order differs (per-rank partial sums, row-count-dependent
        # matmul blocking); bf16 also rounds those partial sums.
        rel = 1e-4 if job_setup.dtype == torch.float32 else 2e-2
        scale = out_off.float().abs().max().item() if out_off.numel() else 0.0
        tol = rel * max(1.0, scale)
        # Tokens that met a near-tie in their top-k choice may be routed to another
        # expert in one of the two runs (moe.routing_log): checked by their logits.
        ties_T = routing_ties(routed_off, routed_on, num_tokens=job_setup.num_tokens,
                              logit_atol=rel * max(1.0, routed_off.logit_scale()))
        if "seq_lens" in job_setup.kwargs:  # attention carries a flip to later tokens
            ties_T = spread_in_requests(ties_T, job_setup.kwargs["seq_lens"])
        diff_T = (out_on.float() - out_off.float()).abs().amax(dim=-1).cpu()
        checked_T = diff_T[~ties_T]
        err = checked_T.max().item() if checked_T.numel() else 0.0
        for _ in range(job.warmup):
            run_off()
            run_on()
        t_off = _timed(run_off, job.steps, ctx.device)
        t_on = _timed(run_on, job.steps, ctx.device)
        captured = None
        if job.trace:
            captured = capture(job_setup.on,
                               Path(job.out) / f"rank{ctx.rank}" if ctx.rank else job.out,
                               title=f"dbo run {job_setup.label}, rank {ctx.rank}",
                               align=lambda: align_ranks(ctx))

        decoded = (run_decode_steps(model, runner, job_setup.args, job_setup.kwargs,
                                    steps=job.decode_steps, device=ctx.device)
                    if job.decode_steps else None)
    decode = decode_summary(decoded, job.decode_steps) if decoded is not None else None

    stats = torch.tensor([err, tol, float(ties_T.sum()), statistics.median(t_off),
                          statistics.median(t_on), float(job_setup.num_tokens)],
                         dtype=torch.float64, device=ctx.device)
    gathered = [torch.zeros_like(stats) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, stats)
    if not ctx.is_main:
        return None
    per_rank = [g.tolist() for g in gathered]
    moe_layer = job_setup.moe_layer_id
    order = phase_order(captured.trace.labels, layer=moe_layer) if captured and moe_layer is not None else []
    total_tokens = sum(int(r[5]) for r in per_rank)
    step_off = max(r[3] for r in per_rank)
    step_on = max(r[4] for r in per_rank)
    # On CPU gloo runs each collective on the calling thread: there is nothing to
    # overlap, and the times only show that both modes ran.
    performance = ctx.device.type == "cuda"
    summary = {
        "job": "dbo run", "config": asdict(job), "backend": backend, "world_size": ctx.world_size,
        "model": job_setup.label, "num_experts": job_setup.num_experts,
        "device": str(ctx.device.type), "dtype": str(job_setup.dtype),
        "cuda_graph": job.cuda_graph,
        "split": decision.split, "reason": decision.reason, "mode": decision.overlap,
        "outputs_match": all(r[0] <= r[1] for r in per_rank),
        "max_abs_diff": [r[0] for r in per_rank], "tolerance": [r[1] for r in per_rank],
        "routing_ties": [int(r[2]) for r in per_rank],
        "tokens_per_rank": [int(r[5]) for r in per_rank],
        "regime": regime_label(ctx.device.type, p2p_disabled=p2p_disabled(os.environ)),
        "timings": "performance" if performance else "functional",
        "step_ms": {"dbo_off": step_off * 1e3, "dbo_on": step_on * 1e3},
        "tokens_per_s": {"dbo_off": total_tokens / step_off, "dbo_on": total_tokens / step_on},
        "speedup": step_off / step_on if performance else None,
        "phase_order_layer": moe_layer, "phase_order": [f"ub{u} {p}" for u, p in order],
        "traced_comm": traced_comm(captured) if performance else None,
        "files": {} if captured is None else {
            "trace": str(captured.trace_path), "analysis": str(captured.analysis_path),
            "timeline": str(captured.timeline_path) if captured.timeline_path else None},
        **({"decode": decode} if decode is not None else {}),
    }
    Path(job.out).mkdir(parents=True, exist_ok=True)
    (Path(job.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def print_summary(s: dict) -> None:
    cfg = s["config"]
    print(f"dbo run: {s['model']}, {s['world_size']} ranks on {s['device']} "
          f"({s['dtype']}), backend {s['backend']}, {s['num_experts']} experts, tokens per "
          f"rank {s['tokens_per_rank']}")
    joined = " with joined experts" if s.get("mode") == "joined" else ""
    print(f"split: {s['split']}{joined} ({s['reason']})")
    verdict = "match" if s["outputs_match"] else "DIFFER"
    print(f"outputs DBO on vs off: {verdict} (max |diff| per rank {['%.2e' % d for d in s['max_abs_diff']]}, "
          f"tolerance {['%.1e' % t for t in s['tolerance']]})")
    if any(s["routing_ties"]):
        print(f"  not compared: tokens per rank routed to other experts at a near-tie, their "
              f"router logits agreeing, and the later tokens of their requests (attention "
              f"carries the flip to them): {s['routing_ties']} (moe/routing_log.py)")
    if s["cuda_graph"]:
        print("both modes ran as CUDA graph replays; the trace is of an eager DBO step")
    if s["speedup"] is None:
        print(f"\nfunctional check on {s['device']}, not a performance figure: gloo runs "
              f"each collective on the calling thread, so nothing overlaps; the times only "
              f"show that both modes ran ({cfg['steps']} timed steps each)")
    print(f"\n{'mode':<10} {'step ms (median, slowest rank)':>32} {'tokens/s':>12}")
    for mode in ("dbo_off", "dbo_on"):
        print(f"{mode:<10} {s['step_ms'][mode]:>32.3f} {s['tokens_per_s'][mode]:>12.0f}")
    if s["speedup"] is not None:
        print(f"speedup: {s['speedup']:.3f}x")
    if s.get("traced_comm"):
        comm = s["traced_comm"]
        print(f"traced DBO step, rank 0: {comm['comm_ms']:.1f} ms of communication, "
              f"{comm['hidden_fraction']:.0%} of it hidden behind compute "
              f"(trace_timeline.png shows where)")
    if s["speedup"] is not None and s["speedup"] < LITTLE_GAIN:
        for line in why_dbo_lost(s):
            print(f"  {line}")
    if s["phase_order"]:
        print(f"\norder in which the ubatches issued the phases of layer {s['phase_order_layer']}:")
        for i, item in enumerate(s["phase_order"], 1):
            ub, phase = item.split(" ", 1)
            print(f"  {i:>2}. {'    ' * int(ub[2:])}{ub} {phase}")
    if "decode" in s:
        print_decode(s["decode"])
    if s["files"]:
        print("\nwritten: " + ", ".join(v for v in s["files"].values() if v)
              + f", {Path(cfg['out']) / 'summary.json'}")


# Below this speedup a GPU run says why DBO gained little and how to see the overlap.
LITTLE_GAIN = 1.05


def traced_comm(captured: Any) -> Optional[dict[str, float]]:
    """This rank's communication in its traced DBO step and the share of it that ran
    beside compute (`traces.report`); None without a trace or comm kernels."""
    if captured is None:
        return None
    reports = list(captured.report.devices.values())
    comm = sum(r.comm_us for r in reports)
    if comm <= 0:
        return None
    hidden = sum(r.comm_overlapped_us for r in reports)
    return {"comm_ms": comm / 1e3, "hidden_ms": hidden / 1e3, "hidden_fraction": hidden / comm}


def why_dbo_lost(s: dict) -> list[str]:
    """Lines saying why DBO on was slower than off (or barely faster) in the summary `s`
    of a GPU run (its split compute and extra launches cost about what the overlap hid),
    what made the communication small here (one rank; NVLink), and how to see the
    overlap."""
    verdict = "lost" if s["speedup"] < 1.0 else "gained little"
    lines = [f"DBO {verdict} here: its two half-size ubatches and extra launches cost about "
             "what the overlap hid" + ("" if s["cuda_graph"] else " (--cuda-graph cuts the "
                                       "launches)") + "."]
    tokens = max(s["tokens_per_rank"])
    if s["world_size"] == 1:
        lines.append("One rank sends nothing to other ranks: there is no communication to "
                     "hide. Run on 2 or more GPUs.")
    else:
        if s.get("regime") == NVLINK_REGIME:
            lines.append("The ranks talk over NVLink, fast enough that the dispatch and "
                         "combine leave little to hide.")
        lines.append("To see the overlap: emulate a scale-out link with NCCL_P2P_DISABLE=1 "
                     "(NCCL then stages its traffic through host memory), run more ranks "
                     f"(more GPUs), or more tokens per rank (--tokens {2 * tokens}).")
    lines.append("`dbo bench` measures where DBO wins, and gates it off elsewhere.")
    return lines


def build_parser(*, prog: str = "dbo run", description: Optional[str] = DESCRIPTION,
                 defaults: Optional[RunConfig] = None,
                 traced: bool = False) -> argparse.ArgumentParser:
    """The options of `dbo run`, their defaults from `defaults` but for --preset and
    --tokens, which depend on the device the ranks compute on (`run_defaults`, applied
    by `parse_job`); `traced=True` (`dbo trace`, whose job is the trace) leaves out
    --no-trace, and --cuda-graph, as a traced step runs eagerly."""
    d = defaults or RunConfig()
    cpu, cuda = run_defaults("cpu"), run_defaults("cuda")
    p = Parser(prog, description=description, epilog=None if traced else EXAMPLES)
    # --preset and --tokens default to what the ranks' device runs (`run_defaults`),
    # filled in by `parse_job`.
    p.add_argument("--preset", default=None, choices=PRESETS,
                   help=f"model shapes (default: {cuda.preset} on CUDA GPUs, {cpu.preset} "
                        f"on CPU)")
    p.add_argument("--hf", default=d.hf, metavar="PATH",
                   help="run a local Hugging Face MoE checkpoint folder instead of the preset "
                        "(experts sharded over the ranks; nothing is downloaded)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="with --hf: run the folder's own Python that config.json's auto_map "
                        "names (refused without it)")
    p.add_argument("--hf-config", default=d.hf_config, metavar="NAME",
                   help=f"run a Hugging Face MoE model with random weights instead of the "
                        f"preset: a tiny one of any MoE model type of the installed "
                        f"transformers (e.g. {', '.join(TINY_SIZES)}, olmoe), or real shapes "
                        f"with --layers ({', '.join(REAL_SHAPES)})")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens per rank (rank r gets tokens - r * (tokens // 8)) (default: "
                        f"{cuda.tokens} on CUDA GPUs, {cpu.tokens} on CPU)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests per rank")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="dispatch/combine backend (auto: a2a on several ranks, a2a_ll "
                        "with --cuda-graph)")
    p.add_argument("--experts", default=d.experts, choices=EXPERTS,
                   help="expert kernel (auto: the fastest that runs here)")
    p.add_argument("--num-experts", type=int, default=d.num_experts,
                   help="routed experts over all ranks, a multiple of the world size "
                        "(default: the preset's)")
    p.add_argument("--steps", type=int, default=d.steps,
                   help="steps captured" if traced else "timed steps per mode")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    p.add_argument("--layers", type=int, default=d.layers,
                   help="decoder layers (default: the preset's)")
    p.add_argument("--seed", type=int, default=d.seed, help="weights and batches")
    p.add_argument("--out", default=d.out, help="output folder")
    if not traced:
        p.add_argument("--no-trace", dest="trace", action="store_false",
                       help="skip the traced DBO step (trace, analysis, timeline)")
        p.add_argument("--cuda-graph", action="store_true",
                       help="run and time both modes as CUDA graph replays (GPUs only)")
        p.add_argument("--decode-steps", type=int, default=d.decode_steps, metavar="N",
                       help="after the prefill, N decode steps of one token per request "
                            "over KV caches, DBO off and on, compared and timed")
    else:
        p.add_argument("--profiler", default=d.profiler, choices=PROFILERS,
                       help="torch: torch.profiler (Chrome trace, analysis, timeline); nsys: "
                            "NVTX ranges for `nsys profile --capture-range=cudaProfilerApi`")
    p.add_argument("--joined-experts", action="store_true",
                   help="DBO steps run each MoE layer's experts once over both ubatches' "
                        "rows (DBOConfig.joined_experts: weights read once)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to start (default: every GPU, or 2 CPU ranks)")
    return p


def parse_job(parser: argparse.ArgumentParser,
              argv: Optional[list[str]]) -> tuple[RunConfig, int]:
    """The validated job and its world size, checked the way every rank would check them
    (preset, experts over the ranks, expert kernel, CUDA): a bad value ends the command
    here through `parser.error` (one line, exit 2), before any rank starts."""
    args = vars(parser.parse_args(argv))
    world_size = args.pop("world_size")
    defaults = run_defaults("cuda" if torch.cuda.is_available() else "cpu")
    if args["preset"] is None:  # --hf and --hf-config name the model instead
        hf = args["hf"] is not None or args["hf_config"] is not None
        args["preset"] = RunConfig.preset if hf else defaults.preset
    if args["tokens"] is None:
        args["tokens"] = defaults.tokens
    try:
        job = RunConfig(**args)
        world_size = resolve_world_size(world_size)
        check_job_runs(job, world_size)
        if job.cuda_graph and not torch.cuda.is_available():
            raise ValueError("--cuda-graph needs CUDA GPUs, and none is visible here: "
                             "run without it on CPU")
        if job.profiler == "nsys" and not torch.cuda.is_available():
            raise ValueError("--profiler=nsys needs CUDA GPUs (Nsight Systems records GPU "
                             "work), and none is visible here: use --profiler=torch on CPU")
        from moe.experts import make_experts
        make_experts(job.experts, "cuda" if torch.cuda.is_available() else "cpu")
    except (ImportError, ValueError) as exc:
        parser.error(str(exc))
    return job, world_size


def main(argv: Optional[list[str]] = None) -> int:
    job, world_size = parse_job(build_parser(), argv)
    summary = launch(run_rank, job, world_size=world_size)
    if summary is None:
        return 0  # a non-zero torchrun rank
    print_summary(summary)
    keys = ("split", "mode", "outputs_match", "timings", "speedup", "step_ms", "tokens_per_s",
            "world_size", "backend", "cuda_graph", *(("decode",) if "decode" in summary else ()))
    print(json.dumps({k: summary[k] for k in keys}))
    decode_ok = summary.get("decode", {}).get("outputs_match", True)
    return 0 if summary["outputs_match"] and decode_ok else 1


if __name__ == "__main__":
    sys.exit(main())
