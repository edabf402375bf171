"""`dbo bench --hf NAME`: parse the options that apply, start the ranks, report.

    python -m dbo.cli.bench --hf qwen3_moe                           # CPU: 2 gloo ranks, tiny
    python -m dbo.cli.bench --hf qwen3_moe --mode decode --requests 2,4 --context 8
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf deepseek-v3
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf qwen3-30b-a3b \
        --mode decode --requests 64,256,512 --context 1024
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf qwen3-30b-a3b \
        --tokens 4096 --backends a2a,a2a_ll                  # a2a_ll: a capacity per point
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf qwen3-30b-a3b \
        --tokens 4096 --backends a2a_ll --cuda-graph         # converted steps as graphs
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf qwen3-30b-a3b \
        --tokens 4096 --backends a2a_ll --combine-groups 4   # SBO by expert group
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf qwen3-30b-a3b \
        --mode decode --requests 64,256,512 --backends a2a_ll --cuda-graph   # graphed decode

Prefill by default, each point timed with DBO off, SBO (single-batch overlap, the
DBO-off model through `DBOConfig(overlap="sbo")`) and DBO on, then gated as the layer
bench gates (`dbo.cli.bench.hf_gate`: off, SBO or DBO; `--gate-min-tokens`,
`--min-gain`, `--gate-trial-iters`); `--combine-chunks N` / `--combine-groups N`
(a2a_ll only) set the SBO step's combine form (`A2ALLOptions`).
`--mode decode` times decode steps over KV caches instead, SBO too
(`dbo.cli.bench.hf_decode`), sweeping `--requests` (requests per rank) at `--context`
cached tokens per request, gated as the other modes gate (`--gate-min-tokens`,
`--gate-trial-iters`).

`--backends a2a_ll` (also symm_mem, deepep_ll) converts with a capacity per rank
(`hf_config.conversions`): no MoE layer reads counts on the host. `--cuda-graph` (GPUs;
those backends only; prefill or decode) replays the converted model's steps, DBO off and
on, from CUDA graphs: an eager DBO step issues every layer's Python once per ubatch,
which at small hidden sizes or few tokens costs more host time than the GPU takes
(`hf_sweep`, `hf_decode`).

Ranks as the other modes (`dbo.cli.bench.launch`): under torchrun this process is one
rank, else it spawns `--world-size` (default 2). Everything is checked before a rank
starts (the architecture, its experts over the ranks, each backend's library, device and
shape limits), each error one line with the fix.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Mapping, Optional

import torch

from dbo.cli import (check_backend_runs, check_backend_shape, check_backend_tokens,
                     check_fits_memory, check_out_dir, quiet_profiler_logs)
from dbo.cli.bench.config import check_context_option, regime_label, requests_count
from dbo.cli.bench.ranks import measure_on_rank, p2p_disabled, resolve_device, world_size_of
from dbo.cli.bench.hf_config import (
    DEFAULT_HF_CPU_CONTEXT,
    DEFAULT_HF_CPU_DECODE_REQUESTS,
    DEFAULT_HF_CPU_TOKENS,
    DEFAULT_HF_GPU_CONTEXT,
    DEFAULT_HF_GPU_DECODE_REQUESTS,
    DEFAULT_HF_GPU_TOKENS,
    DEFAULT_HF_LAYERS,
    HFBenchConfig,
    HFDecodeOptions,
)
from moe.backends import DEFAULT_BACKEND

# Options of the other modes that mean nothing here: (attribute, its default, flag).
_NOT_WITH_HF = (("preset", None, "--preset"), ("experts_per_rank", None, "--experts-per-rank"),
                ("trace", False, "--trace"))


def hf_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> HFBenchConfig:
    """A validated HFBenchConfig (ValueError with the fix on bad input)."""
    for name, default, flag in _NOT_WITH_HF:
        if getattr(args, name) != default:
            raise ValueError(f"{flag} does not apply to --hf (it names the model and its "
                             f"shapes): drop {flag}")
    device = resolve_device(args.device)
    gpu = device == "cuda"
    decode = _decode_options(args, gpu=gpu)
    tokens = ([t for group in args.tokens for t in group] if args.tokens else
              list(DEFAULT_HF_GPU_TOKENS if gpu else DEFAULT_HF_CPU_TOKENS))
    backends = ([b for group in args.backends for b in group] if args.backends
                else [DEFAULT_BACKEND])
    return HFBenchConfig(decode=decode,
        arch=args.hf, layers=args.layers if args.layers is not None else DEFAULT_HF_LAYERS,
        num_experts=args.num_experts, tokens=tuple(tokens),
        requests=(HFBenchConfig.requests if decode is not None else
                  requests_count(args.requests, where="--hf without --mode decode",
                                 default=HFBenchConfig.requests)),
        backends=tuple(backends), experts=args.experts, conversion=args.conversion,
        iters=args.iters if args.iters is not None else (20 if gpu else 5),
        warmup=args.warmup if args.warmup is not None else (5 if gpu else 2),
        rounds=args.rounds if args.rounds is not None else (3 if gpu else 1),
        device=device, regime=regime_label(device, p2p_disabled=p2p_disabled(env)),
        cuda_graph=args.cuda_graph, combine_chunks=args.combine_chunks,
        combine_groups=args.combine_groups, gate_min_tokens=args.gate_min_tokens,
        min_gain=args.min_gain, gate_trial_iters=args.gate_trial_iters,
        out_dir=args.out, seed=args.seed, progress=not args.no_progress)


def _decode_options(args: argparse.Namespace, *, gpu: bool) -> Optional[HFDecodeOptions]:
    """`--mode decode`'s options (None for prefill); ValueError naming the fix."""
    if args.mode == "model":
        raise ValueError("--mode model does not apply to --hf (the architecture is the "
                         "model): drop it for prefill, or use --mode decode")
    check_context_option(args.mode, args.context)
    if args.mode != "decode":
        return None
    if args.tokens:
        raise ValueError("--hf with --mode decode sweeps --requests (one new token per "
                         "request per step): drop --tokens")
    requests = ([r for group in args.requests for r in group] if args.requests else
                list(DEFAULT_HF_GPU_DECODE_REQUESTS if gpu else DEFAULT_HF_CPU_DECODE_REQUESTS))
    context = args.context if args.context is not None else (
        DEFAULT_HF_GPU_CONTEXT if gpu else DEFAULT_HF_CPU_CONTEXT)
    return HFDecodeOptions(requests=tuple(requests), context=context,
                           gate_min_requests=args.gate_min_tokens,
                           gate_trial_iters=args.gate_trial_iters)


def main_hf(parser: argparse.ArgumentParser, args: argparse.Namespace,
            env: Mapping[str, str], spawn: Callable[..., int]) -> int:
    """Run `dbo bench --hf` with parsed `args`; returns the exit code. `spawn`: how
    ranks start outside torchrun (`dbo.cli.bench.ranks.spawn_ranks`)."""
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    try:
        cfg = hf_config_from_args(args, env)
        check_out_dir("--out", cfg.out_dir)
        world = world_size_of(args.world_size, cfg.device, env)
        config = cfg.model_config(world)
        check_backends_run(cfg, config, world_size=world, env=env)
        # A lower bound: the logits row [V] and four hidden rows [H] of each token (decode:
        # of each request's new token), bf16 on GPUs, fp32 on CPU.
        unit = "token" if cfg.decode is None else "request"
        check_fits_memory(f"--{unit}s", max(cfg.tokens if cfg.decode is None
                                            else cfg.decode.requests), unit=unit,
                          per_unit_bytes=(config.vocab_size + 4 * config.hidden_size)
                          * (2 if cfg.device == "cuda" else 4),
                          model=f"--hf {args.hf}", shape_fix="use a smaller model",
                          world_size=world, device_type=cfg.device)
    except (ImportError, ValueError) as exc:
        parser.error(str(exc))  # one line, exit 2
    quiet_profiler_logs()
    if torchrun:
        return run_hf_rank(cfg, rank=int(env["RANK"]), world_size=world,
                           local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                           init_method="env://")
    return spawn(cfg, world, run_hf_rank)


def check_backends_run(cfg: HFBenchConfig, config: Any, *, world_size: int,
                       env: Mapping[str, str]) -> None:
    """ImportError or ValueError, in one line, for a backend of `cfg` that cannot run the
    model of transformers config `config` here, as the backend declares it
    (`PrepareFinalize.check_runs`, `check_shape`, `check_max_tokens`): symm_mem without
    its op, CUDA or NVSHMEM; the DeepEP backends without deep_ep or CUDA; deepep_ll at a
    hidden size its kernels lack, or at more tokens per rank than NVSHMEM's queue depth
    takes."""
    points = cfg.tokens if cfg.decode is None else cfg.decode.requests
    for backend in cfg.backends:
        check_backend_runs(backend, world_size)
        check_backend_shape(backend, config.hidden_size, torch.bfloat16, world_size)
        check_backend_tokens(backend, "--tokens" if cfg.decode is None else "--requests",
                             max(points), world_size, env=env,
                             backend_option=f"--backends {backend}")


def run_hf_rank(cfg: HFBenchConfig, *, rank: int, world_size: int, local_rank: int,
                init_method: str) -> int:
    """One rank: init the group, measure, and (rank 0) print the table and JSON line."""
    if cfg.decode is not None:
        from dbo.cli.bench import hf_decode_report as report
        from dbo.cli.bench.hf_decode import run_hf_decode as sweep
    else:
        from dbo.cli.bench import hf_report as report  # type: ignore[no-redef]
        from dbo.cli.bench.hf_sweep import run_hf_sweep as sweep  # type: ignore[assignment]

    return measure_on_rank(cfg.device, rank=rank, world_size=world_size,
                           local_rank=local_rank, init_method=init_method,
                           measure=lambda group, device: sweep(cfg, group=group,
                                                               device=device),
                           report=report)
