"""What `dbo run` (and `dbo trace`) runs: `RunConfig`, checked before any rank starts,
and the model config it makes for a group of ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from dbo.cli import (check_backend_runs, check_backend_tokens,
                     check_fits_memory, check_graph_backends, check_out_dir)
from dbo.cli.job_base import ModelJob
from dbo.cli.run_hf import check_hf_options, hf_label, hf_model_config
from moe.backends import (AUTO, BACKENDS as MOE_BACKENDS, DEFAULT_BACKEND,
                          DEFAULT_GRAPH_BACKEND, SINGLE_RANK_BACKEND, UNTESTED_BACKENDS,
                          backends_with)
from moe.experts import EXPERTS as EXPERT_KERNELS
from moe.models import PRESETS

# The backends `dbo run` offers: every registered one (not deepep_v2, never run against
# its library).
BACKENDS = ("auto", *(name for name in MOE_BACKENDS if name not in UNTESTED_BACKENDS))
EXPERTS = ("auto", *EXPERT_KERNELS)
# Backends `--cuda-graph` runs: those capturable with the capacity `setup_rank` sets (the
# trait `graph_safe_with_capacity`: not a2a, which reads its token counts on the host, nor
# deepep_ht, capturable only in its worst-case form, which no command configures).
GRAPH_BACKENDS = ("auto", *backends_with(graph_safe_with_capacity=True, among=BACKENDS))
# What records the traced steps (`dbo trace --profiler`).
PROFILERS = ("torch", "nsys")
# What a plain `dbo run` runs on CUDA GPUs (`run_defaults`).
CUDA_PRESET = "deepseek-v3-like"
CUDA_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class RunConfig(ModelJob):
    """What `dbo run` runs (`seed`, and `num_experts` in place of the preset's routed
    expert count: `dbo.cli.job_base.ModelJob`)."""

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
    steps: int = 3
    """Timed steps per mode, after warm-up."""
    warmup: int = 1
    """Untimed steps per mode first."""
    layers: Optional[int] = None
    """Override the preset's layer count."""
    out: str = "dbo_out/run"
    """Output folder."""
    trace: bool = True
    """Capture one DBO step under torch.profiler (trace, analysis, timeline)."""
    cuda_graph: bool = False
    """Run and time both modes as CUDA graph replays (GPUs only)."""
    joined_experts: bool = False
    """DBO steps run each MoE layer's experts once over both ubatches' rows
    (`DBOConfig.joined_experts`)."""
    hf: Optional[str] = None
    """A local Hugging Face checkpoint folder to run instead of the preset (`moe.hf.load`)."""
    hf_config: Optional[str] = None
    """A tiny random Hugging Face model of this architecture to run instead of the preset
    (`moe.hf.tiny`)."""
    trust_remote_code: bool = False
    """Run the Python of the `hf` folder that its config.json's `auto_map` names (passed to
    `moe.hf.load`); without it such a folder is refused."""
    decode_steps: int = 0
    """Decode steps of one token per request over KV caches after the prefill, DBO off
    and on, compared and timed (`dbo.cli.run_decode`); 0: none."""
    profiler: str = "torch"
    """What records the traced steps: "torch" (torch.profiler) or "nsys" (NVTX ranges
    inside cudaProfilerStart/Stop, for Nsight Systems; GPUs only)."""
    errors_name_options: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("tokens", "requests", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: must be >= 1")
        if self.requests > self.tokens:
            raise ValueError(f"--requests={self.requests} exceeds --tokens={self.tokens}: "
                             f"each request holds at least one token; use --requests <= "
                             f"{self.tokens}, or --tokens >= {self.requests}")
        if self.warmup < 0:
            raise ValueError(f"--warmup={self.warmup}: must be >= 0")
        super().__post_init__()  # --seed, --num-experts
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
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers={self.layers}: must be >= 1")
        check_out_dir("--out", self.out)
        check_hf_options(self)
        if self.cuda_graph:
            check_graph_backends((self.backend,), GRAPH_BACKENDS, option="--backend=",
                                 hint=" (auto picks a2a_ll on several ranks)")
        if self.cuda_graph and self.experts == "reference":
            raise ValueError("--cuda-graph with --experts=reference: the reference experts "
                             "read their token counts on the host; use triton or auto")


def run_defaults(device_type: str) -> RunConfig:
    """What a `dbo run` (or `dbo trace`) with no model options runs on ranks computing on
    `device_type` ("cpu" or "cuda"). On CPU: the tiny fp32 preset, a functional check. On
    CUDA GPUs: DeepSeek-V3's layer shapes in bf16 (its preset: 4 layers, 3 of them MoE,
    256 experts of 7168 x 2048) at 4096 tokens per rank, where the dispatch and combine
    are large enough for DBO's overlap to show; its weights take about 70 GB on one GPU
    (less split over more), which an H200 holds."""
    if device_type == "cuda":
        return RunConfig(preset=CUDA_PRESET, tokens=CUDA_TOKENS)
    if device_type == "cpu":
        return RunConfig()
    raise ValueError(f"device type {device_type!r}: expected 'cpu' or 'cuda'")


def run_backend(job: RunConfig, world_size: int) -> str:
    """The backend the job's ranks build: `job.backend`, where "auto" is local on one
    rank, a2a on several, a2a_ll on several with --cuda-graph (capturable)."""
    if job.backend != AUTO:
        return job.backend
    if world_size == 1:
        return SINGLE_RANK_BACKEND
    return DEFAULT_GRAPH_BACKEND if job.cuda_graph else DEFAULT_BACKEND


def check_job_runs(job: RunConfig, world_size: int) -> None:
    """Everything about `job` on `world_size` ranks that a rank would refuse, checked
    here before any starts (ImportError or ValueError, one line with the fix): the model
    (experts over the ranks, `model_config`), the backend in this process's environment
    and on the model's shapes (`dbo.cli.check_backend_runs`), deepep_ll's capacity
    against NVSHMEM's queue depth, and the memory one rank would need."""
    config = model_config(job, world_size)
    backend = run_backend(job, world_size)
    check_backend_tokens(backend, "--tokens", job.tokens, world_size,
                         backend_option=f"--backend={backend}")
    check_backend_runs(backend, world_size, getattr(config, "moe", None))
    check_run_memory(job, config, world_size)


def step_bytes_per_token(config: Any, *, lm_head: bool = True) -> int:
    """A lower bound of the bytes one token adds to a forward step of preset `config` (a
    `ModelConfig`) on its rank: its logits row [V] (with `lm_head`), four hidden rows [H]
    (input, residual, norm, attention output) and its top-k expert rows, each [H] in and
    [2 I] between the expert GEMMs."""
    moe = config.moe
    elements = 4 * config.hidden_size + moe.top_k * (moe.hidden_size + 2 * moe.intermediate_size)
    if lm_head:
        elements += config.vocab_size
    return elements * config.dtype.itemsize


def kv_bytes_per_token(config: Any) -> int:
    """Bytes of one token's keys and values over every layer of preset `config`."""
    return (config.num_layers * 2 * config.num_kv_heads * config.head_dim
            * config.dtype.itemsize)


def check_run_memory(job: RunConfig, config: Any, world_size: int) -> None:
    """Refuse (`dbo.cli.check_fits_memory`) a job whose rank 0, the one with the most
    tokens, would need more memory than a rank has: the preset's weights on one of
    `world_size` ranks (`estimate_param_bytes`) plus `step_bytes_per_token` per token;
    with --decode-steps, the two KV caches (DBO off and on) of the prefill's tokens and
    of every decode step's. A --hf / --hf-config model: its logits [T, V] and four hidden
    rows per token (bf16 on GPUs, fp32 on CPU)."""
    from moe.models import estimate_param_bytes

    if job.hf is not None or job.hf_config is not None:
        size = 2 if torch.cuda.is_available() else 4
        check_fits_memory("--tokens", job.tokens, unit="token", model=hf_label(job),
                          per_unit_bytes=(config.vocab_size + 4 * config.hidden_size) * size,
                          shape_fix="use a smaller model", world_size=world_size)
        return
    weights = estimate_param_bytes(config, ep_size=world_size)
    kv = 2 * kv_bytes_per_token(config) if job.decode_steps else 0
    per_token = step_bytes_per_token(config) + kv
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    model = (f"preset {job.preset} ({config.num_layers} layers, {config.moe.num_experts} "
             f"experts over {ranks})")
    check_fits_memory("--tokens", job.tokens, unit="token", per_unit_bytes=per_token,
                      model=model, fixed_bytes=weights,
                      shape_fix="use more ranks (--world-size, GPUs), fewer --layers, or a "
                                "smaller --preset", world_size=world_size)
    if job.decode_steps:
        check_fits_memory("--decode-steps", job.decode_steps, unit="decode step",
                          per_unit_bytes=job.requests * kv, model=model,
                          fixed_bytes=weights + job.tokens * per_token,
                          fixed_what="weights and prefill",
                          shape_fix="use fewer --requests or --tokens",
                          world_size=world_size)


def tokens_for_rank(job: RunConfig, rank: int) -> int:
    return max(1, job.tokens - rank * (job.tokens // 8))


def model_config(job: RunConfig, world_size: int) -> Any:
    """The preset's `ModelConfig` with the job's overrides for a group of `world_size`
    ranks. ValueError (with the fix) where the preset cannot run that way, e.g. experts
    that do not split over the ranks: call it before starting them."""
    from moe.models import get_preset

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
