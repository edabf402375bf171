"""Named Hugging Face MoE architectures at their real shapes, and the tiny ones, as
transformers configs with few layers (random weights: what `dbo bench --hf NAME` runs).

    config = named_config("deepseek-v3", num_layers=2)     # DeepseekV3Config, real shapes
    config = named_config("qwen3_moe", num_layers=2)       # the tiny one of moe.hf.tiny
    config = named_config("olmoe", num_layers=2)           # any MoE model type, tiny
    num_experts, top_k, width = expert_sizes(config)       # whichever fields it names them by

Shape legend: E routed experts, H hidden size, I one expert's width.

Real shapes are the published checkpoints' config.json sizes, except: the layer count
(`num_layers`), DeepSeek-V3's `first_k_dense_replace` (0, so that every one of the few
layers is an MoE layer) and its rope settings (the defaults: they change no shape or cost).
Llama-4-Scout and MiniMax-M2 are their transformers configs' defaults, which are those
checkpoints' text-model sizes. Any other MoE model type of the installed transformers
(`moe.hf.coverage.discover`) is built tiny (`moe.hf.coverage.tiny_config`).
"""
from __future__ import annotations

from typing import Any, Optional

from moe.hf.arch import ARCHITECTURES
from moe.hf.deps import require
from moe.hf.tiny import TINY_SIZES, tiny_config

__all__ = ["REAL_SHAPES", "expert_sizes", "named_config", "named_architectures"]

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
    # meta-llama/Llama-4-Scout-17B-16E (text model): E=16, top-1 sigmoid routing plus one
    # shared expert, H=5120, I=8192, 40 q heads / 8 kv heads of 128; every layer MoE.
    "llama-4-scout": ("llama4_text", dict(interleave_moe_layer_step=1)),
    # MiniMaxAI/MiniMax-M2: E=256, top-8 sigmoid routing with a correction bias, H=3072,
    # I=1536, 48 q heads / 8 kv heads of 128.
    "minimax-m2": ("minimax_m2", {}),
}
#: Config fields that hold the routed expert count, the top-k and one expert's width,
#: in the order they are looked up (a config may hold a dense width too).
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts",
                       "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts")
WIDTH_FIELDS = ("moe_intermediate_size", "expert_ffn_hidden_size", "intermediate_size")


def named_architectures() -> tuple[str, ...]:
    """The names listed for `named_config`: the real shapes, then the hand-sized tiny
    architectures (any other MoE model type of transformers is taken too: `is_named`)."""
    return (*REAL_SHAPES, *TINY_SIZES)


def is_named(name: str) -> bool:
    """Whether `named_config` builds `name` (a listed name, or an MoE model type of the
    installed transformers: reading its modeling files takes about 2 s)."""
    if name in REAL_SHAPES or name in TINY_SIZES:
        return True
    from moe.hf.coverage import discover
    return isinstance(name, str) and name in {f.model_type for f in discover()}


def unknown_name(name: str, *, option: str = "--hf") -> str:
    """The one-line error for a name `named_config` does not build."""
    return (f"unknown architecture {name!r} for {option}: use one of "
            f"{', '.join(named_architectures())}, or the model type of any MoE family of "
            f"transformers (python -m moe.hf.coverage --list)")


def named_config(name: str, *, num_layers: Optional[int],
                 num_experts: Optional[int] = None) -> Any:
    """The transformers config of `name` with `num_layers` decoder layers (None: a tiny
    model's own count; real shapes need one) and `num_experts` routed experts, when
    given; ValueError listing the names otherwise."""
    if name in TINY_SIZES:
        return tiny_config(name, num_layers=num_layers, num_experts=num_experts)
    if name in REAL_SHAPES:
        if num_layers is None:
            raise ValueError(f"{name!r} is real shapes: name how many decoder layers to build")
        model_type, sizes = REAL_SHAPES[name]
        config = require("transformers").AutoConfig.for_model(
            model_type, **{**sizes, "num_hidden_layers": num_layers})
    elif is_named(name):
        from moe.hf.coverage import tiny_config as generic_tiny_config
        config = generic_tiny_config(name)
        if num_layers is not None:
            _set_layers(config, num_layers)
    else:
        raise ValueError(unknown_name(name))
    if num_experts is not None:
        setattr(config, _first_field(config, EXPERT_COUNT_FIELDS, "routed expert count"),
                num_experts)
    return config


def expert_sizes(config: Any) -> tuple[int, int, int]:
    """(routed experts E, top-k K, one expert's width I) of an MoE `config`, by whichever
    of the usual field names it uses; ValueError naming the fields when it has none."""
    spec = ARCHITECTURES.get(getattr(config, "model_type", None))
    count = spec.num_experts_field if spec else _first_field(
        config, EXPERT_COUNT_FIELDS, "routed expert count")
    width = spec.expert_width_field if spec else _first_field(
        config, WIDTH_FIELDS, "expert width")
    top_k = _first_field(config, TOP_K_FIELDS, "top-k")
    return getattr(config, count), getattr(config, top_k), getattr(config, width)


def _first_field(config: Any, fields: tuple[str, ...], what: str) -> str:
    for field in fields:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return field
    raise ValueError(f"the {getattr(config, 'model_type', '?')} config names no "
                     f"{what} (looked for {', '.join(fields)})")


def _set_layers(config: Any, num_layers: int) -> None:
    """`num_layers` decoder layers, per-layer schedules cut (or the last kind repeated)."""
    before = config.num_hidden_layers
    config.num_hidden_layers = num_layers
    for name, value in list(vars(config).items()):
        if name.endswith("layer_types") and isinstance(value, list) and len(value) == before:
            setattr(config, name, (value + value[-1:] * num_layers)[:num_layers])
