"""Phase times of one step of a model shape on a cluster, from first principles, for
`dbo plan` (a prediction: rooflines from a `Calibration`, not measured kernel times).

Per MoE layer and rank, T tokens on the rank, bw = bytes per weight (the model's dtype),
E_loc = (E + redundant) / EP experts held per rank (redundant: extra replicas of experts
so that EP divides them, as DeepSeek's deployment holds 288 = 256 + 32 over 96 or 144 GPUs):
  experts:   rows R = T * K; max(2 * R * 3 * H * I / (dense_tflops * eff(R / E_loc)),
             E_loc * P(hit) * 3 * H * I * bw / memory_gbs), P(hit) = 1 - (1 - K / E)^(T * EP)
  shared:    max(2 * T * 3 * H * I_sh / (dense_tflops * eff(T)), 3 * H * I_sh * bw / memory)
  attention: projections (+ router) 2 * T * P_attn flops and P_attn * bw bytes; the core
             4 * T * ctx * heads * head_dim flops (decode: + the KV cache read,
             T * ctx * 2 * kv_heads * head_dim * bw bytes; prefill: causal over
             sequences of min(T, ctx)); max(flops / (dense_tflops * eff(T)), bytes / memory)
  dispatch:  one node: T * (distinct other ranks per token) * H * b_d / intra_gbs; several:
             max(T * (distinct other nodes per token) * H * b_d / inter_gbs,
             T * K * H * b_d / intra_gbs) (sent once per node, forwarded over NVLink);
             distinct nodes capped at the model's topk_group (DeepSeek-V3's node limit);
             b_d = 1 + 4 / 128 with --fp8-dispatch, else bw; + the regime's latency
  combine:   the same with b_d = bw (combined in bf16)
Dense layers, the embedding and the LM head are left out (no comm to hide).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dbo import Calibration, PhaseTimes, StepShape
from moe.models import ModelConfig

__all__ = ["Cluster", "check_expert_split", "comm_time", "step_inputs"]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The GPUs an EP group spans and its links."""

    gpus_per_node: int
    ep_size: int
    intra_gbs: float
    intra_latency_us: float
    inter_gbs: float
    inter_latency_us: float

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r}: must be an int >= 1")
        for name in ("intra_gbs", "inter_gbs"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: must "
                                 f"be > 0 (GB/s per GPU)")
        for name in ("intra_latency_us", "inter_latency_us"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: must "
                                 f"be >= 0 (us)")

    @property
    def nodes(self) -> int:
        return math.ceil(self.ep_size / self.gpus_per_node)


def _distinct(bins: float, picks: int) -> float:
    """Expected distinct bins hit by `picks` uniform picks among `bins`."""
    return bins * (1.0 - (1.0 - 1.0 / bins) ** picks)


def comm_time(model: ModelConfig, cluster: Cluster, *, tokens: int, bytes_per_row: float
              ) -> tuple[float, float, str]:
    """(ms, latency ms, the regime that bounds it: "nvlink" or "scale_out") of one
    dispatch or combine of one layer (module docstring: the formulas)."""
    moe, T, ep = model.moe, tokens, cluster.ep_size
    H, K = moe.hidden_size, moe.top_k
    if cluster.nodes == 1:
        others = _distinct(ep, K) * (ep - 1) / ep
        lam = cluster.intra_latency_us * 1e-3
        return T * others * H * bytes_per_row / (cluster.intra_gbs * 1e6) + lam, lam, "nvlink"
    nodes = _distinct(cluster.nodes, K)
    if moe.n_group is not None and moe.n_group > 1:
        nodes = min(nodes, moe.topk_group)
    remote = nodes * (cluster.nodes - 1) / cluster.nodes
    inter = T * remote * H * bytes_per_row / (cluster.inter_gbs * 1e6)
    intra = T * K * H * bytes_per_row / (cluster.intra_gbs * 1e6)
    lam = cluster.inter_latency_us * 1e-3
    return max(inter, intra) + lam, lam, "scale_out" if inter >= intra else "nvlink"


def check_expert_split(num_experts: int, ep_size: int, *, redundant: int = 0) -> None:
    """ValueError (with the fix) where `num_experts` routed experts plus `redundant`
    replicas do not split evenly over `ep_size` ranks: each rank holds E_loc of them."""
    held = num_experts + redundant
    if ep_size > held:
        raise ValueError(f"--ep {ep_size}: more ranks than the model's {held} experts; "
                         f"use at most {held}")
    if held % ep_size == 0:
        return
    divisors = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
    below = max((d for d in divisors if d < ep_size), default=1)
    above = min((d for d in divisors if d > ep_size), default=num_experts)
    pad = -num_experts % ep_size
    held_text = f"{num_experts} experts" + (f" + {redundant} redundant" if redundant else "")
    raise ValueError(f"--ep {ep_size}: {held_text} do not split over {ep_size} ranks (each "
                     f"rank holds the same number): use an EP size that divides "
                     f"{num_experts} (e.g. {below} or {above}), or hold redundant experts "
                     f"as DeepSeek's deployment does: --redundant-experts {pad} "
                     f"({num_experts + pad} = {(num_experts + pad) // ep_size} x {ep_size})")


def step_inputs(model: ModelConfig, cluster: Cluster, calibration: Calibration, *,
                tokens: int, decode: bool, context_len: int, layers: int,
                fp8_dispatch: bool, kernels_per_layer: int,
                redundant_experts: int = 0) -> tuple[PhaseTimes, StepShape]:
    """The `PhaseTimes` and `StepShape` of one step (module docstring: the formulas)."""
    cal, moe = calibration, model.moe
    H, E, K, I = moe.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size
    check_expert_split(E, cluster.ep_size, redundant=redundant_experts)
    bw = model.dtype.itemsize
    T, ep = tokens, cluster.ep_size
    flops_ms = 1e-9 / cal.dense_tflops  # flops -> ms at dense_tflops
    bytes_ms = 1e-6 / cal.memory_gbs  # bytes -> ms at memory_gbs

    # A replica is taken to be hit as often as an expert (its weight read: an upper bound).
    e_loc = (E + redundant_experts) / ep
    rows = T * K
    rows_per_expert = rows / e_loc
    p_hit = 1.0 - (1.0 - K / E) ** (T * ep)
    w_expert = e_loc * p_hit * 3 * H * I * bw
    x = max(2 * rows * 3 * H * I * flops_ms / cal.efficiency(rows_per_expert),
            w_expert * bytes_ms)

    i_sh = I * moe.num_shared_experts
    w_shared = 3 * H * i_sh * bw
    s = max(2 * T * 3 * H * i_sh * flops_ms / cal.efficiency(T), w_shared * bytes_ms) \
        if i_sh else 0.0

    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    p_attn = H * q + 2 * H * kv + q * H + H * E
    if decode:
        core_flops, kv_bytes = 4 * T * context_len * q, T * context_len * 2 * kv * bw
    else:
        core_flops, kv_bytes = 4 * T * min(T, context_len) / 2 * q, 0.0
    a = max((2 * T * p_attn + core_flops) * flops_ms / cal.efficiency(T),
            (p_attn * bw + kv_bytes) * bytes_ms)

    d, lam, _ = comm_time(model, cluster, tokens=T, bytes_per_row=1 + 4 / 128
                          if fp8_dispatch else bw)
    c, _, _ = comm_time(model, cluster, tokens=T, bytes_per_row=bw)
    times = PhaseTimes(attention=layers * a, shared=layers * s, experts=layers * x,
                       dispatch=layers * d, combine=layers * c, comm_latency=lam)
    shape = StepShape(layers=layers, tokens=T, rows_per_expert=rows_per_expert,
                      expert_weight_bytes=layers * w_expert,
                      attention_weight_bytes=layers * p_attn * bw,
                      shared_weight_bytes=layers * w_shared if i_sh else 0.0,
                      kernels_per_layer=kernels_per_layer,
                      own_row_share=1.0 / ep if ep > 1 else 0.0)  # a2a-style split combine
    return times, shape
