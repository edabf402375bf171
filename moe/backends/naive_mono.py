"""`naive_mono`: the naive backend's monolithic form. The router logits travel with the
tokens in the all-gather and every rank routes the gathered tokens itself, for expert
kernels that route internally; the combine is `naive`'s reduce-scatter.

Shape legend: T tokens here, C rows per rank in the gathered buffer, R = W * C gathered
rows, H hidden, E experts (global), K top-k, W ranks.

A packed row is `[valid (int64) | logits (E x float32) | x (H x dtype) | pad]` as uint8,
its length rounded up to 16 bytes. The logits travel in float32 (routing reads them in
float32 whatever their dtype, so nothing is lost); padding rows have valid = 0 and
route to no expert. Routing the gathered rows runs the same `route` on the same logits
as the modular form does on each rank, so both pick the same experts and weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moe.backends.base import Dispatched, Pending
from moe.backends.naive import NaiveBackend
from moe.router import route
from moe.workspace import Workspace


@dataclass(frozen=True)
class LogitRowLayout:
    """Byte offsets of the fields in a packed row for hidden size H and E experts."""

    hidden_size: int
    num_experts: int
    dtype: torch.dtype

    @property
    def x_offset(self) -> int:
        return 8 + self.num_experts * 4

    @property
    def row_bytes(self) -> int:
        used = self.x_offset + self.hidden_size * self.dtype.itemsize
        return -(-used // 16) * 16

    def unpack(self, rows_NB: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Views (valid_N1 int64, logits_NE float32, x_NH) into packed rows."""
        valid_N1 = rows_NB[:, :8].view(torch.int64)
        logits_NE = rows_NB[:, 8:self.x_offset].view(torch.float32)
        x_NH = rows_NB[:, self.x_offset:self.x_offset + self.hidden_size * self.dtype.itemsize]
        return valid_N1, logits_NE, x_NH.view(self.dtype)

    def padded_rows(self, capacity: int, x_TH: Tensor, logits_TE: Tensor) -> Tensor:
        """[capacity, row_bytes]: this rank's tokens (valid = 1), then padding rows."""
        num_tokens = x_TH.shape[0]
        rows_CB = torch.zeros(capacity, self.row_bytes, dtype=torch.uint8, device=x_TH.device)
        valid_C1, logits_CE, x_CH = self.unpack(rows_CB)
        valid_C1[:num_tokens] = 1
        logits_CE[:num_tokens] = logits_TE
        x_CH[:num_tokens] = x_TH
        return rows_CB


class NaiveMonolithicBackend(NaiveBackend):
    """All-gather of tokens and router logits, routing on every rank, reduce-scatter."""

    name = "naive_mono"
    routes_gathered_logits = True

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        raise TypeError("backend 'naive_mono' gathers router logits, not top-k ids: call "
                        "prepare_logits_async (the modular kernel does when "
                        "routes_gathered_logits is set)")

    def prepare_logits_async(self, x_TH: Tensor, logits_TE: Tensor, *,
                             correction_bias_E: Optional[Tensor],
                             workspace: Workspace) -> Pending[Dispatched]:
        """Start gathering every rank's tokens [T, H] and router logits [T, E]; the
        receiver routes all gathered rows here (`moe.router.route`, on the compute
        stream) and gives them with this rank's local expert ids. With
        `apply_router_weight_on_input` (top-1) the gathered inputs are scaled by their
        weight and the weights become 1, as the modular form does before its dispatch."""
        layout = LogitRowLayout(x_TH.shape[1], logits_TE.shape[1], x_TH.dtype)
        wait, gathered_RB, handle = self._gather_async(
            x_TH.shape[0], lambda capacity: layout.padded_rows(capacity, x_TH, logits_TE),
            x_TH.device)

        def receiver() -> Dispatched:
            wait.wait(gathered_RB)
            valid_R1, logits_RE, x_RH = layout.unpack(gathered_RB)
            weights_RK, ids_RK = route(logits_RE, self.config,
                                       correction_bias_E=correction_bias_E)
            ids_RK = torch.where(valid_R1 != 0, ids_RK, -1)
            if self.config.apply_router_weight_on_input:
                x_RH = (x_RH.float() * weights_RK).to(x_RH.dtype)
                weights_RK = torch.ones_like(weights_RK)
            return Dispatched(x_RH, self.local_ids(ids_RK), weights_RK, handle)

        return Pending(None, receiver)
