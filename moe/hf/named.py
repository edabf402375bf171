"""Named Hugging Face MoE architectures at their real shapes, and the tiny ones, as
transformers configs with few layers (random weights: what `dbo bench --hf NAME` runs).

    config = named_config("deepseek-v3", num_layers=2)     # DeepseekV3Config, real shapes
    config = named_config("qwen3_moe", num_layers=2)       # the tiny one of moe.hf.tiny

Shape legend: E routed experts, H hidden size, I one expert's width.

Real shapes are the published checkpoints' config.json sizes, except: the layer count
(`num_layers`), DeepSeek-V3's `first_k_dense_replace` (0, so that every one of the few
layers is an MoE layer) and its rope settings (the defaults: they change no shape or cost).
"""
from __future__ import annotations

from typing import Any, Optional

from moe.hf.arch import ARCHITECTURES
from moe.hf.deps import require
from moe.hf.tiny import TINY_SIZES, tiny_config

__all__ = ["REAL_SHAPES", "named_config", "named_architectures"]

#: name -> (model_type, the config's sizes).
REAL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen/Qwen3-30B-A3B: E=128, top-8, H=2048, I=768, 32 q heads / 4 kv heads of 128.
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, rms_norm_eps=1e-6,
        max_position_embeddings=40960, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False)),
    # deepseek-ai/DeepSeek-V3: E=256 in 8 groups (4 per token), top-8, 1 shared expert,
    # H=7168, I=2048, MLA with 128 heads.
    "deepseek-v3": ("deepseek_v3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
        first_k_dense_replace=0, rms_norm_eps=1e-6,
        max_position_embeddings=163840, tie_word_embeddings=False)),
}


def named_architectures() -> tuple[str, ...]:
    """Every name `named_config` takes: the real shapes, then the tiny architectures."""
    return (*REAL_SHAPES, *TINY_SIZES)


def named_config(name: str, *, num_layers: int, num_experts: Optional[int] = None) -> Any:
    """The transformers config of `name` with `num_layers` decoder layers (and
    `num_experts` routed experts, when given); ValueError listing the names otherwise."""
    if name in TINY_SIZES:
        return tiny_config(name, num_layers=num_layers, num_experts=num_experts)
    if name not in REAL_SHAPES:
        raise ValueError(f"unknown architecture {name!r}: choose one of "
                         f"{', '.join(named_architectures())}")
    model_type, sizes = REAL_SHAPES[name]
    sizes = {**sizes, "num_hidden_layers": num_layers}
    if num_experts is not None:
        sizes[ARCHITECTURES[model_type].num_experts_field] = num_experts
    return require("transformers").AutoConfig.for_model(model_type, **sizes)
