"""Expert-kernel throughput on one GPU: triton vs grouped vs reference, beside GEMM baselines.

    python -m moe.bench.experts                          # default sweep, ~5 min on one H100
    python -m moe.bench.experts --shapes ds-e8,qwen-e128 --tokens 64,4096 --paths triton,grouped
    python -m moe.bench.experts --out results/           # also writes experts.json, .txt, .png
    python -m moe.bench.experts --dry-run                # list the points; no GPU needed
    python -m moe.bench.experts --shapes ds-e32 --tokens 4096,8192 --ep-ranks 2
                                                         # one rank's view under EP (ids -1)
    python -m moe.bench.experts --sustain 2              # each round after 2 s of load:
                                                         # the power-capped steady state
    python -m moe.bench.experts --shapes qwen-e128 --tokens 4096 --paths triton,dense,bmm \
        --routing balanced                               # no padding: what routing costs
    TRITON_INTERPRET=1 python -m moe.bench.experts --device cpu --shapes tiny --tokens 4,16
                                                         # CPU smoke run; timings meaningless
    ncu --profile-from-start off -k regex:fused_moe --metrics dram__bytes_read.sum \
        python -m moe.bench.experts --shapes ds-e128 --tokens 4096 --paths triton \
        --rounds 1 --profile-window                      # hardware counters of one call

Each point is a shape (below) and T tokens per rank with uniform random top-k routing, bf16
activations and weights. With `--ep-ranks W` (W > 1) the routing is one rank's view under
expert parallelism over W ranks, as the dispatch hands it to the experts: top-k over W * E
experts, the ids of the other ranks' experts -1, and T the tokens this rank received
(each has at least one local expert). FLOPs and the dense chain then count the local
rows only. Per path: the median time over repeats (CUDA events, after a first call
that compiles/autotunes and a warmup per round), TFLOP/s = 2 * T * K * 3 * H * I / time, the
peak of `torch.cuda.max_memory_allocated` over one call (inputs and weights included) beside
the minimum any path needs (x, routing, weights, output, the [T*K, I] activation), and
"of dense": the path's TFLOP/s over the dense chain's at the same point. The paths of a
point are timed in `--rounds` alternating rounds (a path's time is the median of its
round medians), so clock or thermal drift during a point reaches every path alike.
`--sustain S` runs a path back to back for S seconds before each of its timed rounds: a
GPU under continuous load sits at its power limit with a lower SM clock than in a short
burst (an H200 at 700 W: 1300-1600 MHz against 1980), and a path pays for its own memory
traffic there. `SM MHz` is the median SM clock of one sample per round, taken as the
round's timed calls run (from `nvidia-smi`, `moe.bench.gpu_clocks`; rounds shorter than the
query, ~50 ms, are read just after), and `capped` how many samples found the clock held
back by the power limit. Two paths are GEMM-only baselines (`moe.bench.baselines`), not
the experts' function: `dense` is `torch.matmul` on [T*K, H] x [H, 2I] then [T*K, I] x
[I, H] with one expert's weights, the same FLOPs without routing or the weight traffic of
E experts, i.e. the GEMM ceiling; `bmm` is `torch.bmm` over the E experts with
ceil(T*K / E) rows each (its TFLOP/s count those rows), every expert's own weights, no
routing: what a perfectly balanced grouped GEMM reaches at this point's rows per expert.
`--routing balanced` gives every expert exactly T*K/E rows (token n to experts n*K .. n*K
+ K - 1, mod E): no router draws that, but beside uniform routing it says how much the
experts' uneven rows (short last blocks, padding) cost the expert paths.
`err` is triton's max |difference| against the reference (or grouped) relative to the
reference's max |value|. Progress goes to stderr, a table to stdout, then one JSON line.
With `--out`, also the table, the JSON and a plot (`experts.png`, `moe.bench.experts_plot`:
TFLOP/s and share of dense against T, one column per shape; skipped with a note where
matplotlib is missing, or with `--no-plot`). Without CUDA it exits 2 (unless --device cpu).

`--profile-window`: after a point's timed rounds, one more call of each path runs between
cudaProfilerStart and cudaProfilerStop, so that a profiler started with its capture off
(`ncu --profile-from-start off`, `nsys profile --capture-range=cudaProfilerApi`) records
that call's kernels only, not the compiling, tuning and timed calls. stderr names each
window with the point's weight and x bytes, which the expert paths must read at least once:
compare them with `dram__bytes_read.sum` (BENCHMARKS.md section 2). The
profiler slows every launch, windowed or not, so times taken under it are not the
bench's (qwen-e128 at 4096 tokens: 1.34 ms under ncu, 0.78-0.80 ms without).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from moe.bench.args import split_names, split_tokens
from moe.bench.baselines import BASELINES
from moe.bench.gpu_clocks import ClockSample, read_clocks, summarize
from moe.bench.problems import SHAPES, Problem, min_bytes, random_tokens, random_weights
from moe.bench.results import Point, attach_dense_share, attach_error, format_table
from moe.bench.timing import peak_gb, sustain, time_ms

DEFAULT_SHAPES = "ds-e8,ds-e32,ds-e128,qwen-e128"
DEFAULT_TOKENS = "64,256,1024,4096,16384"
EXPERT_PATHS = ("triton", "grouped", "reference")
PATHS = (*EXPERT_PATHS, *BASELINES)  # the expert kernels, then the GEMM-only baselines
ROUTINGS = ("uniform", "balanced")


class ReadyPath(NamedTuple):
    """A path made ready to time at one point: `factory()` gives a fresh call (with its
    own workspace); peak and minimum memory in GB; the note for its table row; its FLOPs
    where they are not the point's (the `bmm` baseline rounds rows up to whole experts)."""

    factory: Callable[[], Callable[[], object]]
    peak_gb: float | None
    min_gb: float
    note: str
    flops: float | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m moe.bench.experts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {', '.join(SHAPES)}")
    add("--tokens", default=DEFAULT_TOKENS, help="comma list of tokens per rank")
    add("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    add("--ref-max-tokens", type=int, default=4096,
        help="skip the (slow, float32) reference above this many tokens; 0 = never skip")
    add("--budget-ms", type=float, default=300.0,
        help="timed repeats per path and point aim at this, over all rounds")
    add("--rounds", type=int, default=3,
        help="time the paths of a point in this many alternating rounds (median of rounds)")
    add("--out", type=Path, default=None,
        help="also write experts.json / experts.txt / experts.png here")
    add("--no-plot", action="store_true", help="with --out: no experts.png")
    add("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: interpreter smoke run")
    add("--dry-run", action="store_true", help="print the points and exit")
    add("--sustain", type=float, default=0.0, metavar="S",
        help="run each path back to back for S seconds before each timed round (0: no)")
    add("--ep-ranks", type=int, default=1,
        help="routing as one rank of W under expert parallelism sees it (ids elsewhere -1)")
    add("--routing", default="uniform", choices=ROUTINGS,
        help="uniform: random top-k; balanced: every expert gets T*K/E rows (a diagnostic)")
    add("--profile-window", action="store_true",
        help="after a point's rounds, one call per path inside cudaProfilerStart/Stop")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.profile_window and args.device != "cuda":
        parser.error("--profile-window needs --device cuda (the CUDA profiler API)")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    if not args.sustain >= 0:  # also rejects nan
        parser.error(f"--sustain {args.sustain}: give seconds >= 0")
    if args.ep_ranks < 1:
        parser.error(f"--ep-ranks {args.ep_ranks}: give the number of EP ranks, >= 1")
    if args.routing == "balanced" and args.ep_ranks > 1:
        parser.error("--routing balanced is one rank's routing without EP: leave out "
                     "--ep-ranks (or give 1)")
    args.shapes = split_names(args.shapes, SHAPES, "--shapes")
    args.paths = split_names(args.paths, PATHS, "--paths")
    args.tokens = split_tokens(parser, args.tokens)
    return args


def bench_shape(
    name: str, args: argparse.Namespace, device: torch.device, total: int, done: list[int]
) -> list[Point]:
    """All token counts and paths of one shape (the weights are made once per shape)."""
    from moe.experts import make_experts

    hidden, inter, top_k, num_experts = SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # interpreter: no bf16 dot
    gen = torch.Generator(device=device).manual_seed(args.seed)
    w13, w2 = random_weights(name, dtype, gen)
    kernels: dict[str, object] = {}
    for path in args.paths:
        if path in EXPERT_PATHS:
            try:
                kernels[path] = make_experts(path, device)
            except (ValueError, ImportError) as exc:
                kernels[path] = exc

    points = []
    for tokens in args.tokens:
        x, topk_weights, topk_ids = random_tokens(name, tokens, dtype, gen, args.ep_ranks,
                                                  args.routing)
        local_rows = int((topk_ids >= 0).sum())
        problem = Problem(
            shape=name, x_NH=x, w13_EIH=w13, w2_EHI=w2, topk_ids_NK=topk_ids,
            topk_weights_NK=topk_weights,
            min_gb=min_bytes(tokens, hidden, inter, top_k, num_experts, x.element_size()) / 1e9,
            local_rows=local_rows,
        )
        new_points = bench_point(problem, kernels, args, device)
        for point in new_points:
            done[0] += 1
            ms = f"{point.ms:9.3f} ms" if point.ms is not None else "skipped"
            rate = f"{point.tflops:7.1f} TFLOP/s" if point.tflops is not None else ""
            line = f"[{done[0]}/{total}] {name} T={tokens} {point.path}: {ms} {rate} {point.note}"
            print(line.rstrip(), file=sys.stderr, flush=True)
        points += new_points
        del x, problem
    return points


def bench_point(problem: Problem, kernels: dict[str, object], args: argparse.Namespace,
                device: torch.device) -> list[Point]:
    """Every path at one point: each made ready (compiled, its output and peak memory
    taken) on its own, then all timed in `args.rounds` alternating rounds, so that clock
    or thermal drift reaches every path alike; a path's time is the median of its rounds."""
    outputs: dict[str, torch.Tensor] = {}  # on the CPU, so they do not count in peaks
    ready: dict[str, ReadyPath] = {}
    results: dict[str, Point] = {}
    for path in args.paths:
        try:
            made = make_path(path, kernels.get(path), problem, args, device, outputs)
        except Exception as exc:  # keep sweeping: one broken path must not hide the rest
            made = _failed(problem, path, exc, device)
        if isinstance(made, Point):
            results[path] = made
        else:
            ready[path] = made
    rounds: dict[str, list[float]] = {path: [] for path in ready}
    clocks: dict[str, list[ClockSample | None]] = {path: [] for path in ready}
    timed = {path: made.factory() for path, made in ready.items()}
    for _ in range(args.rounds):
        for path in list(ready):
            try:
                if args.sustain > 0:
                    sustain(timed[path], device, args.sustain)
                rounds[path].append(time_ms(
                    timed[path], device, args.budget_ms / args.rounds,
                    during=lambda path=path: clocks[path].append(read_clocks(device))))
            except Exception as exc:
                results[path] = _failed(problem, path, exc, device)
                del ready[path], timed[path]
    if args.profile_window:
        weight_gb = (problem.w13_EIH.nbytes + problem.w2_EHI.nbytes) / 1e9
        for path in ready:
            label = (f"{problem.shape} T={problem.tokens} {path}: weights {weight_gb:.3f} GB, "
                     f"x {problem.x_NH.nbytes / 1e9:.3f} GB")
            profile_one_call(timed[path], device, label)
    for path, made in ready.items():
        ms = statistics.median(rounds[path])
        flops = made.flops or problem.flops
        results[path] = Point(problem.shape, problem.tokens, path, ms, flops / ms / 1e9,
                              made.peak_gb, made.min_gb, note=made.note,
                              **clock_fields(clocks[path]))
    del timed
    points = [results[path] for path in args.paths]
    attach_error(points, outputs)
    return attach_dense_share(points)


def profile_one_call(fn: Callable[[], object], device: torch.device, label: str) -> None:
    """One call of `fn` between cudaProfilerStart and cudaProfilerStop (its kernels
    finished before the stop), named on stderr as `label`. Earlier work is finished
    before the start, so that nothing else lands in the window."""
    torch.cuda.synchronize(device)
    print(f"profile window: {label}", file=sys.stderr, flush=True)
    torch.cuda.profiler.start()
    try:
        fn()
        torch.cuda.synchronize(device)
    finally:
        torch.cuda.profiler.stop()


def clock_fields(samples: list[ClockSample | None]) -> dict[str, object]:
    """`sm_mhz` and `capped` of a Point from its rounds' samples (unread ones left out)."""
    return summarize(s for s in samples if s is not None) or {}


def make_path(
    path: str,
    kernel: object,
    problem: Problem,
    args: argparse.Namespace,
    device: torch.device,
    outputs: dict[str, torch.Tensor],
) -> Point | ReadyPath:
    """A skipped Point, or the path made ready to time. Here one call compiles /
    autotunes, keeps its output (on the CPU) for the error column, and takes the peak
    with only this path's buffers alive."""
    from moe import Workspace

    skipped = Point(problem.shape, problem.tokens, path, None, None, None, problem.min_gb)
    if path == "reference" and args.ref_max_tokens and problem.tokens > args.ref_max_tokens:
        return replace(skipped, note=f"skipped: T > --ref-max-tokens {args.ref_max_tokens}")
    if isinstance(kernel, Exception):
        return replace(skipped, note=f"unavailable: {kernel}")
    if path in BASELINES:
        chain = BASELINES[path](problem.x_NH, problem.w13_EIH, problem.w2_EHI,
                                rows=problem.local_rows)
        chain.fn()
        return ReadyPath(lambda: chain.fn, peak_gb(chain.fn, device), chain.min_gb, chain.note,
                         chain.flops)

    def factory() -> Callable[[], torch.Tensor]:
        workspace = Workspace()  # per call site: its buffers count in the peak

        def fn() -> torch.Tensor:
            return kernel.apply(  # type: ignore[attr-defined]
                problem.x_NH, problem.w13_EIH, problem.w2_EHI, problem.topk_ids_NK,
                problem.topk_weights_NK, workspace=workspace,
            )
        return fn

    fn = factory()
    outputs[path] = fn().cpu()
    return ReadyPath(factory, peak_gb(fn, device), problem.min_gb, "")


def _failed(problem: Problem, path: str, exc: Exception, device: torch.device) -> Point:
    traceback.print_exc(file=sys.stderr)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Point(problem.shape, problem.tokens, path, None, None, None, problem.min_gb,
                 note=f"failed: {type(exc).__name__}: {str(exc)[:120]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    points_planned = [(s, t, p) for s in args.shapes for t in args.tokens for p in args.paths]
    if args.dry_run:
        for shape, tokens, path in points_planned:
            hidden, inter, top_k, experts = SHAPES[shape]
            print(f"{shape} (H={hidden} I={inter} K={top_k} E={experts}) T={tokens} {path}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: moe.bench.experts needs a CUDA GPU (none visible to torch); for a CPU smoke "
              "run use TRITON_INTERPRET=1 ... --device cpu --shapes tiny", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    done = [0]
    points: list[Point] = []
    with torch.inference_mode():
        for shape in args.shapes:
            points += bench_shape(shape, args, device, len(points_planned), done)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    table = format_table(points)
    if args.ep_ranks > 1:
        table = (f"one rank of {args.ep_ranks} under EP: T = tokens received, FLOPs over "
                 f"local rows\n{table}")
    if args.routing == "balanced":
        table = f"balanced routing: every expert gets T*K/E rows (not a router's)\n{table}"
    on_gpu = device.type == "cuda"
    record = {
        "bench": "experts",
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": "bf16" if on_gpu else "fp16",
        "ep_ranks": args.ep_ranks,
        "routing": args.routing,
        "sustain_s": args.sustain,
        "points": [asdict(p) for p in points],
    }
    if "triton" in args.paths and device.type == "cuda":
        from moe.kernels.fused_moe import tuned_configs

        record["triton_configs"] = tuned_configs()
    print(table)
    print(json.dumps(record))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "experts.txt").write_text(table + "\n")
        (args.out / "experts.json").write_text(json.dumps(record, indent=1) + "\n")
        if not args.no_plot:
            _write_plot(points, args.out / "experts.png", record)
    return 0


def _write_plot(points: list[Point], path: Path, record: dict[str, Any]) -> None:
    """`experts.png`, or a note on stderr saying why not."""
    from moe.bench.experts_plot import plot_experts

    title = (f"expert kernels vs dense, {record['device']}, {record['dtype']}"
             + (f", one rank of {record['ep_ranks']} under EP" if record["ep_ranks"] > 1 else "")
             + (", balanced routing" if record["routing"] == "balanced" else ""))
    try:
        drawn = plot_experts(points, path, title=title)
    except ImportError as exc:
        print(f"note: no plot: {exc}", file=sys.stderr)
        return
    if not drawn:
        print("note: no plot: no point has a time", file=sys.stderr)


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    raise SystemExit(main())
