"""Layer mode workload: a stack of MoE layers with attention-sized dense compute between.

Shape legend: T tokens on this rank, H hidden, C attention context per token, L layers.

Each of the L blocks runs

    x = x + attention_standin(rms_norm(x))
    x = x + moe(rms_norm(x))

The attention stand-in has attention's GEMMs for T tokens that each attend to C
context tokens: a fused QKV projection [3H, H] (k and v of the new tokens are computed
and dropped, as a KV-cache write would consume them), scores q K^T against a fixed
[C, H] key block, softmax, times a [C, H] value block, and the output projection [H, H].
FLOPs per token per layer: 8 H^2 + 4 C H (projections + scores + weighted sum), the
same as multi-head attention of width H over C context tokens. Rows are independent,
so halving T (DBO "tokens" split) halves the work, as a request-boundary split would.

Weights are drawn directly on the device (seeded, N(0, 1/fan_in)): the bench needs
realistic magnitudes and routing, not bit-reproducibility across rank counts.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe import MoEConfig, MoELayer


class AttentionStandin(nn.Module):
    """Attention-sized GEMMs for [T, H] inputs (no real KV cache; see the module doc)."""

    def __init__(self, hidden_size: int, context: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.context = context
        self.w_qkv = nn.Parameter(torch.empty(3 * hidden_size, hidden_size, dtype=dtype,
                                              device=device), requires_grad=False)
        self.w_o = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype,
                                            device=device), requires_grad=False)
        self.register_buffer("keys_CH", torch.empty(context, hidden_size, dtype=dtype,
                                                    device=device))
        self.register_buffer("values_CH", torch.empty(context, hidden_size, dtype=dtype,
                                                      device=device))

    def forward(self, x_TH: Tensor) -> Tensor:
        """[T, H] -> [T, H], same dtype, on the current stream."""
        q_TH = F.linear(x_TH, self.w_qkv)[:, :self.hidden_size]
        if self.context > 0:
            scores_TC = (q_TH @ self.keys_CH.t()) * (1.0 / math.sqrt(self.hidden_size))
            q_TH = torch.softmax(scores_TC, dim=-1) @ self.values_CH
        return F.linear(q_TH, self.w_o)


class LayerStack(nn.Module):
    """L blocks of (attention stand-in, MoE layer), pre-norm residual; [T, H] -> [T, H]."""

    def __init__(self, moe_config: MoEConfig, *, num_layers: int, attn_context: int,
                 group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        super().__init__()
        hidden, dtype = moe_config.hidden_size, moe_config.dtype
        self.moe_config = moe_config
        self.attention = nn.ModuleList(
            AttentionStandin(hidden, attn_context, dtype=dtype, device=device)
            for _ in range(num_layers))
        self.moe = nn.ModuleList(
            MoELayer(moe_config, group=group, layer_id=i, last_layer=i == num_layers - 1,
                     device=device)
            for i in range(num_layers))

    def forward(self, x_TH: Tensor) -> Tensor:
        """[T, H] in the config dtype -> [T, H], on the current (compute) stream."""
        for attention, moe in zip(self.attention, self.moe):
            x_TH = x_TH + attention(rms_norm(x_TH))
            x_TH = x_TH + moe(rms_norm(x_TH))
        return x_TH

    def dbo_can_split_inside_request(self) -> bool:
        """True: every row is computed on its own (`dbo.split`), so any cut is exact."""
        return True

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded N(0, 1/fan_in) weights drawn on the parameters' device (no CPU copy)."""
        for i, (attention, moe) in enumerate(zip(self.attention, self.moe)):
            gen = generator(attention.w_qkv.device, seed * 1000 + i)
            for tensor in (attention.w_qkv, attention.w_o, attention.keys_CH, moe.router.weight):
                tensor.normal_(0.0, 1.0 / math.sqrt(tensor.shape[-1]), generator=gen)
            # Values O(1) so that the softmax average keeps unit-order activations.
            attention.values_CH.normal_(0.0, 1.0, generator=gen)
            init_moe_experts(moe, seed * 1000 + i)
        for p in self.parameters():
            p.requires_grad_(False)


def layer_moe_config(base: MoEConfig, *, num_experts: int,
                     max_tokens_per_rank: Optional[int]) -> MoEConfig:
    """`base` with `num_experts` experts and the given capacity.

    Grouped top-k (n_group / topk_group) is kept when the groups still divide the experts
    and hold at least top_k candidates; otherwise it is dropped, with a note on stderr.
    """
    changes: dict = {"num_experts": num_experts, "max_tokens_per_rank": max_tokens_per_rank}
    if base.n_group is not None:
        per_group = num_experts // base.n_group if num_experts % base.n_group == 0 else 0
        if per_group == 0 or per_group * base.topk_group < base.top_k:
            print(f"[dbo bench] note: n_group={base.n_group}, topk_group={base.topk_group} "
                  f"does not fit {num_experts} experts with top_k={base.top_k}; using plain "
                  f"top-k routing", file=sys.stderr)
            changes.update(n_group=None, topk_group=None)
    if base.top_k > num_experts:
        raise ValueError(f"{num_experts} experts are fewer than top_k={base.top_k}: raise "
                         f"--num-experts / --experts-per-rank")
    return dataclasses.replace(base, **changes)


def make_input(num_tokens: int, hidden_size: int, *, dtype: torch.dtype,
               device: torch.device, seed: int) -> Tensor:
    """[T, H] standard-normal hidden states, seeded."""
    gen = generator(device, seed)
    return torch.randn(num_tokens, hidden_size, generator=gen, device=device).to(dtype)


@torch.no_grad()
def init_moe_experts(moe: MoELayer, seed: int) -> None:
    """Seeded N(0, 1/fan_in) weights for `moe`'s experts and shared experts, drawn on
    their device; this rank's experts from a stream of their own (`first_expert`)."""
    gen = generator(moe.w13.device, seed + 7919 * (moe.first_expert + 1))
    for tensor in (moe.w13, moe.w2):
        tensor.normal_(0.0, 1.0 / math.sqrt(tensor.shape[-1]), generator=gen)
    if moe.shared_experts is not None:
        for p in moe.shared_experts.parameters():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)


def rms_norm(x_TH: Tensor) -> Tensor:
    return F.rms_norm(x_TH, (x_TH.shape[-1],), eps=1e-6)


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
