"""The names of the expert kernels, and where each is implemented.

Data only (no imports), so that `MoEConfig` can check a name without importing a
kernel: `moe.experts` imports its class on first use. The backends' names are
`moe.backends.registry`'s.
"""
from __future__ import annotations

#: expert kernel name -> "module:Class" (`moe.experts`); "auto" picks the fastest available.
EXPERTS: dict[str, str] = {
    "reference": "moe.experts.reference:ReferenceExperts",
    "grouped": "moe.experts.grouped:GroupedExperts",
    "triton": "moe.experts.triton:TritonExperts",
}

AUTO = "auto"
