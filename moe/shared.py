"""`SharedExperts`: the always-on gated MLP that runs beside the routed experts.

Shape legend: T tokens, H hidden size, S shared width (num_shared_experts * intermediate_size).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.config import MoEConfig

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with ``gate_up.weight`` [2S, H] (gate rows first).

    Args:
        hidden_size: H.
        intermediate_size: S, the total shared width.
        dtype: parameter dtype.
        device: parameter device.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(
                f"SharedExperts: hidden_size={hidden_size}, intermediate_size="
                f"{intermediate_size}: both must be positive."
            )
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype,
                                 device=device)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype,
                              device=device)

    @classmethod
    def from_config(
        cls, config: MoEConfig, *, seed: int, device: torch.device | str = "cpu"
    ) -> SharedExperts:
        """Shared experts of width ``num_shared_experts * intermediate_size``, seeded weights.

        Weights are N(0, 1/fan_in) so activations stay O(1), like `moe.reference.init_moe_weights`.
        """
        if config.num_shared_experts < 1:
            raise ValueError(
                f"SharedExperts.from_config: config.num_shared_experts="
                f"{config.num_shared_experts}: set it >= 1, or use no shared experts (None)."
            )
        width = config.num_shared_experts * config.intermediate_size
        module = cls(hidden_size=config.hidden_size, intermediate_size=width,
                     dtype=config.dtype, device=device)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for linear in (module.gate_up, module.down):
                fan_in = linear.weight.shape[1]
                w = torch.randn(linear.weight.shape, generator=gen) / fan_in**0.5
                linear.weight.copy_(w)
        return module

    def forward(self, x_TH: Tensor) -> Tensor:
        """[T, H] in the parameter dtype -> [T, H], same dtype; the SiLU gate runs in float32."""
        h_T2S = self.gate_up(x_TH)
        gate_TS, up_TS = h_T2S.chunk(2, dim=-1)
        act_TS = (F.silu(gate_TS.float()) * up_TS.float()).to(h_T2S.dtype)
        return self.down(act_TS)
