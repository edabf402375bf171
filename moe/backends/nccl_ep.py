"""`nccl_ep`: dispatch and combine through NCCL EP (`nccl.ep`, NCCL's own expert-parallel
kernels on its device API), in its low-latency or high-throughput form.

Shape legend: T tokens here (T <= C), C = `MoEConfig.max_tokens_per_rank`, H hidden,
K top-k, W ranks, E_loc experts per rank.

Low latency (`NCCLEPOptions.mode="ll"`), as DeepEP's low-latency kernels: the tokens
arrive expert-major, [E_loc, W*C, H] with `expert_counters[e]` valid rows at the front
of expert e's block; the experts read that buffer in place as E_loc*W*C rows with one id
each (e, or -1 for padding; nothing read on the host) and weight 1, since the combine
applies the top-k weights on the receiving side. In a DBO step both halves only send
(`send_only`); the completion (`Handle.complete`, NCCL EP's counterpart of DeepEP's
receive hook) goes back as the `Pending` hook, which the modular kernel hands to the
other ubatch: it runs once that ubatch has queued its compute. Outside a step each call
is one launch. Everything runs on the compute stream.

High throughput (`mode="ht"`), as DeepEP's normal kernels: each token goes once to every
rank holding one of its experts, with its K ids (local, -1 for experts elsewhere) and
weights, into W*C flat rows (the static size, which CUDA graphs need); rows past the
received count (`recv_total_counter`, on the GPU) get ids -1 here. The experts weight
their rows; the combine adds them per token without weights. NCCL EP has no send-only
form here, so in a DBO step each half runs on the comm stream after compute-done, and
the receiver makes compute wait (as `symm_mem` does).

Per call: the handle is re-bound to this call's ids (`Handle.update`; the ids stay
alive in the call's `EPCall` until the combine, since the handle reads them then too).
Handles are made once per layer and ubatch; EP groups once per process group, shape and
ubatch (`moe.backends.nccl_ep_support`). The receive buffers are the ubatch's workspace:
a layer reads its rows before the next layer of the same ubatch dispatches.

Measured on one H200 (EP group of one rank): exact against the reference with DBO off
and on, in both forms. Not yet measured across two GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.yield_points import (dbo_current_ubatch_id, dbo_enabled, dbo_switch_to_comm_sync,
                              dbo_switch_to_compute_async, dbo_yield)
from moe.backend_options import BackendOptions
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity
from moe.backends.deepep_support import LLRowConstants, ll_expert_ids
from moe.backends.nccl_ep_support import (GROUPS, NAME, Descriptors, GroupKey,
                                          check_nccl_ep_rows, require_nccl_ep)
from moe.config import MoEConfig
from moe.workspace import Workspace
from streams.memory import record_on_current_stream

_MODES = ("ll", "ht")


@dataclass(frozen=True, kw_only=True)
class NCCLEPOptions(BackendOptions):
    """Options of backend `nccl_ep` (`MoEConfig(backend="nccl_ep", backend_options=
    NCCLEPOptions(...))`)."""

    backend_name = NAME

    mode: str = "ll"
    """"ll" (low latency: expert-major rows, send-only halves completed under the other
    ubatch) or "ht" (high throughput: flat rows, each half on the comm stream)."""

    num_sms: int = 0
    """The most SMs NCCL EP's kernels may use (`GroupConfig.max_num_sms`); 0: the
    library's own choice."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in _MODES:
            raise ValueError(f"NCCLEPOptions.mode={self.mode!r} is not an nccl_ep mode: use "
                             f"one of {_MODES}.")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 0:
            raise ValueError(f"NCCLEPOptions.num_sms={self.num_sms!r} must be an int >= 0 "
                             f"(0: NCCL EP's own choice).")


@dataclass(frozen=True)
class EPCall:
    """One dispatch's record, owned by its ubatch: the handle bound to this call's ids
    (ids_TK, kept alive until the combine), the top-k weights (the low-latency combine
    applies them), and the received row count of the high-throughput form."""

    handle: Any
    ids_TK: Tensor
    weights_TK: Tensor
    total_1: Optional[Tensor]


class NCCLEPBackend(PrepareFinalize):
    """NCCL EP dispatch and combine (`nccl.ep`), low latency or high throughput.

    Args:
        config: needs `max_tokens_per_rank` (C, the size of every buffer); its
            `NCCLEPOptions` pick the form and the SM limit.
        group: the EP process group (NCCL; one rank is allowed).
    """

    name = NAME
    graph_safe = True
    graph_safe_with_capacity = True
    pads_to_capacity = True  # E_loc*W*C rows (low latency), W*C rows (high throughput)
    opt_in = True  # NCCL EP
    needs_capacity = True
    comm_recordable = False  # NCCL EP's own kernels
    options_type = NCCLEPOptions
    row_dtypes = (torch.bfloat16,)
    library = "NCCL EP"
    kernels = "NCCL EP's kernels"
    options: NCCLEPOptions
    agreement_prefix = "nccl_ep_"

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        require_nccl_ep()
        if config is not None:
            check_nccl_ep_rows(config.hidden_size, config.dtype, config.options.mode)

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        self.ep = require_nccl_ep()
        check_nccl_ep_rows(config.hidden_size, config.dtype, config.options.mode)
        if group is None:
            raise ValueError(f"backend '{NAME}' needs a process group on NCCL (group=...; "
                             f"one rank is enough), or use backend 'local' on one process")
        super().__init__(config, group)
        if config.max_tokens_per_rank is None:
            raise ValueError(f"backend '{NAME}' needs MoEConfig.max_tokens_per_rank (the size "
                             f"of NCCL EP's buffers): set it to the largest token count a rank "
                             f"sends in one step")
        self.capacity = config.max_tokens_per_rank
        self.low_latency = self.options.mode == "ll"
        self._handles: dict[int, Any] = {}  # ubatch id -> this layer's handle
        self.descriptors = Descriptors(self.ep)

    @property
    def rows_per_expert(self) -> int:
        """W * C: the rows of one local expert's block in the low-latency receive buffer."""
        return self.world_size * self.capacity

    def _handle(self, num_topk: int) -> Any:
        """This layer's handle for the running ubatch, made at its first call."""
        ubatch = dbo_current_ubatch_id()
        handle = self._handles.get(ubatch)
        if handle is None:
            key = GroupKey(self.options.mode, self.config.num_experts, self.capacity,
                           self.config.hidden_size * self.config.dtype.itemsize,
                           self.options.num_sms, ubatch)
            handle = self._handles[ubatch] = GROUPS.handle(self.ep, self.group, key,
                                                           num_topk=num_topk)
        return handle

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        check_capacity(x_TH.shape[0], self.capacity, self.name)
        ids_TK = topk_ids_TK.to(torch.int64).contiguous()
        weights_TK = topk_weights_TK.to(torch.float32).contiguous()
        handle = self._handle(ids_TK.shape[1])
        if self.low_latency:
            return self._dispatch_ll(x_TH.contiguous(), ids_TK, weights_TK, handle, workspace)
        return self._dispatch_ht(x_TH.contiguous(), ids_TK, weights_TK, handle, workspace)

    def _dispatch_ll(self, x_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor, handle: Any,
                     workspace: Workspace) -> Pending[Dispatched]:
        device = x_TH.device
        num_local, hidden = self.placement.num_local_experts, x_TH.shape[1]
        recv_ENH = workspace.get("nccl_ep/ll/recv", (num_local, self.rows_per_expert, hidden),
                                 x_TH.dtype, device)
        count_E = workspace.get("nccl_ep/ll/count", (num_local,), torch.int32, device)
        stream = torch.cuda.current_stream(device).cuda_stream
        split = dbo_enabled()  # outside a DBO step: one launch, nothing to hand over
        d = self.descriptors
        ids_d = d.of(ids_TK)
        inputs, outputs = d.bundle("DispatchInputs", tokens=x_TH), d.bundle(
            "DispatchOutputs", tokens=recv_ENH)
        layout = d.bundle("LayoutInfo", expert_counters=count_E)
        config = d.bundle("DispatchConfig", send_only=int(split))
        note_collective("nccl_ep.dispatch", self.group)
        handle.update(ids_d, stream=stream)
        handle.dispatch(inputs[0], outputs[0], layout_info=layout[0], config=config[0],
                        stream=stream)
        call = EPCall(handle, ids_TK, weights_TK, None)
        rows = workspace.keep(f"nccl_ep/rows/{num_local}/{self.rows_per_expert}/{device}",
                              lambda: LLRowConstants.make(num_local, self.rows_per_expert,
                                                          device))

        def receiver() -> Dispatched:
            return Dispatched(recv_ENH.view(-1, hidden), ll_expert_ids(count_E, rows),
                              rows.ones_R1, call)

        keep = [ids_d, inputs, outputs, layout, config]
        return Pending(_completion(handle, keep) if split else None, receiver)

    def _dispatch_ht(self, x_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor, handle: Any,
                     workspace: Workspace) -> Pending[Dispatched]:
        device = x_TH.device
        slots, hidden, top_k = self.world_size * self.capacity, x_TH.shape[1], ids_TK.shape[1]
        recv_SH = workspace.get("nccl_ep/ht/recv", (slots, hidden), x_TH.dtype, device)
        recv_w_SK = workspace.get("nccl_ep/ht/weights", (slots, top_k), torch.float32, device)
        recv_ids_SK = workspace.get("nccl_ep/ht/ids", (slots, top_k), torch.int64, device)
        total_1 = workspace.get("nccl_ep/ht/total", (1,), torch.int32, device)
        in_step = dbo_enabled()
        if in_step:
            dbo_switch_to_comm_sync()  # send first: nothing to read on the host
        stream = torch.cuda.current_stream(device).cuda_stream
        d = self.descriptors
        layout = d.bundle("LayoutInfo", recv_total_counter=total_1)
        inputs = d.bundle("DispatchInputs", tokens=x_TH, topk_weights=weights_TK)
        outputs = d.bundle("DispatchOutputs", tokens=recv_SH, topk_weights=recv_w_SK,
                           topk_idx=recv_ids_SK)
        note_collective("nccl_ep.dispatch", self.group)
        handle.update(d.of(ids_TK), layout_info=layout[0], stream=stream)
        handle.dispatch(inputs[0], outputs[0], stream=stream)
        record_on_current_stream(x_TH, ids_TK, weights_TK)  # made on compute, read here
        wait = dbo_switch_to_compute_async()
        if in_step:
            dbo_yield()
        call = EPCall(handle, ids_TK, weights_TK, total_1)

        def receiver() -> Dispatched:
            wait.wait()
            # Rows at or past the received total hold earlier calls' rows: no expert.
            stale_S1 = (torch.arange(slots, device=device) >= total_1).unsqueeze(1)
            return Dispatched(recv_SH, recv_ids_SK.masked_fill(stale_S1, -1),
                              recv_w_SK.masked_fill(stale_S1, 0.0), call)

        return Pending(None, receiver)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        call: EPCall = dispatched.handle
        if self.low_latency:
            return self._combine_ll(expert_out_RH, call)
        return self._combine_ht(expert_out_RH, call)

    def _combine_ll(self, expert_out_RH: Tensor, call: EPCall) -> Pending[Tensor]:
        device = expert_out_RH.device
        out_ENH = expert_out_RH.contiguous().view(self.placement.num_local_experts,
                                                  self.rows_per_expert, -1)
        out_TH = torch.empty(call.ids_TK.shape[0], out_ENH.shape[2], dtype=out_ENH.dtype,
                             device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        split = dbo_enabled()
        d = self.descriptors
        inputs = d.bundle("CombineInputs", tokens=out_ENH)
        outputs = d.bundle("CombineOutputs", tokens=out_TH, topk_weights=call.weights_TK)
        config = d.bundle("CombineConfig", send_only=int(split))
        note_collective("nccl_ep.combine", self.group)
        call.handle.combine(inputs[0], outputs[0], config=config[0], stream=stream)
        keep = [inputs, outputs, config, out_ENH]
        return Pending(_completion(call.handle, keep) if split else None, lambda: out_TH)

    def _combine_ht(self, expert_out_RH: Tensor, call: EPCall) -> Pending[Tensor]:
        device = expert_out_RH.device
        y_SH = expert_out_RH.contiguous()
        out_TH = torch.empty(call.ids_TK.shape[0], y_SH.shape[1], dtype=y_SH.dtype,
                             device=device)
        in_step = dbo_enabled()
        if in_step:
            dbo_switch_to_comm_sync()
        stream = torch.cuda.current_stream(device).cuda_stream
        d = self.descriptors
        inputs, outputs = d.bundle("CombineInputs", tokens=y_SH), d.bundle(
            "CombineOutputs", tokens=out_TH)
        note_collective("nccl_ep.combine", self.group)
        call.handle.combine(inputs[0], outputs[0], stream=stream)
        record_on_current_stream(y_SH, out_TH)
        wait = dbo_switch_to_compute_async()
        if in_step:
            dbo_yield()

        def receiver() -> Tensor:
            wait.wait()
            return out_TH

        return Pending(None, receiver)


def _completion(handle: Any, keep: list) -> Callable[[], None]:
    """The receive half of a send-only call (`Handle.complete` on the stream current when
    it runs: the compute stream, under the other ubatch), to run exactly once. `keep`
    holds the call's descriptors and bundles until then: the handle keeps their
    addresses and the completion reads them again (found on an H200: freed ones were
    read as garbage)."""
    ran: list[bool] = []

    def complete() -> None:
        assert not ran, "an NCCL EP completion ran twice"
        ran.append(True)
        handle.complete(stream=torch.cuda.current_stream().cuda_stream)
        del keep[:]  # the completion has read them: let them go with the call

    return complete
