"""What dbo knows about each Hugging Face MoE architecture of the fused path: where its
routing settings live in the model config, which shared experts its block has.
(Checkpoints are read with transformers' own name mapping, `moe.hf.weights`.)

Shape legend: E routed experts, K top-k, H hidden size, I one expert's width.

Every architecture here (transformers 5.17 and 5.24 alike) has a MoE block holding a
router `gate` (`weight [E, H]`; DeepSeek-V3 adds `e_score_correction_bias [E]`) and an
experts module with `gate_up_proj [E, 2I, H]` (gate rows, then up rows) and `down_proj
[E, H, I]` under a SiLU gate; the block maps hidden states [B, S, H] to [B, S, H] and
returns a tensor. The routing each router's forward computes:

==============  =========  ==================  ============================================
model_type      scores     renormalise         also
==============  =========  ==================  ============================================
mixtral         softmax    always              --
qwen2_moe       softmax    norm_topk_prob      shared_expert, sigmoid(shared_expert_gate)
qwen3_moe       softmax    norm_topk_prob      --
deepseek_v3     sigmoid    norm_topk_prob      grouped top-k (n_group, topk_group, top-2
                                               group score), e_score_correction_bias,
                                               routed_scaling_factor, shared_experts;
                                               router logits in float32
==============  =========  ==================  ============================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from moe.config import MoEConfig

__all__ = ["ARCHITECTURES", "ArchSpec", "spec_for"]

#: Activations the dbo expert kernels compute (SiLU gate; "swish" is its other name).
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    """One architecture's MoE block, as dbo converts it."""

    model_type: str
    """`config.model_type`."""
    block_class: str
    """Class name of the MoE block in the modeling file."""
    num_experts_field: str
    """Config field holding E."""
    expert_width_field: str
    """Config field holding I."""
    scoring: str
    """"softmax" or "sigmoid" (`MoEConfig.scoring`)."""
    renormalize_field: Optional[str]
    """Config field that turns renormalisation on; None: always on."""
    grouped: bool = False
    """DeepSeek-V3 routing: n_group / topk_group, correction bias, routed_scaling_factor."""
    shared: tuple[str, ...] = ()
    """Names of the block's shared-expert modules: () none, ("shared_experts",) an MLP
    added to the output, ("shared_expert", "shared_expert_gate") an MLP scaled by
    sigmoid(gate(x))."""
    router_fp32: bool = False
    """The router computes its logits in float32 whatever the model dtype."""

    def moe_config(self, config: Any, *, dtype: torch.dtype) -> MoEConfig:
        """The block's `MoEConfig` from the model config (raises ValueError as
        `MoEConfig` does, for settings dbo cannot express)."""
        renormalize = (True if self.renormalize_field is None
                       else bool(getattr(config, self.renormalize_field)))
        routing: dict[str, Any] = {}
        if self.grouped:
            routing = dict(n_group=config.n_group, topk_group=config.topk_group,
                           use_correction_bias=True,
                           routed_scaling_factor=float(config.routed_scaling_factor))
        return MoEConfig(
            num_experts=getattr(config, self.num_experts_field),
            top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=getattr(config, self.expert_width_field),
            scoring=self.scoring, renormalize=renormalize, dtype=dtype, **routing)


ARCHITECTURES: dict[str, ArchSpec] = {spec.model_type: spec for spec in (
    ArchSpec(model_type="mixtral", block_class="MixtralSparseMoeBlock",
             num_experts_field="num_local_experts", expert_width_field="intermediate_size",
             scoring="softmax", renormalize_field=None),
    ArchSpec(model_type="qwen2_moe", block_class="Qwen2MoeSparseMoeBlock",
             num_experts_field="num_experts", expert_width_field="moe_intermediate_size",
             scoring="softmax", renormalize_field="norm_topk_prob",
             shared=("shared_expert", "shared_expert_gate")),
    ArchSpec(model_type="qwen3_moe", block_class="Qwen3MoeSparseMoeBlock",
             num_experts_field="num_experts", expert_width_field="moe_intermediate_size",
             scoring="softmax", renormalize_field="norm_topk_prob"),
    ArchSpec(model_type="deepseek_v3", block_class="DeepseekV3MoE",
             num_experts_field="n_routed_experts", expert_width_field="moe_intermediate_size",
             scoring="sigmoid", renormalize_field="norm_topk_prob", grouped=True,
             shared=("shared_experts",), router_fp32=True),
)}


def spec_for(config: Any) -> ArchSpec:
    """The spec of `config.model_type`; ValueError naming the supported ones otherwise."""
    model_type = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise ValueError(f"moe.hf: unsupported architecture {model_type!r}: dbo converts "
                         f"{', '.join(sorted(ARCHITECTURES))} (add an ArchSpec to "
                         f"moe.hf.arch.ARCHITECTURES for a model built like one of them)")
    return spec
