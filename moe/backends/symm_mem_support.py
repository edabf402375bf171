"""What backend `symm_mem` needs from torch, and its symmetric buffers.

`require_symm_mem` checks, in one line each, what a process must have before the backend
can run: torch's `torch.distributed._symmetric_memory` with the op
`torch.ops.symm_mem.all_to_all_vdev` of the schema this backend was written against, a
CUDA device, and NVSHMEM. `SymmBuffers.allocate` makes one set of the backend's buffers,
and `shared_buffers` keeps the sets every layer of a group shares.

Shape legend: W ranks, N = W*C rows (C = `MoEConfig.max_tokens_per_rank`), Bp bytes per
padded packed row, Hp padded hidden size.

Facts about torch's op that the sizes below follow (torch 2.9 to 2.11,
`torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu`):

- Every tensor the op touches must come from `torch.distributed._symmetric_memory.empty`
  with the NVSHMEM backend (`set_backend("NVSHMEM")` before the process's first such
  allocation), be the same size on every rank, and be rendezvoused on the group; the op
  rendezvouses them itself, which on a first call is a host-side exchange, so each buffer
  is rendezvoused here when it is made (never first inside a CUDA graph capture).
- The op splits the bytes it moves for each peer evenly over `num_blocks // W` thread
  blocks and asserts that the split is exact (`block_size * blocks_per_peer ==
  peer_size`): a row count times the row stride must divide by it. `num_blocks` comes
  from the size of the op's input: 64 from 4 MiB up within a node (16 across nodes),
  fewer, and not always a power of two, below. Each block copies its share with
  `nvshmemx_getmem_block` from the share's byte offset, which is fast only 16-byte
  aligned. So every send buffer holds at least `_MIN_SEND_BYTES` and every row stride
  is a multiple of `row_alignment(W)`: then each peer's bytes divide evenly whatever its
  row count, into 16-byte-aligned shares.
- `out_splits_offsets` ([2, W] int64) gets, per source rank, the rows received (row 0)
  and where they start in `out` (row 1, the exclusive prefix sum of row 0: the rows of
  the sources lie back to back in rank order from row 0). Newer versions keep per-call
  signals in that tensor's signal pad, so each such tensor is its own allocation.

Shared sets (`shared_buffers`): one set per (process group, ubatch, row layout, capacity,
device), made by the first layer that dispatches with that key and used by every later
layer, so a model holds two sets (one per ubatch) whatever its number of MoE layers;
layers of another hidden size, top-k, dtype or capacity get their own. The registry holds
groups by weak reference, as `dbo.groups` does for side groups: `release_buffers(group)`
drops a group's sets (`dbo.destroy_group` calls it), and the sets of a group that is gone
are dropped at the next point where a set is made, a point every rank reaches in the
same order. A set is never made inside a CUDA graph capture (allocation and rendezvous
are host-side collectives): the eager warmup before a capture makes it.

NVSHMEM: making a set claims it for `symm_mem` (`moe.backends.nvshmem_owner`), which
refuses in a process that has made a DeepEP low-latency buffer and makes any later one
refuse (DeepEP's low-latency kernels abort a process whose NVSHMEM symm_mem started).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.groups import on_group_destroy
from moe.backends.nvshmem_owner import claim_nvshmem

OP_NAME = "all_to_all_vdev"
#: (name, type, written) of each argument of torch.ops.symm_mem.all_to_all_vdev, which
#: returns nothing: the schema of torch 2.9 to 2.13 (it changed before 2.9).
OP_ARGUMENTS: tuple[tuple[str, str, bool], ...] = (
    ("input", "Tensor", False), ("out", "Tensor", True), ("in_splits", "Tensor", False),
    ("out_splits_offsets", "Tensor", True), ("group_name", "str", False))
_MIN_SEND_BYTES = 4 << 20
_MAX_BLOCKS_INTRA_NODE = 64
_MAX_BLOCKS_INTER_NODE = 16
_FALLBACK = "use backend 'a2a' (exact, NCCL) or 'a2a_ll' (CUDA graphs, NCCL)"


def require_symm_mem() -> Any:
    """Return the op `torch.ops.symm_mem.all_to_all_vdev.default`; raise, in one line,
    what is missing: ImportError without torch's symmetric memory, the op, or NVSHMEM,
    or where the op's schema differs from `OP_ARGUMENTS`; ValueError without CUDA."""
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: F401
        op = getattr(torch.ops.symm_mem, OP_NAME).default
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise ImportError(f"backend 'symm_mem' needs torch.ops.symm_mem.{OP_NAME} "
                          f"(torch.distributed._symmetric_memory, torch >= 2.9 built with "
                          f"NVSHMEM), which this torch {torch.__version__} lacks "
                          f"({type(exc).__name__}); {_FALLBACK}") from None
    schema = op._schema
    found = tuple((a.name, str(a.type), a.alias_info is not None and a.alias_info.is_write)
                  for a in schema.arguments)
    if found != OP_ARGUMENTS or len(schema.returns) != 0:
        raise ImportError(f"backend 'symm_mem' was written for torch.ops.symm_mem.{OP_NAME}"
                          f"(input, out!, in_splits, out_splits_offsets!, group_name) -> (), "
                          f"but this torch {torch.__version__} has '{schema}'; {_FALLBACK}")
    if not torch.cuda.is_available():
        raise ValueError(f"backend 'symm_mem' runs NVSHMEM kernels on CUDA GPUs and this "
                         f"process has no CUDA device: run on GPUs, or {_FALLBACK} (these "
                         f"run on CPU with gloo)")
    if not symm.is_nvshmem_available():
        raise ImportError(f"backend 'symm_mem' needs NVSHMEM (libnvshmem_host.so.3, e.g. "
                          f"pip install nvidia-nvshmem-cu12 or -cu13 to match torch's CUDA), "
                          f"which this process cannot load; {_FALLBACK}")
    return op


def row_alignment(world_size: int) -> int:
    """Bytes every row stride of the op's buffers is a multiple of: 16 times the thread
    blocks per peer the op uses for a send buffer of `_MIN_SEND_BYTES` or more (within a
    node and across nodes). Then each peer's bytes split evenly over its blocks whatever
    its row count, and every block's share starts and ends on a 16-byte boundary, which
    NVSHMEM's block copy needs for its 16-byte loads: with a 32-byte multiple only (the
    even split alone), a 7168-wide bf16 row with its routing (14432 bytes) left the
    blocks' shares unaligned, and the dispatch moved 30 GB/s where the same op moves 410
    GB/s on aligned rows (2x H200, BENCHMARKS.md section 11)."""
    per_peer = [max(blocks // world_size, 1)
                for blocks in (_MAX_BLOCKS_INTRA_NODE, _MAX_BLOCKS_INTER_NODE)]
    return math.lcm(*(16 * blocks for blocks in per_peer))


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


@dataclass(frozen=True)
class SymmBuffers:
    """One ubatch's symmetric buffers (same sizes on every rank), made once and shared by
    every layer of its row layout, every step (`shared_buffers`). Dispatch: `send_XB`
    (rows out, rank-major), `recv_NB` (rows in, sources back to back), `splits_D` [W]
    (rows sent to each rank), `got_D` [2, W] (rows received from each rank, and their
    offsets). Combine: `back_send_YH` (expert outputs of the received rows, in receive
    order), `back_recv_NH` (the outputs of this rank's rows, in its send order),
    `splits_C`, `got_C`. `row_N1`: [N, 1] int64 0..N-1 (plain memory), to mark the
    received rows. uint8 rows are Bp bytes; hidden rows Hp wide."""

    send_XB: Tensor
    recv_NB: Tensor
    splits_D: Tensor
    got_D: Tensor
    back_send_YH: Tensor
    back_recv_NH: Tensor
    splits_C: Tensor
    got_C: Tensor
    row_N1: Tensor

    @staticmethod
    def allocate(*, rows: int, row_bytes: int, hidden: int, dtype: torch.dtype,
                 world_size: int, group_name: str, device: torch.device) -> "SymmBuffers":
        """Make and rendezvous one set of symmetric buffers (`build`). A collective
        (allocation and rendezvous): every rank of the group calls it with the same
        sizes, in the same order."""
        import torch.distributed._symmetric_memory as symm

        def make(shape: tuple[int, ...], kind: torch.dtype) -> Tensor:
            tensor = symm.empty(shape, dtype=kind, device=device)
            symm.rendezvous(tensor, group_name)
            return tensor

        claim_nvshmem("symm_mem")  # RuntimeError after a DeepEP low-latency buffer
        with torch.cuda.device(device):
            _use_nvshmem(symm, device)
            return SymmBuffers.build(make, rows=rows, row_bytes=row_bytes, hidden=hidden,
                                     dtype=dtype, world_size=world_size, device=device)

    @staticmethod
    def build(make: Callable[[tuple[int, ...], torch.dtype], Tensor], *, rows: int,
              row_bytes: int, hidden: int, dtype: torch.dtype, world_size: int,
              device: torch.device) -> "SymmBuffers":
        """One set from `make(shape, dtype)`: N = `rows` rows of `row_bytes` packed bytes
        and of `hidden` expert outputs in `dtype`, row strides padded to
        `row_alignment`, send buffers of at least `_MIN_SEND_BYTES`."""
        align = row_alignment(world_size)
        row_bytes_p = padded(row_bytes, align)
        hidden_p = padded(hidden * dtype.itemsize, align) // dtype.itemsize
        send_rows = max(rows, -(-_MIN_SEND_BYTES // row_bytes_p))
        back_rows = max(rows, -(-_MIN_SEND_BYTES // (hidden_p * dtype.itemsize)))
        bufs = SymmBuffers(
            send_XB=make((send_rows, row_bytes_p), torch.uint8),
            recv_NB=make((rows, row_bytes_p), torch.uint8),
            splits_D=make((world_size,), torch.int64),
            got_D=make((2, world_size), torch.int64),
            back_send_YH=make((back_rows, hidden_p), dtype),
            back_recv_NH=make((rows, hidden_p), dtype),
            splits_C=make((world_size,), torch.int64),
            got_C=make((2, world_size), torch.int64),
            row_N1=torch.arange(rows, dtype=torch.int64, device=device)[:, None])
        # Rows past what a call receives keep what was there: make that finite once.
        for tensor in (bufs.send_XB, bufs.recv_NB, bufs.back_send_YH, bufs.back_recv_NH):
            tensor.zero_()
        return bufs


@dataclass(frozen=True)
class _Shared:
    """One shared set: its group (held weakly), key and buffers."""

    owner: "weakref.ref[dist.ProcessGroup]"
    key: Hashable
    device: torch.device
    buffers: SymmBuffers


# Every shared set made here, in the order made (process groups and symmetric memory are
# process-wide objects).
_SHARED: list[_Shared] = []


def shared_buffers(group: dist.ProcessGroup, key: Hashable, *, device: torch.device,
                   make: Callable[[], SymmBuffers]) -> SymmBuffers:
    """The set of (`group`, `key`) on `device`, made by `make()` (a collective,
    `SymmBuffers.allocate`) on the first request and shared by every later one. `key`
    names what the set's sizes and users depend on: (ubatch id, row layout, rows).

    Collective when it makes one: every rank of `group` reaches the first request of a
    key in the same order (a ubatch's first dispatch of that layout). Raises
    RuntimeError inside a CUDA graph capture, where nothing may be allocated."""
    for entry in _SHARED:
        if entry.owner() is group and entry.key == key and entry.device == device:
            return entry.buffers
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"backend 'symm_mem' would make its symmetric buffers for {key} "
                           f"inside a CUDA graph capture, where nothing may be allocated: "
                           f"run the step eagerly first (GraphedRunner warms up before "
                           f"it captures)")
    _release_orphans()
    buffers = make()
    _SHARED.append(_Shared(weakref.ref(group), key, device, buffers))
    return buffers


def num_shared_sets(group: dist.ProcessGroup) -> int:
    """How many sets `group` holds (two per row layout, one per ubatch that has run)."""
    return sum(entry.owner() is group for entry in _SHARED)


def release_buffers(group: dist.ProcessGroup) -> None:
    """Drop `group`'s shared sets (on every rank, after the group's last `symm_mem`
    operation, before the group is destroyed; `dbo.destroy_group` calls it). Layers
    built on them must not run afterwards. The memory goes with the last reference,
    the layers' included (torch's allocator may keep rendezvoused memory until the
    process ends)."""
    _SHARED[:] = [entry for entry in _SHARED if entry.owner() is not group]


on_group_destroy(release_buffers)  # `dbo.destroy_group` drops them with the group


def _release_orphans() -> None:
    """Drop the sets of groups that are gone (collected, or destroyed in torch)."""
    # torch has no public query for a live group (dbo.groups reads the same map).
    live = dist.distributed_c10d._world.pg_map
    _SHARED[:] = [entry for entry in _SHARED
                  if (group := entry.owner()) is not None and group in live]


def _use_nvshmem(symm: Any, device: torch.device) -> None:
    """Make NVSHMEM the symmetric-memory backend, which must happen before the process's
    first symmetric allocation."""
    if getattr(symm, "get_backend", None) is not None and symm.get_backend(device) == "NVSHMEM":
        return
    try:
        symm.set_backend("NVSHMEM")
    except RuntimeError as exc:
        raise RuntimeError(f"backend 'symm_mem' needs torch symmetric memory's NVSHMEM "
                           f"backend, but it cannot be set now ({exc}): call "
                           f"torch.distributed._symmetric_memory.set_backend('NVSHMEM') "
                           f"before this process allocates any symmetric memory") from None
