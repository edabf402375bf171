"""The modular kernel: prepare (dispatch) -> experts -> finalize (combine).

Shape legend: T tokens here, H hidden, K top-k, R rows the experts of this rank see.

    prepare_async  -> (hook?, receiver) -> Dispatched      the backend yields before its send
    experts        on the compute stream, this ubatch's workspace, in chunks
    finalize_async -> (hook?, receiver) -> out_TH
    shared experts between the combine's send and its receive (they overlap the combine)

A backend whose send and receive are separate (a `hook`) has the receive half handed to
the other ubatch with `dbo_register_recv_hook`, then this ubatch yields; the other runs
the hook after queueing its own compute (`dbo_maybe_run_recv_hook` at the start of each
half). Outside a DBO step the hook simply runs at once: the synchronous path is the
async path plus its wait.

The split combine (`split_combine=True`, for the model's last MoE layer): the step's last
ubatch has no other ubatch's compute left to hide its final combine behind, so there it
runs the experts on the rows other ranks sent first (this rank's own rows masked to -1),
queues the combine, then computes its own rows -- which return by a local copy -- while
that combine is in flight (phase `own_experts`), and hands them to the receiver
(`OwnRows`). Elsewhere, and for backends without `own_rows`, the layer runs as above.

Single-batch overlap (a step of one ubatch, `dbo_single_batch_overlap`; the runner
chooses it when splitting would not pay, `DBOConfig.overlap`): nothing yields, but the
collectives still run on the comm stream. The shared experts, which do not need the
dispatched tokens, run on the compute stream between the dispatch's send and its
receive, and every layer's combine is split as above (with `split_combine`'s config,
`MoEConfig.split_last_combine`): the other ranks' rows go first and this rank's own
rows are computed under that combine. Same operations on the same rows as without
overlap, only queued in another order.

The chunked combine (SBO only, the backend's `combine_chunks` > 1, backends with
`chunks_combine`: a2a_ll): the experts run on the other ranks' rows in chunks, each
chunk's combine sent on the comm stream while the next chunk's experts run, the own rows
last (`PrepareFinalize.finalize_chunked_async`). It replaces the split above; a chunk
count of 1, and DBO steps, take the path above. The same rows go through the experts
once each, in other row groups (equal within floating-point rounding).

The combine by expert group (SBO only, the backend's `combine_groups` > 1, where it has
`finalize_grouped_async`: a2a_ll): the experts run over every received row one group of this
rank's experts at a time (the other ids masked to -1), each group's partial combine sent
on the comm stream while the next group's experts run (`finalize_grouped_async`). Each
expert's weights are read once, where row chunks may read them once per chunk; the
receiver sums each token's partials over the groups (equal within floating-point
rounding: every group's partial is rounded to the rows' dtype).

The joined experts (a DBO step with `DBOConfig.joined_experts`, `dbo_joined_experts`):
each ubatch dispatches as above, then the two meet (`dbo_meet`): the first to arrive
yields until the other has its rows too, which runs the experts once over both ubatches'
rows and hands each its part; then each combines its own rows as above. Each expert's
weights are read once per step, not once per ubatch, at the price of the overlap of one
ubatch's experts with the other's transfers: what still overlaps is one ubatch's dispatch
with the other's attention, and one's combine with the other's next attention (or its
shared experts). No split combine there.

Under `torch.compile` the halves that communicate (`_dispatch_send`, `_dispatch_recv`,
`_joined_experts`, `_combine_send`, `_interleaved_combine`, `_combine_recv`) are graph
breaks (`dbo.compiling`): they run eagerly, yields and collectives in the same order as without compile, and the
compute between them (the experts, the own rows, the shared experts) is compiled, the
experts then without workspaces. The interleaved combines' experts run inside their half,
eagerly.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from dbo.compiling import compiling, graph_break
from dbo.phases import phase_scope
from dbo.yield_points import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_is_last_ubatch,
    dbo_joined_experts,
    dbo_maybe_run_recv_hook,
    dbo_meet,
    dbo_register_recv_hook,
    dbo_single_batch_overlap,
    dbo_yield,
)
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, R
from moe.config import MoEConfig
from moe.experts.base import Experts
from moe.workspace import Workspace, WorkspaceSets


@dataclass(frozen=True)
class _Sent:
    """A dispatch in flight: its pending receive, the ubatch's workspace, whether the
    step is single-batch overlap (`dbo_single_batch_overlap`), whether it joins the
    ubatches' experts (`dbo_joined_experts`) and whether the experts share the SMs with
    other streams' kernels (a DBO step, or a caller's `sms_shared`)."""

    pending: Pending[Dispatched]
    workspace: Workspace
    sbo: bool
    joined: bool
    sms_shared: bool


class SharesSMs:
    """A module that runs MoE experts through a `ModularKernel` (`MoELayer`, the Hugging
    Face adapters' experts): `sharing_sms` marks it, and its forward passes the mark on
    as `ModularKernel.forward`'s `sms_shared`."""

    sms_shared: bool = False
    """Other streams' kernels run beside this module's experts although no DBO step
    runs (`sharing_sms`)."""


@contextlib.contextmanager
def sharing_sms(model: nn.Module) -> Iterator[None]:
    """Within: every MoE layer of `model` (each `SharesSMs` module) runs its experts as in a
    DBO step, where kernels of other streams share the SMs: no expert kernel that holds
    every SM until it ends (`Experts.apply`'s `sms_shared`). For callers that overlap
    other streams' kernels with the model themselves (the bench's ceiling probe)."""
    layers = [m for m in model.modules() if isinstance(m, SharesSMs)]
    before = [layer.sms_shared for layer in layers]
    for layer in layers:
        layer.sms_shared = True
    try:
        yield
    finally:
        for layer, value in zip(layers, before):
            layer.sms_shared = value


def await_pending(pending: Pending[R]) -> R:
    """Under DBO, hand the hook to the other ubatch and yield before receiving; outside
    a step (or without a hook) this is just `pending.wait()`."""
    if pending.hook is not None and dbo_enabled():
        dbo_register_recv_hook(pending.hook)
        dbo_yield()
        return pending.receiver()
    return pending.wait()


class ModularKernel:
    """One MoE layer's routed path: a backend and an expert kernel, per-ubatch workspaces.

    Args:
        config: the layer's MoEConfig (top-k weighting mode, chunk size).
        backend: dispatch/combine.
        experts: the expert kernel run on the rows this rank receives.
    """

    def __init__(self, config: MoEConfig, backend: PrepareFinalize, experts: Experts) -> None:
        self.config = config
        self.backend = backend
        self.experts = experts
        self.workspaces = WorkspaceSets(num_ubatches=2)

    def forward(self, x_TH: Tensor, topk_weights_TK: Optional[Tensor],
                topk_ids_TK: Optional[Tensor], *, w13_EIH: Tensor, w2_EHI: Tensor,
                shared_experts: Optional[nn.Module] = None, layer: Optional[int] = None,
                split_combine: bool = False, logits_TE: Optional[Tensor] = None,
                correction_bias_E: Optional[Tensor] = None, sms_shared: bool = False) -> Tensor:
        """out_TH (x's dtype, compute stream) = routed experts' weighted sum + shared experts.

        topk_ids are global expert ids. A backend of the monolithic form
        (`routes_gathered_logits`) takes the router logits [T, E] (and the correction
        bias) instead of the top-k weights and ids, which are then None. Each phase (dispatch_send, dispatch_recv, experts,
        combine_send, own_experts, shared_experts, combine_recv) is a `phase_scope`: a
        trace range `ub<u>/L<layer>/<phase>` when tracing is on, and the place named in
        the notes of an exception raised inside it. `split_combine`: this is the model's
        last MoE layer (see the module doc). `sms_shared`: the caller runs other streams'
        kernels beside this layer (`sharing_sms`); in a DBO step the experts are told so
        without it (`Experts.apply`'s `sms_shared`).
        """
        send = self._dispatch_send(x_TH, topk_weights_TK, topk_ids_TK, logits_TE,
                                   correction_bias_E, layer, sms_shared)
        sbo, workspace = send.sbo, send.workspace
        shared_TH = None
        if sbo and shared_experts is not None:
            with phase_scope("shared_experts", layer=layer):
                shared_TH = shared_experts(x_TH)  # under the dispatch
        if sbo and (self.backend.combine_groups > 1 or self.backend.combine_chunks > 1):
            dispatched, _ = self._dispatch_recv(send, layer, split=False)
            pending_out = self._interleaved_combine(dispatched, w13_EIH, w2_EHI, workspace,
                                                    layer, send.sms_shared)
            out_TH = self._combine_recv(pending_out, layer)
            return out_TH if shared_TH is None else out_TH + shared_TH
        dispatched, own = self._dispatch_recv(
            send, layer, split=not send.joined and (
                split_combine or (sbo and self.config.split_last_combine)))
        # Inside a compiled graph the experts allocate their own scratch (the compiler
        # plans its buffers); the workspaces serve the eager kernels.
        experts_ws = None if compiling() else workspace
        if send.joined:
            expert_out_RH = self._joined_experts(dispatched, w13_EIH, w2_EHI, workspace,
                                                 layer, sms_shared)
        else:
            with phase_scope("experts", layer=layer):
                ids_RK = dispatched.topk_ids_RK
                if own is not None:
                    ids_RK = ids_RK.clone()
                    ids_RK[own.rows] = -1  # computed after the send
                expert_out_RH = self._run_experts(dispatched.x_RH, ids_RK,
                                                  dispatched.topk_weights_RK, w13_EIH,
                                                  w2_EHI, experts_ws, send.sms_shared)
        pending_out = self._combine_send(expert_out_RH, dispatched, workspace, own, layer)
        if own is not None:
            with phase_scope("own_experts", layer=layer):
                own.out_NH = self._run_experts(
                    dispatched.x_RH[own.rows], dispatched.topk_ids_RK[own.rows],
                    dispatched.topk_weights_RK[own.rows], w13_EIH, w2_EHI, experts_ws,
                    send.sms_shared)
        if shared_experts is not None and not sbo:
            with phase_scope("shared_experts", layer=layer):
                shared_TH = shared_experts(x_TH)
        out_TH = self._combine_recv(pending_out, layer)
        return out_TH if shared_TH is None else out_TH + shared_TH

    # The halves that communicate: each a graph break under torch.compile, so their
    # collectives, stream switches and yields run eagerly between compiled graphs, in
    # the order written here (`dbo.compiling`).
    @graph_break
    def _dispatch_send(self, x_TH: Tensor, topk_weights_TK: Optional[Tensor],
                       topk_ids_TK: Optional[Tensor], logits_TE: Optional[Tensor],
                       correction_bias_E: Optional[Tensor], layer: Optional[int],
                       sms_shared: bool) -> _Sent:
        """The dispatch's send on this ubatch's workspace (after the hooks handed to it).
        Whether SMs are shared is settled here, eagerly (a graph break), with the step."""
        workspace = self.workspaces.for_ubatch(dbo_current_ubatch_id())
        sbo = dbo_single_batch_overlap()
        with phase_scope("dispatch_send", layer=layer):
            dbo_maybe_run_recv_hook()
            if self.backend.routes_gathered_logits:
                if logits_TE is None:
                    raise TypeError(f"backend {self.backend.name!r} routes the gathered "
                                    f"tokens itself: pass logits_TE")
                pending = self.backend.prepare_logits_async(
                    x_TH, logits_TE, correction_bias_E=correction_bias_E, workspace=workspace)
            else:
                assert topk_weights_TK is not None and topk_ids_TK is not None
                pending = self._prepare_async(x_TH, topk_weights_TK, topk_ids_TK, workspace)
        return _Sent(pending=pending, workspace=workspace, sbo=sbo,
                     joined=dbo_joined_experts(), sms_shared=sms_shared or dbo_enabled())

    @graph_break
    def _dispatch_recv(self, sent: _Sent, layer: Optional[int], *, split: bool
                       ) -> tuple[Dispatched, Optional[OwnRows]]:
        """The dispatched rows, and with `split` (the split combine, module doc) on the
        step's last ubatch the rows this rank sent itself, where the backend names them."""
        with phase_scope("dispatch_recv", layer=layer):
            dispatched = await_pending(sent.pending)
        if not (split and dbo_enabled() and dbo_is_last_ubatch()):
            return dispatched, None
        rows = self.backend.own_rows(dispatched)
        return dispatched, None if rows is None else OwnRows(rows)

    @graph_break
    def _joined_experts(self, dispatched: Dispatched, w13_EIH: Tensor, w2_EHI: Tensor,
                        workspace: Workspace, layer: Optional[int], sms_shared: bool) -> Tensor:
        """This ubatch's expert outputs, the experts run once over both ubatches' rows
        (the joined experts, module doc): the ubatch arriving first yields at the meeting
        (`dbo_meet`, keyed by this kernel) until the other arrives, which runs the experts
        over the two ubatches' rows end to end, on its own workspace, and hands each its
        part. Both dispatches have arrived and no combine is sent yet, so no transfer of
        the step runs beside these experts: they take every SM (as without DBO) unless the
        caller shares them (`sms_shared`). A graph break under torch.compile (it yields)."""
        def run_both(parts: list[tuple[Tensor, Tensor, Tensor]]) -> list[Tensor]:
            sizes = [part[0].shape[0] for part in parts]
            with phase_scope("experts", layer=layer):
                x_RH, ids_RK, weights_RK = (torch.cat(rows) for rows in zip(*parts))
                out_RH = self._run_experts(x_RH, ids_RK, weights_RK, w13_EIH, w2_EHI,
                                           workspace, sms_shared)
            return list(out_RH.split(sizes))

        mine = (dispatched.x_RH, dispatched.topk_ids_RK, dispatched.topk_weights_RK)
        return dbo_meet(self, mine, run_both)

    @graph_break
    def _combine_send(self, expert_out_RH: Tensor, dispatched: Dispatched,
                      workspace: Workspace, own: Optional[OwnRows],
                      layer: Optional[int]) -> Pending[Tensor]:
        with phase_scope("combine_send", layer=layer):
            dbo_maybe_run_recv_hook()
            return self.backend.finalize_async(expert_out_RH, dispatched,
                                               workspace=workspace, **_own_kwarg(own))

    @graph_break
    def _combine_recv(self, pending_out: Pending[Tensor], layer: Optional[int]) -> Tensor:
        with phase_scope("combine_recv", layer=layer):
            return await_pending(pending_out)

    @graph_break
    def _interleaved_combine(self, dispatched: Dispatched, w13_EIH: Tensor, w2_EHI: Tensor,
                             workspace: Workspace, layer: Optional[int],
                             sms_shared: bool) -> Pending[Tensor]:
        """The experts and the combine interleaved by the backend (see the module doc): by
        expert group (`combine_groups` > 1) or by row chunk (`combine_chunks` > 1). Each
        pass of the experts is an `experts` phase inside the `combine_send` phase that
        queues the transfers."""
        def run_experts(x_NH: Tensor, ids_NK: Tensor, weights_NK: Tensor) -> Tensor:
            with phase_scope("experts", layer=layer):
                return self._run_experts(x_NH, ids_NK, weights_NK, w13_EIH, w2_EHI,
                                         workspace, sms_shared)

        backend = self.backend
        with phase_scope("combine_send", layer=layer):
            if backend.combine_groups > 1:
                return backend.finalize_grouped_async(
                    run_experts, dispatched, num_groups=backend.combine_groups,
                    workspace=workspace)
            return backend.finalize_chunked_async(
                run_experts, dispatched, num_chunks=backend.combine_chunks,
                workspace=workspace)

    def _prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor,
                       workspace: Workspace) -> Pending:
        expert_in_TH = x_TH
        if self.config.apply_router_weight_on_input:
            # Top-1 only (checked by MoEConfig): scale the input, weight the output by 1.
            expert_in_TH = (x_TH.float() * topk_weights_TK).to(x_TH.dtype)
            topk_weights_TK = torch.ones_like(topk_weights_TK)
        return self.backend.prepare_async(expert_in_TH, topk_weights_TK, topk_ids_TK,
                                          workspace=workspace)

    def _run_experts(self, x_RH: Tensor, ids_RK: Tensor, weights_RK: Tensor, w13_EIH: Tensor,
                     w2_EHI: Tensor, workspace: Optional[Workspace], sms_shared: bool) -> Tensor:
        """Experts over the given rows, `expert_chunk_size` rows at a time. The rows are
        read in place, in the backend's packed buffer (a strided view; every expert
        kernel takes a row stride), which spares a [R, H] copy per layer."""
        if x_RH.stride(-1) != 1:
            x_RH = x_RH.contiguous()
        num_rows, chunk = x_RH.shape[0], self.config.expert_chunk_size
        if num_rows <= chunk:
            return self.experts.apply(x_RH, w13_EIH, w2_EHI, ids_RK, weights_RK,
                                      workspace=workspace, sms_shared=sms_shared)
        out_RH = torch.empty_like(x_RH)
        for start in range(0, num_rows, chunk):
            end = min(start + chunk, num_rows)
            out_RH[start:end] = self.experts.apply(
                x_RH[start:end], w13_EIH, w2_EHI, ids_RK[start:end], weights_RK[start:end],
                workspace=workspace, sms_shared=sms_shared)
        return out_RH


def _own_kwarg(own: Optional[OwnRows]) -> dict:
    """`own=` only when splitting, so backends written before the split combine (whose
    finalize_async takes no `own`) keep working."""
    return {} if own is None else {"own": own}
