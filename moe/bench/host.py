"""Host (CPU) time of the Triton expert path per call: what a DBO step waits for where
the GPU has run out of queued work.

    python -m moe.bench.host                                  # ds-e32, one of 2 EP ranks, 2048 tokens
    python -m moe.bench.host --shape qwen-e128 --tokens 256 --ep-ranks 1
    TRITON_INTERPRET=1 python -m moe.bench.host --device cpu --shape tiny --tokens 16 --reps 3
                                                              # CPU smoke run

For one routed input (`moe.bench.experts.random_tokens`: T tokens received by one rank of
`--ep-ranks`), the wall time from call to return of each step, with the GPU idle before
every call (a synchronize, outside the timed span) so that no launch waits for a full
queue: `fused_moe` whole, the align step (three launches), one GEMM launch, and the
k-sum launch, each with the compiled-handle launches of `moe.kernels.launch` on ("fast")
and off ("triton", Triton's own `kernel[grid](...)` and autotuner). Medians over `--reps`
calls after a warmup that compiles and autotunes. The two modes alternate, step by step,
in `--rounds` rounds, and each figure is the median of its rounds: host time on the GPU
machines moved 2x between back-to-back runs (BENCHMARKS.md section 2), so the
two modes must see the same host load. Progress on stderr, a table on stdout, then one
JSON line (`host_us`, and each round's figures in `rounds_us`). Without CUDA it exits 2
(unless --device cpu).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from moe.bench.problems import SHAPES, random_tokens, random_weights

STEPS = ("fused_moe", "align", "gemm2_launch", "ksum_launch")
MODES = ("fast", "triton")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m moe.bench.host", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="ds-e32", choices=sorted(SHAPES),
                        help="expert shape of moe.bench.experts (default ds-e32)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="tokens this rank received (default 2048: one DBO ubatch of 4096)")
    parser.add_argument("--ep-ranks", type=int, default=2,
                        help="EP ranks: ids of the other ranks' experts are -1 (default 2)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per step (default 50)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of both modes; median of rounds (default 3)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.reps < 1 or args.ep_ranks < 1 or args.rounds < 1:
        parser.error("--tokens, --reps, --rounds and --ep-ranks must be >= 1")
    return args


def host_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median host microseconds of `fn`, the device idle before each call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e6 * statistics.median(times)


def measure(args: argparse.Namespace, device: torch.device
            ) -> dict[str, dict[str, list[float]]]:
    """{"fast" | "triton": {step: [median us of each round]}}."""
    from moe import Workspace
    from moe.kernels import KernelPolicy
    from moe.kernels.fused_moe import (align_routing_triton, choose_block_m, fused_moe,
                                       gemm_tiles, kernel_launch, launch_gemm, prefer_tma,
                                       sum_routed_rows, tma_unsupported_reason)

    _, inter, top_k, num_experts = SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gen = torch.Generator(device=device).manual_seed(args.seed)
    w13, w2 = random_weights(args.shape, dtype, gen)
    x, weights, ids = random_tokens(args.shape, args.tokens, dtype, gen, args.ep_ranks)
    ws = Workspace()
    fused_moe(x, w13, w2, ids, weights, workspace=ws)  # compile and autotune
    block_m = choose_block_m(ids.numel(), num_experts)
    routing = align_routing_triton(ids, num_experts, block_m, workspace=ws)
    max_rows = routing.sorted_ids_P.numel()
    act = torch.zeros(max_rows, inter, dtype=dtype, device=device)
    y = torch.empty(ids.numel(), x.shape[1], dtype=dtype, device=device)
    out = torch.empty_like(x)
    tiles = gemm_tiles(block_m, gated=False, rows_per_expert=ids.numel() / num_experts)
    tma = device.type == "cuda" and tma_unsupported_reason(w13, w2, x) is None
    gemm2 = kernel_launch(act, w2, y, weights, routing, n=x.shape[1], k=inter,
                          a_rows_div=1, a_sorted=True, tma=tma and prefer_tma(inter),
                          tiles=tiles)

    def steps(compiled: bool) -> dict[str, Callable[[], object]]:
        policy = KernelPolicy(compiled_launches=compiled)
        return {
            "fused_moe": lambda: fused_moe(x, w13, w2, ids, weights, workspace=ws,
                                           policy=policy),
            "align": lambda: align_routing_triton(ids, num_experts, block_m, workspace=ws,
                                                  compiled=compiled),
            "gemm2_launch": lambda: launch_gemm(gemm2, compiled=compiled),
            "ksum_launch": lambda: sum_routed_rows(y, ids, out, compiled=compiled),
        }

    calls = {mode: steps(mode == "fast") for mode in MODES}
    results: dict[str, dict[str, list[float]]] = {
        mode: {step: [] for step in STEPS} for mode in MODES}
    for index in range(args.rounds):
        for step in STEPS:
            for mode in MODES:
                us = host_us(calls[mode][step], device, args.reps)
                results[mode][step].append(us)
                print(f"round {index + 1}/{args.rounds} {mode:6s} {step:13s} {us:8.1f} us",
                      file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("moe.bench.host: no CUDA device (use --device cpu under TRITON_INTERPRET=1 "
              "for a smoke run)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    rounds = measure(args, device)
    medians = {mode: {step: statistics.median(us) for step, us in steps.items()}
               for mode, steps in rounds.items()}
    print(f"host time per call, {args.shape}, T={args.tokens} received of {args.ep_ranks} "
          f"EP ranks, median of {args.reps} calls, median of {args.rounds} alternating "
          f"rounds (us)")
    print(f"{'step':14s} {'fast':>9s} {'triton':>9s} {'saved':>9s}  fast, per round")
    for step in STEPS:
        fast, slow = medians["fast"][step], medians["triton"][step]
        spread = " ".join(f"{us:.1f}" for us in rounds["fast"][step])
        print(f"{step:14s} {fast:9.1f} {slow:9.1f} {slow - fast:9.1f}  {spread}")
    print(json.dumps({"shape": args.shape, "tokens": args.tokens, "ep_ranks": args.ep_ranks,
                      "reps": args.reps, "rounds": args.rounds,
                      "device": torch.cuda.get_device_name(device)
                      if device.type == "cuda" else "cpu", "host_us": medians,
                      "rounds_us": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
