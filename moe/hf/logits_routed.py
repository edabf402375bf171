"""Experts modules that route themselves from router logits, on the experts path of
`moe.hf.convert` (Aria under transformers 5.17).

Shape legend: T tokens, K top-k, E routed experts, H hidden, I one expert's width.

Some blocks hand their experts module the router logits, not the routing:
``experts(hidden_states [T, H], router_logits [T, E]) -> [T, H]``, the module turning the
logits into (top_k_index [T, K], top_k_weights [T, K]) with a method of its own
(`ROUTING_METHODS`, e.g. transformers 5.17's ``AriaExperts.route_tokens_to_experts``: top-k
of the logits, softmax over the top logits). Such a block converts on the experts path
as any other (`moe.hf.generic`), its experts module replaced by a `LogitsRoutedExperts`:
an `HFExperts` called as the block calls its experts, which routes with the replaced
module's own method (kept on a copy of the module without its expert tensors, so the
routing is the model's, not a reproduction of it) and hands that routing to the dispatch.

Where such a module keeps its expert tensors under other names than the experts
interface, or computes its activation inline (no `act_fn` / `_apply_gate` to probe),
`KNOWN` says, per class, which tensors hold what and what each expert computes:

=====================  =========================================================
transformers 5.17      its `AriaExperts`
=====================  =========================================================
fc1.weight [E, H, 2I]  the interface's ``gate_up_proj`` with ``is_transposed=True``
fc2.weight [E, I, H]   ``down_proj`` with ``is_transposed=True``
silu(x fc1[:I]) *      dbo's default form: silu(gate) * up, the gate rows first
x fc1[I:]
=====================  =========================================================

A module of another class is read as an interface module is: ``gate_up_proj`` /
``down_proj`` (not transposed, gate rows first) and its ``act_fn`` / ``_apply_gate``.
A module that takes the logits but has no routing method dbo can call is refused in one
line.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.backend_options import BackendOptions
from moe.config import MoEConfig
from moe.experts.form import ExpertForm
from moe.hf.generic import KNOWN_OPTIONS, ExpertsPlan, HFExperts, build_experts, plan_experts

__all__ = ["KNOWN", "LogitsRoutedExperts", "ROUTING_METHODS", "RoutedModule",
           "build_logits_routed", "plan_logits_routed", "takes_router_logits"]

#: The methods, in the order tried, by which an experts module turns router logits
#: [T, E] into its routing: two tensors, the expert ids [T, K] (integer) and their
#: weights [T, K], in either order.
ROUTING_METHODS = ("route_tokens_to_experts",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutedModule:
    """Where an experts module of one class keeps its expert tensors, and what each
    expert computes."""

    up: str = "gate_up_proj"
    """The up projection [E, 2I, H] ([E, H, 2I] transposed), dotted through children."""
    down: str = "down_proj"
    """The down projection [E, H, I] ([E, I, H] transposed)."""
    transposed: bool = False
    """Stored in x out ([E, H, 2I] / [E, I, H]), the interface's ``is_transposed``."""
    form: Optional[ExpertForm] = None
    """What each expert computes, where the module has no gate to probe; None: read from
    its `act_fn` / `_apply_gate` (`moe.hf.experts_form.identify_form`)."""

    def options(self) -> dict[str, bool]:
        """The experts-interface options (`moe.hf.generic.KNOWN_OPTIONS` names) of it."""
        return {**KNOWN_OPTIONS, "is_transposed": self.transposed}


#: Per experts class (name) that takes router logits and stores its experts otherwise
#: than the interface: its layout (the module doc's table).
KNOWN: dict[str, RoutedModule] = {
    # transformers 5.17: AriaGroupedExpertsGemm weights, silu(first half) * second half
    "AriaExperts": RoutedModule(up="fc1.weight", down="fc2.weight", transposed=True,
                                form=ExpertForm()),
}


def takes_router_logits(module: Any) -> bool:
    """Whether experts `module` is called with (hidden_states, router_logits): two
    arguments, the second named for logits."""
    if not isinstance(module, nn.Module):
        return False
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(params) == 2 and "logits" in params[1].name


def plan_logits_routed(path: str, block: nn.Module, *, model_config: Any, world: int,
                       backend: str, experts: str, check_weights: bool, layer_id: int,
                       note: str = "") -> ExpertsPlan:
    """`moe.hf.generic.plan_experts` for a block whose experts take router logits
    (`takes_router_logits`); ValueError, one line naming the block, for a module without
    a routing method dbo can call, and whatever `plan_experts` refuses."""
    module = block.experts
    cls = type(module).__name__
    method = routing_method(module)
    if method is None:
        params = list(inspect.signature(module.forward).parameters)
        raise ValueError(f"moe.hf.convert: block {path!r} ({type(block).__name__}, experts "
                         f"{cls}): its experts take forward({', '.join(params)}) and route the "
                         f"logits themselves, with no method dbo can call to route them "
                         f"({', '.join(ROUTING_METHODS)}): dbo runs experts on a routing of "
                         f"top_k_index / top_k_weights")
    layout = KNOWN.get(cls, RoutedModule())
    return plan_experts(path, block, model_config=model_config, world=world, backend=backend,
                        experts=experts, check_weights=check_weights, layer_id=layer_id,
                        note=note, options=layout.options(),
                        tensor_names=(layout.up, layout.down), form=layout.form,
                        routing=method)


def routing_method(module: nn.Module) -> Optional[str]:
    """The first of `ROUTING_METHODS` that `module` has, or None."""
    return next((name for name in ROUTING_METHODS if callable(getattr(module, name, None))),
                None)


def build_logits_routed(plan: ExpertsPlan, module: nn.Module, *, device: torch.device,
                        group: Optional[dist.ProcessGroup], capacity: Optional[int],
                        backend_options: Optional[BackendOptions],
                        last_layer: bool) -> "LogitsRoutedExperts":
    """`moe.hf.generic.build_experts` for a `plan_logits_routed` plan: the
    `LogitsRoutedExperts` of experts `module`, its experts uninitialised."""
    owner = route_owner(module, plan.tensor_names or ())
    built = functools.partial(LogitsRoutedExperts, route_owner=owner, routing=plan.routing)
    out = build_experts(plan, module, device=device, group=group, capacity=capacity,
                        backend_options=backend_options, last_layer=last_layer, cls=built)
    assert isinstance(out, LogitsRoutedExperts)
    return out


def route_owner(module: nn.Module, tensor_names: tuple[str, ...]) -> nn.Module:
    """A shallow copy of experts `module` without its expert tensors (the children or
    parameters that the first component of each of `tensor_names` names): what its
    routing method reads (its config, top-k), and no more."""
    heads = {name.split(".", 1)[0] for name in tensor_names}
    owner = copy.copy(module)
    owner._parameters = {k: v for k, v in module._parameters.items() if k not in heads}
    owner._buffers = dict(module._buffers)
    owner._modules = {k: v for k, v in module._modules.items() if k not in heads}
    return owner


class LogitsRoutedExperts(HFExperts):
    """A converted experts module called as the replaced one was, with the router logits:
    the replaced module's own routing method on them, then `HFExperts` (dispatch ->
    this rank's experts -> combine) on that routing.

    Args:
        config, form, **kwargs: as for `HFExperts`.
        route_owner: the replaced module without its expert tensors (`route_owner`), kept
            as child `route_owner`: whatever else it holds, the replaced module held.
        routing: the name of its routing method (`ROUTING_METHODS`).
    """

    OWNERS = (*HFExperts.OWNERS, "route_owner")

    def __init__(self, config: MoEConfig, form: ExpertForm, *, route_owner: nn.Module,
                 routing: str, **kwargs: Any) -> None:
        super().__init__(config, form, **kwargs)
        self.route_owner = route_owner
        self.routing = routing

    def forward(self, hidden_states: Tensor, router_logits: Tensor) -> Tensor:  # type: ignore[override]
        """hidden_states [..., H], router_logits [T, E] (the block's router on them) ->
        [..., H]: sum_k weight * expert(x) over the routing the replaced module computes."""
        route: Callable[[Tensor], Any] = getattr(self.route_owner, self.routing)
        routed = route(router_logits.reshape(-1, router_logits.shape[-1]))
        pair = routed if isinstance(routed, tuple) and len(routed) == 2 else ()
        ids = [t for t in pair if isinstance(t, Tensor) and not t.is_floating_point()]
        weights = [t for t in pair if isinstance(t, Tensor) and t.is_floating_point()]
        if len(ids) != 1 or len(weights) != 1:
            raise ValueError(f"LogitsRoutedExperts {self.path!r}: {self.source}.{self.routing} "
                             f"returned {_kinds(routed)}, not the routing dbo runs on: the "
                             f"expert ids and their weights, an integer and a floating-point "
                             f"[T, K] tensor in either order")
        return super().forward(hidden_states, ids[0], weights[0])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, routed by {self.source}.{self.routing}"


def _kinds(values: Any) -> str:
    """e.g. "(int64 [5, 2], float32 [5, 2])"."""
    if not isinstance(values, tuple):
        return type(values).__name__
    return "(" + ", ".join(f"{str(v.dtype).removeprefix('torch.')} {list(v.shape)}"
                           if isinstance(v, Tensor) else type(v).__name__
                           for v in values) + ")"
