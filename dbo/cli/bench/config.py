"""Configuration of a `dbo bench` run (`BenchConfig`) and the run's environment label.

    cfg = BenchConfig(mode="layer", preset="tiny", tokens=(16, 64), backends=("a2a", "naive"),
                      device="cpu", regime=CPU_REGIME)

One frozen, keyword-only dataclass; every field has a one-line doc and `__post_init__`
rejects bad values with a message that says how to fix them. Only the command line
(`dbo.cli.bench.launch`) reads the environment; it passes the regime label in here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dbo import DBOConfig
from dbo.cli.job_base import ModelJob
from moe.backends import COMPARED_BACKENDS, UNTESTED_BACKENDS, backends_with, check_one_process
from moe.experts import EXPERTS

MODES: tuple[str, ...] = ("layer", "model", "decode")
"""`layer`: a stack of MoE layers with attention-sized GEMMs between them; `model`: the
reference MoE transformer (`moe.models.transformer.MoETransformer`) of a preset;
`decode`: decode steps, each request's new token attending over its KV cache, then the
MoE layer (`dbo.cli.bench.decode_stack`); its swept axis is requests per rank."""

BENCH_BACKENDS: tuple[str, ...] = tuple(sorted(
    name for name in backends_with(single_rank=False) if name not in UNTESTED_BACKENDS))
"""Dispatch/combine backends the sweep can compare: every registered one that moves tokens
between ranks (`moe.backends`, not `single_rank`; all need EP size >= 2), except those never run against
their library (`moe.backends.UNTESTED_BACKENDS`)."""

GRAPH_BACKENDS: tuple[str, ...] = backends_with(graph_safe=True, among=BENCH_BACKENDS)
"""Backends whose steps `--cuda-graph` can capture: nothing read on the host (the trait
`graph_safe`; a2a reads its counts; the bench runs naive without a fixed capacity, so it
reads their maximum; deepep_ht reads its counts in the form the bench runs)."""

OPT_IN_BACKENDS: tuple[str, ...] = backends_with(opt_in=True, among=BENCH_BACKENDS)
"""Backends run only when named (`--backends`; the trait `opt_in`): they need more than torch and NCCL
(symm_mem: NVSHMEM; the DeepEP ones: DeepEP installed, GPUs of one node and bfloat16,
deepep_ll a hidden size its kernels are compiled for), so a sweep without --backends runs
wherever torch does."""

DEFAULT_BACKENDS: tuple[str, ...] = tuple(
    b for b in BENCH_BACKENDS if b not in OPT_IN_BACKENDS)
"""What the sweep compares when `--backends` is not given."""

GRAPH_REFUSES_REFERENCE_EXPERTS = ("--cuda-graph cannot capture the reference experts (they "
                                   "select rows on the host): use --experts triton or auto")
"""Why `--cuda-graph` refuses `--experts reference` (every bench mode says it alike)."""

DEFAULT_GRAPH_BACKENDS: tuple[str, ...] = tuple(
    b for b in GRAPH_BACKENDS if b not in OPT_IN_BACKENDS)
"""What `--cuda-graph` compares when `--backends` is not given."""

EXPERT_KERNELS: tuple[str, ...] = ("auto", *EXPERTS)
"""Expert kernel names (`moe.experts`); "auto" picks the fastest that runs."""

DEVICES: tuple[str, ...] = ("cpu", "cuda")

OVERLAPS: tuple[str, ...] = ("dbo", "sbo", "joined")
"""The overlaps each point times beside no overlap (`--overlaps`; all of them by default):
"dbo", two ubatches (`DBOConfig(overlap="dbo")`); "sbo", single-batch overlap
(`DBOConfig(overlap="sbo")`: one ubatch, shared experts under the dispatch, own rows under
the combine); "joined", DBO with joined experts (`DBOConfig(joined_experts=True)`: two
ubatches, each MoE layer's experts run once over both ubatches' rows)."""

NVLINK_REGIME = "NVLink"
CPU_REGIME = "CPU gloo"
EMULATED_REGIME = "scale-out emulated (NCCL_P2P_DISABLE=1)"

DEFAULT_GPU_PRESET = "deepseek-v3-like"
DEFAULT_CPU_PRESET = "tiny"
DEFAULT_GPU_TOKENS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_CPU_TOKENS: tuple[int, ...] = (16, 64)
DEFAULT_GPU_REQUESTS: tuple[int, ...] = (16, 64, 256, 1024)
DEFAULT_CPU_REQUESTS: tuple[int, ...] = (4, 8)
DEFAULT_MAX_EXPERTS_PER_RANK = 32
"""Without --num-experts / --experts-per-rank the preset's expert count is capped at this
many per rank, so that deepseek-v3-like layer weights fit (~2.8 GB of experts per layer)."""


def regime_label(device: str, *, p2p_disabled: bool) -> str:
    """The label every table, plot and JSON of a run carries.

    `p2p_disabled`: NCCL_P2P_DISABLE=1 is set, so NCCL stages its traffic through host
    memory (about one 400 Gb/s NIC per GPU): scale-out emulated on one host. On CPU the
    collectives are gloo's whatever NCCL's settings are.
    """
    if device == "cpu":
        return CPU_REGIME
    return EMULATED_REGIME if p2p_disabled else NVLINK_REGIME


def check_context_option(mode: str, context: Optional[int]) -> None:
    """--context sizes the KV caches of decode steps: ValueError (with the fix) where it
    is given to another mode, which would ignore it."""
    if context is not None and mode != "decode":
        raise ValueError(f"--context {context} applies to decode steps: add --mode decode, or "
                         f"drop --context")


def requests_count(groups: Optional[list[list[int]]], *, where: str, default: int) -> int:
    """The one `--requests` count (parsed as lists, `groups`) of a mode that takes one;
    `default` without the option. ValueError for a list: only --mode decode sweeps it."""
    requests = [r for group in groups for r in group] if groups else []
    if len(requests) > 1:
        raise ValueError(f"--requests {','.join(map(str, requests))}: {where} takes one "
                         f"count (a list is --mode decode's swept axis)")
    return requests[0] if requests else default


def known_presets() -> list[str]:
    from moe.models import PRESETS
    return sorted(PRESETS)


@dataclass(frozen=True, kw_only=True)
class SweepJob(ModelJob):
    """What the sweeps of `dbo bench` (`BenchConfig`) and `dbo bench --hf`
    (`HFBenchConfig`) share, besides `seed` and `num_experts` (`dbo.cli.job_base.ModelJob`):
    the expert kernel, how each point is timed, where it runs, the label and folder of its
    outputs."""

    experts: str = "auto"
    """Expert kernel name (see moe.experts): "auto", "reference", "grouped", "triton"."""
    iters: int = 20
    """Timed steps per measurement; the median is reported."""
    warmup: int = 5
    """Untimed steps before each measurement (allocations, autotuning, NCCL setup)."""
    rounds: int = 3
    """Each point's modes are measured this many times in alternation, so slow drift of
    clocks or host load hits them all alike; times are medians over the rounds."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL, one GPU per rank)."""
    regime: str = CPU_REGIME
    """Environment label carried by every output (see regime_label)."""
    out_dir: str = "dbo_out/bench"
    """Where the outputs go (rank 0 writes them)."""
    progress: bool = True
    """Show progress on stderr (rank 0)."""
    cuda_graph: bool = False
    """Time the steps as CUDA graph replays (`dbo.graphs`; each sweep says which)."""
    combine_chunks: int = 1
    """SBO steps of `a2a_ll`: the combine in this many chunks, each sent under the next
    chunk's experts (`A2ALLOptions.combine_chunks`); at most the smallest point's tokens
    (requests in decode mode) per rank, a2a_ll's capacity there. 1: the combine whole."""
    combine_groups: int = 1
    """SBO steps of `a2a_ll`: each rank's experts in this many groups, each over every
    received row, each group's combine sent under the next group's experts
    (`A2ALLOptions.combine_groups`); at most the experts each rank holds; exclusive with
    `combine_chunks` > 1. 1: the experts whole."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("iters", 1), ("warmup", 0), ("rounds", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: use one of {', '.join(DEVICES)}")
        if self.regime not in (NVLINK_REGIME, CPU_REGIME, EMULATED_REGIME):
            raise ValueError(f"regime={self.regime!r}: build it with regime_label()")
        if self.experts not in EXPERT_KERNELS:
            raise ValueError(f"unknown experts kernel {self.experts!r}: use one of "
                             f"{', '.join(EXPERT_KERNELS)}")

    def sbo_form(self) -> str:
        """How an SBO step overlaps its combine, in words (the table)."""
        if self.combine_groups > 1:
            return (f"a2a_ll: the experts in {self.combine_groups} expert groups over every "
                    f"row, each group's combine under the next group's experts")
        if self.combine_chunks > 1:
            return (f"a2a_ll: the combine in {self.combine_chunks} row chunks, each under "
                    f"the next chunk's experts, own rows under the last")
        return "own rows under the combine"

    @property
    def functional(self) -> bool:
        """A CPU gloo run: gloo runs each collective on the calling thread, so nothing can
        overlap, and the times only show that the code runs (no speedup is reported)."""
        return self.regime == CPU_REGIME


@dataclass(frozen=True, kw_only=True)
class BenchConfig(SweepJob):
    """What one `dbo bench` run sweeps and how it times, gates and writes the results.
    From `SweepJob`: `num_experts` over all ranks (None: experts_per_rank, or the
    preset's, at most 32 per rank); `rounds`, each point measured in alternation as DBO
    off, probe, SBO, DBO on, joined, then again, eta's spread over them reported beside it;
    `out_dir`, the CSV, JSON and PNG; `cuda_graph`, every step timed as a replay: DBO on
    through a `GraphedRunner` (vote, then replay), DBO off and the probe's timings
    captured whole."""

    mode: str = "layer"
    """Workload: "layer" (MoE layer stack + attention-sized GEMMs) or "model" (MoETransformer)."""
    preset: str = DEFAULT_CPU_PRESET
    """Shapes from `moe.models.presets` ("tiny", "deepseek-v3-like", "qwen3-moe-like", "mixtral-like")."""
    tokens: tuple[int, ...] = DEFAULT_CPU_TOKENS
    """Tokens per rank of one step, one sweep point each (decode mode: requests per rank,
    one new token each; `--requests`)."""
    backends: tuple[str, ...] = COMPARED_BACKENDS
    """Dispatch/combine backends to compare (any of BENCH_BACKENDS; naive_mono moves the
    same data as naive plus the router logits, so it is asked for by name)."""
    layers: Optional[int] = None
    """Layer mode: MoE layers (None: 4); model mode: decoder layers (None: the preset's)."""
    experts_per_rank: Optional[int] = None
    """Routed experts per rank (num_experts = this * world size); exclusive with num_experts."""
    attn_context: int = 2048
    """Layer mode: context tokens per token in the attention stand-in (4*C*H FLOPs per token)."""
    requests: int = 4
    """Model mode: requests per rank per step (random lengths, moe.models.transformer.make_batch)."""
    context: int = 4096
    """Decode mode: tokens in each request's KV cache, attended to by its new token."""
    min_gain: float = 0.03
    """Gate: keep DBO off where the measured ceiling T_serial / T_both is below 1 + min_gain."""
    gate_min_tokens: int = 512
    """Gate: keep DBO off below this many tokens per rank."""
    plot: bool = True
    """Write the PNG (needs matplotlib)."""
    gate_trial_iters: int = 3
    """Steps of each of the gate's separate DBO trials, one per round (see
    dbo.cli.bench.gating)."""
    trace: bool = False
    """Also capture one DBO-off and one DBO-on step per point under torch.profiler into
    <out>/traces/ (rank 0's Chrome trace, analysis JSON and timeline PNG)."""
    split_last_combine: bool = True
    """The last MoE layer's last ubatch sends the other ranks' rows before computing its
    own (`MoEConfig.split_last_combine`); False runs that layer like the others."""
    gemm_sm_carveout: int = DBOConfig().gemm_sm_carveout or 0
    """SMs that torch's GEMMs leave to the comm kernels in DBO steps and in the probe's
    `both` (`DBOConfig.gemm_sm_carveout`); 0: every SM."""
    overlaps: tuple[str, ...] = OVERLAPS
    """The overlaps timed at every point beside no overlap (any of OVERLAPS, each once);
    the gate chooses among no overlap and these."""
    calibration: Optional[str] = None
    """A calibration file (`dbo.calibration`): its machine figures feed each point's
    prediction, and a point its measured points cover is gated on the prediction, with no
    trial steps; None: the illustrative defaults, trials everywhere."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: use one of {', '.join(MODES)} "
                             f"(--mode layer | --mode model)")
        presets = known_presets()
        if self.preset not in presets:
            raise ValueError(f"unknown preset {self.preset!r} for --mode {self.mode}: use one "
                             f"of {', '.join(presets)} (--preset NAME)")
        if self.mode == "decode":
            self._check_decode()
        self._check_int_tuple("tokens", "tokens per rank, e.g. --tokens 256,1024")
        if not isinstance(self.backends, tuple) or not self.backends:
            raise ValueError(f"backends={self.backends!r}: give at least one of "
                             f"{', '.join(BENCH_BACKENDS)} (--backends a2a,naive)")
        unknown = [b for b in self.backends if b not in BENCH_BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend {unknown[0]!r}: use one of "
                             f"{', '.join(BENCH_BACKENDS)} (--backends a2a,a2a_ll,naive)")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends={self.backends!r} repeats a name: list each once")
        check_one_process(self.backends)  # symm_mem with deepep_ll aborts the process
        self._check_overlaps()
        super().__post_init__()  # seed, num_experts, experts, iters, warmup, rounds, device, regime
        for name in ("layers", "experts_per_rank"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int (or unset)")
        if self.num_experts is not None and self.experts_per_rank is not None:
            raise ValueError(f"num_experts={self.num_experts} and experts_per_rank="
                             f"{self.experts_per_rank} are both set: give only one")
        for name, low in (("attn_context", 0), ("requests", 1), ("gate_min_tokens", 0),
                          ("gate_trial_iters", 1), ("gemm_sm_carveout", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if not _is_int(self.combine_chunks) or not 1 <= self.combine_chunks <= min(self.tokens):
            raise ValueError(f"combine_chunks={self.combine_chunks!r} must be an int from 1 to "
                             f"the smallest point's {min(self.tokens)} tokens per rank (each "
                             f"chunk takes one slot row per rank): lower --combine-chunks")
        self._check_combine_groups()
        if self.mode == "model" and self.requests > min(self.tokens):
            raise ValueError(f"requests={self.requests} per rank exceeds the smallest token "
                             f"count {min(self.tokens)}: every request needs a token; lower "
                             f"--requests or raise --tokens")
        if (isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float))
                or not 0.0 <= self.min_gain < 10.0):
            raise ValueError(f"min_gain={self.min_gain!r} must be a fraction >= 0, e.g. 0.03 "
                             f"for 3%")
        if self.device == "cuda" and self.regime == CPU_REGIME:
            # It would be reported as a functional run: every speedup null.
            raise ValueError(f"regime={self.regime!r} does not fit device='cuda': pass "
                             f"regime=regime_label('cuda', p2p_disabled=...)")
        if self.cuda_graph:
            self._check_cuda_graph()

    def _check_combine_groups(self) -> None:
        groups = self.combine_groups
        if not _is_int(groups) or groups < 1:
            raise ValueError(f"combine_groups={groups!r} must be an int >= 1 (1: the experts "
                             f"whole; --combine-groups N)")
        if groups > 1 and self.combine_chunks > 1:
            raise ValueError(f"combine_chunks={self.combine_chunks} and combine_groups="
                             f"{groups}: an SBO step chunks its combine by rows or by expert "
                             f"group, not both; drop --combine-chunks or --combine-groups")
        if self.experts_per_rank is not None:
            self.check_combine_groups_fit(self.experts_per_rank)

    def check_combine_groups_fit(self, experts_per_rank: int) -> None:
        """ValueError where `combine_groups` exceeds the experts each rank holds (known
        once the world size is: `resolve_num_experts`)."""
        if self.combine_groups > experts_per_rank:
            raise ValueError(f"combine_groups={self.combine_groups} exceeds the "
                             f"{experts_per_rank} experts each rank holds: a group holds at "
                             f"least one expert; lower --combine-groups")

    def _check_cuda_graph(self) -> None:
        if self.device != "cuda":
            raise ValueError("--cuda-graph captures CUDA graphs: it needs --device cuda")
        unsafe = [b for b in self.backends if b not in GRAPH_BACKENDS]
        if unsafe:
            raise ValueError(f"--cuda-graph cannot capture backend {unsafe[0]!r}: it reads "
                             f"device values on the host; use --backends "
                             f"{','.join(GRAPH_BACKENDS)}")
        if self.experts == "reference":
            raise ValueError(GRAPH_REFUSES_REFERENCE_EXPERTS)
        if self.trace:
            raise ValueError("--trace labels phases from the host, which a graph replay "
                             "does not run: trace without --cuda-graph")

    def _check_overlaps(self) -> None:
        if not isinstance(self.overlaps, tuple) or not self.overlaps:
            raise ValueError(f"overlaps={self.overlaps!r}: give at least one of "
                             f"{', '.join(OVERLAPS)} (--overlaps dbo,sbo,joined)")
        unknown = [o for o in self.overlaps if o not in OVERLAPS]
        if unknown:
            raise ValueError(f"unknown overlap {unknown[0]!r}: use any of "
                             f"{', '.join(OVERLAPS)} (--overlaps dbo,sbo,joined; no overlap "
                             f"is always timed)")
        if len(set(self.overlaps)) != len(self.overlaps):
            raise ValueError(f"overlaps={self.overlaps!r} repeats a name: list each once")

    def _check_decode(self) -> None:
        if not _is_int(self.context) or self.context < 1:
            raise ValueError(f"context={self.context!r} must be an int >= 1 (KV-cache tokens "
                             f"per request, --context 4096)")
        if isinstance(self.tokens, tuple):
            small = [r for r in self.tokens if _is_int(r) and r < 2]
            if small:
                raise ValueError(f"--mode decode with {small[0]} request(s) per rank: DBO "
                                 f"splits a decode step's requests between two ubatches, "
                                 f"each with its own requests' KV caches, so each needs "
                                 f"one; use --requests values >= 2")

    def _check_int_tuple(self, name: str, hint: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, tuple) or not value:
            raise ValueError(f"{name}={value!r}: give at least one value ({hint})")
        bad = [v for v in value if not _is_int(v) or v <= 0]
        if bad:
            raise ValueError(f"{name} must be positive ints, got {bad[0]!r} ({hint})")

    def resolve_num_experts(self, world_size: int, preset_num_experts: int) -> int:
        """Routed experts over all ranks for a group of `world_size` ranks."""
        if self.experts_per_rank is not None:
            return self.experts_per_rank * world_size
        if self.num_experts is not None:
            num = self.num_experts
        else:
            num = min(preset_num_experts, DEFAULT_MAX_EXPERTS_PER_RANK * world_size)
        if num % world_size != 0:
            raise ValueError(f"{num} routed experts do not split over {world_size} ranks: "
                             f"use --num-experts with a multiple of {world_size}, or "
                             f"--experts-per-rank")
        return num

    def summary(self) -> dict[str, Any]:
        """The settings that shape the numbers (for the JSON outputs)."""
        return {"mode": self.mode, "preset": self.preset, "tokens": list(self.tokens),
                "backends": list(self.backends), "layers": self.layers,
                "num_experts": self.num_experts, "experts_per_rank": self.experts_per_rank,
                "attn_context": self.attn_context, "requests": self.requests,
                "context": self.context,
                "experts": self.experts, "iters": self.iters, "warmup": self.warmup,
                "rounds": self.rounds, "split_last_combine": self.split_last_combine,
                "combine_chunks": self.combine_chunks, "combine_groups": self.combine_groups,
                "gemm_sm_carveout": self.gemm_sm_carveout, "cuda_graph": self.cuda_graph,
                "overlaps": list(self.overlaps),
                "min_gain": self.min_gain, "gate_min_tokens": self.gate_min_tokens,
                "device": self.device, "seed": self.seed, "calibration": self.calibration}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
