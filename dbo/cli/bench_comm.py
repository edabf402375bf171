"""`dbo bench-comm`: dispatch + combine latency, bandwidth, host time and SMs of every
MoE backend and of DeepEP's raw calls, over tokens per rank (`moe.bench.comm`).

    torchrun --nproc_per_node=2 -m dbo.cli.bench_comm                 # GPU, DeepSeek-V3 shapes
    torchrun --nproc_per_node=2 -m dbo.cli.bench_comm --backends a2a,deepep_ht,deepep_raw_ht
    dbo bench-comm --hidden 64 --num-experts 8 --top-k 2 --tokens 1,16   # CPU: 2 gloo ranks
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench_comm --backends a2a,a2a_ll
    torchrun --nproc_per_node=2 -m dbo.cli.bench_comm --cuda-graph --tokens 1,128 \
        --backends a2a_ll,symm_mem                                      # GPU, graphed

Without torchrun it starts one rank per visible GPU (NCCL), or 2 gloo ranks on a CPU
machine. Backends: every registered multi-rank one (a2a, a2a_ll, naive, naive_mono,
deepep_*, symm_mem, nccl_ep) and the libraries' raw calls: DeepEP's `deepep_raw_ht`
(normal kernels) and `deepep_raw_ll` (low-latency kernels, T <= 256), DeepEP v2's
`deepep_v2_raw_prefill` and `deepep_v2_raw_decode`, NCCL EP's `nccl_ep_raw_ll` and
`nccl_ep_raw_ht`. A backend takes its options as
`NAME:FIELD=VALUE` (`--backends nccl_ep,nccl_ep:mode=ht`). Without --backends, one
that cannot be built or run here is skipped with a one-line reason; one named in
--backends is refused before any rank starts. NCCL_P2P_DISABLE=1 slows NCCL only
(DeepEP and NVSHMEM do not go through NCCL): the regime label says which was set.
Progress lines on stderr; a table, then one JSON line on stdout; CSV, JSON and PNG under
--out.

`--cuda-graph` (GPU only) times `--graph-layers` dispatch + combine pairs replayed from one
CUDA graph instead of eager calls (`moe.bench.comm_timing`): the device time per pair
without per-call launch cost, and the host time per layer (one replay call / N).
Engines that cannot be captured (a2a, deepep_ht and deepep_raw_ht read counts on the
host) are skipped with the reason; outputs carry `cuda_graph: true` and end in `_graphs`.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from dbo.cli import (Parser, check_backend_runs, check_fits_memory, check_out_dir,
                     check_seed, quiet_profiler_logs)
from dbo.cli.launch import RankContext, launch, resolve_world_size

EXAMPLES = """\
examples:
  torchrun --nproc_per_node=2 -m dbo.cli.bench_comm
  torchrun --nproc_per_node=2 -m dbo.cli.bench_comm --tokens 128,4096 --backends deepep_ll,deepep_raw_ll
  dbo bench-comm --hidden 64 --num-experts 8 --top-k 2 --tokens 1,16 --iters 3   # CPU
  torchrun --nproc_per_node=2 -m dbo.cli.bench_comm --cuda-graph --tokens 128 --backends a2a_ll,symm_mem
"""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,128,4096, got {text!r}")


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.replace(",", " ").split() if v)


def build_parser() -> argparse.ArgumentParser:
    from moe.bench.comm import DEFAULT_TOKENS, CommBenchConfig
    from moe.bench.comm_engines import bench_names
    from moe.bench.comm_metrics import ROUTINGS

    d = CommBenchConfig()
    p = Parser("dbo bench-comm", epilog=EXAMPLES,
               description="Times the dispatch + combine of every backend alone, over tokens per\n"
                           "rank: latency (CUDA events), algorithmic bandwidth (DeepEP's\n"
                           "definition), host time per call and the SMs of the comm kernels.\n"
                           "Prints a table, writes CSV/JSON/PNG, ends with one JSON line.")
    p.add_argument("--tokens", type=_int_list, default=None,
                   help="tokens per rank of each point, comma list "
                        f"(default {','.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--backends", type=_name_list, default=None,
                   help=f"comma list of {', '.join(bench_names())} (default: all); a "
                        f"backend may take its options as NAME:FIELD=VALUE, e.g. "
                        f"nccl_ep:mode=ht")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size H")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    p.add_argument("--num-experts", type=int, default=d.num_experts,
                   help="routed experts over all ranks (a multiple of the ranks)")
    p.add_argument("--iters", type=int, default=d.iters, help="timed calls per point")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="untimed calls per point (with --cuda-graph: untimed replays)")
    p.add_argument("--routing", default=d.routing, choices=ROUTINGS,
                   help="random: top-k of random scores (as DeepEP's tests); balanced: "
                        "every expert and rank gets the same share")
    p.add_argument("--seed", type=int, default=d.seed, help="tokens and routing")
    p.add_argument("--out", default=d.out_dir, help="output folder")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU only: time --graph-layers dispatch+combine pairs replayed from "
                        "one CUDA graph (device time per pair without launch cost, host "
                        "time per layer = one replay call / N); engines that cannot be "
                        "captured are skipped with the reason")
    p.add_argument("--graph-layers", type=int, default=None,
                   help=f"dispatch+combine pairs per graph, with --cuda-graph (default "
                        f"{d.graph_layers})")
    return p


def config_from_args(args: argparse.Namespace) -> "CommBenchConfig":  # noqa: F821
    """A validated config (ValueError with the fix on bad input)."""
    import torch

    from dbo.cli.bench.config import regime_label
    from moe.bench.comm import DEFAULT_TOKENS, CommBenchConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p2p_disabled = os.environ.get("NCCL_P2P_DISABLE", "").strip() not in ("", "0")
    regime = regime_label(device, p2p_disabled=p2p_disabled)
    if p2p_disabled and device == "cuda":
        regime += "; DeepEP/NVSHMEM unaffected"
    check_seed(args.seed)
    if args.graph_layers is not None and not args.cuda_graph:
        raise ValueError(f"--graph-layers {args.graph_layers} does nothing without "
                         f"--cuda-graph: add --cuda-graph, or drop --graph-layers")
    graph_layers = {} if args.graph_layers is None else {"graph_layers": args.graph_layers}
    cfg = CommBenchConfig(
        tokens=tuple(args.tokens) if args.tokens is not None else DEFAULT_TOKENS,
        backends=tuple(args.backends or ()), hidden=args.hidden, top_k=args.top_k,
        num_experts=args.num_experts, iters=args.iters, warmup=args.warmup,
        routing=args.routing, seed=args.seed, regime=regime, out_dir=args.out,
        plot=not args.no_plot, cuda_graph=args.cuda_graph, **graph_layers)
    cfg.check_device(torch.device(device))
    return cfg


def check_named_backends(names: Sequence[str], world_size: int) -> None:
    """Refuse, in one line, a backend named in --backends that this benchmark does not
    time (`moe.bench.comm_engines.check_timed`) or that cannot run here (a missing
    library, no CUDA, a group size it does not take): the MoE backends through
    `dbo.cli.check_backend_runs`, DeepEP's and NCCL EP's raw calls through their
    backends' checks. An entry may carry the backend's options (`nccl_ep:mode=ht`).
    Without --backends every one is tried, and one that cannot run is skipped with the
    reason."""
    from moe.backends import backend_class, require_deep_ep
    from moe.bench.comm_engines import (RAW_DEEPEP, RAW_DEEPEP_V2, RAW_NCCL_EP, check_timed,
                                        parse_spec)

    for spec in names:
        name, _ = parse_spec(spec)
        if name in RAW_DEEPEP:
            require_deep_ep(name, "Buffer")
        elif name in RAW_DEEPEP_V2:
            from moe.backends import require_elastic_buffer
            require_elastic_buffer()
        elif name in RAW_NCCL_EP:
            from moe.backends import require_nccl_ep
            require_nccl_ep()
        else:
            check_timed(backend_class(name, world_size))
            check_backend_runs(name, world_size)


def _rank(ctx: RankContext, cfg: "CommBenchConfig") -> object:  # noqa: F821
    from moe.bench.comm import run_comm_sweep

    # torch deprecates the *_tensor collectives the backends call; not this tool's business.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*is deprecated\. Please use .*")
    return run_comm_sweep(cfg, group=ctx.group, device=ctx.device)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        cfg = config_from_args(args)
        check_out_dir("--out", cfg.out_dir)
        world_size = resolve_world_size(None)
        cfg.check_world(world_size)
        check_named_backends(cfg.backends, world_size)
        # A lower bound: each token's row [H] and the top-k rows it becomes, in bf16.
        check_fits_memory("--tokens", max(cfg.tokens), unit="token",
                          per_unit_bytes=(1 + cfg.top_k) * cfg.hidden * cfg.dtype.itemsize,
                          model=f"the exchange of --hidden {cfg.hidden} --top-k {cfg.top_k}",
                          shape_fix="use a smaller --hidden or --top-k", world_size=world_size)
    except (ImportError, ValueError) as exc:
        parser.error(str(exc))  # one line, exit 2, before any rank starts
    quiet_profiler_logs()  # the SM count reads torch.profiler's kernel events
    result = launch(_rank, cfg)
    if result is None:  # a torchrun rank other than 0
        return 0
    from moe.bench.comm_report import final_line, format_table, write_outputs

    files = write_outputs(result)
    print(format_table(result), flush=True)
    print(final_line(result, files), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
