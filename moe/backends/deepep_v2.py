"""`deepep_v2`: dispatch and combine through DeepEP v2's `deep_ep.ElasticBuffer`.

Shape legend: T tokens here (T <= C), C = `MoEConfig.max_tokens_per_rank`, H hidden,
K top-k, W ranks, E_loc experts per rank, R rows received for this rank's experts.

Not yet measured against the real library on two GPUs (it needs NCCL >= 2.30.4 loaded,
and peers: on one rank DeepEP v2's own dispatch crashes). The adapter follows DeepEP's
contract (`deep_ep/buffers/elastic.py`: `ElasticBuffer.dispatch`, `.combine`,
`EPHandle`), is tested through a fake that reproduces it
(`tests/moe/fake_elastic_buffer.py`), and builds its buffer on the real library (H200,
NCCL 2.30.7, DeepEP main at dd758ca) once the group's NCCL communicator has started.

Two modes (`DeepEPV2Options.mode`):

- "prefill": `do_cpu_sync=True, do_expand=True`. The dispatch blocks the host until the
  counts arrive and returns exactly R rows, expert-major: one row per (token, local expert
  it picked), each with its own weight. Each row goes to one expert (ids [R, 1]).
- "decode": `do_cpu_sync=False, do_expand=False`. No host wait: the outputs are sized for
  the worst case, R = W * C rows (one per token and rank, with its K ids made local, -1
  elsewhere), and the true count stays on the GPU in
  `EPHandle.psum_num_recv_tokens_per_scaleup_rank[-1]`; rows past it are uninitialised,
  so their ids are masked to -1 here. CUDA-graph capturable (`graph_safe`).

Weights: the experts weight each row once; DeepEP's combine is an unweighted sum (its
`topk_weights` argument is only reduced and handed back, never multiplied in), so it is
called without them.

Streams: DeepEP runs every call on its one comm stream. Each call gets `previous_event`,
an event captured on the compute stream *before* any yield (captured after one, it would
also cover the other ubatch's queued compute), `allocate_on_comm_stream=True` (DeepEP
requires it with `previous_event`) and `async_with_compute_stream=True`: the compute
stream is not held, and the receiver makes it wait on the call's event
(`EventOverlap.current_stream_wait`); DeepEP records its tensors on both streams. In
prefill mode the dispatch blocks the host, so, as `a2a` does, it yields first (the other
ubatch queues its compute) unless the other ubatch has not started yet, and the combine
yields before its send, which keeps the transfers alternating between the ubatches. In
decode mode both halves send first and yield after, as `a2a_ll` does.

One `ElasticBuffer` per (process group, size) serves every layer and both ubatches
(`ElasticBufferPool`); per-call state is the frozen `V2Handle` the ubatch owns.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.yield_points import dbo_enabled, dbo_other_ubatch_started, dbo_yield
from moe.backend_options import BackendOptions
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity
from moe.backends.nccl_comm import group_live, start_nccl_comm, torch_nccl_version
from moe.config import MoEConfig
from moe.workspace import Workspace

#: The oldest NCCL DeepEP v2 runs on (its README; it uses NCCL's device API).
MIN_NCCL = (2, 30, 4)

_HOW_TO_GET = ("build DeepEP v2 (the main branch of github.com/deepseek-ai/DeepEP, see its "
               "README; it needs NCCL >= 2.30.4) and pip install it")
_OR = "or use backend 'a2a' or 'a2a_ll'"
_NEEDS_GROUP = ("backend 'deepep_v2' needs an expert-parallel process group (an "
                "ElasticBuffer is built on one): pass group=..., or use backend 'local' on "
                "one process")


def _find_deep_ep() -> Optional[ModuleType]:
    """The installed `deep_ep`, or None (imported only when a layer is built)."""
    if importlib.util.find_spec("deep_ep") is None:
        return None
    return importlib.import_module("deep_ep")


def elastic_buffer_class(config: MoEConfig, group: Optional[dist.ProcessGroup], *,
                         find_deep_ep: Callable[[], Optional[ModuleType]] = _find_deep_ep,
                         nccl_version: Callable[[], Optional[tuple[int, ...]]] = torch_nccl_version,
                         cuda_available: Callable[[], bool] = torch.cuda.is_available) -> type:
    """`deep_ep.ElasticBuffer`, once everything it needs is here; otherwise raise, in one
    line, what is missing and how to get it. The keyword arguments are where the facts
    come from (tests pass stand-ins).

    ImportError: no `deep_ep`, a `deep_ep` without `ElasticBuffer` (DeepEP v1), NCCL
    older than 2.30.4. ValueError: no CUDA, no process group, a dtype other than
    bfloat16, rows that are not a multiple of 16 bytes.
    """
    deep_ep = require_elastic_buffer(find_deep_ep=find_deep_ep, nccl_version=nccl_version,
                                     cuda_available=cuda_available)
    if group is None:
        raise ValueError(_NEEDS_GROUP)
    check_v2_rows(config)
    return deep_ep.ElasticBuffer


def check_v2_rows(config: MoEConfig) -> None:
    """ValueError where DeepEP v2 cannot move `config`'s rows: bfloat16 only, a multiple
    of 16 bytes each."""
    if config.dtype != torch.bfloat16:
        raise ValueError(f"backend 'deepep_v2' moves torch.bfloat16 tokens only (DeepEP v2's "
                         f"combine takes bf16) but MoEConfig.dtype is {config.dtype}: set "
                         f"MoEConfig.dtype=torch.bfloat16; {_OR}")
    if config.hidden_size * 2 % 16:
        raise ValueError(f"backend 'deepep_v2' moves rows of a multiple of 16 bytes, but "
                         f"hidden_size={config.hidden_size} bf16 values are "
                         f"{config.hidden_size * 2} bytes: use a multiple of 8; {_OR}")


def require_elastic_buffer(
        *, find_deep_ep: Callable[[], Optional[ModuleType]] = _find_deep_ep,
        nccl_version: Callable[[], Optional[tuple[int, ...]]] = torch_nccl_version,
        cuda_available: Callable[[], bool] = torch.cuda.is_available) -> ModuleType:
    """The `deep_ep` module, where this process has what DeepEP v2 needs (whatever the
    config): raise as `elastic_buffer_class` does for no `deep_ep`, no `ElasticBuffer`,
    no CUDA, or an NCCL older than 2.30.4."""
    deep_ep = find_deep_ep()
    if deep_ep is None:
        raise ImportError(f"backend 'deepep_v2' needs DeepEP (deep_ep.ElasticBuffer), which "
                          f"is not installed: {_HOW_TO_GET}; {_OR}")
    if not hasattr(deep_ep, "ElasticBuffer"):
        raise ImportError(f"backend 'deepep_v2' needs deep_ep.ElasticBuffer, which the "
                          f"installed deep_ep lacks (it is DeepEP v1): {_HOW_TO_GET}; {_OR}")
    if not cuda_available():
        raise ValueError("backend 'deepep_v2' runs DeepEP's CUDA kernels and this process "
                         "has no CUDA device: run on GPUs, or use backend 'a2a' or 'a2a_ll' "
                         "(these run on CPU with gloo)")
    version = nccl_version()
    if version is None or tuple(version) < MIN_NCCL:
        found = "no NCCL" if version is None else "NCCL " + ".".join(map(str, version))
        raise ImportError(f"backend 'deepep_v2' needs NCCL >= 2.30.4 (DeepEP v2 uses NCCL's "
                          f"device API) but this process runs {found}: install a newer NCCL "
                          f"(nvidia-nccl-cu13 >= 2.30.4 from the package index) for torch to load; {_OR}")
    return deep_ep


class ElasticBufferPool:
    """One buffer per (process group, buffer class, size), shared by every layer and both
    ubatches. Building an `ElasticBuffer` is collective (it ends in a barrier), so every
    rank builds its layers in the same order, as with every process group; before the
    first build on a group, `before_build(group)` (`start_nccl_comm`) runs, collective too.

    A buffer holds its group, so the pool cannot hold groups weakly: it forgets the
    buffers of destroyed groups whenever it is asked for one (the same points on every
    rank), and the real buffer frees its memory once the last layer using it is gone.
    """

    def __init__(self, before_build: Callable[[Optional[dist.ProcessGroup]], None]
                 = start_nccl_comm) -> None:
        self._entries: list[tuple[Optional[dist.ProcessGroup], tuple, Any]] = []
        self._before_build = before_build

    def get(self, buffer_cls: Callable[..., Any], group: Optional[dist.ProcessGroup], *,
            num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> Any:
        self._entries = [e for e in self._entries if group_live(e[0])]
        key = (buffer_cls, num_max_tokens_per_rank, hidden, num_topk)
        for entry_group, entry_key, buffer in self._entries:
            if entry_group is group and entry_key == key:
                return buffer
        self._before_build(group)
        buffer = buffer_cls(group, num_max_tokens_per_rank=num_max_tokens_per_rank,
                            hidden=hidden, num_topk=num_topk, use_fp8_dispatch=False)
        self._entries.append((group, key, buffer))
        return buffer


#: The process's buffers (process groups are process-wide objects).
BUFFERS = ElasticBufferPool()


@dataclass(frozen=True)
class V2Handle:
    """One dispatch's record, owned by its ubatch: DeepEP's `EPHandle`, which the combine
    consumes to send each row back to its token."""

    ep_handle: Any


_MODES = ("prefill", "decode")


@dataclass(frozen=True, kw_only=True)
class DeepEPV2Options(BackendOptions):
    """Options of backend `deepep_v2` (`MoEConfig(backend="deepep_v2", backend_options=
    DeepEPV2Options(...))`)."""

    backend_name = "deepep_v2"

    mode: str = "prefill"
    """"prefill" (exact sizes, expert-major rows, the host waits for the counts) or
    "decode" (outputs sized for the worst case, the count stays on the GPU: no host
    sync, CUDA-graph capturable)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in _MODES:
            raise ValueError(f"DeepEPV2Options.mode={self.mode!r} is not a deepep_v2 mode: "
                             f"use one of {_MODES}.")


class DeepEPV2Backend(PrepareFinalize):
    """DeepEP v2 (`ElasticBuffer`) dispatch and combine, in prefill or decode mode.

    Args:
        config: needs `max_tokens_per_rank` (the buffer's and decode mode's size C);
            its `DeepEPV2Options.mode` picks the mode.
        group: the EP process group.
        elastic_buffer_cls: the buffer class, built as `cls(group,
            num_max_tokens_per_rank=C, hidden=H, num_topk=K, use_fp8_dispatch=False)`;
            None (the default): `deep_ep.ElasticBuffer`, checked by `elastic_buffer_class`.
    """

    name = "deepep_v2"
    reads_counts_on_host = True  # prefill mode, the default
    opt_in = True  # DeepEP v2
    needs_capacity = True
    comm_recordable = False  # DeepEP v2's own kernels
    options_type = DeepEPV2Options
    row_dtypes = (torch.bfloat16,)
    library = "DeepEP v2"
    kernels = "DeepEP v2's kernels"
    options: DeepEPV2Options
    agreement_prefix = "deepep_v2_"

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        require_elastic_buffer()
        if world_size < 2:
            raise ValueError(_NEEDS_GROUP)
        if config is not None:
            check_v2_rows(config)

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup], *,
                 elastic_buffer_cls: Optional[Callable[..., Any]] = None) -> None:
        if elastic_buffer_cls is None:
            elastic_buffer_cls = elastic_buffer_class(config, group)
        super().__init__(config, group)
        if config.max_tokens_per_rank is None:
            raise ValueError("backend 'deepep_v2' needs MoEConfig.max_tokens_per_rank (the "
                             "ElasticBuffer's size, and decode mode's outputs): set it to the "
                             "largest token count a rank sends in one step")
        self.capacity = config.max_tokens_per_rank
        self.decode = self.options.mode == "decode"
        self.buffer = BUFFERS.get(elastic_buffer_cls, group, num_max_tokens_per_rank=self.capacity,
                                  hidden=config.hidden_size, num_topk=config.top_k)

    @property
    def graph_safe(self) -> bool:
        """Decode mode reads nothing on the host; prefill mode waits for the counts."""
        return self.decode

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        check_capacity(x_TH.shape[0], self.capacity, self.name)
        prefill = not self.decode
        # Prefill blocks the host in the call: let the other ubatch queue its compute
        # first, unless it has not started (then it has nothing the GPU could run).
        yield_first = prefill and dbo_enabled() and dbo_other_ubatch_started()
        previous = self.buffer.capture()  # before the yield: this ubatch's work only
        if yield_first:
            dbo_yield()
        note_collective("deepep_v2.dispatch", self.group)
        recv_x, recv_ids, recv_weights, ep_handle, event = self.buffer.dispatch(
            x_TH.contiguous(), topk_idx=topk_ids_TK.to(torch.int64).contiguous(),
            topk_weights=topk_weights_TK.to(torch.float32).contiguous(),
            num_experts=self.config.num_experts, previous_event=previous,
            allocate_on_comm_stream=True, async_with_compute_stream=True,
            do_cpu_sync=prefill, do_expand=prefill)
        if not yield_first:
            dbo_yield()  # a no-op outside a DBO step
        handle = V2Handle(ep_handle)

        def receiver() -> Dispatched:
            event.current_stream_wait()
            if prefill:
                ids_RK, weights_RK = self._expanded_ids(recv_weights, ep_handle)
            else:
                ids_RK, weights_RK = self._masked_ids(recv_ids, recv_weights, ep_handle)
            return Dispatched(recv_x, ids_RK, weights_RK, handle)

        return Pending(None, receiver)

    def _expanded_ids(self, recv_weights_R: Tensor, ep_handle: Any) -> tuple[Tensor, Tensor]:
        """Prefill: row r belongs to the local expert e with psum[e-1] <= r < psum[e]
        (`psum_num_recv_tokens_per_expert`, inclusive with expert alignment 1). Read on
        the GPU: the host list `num_recv_tokens_per_expert_list` would cost a copy."""
        num_rows = recv_weights_R.shape[0]
        psum_E = ep_handle.psum_num_recv_tokens_per_expert.to(torch.int64)
        rows_R = torch.arange(num_rows, device=recv_weights_R.device)
        expert_R = torch.bucketize(rows_R, psum_E, right=True)
        ids_R = torch.where(expert_R < psum_E.shape[0], expert_R, -1)
        return ids_R.unsqueeze(1), recv_weights_R.unsqueeze(1)

    def _masked_ids(self, recv_ids_RK: Tensor, recv_weights_RK: Tensor,
                    ep_handle: Any) -> tuple[Tensor, Tensor]:
        """Decode: rows past the received count (on the GPU) are uninitialised; their ids
        become -1 (no expert) and their weights 0, without reading the count on the host."""
        num_valid_1 = ep_handle.psum_num_recv_tokens_per_scaleup_rank[-1:]
        rows_R = torch.arange(recv_ids_RK.shape[0], device=recv_ids_RK.device)
        valid_R1 = (rows_R < num_valid_1).unsqueeze(1)
        return (torch.where(valid_R1, recv_ids_RK, -1),
                torch.where(valid_R1, recv_weights_RK, 0.0))

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        handle: V2Handle = dispatched.handle
        # Prefill: yield before the send, so the other ubatch's dispatch, which yielded
        # before its own, reaches the comm stream first (transfers alternate).
        yield_first = not self.decode
        previous = self.buffer.capture()
        if yield_first:
            dbo_yield()
        note_collective("deepep_v2.combine", self.group)
        out_TH, _, event = self.buffer.combine(
            expert_out_RH.contiguous(), handle.ep_handle, topk_weights=None,
            previous_event=previous, allocate_on_comm_stream=True,
            async_with_compute_stream=True)
        if not yield_first:
            dbo_yield()

        def receiver() -> Tensor:
            event.current_stream_wait()
            return out_TH

        return Pending(None, receiver)
