"""What backend `nccl_ep` needs from NCCL EP (`nccl.ep`, the nccl-extensions package): the
checks that refuse before ranks start, and the EP groups it builds on torch's NCCL
communicator.

NCCL EP (NCCL's own expert-parallel dispatch and combine, on NCCL's device API) runs on
NCCL >= 2.29. Its Python bindings come in the `nccl-extensions` package (`pip install
nccl-extensions`, which also brings `nccl4py`); the NCCL that torch loads must be new
enough (a newer `nvidia-nccl-cu13` from the package index). Importing `moe` imports
neither: `nccl.ep` is imported when a layer is built.

EP groups. An `nccl.ep.Group` owns the staging buffers its handles' operations use; a
low-latency handle alternates between two of them per call (dispatch, combine, dispatch,
...), as DeepEP's low-latency buffer does. Two ubatches interleave their calls, and a
send-only dispatch stays in flight until its completion runs under the other ubatch, so
each ubatch gets a group of its own (`EPGroups`): within one ubatch the layers' calls
follow one another, dispatch then combine, which is the alternation the buffers expect.
"""
from __future__ import annotations

import importlib
import importlib.util
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dbo.groups import on_group_destroy
from moe.backends.nccl_comm import nccl_comm_ptr, torch_nccl_version

#: The oldest NCCL that NCCL EP runs on (it uses NCCL's device API).
MIN_NCCL = (2, 29, 0)

NAME = "nccl_ep"
#: The low-latency kernels' unit of hidden values for bf16: the combine's receive reads
#: 32 lanes x 2 unrolls x 8 values (the dispatch 32 x 8).
LL_HIDDEN_MULTIPLE = 512
OR_USE = "or use backend 'a2a' or 'a2a_ll'"
HOW_TO_GET = ("pip install nccl-extensions (NCCL EP's Python bindings; it needs NCCL >= "
              "2.29, e.g. a newer nvidia-nccl-cu13 from the package index)")


def nccl_ep_installed() -> bool:
    """Whether nccl-extensions' `nccl.ep` is installed, without importing it."""
    try:
        return (importlib.util.find_spec("nccl") is not None
                and importlib.util.find_spec("nccl.ep") is not None)
    except (ImportError, ValueError):  # `nccl` is not a package here
        return False


def find_nccl_ep() -> Optional[ModuleType]:
    """`nccl.ep` where nccl-extensions is installed (imported here: it loads NCCL EP's
    library), or None where it is not."""
    return importlib.import_module("nccl.ep") if nccl_ep_installed() else None


def require_nccl_ep(*, installed: Callable[[], bool] = nccl_ep_installed,
                    cuda_available: Callable[[], bool] = torch.cuda.is_available,
                    nccl_version: Callable[[], Optional[tuple[int, ...]]] = torch_nccl_version,
                    find: Callable[[], Optional[ModuleType]] = find_nccl_ep) -> ModuleType:
    """The `nccl.ep` module, where this process has what NCCL EP needs; otherwise raise, in
    one line, what is missing and how to get it: ImportError for no nccl-extensions or an
    NCCL older than 2.29, ValueError for no CUDA device. The keyword arguments are where
    the facts come from (tests pass stand-ins). Checked in this order, so a CPU machine
    hears first about what it can install."""
    if not installed():
        raise ImportError(f"backend '{NAME}' needs NCCL EP (nccl.ep), which is not "
                          f"installed: {HOW_TO_GET}; {OR_USE}")
    if not cuda_available():
        raise ValueError(f"backend '{NAME}' runs NCCL EP's CUDA kernels and this process "
                         f"has no CUDA device: run on GPUs, or use backend 'a2a' or "
                         f"'a2a_ll' (these run on CPU with gloo)")
    version = nccl_version()
    if version is None or tuple(version) < MIN_NCCL:
        found = "no NCCL" if version is None else "NCCL " + ".".join(map(str, version))
        raise ImportError(f"backend '{NAME}' needs NCCL >= 2.29 (NCCL EP uses NCCL's device "
                          f"API) but this process runs {found}: install a newer NCCL "
                          f"(nvidia-nccl-cu13 >= 2.29 from the package index) for torch to "
                          f"load; {OR_USE}")
    module = find()
    if module is None:  # installed() said yes: a broken install
        raise ImportError(f"backend '{NAME}': nccl.ep could not be imported: {HOW_TO_GET}; "
                          f"{OR_USE}")
    return module


def check_nccl_ep_rows(hidden_size: int, dtype: torch.dtype, mode: str) -> None:
    """ValueError where NCCL EP cannot move rows of `hidden_size` values of `dtype` in
    form `mode`: bfloat16 only (the form measured), a multiple of 16 bytes each (the
    high-throughput kernels' unit), and in the low-latency form a multiple of 512 values
    (its combine receives 32 lanes x 2 unrolls of 16 bytes per step: static assertions
    in NCCL EP's kernels, which otherwise fail to compile at the first call)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"backend '{NAME}' moves torch.bfloat16 tokens only, but "
                         f"MoEConfig.dtype is {dtype}: set MoEConfig.dtype=torch.bfloat16; "
                         f"{OR_USE}")
    if hidden_size * 2 % 16:
        raise ValueError(f"backend '{NAME}' moves rows of a multiple of 16 bytes, but "
                         f"hidden_size={hidden_size} bf16 values are {hidden_size * 2} "
                         f"bytes: use a multiple of 8; {OR_USE}")
    if mode == "ll" and hidden_size % LL_HIDDEN_MULTIPLE:
        raise ValueError(f"backend '{NAME}' in its low-latency form (NCCLEPOptions.mode='ll') "
                         f"moves rows of a multiple of {LL_HIDDEN_MULTIPLE} bf16 values, but "
                         f"hidden_size={hidden_size}: use NCCLEPOptions(mode='ht'), or "
                         f"{OR_USE}")


class Descriptors:
    """`nccl.ep.Tensor` descriptors of CUDA tensors, and the bundles made of them
    (`DispatchInputs`, ...), kept for reuse: making them is most of a call's host time
    (on an H200, 118 us of host time per low-latency dispatch made anew each call
    against 14 us for NCCL EP's own call). A descriptor holds a tensor's address, shape
    and dtype only, so one made for the same three describes the same thing; the caching
    allocator hands a step the addresses of the step before, so steady steps hit.

    The newest `size` of each are kept. A descriptor must outlive the call it is passed
    to (the bundles hold only its address) and, for a send-only call, its completion:
    callers hold the ones of a call in flight (found on an H200: a descriptor collected
    first made the call read garbage)."""

    def __init__(self, ep: ModuleType, size: int = 64) -> None:
        self._ep = ep
        self._size = size
        self._tensors: OrderedDict[tuple, Any] = OrderedDict()
        self._bundles: OrderedDict[tuple, Any] = OrderedDict()

    def of(self, t: torch.Tensor) -> Any:
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        return self._cached(self._tensors, key, lambda: self._ep.Tensor(t))

    def bundle(self, kind: str, **fields: Any) -> tuple[Any, tuple]:
        """(`nccl.ep.<kind>(**fields)`, the descriptors it points to): `fields` are CUDA
        tensors (described here, `of`) or plain values. A bundle holds only its
        descriptors' addresses: whoever passes it to a call holds the pair until the call
        (or its completion) is done."""
        def describe(value: Any) -> Any:
            return self.of(value) if isinstance(value, torch.Tensor) else value

        def key_of(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return (value.data_ptr(), tuple(value.shape), value.dtype)
            return value

        key = (kind, *((name, key_of(value)) for name, value in sorted(fields.items())))

        def make() -> tuple[Any, tuple]:
            described = {name: describe(value) for name, value in fields.items()}
            return getattr(self._ep, kind)(**described), tuple(described.values())

        return self._cached(self._bundles, key, make)

    def _cached(self, table: OrderedDict, key: tuple, make: Callable[[], Any]) -> Any:
        found = table.get(key)
        if found is not None:
            table.move_to_end(key)
            return found
        made = table[key] = make()
        if len(table) > self._size:
            table.popitem(last=False)
        return made


@dataclass(frozen=True)
class GroupKey:
    """What an EP group's buffers depend on: the algorithm ("ll"/"ht"), the experts, the
    capacity per rank, bytes per row, the SM limit (0: the library's choice), and the
    ubatch that uses it."""

    mode: str
    num_experts: int
    capacity: int
    row_bytes: int
    num_sms: int
    ubatch: int


@dataclass
class _Entry:
    owner: "weakref.ref[dist.ProcessGroup]"
    key: GroupKey
    comm: Any  # nccl.core.Communicator over torch's communicator: kept with the group
    group: Any  # nccl.ep.Group
    handles: list[Any]  # nccl.ep.Handle made on it, destroyed before it


class EPGroups:
    """The EP groups of the process, one per (process group, `GroupKey`), shared by every
    layer: made (a collective) on the first request of a key, which every rank reaches
    in the same order (a ubatch's first dispatch at that shape). Handles are made here
    too, so that `release` destroys them before their group; they live as long as the
    group (a layer built and dropped again and again leaves its handles until then).
    Handles are made through NCCL EP's bindings (`init_handle`: one not yet bound to any
    routing), which its Python classes do not offer."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def handle(self, ep: ModuleType, pg: dist.ProcessGroup, key: GroupKey, *,
               num_topk: int) -> Any:
        """A new handle on (pg, key)'s group, not yet bound to any routing: low latency,
        expert-major, for `num_topk` ids per token; high throughput, flat. Local where the
        group's staging buffer is already large enough, else collective (NCCL EP grows
        it), so a layer makes its handles at the same point on every rank. Both forms take
        `num_topk` (the high-throughput form too, though NCCL EP's header says -1 there:
        the library refuses that)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"backend '{NAME}' would make an NCCL EP handle inside a CUDA "
                               f"graph capture: run the step eagerly first (GraphedRunner "
                               f"warms up before it captures)")
        entry = self._entry(ep, pg, key)
        from nccl._extensions.bindings import nccl_ep as bindings
        layout = ep.Layout.EXPERT_MAJOR if key.mode == "ll" else ep.Layout.FLAT
        handle = ep.Handle(bindings.init_handle(entry.group.ptr, int(layout), 0, num_topk, 0))
        entry.handles.append(handle)
        return handle

    def _entry(self, ep: ModuleType, pg: dist.ProcessGroup, key: GroupKey) -> _Entry:
        self._release_orphans()
        for entry in self._entries:
            if entry.owner() is pg and entry.key == key:
                return entry
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"backend '{NAME}' would make an NCCL EP group for {key} "
                               f"inside a CUDA graph capture: run the step eagerly first "
                               f"(GraphedRunner warms up before it captures)")
        import nccl.core
        comm = nccl.core.Communicator(nccl_comm_ptr(pg))
        high_throughput = key.mode == "ht"
        world = dist.get_world_size(pg)
        config = ep.GroupConfig(
            algorithm=ep.Algorithm.HIGH_THROUGHPUT if high_throughput else ep.Algorithm.LOW_LATENCY,
            num_experts=key.num_experts, max_dispatch_tokens_per_rank=key.capacity,
            max_recv_tokens_per_rank=world * key.capacity if high_throughput else 0,
            max_token_bytes=key.row_bytes, max_num_sms=key.num_sms)
        entry = _Entry(weakref.ref(pg), key, comm, ep.Group.create(comm, config), [])
        self._entries.append(entry)
        return entry

    def release(self, pg: dist.ProcessGroup) -> None:
        """Destroy `pg`'s handles and groups (every rank, after the last `nccl_ep` call on
        it and before the process group goes; `dbo.destroy_group` calls it). Layers built
        on them must not run afterwards."""
        keep = []
        for entry in self._entries:
            if entry.owner() is pg:
                _destroy(entry)
            else:
                keep.append(entry)
        self._entries = keep

    def _release_orphans(self) -> None:
        """Forget the groups whose process group is gone (its communicator went with it)."""
        self._entries = [e for e in self._entries if e.owner() is not None]


def _destroy(entry: _Entry) -> None:
    for handle in entry.handles:
        handle.destroy()
    entry.group.destroy()


#: The process's EP groups (process groups are process-wide objects).
GROUPS = EPGroups()


on_group_destroy(GROUPS.release)  # `dbo.destroy_group` destroys them with the group

