"""Attention of the reference model (`moe.models.transformer`): GQA self-attention with
rotary positions over packed variable-length requests, causal inside each request and
never across requests.

    cos_TD2, sin_TD2 = rotary_cos_sin(positions_T, head_dim=D, theta=config.rope_theta)
    o_TND = causal_attention(q_TND, k_TND, v_TND, seq_lens=[5, 3, 8])
    out_TH = Attention(config, device="cuda")(x_TH, cos_TD2, sin_TD2, seq_lens)

Shape legend: T tokens of the call (all requests packed back to back), H hidden,
N query heads, Nk kv heads, D head dim, B requests of one length, L that length.

With a `CacheStep` (`moe.models.kv_cache`) a layer's new tokens attend over their
request's cached ones too, and are appended to them; without one, a call attends only
over the tokens it is given.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbo.graph_host import keep_for_graph
from moe.models.rotary import apply_rotary
from moe.models.kv_cache import CacheStep
from moe.models.presets import ModelConfig

__all__ = ["Attention", "causal_attention", "rotary_cos_sin"]


def rotary_cos_sin(positions_T: Tensor, *, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, D/2] float32 of the rotary angles ``pos * theta^(-2j/D)``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32,
                                       device=positions_T.device) / head_dim)
    angles_TD2 = positions_T.float()[:, None] * inv_freq[None, :]
    return angles_TD2.cos(), angles_TD2.sin()


def causal_attention(q_TND: Tensor, k_TND: Tensor, v_TND: Tensor,
                     seq_lens: Sequence[int]) -> Tensor:
    """Causal SDPA inside each packed request: q [T, N, D], k and v [T, Nk, D] with Nk
    dividing N (query head n reads kv head n // (N / Nk); SDPA's `enable_gqa`, no copies).

    Requests of equal length go through one batched SDPA call: a reshape when they lie
    back to back (a decode step, a single request, equal-length prefill), else a row
    gather whose index goes to the GPU from pinned memory (no host sync, which would
    stall the other ubatch). Returns [T, N, D] in q's dtype.

    Not torch's varlen attention (`torch.nn.attention.varlen`, FlashAttention-2 in torch
    2.11): on an H200 at DeepSeek-V3 head shapes and 8 requests it was faster at 2048
    tokens (0.29 against 0.43 ms) but slower at 4096 and 8192 (0.63 / 1.97 against 0.57 /
    1.29 ms) than SDPA's cuDNN kernel (measured 2026-11).
    """
    num_tokens = q_TND.shape[0]
    by_length: dict[int, list[int]] = {}
    start = 0
    for length in seq_lens:
        if length > 0:
            by_length.setdefault(length, []).append(start)
        start += length
    out_TND: Optional[Tensor] = None
    for length, starts in by_length.items():
        count, first = len(starts), starts[0]
        if starts == list(range(first, first + count * length, length)):
            rows = slice(first, first + count * length)
            o_BLND = _sdpa(*(t[rows].view(count, length, *t.shape[1:])
                             for t in (q_TND, k_TND, v_TND)))
            if count * length == num_tokens:
                return o_BLND.reshape(q_TND.shape)  # one group holds every row
            out_TND = torch.empty_like(q_TND) if out_TND is None else out_TND
            out_TND[rows] = o_BLND.reshape(count * length, *q_TND.shape[1:])
            continue
        idx = (_to_device(torch.tensor(starts), q_TND.device)[:, None]
               + torch.arange(length, device=q_TND.device)[None, :]).reshape(-1)
        o_BLND = _sdpa(*(t.index_select(0, idx).view(count, length, *t.shape[1:])
                         for t in (q_TND, k_TND, v_TND)))
        out_TND = torch.empty_like(q_TND) if out_TND is None else out_TND
        out_TND.index_copy_(0, idx, o_BLND.reshape(count * length, *q_TND.shape[1:]))
    return torch.empty_like(q_TND) if out_TND is None else out_TND  # T = 0


def _to_device(x: Tensor, device: torch.device) -> Tensor:
    """`x` (a small CPU tensor) on `device`, without a host sync on CUDA. In a CUDA graph
    capture the pinned copy's source is kept as long as the graph (`dbo.graph_host`)."""
    if device.type != "cuda":
        return x.to(device)
    pinned = x.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        pinned = keep_for_graph(pinned)
    return pinned.to(device, non_blocking=True)


def _sdpa(q_BLND: Tensor, k_BLND: Tensor, v_BLND: Tensor) -> Tensor:
    """Causal attention of [B, L, N, D] queries over [B, L, Nk, D] keys and values.

    Grouped kv heads go to SDPA as they are (`enable_gqa`): on an H200 at the
    deepseek-v3-like shapes (128 query heads, 8 kv heads of 128) that ran the same cuDNN
    kernel, gave the same bits, and took 0.18 / 0.50 / 0.98 ms against 0.46 / 0.77 /
    1.19 ms with the kv heads repeated first, at 8 x 512 / 2 x 2048 / 1 x 4096 tokens
    (measured 2026-11)."""
    o_BNLD = F.scaled_dot_product_attention(q_BLND.transpose(1, 2), k_BLND.transpose(1, 2),
                                            v_BLND.transpose(1, 2), is_causal=True,
                                            enable_gqa=k_BLND.shape[2] != q_BLND.shape[2])
    return o_BNLD.transpose(1, 2)


class Attention(nn.Module):
    """GQA self-attention with rotary positions over packed variable-length requests.

    Parameters: ``qkv_proj.weight [(N + 2 Nk) D, H]`` (q rows, then k, then v),
    ``o_proj.weight [H, N D]``.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_width + 2 * kv_width, bias=False,
                                  dtype=config.dtype, device=device)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False, dtype=config.dtype,
                                device=device)

    def forward(self, x_TH: Tensor, cos_TD2: Tensor, sin_TD2: Tensor,
                seq_lens: Sequence[int], cached: Optional[CacheStep] = None,
                layer_id: int = 0) -> Tensor:
        """[T, H] -> [T, H] in x's dtype; cos/sin from `rotary_cos_sin` of the positions;
        with `cached`, over (and into) layer `layer_id` of its KV cache."""
        num_tokens, dim = x_TH.shape[0], self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x_TH).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q_TND = apply_rotary(q.view(num_tokens, heads, dim), cos_TD2, sin_TD2)
        k_TND = apply_rotary(k.view(num_tokens, kv_heads, dim), cos_TD2, sin_TD2)
        v_TND = v.reshape(num_tokens, kv_heads, dim)
        if cached is not None:
            o_TND = cached.attend(layer_id, q_TND, k_TND, v_TND)
        else:
            o_TND = causal_attention(q_TND, k_TND, v_TND, seq_lens)
        return self.o_proj(o_TND.reshape(num_tokens, heads * dim))
