"""A fake `deep_ep.ElasticBuffer` (DeepEP v2) that really moves rows between gloo ranks.

DeepEP v2 needs NCCL >= 2.30.4, which our machines lack, so `moe.backends.deepep_v2` is
tested through this stand-in. It reproduces the facts below of DeepEP's main branch
(github.com/deepseek-ai/DeepEP); where a fact was read is given in brackets:
[elastic.py] = deep_ep/buffers/elastic.py, [buffer.hpp] = csrc/elastic/buffer.hpp,
[event.py] = deep_ep/utils/event.py, [refs.py] = deep_ep/utils/refs.py,
[test_ep.py] = tests/elastic/test_ep.py.

- Construction `ElasticBuffer(group, num_max_tokens_per_rank=, hidden=, num_topk=,
  use_fp8_dispatch=)`; `capture()` is a static method returning an `EventHandle` recorded
  on the current stream [elastic.py: ElasticBuffer.__init__, capture].
- `dispatch(x, topk_idx, topk_weights, num_experts=, previous_event=,
  async_with_compute_stream=, allocate_on_comm_stream=, do_cpu_sync=, do_expand=, ...)`
  returns `(recv_x, recv_topk_idx, recv_topk_weights, EPHandle, EventOverlap)`
  [elastic.py: dispatch]. Checks kept: `previous_event` needs `allocate_on_comm_stream`
  [buffer.hpp: stream_control_prologue]; x contiguous, its rows a multiple of 16 bytes,
  at most `num_max_tokens_per_rank` tokens; `topk_idx` int64 and `topk_weights` float32,
  contiguous [buffer.hpp: dispatch].
- Each token goes once to every rank holding one of its experts, with all K ids made
  local to the receiver (-1 for experts elsewhere) and all K weights [refs.py: dispatch].
  The receive order is not rank-major (only deterministic mode sorts it,
  [elastic.py: EPHandle.deterministic_sort]): the fake reverses it.
- Non-expand layout: recv_x [N, H], recv_topk_idx [N, K] int64, recv_topk_weights
  [N, K] float32. Expand layout (`do_expand=True`): one row per (token, local expert),
  expert-major; recv_topk_idx is None, recv_topk_weights is 1-D [N_exp] float32
  [buffer.hpp: dispatch; test_ep.py: "Expanded checks"].
- `do_cpu_sync=True`: exact sizes, and `num_recv_tokens_per_expert_list` (a host list) is
  filled. `do_cpu_sync=False`: outputs sized for the worst case, N = W * C rows
  (N_exp = W * C * min(K, E_loc)), rows past the true count uninitialised (the fake
  fills them with NaN and out-of-range ids), the list empty, the true count only on the
  device in `psum_num_recv_tokens_per_scaleup_rank[-1]` [buffer.hpp: dispatch, "allocate
  with the worst case"; test_ep.py: "Make the valid part ... for no CPU sync mode"].
- EPHandle fields: `psum_num_recv_tokens_per_scaleup_rank` int32 [W] inclusive prefix sum
  over source ranks (one scale-up domain); `psum_num_recv_tokens_per_expert` int32
  [E_loc], inclusive (expert alignment 1); `num_unaligned_recv_tokens_per_expert` int32
  [E_loc] (expand mode); `recv_src_metadata` int32 [N, K + 2], column 0 the source
  token's global index `src_rank * C + t`, columns 2.. its expand-mode slots (-1 where
  none); `topk_idx` a clone; `num_recv_tokens`, `num_expanded_tokens` [elastic.py:
  EPHandle docstring; buffer.hpp: dispatch]. Column 1 and `dst_buffer_slot_idx` are
  zeros here (not reproduced: cached dispatch only).
- `combine(x, handle, topk_weights=None, previous_event=, async_with_compute_stream=,
  allocate_on_comm_stream=)` returns `(combined_x [T, H], combined_topk_weights,
  EventOverlap)`: the plain sum of the rows of each token, in float32, cast to x's dtype
  (expand mode sums a token's slots first); the weights are NOT multiplied in
  [refs.py: combine, ordered_accumulate; test_ep.py: combined_x == ref_combine(...)].
- Events: with `async_with_compute_stream=True` the event is valid and the results are
  ready for the compute stream only after `EventOverlap.current_stream_wait()`: the fake
  fills every device output with garbage and writes the data at that wait. Without it
  the event is None and the results are ready at once [event.py: EventOverlap;
  buffer.hpp: stream_control_epilogue].

Not reproduced (the fake raises NotImplementedError): FP8 dispatch, cached dispatch
(`handle=`), expert alignment above 1, zero padding, bias, top-k weights in the combine,
statistics counters, more than one scale-out domain. The real combine takes bfloat16
only; the fake takes any floating dtype, so the adapter's logic is checked exactly in
float32 (the adapter refuses other dtypes against the real library).

With `device_only=True` every device output is a `DeviceOnlyTensor`, which raises on a
host read (`.item()`, `.tolist()`, `bool()`, `nonzero()`, ...), as a CUDA graph or a
no-sync step would forbid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class HostReadError(RuntimeError):
    """A value that lives on the device was read on the host."""


class DeviceOnlyTensor(torch.Tensor):
    """A tensor whose values may not be read on the host (everything made from it too)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        if func in _HOST_READS:
            raise HostReadError(f"{getattr(func, '__name__', func)} reads a device value on "
                                f"the host")
        return super().__torch_function__(func, types, args, kwargs or {})


_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
               torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy,
               torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique,
               torch.unique}


class FakeEventHandle:
    """`deep_ep.EventHandle`: an event; waiting on it delivers the call's results."""

    def __init__(self, deliver: Optional[Callable[[], None]] = None) -> None:
        self._deliver = deliver
        self.num_waits = 0

    def current_stream_wait(self) -> None:
        self.num_waits += 1
        if self._deliver is not None:
            self._deliver()
            self._deliver = None


class FakeEventOverlap:
    """`deep_ep.EventOverlap`: `.event` (None unless async), `current_stream_wait()`."""

    def __init__(self, event: Optional[FakeEventHandle] = None) -> None:
        self.event = event

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None  # as the real one: only async calls give an event
        self.event.current_stream_wait()
        if release_handle:
            self.event = None


@dataclass
class _Route:
    """What the fake's combine needs (private: the real handle keeps it in its tensors)."""

    num_tokens: int
    send_counts: list[int]   # tokens sent to each rank
    send_src: Tensor         # int64 [S]: the token of each sent row, rank-major
    recv_counts: list[int]   # tokens received from each rank
    order: Tensor            # int64 [n]: receive row -> position in the rank-major order
    slots: Optional[Tensor]  # int64 [n, K] expand-mode rows of each received token, -1


class FakeEPHandle:
    """`deep_ep.EPHandle`'s fields (see the module doc for which are reproduced)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


@dataclass(frozen=True)
class Call:
    """One call as the fake saw it (for tests of the adapter's flags)."""

    op: str
    do_cpu_sync: Optional[bool]
    do_expand: Optional[bool]
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool
    previous_event: bool


class FakeElasticBuffer:
    """See the module doc. `group` None is a world of one (no collectives)."""

    def __init__(self, group: Optional[dist.ProcessGroup], num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0, hidden: int = 0,
                 num_topk: int = 0, use_fp8_dispatch: bool = False, *,
                 device_only: bool = False, **options: Any) -> None:
        if use_fp8_dispatch:
            raise NotImplementedError("the fake ElasticBuffer has no FP8 dispatch")
        self.group = group
        self.rank_idx = 0 if group is None else group.rank()
        self.num_ranks = 1 if group is None else group.size()
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden, self.num_topk = hidden, num_topk
        self.device_only = device_only
        self.calls: list[Call] = []

    @staticmethod
    def capture() -> FakeEventHandle:
        return FakeEventHandle()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: Any, topk_idx: Optional[Tensor] = None,
                 topk_weights: Optional[Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                 num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[FakeEventHandle] = None,
                 previous_event_before_epilogue: Optional[FakeEventHandle] = None,
                 async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Any = None,
                 do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) -> tuple:
        if isinstance(x, tuple) or handle is not None or expert_alignment not in (None, 1) \
                or do_zero_padding or cumulative_local_expert_recv_stats is not None:
            raise NotImplementedError("the fake ElasticBuffer has no FP8, cached dispatch, "
                                      "expert alignment, zero padding or statistics")
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        assert num_experts is not None and topk_idx is not None and topk_weights is not None
        self.calls.append(Call("dispatch", do_cpu_sync, do_expand, async_with_compute_stream,
                               allocate_on_comm_stream, previous_event is not None))
        cap = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        num_tokens, hidden = x.shape
        top_k = topk_idx.shape[1]
        assert x.is_contiguous() and hidden * x.element_size() % 16 == 0
        assert num_tokens <= cap, (num_tokens, cap)
        assert topk_idx.dtype == torch.int64 and topk_idx.is_contiguous()
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        world, rank = self.num_ranks, self.rank_idx
        num_local = num_experts // world

        # Send: each token once to every rank holding one of its experts, rank-major.
        owner_TK = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
        goes_WT = torch.stack([(owner_TK == w).any(1) for w in range(world)])
        send_src = torch.cat([goes_WT[w].nonzero().squeeze(1) for w in range(world)])
        send_counts = goes_WT.sum(1).tolist()
        recv_counts = self._exchange_counts(send_counts)
        src_global = send_src + rank * cap
        got_x = self._all_to_all(x[send_src].float(), recv_counts, send_counts).to(x.dtype)
        got_ids = self._all_to_all(topk_idx[send_src], recv_counts, send_counts)
        got_w = self._all_to_all(topk_weights[send_src], recv_counts, send_counts)
        got_src = self._all_to_all(src_global, recv_counts, send_counts)

        # Receive order: reversed (not rank-major); ids made local.
        num_recv = sum(recv_counts)
        order = torch.arange(num_recv - 1, -1, -1, dtype=torch.int64)
        got_x, got_ids, got_w, got_src = (t[order] for t in (got_x, got_ids, got_w, got_src))
        mine = (got_ids >= rank * num_local) & (got_ids < (rank + 1) * num_local)
        local_ids = torch.where(mine, got_ids - rank * num_local, -1)
        count_E = torch.stack([(local_ids == e).any(1).sum() for e in range(num_local)])

        psum_rank = torch.cumsum(torch.tensor(recv_counts), 0).to(torch.int32)
        psum_expert = torch.cumsum(count_E, 0).to(torch.int32)
        n_alloc = num_recv if do_cpu_sync else world * cap
        metadata = torch.zeros(num_recv, top_k + 2, dtype=torch.int32)
        metadata[:, 0] = got_src.to(torch.int32)
        metadata[:, 2:] = -1
        slots = None
        if do_expand:
            # Expert-major: expert e's rows are the received tokens that picked it, in
            # receive order; slot (token, k) is the row it got.
            rows = [(e, r, k) for e in range(num_local) for r in range(num_recv)
                    for k in range(top_k) if local_ids[r, k] == e]
            slots = torch.full((num_recv, top_k), -1, dtype=torch.int64)
            for row, (_, r, k) in enumerate(rows):
                slots[r, k] = row
            metadata[:, 2:] = slots.to(torch.int32)
            out_x = x.new_empty((len(rows), hidden))
            out_w = torch.empty(len(rows), dtype=torch.float32)
            for row, (_, r, k) in enumerate(rows):
                out_x[row], out_w[row] = got_x[r], got_w[r, k]
            out_ids = None
            exp_alloc = len(rows) if do_cpu_sync else world * cap * min(top_k, num_local)
            results = {"x": (out_x, exp_alloc), "w": (out_w, exp_alloc)}
        else:
            results = {"x": (got_x, n_alloc), "ids": (local_ids, n_alloc),
                       "w": (got_w, n_alloc)}
        results["psum_rank"] = (psum_rank, psum_rank.shape[0])
        results["psum_expert"] = (psum_expert, psum_expert.shape[0])
        results["unaligned"] = (count_E.to(torch.int32), num_local)
        results["metadata"] = (metadata, n_alloc)

        # Outputs sized for the mode, garbage until delivered.
        out = {name: _garbage(data, rows, num_experts) for name, (data, rows) in results.items()}
        if not do_expand:
            del results["unaligned"]  # written in expand mode only

        def deliver() -> None:
            for name, (data, _) in results.items():
                out[name][:data.shape[0]] = data

        event = self._event(deliver, async_with_compute_stream)
        wrap = self._wrap
        ep_handle = FakeEPHandle(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=1,
            num_max_tokens_per_rank=cap, num_sms=num_sms or 24,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=n_alloc,
            num_expanded_tokens=(out["x"].shape[0] if do_expand else
                                 int(count_E.sum()) if do_cpu_sync
                                 else world * cap * min(top_k, num_local)),
            num_recv_tokens_per_expert_list=count_E.tolist() if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=wrap(out["psum_rank"]),
            psum_num_recv_tokens_per_expert=wrap(out["psum_expert"]),
            num_unaligned_recv_tokens_per_expert=wrap(out["unaligned"]),
            recv_src_metadata=wrap(out["metadata"]),
            dst_buffer_slot_idx=torch.zeros(num_tokens, top_k, dtype=torch.int32),
            token_metadata_at_forward=None, channel_linked_list=None,
            _route=_Route(num_tokens, send_counts, send_src, recv_counts, order, slots))
        return (wrap(out["x"]), None if do_expand else wrap(out["ids"]), wrap(out["w"]),
                ep_handle, event)

    # ------------------------------------------------------------------ combine
    def combine(self, x: Tensor, handle: FakeEPHandle, topk_weights: Optional[Tensor] = None,
                bias: Any = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: Optional[FakeEventHandle] = None,
                previous_event_before_epilogue: Optional[FakeEventHandle] = None,
                async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        if topk_weights is not None or bias is not None:
            raise NotImplementedError("the fake ElasticBuffer's combine takes no top-k "
                                      "weights and no bias")
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        self.calls.append(Call("combine", None, None, async_with_compute_stream,
                               allocate_on_comm_stream, previous_event is not None))
        route: _Route = handle._route
        hidden = x.shape[1]
        assert x.is_contiguous() and x.dtype.is_floating_point
        assert hidden * x.element_size() % 16 == 0
        assert x.shape[0] == (handle.num_expanded_tokens if handle.do_expand
                              else handle.num_recv_tokens), (x.shape, handle.num_recv_tokens)
        x = x.as_subclass(torch.Tensor)  # the "kernel" reads it on the device
        num_recv = route.order.shape[0]
        if handle.do_expand:
            partial_NH = torch.zeros(num_recv, hidden, dtype=torch.float32)
            for k in range(route.slots.shape[1]):
                has = route.slots[:, k] >= 0
                partial_NH[has] += x[route.slots[has, k]].float()
        else:
            partial_NH = x[:num_recv].float()
        # Back to the rank-major order, then to the source ranks.
        rank_major_NH = torch.empty_like(partial_NH)
        rank_major_NH[route.order] = partial_NH
        back_SH = self._all_to_all(rank_major_NH, route.send_counts, route.recv_counts)
        sum_TH = torch.zeros(route.num_tokens, hidden, dtype=torch.float32)
        sum_TH.index_add_(0, route.send_src, back_SH)
        result = sum_TH.to(x.dtype)
        out = _garbage(result, route.num_tokens, 0)

        def deliver() -> None:
            out.copy_(result)

        event = self._event(deliver, async_with_compute_stream)
        return self._wrap(out), None, event

    # ------------------------------------------------------------------ helpers
    def _check_stream_args(self, previous_event: Optional[FakeEventHandle],
                           allocate_on_comm_stream: bool) -> None:
        if previous_event is not None:
            assert isinstance(previous_event, FakeEventHandle)
            assert allocate_on_comm_stream, "previous_event needs allocate_on_comm_stream"

    def _event(self, deliver: Callable[[], None], is_async: bool) -> FakeEventOverlap:
        if is_async:
            return FakeEventOverlap(FakeEventHandle(deliver))
        deliver()
        return FakeEventOverlap(None)

    def _wrap(self, t: Tensor) -> Tensor:
        return t.as_subclass(DeviceOnlyTensor) if self.device_only else t

    def _exchange_counts(self, send_counts: list[int]) -> list[int]:
        if self.group is None:
            return list(send_counts)
        recv = torch.empty(self.num_ranks, dtype=torch.int64)
        dist.all_to_all_single(recv, torch.tensor(send_counts, dtype=torch.int64),
                               group=self.group)
        return recv.tolist()

    def _all_to_all(self, send: Tensor, recv_counts: list[int],
                    send_counts: list[int]) -> Tensor:
        if self.group is None:
            return send.clone()
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts,
                               group=self.group)
        return recv


def _garbage(like: Tensor, rows: int, num_experts: int) -> Tensor:
    """[rows, *like.shape[1:]] of like's dtype, filled with what uninitialised device
    memory might hold: NaN for floats, an out-of-range id for integers."""
    shape = (rows, *like.shape[1:])
    if like.dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=like.dtype)
    return torch.full(shape, num_experts + 1000, dtype=like.dtype)
