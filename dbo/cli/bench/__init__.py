"""`dbo bench`: DBO throughput experiments with a measured overlap ceiling.

    python -m dbo.cli.bench --mode layer                          # CPU: 2 gloo ranks, tiny shapes
    torchrun --nproc_per_node=2 -m dbo.cli.bench --mode layer     # GPU (NVLink)
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --mode layer   # scale-out emulated
    torchrun --nproc_per_node=2 -m dbo.cli.bench --mode model --preset deepseek-v3-like

Sweeps tokens per rank x backend (a2a, a2a_ll, naive) x DBO on/off in `layer` mode (a
stack of MoE layers with attention-sized GEMMs between, `dbo.cli.bench.layer_stack`) or
`model` mode (`moe.models.transformer.MoETransformer` of a preset); on GPU it measures each point's
overlap ceiling (`dbo.cli.bench.ceiling`) and applies a gate (`dbo.cli.bench.gating`). Prints a
table, writes CSV/JSON/PNG under --out, and ends with one JSON line on stdout.

Modules: config (BenchConfig), layer_stack, workload (model + inputs per point), timing,
ceiling (the probe), gating, sweep (the loop, per-point figures), report (table, files,
final line), plot (PNG), launch (command line, ranks).
"""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `dbo bench` with `argv` (None: sys.argv[1:]); returns the exit code."""
    from dbo.cli.bench.launch import main as launch_main
    return launch_main(argv)


__all__ = ["main"]
