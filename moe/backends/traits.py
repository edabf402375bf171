"""What each registered backend declares about itself, asked by name.

The facts live as class attributes of the backend classes (`PrepareFinalize`:
`needs_capacity`, `reads_counts_on_host`, ...); this module reads them through
`backend_class`, so a tool asks `backends_with(pads_to_capacity=True)` instead of keeping
a list of names by hand. Answers come in registry order (`moe.backends.registry.BACKENDS`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

from moe.backends.registry import BACKENDS, backend_class


@dataclass(frozen=True, kw_only=True)
class BackendTraits:
    """The declared traits of one backend (`PrepareFinalize` documents each)."""

    name: str
    #: Capturable in a CUDA graph in every config: nothing read on the host.
    graph_safe: bool
    #: Capturable once `MoEConfig.max_tokens_per_rank` is set (default form).
    graph_safe_with_capacity: bool
    #: Work grows with the capacity, not with the routed rows.
    pads_to_capacity: bool
    #: Reads token counts on the host (default form, no capacity).
    reads_counts_on_host: bool
    #: Every byte goes through the collectives the bench's ceiling probe records.
    comm_recordable: bool
    #: Needs `MoEConfig.max_tokens_per_rank`.
    needs_capacity: bool
    #: Needs more than torch and its collectives; never picked by "auto".
    opt_in: bool
    #: Routes the rows it receives from gathered router logits (monolithic form).
    routes_gathered_logits: bool
    #: Runs on an EP group of one rank only.
    single_rank: bool
    #: Takes a capacity per DBO ubatch (`A2ALLOptions.max_tokens_per_ubatch`).
    takes_ubatch_capacity: bool


#: The trait names `backends_with` takes.
TRAITS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(BackendTraits)
                                if f.name != "name")


def backend_traits(name: str) -> BackendTraits:
    """The declared traits of registered backend `name` ("auto" not taken: it is local or
    a2a by EP size). Imports the backend's module, builds nothing."""
    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}: choose one of {sorted(BACKENDS)}")
    cls = backend_class(name, 2)
    reads = bool(cls.reads_counts_on_host)
    return BackendTraits(
        name=name, graph_safe=not reads,
        graph_safe_with_capacity=bool(cls.graph_safe_with_capacity),
        pads_to_capacity=bool(cls.pads_to_capacity), reads_counts_on_host=reads,
        comm_recordable=bool(cls.comm_recordable), needs_capacity=bool(cls.needs_capacity),
        opt_in=bool(cls.opt_in), routes_gathered_logits=bool(cls.routes_gathered_logits),
        single_rank=bool(cls.single_rank),
        takes_ubatch_capacity=bool(cls.takes_ubatch_capacity))


def backends_with(*, among: Optional[Iterable[str]] = None, **wanted: bool) -> tuple[str, ...]:
    """The backends (registry order) whose traits equal every `wanted` value, e.g.
    `backends_with(pads_to_capacity=True, opt_in=False)`; `among` keeps only those
    names (None: every registered backend)."""
    unknown = sorted(set(wanted) - set(TRAITS))
    if unknown:
        raise ValueError(f"unknown backend trait(s) {unknown}: choose from {list(TRAITS)}")
    keep = set(BACKENDS if among is None else among)
    return tuple(name for name in BACKENDS if name in keep
                 and all(getattr(backend_traits(name), k) == v for k, v in wanted.items()))


#: The trait table's columns: (trait, heading), in the order docs/backends.md shows them.
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("reads_counts_on_host", "reads counts on the host"),
    ("graph_safe", "CUDA graphs"),
    ("graph_safe_with_capacity", "CUDA graphs with a capacity"),
    ("needs_capacity", "needs a capacity"),
    ("pads_to_capacity", "pads to its capacity"),
    ("takes_ubatch_capacity", "per-ubatch capacity"),
    ("comm_recordable", "ceiling probe"),
    ("opt_in", "opt-in"),
    ("single_rank", "one rank only"),
    ("routes_gathered_logits", "monolithic"),
)


def trait_table() -> str:
    """The declared traits of every registered backend as a Markdown table ("yes" or
    blank per cell), one row per backend in registry order: what docs/backends.md
    shows (a test keeps the two equal)."""
    head = "| name | " + " | ".join(h for _, h in TABLE_COLUMNS) + " |"
    rule = "|---" * (len(TABLE_COLUMNS) + 1) + "|"
    rows = []
    for name in BACKENDS:
        traits = backend_traits(name)
        cells = ["yes" if getattr(traits, t) else "" for t, _ in TABLE_COLUMNS]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows]) + "\n"
