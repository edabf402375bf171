"""`python -m dbo.cli.bench.compiled`: one step of the reference MoE transformer eagerly,
compiled (`torch.compile`), replayed from a CUDA graph (`dbo.graphs.GraphedRunner`) and
compiled then replayed, DBO off and on.

    python -m dbo.cli.bench.compiled                          # CPU: 2 gloo ranks, no graphs
    torchrun --nproc_per_node=2 -m dbo.cli.bench.compiled --preset qwen3-moe-like \\
        --layers 2 --tokens 1024
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench.compiled \\
        --preset deepseek-v3-like --layers 2 --tokens 4096

Each rank runs `--requests` requests of equal length, `--tokens` in all (its own random
ids), through `MoETransformer(get_preset(--preset, num_layers=--layers))` (the preset's
dense layers first, one MoE layer at least) in bfloat16 on GPUs (float32 on CPU), backend
`--backend` (a2a_ll: the step can be captured; one rank: local) with a capacity of the
step's tokens (a ubatch's half under DBO), the default experts (triton on GPUs). DBO on splits every step (thresholds 0) between the middle
requests, so both ubatches have one shape and compile once. The modes: eager
`DBORunner(model)`; compile `DBORunner(torch.compile(model, dynamic=False))` (`--mode`,
`--compiler`: torch.compile's mode and backend); graph `GraphedRunner(DBORunner(model))`;
compile+graph `GraphedRunner(DBORunner(compiled))`. Per row: the step time (CUDA events
on GPUs; median of `--iters` after `--warmup` steps; slowest rank) and its host time
(`dbo.cli.bench.timing`), the first call's time (compiles and captures included, slowest
rank), the speedup over eager and the largest difference of the logits to eager's (over
their largest magnitude, all ranks), both with the same DBO setting, whether the step was
split, and the graphs and graph breaks dynamo made. Prints a table and ends with
one JSON line; `--out` gets the JSON too.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dbo.cli import check_int_option, check_out_dir
from dbo.cli.bench.predicted import device_name
from dbo.cli.bench.result_line import print_result
from dbo.cli.bench.timing import _sync, gather_floats, time_steps
from dbo.cli.job_base import ToolJob
from dbo.cli.launch import RankContext, launch
from moe.backends import DEFAULT_GRAPH_BACKEND
from moe.bench.timing import barrier

MODES = ("eager", "compile", "graph", "compile+graph")
# torch.compile's modes that leave CUDA graphs to dbo: "reduce-overhead" records its own
# graphs (CUDA graph trees) around each compiled piece, which a DBO step's two ubatches
# would replay interleaved; untried, so refused (the graph modes here capture the step).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True)
class CompileBenchConfig(ToolJob):
    """What one run measures (`seed`: `dbo.cli.job_base.ToolJob`)."""

    preset: str = "tiny"
    layers: int = 2
    tokens: int = 64
    """Tokens per rank in one step."""
    requests: int = 4
    """Requests per rank, of tokens / requests tokens each; even, so DBO halves them."""
    backend: str = DEFAULT_GRAPH_BACKEND
    mode: str = "default"
    compiler: str = "inductor"
    warmup: int = 3
    iters: int = 10
    out_dir: Optional[str] = None

    def __post_init__(self) -> None:
        from moe.models import PRESETS
        if self.preset not in PRESETS:
            raise ValueError(f"--preset={self.preset!r}: choose one of {sorted(PRESETS)}")
        for name in ("layers", "tokens", "requests", "iters"):
            check_int_option(name, getattr(self, name), low=1)
        check_int_option("warmup", self.warmup, low=0)
        super().__post_init__()  # --seed
        if self.requests % 2 or self.tokens % self.requests:
            raise ValueError(f"--requests={self.requests} --tokens={self.tokens}: give an "
                             f"even number of requests that divides the tokens (DBO then "
                             f"splits the step into two halves of one shape)")
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"--mode={self.mode!r}: use one of {COMPILE_MODES} (CUDA graphs "
                             f"come from the graph modes, which capture the whole step)")
        if self.out_dir is not None:
            check_out_dir("--out", self.out_dir)


def run_rank(ctx: RankContext, cfg: CompileBenchConfig) -> Optional[dict[str, Any]]:
    """Every mode on this rank; rank 0 returns the result (the times: slowest rank)."""
    from torch._dynamo.utils import counters

    from dbo import DBOConfig, DBORunner, GraphedRunner
    from moe.backends import SINGLE_RANK_BACKEND, backend_class, backend_traits
    from moe.models import MoETransformer, get_preset
    cuda = ctx.device.type == "cuda"
    backend = cfg.backend if ctx.world_size > 1 else SINGLE_RANK_BACKEND
    capacity: dict[str, Any] = {"max_tokens_per_rank": cfg.tokens}
    if backend_traits(backend).takes_ubatch_capacity:
        options_type = backend_class(backend, ctx.world_size).options_type
        capacity["backend_options"] = options_type(max_tokens_per_ubatch=cfg.tokens // 2)
    dense = min(get_preset(cfg.preset).num_dense_layers, cfg.layers - 1)  # >= 1 MoE layer
    config = get_preset(cfg.preset, num_layers=cfg.layers, num_dense_layers=dense,
                        backend=backend, dtype=torch.bfloat16 if cuda else torch.float32,
                        **capacity)
    model = MoETransformer(config, group=ctx.group, device=ctx.device)
    model.init_weights(seed=cfg.seed)
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + ctx.rank)
    ids = torch.randint(0, config.vocab_size, (cfg.tokens,), generator=gen).to(ctx.device)
    lens = [cfg.tokens // cfg.requests] * cfg.requests
    positions = torch.cat([torch.arange(n) for n in lens]).to(ctx.device)
    options = {"mode": cfg.mode} if cfg.compiler == "inductor" else {}
    compiled = torch.compile(model, dynamic=False, backend=cfg.compiler, **options)
    rows = []
    for dbo_on in (False, True):
        reference: Optional[torch.Tensor] = None  # the eager step's logits
        dbo_config = (DBOConfig(min_prefill_tokens=0, min_decode_tokens=0) if dbo_on
                      else DBOConfig(enabled=False))
        for mode in MODES:
            if "graph" in mode and not cuda:
                rows.append({"mode": mode, "dbo": dbo_on, "skipped": "CUDA graphs need GPUs"})
                continue
            runner = DBORunner(compiled if "compile" in mode else model, dbo_config,
                               group=ctx.group)
            call = GraphedRunner(runner) if "graph" in mode else runner

            def step(call: Callable[..., Any] = call) -> torch.Tensor:
                return call(ids, positions, seq_lens=lens)

            before = dict(counters["stats"]), sum(counters["graph_break"].values())
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # one rank: backend 'local' never yields
                first_s, out = _first_call(step, ctx)
                timing = time_steps(step, device=ctx.device, group=ctx.group,
                                    warmup=cfg.warmup, iters=cfg.iters)
            reference = out if reference is None else reference
            diff = (out.float() - reference.float()).abs().max().item()
            scale = reference.float().abs().max().item() or 1.0
            rows.append({"mode": mode, "dbo": dbo_on, "ms": timing.max_ms,
                         "host_ms": timing.host_max_ms, "first_s": first_s,
                         "max_rel_diff": max(gather_floats(diff / scale, ctx.group)),
                         "split": bool(runner.last_decision and runner.last_decision.split),
                         "graphs": counters["stats"].get("unique_graphs", 0)
                         - before[0].get("unique_graphs", 0),
                         "graph_breaks": sum(counters["graph_break"].values()) - before[1]})
    if not ctx.is_main:
        return None
    for row in rows:
        eager = next(r for r in rows if r["mode"] == "eager" and r["dbo"] == row["dbo"])
        if "ms" in row:
            row["speedup"] = eager["ms"] / row["ms"] if row["ms"] > 0 else None
    return {"bench": "compiled", "config": dataclasses.asdict(cfg),
            "world_size": ctx.world_size, "backend": backend, "device": device_name(ctx.device),
            "dtype": str(config.dtype).removeprefix("torch."), "rows": rows}


def _first_call(step: Callable[[], torch.Tensor], ctx: RankContext
                ) -> tuple[float, torch.Tensor]:
    """(seconds, output) of the first call (compiles and captures), slowest rank."""
    _sync(ctx.device)
    barrier(ctx.group, ctx.device)
    start = time.perf_counter()
    out = step()
    _sync(ctx.device)
    return max(gather_floats(time.perf_counter() - start, ctx.group)), out.clone()


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"{cfg['preset']} layers={cfg['layers']} world={result['world_size']} "
             f"{result['backend']} {result['dtype']} on {result['device']}; {cfg['tokens']} "
             f"tokens per rank in {cfg['requests']} requests; torch.compile "
             f"backend={cfg['compiler']} mode={cfg['mode']}",
             f"  ms: median of {cfg['iters']} steps, slowest rank; first s: the first call "
             f"(compiles, captures); vs eager, rel diff: to eager with the same DBO",
             f"{'mode':14s} {'DBO':4s} {'ms':>9s} {'host ms':>9s} {'vs eager':>8s} "
             f"{'first s':>8s} {'rel diff':>9s} {'split':>6s} {'graphs':>6s} {'breaks':>6s}"]
    for row in result["rows"]:
        head = f"{row['mode']:14s} {'on' if row['dbo'] else 'off':4s}"
        if "skipped" in row:
            lines.append(f"{head} {'-':>9s}  ({row['skipped']})")
            continue
        host = "-" if row["host_ms"] is None else f"{row['host_ms']:.3f}"
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.3f}x"
        lines.append(f"{head} {row['ms']:9.3f} {host:>9s} {speedup:>8s} "
                     f"{row['first_s']:8.2f} {row['max_rel_diff']:9.2e} "
                     f"{str(row['split']):>6s} {row['graphs']:6d} {row['graph_breaks']:6d}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dbo.cli.bench.compiled",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = CompileBenchConfig()
    parser.add_argument("--preset", default=defaults.preset, help="a moe.models preset")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="per rank")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="per rank")
    parser.add_argument("--backend", default=defaults.backend,
                        help="MoE backend with two or more ranks (default: a2a_ll)")
    parser.add_argument("--mode", default=defaults.mode, choices=COMPILE_MODES,
                        help="torch.compile mode (inductor)")
    parser.add_argument("--compiler", default=defaults.compiler,
                        help="torch.compile backend (inductor; aot_eager or eager: dynamo "
                             "without code generation)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--iters", type=int, default=defaults.iters)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=None, help="also write compiled.json here")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to spawn when not under torchrun (default: 2 on CPU)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = CompileBenchConfig(preset=args.preset, layers=args.layers, tokens=args.tokens,
                                 requests=args.requests, backend=args.backend,
                                 mode=args.mode, compiler=args.compiler, warmup=args.warmup,
                                 iters=args.iters, seed=args.seed, out_dir=args.out)
    except ValueError as exc:
        parser.error(str(exc))
    result = launch(run_rank, cfg, world_size=args.world_size)
    if result is None:  # not rank 0 under torchrun
        return 0
    print_result(format_table(result), result, out_dir=cfg.out_dir, file_name="compiled.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
