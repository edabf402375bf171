"""What `dbo run` (and `dbo trace`) runs: `RunConfig`, checked before any rank starts,
and the model config it makes for a group of ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dbo.cli import CAPACITY_GRAPH_BACKENDS, check_graph_backends, check_out_dir
from dbo.cli.run_hf import check_hf_options, hf_model_config
from moe.backends import BACKENDS as MOE_BACKENDS
from moe.experts import EXPERTS as EXPERT_KERNELS
from moe.models.presets import PRESETS
from moe.registry import UNTESTED_BACKENDS

# The backends `dbo run` offers: every registered one (not deepep_v2, never run against
# its library).
BACKENDS = ("auto", *(name for name in MOE_BACKENDS if name not in UNTESTED_BACKENDS))
EXPERTS = ("auto", *EXPERT_KERNELS)
# Backends `--cuda-graph` runs: those capturable with the capacity `setup_rank` sets.
GRAPH_BACKENDS = ("auto", *CAPACITY_GRAPH_BACKENDS)
# What records the traced steps (`dbo trace --profiler`).
PROFILERS = ("torch", "nsys")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What `dbo run` runs."""

    preset: str = "tiny"
    """Model preset (moe.models.transformer.PRESETS)."""
    tokens: int = 256
    """Tokens per rank (rank r gets tokens - r * tokens // 8, so ranks differ)."""
    requests: int = 8
    """Requests per rank (packed, variable lengths)."""
    backend: str = "auto"
    """Dispatch/combine backend."""
    experts: str = "auto"
    """Expert kernel."""
    num_experts: Optional[int] = None
    """Override the preset's routed expert count (over all ranks: a multiple of the
    world size)."""
    steps: int = 3
    """Timed steps per mode, after warm-up."""
    warmup: int = 1
    """Untimed steps per mode first."""
    layers: Optional[int] = None
    """Override the preset's layer count."""
    seed: int = 0
    """Weights and batches derive from it."""
    out: str = "dbo_out/run"
    """Output folder."""
    trace: bool = True
    """Capture one DBO step under torch.profiler (trace, analysis, timeline)."""
    cuda_graph: bool = False
    """Run and time both modes as CUDA graph replays (GPUs only)."""
    hf: Optional[str] = None
    """A local Hugging Face checkpoint folder to run instead of the preset (`moe.hf.load`)."""
    hf_config: Optional[str] = None
    """A tiny random Hugging Face model of this architecture to run instead of the preset
    (`moe.hf.tiny`)."""
    decode_steps: int = 0
    """Decode steps of one token per request over KV caches after the prefill, DBO off
    and on, compared and timed (`dbo.cli.run_decode`); 0: none."""
    profiler: str = "torch"
    """What records the traced steps: "torch" (torch.profiler) or "nsys" (NVTX ranges
    inside cudaProfilerStart/Stop, for Nsight Systems; GPUs only)."""

    def __post_init__(self) -> None:
        for name in ("tokens", "requests", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup={self.warmup}: must be >= 0")
        if self.decode_steps < 0:
            raise ValueError(f"--decode-steps={self.decode_steps}: must be >= 0")
        if self.decode_steps and (self.hf is not None or self.hf_config is not None):
            raise ValueError("--decode-steps runs the preset model's KV caches: drop "
                             "--hf / --hf-config (moe.hf.generate decodes those)")
        if self.decode_steps and self.cuda_graph:
            raise ValueError("--decode-steps with --cuda-graph: decode steps read their "
                             "KV caches' lengths on the host, which a graph would bake in; "
                             "drop one of them (dbo bench --mode decode --cuda-graph "
                             "times graphed decode steps)")
        for name, choices in (("preset", PRESETS), ("backend", BACKENDS),
                              ("experts", EXPERTS), ("profiler", PROFILERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name}={getattr(self, name)!r}: choose one of "
                                 f"{', '.join(choices)}")
        for name in ("layers", "num_experts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value}: must be >= 1")
        check_out_dir("--out", self.out)
        check_hf_options(self)
        if self.cuda_graph:
            check_graph_backends((self.backend,), GRAPH_BACKENDS, option="--backend=",
                                 hint=" (auto picks a2a_ll on several ranks)")
        if self.cuda_graph and self.experts == "reference":
            raise ValueError("--cuda-graph with --experts=reference: the reference experts "
                             "read their token counts on the host; use triton or auto")


def check_backend_runs(backend: str) -> None:
    """Raise ImportError or ValueError, in one line, where `backend` cannot run in this
    process's environment, before any rank starts: `symm_mem` needs torch's NVSHMEM op,
    CUDA and NVSHMEM (`moe.backends.symm_mem_support.require_symm_mem`)."""
    if backend == "symm_mem":
        from moe.backends.symm_mem_support import require_symm_mem
        require_symm_mem()


def tokens_for_rank(job: RunConfig, rank: int) -> int:
    return max(1, job.tokens - rank * (job.tokens // 8))


def model_config(job: RunConfig, world_size: int) -> Any:
    """The preset's `ModelConfig` with the job's overrides for a group of `world_size`
    ranks. ValueError (with the fix) where the preset cannot run that way, e.g. experts
    that do not split over the ranks: call it before starting them."""
    from moe.models.transformer import get_preset

    if job.hf is not None or job.hf_config is not None:
        return hf_model_config(job, world_size)
    max_tokens = max(tokens_for_rank(job, r) for r in range(world_size))
    overrides: dict[str, Any] = {"max_tokens_per_rank": max_tokens}
    if job.layers is not None:
        overrides["num_layers"] = job.layers
    if job.num_experts is not None:
        overrides["num_experts"] = job.num_experts
    config = get_preset(job.preset, **overrides)
    if config.moe.num_experts % world_size:
        raise ValueError(f"{config.moe.num_experts} routed experts ({job.preset}) do not "
                         f"split over {world_size} ranks: pass --num-experts N with N a "
                         f"multiple of {world_size}, or another --world-size")
    return config
