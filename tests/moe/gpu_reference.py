"""A GPU backend test's measure: one layer's output with DBO off, on (two ubatches of one
scheduler) and on with joined experts, against the dense reference, relative to the
reference's largest value."""
from __future__ import annotations

import torch

from dbo import UBatchScheduler
from moe.config import MoEConfig
from moe.reference import reference_moe


def off_and_on_errors(layer: torch.nn.Module, weights: dict, cfg: MoEConfig,
                      x: torch.Tensor) -> tuple[float, float, float]:
    """(DBO off, DBO on, DBO with joined experts): max |out - reference| / max(max
    |reference|, 1); 0.0 for no tokens. Asserts every output has x's shape."""
    ref = reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                        w2_EHI=weights["w2"], config=cfg).float()
    with torch.no_grad():
        off = layer(x)
        half = x.shape[0] // 2
        halves = [lambda: layer(x[:half]), lambda: layer(x[half:])]
        on = torch.cat(UBatchScheduler(x.device).run(halves))
        joined = torch.cat(UBatchScheduler(x.device).run(halves, joined_experts=True))
    torch.cuda.synchronize()
    assert off.shape == on.shape == joined.shape == x.shape, (off.shape, on.shape, x.shape)
    scale = max(ref.abs().max().item(), 1.0) if ref.numel() else 1.0
    return tuple((out.float() - ref).abs().max().item() / scale if out.numel() else 0.0
                 for out in (off, on, joined))
