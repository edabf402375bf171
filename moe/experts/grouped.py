"""`GroupedExperts`: sort the (token, k) slots by expert once, then one grouped GEMM per layer.

Shape legend: N rows, K top-k, E local experts, H hidden, I intermediate, S = N * K slots
(sorted by expert; slots with id -1 sort last and are computed on garbage, then masked).

GEMM paths, chosen per call:

- ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (torch >= 2.9) or ``torch._grouped_mm``
  (2.8), with int32 end offsets per expert. Used when the build has it, the rows are
  16-byte aligned (H and I multiples of 16 / itemsize: the kernels need aligned strides),
  the weights are contiguous, on CUDA the dtype is bfloat16 (the only dtype its fast kernels
  and meta checks accept), and a one-off probe on that device and dtype gives exact results.
  No host sync: offsets stay on the device.
  Inside a graph that ``torch.compile`` traced, off CUDA, the GEMM is the op
  ``moe::grouped_mm`` (``_gmm`` says why).
- ``loop``: the fallback, one ``torch.mm`` per expert over its contiguous block of sorted
  rows (one host sync to read the block ends: a graph break under ``torch.compile``).
  Chosen over a padded ``bmm`` because its memory is S rows whatever the load imbalance
  (padding needs E * max_rows_per_expert).
  The reason is logged once per distinct reason.

Every form of `moe.experts.form` runs on both paths: the biases are added per sorted slot
after each GEMM, the activation and the post-expert norm run on the sorted rows.
"""
from __future__ import annotations

import logging
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from dbo.compiling import compiling, graph_break
from moe.experts.base import Experts, check_expert_inputs, weighted_topk_sum
from moe.experts.form import ExpertExtras, activate
from moe.workspace import Workspace, empty_from

__all__ = ["GroupedExperts", "grouped_mm_unsupported_reason"]

_logger = logging.getLogger(__name__)
_logged_reasons: set[str] = set()
# (device type, device index, dtype) -> None when grouped_mm works there, else the reason.
_probe_results: dict[tuple[str, int | None, torch.dtype], str | None] = {}


def _grouped_mm_fn() -> Callable[..., Tensor] | None:
    fn = getattr(F, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


@torch.library.custom_op("moe::grouped_mm", mutates_args=())
def _grouped_mm_op(a_SK: Tensor, b_GKN: Tensor, offs_G: Tensor) -> Tensor:
    """``grouped_mm(a, b, offs=offs)`` as an op of its own, for compiled graphs off CUDA
    (`_gmm`): [S, K] x [G, K, N] -> [S, N] in a's dtype."""
    fn = _grouped_mm_fn()
    assert fn is not None
    return fn(a_SK, b_GKN, offs=offs_G)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a_SK: Tensor, b_GKN: Tensor, offs_G: Tensor) -> Tensor:
    return a_SK.new_empty(a_SK.shape[0], b_GKN.shape[-1])


def _gmm(a_SK: Tensor, b_GKN: Tensor, offs_G: Tensor) -> Tensor:
    """``grouped_mm(a, b, offs=offs)``. Inside a compiled graph off CUDA it is the op
    ``moe::grouped_mm``: the shape function torch gives its grouped_mm (what dynamo runs
    on fake tensors) applies the CUDA kernel's rule, bfloat16 only, while the CPU kernel
    takes every float dtype (float32 included, as the probe checks), so tracing a CPU call
    in float32 would fail there. On CUDA the rules agree (`grouped_mm_unsupported_reason`
    asks for bfloat16) and the compiler gets torch's own op."""
    if compiling() and a_SK.device.type != "cuda":
        return _grouped_mm_op(a_SK, b_GKN, offs_G)
    fn = _grouped_mm_fn()
    assert fn is not None
    return fn(a_SK, b_GKN, offs=offs_G)


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run a tiny grouped GEMM once per (device, dtype); None if it is exact, else why not."""
    key = (device.type, device.index, dtype)
    if key in _probe_results:
        return _probe_results[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None  # cannot sync inside a graph capture; decide on the static rules alone
    return _run_probe(device, dtype)


@graph_break  # it compares on the host: once per (device, dtype), eagerly
def _run_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    key = (device.type, device.index, dtype)
    fn = _grouped_mm_fn()
    assert fn is not None
    # Small integers are exact in every dtype, so the check can demand equality.
    gen = torch.Generator().manual_seed(0)
    a_RK = torch.randint(-2, 3, (32, 16), generator=gen).to(device=device, dtype=dtype)
    b_GNK = torch.randint(-2, 3, (2, 16, 16), generator=gen).to(device=device, dtype=dtype)
    offs_G = torch.tensor([8, 24], dtype=torch.int32, device=device)  # rows 24: are ignored
    try:
        out = fn(a_RK, b_GNK.transpose(-2, -1), offs=offs_G)[:24].float()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        reason = f"grouped_mm failed on {device} {dtype}: {type(exc).__name__}: {exc}"
    else:
        a32 = a_RK.float()
        want = torch.cat([a32[:8] @ b_GNK[0].float().t(), a32[8:24] @ b_GNK[1].float().t()])
        exact = torch.equal(out, want)
        reason = None if exact else f"grouped_mm gave wrong results on {device} {dtype}"
    _probe_results[key] = reason
    return reason


def grouped_mm_unsupported_reason(
    x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor
) -> str | None:
    """None when the ``grouped_mm`` path can run these operands, else the reason."""
    if _grouped_mm_fn() is None:
        return f"torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm"
    dtype, device = x_NH.dtype, x_NH.device
    align = 16 // dtype.itemsize
    hidden, inter = x_NH.shape[1], w2_EHI.shape[2]
    if hidden % align or inter % align:
        return (
            f"H={hidden} / I={inter} are not multiples of {align} for {dtype}: grouped_mm "
            f"needs 16-byte aligned rows (pad them, e.g. with moe.config.round_up_hidden)"
        )
    if not (w13_EIH.is_contiguous() and w2_EHI.is_contiguous()):
        return "expert weights are not contiguous: call .contiguous() on w13 / w2 once"
    if device.type == "cuda" and dtype != torch.bfloat16:
        return f"grouped_mm on CUDA takes bfloat16 only, got {dtype}"
    return _probe(device, dtype)


def _log_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        _logger.warning("GroupedExperts: using the per-expert mm loop: %s", reason)


def _silu_and_mul(h_M2I: Tensor, *, out_MI: Tensor) -> None:
    """``out = silu(gate) * up`` computed in float32, stored in ``out``'s dtype."""
    inter = h_M2I.shape[1] // 2
    torch.mul(F.silu(h_M2I[:, :inter].float()), h_M2I[:, inter:], out=out_MI)


def _activate(h_MJ: Tensor, expert_M: Tensor, extras: ExpertExtras | None, *,
              out_MI: Tensor) -> None:
    """The form's activation of the first GEMM's rows (after its bias, `expert_M` the
    local expert of each row) in float32, stored in ``out``'s dtype; the default form
    takes the fused ``silu(gate) * up``."""
    if extras is None:
        _silu_and_mul(h_MJ, out_MI=out_MI)
        return
    h32_MJ = h_MJ.float()
    if extras.bias13_EJ is not None:
        h32_MJ = h32_MJ + extras.bias13_EJ.float().index_select(0, expert_M)
    out_MI.copy_(activate(h32_MJ, extras))


def _finish_rows(y_MH: Tensor, expert_M: Tensor, extras: ExpertExtras | None) -> Tensor:
    """The second GEMM's rows with the form's bias and post-expert norm (float32), or the
    rows as they are for the default form."""
    if extras is None or (extras.bias2_EH is None and extras.post_norm is None):
        return y_MH
    y32_MH = y_MH.float()
    if extras.bias2_EH is not None:
        y32_MH = y32_MH + extras.bias2_EH.float().index_select(0, expert_M)
    if extras.post_norm is not None:
        y32_MH = extras.post_norm(y32_MH).float()
    return y32_MH


class GroupedExperts(Experts):
    """Sorted slots + grouped GEMM (``grouped_mm``), or a per-expert ``mm`` loop fallback.

    Args:
        use_grouped_mm: None picks per call (see the module docstring); False forces the
            loop; True raises ``RuntimeError`` when ``grouped_mm`` cannot run a call.
    """

    name: ClassVar[str] = "grouped"

    def __init__(self, *, use_grouped_mm: bool | None = None) -> None:
        self.use_grouped_mm = use_grouped_mm
        self.last_path: str | None = None
        """GEMM path of the latest call, "grouped_mm" or "loop" (for tests and logs)."""

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """Always runs (the loop fallback needs only ``torch.mm``), except on meta tensors."""
        if torch.device(device).type == "meta":
            return False, "GroupedExperts cannot run on the meta device"
        return True, ""

    def apply(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
              topk_weights_NK: Tensor, *, workspace: Workspace | None = None,
              extras: ExpertExtras | None = None, sms_shared: bool = False) -> Tensor:
        """See `Experts.apply`. Uses ``workspace`` for the sorted input and activation;
        ignores ``sms_shared``."""
        check_expert_inputs(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK, extras)
        num_rows, hidden = x_NH.shape
        top_k = topk_ids_NK.shape[1]
        num_experts = w13_EIH.shape[0]
        num_slots, device, dtype = num_rows * top_k, x_NH.device, x_NH.dtype
        if num_slots == 0:
            return torch.zeros(num_rows, hidden, dtype=dtype, device=device)

        ids_S = topk_ids_NK.reshape(-1)
        key_S = torch.where(ids_S >= 0, ids_S, num_experts)  # dropped slots sort last
        sorted_key_S, order_S = torch.sort(key_S, stable=True)
        experts_E = torch.arange(num_experts, dtype=key_S.dtype, device=device)
        ends_E = torch.searchsorted(sorted_key_S, experts_E, right=True)  # block end per expert
        row_of_slot_S = torch.empty_like(order_S)
        row_of_slot_S[order_S] = torch.arange(num_slots, device=device)
        x_SH = empty_from(workspace, "grouped.x", (num_slots, hidden), dtype, device)
        torch.index_select(x_NH, 0, order_S // top_k, out=x_SH)

        if self.use_grouped_mm is False:
            reason = "use_grouped_mm=False"
        else:
            reason = grouped_mm_unsupported_reason(x_NH, w13_EIH, w2_EHI)
            if reason is not None and self.use_grouped_mm:
                raise RuntimeError(f"GroupedExperts(use_grouped_mm=True): {reason}.")
        # The local expert of each sorted slot (dropped slots, sorted last, read expert 0's
        # biases: their rows are masked in the sum).
        expert_S = torch.where(sorted_key_S < num_experts, sorted_key_S, 0)
        y_SH = None
        if reason is None:
            try:
                y_SH = self._grouped_mm(x_SH, w13_EIH, w2_EHI, ends_E.to(torch.int32), workspace,
                                        expert_S, extras)
                self.last_path = "grouped_mm"
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # a shape/layout rule of this build the checks missed
                if self.use_grouped_mm:
                    raise
                inter = w2_EHI.shape[2]
                reason = f"grouped_mm raised on {device} {dtype} (H={hidden}, I={inter}): {exc}"
        if y_SH is None:
            assert reason is not None
            if self.use_grouped_mm is None:
                _log_once(reason)
            self.last_path = "loop"
            y_SH = self._loop(x_SH, w13_EIH, w2_EHI, ends_E, workspace, expert_S, extras)
        return weighted_topk_sum(
            y_SH,
            topk_ids_NK,
            topk_weights_NK,
            out_dtype=dtype,
            row_of_slot_NK=row_of_slot_S.view(num_rows, top_k),
        )

    @staticmethod
    def _grouped_mm(
        x_SH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, ends_E: Tensor, workspace: Workspace | None,
        expert_S: Tensor, extras: ExpertExtras | None,
    ) -> Tensor:
        """[S, H] expert outputs in sorted order (`expert_S` the local expert of each sorted
        slot); rows past ``ends_E[-1]`` are garbage."""
        num_slots, inter = x_SH.shape[0], w2_EHI.shape[2]
        h_SJ = _gmm(x_SH, w13_EIH.transpose(-2, -1), ends_E)
        act_SI = empty_from(workspace, "grouped.act", (num_slots, inter), x_SH.dtype, x_SH.device)
        _activate(h_SJ, expert_S, extras, out_MI=act_SI)
        y_SH = _gmm(act_SI, w2_EHI.transpose(-2, -1), ends_E)
        return _finish_rows(y_SH, expert_S, extras)

    @staticmethod
    def _loop(
        x_SH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, ends_E: Tensor, workspace: Workspace | None,
        expert_S: Tensor, extras: ExpertExtras | None,
    ) -> Tensor:
        """Same contract as `_grouped_mm`, one ``mm`` per expert block (one host sync)."""
        num_slots, hidden = x_SH.shape
        inter, rows = w2_EHI.shape[2], w13_EIH.shape[1]
        dtype, device = x_SH.dtype, x_SH.device
        ends = ends_E.tolist()
        h_SJ = empty_from(workspace, "grouped.h", (num_slots, rows), dtype, device)
        act_SI = empty_from(workspace, "grouped.act", (num_slots, inter), dtype, device)
        # Workspace is safe here: apply() reduces y into a fresh tensor before it returns.
        y_SH = empty_from(workspace, "grouped.y", (num_slots, hidden), dtype, device)
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                torch.mm(x_SH[start:end], w13_EIH[e].t(), out=h_SJ[start:end])
            start = end
        num_routed = ends[-1]
        _activate(h_SJ[:num_routed], expert_S[:num_routed], extras, out_MI=act_SI[:num_routed])
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                torch.mm(act_SI[start:end], w2_EHI[e].t(), out=y_SH[start:end])
            start = end
        if extras is None:
            return y_SH
        # Garbage rows past num_routed stay out of the form's bias and norm (a norm of
        # garbage may raise or warn); their slots are masked in the sum.
        out_SH = y_SH.float()
        out_SH[:num_routed] = _finish_rows(y_SH[:num_routed], expert_S[:num_routed], extras)
        return out_SH
