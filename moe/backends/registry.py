"""The names of the MoE backends, where each is implemented, and the named defaults.

Data and a lazy import only, so that `MoEConfig` can check a backend name (and find its
options class) without importing any backend up front: `backend_class` imports a
backend's module on first use. A new backend is one line in `BACKENDS`.
"""
from __future__ import annotations

import importlib
from typing import Any

#: backend name -> "module:Class" (`moe.backends`); "auto" is `SINGLE_RANK_BACKEND` for
#: EP size 1, else `DEFAULT_BACKEND`.
BACKENDS: dict[str, str] = {
    "local": "moe.backends.local:LocalBackend",
    "naive": "moe.backends.naive:NaiveBackend",
    "naive_mono": "moe.backends.naive_mono:NaiveMonolithicBackend",
    "a2a": "moe.backends.a2a:AllToAllBackend",
    "a2a_ll": "moe.backends.a2a_ll:AllToAllLLBackend",
    "symm_mem": "moe.backends.symm_mem:SymmMemBackend",
    "deepep_ht": "moe.backends.deepep_ht:DeepEPHTBackend",
    "deepep_ll": "moe.backends.deepep_ll:DeepEPLLBackend",
    "deepep_v2": "moe.backends.deepep_v2:DeepEPV2Backend",
    "nccl_ep": "moe.backends.nccl_ep:NCCLEPBackend",
}

#: Backends whose exactness against their real library is not yet measured: `deepep_v2`
#: (DeepEP v2 needs NCCL >= 2.30.4 and peers; its layer has been built on the real
#: library, its tests run through tests/moe/fake_elastic_buffer.py) and `nccl_ep` (exact on
#: one GPU, not yet measured across two). The `dbo` commands do not offer them.
UNTESTED_BACKENDS: frozenset[str] = frozenset({"deepep_v2", "nccl_ep"})

#: What "auto" takes on an EP group of one rank (nothing to exchange).
SINGLE_RANK_BACKEND = "local"
#: What "auto" takes on several ranks: exact all-to-all, torch collectives only.
DEFAULT_BACKEND = "a2a"
#: The default where a step is captured in a CUDA graph (`dbo run --cuda-graph` with
#: "auto", the compile bench, the HF generate bench): fixed capacity, no host read.
DEFAULT_GRAPH_BACKEND = "a2a_ll"
#: What `dbo bench` compares when no backend is named.
COMPARED_BACKENDS: tuple[str, ...] = (DEFAULT_BACKEND, DEFAULT_GRAPH_BACKEND, "naive")

AUTO = "auto"


def resolve_backend_name(name: str, world_size: int) -> str:
    """Map "auto" to a concrete backend; reject unknown names."""
    if name == AUTO:
        return SINGLE_RANK_BACKEND if world_size == 1 else DEFAULT_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}: choose one of "
                         f"{sorted(BACKENDS) + [AUTO]}")
    return name


def options_with(name: str, world_size: int, **values: Any) -> Any:
    """Backend `name`'s options (its `options_type`) with `values` set, keeping only the
    fields it has and the values that differ from their defaults; None where nothing is
    left (the backend's defaults). E.g. `options_with("a2a_ll", 2, combine_groups=2)`
    is `A2ALLOptions(combine_groups=2)`, and None for backend "a2a"."""
    import dataclasses
    options_type = backend_class(name, world_size).options_type
    defaults = {f.name: f.default for f in dataclasses.fields(options_type)}
    given = {k: v for k, v in values.items() if k in defaults and v != defaults[k]}
    return options_type(**given) if given else None


def backend_class(name: str, world_size: int) -> type:
    """The class (a `moe.backends.base.PrepareFinalize`; not imported here, which imports
    `moe.config`) of backend `name` ("auto" allowed) for an EP group of `world_size`
    ranks, imported but not built: its class attributes (`needs_capacity`, `options_type`, ...)
    answer what a config needs before anything is made."""
    module_name, cls_name = BACKENDS[resolve_backend_name(name, world_size)].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
