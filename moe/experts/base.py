"""The expert-kernel interface and the steps every kernel shares.

Shape legend: N rows (tokens) given to the experts, K top-k, E local experts on this rank,
H hidden size, I intermediate size (w13 holds 2I rows: gate rows first, then up rows),
S = N * K (token, k) slots, numbered ``n * K + k``.

Every kernel computes, accumulating in float32::

    out[n] = sum_k  w[n, k] * W2_e( silu(Wgate_e x[n]) * Wup_e x[n] ),   e = ids[n, k]

with slots whose id is -1 (expert on another rank) contributing nothing. With `extras`
(`moe.experts.form.ExpertExtras`), the expert inside the sum is the one its form
describes (another activation, no gate, biases, a post-expert norm, ...); `supports`
says whether a kernel computes a form.
"""
from __future__ import annotations

import abc
from typing import ClassVar

import torch
from torch import Tensor

from moe.config import SUPPORTED_DTYPES
from moe.experts.form import ExpertExtras, ExpertForm
from moe.kernels.topk_sum import weighted_topk_sum
from moe.workspace import Workspace

__all__ = ["Experts", "check_expert_inputs", "weighted_topk_sum"]


class Experts(abc.ABC):
    """An expert kernel: the gated MLPs of the local experts plus the top-k weighted sum.

    Implementations are stateless apart from caches (weights are passed per call), can be
    built with no constructor arguments (`make_experts` does so), and register under
    ``name`` in ``moe.experts``.
    """

    name: ClassVar[str]
    """Registry name, e.g. "reference"."""

    @classmethod
    @abc.abstractmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """Whether this kernel runs on ``device``; when not, the reason / install hint."""

    @classmethod
    def supports(cls, form: ExpertForm) -> str | None:
        """None when this kernel computes experts of `form`, else why not (one line naming
        what it lacks). The torch kernels compute every form; this default says so."""
        return None

    @abc.abstractmethod
    def apply(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
              topk_weights_NK: Tensor, *, workspace: Workspace | None = None,
              extras: ExpertExtras | None = None, sms_shared: bool = False) -> Tensor:
        """Run the routed rows through their experts and reduce over k.

        Args:
            x_NH: [N, H] float32 / float16 / bfloat16; N may be 0.
            w13_EIH: [E, 2I, H], x's dtype; gate rows ``[:I]``, up rows ``[I:]`` ([E, I, H],
                the up rows only, for a form without a gate; interleaved rows for an
                interleaved form).
            w2_EHI: [E, H, I], x's dtype.
            topk_ids_NK: int64 [N, K] local expert ids in [0, E), or -1 for "not on this
                rank" (contributes nothing). Values are not range-checked (host sync).
            topk_weights_NK: float32 [N, K].
            workspace: scratch buffers to reuse (this ubatch's); None allocates.
            extras: the experts' form and its tensors (`moe.experts.form`); None: dbo's
                SwiGLU expert. A kernel raises ValueError for a form it does not compute
                (`supports`).
            sms_shared: the caller runs other streams' kernels (communication) beside
                these experts: a DBO step (`moe.modular_kernel`), or a probe that marks
                the model (`moe.modular_kernel.sharing_sms`). A kernel with a path that
                holds every SM until it ends (the Triton experts' persistent GEMMs) does
                not take it; the others ignore it.

        Returns:
            [N, H] in x's dtype, a fresh tensor (never workspace memory), valid on the
            current stream. Rows whose ids are all -1 are zero.
        """


def check_expert_inputs(
    x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor, topk_weights_NK: Tensor,
    extras: ExpertExtras | None = None,
) -> None:
    """Raise ValueError/TypeError when the `Experts.apply` arguments break its contract."""
    if x_NH.dim() != 2:
        raise ValueError(f"experts: x has shape {tuple(x_NH.shape)}: expected [N, H].")
    if x_NH.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"experts: x dtype {x_NH.dtype}: use one of {SUPPORTED_DTYPES}.")
    if extras is not None and not isinstance(extras, ExpertExtras):
        raise TypeError(f"experts: extras={extras!r}: pass a moe.experts.form.ExpertExtras "
                        f"or None.")
    per_width = 2 if extras is None else extras.form.rows_per_width()
    num_rows, hidden = x_NH.shape
    if w13_EIH.dim() != 3 or w13_EIH.shape[2] != hidden or w13_EIH.shape[1] % per_width != 0:
        layout = "2I, H={hidden}] (gate rows then up rows)" if per_width == 2 else "I, H={hidden}]"
        raise ValueError(
            f"experts: w13 has shape {tuple(w13_EIH.shape)}: expected [E, "
            f"{layout.format(hidden=hidden)}."
        )
    num_experts, inter = w13_EIH.shape[0], w13_EIH.shape[1] // per_width
    if tuple(w2_EHI.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"experts: w2 has shape {tuple(w2_EHI.shape)}: expected [E, H, I] = "
            f"[{num_experts}, {hidden}, {inter}] to match w13 {tuple(w13_EIH.shape)}."
        )
    if num_experts < 1:
        raise ValueError("experts: w13 holds 0 experts: every rank needs >= 1 local expert.")
    if w13_EIH.dtype != x_NH.dtype or w2_EHI.dtype != x_NH.dtype:
        raise TypeError(
            f"experts: weight dtypes w13={w13_EIH.dtype}, w2={w2_EHI.dtype} differ from x "
            f"dtype {x_NH.dtype}: keep activations and expert weights in one dtype."
        )
    if topk_ids_NK.dim() != 2 or topk_ids_NK.shape[0] != num_rows:
        raise ValueError(
            f"experts: topk_ids has shape {tuple(topk_ids_NK.shape)}: expected [N={num_rows}, K]."
        )
    if tuple(topk_weights_NK.shape) != tuple(topk_ids_NK.shape):
        raise ValueError(
            f"experts: topk_weights shape {tuple(topk_weights_NK.shape)} != topk_ids shape "
            f"{tuple(topk_ids_NK.shape)}."
        )
    if topk_ids_NK.dtype != torch.int64:
        raise TypeError(f"experts: topk_ids dtype {topk_ids_NK.dtype}: pass int64 (.long()).")
    if topk_weights_NK.dtype != torch.float32:
        raise TypeError(
            f"experts: topk_weights dtype {topk_weights_NK.dtype}: pass float32 (.float())."
        )
    devices = {t.device for t in (x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK)}
    if len(devices) != 1:
        raise ValueError(f"experts: inputs live on several devices {sorted(map(str, devices))}.")
    if extras is not None:
        extras.check(w13_EIH, w2_EHI)
