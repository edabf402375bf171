"""Decode mode workload: one decode step of R requests over their KV caches, then MoE.

Shape legend: R requests on this rank (one new token each, so R tokens), H hidden,
N query heads, Nk kv heads, D head dim, C context tokens cached per request, L layers.

Each of the L blocks runs

    x = x + attention(rms_norm(x))      # each request's new token over its C cached tokens
    x = x + moe(rms_norm(x))

The attention is the decode attention of the preset's head shapes: a fused QKV
projection [(N + 2 Nk) D, H], the new token's k and v written into its request's cache
slot C, then `F.scaled_dot_product_attention` of the R queries [R, N, 1, D] over the
keys and values [R, Nk, C + 1, D] (grouped kv heads as they are, `enable_gqa`; torch
picks a fused kernel where the build has one), and the output projection [H, N D]. No
rotary embedding: its elementwise cost is small beside the cache read.

The caches `[R_max, Nk, C + 1, D]` (keys, values) are allocated once per sweep for the
largest request count and shared by every layer and every model the sweep builds: each
layer reads its requests' C + 1 positions as a per-layer cache would, so the time is
that of distinct caches (they are far larger than L2), at 1/L of the memory (1024
requests x 4096 tokens at DeepSeek-V3's 8 kv heads of 128 in bf16: 17 GB, not 69 GB).

Under DBO the step's requests are split on request boundaries (`SplitRequests`): ubatch
0 gets requests [0, ceil(R/2)), ubatch 1 the rest, each with its own rows of the caches
(`first_request=`), so the two ubatches' attention reads and writes disjoint memory.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dbo.cli.bench.layer_stack import generator, init_moe_experts, rms_norm
from moe import MoEConfig, MoELayer
from moe.models import ModelConfig

FIRST_REQUEST_KWARG = "first_request"


class DecodeAttention(nn.Module):
    """GQA attention of R new tokens, one per request, over their KV caches."""

    def __init__(self, preset: ModelConfig, *, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = preset.num_heads, preset.num_kv_heads
        self.head_dim = preset.head_dim
        q_width = preset.num_heads * preset.head_dim
        kv_width = preset.num_kv_heads * preset.head_dim
        self.w_qkv = nn.Parameter(torch.empty(q_width + 2 * kv_width, preset.hidden_size,
                                              dtype=preset.dtype, device=device),
                                  requires_grad=False)
        self.w_o = nn.Parameter(torch.empty(preset.hidden_size, q_width, dtype=preset.dtype,
                                            device=device), requires_grad=False)

    def forward(self, x_RH: Tensor, keys_RKCD: Tensor, values_RKCD: Tensor) -> Tensor:
        """[R, H] -> [R, H] in x's dtype, on the current stream. `keys_RKCD` /
        `values_RKCD` [R, Nk, C + 1, D]: these requests' caches; the new token's k and v
        are written at position C (the last), then attended to with the C before it."""
        num_requests, dim = x_RH.shape[0], self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q, k, v = F.linear(x_RH, self.w_qkv).split(
            [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        last = keys_RKCD.shape[2] - 1
        keys_RKCD[:, :, last].copy_(k.view(num_requests, kv_heads, dim))
        values_RKCD[:, :, last].copy_(v.view(num_requests, kv_heads, dim))
        o_RN1D = F.scaled_dot_product_attention(
            q.view(num_requests, heads, 1, dim), keys_RKCD, values_RKCD,
            enable_gqa=kv_heads != heads)
        return F.linear(o_RN1D.reshape(num_requests, heads * dim), self.w_o)


class DecodeStack(nn.Module):
    """L blocks of (decode attention, MoE layer), pre-norm residual; [R, H] -> [R, H].

    `keys` / `values` [R_max, Nk, C + 1, D] are the sweep's caches (`make_kv_caches`),
    held by reference: the stack does not own them, so rebuilding it keeps them.
    """

    def __init__(self, moe_config: MoEConfig, preset: ModelConfig, *, num_layers: int,
                 keys: Tensor, values: Tensor, group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        super().__init__()
        self.moe_config = moe_config
        self.keys, self.values = keys, values  # plain attributes: not the stack's state
        self.attention = nn.ModuleList(
            DecodeAttention(preset, device=device) for _ in range(num_layers))
        self.moe = nn.ModuleList(
            MoELayer(moe_config, group=group, layer_id=i, last_layer=i == num_layers - 1,
                     device=device)
            for i in range(num_layers))

    def forward(self, x_RH: Tensor, *, first_request: int = 0) -> Tensor:
        """[R, H] in the config dtype -> [R, H], on the current (compute) stream; the rows
        are requests [first_request, first_request + R) of the caches."""
        rows = slice(first_request, first_request + x_RH.shape[0])
        assert rows.stop <= self.keys.shape[0], (rows, self.keys.shape)
        keys, values = self.keys[rows], self.values[rows]
        for attention, moe in zip(self.attention, self.moe):
            x_RH = x_RH + attention(rms_norm(x_RH), keys, values)
            x_RH = x_RH + moe(rms_norm(x_RH))
        return x_RH

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded N(0, 1/fan_in) weights drawn on the parameters' device (no CPU copy)."""
        for i, (attention, moe) in enumerate(zip(self.attention, self.moe)):
            gen = generator(attention.w_qkv.device, seed * 1000 + i)
            for tensor in (attention.w_qkv, attention.w_o, moe.router.weight):
                tensor.normal_(0.0, 1.0 / math.sqrt(tensor.shape[-1]), generator=gen)
            init_moe_experts(moe, seed * 1000 + i)
        for p in self.parameters():
            p.requires_grad_(False)


class SplitRequests:
    """The DBO split of a decode step (a callable `DBOConfig.split`): ubatch 0 gets the
    first ceil(R/2) requests, ubatch 1 the rest, each told where its rows start in the
    caches (`first_request=`). None (unsplit) below two requests."""

    def __repr__(self) -> str:  # the runner names the callable in its decisions
        return "SplitRequests()"

    def __call__(self, args: tuple, kwargs: dict) -> Optional[list[tuple[tuple, dict]]]:
        x_RH = args[0]
        first = int(kwargs.get(FIRST_REQUEST_KWARG, 0))
        num_requests = x_RH.shape[0]
        if num_requests < 2:
            return None
        half = ubatch_requests(num_requests)
        return [((x_RH[:half],), {FIRST_REQUEST_KWARG: first}),
                ((x_RH[half:],), {FIRST_REQUEST_KWARG: first + half})]


def ubatch_requests(num_requests: int) -> int:
    """Requests of the larger ubatch `SplitRequests` makes of `num_requests` (>= 2)."""
    return (num_requests + 1) // 2


def make_kv_caches(preset: ModelConfig, *, max_requests: int, context: int,
                   device: torch.device, seed: int) -> tuple[Tensor, Tensor]:
    """Keys and values [max_requests, Nk, context + 1, D] in the preset dtype, N(0, 1)
    (unit-order values keep the attention output O(1)), drawn on `device`."""
    shape = (max_requests, preset.num_kv_heads, context + 1, preset.head_dim)
    gen = generator(device, seed)
    keys = torch.empty(shape, dtype=preset.dtype, device=device).normal_(generator=gen)
    values = torch.empty(shape, dtype=preset.dtype, device=device).normal_(generator=gen)
    return keys, values


def describe_decode(preset: ModelConfig, *, context: int, max_requests: int) -> dict[str, Any]:
    """The attention shapes and cache size a decode sweep runs (for the outputs)."""
    cache_bytes = (2 * max_requests * preset.num_kv_heads * (context + 1) * preset.head_dim
                   * preset.dtype.itemsize)
    return {"context": context, "num_heads": preset.num_heads,
            "num_kv_heads": preset.num_kv_heads, "head_dim": preset.head_dim,
            "kv_cache_gb": round(cache_bytes / 1e9, 3)}

