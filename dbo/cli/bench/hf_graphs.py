"""CUDA graphs in `dbo bench --hf --cuda-graph` (`dbo.cli.bench.hf_sweep`): a captured
forward replayed with its output cloned out, and the unconverted transformers model timed
as a graph where it captures.

    step = replayed(capture_graph(off_step, device=device, warmup=GRAPH_WARMUP))
    times = graphed_unconverted(step, eager, cfg, timing, device=device, group=group)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_map

from dbo.cli.bench.hf_config import HFBenchConfig
from dbo.cli.bench.timing import Timing, gather_floats, median_of_rounds, time_steps
from dbo.graphs import capture_graph

__all__ = ["GRAPH_WARMUP", "UnconvertedTimes", "graphed_unconverted", "replayed"]

#: Eager steps before each capture (compiles, autotunes, allocates the workspaces).
GRAPH_WARMUP = 2


@dataclass
class UnconvertedTimes:
    """The unconverted model eagerly and as a replayed graph (None: it did not capture,
    `note` says why); `best` the faster."""

    eager: Timing
    graph: Optional[Timing]
    note: str

    @property
    def best(self) -> Timing:
        if self.graph is None or self.eager.max_ms <= self.graph.max_ms:
            return self.eager
        return self.graph


def graphed_unconverted(step: Callable[[], Any], eager: Timing, cfg: HFBenchConfig,
                         timing: dict[str, Any], *, device: torch.device,
                         group: Optional[dist.ProcessGroup]) -> UnconvertedTimes:
    """Time the unconverted model as a replayed graph, where every rank captures it (it
    runs no collective: a rank whose capture fails only tells the others, below)."""
    note, graph = "", None
    try:
        replay = replayed(capture_graph(step, device=device, warmup=GRAPH_WARMUP))
    except RuntimeError as exc:
        replay, note = None, f"did not capture: {str(exc).splitlines()[0][:200]}"
    captured = gather_floats(0.0 if replay is None else 1.0, group)
    if min(captured) == 1.0:
        assert replay is not None
        rounds = [time_steps(replay, **timing) for _ in range(cfg.rounds)]
        graph = median_of_rounds(rounds)
    elif not note:
        note = "did not capture on another rank"
    replay = None  # the graph and its memory pool go here
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return UnconvertedTimes(eager, graph, note)


def replayed(captured: Any) -> Callable[[], Any]:
    """A step that replays `captured` (`dbo.graphs.CapturedGraph`) and clones its output
    out, as `GraphedRunner` does (the next replay overwrites the graph's own)."""
    def step() -> Any:
        return tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v,
                        captured.replay())
    return step
