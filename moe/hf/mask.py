"""`batch_attention_mask`: a transformers model's attention mask for a whole batch, built
once before a DBO step splits it.

    mask = moe.hf.batch_attention_mask(model, input_ids, attention_mask)   # [B, 1, S, S]
    runner = DBORunner(model, DBOConfig(split="batch", split_kwargs=("attention_mask",)))
    logits = runner(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

Shape legend: B sequences, S tokens per sequence.

A transformers forward turns the 2D padding mask [B, S] into the mask its attention
takes (`masking_utils.create_causal_mask`), and on the way reads the mask on the host
(under sdpa: whether every token is real, `_ignore_causal_mask_sdpa`). Under DBO each
ubatch runs the forward, so each builds its rows' mask and reads: the second ubatch's
read waits for everything the first has queued on the GPU. Given the 4D mask the model
would build, a forward takes it as it is (`_preprocess_mask_arguments` returns a 4D mask
unchanged): built here once, on the whole batch, it is split by rows like the inputs,
and no ubatch builds or reads one. The rows of a mask built on the batch are the masks
of the rows: attention never looks across sequences.

Where the model builds no 4D mask (sdpa without padding: attention is plainly causal, it
passes `is_causal` to sdpa instead; flash attention, which takes the 2D mask), the mask
is returned unchanged: a 4D mask there would take sdpa off its causal kernel. Each
ubatch then still reads once on the host (the padding check, or, without a mask, the
packed-sequence check of `find_packed_sequence_indices`).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from moe.hf.deps import require

__all__ = ["batch_attention_mask"]


def batch_attention_mask(model: nn.Module, input_ids: Tensor,
                         attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The mask to pass as `attention_mask=` for this batch: the model's own 4D mask
    [B, 1, S, S] (bool, on the model's device) where it builds one from the padding mask,
    else `attention_mask` unchanged (None, a mask already 4D, or one the model uses as
    it is). For a call without a KV cache (`use_cache=False`), whose positions start at 0.

    Args:
        model: a transformers causal LM or base model (converted or not).
        input_ids: [B, S] (only its shape is read).
        attention_mask: the padding mask [B, S] (1: a real token), or None.

    Raises:
        ValueError: a model whose layers mix attention kinds (full and sliding window
            layers need masks of their own: pass the 2D mask).
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    if input_ids.dim() != 2 or tuple(input_ids.shape) != tuple(attention_mask.shape):
        raise ValueError(f"batch_attention_mask: input_ids {tuple(input_ids.shape)} and "
                         f"attention_mask {tuple(attention_mask.shape)} must both be [B, S]")
    config = model.config
    build = _mask_function(config)
    embedding = model.get_input_embeddings().weight
    num_seqs, seq_len = input_ids.shape
    # Read only for its batch size, length, dtype and device.
    embeds = torch.empty(num_seqs, seq_len, 1, dtype=embedding.dtype, device=embedding.device)
    positions = torch.arange(seq_len, device=embedding.device)
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask.to(
        embedding.device), "position_ids": positions.unsqueeze(0)}
    params = inspect.signature(build).parameters
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
    for name in ("cache", "past_key_values"):  # spelt either way across transformers 5.x
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = positions
    mask = build(**kwargs)
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return mask
    return attention_mask


def _mask_function(config: Any) -> Callable[..., Any]:
    """The mask builder the model's forward calls for its layers: per `layer_types` where
    the config has them (Qwen2-MoE), else sliding-window ones where `sliding_window` is
    set (Mixtral, Qwen3-MoE); DeepSeek-V3 has neither."""
    masking = require("transformers.masking_utils")
    kinds = set(getattr(config, "layer_types", None) or ())
    if len(kinds) > 1:
        raise ValueError(f"batch_attention_mask: the model's layers mix attention kinds "
                         f"{sorted(kinds)}, which need masks of their own: pass the 2D "
                         f"attention mask as it is")
    sliding = (kinds == {"sliding_attention"} if kinds
               else getattr(config, "sliding_window", None) is not None)
    return masking.create_sliding_window_causal_mask if sliding else masking.create_causal_mask
