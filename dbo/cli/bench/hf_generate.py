"""`python -m dbo.cli.bench.hf_generate`: the time per new token of `moe.hf.generate` on a
converted Hugging Face model, eagerly (a `DynamicCache` per ubatch), over the static cache
(`static_cache=True`) and replayed from CUDA graphs (`cuda_graph=True`, GPUs), DBO off
and on.

    python -m dbo.cli.bench.hf_generate --hf qwen3_moe                 # CPU: 2 gloo ranks
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench.hf_generate \\
        --hf qwen3-30b-a3b --layers 4 --requests 64 --prompt 256

Each rank generates greedily for its own `--requests` random prompts of `--prompt`
tokens; the model is converted with backend a2a_ll, a capacity of requests x prompt
tokens per rank (and a ubatch's half), so decode steps exchange slots of the requests
(`moe.backends.capacity.exchange_capacity`). A mode's time per token is the steady
state: (time for N2 new tokens - time for N1) / (N2 - N1), `--new-tokens N1,N2`, the
median of `--rounds` rounds after an untimed call, slowest rank; the N2 call's whole
time (prompt, and under graphs the captures, included) is shown beside it; the JSON has
each round's (N1, N2) times. DBO on splits every step it can (thresholds of 2 tokens):
the table shows what splitting costs or gains per token, not what a gate would choose.
Tokens are compared with the eager DBO-off run's (in bfloat16 random-weight models a
different kernel may flip an argmax: the count of equal rows is shown). Prints a table
and ends with one JSON line; `--out` gets the JSON too.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dbo.cli import check_int_option, check_out_dir
from dbo.cli.bench.config import regime_label
from dbo.cli.bench.hf_config import HFBenchConfig
from dbo.cli.bench.predicted import device_name
from dbo.cli.bench.result_line import print_result
from dbo.cli.bench.timing import _sync, gather_floats
from dbo.cli.job_base import ToolJob
from dbo.cli.launch import RankContext, launch
from moe.bench.timing import barrier

MODES = ("eager", "static", "graph")


@dataclass(frozen=True, kw_only=True)
class GenerateBenchConfig(ToolJob):
    """What one run measures (`seed`: `dbo.cli.job_base.ToolJob`)."""

    arch: str
    """A name `dbo bench --hf` takes (`moe.hf.named`)."""
    layers: int = 2
    requests: int = 4
    """Prompts per rank (B)."""
    prompt: int = 8
    """Tokens per prompt (S)."""
    new_tokens: tuple[int, int] = (4, 12)
    """(N1, N2), N1 < N2: the steady time per token is the difference over N2 - N1."""
    rounds: int = 2
    out_dir: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()  # --seed
        for name in ("layers", "requests", "prompt", "rounds"):
            check_int_option(name, getattr(self, name), low=1)
        first, second = self.new_tokens
        if not (isinstance(first, int) and isinstance(second, int) and 1 <= first < second):
            raise ValueError(f"--new-tokens={first},{second}: give N1,N2 with 1 <= N1 < N2")
        if self.out_dir is not None:
            check_out_dir("--out", self.out_dir)


def run_rank(ctx: RankContext, cfg: GenerateBenchConfig) -> Optional[dict[str, Any]]:
    """Every mode on this rank; rank 0 returns the result (the times: slowest rank)."""
    import dbo
    import moe.hf
    from dbo.cli.bench.hf_sweep import build_model
    from moe.backends import DEFAULT_GRAPH_BACKEND as backend  # capturable, a ubatch capacity
    cuda = ctx.device.type == "cuda"
    bench = HFBenchConfig(arch=cfg.arch, layers=cfg.layers, device=ctx.device.type,
                          regime=regime_label(ctx.device.type, p2p_disabled=os.environ.get(
                              "NCCL_P2P_DISABLE") == "1"), backends=(backend,),
                          seed=cfg.seed, progress=False)
    config = bench.model_config(ctx.world_size)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(bench, config, device=ctx.device, dtype=dtype)
    tokens = cfg.requests * cfg.prompt
    model = moe.hf.convert(model, group=ctx.group, backend=backend,
                           max_tokens_per_rank=tokens,
                           max_tokens_per_ubatch=moe.hf.ubatch_capacity(cfg.requests,
                                                                        cfg.prompt))
    gen = torch.Generator().manual_seed(cfg.seed * 7 + 1000 * ctx.rank + 1)
    ids = torch.randint(0, config.vocab_size, (cfg.requests, cfg.prompt), generator=gen)
    ids = ids.to(ctx.device)
    rows, reference = [], None
    for dbo_on in (False, True):
        runner = dbo.DBORunner(model, dbo.DBOConfig(enabled=dbo_on, min_prefill_tokens=2,
                                                    min_decode_tokens=2), group=ctx.group)
        for mode in MODES:
            if mode == "graph" and not cuda:
                rows.append({"mode": mode, "dbo": dbo_on, "skipped": "CUDA graphs need GPUs"})
                continue
            kwargs = {"static_cache": mode == "static", "cuda_graph": mode == "graph"}
            per_token, whole, rounds_ms = [], 0.0, []
            # Untimed first, at N2: compiles, autotunes, initialises the communicators,
            # and meets every cache length (attention plans are made per length).
            _timed_generate(runner, ids, cfg.new_tokens[1], kwargs, ctx)
            for _ in range(cfg.rounds):
                times = {}
                for count in cfg.new_tokens:
                    times[count], out = _timed_generate(runner, ids, count, kwargs, ctx)
                first, second = cfg.new_tokens
                # The slowest rank's times: the step waits for it.
                slow = {n: max(gather_floats(t, ctx.group)) for n, t in times.items()}
                per_token.append((slow[second] - slow[first]) / (second - first))
                whole = slow[second]
                rounds_ms.append([slow[first], slow[second]])
            if reference is None:
                reference = out
            same_shape = out.shape == reference.shape
            equal = int((out == reference).all(dim=1).sum()) if same_shape else 0
            rows.append({"mode": mode, "dbo": dbo_on,
                         "ms_per_token": statistics.median(per_token),
                         "ms_whole": whole, "rounds_ms": rounds_ms,
                         "rows_equal_eager": int(min(gather_floats(float(equal), ctx.group))),
                         "split": bool(runner.last_decision and runner.last_decision.split)})
    if not ctx.is_main:
        return None
    return {"bench": "hf_generate", "config": dataclasses.asdict(cfg),
            "world_size": ctx.world_size, "device": device_name(ctx.device),
            "regime": bench.regime, "dtype": str(dtype).removeprefix("torch."), "rows": rows}


def _timed_generate(runner: Any, ids: torch.Tensor, count: int, kwargs: dict[str, Any],
                    ctx: RankContext) -> tuple[float, torch.Tensor]:
    """(ms, tokens) of one `moe.hf.generate` call, from an idle device with the ranks
    aligned (`moe.bench.timing.barrier`) to its tokens on the host side."""
    import moe.hf
    _sync(ctx.device)
    barrier(ctx.group, ctx.device)
    start = time.perf_counter()
    out = moe.hf.generate(runner, ids, max_new_tokens=count, **kwargs)
    _sync(ctx.device)
    return (time.perf_counter() - start) * 1e3, out


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    first, second = cfg["new_tokens"]
    lines = [f"moe.hf.generate: {cfg['arch']} layers={cfg['layers']} "
             f"world={result['world_size']} {result['regime']} {result['dtype']} on "
             f"{result['device']}; {cfg['requests']} prompts x {cfg['prompt']} tokens per "
             f"rank, a2a_ll",
             f"  ms/token: steady, ({second} - {first} new tokens); ms whole: {second} new "
             f"tokens, prompt (and captures) included; slowest rank, median of "
             f"{cfg['rounds']} rounds",
             f"{'mode':8s} {'DBO':4s} {'ms/token':>9s} {'ms whole':>9s} {'split':>6s} "
             f"{'rows = eager off':>16s}"]
    for row in result["rows"]:
        if "skipped" in row:
            lines.append(f"{row['mode']:8s} {'on' if row['dbo'] else 'off':4s} "
                         f"{'-':>9s} {'-':>9s} {'-':>6s} {'-':>16s}  ({row['skipped']})")
            continue
        # The steady time is a difference of two timings: where noise exceeds the extra
        # tokens' time it is not positive, and says only that N2 - N1 is too small.
        noisy = "" if row["ms_per_token"] > 0 else "  (noise: raise N2 - N1 or --rounds)"
        lines.append(f"{row['mode']:8s} {'on' if row['dbo'] else 'off':4s} "
                     f"{row['ms_per_token']:9.2f} {row['ms_whole']:9.1f} "
                     f"{str(row['split']):>6s} {row['rows_equal_eager']:>8d} of "
                     f"{cfg['requests']:<5d}{noisy}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dbo.cli.bench.hf_generate",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", dest="arch", required=True,
                        help="architecture (qwen3-30b-a3b, deepseek-v3, or a tiny one)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="prompts per rank")
    parser.add_argument("--prompt", type=int, default=8, help="tokens per prompt")
    parser.add_argument("--new-tokens", default="4,12", help="N1,N2 (default: 4,12)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write hf_generate.json here")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to spawn when not under torchrun (default: 2 on CPU)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        counts = tuple(int(v) for v in args.new_tokens.split(","))
        if len(counts) != 2:
            raise ValueError
    except ValueError:
        parser.error(f"--new-tokens={args.new_tokens}: give N1,N2, e.g. 8,40")
    try:
        cfg = GenerateBenchConfig(arch=args.arch, layers=args.layers, requests=args.requests,
                                  prompt=args.prompt, new_tokens=counts, rounds=args.rounds,
                                  seed=args.seed, out_dir=args.out)
        HFBenchConfig(arch=cfg.arch, layers=cfg.layers)  # the architecture's name
    except ValueError as exc:
        parser.error(str(exc))
    result = launch(run_rank, cfg, world_size=args.world_size)
    if result is None:  # not rank 0 under torchrun
        return 0
    print_result(format_table(result), result, out_dir=cfg.out_dir, file_name="hf_generate.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
