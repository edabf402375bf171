"""Command line of `dbo bench`: parse, label the environment, start the ranks, report.

Ranks: under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) this process is one rank;
otherwise it spawns `--world-size` ranks itself (default 2), gloo on CPU, NCCL on GPU
(one GPU per rank). This is the only module of the bench that reads the environment:
NCCL_P2P_DISABLE picks the regime label; NCCL_* settings are passed through untouched.
"""
from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional, Sequence


from dbo.cli.bench.config import (
    BENCH_BACKENDS,
    DEFAULT_BACKENDS,
    DEFAULT_CPU_PRESET,
    DEFAULT_CPU_REQUESTS,
    DEFAULT_CPU_TOKENS,
    DEFAULT_GPU_PRESET,
    DEFAULT_GPU_REQUESTS,
    DEFAULT_GPU_TOKENS,
    DEFAULT_GRAPH_BACKENDS,
    EXPERT_KERNELS,
    GRAPH_BACKENDS,
    MODES,
    OVERLAPS,
    BenchConfig,
    check_context_option,
    known_presets,
    regime_label,
    requests_count,
)
from dbo.cli import (Parser, check_backend_runs, check_backend_tokens, check_fits_memory,
                     check_out_dir, quiet_profiler_logs)
from dbo.cli.bench.ranks import (measure_on_rank, p2p_disabled, resolve_device, spawn_ranks,
                                  world_size_of)

USAGE_EXAMPLES = """\
examples:
  python -m dbo.cli.bench --mode layer                       # CPU: spawns 2 gloo ranks, tiny shapes
  torchrun --nproc_per_node=2 -m dbo.cli.bench --mode layer  # GPU, NVLink
  NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --mode layer
  torchrun --nproc_per_node=2 -m dbo.cli.bench --mode model --preset deepseek-v3-like
  torchrun --nproc_per_node=2 -m dbo.cli.bench --mode layer --cuda-graph   # a2a_ll as graphs
  torchrun --nproc_per_node=2 -m dbo.cli.bench --mode decode --experts-per-rank 8 --cuda-graph
  NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf deepseek-v3 --tokens 4096
  NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf qwen3-30b-a3b --mode decode --requests 64,256,512
"""


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 256,1024, got {text!r}")


def _name_list(text: str) -> list[str]:
    return [v for v in text.replace(",", " ").split() if v]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        "dbo bench", epilog=USAGE_EXAMPLES,
        description="Measures the throughput of no overlap, single-batch overlap (SBO) and DBO\n"
                    "over tokens per rank and backends, with the measured overlap ceiling (GPU)\n"
                    "and a gate that chooses among the three. Prints a table, writes\n"
                    "CSV/JSON/PNG (and a calibration for dbo plan), ends with one JSON line.")
    p.add_argument("--mode", default="layer", choices=MODES,
                   help="layer: MoE layers with attention-sized GEMMs between; model: the "
                        "reference MoE transformer; decode: one token per request over its "
                        "KV cache, then MoE (sweeps --requests)")
    p.add_argument("--hf", default=None, metavar="ARCH",
                   help="a Hugging Face MoE architecture converted by moe.hf, DBO off/on "
                        "beside the unconverted transformers model (qwen3-30b-a3b, "
                        "deepseek-v3, or a tiny one: see dbo.cli.bench.hf_launch)")
    p.add_argument("--preset", default=None, choices=known_presets(),
                   help=f"shapes (default: {DEFAULT_GPU_PRESET} on GPU, "
                        f"{DEFAULT_CPU_PRESET} on CPU)")
    p.add_argument("--tokens", type=_int_list, nargs="+", default=None,
                   help="tokens per rank, e.g. 256,1024,4096 (default: GPU "
                        f"{','.join(map(str, DEFAULT_GPU_TOKENS))}; CPU "
                        f"{','.join(map(str, DEFAULT_CPU_TOKENS))})")
    p.add_argument("--backends", type=_name_list, nargs="+", default=None,
                   help=f"comma list of {', '.join(BENCH_BACKENDS)} (default: "
                        f"{','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--layers", type=int, default=None,
                   help="layer mode: MoE layers (default: 4); model mode: decoder layers "
                        "(default: the preset's)")
    experts = p.add_mutually_exclusive_group()
    experts.add_argument("--num-experts", type=int, default=None,
                         help="routed experts over all ranks (default: the preset's, at "
                              "most 32 per rank)")
    experts.add_argument("--experts-per-rank", type=int, default=None,
                         help="routed experts per rank (default: the preset's, at most 32/rank)")
    d = BenchConfig()
    p.add_argument("--attn-context", type=int, default=d.attn_context,
                   help="layer mode: context tokens of the attention stand-in")
    p.add_argument("--requests", type=_int_list, nargs="+", default=None,
                   help=f"model mode: requests per rank per step (default {d.requests}); "
                        f"decode mode: the swept requests per rank, e.g. 16,64,256,1024 "
                        f"(default: GPU {','.join(map(str, DEFAULT_GPU_REQUESTS))}; CPU "
                        f"{','.join(map(str, DEFAULT_CPU_REQUESTS))})")
    p.add_argument("--context", type=int, default=None,
                   help=f"decode mode: KV-cache tokens per request (default {d.context}; "
                        f"with --hf: GPU 1024, CPU 8)")
    p.add_argument("--experts", default=d.experts, choices=EXPERT_KERNELS,
                   help="expert kernel (auto: the fastest that runs here)")
    p.add_argument("--conversion", default="auto", choices=("auto", "experts"),
                   help="--hf: auto (the fused path where the architecture has one) or "
                        "experts (the experts path for every block)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default: GPU 20, CPU 5)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: GPU 5, CPU 2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measure each point this many times, alternating DBO off, probe, "
                        "SBO and DBO on; report medians and eta's spread (default: GPU 3, CPU 1)")
    p.add_argument("--min-gain", type=float, default=d.min_gain,
                   help="gate: DBO off where the measured ceiling < 1 + this")
    p.add_argument("--gate-min-tokens", type=int, default=d.gate_min_tokens,
                   help="gate: DBO off below this many tokens per rank")
    p.add_argument("--gate-trial-iters", type=int, default=d.gate_trial_iters,
                   help="gate: steps of each of its separate DBO trials, one per "
                        "round; the worst trial decides")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda where it is available")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to spawn when not under torchrun (default: 2)")
    p.add_argument("--out", default=d.out_dir, help="output folder")
    p.add_argument("--seed", type=int, default=d.seed, help="weights and inputs")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--trace", action="store_true",
                   help="capture one DBO-off and one DBO-on step per point (torch.profiler) "
                        "into <out>/traces/")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-split-combine", action="store_true",
                   help="run the last MoE layer's last ubatch like the others (by default "
                        "it sends the other ranks' rows first and computes its own while "
                        "that combine is in flight)")
    p.add_argument("--combine-chunks", type=int, default=d.combine_chunks, metavar="N",
                   help="a2a_ll in SBO steps: send the combine in N chunks, each under the "
                        "next chunk's experts (1: whole)")
    p.add_argument("--combine-groups", type=int, default=d.combine_groups, metavar="N",
                   help="a2a_ll in SBO steps: run each rank's experts in N groups over every "
                        "row, each group's combine under the next group's experts (1: whole; "
                        "not with --combine-chunks)")
    p.add_argument("--gemm-sm-carveout", type=int, default=d.gemm_sm_carveout,
                   metavar="N",
                   help="SMs that torch's GEMMs leave to the comm kernels in DBO steps and "
                        "in the probe's overlapped step (0: every SM)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time every step as a CUDA graph replay (DBO on: vote, then "
                        "replay); backends: " + ", ".join(GRAPH_BACKENDS) + " (default "
                        "with this flag: " + ",".join(DEFAULT_GRAPH_BACKENDS) + ")")
    p.add_argument("--overlaps", type=_name_list, nargs="+", default=None,
                   help=f"comma list of the overlaps timed beside no overlap at every "
                        f"point: dbo (two ubatches), sbo (single-batch overlap, no split), "
                        f"joined (DBO with joined experts: each MoE layer's experts once "
                        f"over both ubatches' rows) (default: {','.join(OVERLAPS)})")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration JSON (e.g. an earlier run's <out>/calibration.json): "
                        "its machine figures feed the predicted columns; points it covers "
                        "are gated on the prediction, without trial steps")
    return p


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> BenchConfig:
    """A validated BenchConfig (ValueError with the fix on bad input)."""
    check_context_option(args.mode, args.context)
    device = resolve_device(args.device)
    gpu = device == "cuda"
    tokens = ([t for group in args.tokens for t in group] if args.tokens else
              list(DEFAULT_GPU_TOKENS if gpu else DEFAULT_CPU_TOKENS))
    backends = ([b for group in args.backends for b in group] if args.backends else
                list(DEFAULT_GRAPH_BACKENDS if args.cuda_graph else DEFAULT_BACKENDS))
    if args.mode == "decode":
        if args.tokens:
            raise ValueError("--mode decode sweeps --requests (one new token per request "
                             "per step): drop --tokens")
        tokens = ([r for group in args.requests for r in group] if args.requests else
                  list(DEFAULT_GPU_REQUESTS if gpu else DEFAULT_CPU_REQUESTS))
    return BenchConfig(
        mode=args.mode, preset=args.preset or (DEFAULT_GPU_PRESET if gpu else DEFAULT_CPU_PRESET),
        tokens=tuple(tokens), backends=tuple(backends), layers=args.layers,
        num_experts=args.num_experts, experts_per_rank=args.experts_per_rank,
        attn_context=args.attn_context,
        requests=(BenchConfig.requests if args.mode == "decode" else
                  requests_count(args.requests, where=f"--mode {args.mode}",
                                 default=BenchConfig.requests)),
        context=args.context if args.context is not None else BenchConfig.context,
        experts=args.experts,
        iters=args.iters if args.iters is not None else (20 if gpu else 5),
        warmup=args.warmup if args.warmup is not None else (5 if gpu else 2),
        rounds=args.rounds if args.rounds is not None else (3 if gpu else 1),
        min_gain=args.min_gain, gate_min_tokens=args.gate_min_tokens,
        gate_trial_iters=args.gate_trial_iters, device=device,
        regime=regime_label(device, p2p_disabled=p2p_disabled(env)), out_dir=args.out,
        seed=args.seed, plot=not args.no_plot, progress=not args.no_progress,
        trace=args.trace, split_last_combine=not args.no_split_combine,
        combine_chunks=args.combine_chunks, combine_groups=args.combine_groups,
        gemm_sm_carveout=args.gemm_sm_carveout, cuda_graph=args.cuda_graph,
        overlaps=(tuple(o for group in args.overlaps for o in group) if args.overlaps
                  else OVERLAPS),
        calibration=args.calibration)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    env = os.environ
    if args.conversion != "auto" and args.hf is None:
        parser.error("--conversion applies to --hf (a Hugging Face model's MoE blocks): "
                     "drop it, or add --hf NAME")
    if args.hf is not None:
        from dbo.cli.bench.hf_launch import main_hf
        return main_hf(parser, args, env, spawn_ranks)
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    try:
        cfg = config_from_args(args, env)
        check_out_dir("--out", cfg.out_dir)
        world = world_size_of(args.world_size, cfg.device, env)
        from moe.models import PRESETS
        num_experts = cfg.resolve_num_experts(world, PRESETS[cfg.preset].moe.num_experts)
        cfg.check_combine_groups_fit(num_experts // world)
        check_bench_memory(cfg, world_size=world, num_experts=num_experts)
        for backend in cfg.backends:
            check_backend_tokens(backend, "--tokens" if cfg.mode != "decode" else "--requests",
                                 max(cfg.tokens), world, env=env,
                                 backend_option=f"--backends {backend}")
            check_backend_runs(backend, world)
        from dbo.cli.bench.predicted import bench_calibration
        bench_calibration(cfg.calibration)  # a bad file fails here, before any rank starts
    except (ImportError, ValueError) as exc:
        parser.error(str(exc))  # one line, exit 2, before any rank starts
    quiet_profiler_logs()  # --trace starts the profiler
    if torchrun:
        return run_rank(cfg, rank=int(env["RANK"]), world_size=world,
                        local_rank=int(env.get("LOCAL_RANK", env["RANK"])), init_method="env://")
    return spawn_ranks(cfg, world, run_rank)


def check_bench_memory(cfg: BenchConfig, *, world_size: int, num_experts: int) -> None:
    """Refuse (`dbo.cli.check_fits_memory`) a sweep whose largest point would need more
    memory than a rank has: the routed experts' weights of its layers (model mode: every
    weight, `estimate_param_bytes`; layer mode: also the attention stand-in's keys and
    values [C, H]) plus, per token (decode mode: per request), `step_bytes_per_token`
    of the preset (model mode: with its logits; layer mode: with its scores [C]; decode
    mode: with its request's keys and values [Nk, context, D])."""
    from dbo.cli.bench.workload import DEFAULT_LAYERS
    from dbo.cli.run_config import step_bytes_per_token
    from moe.models import estimate_param_bytes, get_preset

    preset = get_preset(cfg.preset, num_experts=num_experts)
    size, moe = preset.dtype.itemsize, preset.moe
    layers = cfg.layers if cfg.layers is not None else (
        preset.num_layers if cfg.mode == "model" else DEFAULT_LAYERS)
    per_unit = step_bytes_per_token(preset, lm_head=cfg.mode == "model")
    if cfg.mode == "model":
        weights = estimate_param_bytes(get_preset(cfg.preset, num_experts=num_experts,
                                                  num_layers=layers), ep_size=world_size)
    else:
        experts = num_experts // world_size * 3 * moe.hidden_size * moe.intermediate_size
        weights = layers * experts * size
    if cfg.mode == "layer":
        weights += layers * 2 * cfg.attn_context * preset.hidden_size * size
        per_unit += cfg.attn_context * size
    if cfg.mode == "decode":
        per_unit += 2 * preset.num_kv_heads * (cfg.context + 1) * preset.head_dim * size
    unit = "request" if cfg.mode == "decode" else "token"
    shape = {"layer": ", a smaller --attn-context", "decode": ", a smaller --context"}.get(
        cfg.mode, "")
    check_fits_memory(f"--{unit}s", max(cfg.tokens), unit=unit, per_unit_bytes=per_unit,
                      model=(f"--mode {cfg.mode} of preset {cfg.preset} ({layers} layers, "
                             f"{num_experts} experts over {world_size} ranks)"),
                      fixed_bytes=weights, shape_fix=f"use fewer --layers, fewer experts "
                      f"(--experts-per-rank){shape}, or more ranks", world_size=world_size,
                      device_type=cfg.device)


def run_rank(cfg: BenchConfig, *, rank: int, world_size: int, local_rank: int,
             init_method: str) -> int:
    """One rank: init the group, sweep, and (rank 0) print the table and the JSON line."""
    from dbo.cli.bench import report
    from dbo.cli.bench.sweep import run_sweep

    return measure_on_rank(cfg.device, rank=rank, world_size=world_size,
                           local_rank=local_rank, init_method=init_method,
                           measure=lambda group, device: run_sweep(cfg, group=group,
                                                                   device=device),
                           report=report)
