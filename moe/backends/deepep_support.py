"""What the DeepEP backends (`deepep_ht`, `deepep_ll`, `deepep_v2`) share: the refusals
(DeepEP's `deep_ep` package with the right class, and CUDA), the shape rules DeepEP's
kernels impose, and one `deep_ep.Buffer` per process group and mode.

`deep_ep` is imported only here, inside `require_deep_ep`, when a layer with one of
these backends is constructed: importing `moe` never needs it.

Buffers (`shared_buffer`): a DeepEP `Buffer` holds NVLink (normal kernels) or NVSHMEM
(low-latency kernels) memory registered with every peer, and making one is collective
over the group. So there is one per (group, mode), made by the first layer that needs
it, reused by every later layer and by both ubatches, and grown (destroyed and made
anew, collectively, at a layer's construction) when a layer needs more than it holds.
The registry holds groups by weak reference, as `dbo.groups` does for side groups:
`destroy_buffers(group)` tears a group's buffers down (call it on every rank before
destroying the group), and the buffers of a group that is gone are torn down at the
next point where a buffer is made, a point every rank reaches in the same order.
Buffers are made with `explicitly_destroy=True`: DeepEP's destructor would otherwise run
a cross-rank barrier whenever Python happens to collect it. A low-latency buffer claims
NVSHMEM first (`moe.backends.nvshmem_owner`): refused in a process where backend
`symm_mem` has started it, as DeepEP's low-latency kernels would abort the process.
"""
from __future__ import annotations

import importlib
import importlib.util
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from dbo.groups import on_group_destroy
from moe.backends.nvshmem_owner import claim_nvshmem
from moe.config import round_up_hidden

_HOW_TO_GET = {
    "Buffer": ("build DeepEP v1 from source for your torch and CUDA "
               "(github.com/deepseek-ai/DeepEP, see its README; it needs NVSHMEM) and pip "
               "install it"),
    "ElasticBuffer": ("build DeepEP v2 (the main branch of github.com/deepseek-ai/DeepEP, "
                      "see its README; it needs NCCL >= 2.30.4) and pip install it"),
}

#: NVSHMEM's default queue depth (NVSHMEM_QP_DEPTH), which bounds deepep_ll's capacity:
#: DeepEP asserts a depth of at least 2 (C + 1) (`ll_capacity`).
DEFAULT_NVSHMEM_QP_DEPTH = 1024
#: DeepEP counts its buffers in 16-byte units in an int: a buffer must hold fewer than
#: 2**31 - 1 of them (it asserts `num_rdma_bytes / sizeof(int4) < INT_MAX`).
DEEPEP_MAX_INT4S = 2**31 - 1
#: Hidden sizes DeepEP's low-latency kernels are compiled for (`SWITCH_HIDDEN`).
LL_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: Rank counts of one node that DeepEP's normal (intranode) kernels take.
HT_WORLD_SIZES: tuple[int, ...] = (2, 4, 8)
#: DeepEP's intranode kernels copy rows in units of 32 lanes x 16 bytes.
HT_COPY_UNIT_BYTES = 512


def require_deep_ep(backend: str, cls_name: str) -> ModuleType:
    """The `deep_ep` module, or raise in one line what is missing for `backend` and how to
    get it: ImportError without `deep_ep` or without its `cls_name` ("Buffer" for v1,
    "ElasticBuffer" for v2), ValueError without CUDA."""
    how = _HOW_TO_GET[cls_name]
    if importlib.util.find_spec("deep_ep") is None:
        raise ImportError(f"backend {backend!r} needs DeepEP (deep_ep.{cls_name}), which is "
                          f"not installed: {how}; or use backend 'a2a' or 'a2a_ll'")
    deep_ep = importlib.import_module("deep_ep")
    if not hasattr(deep_ep, cls_name):
        raise ImportError(f"backend {backend!r} needs deep_ep.{cls_name}, which the installed "
                          f"deep_ep lacks: {how}; or use backend 'a2a' or 'a2a_ll'")
    if not torch.cuda.is_available():
        raise ValueError(f"backend {backend!r} runs DeepEP's CUDA kernels and this process "
                         f"has no CUDA device: run on GPUs, or use backend 'a2a' or 'a2a_ll' "
                         f"(these run on CPU with gloo)")
    return deep_ep


# ---------------------------------------------------------------- shape rules (pure)

def ht_padded_hidden(backend: str, hidden_size: int, dtype: torch.dtype) -> int:
    """The hidden size `deepep_ht` sends: `hidden_size` rounded up to whole 512-byte copy
    units (the caller pads x and slices the result). DeepEP's normal combine sums
    bfloat16 only, so other dtypes are refused (ValueError saying how to fix)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"backend {backend!r}: MoEConfig.dtype={dtype} is not supported: "
                         f"DeepEP's normal combine sums bfloat16 rows only; set "
                         f"MoEConfig.dtype=torch.bfloat16")
    return round_up_hidden(hidden_size, dtype, HT_COPY_UNIT_BYTES)


def check_ht_world(backend: str, world_size: int) -> None:
    """DeepEP's normal kernels here run within one node (NVLink): 2, 4 or 8 ranks."""
    if world_size not in HT_WORLD_SIZES:
        raise ValueError(f"backend {backend!r}: an EP group of {world_size} rank(s) is not "
                         f"supported: DeepEP's intranode kernels take {HT_WORLD_SIZES} ranks "
                         f"of one node; use backend 'a2a' (or 'local' on one rank)")


def check_ll_shape(backend: str, hidden_size: int, dtype: torch.dtype, world_size: int) -> None:
    """DeepEP's low-latency kernels take bfloat16 rows of a few hidden sizes, over >= 2 ranks."""
    if hidden_size not in LL_HIDDEN_SIZES:
        raise ValueError(f"backend {backend!r}: MoEConfig.hidden_size={hidden_size} is not "
                         f"supported: DeepEP's low-latency kernels are compiled for hidden "
                         f"sizes {LL_HIDDEN_SIZES}; use one of them, or backend 'deepep_ht' "
                         f"or 'a2a_ll'")
    if dtype != torch.bfloat16:
        raise ValueError(f"backend {backend!r}: MoEConfig.dtype={dtype} is not supported: "
                         f"DeepEP's low-latency kernels move bfloat16 rows; set "
                         f"MoEConfig.dtype=torch.bfloat16")
    check_ll_world(backend, world_size)


def check_ll_world(backend: str, world_size: int) -> None:
    """DeepEP's low-latency kernels exchange between 2 or more ranks."""
    if world_size < 2:
        raise ValueError(f"backend {backend!r} needs an EP group of at least 2 ranks (got "
                         f"{world_size}); use backend 'local' on one rank")


def check_ll_depth(option: str, max_tokens: int, world_size: int, *, backend_option: str,
                   env: Mapping[str, str]) -> None:
    """Refuse `max_tokens` per rank (`option`, e.g. "--max-tokens") for backend deepep_ll
    (`backend_option`, as the command names it) on `world_size` ranks where DeepEP's
    capacity would not fit NVSHMEM's queue depth: DeepEP asserts NVSHMEM_QP_DEPTH (1024
    by default; read from `env`, the caller's environment) >= 2 (C + 1), C the capacity
    `ll_capacity` gives it."""
    depth = int(env.get("NVSHMEM_QP_DEPTH", DEFAULT_NVSHMEM_QP_DEPTH))
    capacity = ll_capacity(max_tokens, world_size)
    if 2 * (capacity + 1) <= depth:
        return
    fits = next((n for n in range(min(max_tokens - 1, depth // 2), 0, -1)
                 if 2 * (ll_capacity(n, world_size) + 1) <= depth), 0)
    raise ValueError(f"{option}={max_tokens} with {backend_option} on {world_size} ranks: "
                     f"DeepEP's capacity {capacity} needs an NVSHMEM queue depth of "
                     f"{2 * (capacity + 1)}, above NVSHMEM_QP_DEPTH={depth}; use {option} "
                     f"<= {fits}, or raise NVSHMEM_QP_DEPTH")


def ll_capacity(max_tokens_per_rank: int, world_size: int) -> int:
    """The per-rank capacity `deepep_ll` gives DeepEP: `max_tokens_per_rank` rounded up so
    that ranks * capacity is a multiple of 4 (DeepEP's TMA loads of the FP8 scales need
    it; a larger capacity only pads the receive buffer)."""
    capacity = max_tokens_per_rank
    while (capacity * world_size) % 4:
        capacity += 1
    return capacity


@dataclass(frozen=True)
class LLRowConstants:
    """What `ll_expert_ids` compares against, made once per shape: row_1N [1, N] int64
    0..N-1 (N rows per expert block), expert_E1 [E_loc, 1] int64 0..E_loc-1, and
    ones_R1 [E_loc * N, 1] float32 (the experts' weight of every row)."""

    row_1N: torch.Tensor
    expert_E1: torch.Tensor
    ones_R1: torch.Tensor

    @staticmethod
    def make(num_local: int, rows_per_expert: int, device: torch.device) -> "LLRowConstants":
        return LLRowConstants(
            torch.arange(rows_per_expert, device=device).unsqueeze(0),
            torch.arange(num_local, device=device).unsqueeze(1),
            torch.ones(num_local * rows_per_expert, 1, dtype=torch.float32, device=device))


def ll_expert_ids(recv_count_E: torch.Tensor, rows: LLRowConstants) -> torch.Tensor:
    """[E_loc * N, 1] int64: row j of expert e's block in DeepEP's expert-major receive
    buffer holds a token for local expert e when j < recv_count[e], else padding (-1,
    routed to no expert). Two small GPU kernels (compare, select; few host calls matter
    at decode sizes): nothing read on the host."""
    valid_EN = rows.row_1N < recv_count_E.unsqueeze(1)
    return torch.where(valid_EN, rows.expert_E1, -1).reshape(-1, 1)


def dequantize_fp8(x_ENH: torch.Tensor, scales_ENS: torch.Tensor) -> torch.Tensor:
    """DeepEP's FP8 dispatch output -> bfloat16 [E*N, H]: x [E, N, H] float8_e4m3fn times
    its per-128-channel float32 scales [E, N, H/128] (any strides: DeepEP returns them
    column-major). Padding rows may come out NaN; the experts mask them (ids -1)."""
    num_local, rows, hidden = x_ENH.shape
    groups = scales_ENS.shape[-1]
    assert hidden == groups * 128, (hidden, groups)
    x_ENG = x_ENH.view(num_local, rows, groups, 128).to(torch.float32)
    return (x_ENG * scales_ENS.unsqueeze(-1)).to(torch.bfloat16).view(num_local * rows, hidden)


# ---------------------------------------------------------------- buffers

@dataclass
class SharedBuffer:
    """One `deep_ep.Buffer` of a group and mode ("ht" normal, "ll" low-latency), shared by
    every layer and both ubatches. Layers keep this record, never the `Buffer` itself,
    so a buffer grown for a later layer is the one every layer uses.

    `ll_in_flight` counts low-latency operations whose receive half has not run: DeepEP
    has two low-latency buffers, so a third send would overwrite a pending receive."""

    mode: str
    buffer: Any
    num_nvl_bytes: int
    num_rdma_bytes: int
    num_qps_per_rank: int
    ll_in_flight: int = 0

    def ll_started(self) -> None:
        self.ll_in_flight += 1
        assert self.ll_in_flight <= 2, (
            "more than two DeepEP low-latency operations in flight (one per ubatch at most)")

    def ll_received(self) -> None:
        assert self.ll_in_flight > 0
        self.ll_in_flight -= 1


@dataclass
class _Entry:
    owner: "weakref.ref[dist.ProcessGroup]"
    shared: SharedBuffer


# Every buffer made here (process groups and DeepEP buffers are process-wide objects).
_ENTRIES: list[_Entry] = []


def shared_buffer(deep_ep: ModuleType, group: dist.ProcessGroup, mode: str, *,
                  num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                  num_qps_per_rank: int = 1) -> SharedBuffer:
    """The `deep_ep.Buffer` of (`group`, `mode`) holding at least the given bytes, made or
    grown here. Collective when it makes one: call it at a point every rank of `group`
    reaches in the same order (a layer's construction)."""
    assert mode in ("ht", "ll"), mode
    if mode == "ll":
        claim_nvshmem("deepep_ll")  # RuntimeError after symm_mem, before DeepEP is called
    _destroy_orphans()
    for entry in _ENTRIES:
        if entry.owner() is group and entry.shared.mode == mode:
            shared = entry.shared
            if (shared.num_nvl_bytes >= num_nvl_bytes and shared.num_rdma_bytes >= num_rdma_bytes
                    and shared.num_qps_per_rank >= num_qps_per_rank):
                return shared
            # Grow: one buffer per group and mode (NVSHMEM is set up once per buffer).
            _destroy(shared)  # a failed remake below leaves None, not a destroyed Buffer
            shared.num_nvl_bytes = max(shared.num_nvl_bytes, num_nvl_bytes)
            shared.num_rdma_bytes = max(shared.num_rdma_bytes, num_rdma_bytes)
            shared.num_qps_per_rank = max(shared.num_qps_per_rank, num_qps_per_rank)
            shared.buffer = _make(deep_ep, group, shared)
            return shared
    shared = SharedBuffer(mode, None, num_nvl_bytes, num_rdma_bytes, num_qps_per_rank)
    shared.buffer = _make(deep_ep, group, shared)
    _ENTRIES.append(_Entry(weakref.ref(group), shared))
    return shared


def ll_queue_depth(group: dist.ProcessGroup) -> Optional[int]:
    """The NVSHMEM queue depth of `group`'s low-latency buffer (DeepEP's
    `Buffer.nvshmem_qp_depth`), None where none is made. A remade (grown) buffer gets the
    same depth: DeepEP reads it from NVSHMEM_QP_DEPTH, which its first buffer set."""
    for entry in _ENTRIES:
        if (entry.owner() is group and entry.shared.mode == "ll"
                and entry.shared.buffer is not None):
            return getattr(entry.shared.buffer, "nvshmem_qp_depth", None)
    return None


def destroy_buffers(group: dist.ProcessGroup) -> None:
    """Tear down `group`'s DeepEP buffers (collective: every rank of the group, after its
    last DeepEP operation, before the group is destroyed; `dbo.destroy_group` calls it).
    Layers built on them must not run afterwards."""
    for entry in [e for e in _ENTRIES if e.owner() is group]:
        _ENTRIES.remove(entry)
        _destroy(entry.shared)


on_group_destroy(destroy_buffers)  # `dbo.destroy_group` tears them down with the group


def _make(deep_ep: ModuleType, group: dist.ProcessGroup, shared: SharedBuffer) -> Any:
    low_latency = shared.mode == "ll"
    return deep_ep.Buffer(group, num_nvl_bytes=shared.num_nvl_bytes,
                          num_rdma_bytes=shared.num_rdma_bytes, low_latency_mode=low_latency,
                          num_qps_per_rank=shared.num_qps_per_rank,
                          allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)


def _destroy(shared: SharedBuffer) -> None:
    if shared.buffer is not None:
        shared.buffer.destroy()
        shared.buffer = None


def _destroy_orphans() -> None:
    """Tear down the buffers of groups that are gone (collected, or destroyed in torch)."""
    for entry in list(_ENTRIES):
        group = entry.owner()
        if group is None or not _live(group):
            _ENTRIES.remove(entry)
            _destroy(entry.shared)


def _live(group: dist.ProcessGroup) -> bool:
    """Whether `group` is still registered with torch (not destroyed)."""
    # torch has no public query for this (dbo.groups reads the same map).
    return group in dist.distributed_c10d._world.pg_map


def ht_buffer_bytes(deep_ep: ModuleType, hidden_bytes: int, world_size: int) -> tuple[int, int]:
    """(NVLink bytes, RDMA bytes) DeepEP's hints ask for normal-kernel rows of
    `hidden_bytes`, the larger of its dispatch and combine configs (the token count does
    not matter: the NVLink buffer is a ring of chunks)."""
    buffer_cls = deep_ep.Buffer
    nvl = rdma = 0
    for config in (buffer_cls.get_dispatch_config(world_size),
                   buffer_cls.get_combine_config(world_size)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, world_size))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, world_size))
    return nvl, rdma


def ht_configs(deep_ep: ModuleType, world_size: int) -> tuple[Any, Any]:
    """DeepEP's recommended (dispatch, combine) `Config`s for `world_size` ranks."""
    return (deep_ep.Buffer.get_dispatch_config(world_size),
            deep_ep.Buffer.get_combine_config(world_size))

