"""The comm benchmark's inputs and arithmetic: routing, the bytes a point moves, the
algorithmic bandwidth, and the SMs a comm engine holds (from its kernels' grid sizes).

Shape legend: T tokens on this rank, H hidden, K top-k, E experts over all ranks, W ranks.

Bandwidth is defined as DeepEP's tests define it (`tests/test_intranode.py`,
`tests/test_low_latency.py`), per rank, over that rank's median time:

- `rank rows` (DeepEP's normal kernels): the rows this rank receives, one per (token of
  any rank, this rank) pair where the token picks at least one expert here, times H times
  the element size (`recv_x.numel() * 2` in test_intranode). The same bytes for dispatch
  and combine (the combine sends those rows back).
- `expert rows` (DeepEP's low-latency kernels): the rows this rank sends, one per
  (token, picked expert) slot, times H times the element size (bf16 here, as our backends
  send bf16; test_low_latency's dispatch figure counts FP8 bytes instead).

Both depend on the routing only, so every backend at a point is divided by the same bytes:
a backend that pads (a2a_ll, naive) moves more than it is credited with.

SMs: a comm kernel (its name matches `traces.classify`'s comm patterns: NCCL, DeepEP,
NVSHMEM, symmetric memory, ...) launched with `grid` blocks can hold min(blocks, SM count)
SMs at once (one resident block per SM, as NCCL's one block per channel and DeepEP's one
block per SM are sized). An engine's figure is the largest over its comm kernels in one
dispatch (or combine); kernels that pack or sum rows are compute and not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

ROUTINGS = ("random", "balanced")


def make_routing(num_tokens: int, *, num_experts: int, top_k: int, rank: int, seed: int,
                 mode: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """(topk_ids_TK int64, topk_weights_TK float32) of this rank's tokens, K distinct
    experts per token, the same on every run with the same seed and rank.

    random: the K largest of random scores, as DeepEP's tests route. balanced: token t of
    rank r picks experts (rT + t + k * (E // K)) mod E, so each token's experts spread
    evenly over the ranks and every expert gets T K / E slots (when that is whole)."""
    if mode not in ROUTINGS:
        raise ValueError(f"routing {mode!r}: choose one of {ROUTINGS}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    if mode == "random":
        scores_TE = torch.rand(num_tokens, num_experts, generator=gen)
        ids_TK = scores_TE.topk(top_k, dim=1).indices
    else:
        first_T = torch.arange(num_tokens) + rank * num_tokens
        step = num_experts // top_k
        ids_TK = (first_T[:, None] + torch.arange(top_k)[None, :] * step) % num_experts
    weights_TK = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    weights_TK = weights_TK / weights_TK.sum(dim=1, keepdim=True)
    return ids_TK.to(device=device, dtype=torch.int64), weights_TK.to(device=device)


def make_tokens(num_tokens: int, hidden: int, *, rank: int, seed: int, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """x_TH: this rank's token rows (random normal), reproducible per (seed, rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7919)
    return torch.randn(num_tokens, hidden, generator=gen).to(device=device, dtype=dtype)


def rows_to_ranks(topk_ids_TK: Tensor, *, num_experts: int, world_size: int) -> list[int]:
    """[W]: how many of these tokens go to rank w (have at least one expert there;
    expert e lives on rank e // (E // W); ids of -1 go nowhere)."""
    per_rank = num_experts // world_size
    # An id of -1 marks column W, which is not counted.
    rank_TK = torch.where(topk_ids_TK >= 0, topk_ids_TK // per_rank,
                          torch.full_like(topk_ids_TK, world_size))
    hit_TW = torch.zeros(topk_ids_TK.shape[0], world_size + 1, dtype=torch.bool,
                         device=topk_ids_TK.device)
    hit_TW.scatter_(1, rank_TK, True)
    return [int(v) for v in hit_TW[:, :world_size].sum(dim=0).tolist()]


def expert_slots(topk_ids_TK: Tensor) -> int:
    """The (token, expert) slots these tokens send: ids that are not -1."""
    return int((topk_ids_TK >= 0).sum().item())


def algbw_gbps(nbytes: float, ms: Optional[float]) -> Optional[float]:
    """GB/s (1e9 bytes per second) of `nbytes` moved in `ms` milliseconds; None without a
    positive time."""
    if ms is None or not ms > 0:
        return None
    return nbytes / (ms * 1e6)


@dataclass(frozen=True)
class CommKernels:
    """The comm kernels of one dispatch or combine: `sms`, the most SMs any of them holds
    (None: no comm kernel seen); `blocks`, each kernel name's largest grid, in blocks."""

    sms: Optional[int]
    blocks: dict[str, int]


def comm_kernel_sms(events: Iterable[dict[str, Any]], *, sm_count: int,
                    is_comm: Callable[[str], bool]) -> CommKernels:
    """Read Chrome-trace kernel events (torch.profiler's `export_chrome_trace`: `cat`
    "kernel", `args.grid` [x, y, z]) and return the comm kernels' SMs: the largest
    min(x*y*z, sm_count) over the kernels whose name `is_comm`."""
    if sm_count < 1:
        raise ValueError(f"sm_count={sm_count}: must be >= 1")
    blocks: dict[str, int] = {}
    for ev in events:
        if str(ev.get("cat", "")).lower() != "kernel":
            continue
        name = str(ev.get("name", ""))
        grid = (ev.get("args") or {}).get("grid")
        if not is_comm(name) or not grid:
            continue
        n = math.prod(int(g) for g in grid)
        blocks[name] = max(n, blocks.get(name, 0))
    sms = max((min(n, sm_count) for n in blocks.values()), default=None)
    return CommKernels(sms, blocks)
