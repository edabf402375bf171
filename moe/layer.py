"""`MoELayer`: router -> modular kernel (dispatch, experts, combine) -> output, plus
optional shared experts. Works the same inside and outside a DBO step.

Shape legend: T tokens here, H hidden, I expert width, E experts (global), E_loc = E/W
experts on this rank, W ranks in the expert-parallel (EP) group, K top-k.

Parameters: `router.weight [E, H]`, `router.e_score_correction_bias [E]` (float32, when
`use_correction_bias`), `w13 [E_loc, 2I, H]` (gate rows, then up rows), `w2 [E_loc, H, I]`,
`shared_experts` (an `nn.Module` or None). Rank r of the EP group holds the E/W
consecutive experts from r*E/W; `expert_map` maps global ids to local ones (-1 elsewhere).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dbo.compiling import graph_break
from dbo.failures import collectives_issued, fail_call_after_collectives
from dbo.phases import phase_scope
from moe.backends import make_backend
from moe.config import MoEConfig
from moe.experts import make_experts
from moe.experts.base import Experts
from moe.inference_only import detach_with_error, needs_graph
from moe.modular_kernel import ModularKernel, SharesSMs
from moe.router import route
from moe.routing_log import RoutingLog
from moe.shared import SharedExperts


class Router(nn.Module):
    """The gate: `weight [E, H]`, and `e_score_correction_bias [E]` when configured."""

    def __init__(self, config: MoEConfig, *, device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                               dtype=config.dtype, device=device))
        if config.use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, dtype=torch.float32, device=device),
                requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x_TH: Tensor) -> Tensor:
        """Router logits [T, E] in x's dtype."""
        return F.linear(x_TH, self.weight)


class MoELayer(nn.Module, SharesSMs):
    """A Mixture-of-Experts FFN with asynchronous, DBO-aware dispatch and combine.

    Args:
        config: sizes, routing, dtype, capacity, and the backend and expert kernel
            (`MoEConfig.backend`, `MoEConfig.experts`).
        group: the EP process group; None means EP size 1 (all experts here). Building
            the layer is collective over it: every rank first checks, with one small
            all-gather, that all were given the same config, and raises
            `dbo.ConfigMismatchError` naming the fields that differ where not.
        layer_id: the layer's index, used in trace range names.
        last_layer: this is the model's last MoE layer: in a DBO step its last ubatch
            splits the combine (`ModularKernel`, `MoEConfig.split_last_combine`).
        device: where the parameters are created (uninitialised: load them with
            `load_weights` or `init_weights`).
    """

    def __init__(self, config: MoEConfig, *, group: Optional[dist.ProcessGroup] = None,
                 layer_id: int = 0, last_layer: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoELayer takes a moe.MoEConfig, got {type(config).__name__}")
        world = 1 if group is None else dist.get_world_size(group)
        self.config = config
        self.layer_id = layer_id
        self.last_layer = last_layer
        # Collective: the ranks agree on `config` first (ConfigMismatchError on every rank
        # where they differ), then num_experts must divide the EP size.
        self.backend = make_backend(config, group)
        self.num_local_experts = config.num_experts // world
        hidden, inter = config.hidden_size, config.intermediate_size
        self.router = Router(config, device=device)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * inter, hidden,
                                            dtype=config.dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, inter,
                                           dtype=config.dtype, device=device))
        self.shared_experts: Optional[nn.Module] = None
        if config.num_shared_experts > 0:
            self.shared_experts = SharedExperts(
                hidden_size=hidden, intermediate_size=config.num_shared_experts * inter,
                dtype=config.dtype, device=device)
        self.register_buffer("expert_map", self.backend.placement.expert_map(
            device if device is not None else "cpu"), persistent=False)
        self._kernels: dict[torch.device, ModularKernel] = {}
        # Set by moe.routing_log.record_routing: every call appends its logits and ids.
        self.routing_log: Optional[RoutingLog] = None

    @property
    def first_expert(self) -> int:
        return self.backend.placement.first_expert

    @property
    def cuda_graph_blocker(self) -> Optional[str]:
        """Why a step through this layer cannot be captured in a CUDA graph (something
        reads a device value on the host), or None when it can (`dbo.graphs`)."""
        if not self.backend.graph_safe:
            return (f"backend {self.backend.name!r} reads device values on the host (use "
                    f"backend 'a2a_ll', 'naive' with MoEConfig.max_tokens_per_rank, or "
                    f"'local' on one rank)")
        if self.config.experts == "reference":
            return "experts 'reference' select each expert's rows on the host (use 'triton')"
        if self.config.check_finite_logits:
            return "MoEConfig.check_finite_logits reads its check on the host (set it False)"
        return None

    def dbo_sbo_blocker(self) -> Optional[str]:
        """Why this layer has nothing to overlap in a single-batch-overlap step (the
        runner then runs such steps without overlap), or None when its dispatch and
        combine are collectives that the shared experts and the own rows can hide under
        (`dbo.runner`, `DBOConfig.overlap`)."""
        if self.backend.world_size == 1:
            return (f"backend {self.backend.name!r} on one rank has no dispatch or combine "
                    f"to overlap")
        return None

    def dbo_max_tokens_per_rank(self) -> Optional[int]:
        """The most tokens one rank may send through this layer per step
        (`MoEConfig.max_tokens_per_rank`), or None: the DBO runner stops a step over it
        on every rank at once, before any collective (`dbo.agreement`)."""
        return self.config.max_tokens_per_rank

    def dbo_max_tokens_per_ubatch(self) -> Optional[int]:
        """The most tokens one rank may send through this layer in one ubatch of a DBO
        step (its backend's `max_tokens_per_ubatch`, from the backend's options), or None:
        the step's capacity."""
        return self.backend.max_tokens_per_ubatch

    def dbo_agreement(self) -> dict[str, object]:
        """What every rank's copy of this layer must share, or the ranks' dispatch and
        combine collectives differ (checked by the DBO runner's vote, `dbo.agreement`)."""
        return {**self.config.agreement_fields(),
                **type(self.backend).agreement_fields(self.config), "backend": self.backend.name,
                "split_combine": self.last_layer and self.config.split_last_combine}

    def load_weights(self, weights: dict[str, Tensor], *, global_experts: bool = True) -> None:
        """Copy `router_weight`, `w13`, `w2` (and `e_score_correction_bias`) in.

        With `global_experts`, w13/w2 hold all E experts and this rank takes its slice.
        """
        sl = slice(self.first_expert, self.first_expert + self.num_local_experts)
        with torch.no_grad():
            self.router.weight.copy_(weights["router_weight"])
            if self.router.e_score_correction_bias is not None:
                self.router.e_score_correction_bias.copy_(weights["e_score_correction_bias"])
            self.w13.copy_(weights["w13"][sl] if global_experts else weights["w13"])
            self.w2.copy_(weights["w2"][sl] if global_experts else weights["w2"])

    def dbo_check_inputs(self, x_TH: Tensor) -> None:
        """The input checks of `forward` alone (shape, dtype, device; no device reads):
        a `DBORunner` over this layer runs them before its vote, so a rank whose input
        fails them stops every rank there (`dbo.agreement`)."""
        self._check_input(x_TH)

    def forward(self, x_TH: Tensor) -> Tensor:
        """[T, H] -> [T, H], both in config.dtype on the parameters' device.

        Inference-only (`moe.inference_only`): no autograd graph is recorded inside, and a
        backward that reaches the output raises RuntimeError instead of a wrong gradient.

        The input is checked here, before any collective, on this rank only: no vote
        runs per layer call (over NCCL one would be a host sync per layer), so where the
        group has other ranks they are not told and wait in this layer's dispatch until
        the group's timeout. A `DBORunner` (with `DBOConfig(enabled=False)` for no
        overlap) runs the model's `dbo_check_inputs` before its step's vote, on every
        rank (docs/models.md).
        """
        try:
            self._check_input(x_TH)
        except (TypeError, ValueError) as exc:
            self._note_peers_not_told(exc)
            raise
        if needs_graph(x_TH, self):
            with torch.no_grad():
                out_TH = self.forward(x_TH)
            experts = self._kernel(x_TH.device).experts.name  # "auto" resolved
            return detach_with_error(out_TH, [x_TH, *self.parameters()], what=(
                f"MoELayer layer {self.layer_id} (backend {self.backend.name!r}, experts "
                f"{experts!r})"))
        issued = collectives_issued()
        try:
            return self._route_and_exchange(x_TH)
        except BaseException as exc:
            # Raised after this call issued collectives: the ranks' sequences may differ,
            # so later collectives on the group refuse (`dbo.failures`).
            fail_call_after_collectives(exc, self.backend.group, issued_before=issued)
            raise

    def _route_and_exchange(self, x_TH: Tensor) -> Tensor:
        """`forward` past its checks: route, then the modular kernel."""
        with phase_scope("router", layer=self.layer_id):
            logits_TE = self.router(x_TH)
            if self.config.check_finite_logits:
                self._check_finite(logits_TE)
            bias_E = self.router.e_score_correction_bias
            topk_weights_TK = topk_ids_TK = None
            # The monolithic form routes after its dispatch, on every rank; here only
            # when the routing log wants this rank's ids.
            if not self.backend.routes_gathered_logits or self.routing_log is not None:
                topk_weights_TK, topk_ids_TK = route(logits_TE, self.config,
                                                     correction_bias_E=bias_E)
            if self.routing_log is not None:
                self.routing_log.add(self.layer_id, logits_TE, topk_ids_TK)
        return self._kernel(x_TH.device).forward(
            x_TH, topk_weights_TK, topk_ids_TK, w13_EIH=self.w13, w2_EHI=self.w2,
            shared_experts=self.shared_experts, layer=self.layer_id,
            split_combine=self.last_layer and self.config.split_last_combine,
            logits_TE=logits_TE, correction_bias_E=bias_E, sms_shared=self.sms_shared)

    # ------------------------------------------------------------------ internals
    def _kernel(self, device: torch.device) -> ModularKernel:
        kernel = self._kernels.get(device)
        return kernel if kernel is not None else self._new_kernel(device)

    @graph_break  # it imports the expert kernel's module: eagerly, once per device
    def _new_kernel(self, device: torch.device) -> ModularKernel:
        experts: Experts = make_experts(self.config.experts, device, policy=self.config.kernels)
        kernel = self._kernels[device] = ModularKernel(self.config, self.backend, experts)
        return kernel

    def _check_finite(self, logits_TE: Tensor) -> None:
        bad_T = ~torch.isfinite(logits_TE).all(dim=1)
        num_bad = int(bad_T.sum())  # the host sync this option costs
        if num_bad:
            first = bad_T.nonzero()[:5, 0].tolist()
            raise ValueError(f"MoELayer layer {self.layer_id}: router logits of {num_bad} of "
                             f"{logits_TE.shape[0]} tokens are NaN/Inf (first: {first}): check "
                             f"the inputs (MoEConfig.check_finite_logits=True raised this)")

    def _note_peers_not_told(self, exc: BaseException) -> None:
        """Say, on an input error raised in `forward`, that the group's other ranks wait."""
        if self.backend.world_size > 1 and hasattr(exc, "add_note"):
            exc.add_note(
                f"[dbo] rank {self.backend.placement.rank}: MoELayer layer {self.layer_id} "
                f"rejected its input before its first collective, and the other ranks of "
                f"its group were not told: they wait in its dispatch until the group's "
                f"timeout. Call the model through a DBORunner (DBOConfig(enabled=False) "
                f"runs it without overlap) with a dbo_check_inputs hook on the model "
                f"(MoELayer and MoETransformer have one): every rank then stops at the "
                f"step's vote")

    def _check_input(self, x_TH: Tensor) -> None:
        if not isinstance(x_TH, Tensor):
            raise TypeError(f"MoELayer.forward takes a [T, H] tensor, got {type(x_TH).__name__}")
        if x_TH.dim() != 2 or x_TH.shape[1] != self.config.hidden_size:
            raise ValueError(f"MoELayer.forward: x has shape {tuple(x_TH.shape)}, expected "
                             f"[T, hidden_size={self.config.hidden_size}]: flatten the batch "
                             f"and sequence dims into T")
        if x_TH.dtype != self.config.dtype:
            raise ValueError(f"MoELayer.forward: x is {x_TH.dtype} but MoEConfig.dtype is "
                             f"{self.config.dtype}: cast the input with .to({self.config.dtype})")
        if x_TH.device != self.w13.device:
            raise ValueError(f"MoELayer.forward: x is on {x_TH.device} but the layer's "
                             f"parameters are on {self.w13.device}: move one to the other")
