"""Which experts each token was routed to, per MoE layer: to compare two runs of a model.

    with record_routing(model) as off:
        out_off = model(x)
    with record_routing(model) as on:
        out_on = runner(x)          # a DBO step: two ubatches, rows in batch order
    ties_T = routing_ties(off, on, num_tokens=x.shape[0], logit_atol=0.02 * scale)
    # bool [T]: tokens whose experts differ, their logits agreeing: leave them out

Why: the same batch run whole and as two ubatches does not give bit-equal hidden states
in bf16 (GEMMs of other row counts round differently). Where a token's top-k choice is a
near-tie, that last-bit difference can pick another expert, and the token's output then
differs by a whole expert's contribution, a valid result of the model all the same
(measured on 2x H200, `dbo run --preset deepseek-v3-like --layers 4 --tokens 1024`: the
4 and 9 tokens per rank beyond tolerance were exactly those routed differently; most
other tokens were bit-equal, the rest within 0.055). A tie is told from a real mismatch
by the router logits at the first layer where the expert sets differ: if the logits
agree there within tolerance, only the choice flipped.

Each MoE layer in the model appends its router logits and top-k ids on every call (with
`dbo_current_ubatch_id`), while `MoELayer.routing_log` is set. A CUDA graph replay runs
no host code and appends nothing: record an eager run.
"""
from __future__ import annotations

from collections.abc import Sequence

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn

from dbo.yield_points import dbo_current_ubatch_id


@dataclass
class RoutingLog:
    """The router logits [T, E] and top-k ids [T, K] of every call, keyed by
    (layer id, ubatch), in call order within a key."""

    calls: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = field(default_factory=dict)

    def add(self, layer: int, logits_TE: Tensor, ids_TK: Tensor) -> None:
        key = (layer, dbo_current_ubatch_id())
        self.calls.setdefault(key, []).append((logits_TE.detach().float().clone(),
                                               ids_TK.detach().clone()))

    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.calls})

    def logit_scale(self) -> float:
        """The largest |logit| recorded (0.0 if none)."""
        return max((float(logits.abs().max()) for calls in self.calls.values()
                    for logits, _ in calls if logits.numel()), default=0.0)

    def of_layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """(logits [T, E], ids sorted per token [T, K]) of one layer, the ubatches'
        rows in batch order (ubatch 0 first). Raises ValueError if the layer ran more
        than once in one ubatch: the rows could not be placed."""
        parts = []
        for (lay, ubatch), calls in sorted(self.calls.items()):
            if lay != layer:
                continue
            if len(calls) != 1:
                raise ValueError(f"MoE layer {layer} ran {len(calls)} times in ubatch "
                                 f"{ubatch}: record one step per RoutingLog")
            parts.append(calls[0])
        if not parts:
            raise ValueError(f"MoE layer {layer} did not run while recording")
        logits = torch.cat([p[0] for p in parts])
        ids = torch.cat([p[1] for p in parts]).sort(dim=-1).values
        return logits, ids


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingLog]:
    """Record the routing of every MoE layer in `model` while inside: every module with a
    `routing_log` attribute (`moe.layer.MoELayer`), which its forward appends to."""
    layers = [m for m in model.modules() if hasattr(m, "routing_log")]
    log = RoutingLog()
    for layer in layers:
        layer.routing_log = log
    try:
        yield log
    finally:
        for layer in layers:
            layer.routing_log = None


def routing_ties(a: RoutingLog, b: RoutingLog, *, num_tokens: int,
                 logit_atol: float) -> Tensor:
    """Bool [T]: tokens routed to other experts in `a` than in `b` in some layer, whose
    router logits at the first such layer agree within `logit_atol` (a near-tie that
    rounding flipped). A token whose experts differ where its logits do not agree is not
    a tie: its inputs already differed, and the caller's output check should catch it.

    Raises ValueError if the two logs cover other layers or other token counts."""
    if a.layers() != b.layers():
        raise ValueError(f"the runs routed in different MoE layers: {a.layers()} and "
                         f"{b.layers()}")
    ties_T = torch.zeros(num_tokens, dtype=torch.bool)
    decided_T = torch.zeros_like(ties_T)  # tokens whose first differing layer was seen
    for layer in a.layers():
        logits_a, ids_a = a.of_layer(layer)
        logits_b, ids_b = b.of_layer(layer)
        if not ids_a.shape[0] == ids_b.shape[0] == num_tokens:
            raise ValueError(f"MoE layer {layer} routed {ids_a.shape[0]} and "
                             f"{ids_b.shape[0]} tokens in the two runs, not {num_tokens}")
        differs_T = (ids_a != ids_b).any(dim=-1).cpu() & ~decided_T
        close_T = ((logits_a - logits_b).abs().amax(dim=-1) <= logit_atol).cpu()
        ties_T |= differs_T & close_T
        decided_T |= differs_T
    return ties_T


def spread_in_requests(ties_T: Tensor, seq_lens: Sequence[int]) -> Tensor:
    """Bool [T]: `ties_T` and every later token of the same request (packed in order,
    `seq_lens` tokens each). Under causal attention a token whose routing flipped reaches
    the later tokens of its request in the next layers, so their outputs differ by more
    than rounding too; the earlier tokens and other requests are untouched."""
    out_T = ties_T.clone()
    start = 0
    for length in seq_lens:
        first = torch.nonzero(ties_T[start:start + length])
        if first.numel():
            out_T[start + int(first[0]):start + length] = True
        start += length
    return out_T
