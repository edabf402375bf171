"""Compiling the fused-MoE tuner's candidate tiles ahead of timing, in fresh worker
processes (`python -m moe.bench.tune --workers N`): the compiles run in parallel and
fill Triton's cache, so the timing loop only loads them."""
from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch


def warmup_spec(launch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A picklable stand-in of a launch: tensors become their dtypes (Triton's warmup
    treats a dtype as an aligned tensor), integers stay (they pick the specialisation)."""
    args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in launch.args)
    return args, dict(launch.flags)


def compile_one(job: tuple[tuple[Any, ...], dict[str, Any], dict[str, int]]) -> str | None:
    """Worker: compile one candidate into Triton's cache; the error text if it fails."""
    args, flags, meta = job
    try:
        from moe.kernels.fused_moe import fused_moe_kernel

        fused_moe_kernel.warmup(*args, grid=(1,), **flags, **meta)
    except Exception as exc:  # a tile the compiler rejects is reported, not fatal
        return f"{meta}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def precompile(jobs: list[tuple[Any, ...]], workers: int) -> list[str]:
    """Compile candidates in `workers` fresh processes; returns the failures."""
    if workers <= 0 or not jobs:
        return []
    unique = list({repr(job): job for job in jobs}.values())
    print(f"compiling {len(unique)} candidates in {workers} processes ...", file=sys.stderr,
          flush=True)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return [err for err in pool.map(compile_one, unique) if err]
