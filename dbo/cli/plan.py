"""`dbo plan`: the PREDICTED step time and gain of each overlap mode (DBO, SBO) for a
model shape on a cluster, over a sweep of tokens per rank, from the cost model
(`dbo.cost_model`) and a calibration (`dbo.calibration`; illustrative H100/H200 figures
unless `--calibration FILE`). Nothing runs on a GPU: every figure is a prediction.

    dbo plan --preset deepseek-v3-like --layers 58 --gpus-per-node 8 --ep 96 \\
        --redundant-experts 32 --inter-gbs 50 --tokens 4096 --requests 256 --out plan/

Prints per phase (prefill: --tokens, decode: --requests, one token each) a table of the
predicted step time and gain of each mode over the sweep, the smallest token count where
DBO / SBO wins by the margin, the token counts where overlap loses, writes
`plan.png` (with --out) and ends with one JSON line.

The phase times are rooflines (`dbo.cli.plan_model`); where the --calibration file holds
points `dbo bench` measured for this preset and phase, each is rescaled by measured /
roofline at the nearest measured token counts (`dbo.cli.plan_measured`), and a line
says which phases were rescaled from which points and which stayed roofline.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from dbo import MODES, Calibration, Prediction, predict
from dbo.cli import Parser, check_out_dir
from dbo.cli.plan_measured import measured_scale
from dbo.cli.plan_model import Cluster, check_expert_split, comm_time, step_inputs

DEFAULT_SWEEP = tuple(2 ** i for i in range(4, 15))  # 16 .. 16384 tokens per rank


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an int >= {low}")
        return value
    return parse


_positive_int = _int_at_least(1)


def _sweep(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        values = ()
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give tokens per rank >= 1, comma-"
                                         f"separated, e.g. 16,256,4096")
    return values


DESCRIPTION = """\
PREDICTS the step time and gain of DBO and SBO for a model shape on a cluster (GPUs per
node, EP size, links) over a sweep of tokens per rank, from dbo's cost model and a
calibration (illustrative H100/H200 figures unless --calibration FILE, e.g. the one
`dbo bench` writes). Nothing runs on a GPU: every figure is a prediction. Prints a table
per phase (prefill: --tokens; decode: --requests), where each mode starts to win, writes
plan.png with --out, and ends with one JSON line."""

EXAMPLES = """\
examples:
  dbo plan --preset deepseek-v3-like --ep 8 --tokens 4096
  dbo plan --preset deepseek-v3-like --layers 58 --gpus-per-node 8 --ep 96 \\
      --redundant-experts 32 --inter-gbs 50 --tokens 4096 --requests 256 --out plan/
  dbo plan --calibration dbo_out/bench/calibration.json --backend a2a_ll --tokens 2048
"""


def build_parser() -> Parser:
    from dbo.cli.bench.config import BENCH_BACKENDS
    from moe.models import PRESETS

    p = Parser("dbo plan", description=DESCRIPTION, epilog=EXAMPLES)
    p.add_argument("--preset", choices=list(PRESETS), default="deepseek-v3-like",
                   help="model shape")
    p.add_argument("--layers", type=_positive_int, default=None,
                   help="MoE layers in the step (default: the preset's; 58 for the full "
                        "DeepSeek-V3)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=8, help="GPUs per node")
    p.add_argument("--ep", type=_positive_int, default=8,
                   help="EP size (ranks); it must divide the experts (with --redundant-experts)")
    p.add_argument("--redundant-experts", type=_int_at_least(0), default=0, metavar="R",
                   help="extra expert replicas held over the EP group, so that an EP size "
                        "that does not divide the experts splits them evenly (DeepSeek-V3's "
                        "deployment: 32, 288 = 3 x 96)")
    for kind, regime in (("intra", "nvlink"), ("inter", "scale_out")):
        p.add_argument(f"--{kind}-gbs", type=float, default=None,
                       help=f"{kind}-node bandwidth per GPU, GB/s (default: the "
                            f"calibration's {regime!r} regime)")
        p.add_argument(f"--{kind}-latency-us", type=float, default=None,
                       help=f"{kind}-node latency per collective, us (default: the "
                            f"calibration's {regime!r} regime)")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="prefill tokens per rank (the point to report)")
    p.add_argument("--requests", type=_positive_int, default=None,
                   help="decode requests per rank, one token each (the point to report)")
    p.add_argument("--context-len", type=_positive_int, default=4096,
                   help="tokens of context per request (decode: KV cache read; prefill: "
                        "sequence length cap)")
    p.add_argument("--sweep", type=_sweep, default=DEFAULT_SWEEP,
                   help="tokens per rank to sweep, comma-separated")
    p.add_argument("--fp8-dispatch", action="store_true", help="dispatch in fp8 (+ scales)")
    p.add_argument("--launches-per-layer", type=int, default=30,
                   help="kernel launches per layer of the unsplit step (illustrative)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="steps replayed as CUDA graphs: no host launch cost")
    p.add_argument("--sbo-chunks", type=_positive_int, default=1,
                   help="combine chunks of an SBO step, each under the next chunk's "
                        "experts (A2ALLOptions.combine_chunks)")
    p.add_argument("--sbo-groups", type=_positive_int, default=1,
                   help="expert groups of an SBO step, each group's combine under the next "
                        "group's experts, each carrying all the combine's rows "
                        "(A2ALLOptions.combine_groups; not with --sbo-chunks)")
    p.add_argument("--joined-experts", action="store_true",
                   help="split steps run their experts once over both ubatches' rows "
                        "(DBOConfig.joined_experts): the split mode chosen from is "
                        "'joined', not 'dbo' (both are predicted)")
    p.add_argument("--margin", type=float, default=0.01,
                   help="an overlap mode must win by at least this (0.01 = 1%%)")
    p.add_argument("--calibration", default=None,
                   help="calibration JSON file (default: illustrative H100/H200 figures)")
    p.add_argument("--backend", default=None, choices=BENCH_BACKENDS,
                   help="use the --calibration's measured points of this MoE backend "
                        "(needed where it holds several)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder to write plan.png in (created if missing)")
    return p


def calibration_source(path: Optional[str], cal: Calibration) -> str:
    """Where the machine figures come from, printed once (a bench-written file names the
    device, torch version and date it was measured on, and its points)."""
    if path is None:
        source = "illustrative H100/H200 defaults"
    elif cal.device:
        source = (f"{path} (written by dbo bench on {cal.device}, torch {cal.torch_version}, "
                  f"{cal.date}; {len(cal.points)} measured points)")
    else:
        source = path
    print(f"calibration: {source}")
    return source


# The overlap modes whose gain over no overlap each sweep point reports.
GAINED = ("dbo", "sbo", "joined")


def _point(pred: Prediction, tokens: int) -> dict[str, Any]:
    return {"tokens": tokens, "chosen": pred.chosen, "reason": pred.reason,
            "times_ms": {m: round(t, 4) for m, t in pred.times_ms.items()},
            "gains": {m: round(pred.gain(m), 4) for m in GAINED},
            "dbo_costs_ms": {k: round(v, 4) for k, v in pred.dbo_costs_ms.items()}}


def _wins_from(mode: str, tokens: Optional[int]) -> str:
    """"DBO wins from 2048 tokens", or that it wins at no point of the sweep."""
    if tokens is None:
        return f"{mode.upper()} wins at no point of the sweep"
    return f"{mode.upper()} wins from {tokens} tokens"


def _ranges(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none in the sweep"


def plan_phase(args: Any, model: Any, cluster: Cluster, cal: Calibration, *, decode: bool,
               point: int) -> dict[str, Any]:
    """Predict every token count of the sweep and the point itself; print the table."""
    layers = args.layers or model.num_moe_layers
    kernels = 0 if args.cuda_graph else args.launches_per_layer
    scale = measured_scale(cal, model, args.preset, decode=decode, backend=args.backend,
                           context_len=args.context_len)
    # inter- and intra-node bytes both grow with the tokens: one bound for the sweep.
    _, _, regime = comm_time(model, cluster, tokens=point, bytes_per_row=1.0)

    def run(tokens: int) -> Prediction:
        times, shape = step_inputs(model, cluster, cal, tokens=tokens, decode=decode,
                                   context_len=args.context_len, layers=layers,
                                   fp8_dispatch=args.fp8_dispatch, kernels_per_layer=kernels,
                                   redundant_experts=args.redundant_experts)
        if scale is not None:
            times = scale.apply(times, tokens=tokens, comm_regime=regime)
        return predict(times, shape, cal, margin=args.margin, sbo_chunks=args.sbo_chunks,
                       sbo_groups=args.sbo_groups, joined=args.joined_experts)

    name = "decode" if decode else "prefill"
    of = "this preset and phase" + (f" of backend {args.backend}" if args.backend else "")
    rescale = (scale.describe(regime) if scale is not None else
               f"roofline only (no measured points of {of} in the calibration)")
    sweep = sorted(set(args.sweep) | {point})
    rows = [_point(run(t), t) for t in sweep]
    print(f"\nprediction, {name} ({'requests' if decode else 'tokens'} per rank), "
          f"{layers} MoE layers, EP {cluster.ep_size} on {cluster.nodes} node(s):")
    print(f"phase times: {rescale}")
    print(f"sbo: {sbo_form(args.sbo_chunks, args.sbo_groups)}")
    print(f"{'tokens':>7} {'none ms':>9}" + "".join(f" {m + ' ms':>9} {m + ' gain':>11}"
                                                   for m in GAINED) + "  chosen")
    for r in rows:
        t, g = r["times_ms"], r["gains"]
        mark = "  <- point" if r["tokens"] == point else ""
        print(f"{r['tokens']:>7} {t['none']:>9.3f}" + "".join(
            f" {t[m]:>9.3f} {g[m]:>+11.1%}" for m in GAINED) + f"  {r['chosen']}{mark}")
    offered = ("joined" if args.joined_experts else "dbo", "sbo")
    thresholds = {m: next((r["tokens"] for r in rows if r["gains"][m] >= args.margin), None)
                  for m in GAINED}
    loses = [r["tokens"] for r in rows if r["chosen"] == "none"]
    at = next(r for r in rows if r["tokens"] == point)
    wins = "; ".join(_wins_from(mode, thresholds[mode]) for mode in offered)
    print(f"prediction: {wins} (first sweep point with gain >= {args.margin:.0%}); overlap "
          f"loses at: {_ranges(loses)}")
    print(f"prediction at {point}: {at['reason']}")
    return {"phase": name, "point": at, "sweep": rows, "thresholds": thresholds,
            "overlap_loses_at": loses, "phase_times": rescale}


def sbo_form(chunks: int, groups: int) -> str:
    """The SBO step's combine in words (`dbo.cost_model`)."""
    if groups > 1:
        return (f"combine by {groups} expert groups, each under the next group's experts "
                f"and carrying all the combine's rows (A2ALLOptions.combine_groups)")
    if chunks > 1:
        return (f"combine in {chunks} row chunks, each under the next chunk's experts "
                f"(A2ALLOptions.combine_chunks)")
    return "one expert pass, its combine exposed"


def _plot(phases: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for ph in phases:
        tokens = [r["tokens"] for r in ph["sweep"]]
        for mode, style in (("dbo", "-o"), ("sbo", "--s"), ("joined", ":^")):
            ax.plot(tokens, [100 * r["gains"][mode] for r in ph["sweep"]], style,
                    label=f"{ph['phase']} {mode}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("predicted gain over no overlap, %")
    ax.set_title("dbo plan: PREDICTION (cost model, not measured)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.margin < 1:
            raise ValueError(f"--margin {args.margin}: must be in [0, 1) (0.01 = 1%)")
        if args.launches_per_layer < 0:
            raise ValueError(f"--launches-per-layer {args.launches_per_layer}: must be >= 0")
        if args.sbo_chunks > 1 and args.sbo_groups > 1:
            raise ValueError(f"--sbo-chunks {args.sbo_chunks} and --sbo-groups "
                             f"{args.sbo_groups}: SBO chunks its combine by rows or by expert "
                             f"group, not both: drop one")
        if args.out is not None:
            check_out_dir("--out", args.out)
        if args.backend is not None and args.calibration is None:
            raise ValueError(f"--backend {args.backend} picks the --calibration file's measured "
                             f"points of that backend, and there is no --calibration: add "
                             f"--calibration FILE, or drop --backend")
        from moe.models import get_preset  # noqa: PLC0415

        model = get_preset(args.preset)
        check_expert_split(model.moe.num_experts, args.ep, redundant=args.redundant_experts)
        cal = (Calibration.load(args.calibration) if args.calibration
               else Calibration.illustrative_h100())
        source = calibration_source(args.calibration, cal)
        intra, inter = cal.regime("nvlink"), cal.regime("scale_out")
        pick = lambda v, d: d if v is None else v  # noqa: E731
        cluster = Cluster(gpus_per_node=args.gpus_per_node, ep_size=args.ep,
                          intra_gbs=pick(args.intra_gbs, intra.bandwidth_gbs),
                          intra_latency_us=pick(args.intra_latency_us, intra.latency_us),
                          inter_gbs=pick(args.inter_gbs, inter.bandwidth_gbs),
                          inter_latency_us=pick(args.inter_latency_us, inter.latency_us))
        points = [(False, args.tokens), (True, args.requests)]
        if args.tokens is None and args.requests is None:
            points = [(False, 4096)]
        phases = [plan_phase(args, model, cluster, cal, decode=dec, point=pt)
                  for dec, pt in points if pt is not None]
    except ValueError as exc:
        parser.error(str(exc))
    plot = None
    if args.out is not None:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot = str(Path(args.out) / "plan.png")
        _plot(phases, Path(plot))
        print(f"prediction plot: {plot}")
    print(json.dumps({"plan": "prediction", "preset": args.preset, "ep": args.ep,
                      "redundant_experts": args.redundant_experts,
                      "gpus_per_node": args.gpus_per_node, "cluster": vars(cluster),
                      "calibration": source, "sbo_chunks": args.sbo_chunks,
                      "sbo_groups": args.sbo_groups, "modes": list(MODES), "phases": phases, "plot": plot}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
