"""Configuration of `dbo bench --hf NAME` (`HFBenchConfig`): a Hugging Face MoE
architecture converted by `moe.hf.convert`, DBO off, SBO and DBO on, beside the
unconverted model.

    cfg = HFBenchConfig(arch="qwen3_moe", tokens=(16,), device="cpu", regime=CPU_REGIME)
    cfg = HFBenchConfig(arch="qwen3_moe", decode=HFDecodeOptions(requests=(2, 4)))  # decode
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", tokens=(4096,), backends=("a2a_ll",),
                        device="cuda", regime=EMULATED_REGIME, cuda_graph=True)  # graphed
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", decode=HFDecodeOptions(requests=(256,)),
                        backends=("a2a_ll",), device="cuda", regime=EMULATED_REGIME,
                        cuda_graph=True)  # graphed decode

Frozen and keyword-only; `__post_init__` rejects bad values saying how to fix them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dbo.cli import check_graph_backends
from dbo.cli.bench.config import (
    BENCH_BACKENDS,
    GRAPH_BACKENDS,
    GRAPH_REFUSES_REFERENCE_EXPERTS,
    BenchConfig,
    SweepJob,
)
from moe.backends import DEFAULT_BACKEND, backends_with, check_one_process

HF_BACKENDS: tuple[str, ...] = BENCH_BACKENDS
"""Backends a converted model can run (those that need a capacity get one per
conversion: `conversions`)."""

PADDED_BACKENDS: tuple[str, ...] = backends_with(pads_to_capacity=True, among=HF_BACKENDS)
"""Capacity backends (the trait `pads_to_capacity`) whose work grows with the capacity, not with the routed rows (a2a_ll
sends every slot of it; deepep_ll's experts see E_loc * W * C rows): a capacity above a
point's tokens would time padding the point does not need."""

CONVERSIONS: tuple[str, ...] = ("auto", "experts")
"""`--conversion`: what `moe.hf.convert(conversion=)` takes."""

DEFAULT_HF_GPU_TOKENS: tuple[int, ...] = (4096,)
DEFAULT_HF_CPU_TOKENS: tuple[int, ...] = (16,)
DEFAULT_HF_LAYERS = 2
DEFAULT_HF_GPU_DECODE_REQUESTS: tuple[int, ...] = (64, 256, 512)
DEFAULT_HF_CPU_DECODE_REQUESTS: tuple[int, ...] = (2, 4)
DEFAULT_HF_GPU_CONTEXT = 1024
DEFAULT_HF_CPU_CONTEXT = 8


@dataclass(frozen=True, kw_only=True)
class HFDecodeOptions:
    """Decode steps (`--mode decode`): what `dbo.cli.bench.hf_decode` sweeps and gates."""

    requests: tuple[int, ...] = DEFAULT_HF_CPU_DECODE_REQUESTS
    """Requests per rank, one point each; a step adds one token to every request."""
    context: int = DEFAULT_HF_CPU_CONTEXT
    """Tokens already in each request's KV cache (prefilled once, untimed)."""
    gate_min_requests: int = 512
    """Gate: DBO off below this many requests (tokens) per rank (`--gate-min-tokens`)."""
    gate_trial_iters: int = 3
    """Gate: steps of each round's separate DBO trial; the worst trial decides."""

    def __post_init__(self) -> None:
        if not isinstance(self.requests, tuple) or not self.requests:
            raise ValueError(f"requests={self.requests!r}: give at least one count "
                             f"(--requests 64,256,512)")
        for r in self.requests:
            if not _is_int(r) or r < 2:
                raise ValueError(f"--requests {r!r}: DBO splits each decode step's requests "
                                 f"into two groups, each with its own KV cache: give counts "
                                 f">= 2 per rank")
        if len(set(self.requests)) != len(self.requests):
            raise ValueError(f"requests={self.requests!r} repeats a count: list each once")
        if not _is_int(self.context) or self.context < 1:
            raise ValueError(f"--context {self.context!r}: the tokens already cached per "
                             f"request must be an int >= 1 (--context 1024)")
        for name, low in (("gate_min_requests", 0), ("gate_trial_iters", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")


@dataclass(frozen=True, kw_only=True)
class HFBenchConfig(SweepJob):
    """What one `dbo bench --hf` run measures. From `dbo.cli.bench.config.SweepJob`:
    `seed`, of the weights (the same on every rank) and of the inputs (each rank its own);
    `num_experts` over all ranks (None: the architecture's); `experts`, the converted
    model's kernel; `rounds`, DBO off and on measured in alternation; `device`, "cpu"
    (gloo, float32) or "cuda" (NCCL, bfloat16); `out_dir`, the CSV and JSON;
    `cuda_graph`, on GPUs, prefill or decode: the converted model's steps, DBO off and
    on, captured in CUDA graphs and replayed (`dbo.graphs`); the unconverted model is
    timed eagerly and, where transformers' model captures, graphed too. A decode step
    captures as it is: it leaves its KV cache as it found it (`hf_decode.PrefixCache`)."""

    arch: str
    """A name of `moe.hf.named.named_architectures()`: real shapes ("qwen3-30b-a3b",
    "deepseek-v3") or a tiny model ("qwen3_moe", ...)."""
    layers: int = DEFAULT_HF_LAYERS
    """Decoder layers (every one an MoE layer)."""
    tokens: tuple[int, ...] = DEFAULT_HF_CPU_TOKENS
    """Prefill tokens per rank of one step, one point each: `requests` sequences of
    tokens / requests tokens."""
    requests: int = 4
    """Sequences per rank per step (DBO splits between them: at least 2)."""
    backends: tuple[str, ...] = (DEFAULT_BACKEND,)
    """Dispatch/combine backends of the converted model (any of HF_BACKENDS)."""
    conversion: str = "auto"
    """`moe.hf.convert(conversion=)`: "auto" (the fused path where the architecture has
    one, else the experts path) or "experts" (the experts path for every block)."""
    decode: Optional[HFDecodeOptions] = None
    """Decode steps over KV caches instead of prefill (`tokens`, `requests` and the
    prefill gate's fields below unused: decode's are `HFDecodeOptions`')."""
    gate_min_tokens: int = BenchConfig.gate_min_tokens
    """Prefill gate (`dbo.cli.bench.gating`): DBO off below this many tokens per rank."""
    min_gain: float = BenchConfig.min_gain
    """Prefill gate: DBO off where the probe's measured ceiling is below 1 + min_gain (GPU;
    without a probe the gate skips this rule)."""
    gate_trial_iters: int = BenchConfig.gate_trial_iters
    """Prefill gate: steps of each round's separate DBO and SBO trials; the worst trial
    of each decides."""

    def __post_init__(self) -> None:
        from moe.hf import is_named, unknown_name
        if self.decode is not None and not isinstance(self.decode, HFDecodeOptions):
            raise TypeError(f"decode={self.decode!r} must be an HFDecodeOptions or None")
        if not is_named(self.arch):
            raise ValueError(unknown_name(self.arch))
        if self.conversion not in CONVERSIONS:
            raise ValueError(f"--conversion {self.conversion!r}: use one of "
                             f"{', '.join(CONVERSIONS)}")
        for name, low in (("layers", 1), ("requests", 2), ("gate_min_tokens", 0),
                          ("gate_trial_iters", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if (isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float))
                or not 0.0 <= self.min_gain < 10.0):
            raise ValueError(f"--min-gain {self.min_gain!r} must be a fraction >= 0, e.g. "
                             f"0.03 for 3%")
        super().__post_init__()  # seed, num_experts, experts, iters, warmup, rounds, device, regime
        if not isinstance(self.tokens, tuple) or not self.tokens:
            raise ValueError(f"tokens={self.tokens!r}: give at least one count (--tokens 4096)")
        bad = [t for t in self.tokens
               if not _is_int(t) or t < self.requests or t % self.requests]
        if bad:
            raise ValueError(f"tokens per rank {bad[0]!r} is not a positive multiple of "
                             f"--requests {self.requests}: each rank runs {self.requests} "
                             f"sequences of equal length")
        if not isinstance(self.backends, tuple) or not self.backends:
            raise ValueError(f"backends={self.backends!r}: give one of {', '.join(HF_BACKENDS)}")
        unknown = [b for b in self.backends if b not in HF_BACKENDS]
        if unknown:
            raise ValueError(f"backend {unknown[0]!r} cannot run a converted model in dbo "
                             f"bench --hf: use one of {', '.join(HF_BACKENDS)}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends={self.backends!r} repeats a name: list each once")
        check_one_process(self.backends)  # symm_mem with deepep_ll aborts the process
        self._check_combine_forms()
        if not isinstance(self.cuda_graph, bool):
            raise TypeError(f"cuda_graph={self.cuda_graph!r} must be True or False")
        if self.cuda_graph:
            self._check_cuda_graph()

    def _check_combine_forms(self) -> None:
        """--combine-chunks / --combine-groups: ints >= 1, not both above 1, only for
        backends whose options take them (a2a_ll), chunks at most the smallest point's
        tokens or requests per rank (a2a_ll's capacity there)."""
        given = []
        for name in ("combine_chunks", "combine_groups"):
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if not _is_int(value) or value < 1:
                raise ValueError(f"{flag} {value!r} must be an int >= 1 (1: the combine "
                                 f"whole)")
            if value > 1:
                given.append((name, flag, value))
        if len(given) == 2:
            raise ValueError(f"--combine-chunks {self.combine_chunks} and --combine-groups "
                             f"{self.combine_groups}: an SBO step chunks its combine by rows "
                             f"or by expert group, not both; drop one of them")
        if not given:
            return
        name, flag, value = given[0]
        without = [b for b in self.backends if not takes_option(b, name)]
        if without:
            raise ValueError(f"{flag} {value}: backend {without[0]!r} has no such option "
                             f"(a2a_ll's SBO steps take it): use --backends a2a_ll, or drop "
                             f"{flag}")
        points, unit = ((self.tokens, "tokens") if self.decode is None
                        else (self.decode.requests, "requests"))
        if name == "combine_chunks" and value > min(points):
            raise ValueError(f"--combine-chunks {value} exceeds the smallest point's "
                             f"{min(points)} {unit} per rank (a2a_ll's capacity there; "
                             f"each chunk takes one slot row per rank): lower "
                             f"--combine-chunks")

    def _check_cuda_graph(self) -> None:
        if self.device != "cuda":
            raise ValueError("--cuda-graph needs CUDA GPUs: drop it on CPU")
        check_graph_backends(self.backends, GRAPH_BACKENDS, option="--backends ")
        if self.experts == "reference":
            raise ValueError(GRAPH_REFUSES_REFERENCE_EXPERTS)

    def model_config(self, world_size: int) -> Any:
        """The transformers config this run builds, checked for `world_size` ranks
        (ValueError with the fix: experts not divisible by the ranks, top-k too large)."""
        from moe.hf import expert_sizes, named_config
        config = named_config(self.arch, num_layers=self.layers, num_experts=self.num_experts)
        num_experts, top_k, _ = expert_sizes(config)
        if num_experts % world_size:
            raise ValueError(f"{num_experts} routed experts of {self.arch} do not split over "
                             f"{world_size} ranks: use a world size that divides "
                             f"{num_experts}, or --num-experts N with N a multiple of "
                             f"{world_size}")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts="
                             f"{num_experts}: pass a larger --num-experts")
        if self.combine_groups > num_experts // world_size:
            raise ValueError(f"--combine-groups {self.combine_groups} exceeds the "
                             f"{num_experts // world_size} experts each rank holds "
                             f"({num_experts} of {self.arch} over {world_size} ranks): a "
                             f"group holds at least one expert; lower --combine-groups")
        return config

    def summary(self) -> dict[str, Any]:
        """The settings that shape the numbers (for the JSON outputs)."""
        return {"arch": self.arch, "layers": self.layers, "num_experts": self.num_experts,
                "tokens": list(self.tokens), "requests": self.requests,
                "backends": list(self.backends), "experts": self.experts,
                "conversion": self.conversion, "iters": self.iters,
                "warmup": self.warmup, "rounds": self.rounds, "device": self.device,
                "seed": self.seed, "cuda_graph": self.cuda_graph,
                "combine_chunks": self.combine_chunks, "combine_groups": self.combine_groups,
                **({"gate_min_tokens": self.gate_min_tokens, "min_gain": self.min_gain,
                    "gate_trial_iters": self.gate_trial_iters} if self.decode is None else {}),
                "decode": None if self.decode is None else dataclasses.asdict(self.decode)}


@dataclass(frozen=True, kw_only=True)
class Conversion:
    """One `moe.hf.convert` of the bench's model and the points it serves."""

    max_tokens_per_rank: Optional[int]
    """The converted layers' capacity (None: a backend that needs none)."""
    max_tokens_per_ubatch: Optional[int] = None
    """a2a_ll: the capacity of one DBO ubatch (`A2ALLOptions.max_tokens_per_ubatch`), the
    largest ubatch of the point; None: the whole capacity."""
    points: tuple[int, ...]
    """Tokens (prefill) or requests (decode) per rank of the points timed on it."""


def conversions(backend: str, points: tuple[int, ...], *, world_size: int,
                ubatch_of: Optional[Callable[[int], int]] = None) -> list[Conversion]:
    """How the bench converts its model for `backend` over `points` (tokens per rank of a
    DBO-off step: prefill tokens, or decode requests). One conversion serves DBO off and
    on (a second would hold the model twice). A backend without a capacity: one
    conversion for every point. symm_mem (its capacity only sizes buffers: only routed
    rows travel): one, with the largest point as capacity. a2a_ll and deepep_ll (padded
    slots of the whole capacity travel): one per point, capacity = that point, so a point
    moves no padding another point needs; each rebuilds the model. a2a_ll's DBO ubatches
    get a capacity of their own, `ubatch_of(point)` (the point's largest ubatch), so that
    each sends half the slots, not the whole capacity again."""
    from moe.backends import backend_class
    if not backend_class(backend, world_size).needs_capacity:
        return [Conversion(max_tokens_per_rank=None, points=points)]
    if backend not in PADDED_BACKENDS:
        return [Conversion(max_tokens_per_rank=max(points), points=points)]
    takes_ubatch = backend_class(backend, world_size).takes_ubatch_capacity
    ubatch = ubatch_of if takes_ubatch and ubatch_of is not None else (lambda p: None)
    return [Conversion(max_tokens_per_rank=p, max_tokens_per_ubatch=ubatch(p), points=(p,))
            for p in points]


def takes_option(backend: str, name: str) -> bool:
    """Whether `backend`'s options (`PrepareFinalize.options_type`) have a field `name`
    ("combine_chunks", "combine_groups": a2a_ll's)."""
    from moe.backends import backend_class
    # HF_BACKENDS holds no "auto", the one name whose class depends on the world size.
    options_type = backend_class(backend, 2).options_type
    return name in {f.name for f in dataclasses.fields(options_type)}


def layer_options(cfg: HFBenchConfig, backend: str, conversion: Conversion, *,
                  world_size: int) -> Any:
    """The backend options every converted layer of `conversion` gets
    (`moe.hf.convert(backend_options=)`): a2a_ll's DBO-ubatch capacity
    (`Conversion.max_tokens_per_ubatch`) and SBO combine form (`cfg.combine_chunks`,
    `cfg.combine_groups`) where set, as `A2ALLOptions(...)`; None: the backend's
    defaults."""
    from moe.backends import options_with
    # HFBenchConfig refused the SBO combine forms for a backend without them.
    return options_with(backend, world_size,
                        max_tokens_per_ubatch=conversion.max_tokens_per_ubatch,
                        combine_chunks=cfg.combine_chunks, combine_groups=cfg.combine_groups)


def capacity_note(backends: tuple[str, ...], *, world_size: int) -> Optional[str]:
    """What the capacity means for the timings of `backends` (None: none takes one)."""
    from moe.backends import backend_class
    taking = [b for b in backends if backend_class(b, world_size).needs_capacity]
    if not taking:
        return None
    # By what the capacity does (`conversions`), in this order: a capacity per ubatch
    # too, padded slots of the whole capacity, buffers sized by it.
    kinds: dict[str, list[str]] = {"ubatch": [], "padded": [], "sized": []}
    for b in taking:
        cls = backend_class(b, world_size)
        kind = ("ubatch" if cls.takes_ubatch_capacity else
                "padded" if cls.pads_to_capacity else "sized")
        kinds[kind].append(b)
    notes = [f"{b}: max_tokens_per_rank = the point's tokens per rank, "
             f"max_tokens_per_ubatch = its largest DBO ubatch (each ubatch sends "
             f"slots of its own capacity)" for b in kinds["ubatch"]]
    notes += [f"{b}: max_tokens_per_rank = the point's tokens per rank, one "
              f"converted model for DBO off and on, so each DBO ubatch pads to the "
              f"full capacity (2x the padding of DBO off)" for b in kinds["padded"]]
    notes += [f"{b}: max_tokens_per_rank = the largest point (it sizes the "
              f"buffers); only routed rows travel" for b in kinds["sized"]]
    return "; ".join(notes)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
