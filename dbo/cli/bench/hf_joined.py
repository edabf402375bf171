"""DBO with joined experts in `dbo bench --hf` (prefill `hf_sweep` and decode `hf_decode`):
its runner and its fields on a point.

    runner, graphed = joined_runners(model, dbo_config, cfg, group=group)
    ...                                         # time it per round, as DBO on
    attach_joined(point, rounds, diff=1e-7, runner=runner, perf=True, total_tokens=8192)

A joined step is the DBO-on step (the same model, split and thresholds) through a runner
with `joined_experts=True`: each converted MoE layer's experts run once over both
ubatches' rows (`dbo.meet`), so each expert's weights are read once per step; under
`cuda_graph` through a `GraphedRunner` as DBO on. Every point times it, each round right
after DBO on; prefill points also time a separate trial of it for the gate
(`hf_gate.attach_gate`: the split rules, as for DBO), decode points report it ungated,
as they report SBO.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist

from dbo import DBOConfig, DBORunner, GraphedRunner
from dbo.cli.bench.hf_config import HFBenchConfig
from dbo.cli.bench.hf_graphs import GRAPH_WARMUP
from dbo.cli.bench.timing import Timing, set_mode_times

__all__ = ["attach_joined", "joined_runners"]


def joined_runners(model: Any, config: DBOConfig, cfg: HFBenchConfig, *,
                   group: Optional[dist.ProcessGroup]
                   ) -> tuple[DBORunner, Optional[GraphedRunner]]:
    """The runner of `model` under the DBO-on `config` with joined experts, and its
    graphed runner under --cuda-graph (else None)."""
    runner = DBORunner(model, dataclasses.replace(config, joined_experts=True), group=group)
    graphed = GraphedRunner(runner, warmup=GRAPH_WARMUP) if cfg.cuda_graph else None
    return runner, graphed


def attach_joined(point: Any, rounds: list[Timing], *, diff: float, runner: DBORunner,
                  perf: bool, total_tokens: int) -> None:
    """Set the joined fields of `point` (prefill or decode, `hf_points.HFPointTimes`) from
    its rounds, as `timing_fields` sets DBO's: medians over rounds, the slowest rank's
    time, the rate of `total_tokens` over all ranks, T_noDBO / T_joined only in a
    performance run (`perf`); `diff`: its logits against the unconverted model's; whether
    the runner's last (timed) step was split, and why."""
    decision = runner.last_decision
    point.logits_diff_joined = diff
    point.joined_split = bool(decision is not None and decision.split)
    point.joined_split_reason = "" if decision is None else decision.reason
    set_mode_times(point, "joined", rounds, total_tokens=total_tokens, speedup=perf)
