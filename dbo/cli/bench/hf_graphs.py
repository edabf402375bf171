"""CUDA graphs in `dbo bench --hf --cuda-graph` (`dbo.cli.bench.hf_sweep`, `hf_decode`): a
captured forward replayed with its output cloned out, the unconverted transformers model
timed as a graph where it captures, and attention that builds the same (no) mask eagerly
and in a capture.

    step = replayed(capture_graph(off_step, device=device, warmup=GRAPH_WARMUP))
    times = graphed_unconverted(step, eager, cfg, timing, device=device, group=group)
    use_mask_free_sdpa(model)   # a graph runs the eager step's attention
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from dbo import capture_graph
from dbo.cli.bench.hf_config import HFBenchConfig
from dbo.cli.bench.timing import Timing, gather_floats, median_of_rounds, time_steps

__all__ = ["GRAPH_WARMUP", "MASK_FREE_SDPA", "UnconvertedTimes", "graphed_unconverted",
           "replayed", "use_mask_free_sdpa"]

#: Eager steps before each capture (compiles, autotunes, allocates the workspaces).
GRAPH_WARMUP = 2

MASK_FREE_SDPA = "dbo_mask_free_sdpa"
"""The attention implementation `use_mask_free_sdpa` registers with transformers."""


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

    def fields(self) -> dict[str, Any]:
        """The point fields `t_hf_eager_ms`, `t_hf_graph_ms` (None: no graph) and
        `hf_graph_note` (max over ranks)."""
        return dict(t_hf_eager_ms=self.eager.max_ms,
                    t_hf_graph_ms=None if self.graph is None else self.graph.max_ms,
                    hf_graph_note=self.note)


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


def use_mask_free_sdpa(model: nn.Module) -> None:
    """Run `model`'s attention as transformers' sdpa, with no attention mask ever built.

    A decode step over a `DynamicCache` without padding needs no mask (one query attends
    to every cached position), and eagerly transformers builds none: sdpa runs without
    one, grouped-query heads inside the kernel. Some transformers versions (5.17) build
    one while a CUDA stream captures (their mask helper takes a capture for tracing): a
    [R, 1, 1, C + 1] mask, with which sdpa repeats the cache's K and V for every query
    head and picks another kernel, so a graph would time other work than the eager step,
    rounded otherwise. An implementation registered under a name of its own
    (`MASK_FREE_SDPA`, transformers' own sdpa function) has no mask function, and for it
    transformers builds no mask, eagerly or in a capture. Correct only for calls that
    need no mask: no padding, and one query per sequence (decode) or a prefill from an
    empty cache (sdpa's is_causal), as the bench's prefill and decode calls are."""
    from moe.hf import require
    transformers = require("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    transformers.AttentionInterface.register(MASK_FREE_SDPA, sdpa_attention_forward)
    model.set_attn_implementation(MASK_FREE_SDPA)
