"""`HFMoEBlock`: what takes a Hugging Face MoE block's place after `moe.hf.convert`.

Shape legend: B sequences, S tokens per sequence, T = B * S tokens, H hidden, E experts.

The block keeps the Hugging Face block's contract (hidden states [B, S, H] in, a tensor
of the same shape out) and runs a dbo `MoELayer` inside: dbo's router maths, dispatch
and combine over the expert-parallel group (yielding to the other ubatch in a DBO step),
this rank's experts only, and the shared experts between the combine's send and receive.

Parameter names under the block, and the names the Hugging Face block gives them:

=====================================  ========================================
here                                   Hugging Face
=====================================  ========================================
``moe.router.weight``                  ``gate.weight``
``moe.router.e_score_correction_bias`` ``gate.e_score_correction_bias``
``moe.w13`` [E_loc, 2I, H]             ``experts.gate_up_proj`` [E, 2I, H], rows of
                                       this rank's experts
``moe.w2`` [E_loc, H, I]               ``experts.down_proj`` [E, H, I], likewise
``moe.shared_experts.<name>...``       ``<name>...`` (the block's shared modules)
=====================================  ========================================
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.hf.generic import HFExperts
from moe.layer import MoELayer

__all__ = ["HFMoEBlock", "HFRouter", "HFSharedExperts", "expert_bytes", "hf_param_name"]


class HFRouter(nn.Module):
    """The router as the Hugging Face block computes its logits.

    `weight [E, H]` keeps the Hugging Face gate's dtype (DeepSeek-V3 keeps it in float32
    in bf16 models); with `fp32_logits` the logits are computed in float32 from float32
    copies of input and weight, as DeepSeek-V3's router does, else in the input's dtype.
    `e_score_correction_bias [E]` float32, or None.
    """

    def __init__(self, weight_EH: Tensor, *, correction_bias_E: Optional[Tensor],
                 fp32_logits: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_EH, requires_grad=False)
        self.e_score_correction_bias = (
            None if correction_bias_E is None
            else nn.Parameter(correction_bias_E.float(), requires_grad=False))
        self.fp32_logits = fp32_logits

    def forward(self, x_TH: Tensor) -> Tensor:
        """Router logits [T, E]: float32 with `fp32_logits`, else x's dtype."""
        if self.fp32_logits:
            return F.linear(x_TH.float(), self.weight.float())
        return F.linear(x_TH, self.weight.to(x_TH.dtype))


class HFSharedExperts(nn.Module):
    """The block's shared experts, under their Hugging Face names.

    `mlp_name` is the shared MLP's attribute ("shared_expert" in Qwen2-MoE,
    "shared_experts" in DeepSeek-V3); `gate_name`, when given, a Linear [1, H] whose
    sigmoid scales the MLP's output per token (Qwen2-MoE's `shared_expert_gate`).
    """

    def __init__(self, *, mlp_name: str, mlp: nn.Module, gate_name: Optional[str] = None,
                 gate: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.mlp_name, self.gate_name = mlp_name, gate_name
        self.add_module(mlp_name, mlp)
        if gate_name is not None:
            assert gate is not None
            self.add_module(gate_name, gate)

    def forward(self, x_TH: Tensor) -> Tensor:
        """[T, H] -> [T, H] in x's dtype."""
        out_TH = getattr(self, self.mlp_name)(x_TH)
        if self.gate_name is None:
            return out_TH
        return torch.sigmoid(getattr(self, self.gate_name)(x_TH)) * out_TH


class HFMoEBlock(nn.Module):
    """A converted MoE block: [B, S, H] -> [B, S, H] through `moe` (an `MoELayer`).

    Args:
        moe: the layer, its router an `HFRouter` and its shared experts (if any) an
            `HFSharedExperts`.
        path: the block's module path in the model (for messages).
    """

    def __init__(self, moe: MoELayer, *, path: str) -> None:
        super().__init__()
        self.moe = moe
        self.path = path

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states [..., H] (any leading dims) -> the same shape and dtype."""
        shape = hidden_states.shape
        out_TH = self.moe(hidden_states.reshape(-1, shape[-1]))
        return out_TH.view(shape)

    def extra_repr(self) -> str:
        moe = self.moe
        return (f"path={self.path!r}, experts {moe.first_expert}.."
                f"{moe.first_expert + moe.num_local_experts - 1} of {moe.config.num_experts}")


def hf_param_name(name: str) -> Optional[str]:
    """The Hugging Face block's name for the parameter `name` of an `HFMoEBlock` (relative
    to the block); None for the routed experts (`moe.w13`, `moe.w2`: this rank's rows of
    `experts.gate_up_proj` / `experts.down_proj`, `moe.hf.save`)."""
    if name in ("moe.w13", "moe.w2"):
        return None
    if name.startswith("moe.router."):
        return "gate." + name.removeprefix("moe.router.")
    if name.startswith("moe.shared_experts."):
        return name.removeprefix("moe.shared_experts.")
    raise AssertionError(f"HFMoEBlock has no parameter {name!r} of a known kind")


def converted_experts(model: nn.Module) -> list[nn.Module]:
    """The modules that hold the routed experts of every converted block of `model`, in
    model order: the `MoELayer` of an `HFMoEBlock` (the hand-mapped path), or the
    `HFExperts` (the experts path). Each has `config` (its `MoEConfig`), `layer_id` and
    this rank's `w13`."""
    found: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, HFMoEBlock):
            found.append(m.moe)
        elif isinstance(m, HFExperts):
            found.append(m)
    return found


def expert_bytes(model: nn.Module) -> int:
    """Bytes of the routed experts' weights (`moe.w13`, `moe.w2` of an `HFMoEBlock`; `w13`,
    `w2` and the biases of an `HFExperts`) of every converted block of `model`: this
    rank's share under expert parallelism."""
    tensors = []
    for m in model.modules():
        if isinstance(m, HFMoEBlock):
            tensors += [m.moe.w13, m.moe.w2]
        elif isinstance(m, HFExperts):
            tensors += [t for t in (m.w13, m.w2, m.bias13, m.bias2) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)
