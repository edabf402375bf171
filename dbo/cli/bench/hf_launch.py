"""`dbo bench --hf NAME`: parse the options that apply, start the ranks, report.

    python -m dbo.cli.bench --hf qwen3_moe                           # CPU: 2 gloo ranks, tiny
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --hf deepseek-v3

Ranks as the other modes (`dbo.cli.bench.launch`): under torchrun this process is one
rank, else it spawns `--world-size` (default 2). Everything is checked before a rank
starts (the architecture, its experts over the ranks), each error one line with the fix.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from dbo.cli import check_out_dir, quiet_profiler_logs
from dbo.cli.bench.config import regime_label, requests_count
from dbo.cli.bench.hf_config import (
    DEFAULT_HF_CPU_TOKENS,
    DEFAULT_HF_GPU_TOKENS,
    DEFAULT_HF_LAYERS,
    HFBenchConfig,
)

# Options of the other modes that mean nothing here: (attribute, its default, flag).
_NOT_WITH_HF = (("preset", None, "--preset"), ("experts_per_rank", None, "--experts-per-rank"),
                ("cuda_graph", False, "--cuda-graph"), ("trace", False, "--trace"))


def hf_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> HFBenchConfig:
    """A validated HFBenchConfig (ValueError with the fix on bad input)."""
    for name, default, flag in _NOT_WITH_HF:
        if getattr(args, name) != default:
            raise ValueError(f"{flag} does not apply to --hf (it names the model and its "
                             f"shapes): drop {flag}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here: use --device cpu")
    gpu = device == "cuda"
    tokens = ([t for group in args.tokens for t in group] if args.tokens else
              list(DEFAULT_HF_GPU_TOKENS if gpu else DEFAULT_HF_CPU_TOKENS))
    backends = [b for group in args.backends for b in group] if args.backends else ["a2a"]
    p2p_disabled = env.get("NCCL_P2P_DISABLE", "").strip() not in ("", "0")
    return HFBenchConfig(
        arch=args.hf, layers=args.layers if args.layers is not None else DEFAULT_HF_LAYERS,
        num_experts=args.num_experts, tokens=tuple(tokens),
        requests=requests_count(args.requests, where="--hf",
                                default=HFBenchConfig.requests),
        backends=tuple(backends), experts=args.experts,
        iters=args.iters if args.iters is not None else (20 if gpu else 5),
        warmup=args.warmup if args.warmup is not None else (5 if gpu else 2),
        rounds=args.rounds if args.rounds is not None else (3 if gpu else 1),
        device=device, regime=regime_label(device, p2p_disabled=p2p_disabled),
        out_dir=args.out, seed=args.seed, progress=not args.no_progress)


def main_hf(parser: argparse.ArgumentParser, args: argparse.Namespace,
            env: Mapping[str, str]) -> int:
    """Run `dbo bench --hf` with parsed `args`; returns the exit code."""
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    try:
        cfg = hf_config_from_args(args, env)
        check_out_dir("--out", cfg.out_dir)
        world = _world_size(args.world_size, cfg, env)
        cfg.model_config(world)  # the experts over the ranks, before a rank starts
    except ValueError as exc:
        parser.error(str(exc))  # one line, exit 2
    quiet_profiler_logs()
    if torchrun:
        return run_hf_rank(cfg, rank=int(env["RANK"]), world_size=world,
                           local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                           init_method="env://")
    import torch.multiprocessing as mp
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawned_rank, args=(world, f"tcp://127.0.0.1:{port}", cfg), nprocs=world,
                 join=True)
    except Exception as exc:  # noqa: BLE001 - a rank failed: its traceback is in exc
        print(f"[dbo bench] a rank failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


def _world_size(world_size: int | None, cfg: HFBenchConfig, env: Mapping[str, str]) -> int:
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size={world_size}: must be >= 1")
    if "RANK" in env and "WORLD_SIZE" in env:
        started = int(env["WORLD_SIZE"])
        if world_size is not None and world_size != started:
            raise ValueError(f"--world-size={world_size} but torchrun started {started} "
                             f"ranks: drop --world-size under torchrun")
        return started
    world = world_size if world_size is not None else 2
    if cfg.device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--world-size={world} needs {world} GPUs, "
                         f"{torch.cuda.device_count()} visible: lower it, or use torchrun")
    return world


def _spawned_rank(rank: int, world_size: int, init_method: str, cfg: HFBenchConfig) -> None:
    run_hf_rank(cfg, rank=rank, world_size=world_size, local_rank=rank,
                init_method=init_method)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's slow teardown; failures above exit normally


def run_hf_rank(cfg: HFBenchConfig, *, rank: int, world_size: int, local_rank: int,
                init_method: str) -> int:
    """One rank: init the group, measure, and (rank 0) print the table and JSON line."""
    from dbo.cli.bench.hf_report import final_line, format_table, write_outputs
    from dbo.cli.bench.hf_sweep import run_hf_sweep

    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*is deprecated\. Please use .*")
    if cfg.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank,
                                world_size=world_size, device_id=device,
                                timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // world_size)))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=5))
    try:
        result = run_hf_sweep(cfg, group=dist.group.WORLD, device=device)
        if rank == 0:
            files = write_outputs(result)
            print(format_table(result), flush=True)
            print(final_line(result, files), flush=True)
        dist.barrier()
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    return 0
