"""The bfloat16 soak's check: every MoE layer of every step against a float32 dense
reference computed from the same bfloat16 inputs and weights.

Shape legend: T real rows of a step, L layers, H hidden, E experts (all of them), K top-k,
I expert width.

What is compared. The soak model returns, besides its output, each layer's input
(hidden_TLH, bfloat16) and router logits (logits_TLE, bfloat16, the layer's own router
on the layer's own rows). Layer l is checked on its own: the reference takes the layer's
actual bf16 input, routes with `moe.router.route` from the layer's logits (the routing
the layer itself picked: a last-bit difference in a logit could otherwise swap two
nearly tied experts and move a token's output by O(1)), then computes every expert, the
shared expert, the residual, the Linear and the GELU in float32 from the bf16 weights
(widened exactly), and compares with the layer's bf16 output (the next layer's input, or
the model's output). The logits themselves are compared with float32 logits of the
layer's input. Teacher-forcing each layer keeps the bound per layer: errors do not
compound through the stack, and a nearly tied routing at layer 1 cannot flip because
layer 0 rounded its output.

The bound. bfloat16 keeps 8 significant bits, so each rounding errs by at most
u = 2^-8 of the rounded value. One soak layer, `x = gelu(dense(x + moe(x)))`, rounds
11 times on the way from its input to its output: the routed experts' gate/up output,
their activation, their down output, the weighted combine; the shared expert's gate/up,
activation and down; routed + shared; x + moe; the Linear; the GELU (GEMMs accumulate
in float32 and round once). Activations are O(1) and the weights N(0, 1/fan_in), unit
gain, so each rounding moves an output element by at most about u times the step's
output scale; all 11 erring the same way at one element give 11 u = 4.3e-2 of the scale,
the scale being max(1, max |reference|) over the step's rows (as tests/moe/
test_deepep_backends.py holds one MoE layer to 4e-2). Random rounding errors add up to
far less: the soak reports the largest error it saw.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe import MoEConfig, init_moe_weights, route

#: bfloat16's unit roundoff: 8 significant bits.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
#: Roundings in one soak layer between its input and its output (module doc).
BF16_ROUNDINGS_PER_LAYER = 11
#: Largest |layer - dense reference| / max(1, max |reference|), any layer of any step.
BF16_REL_TOL = BF16_ROUNDINGS_PER_LAYER * BF16_UNIT_ROUNDOFF


class DenseReference:
    """Float32 copies of every soak layer's weights (all experts, on `device`), and the
    layer computed densely from them.

    Args:
        model: the `dbo.cli.soak.workload.SoakModel` (router, shared expert and Linear
            weights are read from it; its MoE layers hold this rank's experts only).
        expert_seeds: the seed `init_moe_weights` drew each layer's experts with.
    """

    def __init__(self, model: torch.nn.Module, expert_seeds: list[int]) -> None:
        self.config: MoEConfig = model.moe_config
        device = model.dense[0].weight.device
        self.layers = []
        for moe, dense, seed in zip(model.moe, model.dense, expert_seeds, strict=True):
            experts = init_moe_weights(self.config, seed=seed, device=device)
            shared = moe.shared_experts
            self.layers.append({
                "router_EH": moe.router.weight.float(),
                "w13_EIH": experts["w13"].float(),   # all E experts, [E, 2I, H]
                "w2_EHI": experts["w2"].float(),
                "shared_gate_up": shared.gate_up.weight.float(),
                "shared_down": shared.down.weight.float(),
                "dense_w": dense.weight.float(),
                "dense_b": dense.bias.float(),
            })

    def layer(self, index: int, x_TH: Tensor, logits_TE: Tensor) -> Tensor:
        """Layer `index` on x_TH [T, H] (the layer's bf16 input) routed from logits_TE
        [T, E] (the layer's logits): [T, H] float32, on x's device."""
        w = self.layers[index]
        inter = self.config.intermediate_size
        weights_TK, ids_TK = route(logits_TE, self.config)
        kept_TK = ids_TK >= 0  # a dropped slot (id -1) adds nothing
        combine_TE = torch.zeros(x_TH.shape[0], self.config.num_experts, device=x_TH.device)
        combine_TE.scatter_add_(1, ids_TK.clamp(min=0), weights_TK.float() * kept_TK)
        h_TH = x_TH.float()
        moe_TH = torch.zeros_like(h_TH)
        for e in range(self.config.num_experts):  # dense: every row through every expert
            gate_up_T2I = h_TH @ w["w13_EIH"][e].T
            act_TI = F.silu(gate_up_T2I[:, :inter]) * gate_up_T2I[:, inter:]
            moe_TH += combine_TE[:, e:e + 1] * (act_TI @ w["w2_EHI"][e].T)
        gate_TS, up_TS = (h_TH @ w["shared_gate_up"].T).chunk(2, dim=-1)
        moe_TH += (F.silu(gate_TS) * up_TS) @ w["shared_down"].T
        return F.gelu(F.linear(h_TH + moe_TH, w["dense_w"], w["dense_b"]))

    def error(self, out_TH: Tensor, hidden_TLH: Tensor, logits_TLE: Tensor) -> float:
        """The largest relative error of the step (module doc): over the layers, of their
        logits and their outputs, each |got - reference| / max(1, max |reference|).
        Arguments: the model's outputs on the step's real rows. inf for NaN/Inf."""
        if out_TH.shape[0] == 0:
            return 0.0
        worst = 0.0
        num_layers = hidden_TLH.shape[1]
        for i in range(num_layers):
            x_TH, logits_TE = hidden_TLH[:, i], logits_TLE[:, i]
            got_TH = hidden_TLH[:, i + 1] if i + 1 < num_layers else out_TH
            want_TE = x_TH.float() @ self.layers[i]["router_EH"].T
            worst = max(worst, relative_error(logits_TE, want_TE),
                        relative_error(got_TH, self.layer(i, x_TH, logits_TE)))
        return worst


def relative_error(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max(1, max |want|), in float32; inf where got is not finite."""
    diff = (got.float() - want).abs().max().item()
    if diff != diff:  # NaN
        return float("inf")
    return diff / max(1.0, want.abs().max().item())
