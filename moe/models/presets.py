"""`ModelConfig` of the reference MoE transformer (`moe.models.transformer`), its named presets, and
a parameter-memory estimate.

    cfg = get_preset("deepseek-v3-like", num_layers=2, max_tokens_per_rank=4096)
    estimate_param_bytes(cfg, ep_size=2)      # bytes of parameters on one EP rank

Shape legend: H hidden, V vocab, E experts (global), I expert width, L layers.

The presets copy the *layer shapes* of public models (hidden size, expert count and
width, top-k, routing, head counts), not their depth or vocabulary: `num_layers` is
2-4 and the vocabulary 32000 so that a step is dominated by the layers being studied.
Override either with `get_preset(name, num_layers=..., vocab_size=...)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from moe.config import MoEConfig

__all__ = ["ModelConfig", "PRESETS", "get_preset", "estimate_param_bytes"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and 0.0 < float(value) < float("inf"))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes of a decoder-only MoE transformer: dense layers first, MoE layers after."""

    vocab_size: int
    """Vocabulary size (V): rows of the embedding and of the LM head."""
    hidden_size: int
    """Model width (H); must equal moe.hidden_size."""
    num_layers: int
    """Decoder layers in total (dense + MoE)."""
    num_dense_layers: int = 0
    """The first num_dense_layers layers use a dense gated MLP instead of the MoE layer."""
    num_heads: int
    """Query heads of the attention."""
    num_kv_heads: int
    """Key/value heads (GQA); must divide num_heads (num_heads = plain multi-head)."""
    head_dim: int
    """Width of one attention head; even (rotary embedding rotates pairs)."""
    dense_intermediate_size: int
    """Width of the dense layers' gated MLP (unused when num_dense_layers = 0)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    moe: MoEConfig
    """The MoE layers' config (experts, routing, shared experts, capacity)."""
    dtype: torch.dtype = torch.float32
    """Parameter and activation dtype; must equal moe.dtype."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "dense_intermediate_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r}: must be a positive int.")
        if not _is_int(self.num_dense_layers) or not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(
                f"ModelConfig.num_dense_layers={self.num_dense_layers!r}: must be an int in "
                f"[0, num_layers={self.num_layers}] (0 = every layer is MoE).")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_kv_heads={self.num_kv_heads} does not divide num_heads="
                f"{self.num_heads}: use a divisor of num_heads (GQA groups of equal size).")
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim}: must be even (rotary "
                             f"embedding rotates pairs of channels).")
        for name in ("rope_theta", "rms_norm_eps"):
            if not _is_positive_number(getattr(self, name)):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be a "
                                 f"finite number > 0.")
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"ModelConfig.moe={self.moe!r}: must be a moe.MoEConfig.")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(
                f"ModelConfig.hidden_size={self.hidden_size} differs from moe.hidden_size="
                f"{self.moe.hidden_size}: set both to the same value (get_preset(..., "
                f"hidden_size=...) sets both).")
        if self.dtype != self.moe.dtype:
            raise ValueError(
                f"ModelConfig.dtype={self.dtype} differs from moe.dtype={self.moe.dtype}: set "
                f"both to the same dtype (get_preset(..., dtype=...) sets both).")

    @property
    def num_moe_layers(self) -> int:
        """Layers with an MoE FFN (num_layers - num_dense_layers)."""
        return self.num_layers - self.num_dense_layers


PRESETS: dict[str, ModelConfig] = {
    # CPU tests: every feature (dense layer, shared expert, GQA), runs in milliseconds.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=3, num_dense_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, dense_intermediate_size=128,
        moe=MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                      num_shared_experts=1)),
    # DeepSeek-V3 layer shapes. Attention is plain GQA (128 query heads of 128, 8 kv
    # heads), not MLA: per token it costs ~250M MACs of projections against MLA's ~190M.
    "deepseek-v3-like": ModelConfig(
        vocab_size=32000, hidden_size=7168, num_layers=4, num_dense_layers=1, num_heads=128,
        num_kv_heads=8, head_dim=128, dense_intermediate_size=18432, rope_theta=10000.0,
        rms_norm_eps=1e-6, dtype=torch.bfloat16,
        moe=MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048,
                      num_shared_experts=1, scoring="sigmoid", renormalize=True, n_group=8,
                      topk_group=4, use_correction_bias=True, routed_scaling_factor=2.5,
                      dtype=torch.bfloat16)),
    # Qwen3-30B-A3B layer shapes (no per-head q/k RMSNorm); every layer is MoE.
    "qwen3-moe-like": ModelConfig(
        vocab_size=32000, hidden_size=2048, num_layers=4, num_dense_layers=0, num_heads=32,
        num_kv_heads=4, head_dim=128, dense_intermediate_size=6144, rope_theta=1e6,
        rms_norm_eps=1e-6, dtype=torch.bfloat16,
        moe=MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                      scoring="softmax", renormalize=True, dtype=torch.bfloat16)),
    # Mixtral-8x7B layer shapes; every layer is MoE.
    "mixtral-like": ModelConfig(
        vocab_size=32000, hidden_size=4096, num_layers=2, num_dense_layers=0, num_heads=32,
        num_kv_heads=8, head_dim=128, dense_intermediate_size=14336, rope_theta=1e6,
        rms_norm_eps=1e-5, dtype=torch.bfloat16,
        moe=MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336,
                      scoring="softmax", renormalize=True, dtype=torch.bfloat16)),
}
"""Named model shapes; `get_preset` returns one with overrides applied."""

_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
_MOE_FIELDS = frozenset(f.name for f in dataclasses.fields(MoEConfig))
# Fields held by both configs: an override sets both so that they stay consistent.
_SHARED_FIELDS = frozenset({"hidden_size", "dtype"})


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` with `overrides` applied.

    An override names a `ModelConfig` field (``num_layers=2``) or a `MoEConfig` field
    (``max_tokens_per_rank=4096``, ``num_experts=64``), which goes into the nested
    ``moe``; ``hidden_size`` and ``dtype`` set both. ``moe=MoEConfig(...)`` replaces the
    nested config (MoE-field overrides then apply on top of it).

    Raises:
        ValueError: unknown preset or field name (the message lists the valid ones), or
            a resulting config that fails validation.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}.")
    unknown = sorted(set(overrides) - _MODEL_FIELDS - _MOE_FIELDS)
    if unknown:
        raise ValueError(
            f"get_preset({name!r}): unknown override(s) {unknown}: use ModelConfig fields "
            f"{sorted(_MODEL_FIELDS)} or MoEConfig fields {sorted(_MOE_FIELDS)}.")
    base = PRESETS[name]
    moe = overrides.get("moe", base.moe)
    moe_overrides = {k: v for k, v in overrides.items() if k in _MOE_FIELDS}
    if moe_overrides:
        moe = dataclasses.replace(moe, **moe_overrides)
    model_overrides = {k: v for k, v in overrides.items()
                       if k in _MODEL_FIELDS and (k not in _MOE_FIELDS or k in _SHARED_FIELDS)}
    model_overrides["moe"] = moe
    return dataclasses.replace(base, **model_overrides)


def estimate_param_bytes(config: ModelConfig, *, ep_size: int = 1) -> int:
    """Bytes of parameters one rank holds when the routed experts are split over `ep_size`
    ranks (everything else is replicated). Activations and MoE workspaces not included."""
    if not _is_int(ep_size) or ep_size < 1 or config.moe.num_experts % ep_size != 0:
        raise ValueError(f"estimate_param_bytes: ep_size={ep_size!r} must be a positive "
                         f"divisor of num_experts={config.moe.num_experts}.")
    hidden, moe = config.hidden_size, config.moe
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden + 2 * hidden  # + norms
    dense_ffn = 3 * hidden * config.dense_intermediate_size
    experts = (moe.num_experts // ep_size) * 3 * hidden * moe.intermediate_size
    shared = 3 * hidden * moe.intermediate_size * moe.num_shared_experts
    router = moe.num_experts * hidden
    per_moe_layer = attention + experts + shared + router
    total = (config.num_dense_layers * (attention + dense_ffn)
             + config.num_moe_layers * per_moe_layer
             + 2 * config.vocab_size * hidden + hidden)
    bias_bytes = 4 * moe.num_experts * config.num_moe_layers if moe.use_correction_bias else 0
    return total * config.dtype.itemsize + bias_bytes
