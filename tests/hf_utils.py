"""Tiny random transformers MoE models for the moe.hf tests (no download).

`tiny_model(arch)` builds one of the four architectures of `moe.hf.arch` from
`AutoConfig.for_model` with small sizes, the same weights for the same seed on every
process; `batch(...)` a padded batch; `assert_logits_close` the equivalence check.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")

_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
               initializer_range=0.1)
TINY: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=16, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, head_dim=8, norm_topk_prob=True),
    # Layer 0 dense, layer 1 MoE; 8 experts in 4 groups, 2 groups per token.
    "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
                        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=16,
                        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=8, routed_scaling_factor=2.5),
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import AutoConfig
    return AutoConfig.for_model(arch, **{**_COMMON, **TINY.get(arch, {}), **overrides})


def tiny_model(arch: str, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The architecture's tiny model at these tests' sizes, built as `dbo run --hf-config`
    builds its own (`moe.hf.tiny.tiny_model`: eval mode, float32, weights from `seed`,
    DeepSeek's correction bias drawn so that it changes the routing)."""
    from moe.hf.tiny import tiny_model as build
    return build(tiny_config(arch, **overrides), seed=seed)


def batch(num_seqs: int, seq_len: int, *, seed: int, vocab: int = 64
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, S]: sequence b left-padded by b % 3 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_seqs, seq_len), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(num_seqs):
        mask[b, : b % 3] = 0
    return ids, mask


def logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def dbo_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, *, group: Any = None,
               joined: bool = False) -> torch.Tensor:
    """The logits of a DBO step split by sequence in two ubatches (its experts joined
    where `joined`), asserting that it split and in which mode. In one process the
    backend is "local", which never yields (`dbo.NoYieldWarning`, silenced here)."""
    import warnings

    import dbo

    config = dbo.DBOConfig(split="batch", split_kwargs=("attention_mask",),
                           min_prefill_tokens=1, min_decode_tokens=1, joined_experts=joined)
    runner = dbo.DBORunner(model, config, group=group)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dbo.NoYieldWarning)
        out = runner(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert runner.last_decision.split, runner.last_decision.reason
    assert runner.last_decision.overlap == ("joined" if joined else "dbo")
    return out


def assert_saves_unconverted(saved: Any, state: dict[str, torch.Tensor]) -> None:
    """`saved` (what `moe.hf.save.hf_state_dict` gives `save_pretrained`) is the
    unconverted model's `state`: the same names, each tensor bit for bit."""
    assert saved is not None and set(saved) == set(state)
    for name, tensor in state.items():
        assert torch.equal(saved[name], tensor), name


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to 1e-5 of the logits' scale. Not bit-equal: CPU fp32 GEMMs round by row
    count and order, and transformers' experts gather an expert's rows in top-k slot
    order where dbo's gather them in token order (differences of ~1e-7 of the scale)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


def save(model: torch.nn.Module, path: Any) -> str:
    """`save_pretrained` into `path` (per-expert tensors, safetensors); returns the path."""
    model.save_pretrained(path)
    return os.fspath(path)


def rewrite_without(path: str, drop: Callable[[str], bool]) -> None:
    """Rewrite path/model.safetensors without the tensors whose name `drop` accepts."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if not drop(k)}, file,
              metadata={"format": "pt"})
