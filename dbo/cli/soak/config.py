"""The soak run's configuration and limits (see dbo.cli.soak for what the run does)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moe.backends import BACKENDS as MOE_BACKENDS
from moe.registry import UNTESTED_BACKENDS
from moe.experts import EXPERTS

# The soak moves tokens between ranks: every registered backend but the single-rank one.
BACKENDS = tuple(name for name in MOE_BACKENDS
                 if name != "local" and name not in UNTESTED_BACKENDS)
EXPERT_KERNELS = ("auto", *EXPERTS)

# Rank r's forced zero-token period (primes: any two ranks also meet on all-zero steps).
ZERO_EVERY = (11, 7, 13, 17, 19, 23, 29, 31)

KIB = 1024

# Growth bounds after warmup. Python-heap bytes do not stay flat without a leak: CPython
# keeps freed tuples/floats/lists in free lists (still "allocated" to tracemalloc) and its
# type attribute cache holds on to the last ~4096 looked-up names; both fill towards a
# fixed size, ever more slowly (2 gloo ranks, a2a, the defaults: +20 KiB after 200 steps,
# +39 KiB after 1950; 1 MoE layer: 4-10 KiB in any 100-step window). 1 MiB over 1950
# measured steps catches anything that keeps growing by more than ~540 bytes per step.
# The gc-tracked object count rose by 6-16 in the first interval after warmup and then
# stayed there; the tensor count stayed at 0 except +1/+2 at an isolated sample under
# load (the last collective's tensors, released by gloo's worker thread just after the
# step returned). A leak of one object per step adds one per measured step.
DEFAULT_BOUND_KIB = 1024
MAX_OBJECT_GROWTH = 64
MAX_TENSOR_GROWTH = 8


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """What `python -m dbo.cli.soak` runs."""

    steps: int = 2000
    """Steps in all, warmup included."""
    backend: str = "a2a"
    """MoE dispatch/combine backend: "naive", "a2a" or "a2a_ll"."""
    max_tokens: int = 64
    """Most tokens per rank and step (also MoEConfig.max_tokens_per_rank)."""
    layers: int = 2
    """MoE layers in the stack (each followed by a Linear + GELU)."""
    seed: int = 0
    """Weights, token counts and inputs derive from it."""
    warmup: int = 50
    """Steps before the memory baseline."""
    report_every: int = 200
    """Steps between memory samples and progress lines."""
    hidden: int = 32
    """Hidden size H."""
    intermediate: int = 16
    """Expert width I."""
    num_experts: int = 8
    """Routed experts over all ranks (a multiple of the world size)."""
    top_k: int = 2
    """Experts per token."""
    experts: str = "auto"
    """Expert kernel; "auto": "reference" on CPU, the fastest available on GPU."""
    atol: float = 1e-5
    """Largest |DBO - reference| at any element of any step (fp32; raise it for large --hidden)."""
    bound_kib: int = DEFAULT_BOUND_KIB
    """Largest allowed growth (KiB) of tracemalloc and of tensor storage after warmup."""
    trace_window: int = 0
    """tracemalloc only in the last N steps before each memory sample; 0: every step."""

    def __post_init__(self) -> None:
        for name in ("steps", "max_tokens", "layers", "report_every", "hidden",
                     "intermediate", "num_experts", "top_k"):
            _check_int(name, getattr(self, name), low=1)
        for name in ("seed", "warmup", "bound_kib"):
            _check_int(name, getattr(self, name), low=0)
        _check_int("trace_window", self.trace_window, low=0)
        if self.trace_window > self.report_every:
            raise ValueError(f"--trace-window={self.trace_window} exceeds --report-every="
                             f"{self.report_every}: windows end at the samples and must not "
                             f"overlap; use --trace-window <= --report-every")
        if self.warmup >= self.steps:
            raise ValueError(f"--warmup={self.warmup} (steps before the memory baseline) "
                             f"leaves no measured steps of --steps={self.steps}: use "
                             f"--steps > {self.warmup} or --warmup < {self.steps}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend={self.backend!r}: choose one of {', '.join(BACKENDS)} "
                             f"(the soak needs an expert-parallel backend)")
        if self.experts not in EXPERT_KERNELS:
            raise ValueError(f"--experts={self.experts!r}: choose one of "
                             f"{', '.join(EXPERT_KERNELS)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"--top-k={self.top_k} exceeds --num-experts={self.num_experts}")
        if (isinstance(self.atol, bool) or not isinstance(self.atol, (int, float))
                or not math.isfinite(self.atol) or self.atol < 0):
            raise ValueError(f"--atol={self.atol!r}: must be a finite number >= 0")


def _check_int(name: str, value: Any, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"--{name.replace('_', '-')}={value!r}: must be an int >= {low}")
