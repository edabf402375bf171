"""MoE layer configuration (`MoEConfig`) and the hidden-size alignment helper.

Shape legend: T tokens, E experts (global), K top-k, H hidden size.

Routing variants selected by the config (see `moe.router.route` for the maths):

- ``scoring="softmax"`` or ``"sigmoid"``: expert scores from the router logits.
- ``n_group`` / ``topk_group``: grouped top-k (DeepSeek-V3, vLLM ``grouped_topk``). Experts
  are split into ``n_group`` contiguous groups; each group is scored by the max expert score
  in it, or, with ``use_correction_bias``, by the sum of its two best biased scores; only
  experts in the ``topk_group`` best groups may be picked.
- ``use_correction_bias``: ``e_score_correction_bias`` is added to the scores for the
  *selection* only; the returned weights are the unbiased scores of the picked experts.
- ``renormalize``: divide the K weights of a token by their sum.
- ``routed_scaling_factor``: multiplies the final K weights (after renormalisation).
- ``custom_routing_function``: replaces all of the above except the scaling factor; ids it
  returns outside [0, num_experts) drop their (token, k) slot (`moe.router`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from moe.kernels.policy import KernelPolicy
from moe.backend_options import BackendOptions
from moe.registry import AUTO, EXPERTS

__all__ = ["MoEConfig", "RoutingFunction", "round_up_hidden",
           "SUPPORTED_DTYPES"]

#: ``fn(logits_TE, top_k) -> (topk_weights_TK, topk_ids_TK)``; global expert ids.
RoutingFunction = Callable[[Tensor, int], "tuple[Tensor, Tensor]"]

#: Activation / weight dtypes the MoE layer supports.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

_SCORINGS = ("softmax", "sigmoid")
_BOOL_FIELDS = ("renormalize", "use_correction_bias", "apply_router_weight_on_input",
                "split_last_combine", "check_finite_logits")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape and routing of one MoE layer; shared by the router, kernels and backends."""

    num_experts: int
    """Number of routed experts over all ranks (E)."""
    top_k: int
    """Experts picked per token (K), 1 <= top_k <= num_experts."""
    hidden_size: int
    """Model hidden size (H)."""
    intermediate_size: int
    """Width of one expert's gated MLP (I); w13 is [E, 2I, H], w2 is [E, H, I]."""
    num_shared_experts: int = 0
    """Shared experts: one gated MLP of width num_shared_experts * intermediate_size; 0 = none."""
    scoring: str = "softmax"
    """Expert score function: "softmax" (over all experts) or "sigmoid" (per expert)."""
    renormalize: bool = True
    """Divide each token's K weights by their sum (not applied to custom routing)."""
    n_group: int | None = None
    """Grouped top-k: number of expert groups (must divide num_experts); None = plain top-k."""
    topk_group: int | None = None
    """Grouped top-k: number of groups a token may pick experts from; set with n_group."""
    use_correction_bias: bool = False
    """Add e_score_correction_bias [E] to the scores for selection only (DeepSeek-V3)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the final top-k weights (all variants, custom routing included)."""
    apply_router_weight_on_input: bool = False
    """Scale the expert input by the router weight instead of the output; top_k = 1 only."""
    custom_routing_function: RoutingFunction | None = None
    """fn(logits_TE, top_k) -> (weights_TK, ids_TK) replacing scoring/renormalize/groups; a
    (token, k) slot whose id is outside [0, num_experts) is dropped (adds nothing), on every
    backend and expert kernel."""
    dtype: torch.dtype = torch.float32
    """Activation and weight dtype: torch.float32, torch.float16 or torch.bfloat16."""
    max_tokens_per_rank: int | None = None
    """Tokens one rank may send per step (fixed-capacity backends size buffers by it)."""
    expert_chunk_size: int = 8192
    """Most tokens sent through the experts at once; larger batches go in chunks."""
    split_last_combine: bool = True
    """In a DBO step, the last ubatch of the model's last MoE layer (`MoELayer(last_layer=
    True)`) sends the other ranks' expert outputs first and computes its own rows while
    that combine is in flight (a2a, a2a_ll): the step's final combine is otherwise exposed.
    In a single-batch-overlap step (`DBOConfig.overlap`) every MoE layer's combine splits so."""
    kernels: KernelPolicy = KernelPolicy()
    """Which path the router, the backends' row kernels and the Triton experts take
    (`moe.kernels.policy`); the default is the shipped choice."""
    check_finite_logits: bool = False
    """Raise ValueError when router logits hold NaN/Inf (one host sync per layer); off: those tokens' outputs are NaN/Inf and every other token's output is unaffected."""
    backend: str = "auto"
    """Dispatch/combine backend (`moe.backends`): local, naive, naive_mono, a2a, a2a_ll,
    deepep_ht, deepep_ll; "auto": local for EP size 1, else a2a."""
    experts: str = "auto"
    """Expert kernel (`moe.experts`): reference, grouped, triton; "auto": the fastest available on the input's device."""
    backend_options: BackendOptions | None = None
    """The backend's own options: an instance of its `options_type` (e.g.
    `moe.backends.a2a_ll.A2ALLOptions(combine_chunks=2)` for backend a2a_ll); options of
    another backend are refused. None: the backend's defaults (`options`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kernels, KernelPolicy):
            raise TypeError(f"MoEConfig.kernels={self.kernels!r}: pass a "
                            "moe.kernels.policy.KernelPolicy(...)")
        # First: a string such as "false" is truthy, and the checks below read these.
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"MoEConfig.{name}={value!r}: must be True or False (a bool, "
                                f"not a {type(value).__name__}).")
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r}: must be a positive int.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                f"pick at most num_experts experts per token."
            )
        if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
            raise ValueError(
                f"MoEConfig.num_shared_experts={self.num_shared_experts!r}: must be an int "
                f">= 0 (0 = no shared experts)."
            )
        if self.scoring not in _SCORINGS:
            raise ValueError(f"MoEConfig.scoring={self.scoring!r}: use one of {_SCORINGS}.")
        self._check_groups()
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
            0.0 < float(factor) < float("inf")
        ):
            raise ValueError(
                f"MoEConfig.routed_scaling_factor={factor!r}: must be a finite number > 0 "
                f"(1.0 = no scaling)."
            )
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(
                f"MoEConfig.apply_router_weight_on_input=True needs top_k=1, got "
                f"top_k={self.top_k}: the input can carry only one weight."
            )
        self._check_custom_routing()
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"MoEConfig.dtype={self.dtype!r}: use one of {SUPPORTED_DTYPES}.")
        if self.max_tokens_per_rank is not None and (
            not _is_int(self.max_tokens_per_rank) or self.max_tokens_per_rank < 1
        ):
            raise ValueError(
                f"MoEConfig.max_tokens_per_rank={self.max_tokens_per_rank!r}: must be a "
                f"positive int, or None for backends without a fixed capacity."
            )
        if not _is_int(self.expert_chunk_size) or self.expert_chunk_size < 1:
            raise ValueError(
                f"MoEConfig.expert_chunk_size={self.expert_chunk_size!r}: must be a positive int."
            )
        # Lazily: moe.backends imports this module.
        from moe.backends.registry import BACKENDS
        for name, what, registry in (("backend", "MoE backend", BACKENDS),
                                     ("experts", "experts kernel", EXPERTS)):
            value = getattr(self, name)
            if value != AUTO and value not in registry:
                raise ValueError(f"unknown {what} {value!r} (MoEConfig.{name}): choose one "
                                 f"of {sorted(registry) + [AUTO]}")
        self._check_backend_options()

    def _check_groups(self) -> None:
        n_group, topk_group = self.n_group, self.topk_group
        if n_group is None:
            if topk_group is not None:
                raise ValueError(
                    f"MoEConfig.topk_group={topk_group!r} given without n_group: set n_group "
                    f"too, or leave both None for plain top-k."
                )
        else:
            if not _is_int(n_group) or n_group < 1:
                raise ValueError(f"MoEConfig.n_group={n_group!r}: must be a positive int or None.")
            if self.num_experts % n_group != 0:
                raise ValueError(
                    f"MoEConfig.n_group={n_group} does not divide num_experts="
                    f"{self.num_experts}: use a divisor of num_experts."
                )
            if topk_group is None:
                raise ValueError(
                    f"MoEConfig.topk_group=None with n_group={n_group}: set topk_group "
                    f"(1 <= topk_group <= n_group)."
                )
            if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
                raise ValueError(
                    f"MoEConfig.topk_group={topk_group!r}: must be an int in [1, n_group="
                    f"{n_group}]."
                )
            per_group = self.num_experts // n_group
            if topk_group * per_group < self.top_k:
                raise ValueError(
                    f"MoEConfig.topk_group={topk_group} groups of {per_group} experts hold "
                    f"fewer than top_k={self.top_k} experts: raise topk_group to at least "
                    f"{-(-self.top_k // per_group)}."
                )
            if self.use_correction_bias and per_group < 2:
                raise ValueError(
                    f"MoEConfig.n_group={n_group} leaves {per_group} expert per group, but "
                    f"use_correction_bias scores a group by its top-2 experts: use n_group <= "
                    f"{self.num_experts // 2}."
                )

    def _check_backend_options(self) -> None:
        options = self.backend_options
        if options is None:
            return  # the backend's defaults, which fit any config
        if not isinstance(options, BackendOptions):
            raise TypeError(f"MoEConfig.backend_options={options!r}: pass the backend's "
                            f"options (a moe.backend_options.BackendOptions), or None.")
        wanted = self.options_type()
        if type(options) is not wanted:
            owner = (f"of backend {options.backend_name!r}" if options.backend_name else
                     "of the backends without options")
            raise ValueError(f"MoEConfig.backend_options={type(options).__name__}(...) are the "
                             f"options {owner}, not of backend {self.backend!r} (which takes "
                             f"{wanted.__name__}): pass {wanted.__name__}(...) or None.")
        options.check(self)

    def options_type(self) -> type[BackendOptions]:
        """The options class of `backend` (its `PrepareFinalize.options_type`; "auto":
        that of the backends it may resolve to, which take the same). Imports the
        backend's module, builds nothing."""
        from moe.backends.registry import (DEFAULT_BACKEND, SINGLE_RANK_BACKEND,
                                           backend_class)
        if self.backend != AUTO:
            return backend_class(self.backend, 2).options_type
        single, default = (backend_class(SINGLE_RANK_BACKEND, 1).options_type,
                           backend_class(DEFAULT_BACKEND, 2).options_type)
        assert single is default, "the backends 'auto' picks must take the same options"
        return default

    @property
    def options(self) -> BackendOptions:
        """`backend_options`, or the backend's default options where None."""
        return self.backend_options if self.backend_options is not None else (
            self.options_type()())

    def _check_custom_routing(self) -> None:
        fn = self.custom_routing_function
        if fn is None:
            return
        if not callable(fn):
            raise ValueError(
                f"MoEConfig.custom_routing_function={fn!r} is not callable: pass "
                f"fn(logits_TE, top_k) -> (weights_TK, ids_TK), or None."
            )
        if self.n_group is not None or self.use_correction_bias:
            raise ValueError(
                f"MoEConfig.custom_routing_function is set together with n_group="
                f"{self.n_group} / use_correction_bias={self.use_correction_bias}, which it "
                f"would ignore: do the grouping/bias inside the function and unset them."
            )

    def agreement_fields(self) -> dict[str, object]:
        """The fields every rank of an EP group must share (`dbo.agreement`): those that
        shape the dispatch and combine collectives, and those that change the layer's
        math (ranks that differ there run a silently mixed model). Not here: what only
        picks this rank's kernels or chunking (`kernels`, `expert_chunk_size`) or checks
        its own values (`check_finite_logits`). The custom routing function is named by
        its module and qualified name. `backend` is as given ("auto" unresolved). The
        backend adds the fields of its options (`PrepareFinalize.agreement_fields`)."""
        fn = self.custom_routing_function
        routing = None if fn is None else (f"{getattr(fn, '__module__', '?')}."
                                           f"{getattr(fn, '__qualname__', type(fn).__name__)}")
        return {"num_experts": self.num_experts, "top_k": self.top_k,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_shared_experts": self.num_shared_experts, "scoring": self.scoring,
                "renormalize": self.renormalize, "n_group": self.n_group,
                "topk_group": self.topk_group, "use_correction_bias": self.use_correction_bias,
                "routed_scaling_factor": float(self.routed_scaling_factor),
                "apply_router_weight_on_input": self.apply_router_weight_on_input,
                "custom_routing_function": routing,
                "dtype": self.dtype, "backend": self.backend, "experts": self.experts,
                "max_tokens_per_rank": self.max_tokens_per_rank,
                "split_last_combine": self.split_last_combine}

    @property
    def experts_per_group(self) -> int:
        """Experts in one routing group (num_experts when grouped top-k is off)."""
        return self.num_experts // (self.n_group or 1)


#: Fields MoEConfig once had, now in a backend's options: the class to pass instead.
MOVED_TO_OPTIONS: dict[str, str] = {
    "max_tokens_per_ubatch": "A2ALLOptions(max_tokens_per_ubatch=...)",
    "combine_chunks": "A2ALLOptions(combine_chunks=...)",
    "deepep": "DeepEPHTOptions(worst_case_dispatch=...) or DeepEPLLOptions(fp8_dispatch=...)",
    "deepep_v2_mode": "DeepEPV2Options(mode=...)",
}


def _refuse_moved_fields(init: Callable[..., None]) -> Callable[..., None]:
    """MoEConfig's generated __init__, refusing a field that moved into a backend's
    options in one line that names where it went (not Python's "unexpected keyword")."""
    @functools.wraps(init)
    def checked(self: "MoEConfig", *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name in MOVED_TO_OPTIONS:
                raise TypeError(f"MoEConfig({name}=...) is a backend's option now: pass "
                                f"MoEConfig(backend_options={MOVED_TO_OPTIONS[name]}) "
                                f"(moe.backends)")
        init(self, *args, **kwargs)
    return checked


MoEConfig.__init__ = _refuse_moved_fields(MoEConfig.__init__)  # type: ignore[method-assign]


def round_up_hidden(hidden_size: int, dtype: torch.dtype, align_bytes: int = 512) -> int:
    """Smallest hidden size >= ``hidden_size`` whose row of ``dtype`` is ``align_bytes`` long.

    Backends that copy rows in fixed units (512 bytes) pad H up to this before dispatch
    and slice it off after combine. Example: ``round_up_hidden(7000, torch.bfloat16)`` is
    7168.
    """
    if not _is_int(hidden_size) or hidden_size < 1:
        raise ValueError(f"round_up_hidden: hidden_size={hidden_size!r} must be a positive int.")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"round_up_hidden: dtype={dtype!r} must be a torch.dtype.")
    itemsize = dtype.itemsize
    if not _is_int(align_bytes) or align_bytes < 1 or align_bytes % itemsize != 0:
        raise ValueError(
            f"round_up_hidden: align_bytes={align_bytes!r} must be a positive multiple of the "
            f"{dtype} element size ({itemsize} bytes)."
        )
    align = align_bytes // itemsize
    return -(-hidden_size // align) * align
