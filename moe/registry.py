"""The names of the MoE backends and expert kernels, and where each is implemented.

Data only (no imports), so that `MoEConfig` can check a name without importing a
backend or a kernel: `moe.backends` and `moe.experts` import their class on first use.
"""
from __future__ import annotations

#: backend name -> "module:Class" (`moe.backends`); "auto" is local for EP size 1, else a2a.
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
}

#: Backends registered by name whose adapter is not built yet: constructing one refuses
#: in one line saying what is missing (`moe.backends.deepep_support`).
NOT_BUILT_BACKENDS: frozenset[str] = frozenset({"deepep_v2"})

#: expert kernel name -> "module:Class" (`moe.experts`); "auto" picks the fastest available.
EXPERTS: dict[str, str] = {
    "reference": "moe.experts.reference:ReferenceExperts",
    "grouped": "moe.experts.grouped:GroupedExperts",
    "triton": "moe.experts.triton:TritonExperts",
}

AUTO = "auto"
