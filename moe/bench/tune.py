"""Sweep the fused-MoE kernel's tiles on one GPU: which tile and BLOCK_M is fastest where.

    python -m moe.bench.tune --shapes ds-e32 --tokens 2048,4096          # ~1 min on an H100
    python -m moe.bench.tune --shapes qwen-e128 --tokens 4096 --block-m 32,64,128 --out tune/
    python -m moe.bench.tune --shapes ds-e32 --tokens 16384 --block-m 128 --block-k 64 \
        --variants ptr,tma,sorted                                         # compare load paths
    python -m moe.bench.tune --dry-run                                   # list tiles; no GPU

For each shape (`moe.bench.experts.SHAPES`) and token count, with uniform random top-k
routing and bf16 data: for each BLOCK_M (rows per expert block) and each load variant,
every candidate tile of GEMM1 (x @ w13, SiLU-gated) and of GEMM2 (act @ w2,
routing-weighted) is launched on its own and timed with CUDA events (median); the best
tile of each is then tried with other GROUP_M values. Load variants (`--variants`):

    ptr     pointer loads everywhere (GEMM1 gathers x rows by routed id)
    tma     weight tiles (and GEMM2's sorted activation) by TMA; GEMM1 still gathers x
    sorted  x is first gathered into the sorted order (timed as "gather"), then all TMA

Beside them: the align step, the k-sum, the shipped (autotuned) `fused_moe`, and dense
`torch.matmul` GEMMs of the same sizes. Candidates compile first in
worker processes (Triton's on-disk cache then serves this one). Per point a table of the
fastest tiles, and at the end one JSON line with every timing.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from moe.bench.args import split_ints, split_names, split_tokens
from moe.bench.precompile import precompile, warmup_spec
from moe.bench.problems import SHAPES, random_tokens, random_weights
from moe.bench.timing import event_times

# Tile space: BLOCK_N, BLOCK_K, num_warps, num_stages (GROUP_M 8, varied for the winner).
BLOCK_NS = (64, 128, 256)
BLOCK_KS = (64, 128)
WARPS = (4, 8)
STAGES = (3, 4, 5)
GROUP_MS = (1, 4, 8, 16, 32)
DEFAULT_GROUP_M = 8
GEMMS = ("gemm1", "gemm2")
VARIANTS = ("ptr", "tma", "sorted")


@dataclass(frozen=True)
class Tile:
    """One launch configuration of `fused_moe_kernel` (BLOCK_M comes from the routing)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def meta(self) -> dict[str, int]:
        return {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        return (f"N{self.block_n} K{self.block_k} G{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}")


@dataclass(frozen=True)
class Timing:
    """One timed launch (or step) at one point."""

    shape: str
    tokens: int
    what: str  # gemm1:<variant> / gemm2:<variant> / align / gather / sum / fused_moe / dense*
    block_m: int | None
    tile: str | None
    ms: float
    tflops: float | None


def candidate_tiles(
    block_m: int, *, gated: bool, n: int, k: int, elem_bytes: int = 2,
    block_ks: tuple[int, ...] = BLOCK_KS,
) -> list[Tile]:
    """The tile space less what does not fit (`moe.kernels.fused_moe.tiles.tile_fits`)."""
    from moe.kernels.fused_moe import tile_fits

    return [
        Tile(block_n, block_k, DEFAULT_GROUP_M, warps, stages)
        for block_n, block_k, warps, stages in itertools.product(BLOCK_NS, block_ks, WARPS, STAGES)
        if tile_fits(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps,
                     num_stages=stages, gated=gated, elem_bytes=elem_bytes, n=n, k=k)
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m moe.bench.tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--shapes", default="ds-e32", help=f"comma list of {', '.join(SHAPES)}")
    add("--tokens", default="2048,4096", help="comma list of tokens per rank")
    add("--block-m", default="64,128", help="comma list of BLOCK_M (powers of two, >= 16)")
    add("--block-k", default=",".join(map(str, BLOCK_KS)), help="comma list of BLOCK_K to sweep")
    add("--variants", default="tma,sorted", help=f"comma list of {', '.join(VARIANTS)}")
    add("--top", type=int, default=5, help="tiles shown per GEMM and BLOCK_M")
    add("--reps", type=int, default=10, help="timed launches per candidate")
    add("--workers", type=int, default=min(16, os.cpu_count() or 1),
        help="processes that compile candidates ahead (0: compile on first launch)")
    add("--out", type=Path, default=None, help="also write tune.json / tune.txt here")
    add("--dry-run", action="store_true", help="print the candidate tiles and exit")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.shapes = split_names(args.shapes, SHAPES, "--shapes")
    args.tokens = split_tokens(parser, args.tokens)
    args.variants = split_names(args.variants, VARIANTS, "--variants")
    for flag in ("block_m", "block_k"):
        values = split_ints(parser, getattr(args, flag), "--" + flag.replace("_", "-"),
                            example="64,128", valid=lambda b: b >= 16 and not b & (b - 1),
                            need="powers of two >= 16")
        setattr(args, flag, values)
    args.block_k = tuple(args.block_k)
    return args


@dataclass
class Point:
    """The inputs and scratch buffers of one (shape, tokens)."""

    shape: str
    x_NH: torch.Tensor
    w13_EIH: torch.Tensor
    w2_EHI: torch.Tensor
    topk_ids_NK: torch.Tensor
    topk_weights_NK: torch.Tensor
    y_RH: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.x_NH.shape[0]

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(H, I, K, E)."""
        return SHAPES[self.shape]

    def gemm_flops(self, gemm: str) -> float:
        hidden, inter, top_k, _ = self.dims
        rows = self.tokens * top_k
        return 2.0 * rows * hidden * inter * (2 if gemm.startswith(("gemm1", "dense1")) else 1)


def make_point(shape: str, tokens: int, weights: tuple[torch.Tensor, torch.Tensor],
               gen: torch.Generator) -> Point:
    hidden, inter, top_k, _ = SHAPES[shape]
    w13, w2 = weights
    device, dtype = w13.device, w13.dtype
    x, topk_weights, topk_ids = random_tokens(shape, tokens, dtype, gen)
    rows = tokens * top_k
    return Point(
        shape=shape, x_NH=x, w13_EIH=w13, w2_EHI=w2, topk_ids_NK=topk_ids,
        topk_weights_NK=topk_weights,
        y_RH=torch.empty(rows, hidden, dtype=dtype, device=device),
    )


def launches(point: Point, block_m: int, variants: list[str]) -> dict[str, Any]:
    """The GEMM launches (`KernelLaunch`) of `point` with rows aligned to `block_m`, keyed
    "gemm1:<variant>" and "gemm2:<ptr|tma>" (GEMM2 always reads the sorted activation),
    plus "gather": the call that fills the sorted x of the "sorted" variant."""
    from moe.kernels.fused_moe import align_routing_triton as align_routing
    from moe.kernels.fused_moe import gather_rows, kernel_launch

    hidden, inter, top_k, num_experts = point.dims
    routing = align_routing(point.topk_ids_NK, num_experts, block_m)
    max_rows = routing.sorted_ids_P.numel()
    act_PI = point.x_NH.new_empty(max_rows, inter)
    out: dict[str, Any] = {}
    for variant in variants:
        tma, a_x = variant != "ptr", point.x_NH
        if variant == "sorted":
            a_x = point.x_NH.new_empty(max_rows, hidden)
            # Filled where tune_point times it, before any GEMM reads it.
            out["gather"] = functools.partial(gather_rows, point.x_NH, a_x, routing,
                                              rows_div=top_k)
        out[f"gemm1:{variant}"] = kernel_launch(
            a_x, point.w13_EIH, act_PI, None, routing, n=inter, k=hidden, a_rows_div=top_k,
            a_sorted=variant == "sorted", tma=tma)
        out[f"gemm2:{'tma' if tma else 'ptr'}"] = kernel_launch(
            act_PI, point.w2_EHI, point.y_RH, point.topk_weights_NK, routing, n=hidden, k=inter,
            a_rows_div=1, a_sorted=True, tma=tma)
    return out


def gemm_launches(launches_: dict[str, Any]) -> dict[str, Any]:
    """The `KernelLaunch`es of `launches`' result (without "gather")."""
    return {what: launch for what, launch in launches_.items() if what.startswith("gemm")}


def time_launch(launch: Any, tile: Tile, reps: int) -> float:
    """Median ms of one tile after a first (compiling) launch."""
    from moe.kernels.fused_moe import fused_moe_kernel, use_tma_scratch

    grid = launch.grid(tile.block_n)
    use_tma_scratch()

    def fn() -> None:
        fused_moe_kernel[grid](*launch.args, **launch.flags, **tile.meta())

    return time_fn(fn, launch.args[0].device, reps)


def time_fn(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median ms of `fn` over `reps` CUDA-event-timed calls, after a first call."""
    fn()
    return statistics.median(event_times(fn, device, reps))


def tune_point(point: Point, args: argparse.Namespace) -> list[Timing]:
    """Every candidate of both GEMMs at each BLOCK_M, then GROUP_M for the winners."""
    from moe.kernels.fused_moe import align_routing_triton as align_routing
    from moe.kernels.fused_moe import fused_moe, sum_routed_rows

    hidden, inter, top_k, num_experts = point.dims
    device = point.x_NH.device
    out: list[Timing] = []

    def record(what: str, block_m: int | None, tile: object, ms: float,
               flops: float | None = None) -> Timing:
        timing = Timing(point.shape, point.tokens, what, block_m,
                        None if tile is None else str(tile), ms,
                        None if flops is None else flops / ms / 1e9)
        out.append(timing)
        return timing

    # Dense GEMMs of the same sizes (one expert's weights), the k-sum, the shipped path.
    a_RH = point.x_NH.repeat_interleave(top_k, dim=0)
    w1_t, w2_t = point.w13_EIH[0].t(), point.w2_EHI[0].t()
    record("dense1", None, None, time_fn(lambda: a_RH @ w1_t, device, args.reps),
           point.gemm_flops("dense1"))
    act_RI = point.x_NH.new_empty(point.tokens * top_k, inter)
    record("dense2", None, None, time_fn(lambda: act_RI @ w2_t, device, args.reps),
           point.gemm_flops("dense2"))
    del a_RH, act_RI
    out_NH = point.x_NH.new_empty(point.tokens, hidden)
    record("sum", None, None, time_fn(
        lambda: sum_routed_rows(point.y_RH, point.topk_ids_NK, out_NH), device, args.reps))
    record("fused_moe", None, "autotuned", time_fn(
        lambda: fused_moe(point.x_NH, point.w13_EIH, point.w2_EHI, point.topk_ids_NK,
                          point.topk_weights_NK), device, args.reps),
        point.gemm_flops("gemm1") + point.gemm_flops("gemm2"))

    for block_m in args.block_m:
        record("align", block_m, None, time_fn(
            lambda: align_routing(point.topk_ids_NK, num_experts, block_m), device, args.reps))
        calls = launches(point, block_m, args.variants)
        if "gather" in calls:
            record("gather", block_m, None, time_fn(calls["gather"], device, args.reps))
        for what, launch in gemm_launches(calls).items():
            gemm = what.split(":")[0]
            n, k = (inter, hidden) if gemm == "gemm1" else (hidden, inter)
            tiles = candidate_tiles(block_m, gated=gemm == "gemm1", n=n, k=k,
                                    elem_bytes=point.x_NH.element_size(),
                                    block_ks=args.block_k)
            timed = _time_tiles(launch, tiles, args.reps, what)
            if not timed:
                continue
            best_ms, best = min(timed, key=lambda t: t[0])
            timed += _time_tiles(launch, [
                Tile(best.block_n, best.block_k, group_m, best.num_warps, best.num_stages)
                for group_m in GROUP_MS if group_m != best.group_m], args.reps, what)
            for ms, tile in timed:
                record(what, block_m, tile, ms, point.gemm_flops(gemm))
    return out


def _time_tiles(launch: Any, tiles: list[Tile], reps: int, what: str) -> list[tuple[float, Tile]]:
    """(ms, tile) for each tile that compiles and runs; the others are reported and skipped."""
    timed = []
    for tile in tiles:
        try:
            timed.append((time_launch(launch, tile, reps), tile))
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects is not fatal
            print(f"{what} {tile}: skipped: {type(exc).__name__}: {str(exc)[:200]}",
                  file=sys.stderr)
    return timed


def point_table(timings: list[Timing], top: int) -> str:
    """The fastest tiles per GEMM, variant and BLOCK_M, the other steps, and the best
    total of each variant."""
    by = {t.what: t for t in timings if t.what in ("dense1", "dense2", "sum", "fused_moe")}
    lines = []
    for block_m in sorted({t.block_m for t in timings if t.what.startswith("gemm")}):
        here = [t for t in timings if t.block_m == block_m]
        best: dict[str, float] = {}
        for what in sorted({t.what for t in here if t.what.startswith("gemm")}):
            rows = sorted((t for t in here if t.what == what), key=lambda t: t.ms)
            best[what] = rows[0].ms
            dense = by["dense1" if what.startswith("gemm1") else "dense2"]
            for t in rows[:top]:
                share = t.ms and dense.ms / t.ms
                lines.append(f"  BLOCK_M {block_m:>3} {what:<13} {t.tile:<22} {t.ms:8.3f} ms "
                             f"{t.tflops:6.1f} TFLOP/s  {share:6.1%} of dense")
        steps = {t.what: t.ms for t in here if t.what in ("align", "gather")}
        for variant in VARIANTS:
            gemm2 = "gemm2:ptr" if variant == "ptr" else "gemm2:tma"
            if f"gemm1:{variant}" not in best or gemm2 not in best:
                continue
            extra = steps.get("gather", 0.0) if variant == "sorted" else 0.0
            total = steps["align"] + extra + best[f"gemm1:{variant}"] + best[gemm2] + by["sum"].ms
            lines.append(f"  BLOCK_M {block_m:>3} best total, {variant}: align {steps['align']:.3f}"
                         + (f" + gather {extra:.3f}" if variant == "sorted" else "")
                         + f" + GEMMs + sum {by['sum'].ms:.3f} = {total:.3f} ms")
    dense = by["dense1"].ms + by["dense2"].ms
    shipped = by["fused_moe"]
    lines.append(f"  dense GEMMs {dense:.3f} ms; shipped fused_moe {shipped.ms:.3f} ms "
                 f"({shipped.tflops:.1f} TFLOP/s, {dense / shipped.ms:.1%} of dense)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for shape in args.shapes:
            hidden, inter, _, _ = SHAPES[shape]
            for block_m in args.block_m:
                for gemm, (n, k) in zip(GEMMS, ((inter, hidden), (hidden, inter))):
                    tiles = candidate_tiles(block_m, gated=gemm == "gemm1", n=n, k=k,
                                            block_ks=args.block_k)
                    print(f"{shape} BLOCK_M {block_m} {gemm}: {len(tiles)} tiles: "
                          + ", ".join(map(str, tiles)))
        return 0
    if not torch.cuda.is_available():
        print("error: moe.bench.tune needs a CUDA GPU (none visible to torch); "
              "--dry-run lists the candidates without one", file=sys.stderr)
        return 2

    from moe.kernels.fused_moe import autotune_configs

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    timings: list[Timing] = []
    report = []
    with torch.inference_mode():
        for shape in args.shapes:
            hidden, inter, _, _ = SHAPES[shape]
            w13, w2 = random_weights(shape, torch.bfloat16, gen)
            for tokens in args.tokens:
                point = make_point(shape, tokens, (w13, w2), gen)
                jobs = []
                for block_m in args.block_m:
                    calls = launches(point, block_m, args.variants)
                    for what, launch in gemm_launches(calls).items():
                        gated = what.startswith("gemm1")
                        n, k = (inter, hidden) if gated else (hidden, inter)
                        spec_args, flags = warmup_spec(launch)
                        for tile in candidate_tiles(block_m, gated=gated, n=n, k=k,
                                                    block_ks=args.block_k):
                            jobs.append((spec_args, flags, tile.meta()))
                        # The shipped autotune list too: the fused_moe timing tunes over it.
                        for config in autotune_configs(block_m):
                            jobs.append((spec_args, flags, {**config.kwargs,
                                         "num_warps": config.num_warps,
                                         "num_stages": config.num_stages}))
                    del calls
                for err in precompile(jobs, args.workers):
                    print(f"compile failed: {err}", file=sys.stderr)
                print(f"timing {shape} T={tokens} ...", file=sys.stderr, flush=True)
                point_timings = tune_point(point, args)
                timings += point_timings
                block = f"{shape} T={tokens}\n" + point_table(point_timings, args.top)
                report.append(block)
                print(block, flush=True)
                del point
            del w13, w2
            torch.cuda.empty_cache()

    record = {"bench": "tune_experts", "device": torch.cuda.get_device_name(device),
              "timings": [asdict(t) for t in timings]}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.txt").write_text("\n".join(report) + "\n")
        (args.out / "tune.json").write_text(json.dumps(record) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
