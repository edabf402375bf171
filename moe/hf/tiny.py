"""Tiny random transformers models of the architectures in `moe.hf.arch` (no download):
what `dbo run --hf-config NAME` runs.

Shape legend: E routed experts, H hidden size, I one expert's width.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from moe.hf.arch import ARCHITECTURES
from moe.hf.deps import require

__all__ = ["TINY_SIZES", "tiny_config", "tiny_model"]

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
               initializer_range=0.1)
#: Each architecture's small sizes (8 experts, top-2; DeepSeek-V3: layer 0 dense, the
#: experts in 4 groups of which each token uses 2).
TINY_SIZES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=32, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True),
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, first_k_dense_replace=1,
                        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=32,
                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, routed_scaling_factor=2.5),
}


def tiny_config(arch: str, *, num_layers: Optional[int] = None,
                num_experts: Optional[int] = None) -> Any:
    """The transformers config of `arch`'s tiny model; ValueError naming the known ones."""
    if arch not in TINY_SIZES:
        raise ValueError(f"no tiny model of architecture {arch!r}: choose one of "
                         f"{', '.join(TINY_SIZES)}")
    sizes: dict[str, Any] = {**_COMMON, **TINY_SIZES[arch]}
    if num_layers is not None:
        sizes["num_hidden_layers"] = num_layers
    if num_experts is not None:
        sizes[ARCHITECTURES[arch].num_experts_field] = num_experts
    return require("transformers").AutoConfig.for_model(arch, **sizes)


def tiny_model(config: Any, *, seed: int) -> nn.Module:
    """A float32 model of `config` in eval mode on the CPU, the same weights for the same
    seed in every process; DeepSeek's correction bias (zeros at init) drawn too, so that
    it changes the routing."""
    torch.manual_seed(seed)
    model = require("transformers").AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.1)
    return model.eval()
