"""What the comm benchmark times: an `Engine` (one dispatch, one combine, on fixed inputs)
made per point by a `Source` (one per backend name).

Shape legend: T tokens on this rank, H hidden, K top-k, R rows received here.

    source = make_source("a2a", shapes, group, tokens=(1, 128))   # or "deepep_raw_ht", ...
    engine = source.bind(x_TH, topk_weights_TK, topk_ids_TK)
    state = engine.dispatch(); out_TH = engine.combine(state)
    source.close()

Our backends go through the public `PrepareFinalize` interface only (`moe.backends`):
dispatch is `prepare` (the async path and its wait), combine is `finalize` of the
dispatched rows themselves (the expert step is the identity, so the combine has the
shapes a real one has). Each point builds the backend anew with
`MoEConfig.max_tokens_per_rank` = that point's T: fixed-capacity backends (a2a_ll, naive
with a capacity) get their best case. DeepEP's raw calls (`moe.bench.comm_raw`) are the
yardstick.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


RAW_DEEPEP = ("deepep_raw_ht", "deepep_raw_ll")
"""DeepEP's own calls, timed directly (`moe.bench.comm_raw`)."""

RAW_NCCL_EP = ("nccl_ep_raw_ll", "nccl_ep_raw_ht")
"""NCCL EP's own calls, timed directly (`moe.bench.comm_raw_nccl_ep`)."""

RAW_DEEPEP_V2 = ("deepep_v2_raw_prefill", "deepep_v2_raw_decode")
"""DeepEP v2's own calls, timed directly (`moe.bench.comm_raw_deepep_v2`)."""

RAW = RAW_DEEPEP + RAW_DEEPEP_V2 + RAW_NCCL_EP

# DeepSeek-V3's expert width: MoEConfig needs one, and no backend's exchange reads it.
_INTERMEDIATE = 2048


def bench_names() -> tuple[str, ...]:
    """Every plain name --backends accepts: the registered multi-rank backends (not
    `single_rank`: they exchange nothing), then the libraries' raw calls. A backend may
    also be named with options, `NAME:FIELD=VALUE[:FIELD=VALUE]` (`parse_spec`)."""
    from moe.backends import backends_with
    return backends_with(single_rank=False) + RAW


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A --backends entry as (backend name, its options' values): "nccl_ep:mode=ht" is
    ("nccl_ep", {"mode": "ht"}), "a2a_ll:combine_groups=2" ("a2a_ll", {"combine_groups":
    2}); a plain name has no values. Values read as int, then true/false, else text.
    ValueError, naming the choices, for an unknown name, a field the backend's options
    lack, or a value its options refuse."""
    name, *pairs = spec.split(":")
    if name not in bench_names() or (pairs and name in RAW):
        choices = ", ".join(bench_names())
        raise ValueError(f"unknown backend {spec!r}: choose from {choices} (a backend may "
                         f"take options as NAME:FIELD=VALUE)")
    values: dict[str, Any] = {}
    for pair in pairs:
        field, eq, text = pair.partition("=")
        if not eq or not field:
            raise ValueError(f"backend {spec!r}: options are FIELD=VALUE, got {pair!r}")
        values[field] = _value(text)
    if values:
        _options(name, values)  # checked here, before any rank starts
    return name, values


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _options(name: str, values: dict[str, Any]) -> Any:
    """Backend `name`'s options class built with `values` (ValueError naming its fields
    for one it lacks)."""
    import dataclasses

    from moe.backends import backend_class
    options_type = backend_class(name, 2).options_type
    fields = [f.name for f in dataclasses.fields(options_type)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"backend {name!r} has no option {unknown[0]!r}: its options "
                         f"({options_type.__name__}) are {fields or 'none'}")
    try:
        return options_type(**values)
    except TypeError as exc:
        raise ValueError(f"backend {name!r}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """The exchange every engine runs: H, K, E over all ranks, element dtype."""

    hidden: int
    top_k: int
    num_experts: int
    dtype: torch.dtype


class Engine(Protocol):
    """One point's dispatch and combine on fixed inputs, called on the current stream."""

    def dispatch(self) -> Any:
        """Send the tokens; return what combine needs (valid on the current stream)."""

    def combine(self, state: Any) -> Tensor:
        """Return `dispatch`'s rows (as the expert outputs); out_TH on the current stream."""

    def rows_delivered(self, state: Any) -> int:
        """Rows `dispatch` delivered here, padding included."""

    def graph_blocker(self) -> Optional[str]:
        """Why a CUDA graph cannot capture the calls (they read device values on the host,
        or launch other work each call); None where it can (`dbo bench-comm
        --cuda-graph`)."""


class Source(Protocol):
    """Makes the engine of each point for one backend name."""

    name: str

    def bind(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor) -> Engine:
        """The engine for these inputs (raises where this backend cannot run them)."""

    def close(self) -> None:
        """Release what the source holds (buffers)."""


def check_timed(backend_cls: type) -> None:
    """ValueError where this benchmark does not time backend class `backend_cls`: one
    that dispatches router logits (`PrepareFinalize.routes_gathered_logits`), as its
    inputs are top-k ids and weights."""
    if getattr(backend_cls, "routes_gathered_logits", False):
        raise ValueError(f"backend {backend_cls.name!r} dispatches router logits (the "
                         f"monolithic form), not top-k ids: not timed here (dbo bench "
                         f"--backends {backend_cls.name} times it in a model step)")


class BackendEngine:
    """A `PrepareFinalize` backend: prepare, then finalize of the received rows."""

    def __init__(self, backend: Any, x_TH: Tensor, topk_weights_TK: Tensor,
                 topk_ids_TK: Tensor) -> None:
        from moe import Workspace

        check_timed(type(backend))
        self.backend = backend
        self.inputs = (x_TH, topk_weights_TK, topk_ids_TK)
        self.workspace = Workspace()

    def dispatch(self) -> Any:
        return self.backend.prepare(*self.inputs, workspace=self.workspace)

    def combine(self, state: Any) -> Tensor:
        return self.backend.finalize(state.x_RH, state, workspace=self.workspace)

    def rows_delivered(self, state: Any) -> int:
        return int(state.x_RH.shape[0])

    def graph_blocker(self) -> Optional[str]:
        if self.backend.graph_safe:  # `PrepareFinalize.graph_safe`
            return None
        return (f"backend {self.backend.name!r} reads device values on the host (its "
                f"counts) in the form timed here: it cannot be captured in a CUDA graph; "
                f"time it without --cuda-graph")


class BackendSource:
    """A registered backend, built for each point with capacity T (`moe.backends`), with
    the options of its --backends entry (`parse_spec`)."""

    def __init__(self, spec: str, shapes: Shapes, group: Optional[dist.ProcessGroup]) -> None:
        self.name = spec
        self.backend, values = parse_spec(spec)
        self.options = _options(self.backend, values) if values else None
        self.shapes = shapes
        self.group = group

    def bind(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor) -> Engine:
        from moe import MoEConfig
        from moe.backends import make_backend

        s = self.shapes
        config = MoEConfig(num_experts=s.num_experts, top_k=s.top_k, hidden_size=s.hidden,
                           intermediate_size=_INTERMEDIATE, dtype=s.dtype,
                           max_tokens_per_rank=max(1, x_TH.shape[0]), backend=self.backend,
                           backend_options=self.options)
        return BackendEngine(make_backend(config, self.group), x_TH, topk_weights_TK,
                             topk_ids_TK)

    def close(self) -> None:
        pass


def make_source(name: str, shapes: Shapes, group: Optional[dist.ProcessGroup], *,
                tokens: tuple[int, ...]) -> Source:
    """The source of `name` (`bench_names()`, or a backend with options, `parse_spec`);
    `tokens`: the run's points, tokens per rank (DeepEP's low-latency buffer is sized by
    them). Raises where the backend cannot run at all (e.g. DeepEP not installed)."""
    if name in RAW_DEEPEP:
        from moe.bench.comm_raw import DeepEPRawSource
        return DeepEPRawSource(name, shapes, group, tokens=tokens)
    if name in RAW_DEEPEP_V2:
        from moe.bench.comm_raw_deepep_v2 import DeepEPV2RawSource
        return DeepEPV2RawSource(name, shapes, group, tokens=tokens)
    if name in RAW_NCCL_EP:
        from moe.bench.comm_raw_nccl_ep import NCCLEPRawSource
        return NCCLEPRawSource(name, shapes, group, tokens=tokens)
    return BackendSource(name, shapes, group)
