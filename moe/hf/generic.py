"""The experts path of `moe.hf.convert`: any transformers MoE block whose experts go through
transformers' experts interface (`transformers.integrations.moe.use_experts_implementation`)
or hold its standard tensors.

Shape legend: T tokens, K top-k, E routed experts, E_loc = E / W of them on this rank, W
ranks in the EP group, H hidden, I one expert's width, J the rows of the up projection
(2I with a gate, I without).

An experts module of the interface is called by its block as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``:
the block has routed already, with its own router, and adds its shared experts and any
scaling itself. So this path keeps the block as it is and replaces only its `experts`
child by an `HFExperts`: dispatch over the EP group, this rank's experts, combine (with
the DBO yields inside the dispatch and the combine, `moe.modular_kernel`), on the routing
the block hands it. No per-architecture code: what an expert computes is read from the
module itself --

==========================  ==============================================================
the experts module          becomes (`moe.experts.form.ExpertForm`)
==========================  ==============================================================
``has_gate=False``          ``gated=False``: ``up_proj`` [E, I, H] and ``act_fn``
``is_concatenated=False``   ``interleaved=True``
``is_transposed=True``      weights stored as [E, J, H] / [E, H, I] when this rank's slice
                            is copied (the copy is made anyway)
``has_bias=True``           ``bias=True``: ``*_proj_bias`` [E, J] / [E, H]
``has_post_expert_norm``    ``post_norm=True``: the module's ``post_expert_norm`` (5.24)
``identity_expert``         ids past the E experts of ``down_proj`` (``gate_up_proj`` holds
                            E + Z) are zero-compute experts: weight * x, added on the token's
                            own rank, never dispatched (LongCat-Flash)
``_apply_gate``/``act_fn``  a named activation when it computes one on a probe (silu, gelu,
                            relu2, GPT-OSS's clamped ``swiglu_oai`` with the module's
                            alpha/limit, ...), else the module's own callable ("custom")
==========================  ==============================================================

An experts module that its block calls with the router logits instead, routing them
itself, takes this path through `moe.hf.logits_routed` (transformers 5.17's Aria); one
that holds the interface's tensors in another layout (DBRX's ``mlp.w1`` / ``v1`` / ``w2``
[E * I, H]), through `moe.hf.stored_experts`.

What dbo cannot run is refused before anything changes, naming the block and what it
lacks (`plan_experts`). The four architectures of `moe.hf.arch` keep their fused path
(`moe.hf.block`) by default; `convert(..., conversion="experts")` takes this path for
them too.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dbo.compiling import graph_break
from moe.backend_options import BackendOptions
from moe.backends import backend_class, make_backend, resolve_backend_name
from moe.config import SUPPORTED_DTYPES, MoEConfig
from moe.experts import experts_class, make_experts
from moe.experts.base import Experts
from moe.experts.bound import BoundExperts
from moe.experts.form import ExpertExtras, ExpertForm
from moe.hf.experts_form import gate_owner, identify_form, owner_gate
from moe.hf.experts_sizes import (check_declared_sizes, count_identity_experts, expert_sizes,
                                  find_top_k)
from moe.hf.input_scaled import INPUT_SCALED_BLOCKS, input_scaled_options
from moe.hf.stored_experts import StoredExperts, stored_layout
from moe.inference_only import detach_with_error, needs_graph
from moe.layer import MoELayer
from moe.modular_kernel import ModularKernel, SharesSMs

__all__ = ["ExpertsPlan", "HFExperts", "build_experts", "interface_options", "module_tensor",
           "plan_experts"]

#: The experts-interface options dbo serves, with transformers' defaults.
KNOWN_OPTIONS: dict[str, bool] = {"is_concatenated": True, "is_transposed": False,
                                  "has_bias": False, "has_gate": True,
                                  "has_post_expert_norm": False}



@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertsPlan:
    """One MoE block to convert on the experts path, checked."""

    path: str
    """Module path of the block, e.g. "model.layers.3.mlp"; its experts are path.experts."""
    source: str
    """The replaced experts module's class name."""
    config: MoEConfig
    form: ExpertForm
    transposed: bool
    """The module stores [E, H, J] / [E, I, H] (`is_transposed`)."""
    layer_id: int
    identity_experts: int = 0
    """Z zero-compute experts, ids [E, E + Z): weight * x on the token's own rank."""
    note: str = ""
    """Why the fused path was not taken, where the architecture has one ("" otherwise)."""
    input_scaled: bool = False
    """The block scales its experts' input by the routing weight (`moe.hf.input_scaled`):
    the whole block is replaced by an `InputScaledBlock`."""
    tensor_names: Optional[tuple[str, str]] = None
    """The module's up and down expert tensors where they are not the interface's, e.g.
    ("fc1.weight", "fc2.weight"); None: gate_up_proj (or up_proj) and down_proj."""
    routing: str = ""
    """The experts module's method that turns the router logits its block hands it into
    the routing (`moe.hf.logits_routed`), e.g. "route_tokens_to_experts"; "": the block
    hands its experts the routing."""
    stored: Optional[StoredExperts] = None
    """The module's layout of the interface's tensors (`moe.hf.stored_experts`; its
    tensors are then `tensor_names`); None: the interface's."""

    def describe(self) -> str:
        """e.g. "OlmoeExperts: silu(gate) * up" (with the zero-compute experts, if any)."""
        zero = f", {self.identity_experts} zero-compute experts" if self.identity_experts else ""
        scaled = ", routing weight on the input" if self.input_scaled else ""
        routed = f", routed by {self.source}.{self.routing}" if self.routing else ""
        stored = f", stored as {self.stored.describe()}" if self.stored else ""
        return f"{self.source}: {self.form.describe()}{zero}{scaled}{routed}{stored}"


def interface_options() -> dict[str, Any]:
    """The options of this transformers' `use_experts_implementation` with their defaults
    (e.g. 5.17 lacks `has_post_expert_norm`); {} where transformers has no interface."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return {}
    params = inspect.signature(use_experts_implementation).parameters
    return {name: p.default for name, p in params.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "experts_interface"}


def plan_experts(path: str, block: nn.Module, *, model_config: Any, world: int,
                 backend: str, experts: str, check_weights: bool, layer_id: int,
                 note: str = "", options: Optional[dict[str, bool]] = None,
                 tensor_names: Optional[tuple[str, str]] = None,
                 form: Optional[ExpertForm] = None, routing: str = "") -> ExpertsPlan:
    """Check `block`'s experts module; ValueError naming the block and what dbo cannot do.

    `backend` / `experts` are `convert`'s: the backend must take the model's routing (not
    route gathered logits itself) and an explicitly named expert kernel must compute the
    experts' form.

    For a module that is not called as the interface's (`moe.hf.logits_routed`): its
    interface options (`KNOWN_OPTIONS` names), its up and down expert tensors (dotted
    names in the module), its form where the module has no gate to probe (None: read as
    for any experts module, `identify_form`), the method that routes its logits.
    """
    module = getattr(block, "experts", None)
    cls = type(module).__name__

    def refuse(what: str) -> ValueError:
        return ValueError(f"moe.hf.convert: block {path!r} ({type(block).__name__}, experts "
                          f"{cls}): {what}")

    input_scaled = type(block).__name__ in INPUT_SCALED_BLOCKS
    if options is None:
        options = (input_scaled_options(block, find_top_k(block, module, model_config), refuse)
                   if input_scaled else _module_options(module, refuse))
    gated = options["has_gate"]
    up_name, down_name = tensor_names or ("gate_up_proj" if gated else "up_proj", "down_proj")
    stored = stored_layout(module) if tensor_names is None else None
    if stored is not None:  # the interface's tensors held otherwise: sizes without a copy
        stored.check_options(options, refuse=refuse)
        up, down = stored.interface_stand_ins(module, refuse=refuse)
    else:
        up, down = module_tensor(module, up_name), module_tensor(module, down_name)
    if not isinstance(up, Tensor) or not isinstance(down, Tensor):
        raise refuse(f"no expert tensors experts.{up_name} and experts.{down_name}: dbo runs "
                     f"experts stored as transformers' experts interface stores them, 3-D "
                     f"tensors over all experts ([E, 2I, H] and [E, H, I])")
    if tensor_names is not None and options["has_bias"]:
        raise refuse(f"biased experts stored as {up_name} / {down_name}: dbo serves biases "
                     f"only as the experts interface names them (gate_up_proj_bias, "
                     f"down_proj_bias)")
    transposed = options["is_transposed"]
    identity = count_identity_experts(module, up, down, transposed=transposed)
    if identity:  # the rows past down_proj's experts are never read (zero-compute experts)
        up = up[:down.shape[0]]
    e, j, h, i = expert_sizes(up, down, transposed=transposed, refuse=refuse, up_name=up_name)
    if gated and j != 2 * i:
        raise refuse(f"experts.{up_name} has {j} rows per expert, {down_name} {i}: a gated "
                     f"expert needs 2 * {i} (gate and up)")
    if not gated and j != i:
        raise refuse(f"experts.{up_name} has {j} rows per expert, {down_name} {i}: they must "
                     f"match")
    check_declared_sizes(module, e=e + identity, h=h, i=i, refuse=refuse)
    if options["has_bias"]:
        for name, shape in ((f"{up_name}_bias", (e, j)), ("down_proj_bias", (e, h))):
            bias = getattr(module, name, None)
            if not isinstance(bias, Tensor):
                raise refuse(f"biased experts (has_bias=True) without the tensor experts.{name}")
            if tuple(bias.shape) != shape:
                raise refuse(f"experts.{name} has shape {list(bias.shape)}, expected "
                             f"{list(shape)}: the weights do not match the experts module")
    if options["has_post_expert_norm"] and not isinstance(
            getattr(module, "post_expert_norm", None), nn.Module):
        raise refuse("has_post_expert_norm=True but no module experts.post_expert_norm")
    if up.dtype not in SUPPORTED_DTYPES:
        raise refuse(f"expert weights are {up.dtype}: dbo's experts take {SUPPORTED_DTYPES} "
                     f"(load the model in one of them)")
    if check_weights and up.is_meta:
        raise refuse("expert weights are on the meta device: load the weights first")
    if form is None:
        form = (stored.form(module, options, up_EJH=up, refuse=refuse) if stored is not None
                else identify_form(module, options, refuse=refuse)[0])
    top_k = find_top_k(block, module, model_config)
    if top_k is None:
        raise refuse("cannot find its top-k (no `top_k` / `num_experts_per_tok` on the block, "
                     "its router or the model config)")
    if e % world != 0:
        raise refuse(f"num_experts={e} is not divisible by the EP size {world}: use an "
                     f"expert-parallel group whose size divides {e}")
    try:
        config = MoEConfig(num_experts=e, top_k=top_k, hidden_size=h, intermediate_size=i,
                           dtype=up.dtype, backend=backend, experts=experts)
    except ValueError as exc:
        raise refuse(f"no MoE layer of these sizes: {exc}") from exc
    name = resolve_backend_name(backend, world)
    if backend_class(name, world).routes_gathered_logits:
        raise refuse(f"backend {name!r} routes gathered router logits itself, but the experts "
                     f"path runs on the block's own routing: use backend 'a2a', 'a2a_ll' or "
                     f"'naive'")
    if experts != "auto":
        unsupported = experts_class(experts).supports(form)
        if unsupported is not None:
            raise refuse(unsupported)
    return ExpertsPlan(path=path, source=cls, config=config, form=form, transposed=transposed,
                       layer_id=layer_id, note=note, identity_experts=identity,
                       input_scaled=input_scaled, routing=routing, stored=stored,
                       tensor_names=stored.names if stored is not None else tensor_names)


def build_experts(plan: ExpertsPlan, module: nn.Module, *, device: torch.device,
                  group: Optional[dist.ProcessGroup], capacity: Optional[int],
                  backend_options: Optional[BackendOptions], last_layer: bool,
                  cls: Optional[Callable[..., "HFExperts"]] = None) -> "HFExperts":
    """The `HFExperts` for the experts `module` of `plan` on `device`, its experts
    uninitialised (the caller copies this rank's in), the custom gate and the
    post-expert norm taken over. `cls`: what builds it, with `HFExperts`' arguments
    (a subclass that takes more bound to them); None: `HFExperts`."""
    config = dataclasses.replace(plan.config, max_tokens_per_rank=capacity,
                                 backend_options=backend_options)
    form = plan.form
    owner = gate_owner(module) if form.activation == "custom" else None
    post_norm = getattr(module, "post_expert_norm", None) if form.post_norm else None
    return (cls or HFExperts)(config, form, group=group, layer_id=plan.layer_id,
                              last_layer=last_layer, device=device,
                              path=plan.path + ".experts", source=plan.source,
                              gate_owner=owner, post_norm=post_norm,
                              identity_experts=plan.identity_experts)


class HFExperts(nn.Module, SharesSMs):
    """A converted experts module: the block's routing in, dbo's dispatch -> this rank's
    experts -> combine, [T, H] out.

    Parameters: `w13` [E_loc, J, H] (gate rows then up rows, or interleaved, or the up
    rows only, as `form` says), `w2` [E_loc, H, I], `bias13` [E_loc, J] and `bias2`
    [E_loc, H] (biased forms; else None), `post_expert_norm` (the module's, with
    `form.post_norm`), `gate_owner` (the replaced module without its expert tensors, whose
    `_apply_gate` / `act_fn` a "custom" form calls).

    Args:
        config: sizes (E, K, H, I), dtype, backend, expert kernel, capacity.
        form: what each expert computes.
        group: the EP group; None: EP size 1.
        layer_id, last_layer: as for `MoELayer` (trace names; the split last combine).
        device: where the parameters are created (uninitialised).
        path: this module's path in the model; source: the replaced module's class name.
        identity_experts: Z zero-compute experts after the E routed ones (ids [E, E + Z)):
            each adds weight * x on the token's own rank, outside the dispatch.
    """

    #: Which conversion path produced this module ("fused" for `HFMoEBlock`).
    dbo_path = "experts"
    #: Children that stand for the replaced module (copies of it without its expert
    #: tensors): what they hold, the replaced module held under the same names.
    OWNERS: tuple[str, ...] = ("gate_owner",)

    def __init__(self, config: MoEConfig, form: ExpertForm, *,
                 group: Optional[dist.ProcessGroup], layer_id: int, last_layer: bool,
                 device: torch.device | str | None, path: str, source: str,
                 gate_owner: Optional[nn.Module] = None,
                 post_norm: Optional[nn.Module] = None, identity_experts: int = 0) -> None:
        super().__init__()
        self.identity_experts = identity_experts
        self.config, self.form = config, form
        self.layer_id, self.last_layer = layer_id, last_layer
        self.path, self.source = path, source
        self.backend = make_backend(config, group)
        self.num_local_experts = config.num_experts // self.backend.world_size
        hidden, inter = config.hidden_size, config.intermediate_size
        rows = form.rows_per_width() * inter
        dtype = config.dtype
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, rows, hidden, dtype=dtype,
                                            device=device))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, inter, dtype=dtype,
                                           device=device))
        self.bias13: Optional[nn.Parameter] = None
        self.bias2: Optional[nn.Parameter] = None
        if form.bias:
            self.bias13 = nn.Parameter(torch.empty(self.num_local_experts, rows, dtype=dtype,
                                                   device=device))
            self.bias2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, dtype=dtype,
                                                  device=device))
        self.post_expert_norm = post_norm
        self.gate_owner = gate_owner
        if (form.activation == "custom") != (gate_owner is not None):
            raise ValueError("HFExperts: a 'custom' form needs gate_owner, and only it")
        self._kernels: dict[torch.device, ModularKernel] = {}

    # The runner's duck-typed hooks read `config`, `backend`, `last_layer` exactly as
    # MoELayer's do (`dbo.agreement`, `dbo.graphs`, `dbo.overlap`): the same functions.
    cuda_graph_blocker = MoELayer.cuda_graph_blocker
    dbo_sbo_blocker = MoELayer.dbo_sbo_blocker
    dbo_max_tokens_per_rank = MoELayer.dbo_max_tokens_per_rank
    dbo_max_tokens_per_ubatch = MoELayer.dbo_max_tokens_per_ubatch

    def dbo_agreement(self) -> dict[str, object]:
        """`MoELayer.dbo_agreement` plus the experts' form."""
        agreement = MoELayer.dbo_agreement(self)  # type: ignore[arg-type]
        return {**agreement, "expert_form": self.form.describe()}

    @property
    def first_expert(self) -> int:
        return self.backend.placement.first_expert

    def forward(self, hidden_states: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        """hidden_states [..., H], top_k_index / top_k_weights [T, K] (global expert ids
        and their weights, as the block's router gave them) -> [..., H] in hidden_states'
        dtype: sum_k weight * expert(x). Inference-only, as `MoELayer.forward`."""
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        ids_TK = top_k_index.reshape(x_TH.shape[0], top_k_index.shape[-1])  # T may be 0
        self._check(x_TH, ids_TK, top_k_weights)
        weights_TK = top_k_weights.reshape(ids_TK.shape).float()
        ids_TK = ids_TK.long()
        if needs_graph(x_TH, self):
            with torch.no_grad():
                out_TH = self._run(x_TH, ids_TK, weights_TK)
            return detach_with_error(out_TH, [x_TH, *self.parameters()], what=(
                f"HFExperts {self.path!r} (backend {self.backend.name!r})")).view(shape)
        return self._run(x_TH, ids_TK, weights_TK).view(shape)

    def extra_repr(self) -> str:
        return (f"path={self.path!r}, {self.source}: {self.form.describe()}, experts "
                f"{self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.config.num_experts}")

    # ------------------------------------------------------------------ internals
    def _run(self, x_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        identity_TH = None
        if self.identity_experts:
            # Zero-compute experts: weight * x here, their slots dropped (-1) from the dispatch.
            zero_TK = ids_TK >= self.config.num_experts
            identity_TH = x_TH.float() * torch.where(zero_TK, weights_TK, 0.0).sum(-1, keepdim=True)
            ids_TK = torch.where(zero_TK, -1, ids_TK)
        out_TH = self._kernel(x_TH.device).forward(
            x_TH, weights_TK, ids_TK, w13_EIH=self.w13, w2_EHI=self.w2, layer=self.layer_id,
            split_combine=self.last_layer and self.config.split_last_combine,
            sms_shared=self.sms_shared)
        return out_TH if identity_TH is None else (out_TH.float() + identity_TH).to(out_TH.dtype)

    def _kernel(self, device: torch.device) -> ModularKernel:
        kernel = self._kernels.get(device)
        return kernel if kernel is not None else self._new_kernel(device)

    @graph_break  # it imports the expert kernel's module: eagerly, once per device
    def _new_kernel(self, device: torch.device) -> ModularKernel:
        experts: Experts = make_experts(self.config.experts, device,
                                        policy=self.config.kernels, form=self.form)
        if not self.form.is_default:
            experts = BoundExperts(experts, self._extras)
        kernel = self._kernels[device] = ModularKernel(self.config, self.backend, experts)
        return kernel

    def _extras(self) -> ExpertExtras:
        gate_fn = None
        if self.gate_owner is not None:
            gate_fn = owner_gate(self.gate_owner, gated=self.form.gated)
        return ExpertExtras(form=self.form, bias13_EJ=self.bias13, bias2_EH=self.bias2,
                            gate_fn=gate_fn, post_norm=self.post_expert_norm)

    def _check(self, x_TH: Tensor, ids_TK: Tensor, weights: Tensor) -> None:
        cfg = self.config
        if x_TH.shape[-1] != cfg.hidden_size or x_TH.dtype != cfg.dtype:
            raise ValueError(f"HFExperts {self.path!r}: hidden_states are {x_TH.dtype} "
                             f"[..., {x_TH.shape[-1]}], the experts take {cfg.dtype} "
                             f"[..., {cfg.hidden_size}]")
        if ids_TK.shape[1] != cfg.top_k or weights.numel() != ids_TK.numel():
            raise ValueError(f"HFExperts {self.path!r}: top_k_index has {ids_TK.shape[1]} "
                             f"experts per token and top_k_weights {weights.numel()} values "
                             f"for {x_TH.shape[0]} tokens; the block was converted for "
                             f"top_k={cfg.top_k}")
        if x_TH.device != self.w13.device:
            raise ValueError(f"HFExperts {self.path!r}: hidden_states are on {x_TH.device}, "
                             f"the experts on {self.w13.device}: move one to the other")


# ---------------------------------------------------------------------- reading a module
def module_tensor(module: nn.Module, name: str) -> Any:
    """The attribute `name` of `module`, dotted names through its children
    ("fc1.weight"); None where a step is missing."""
    value: Any = module
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def _module_options(module: Any, refuse: Callable[[str], ValueError]) -> dict[str, bool]:
    """The experts module's interface options (dbo's `KNOWN_OPTIONS` names); ValueError
    for a module that is not an experts module, or sets an option dbo cannot serve."""
    if not isinstance(module, nn.Module):
        raise refuse("no `experts` module")
    interface = hasattr(module, "has_gate") and hasattr(module, "is_concatenated")
    if not interface:
        # Not decorated: taken when it is called as the interface is (the routing in) and
        # holds its standard tensors (checked by the caller).
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) != 3:
            raise refuse(f"its experts take forward({', '.join(p.name for p in params)}), not "
                         f"the routing: dbo runs experts called as transformers' experts "
                         f"interface calls them, forward(hidden_states, top_k_index, "
                         f"top_k_weights)")
        return dict(KNOWN_OPTIONS)
    if getattr(module, "_is_expert_parallel", False):
        raise refuse("transformers' own expert parallelism is on (_is_expert_parallel): load "
                     "the model without a tp_plan / distributed_config, dbo shards the experts")
    for name, default in interface_options().items():
        value = getattr(module, name, default)
        if name not in KNOWN_OPTIONS and value != default:
            raise refuse(f"experts-interface option {name}={value!r}, which dbo cannot serve "
                         f"(it serves {', '.join(KNOWN_OPTIONS)})")
    options = {name: getattr(module, name, default) for name, default in KNOWN_OPTIONS.items()}
    for name, value in options.items():
        if not isinstance(value, bool):
            raise refuse(f"experts-interface option {name}={value!r} is not a bool")
    return options
