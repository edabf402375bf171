"""The soak run's configuration and limits (see dbo.cli.soak for what the run does)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from dbo.cli import check_graph_backends, check_int_option
from dbo.cli.job_base import ToolJob
from dbo.cli.soak.padding import MIN_GRAPH_SIZE, default_graph_sizes
from moe.backends import DEFAULT_BACKEND, UNTESTED_BACKENDS, backend_class, backends_with
from moe.experts import EXPERTS

# The soak moves tokens between ranks: every registered backend but the single-rank one.
BACKENDS = tuple(name for name in backends_with(single_rank=False)
                 if name not in UNTESTED_BACKENDS)
EXPERT_KERNELS = ("auto", *EXPERTS)
# Backends whose soak steps a CUDA graph can capture, with the capacity the soak always
# sets (the trait `graph_safe_with_capacity`).
GRAPH_BACKENDS = backends_with(graph_safe_with_capacity=True, among=BACKENDS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

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
class SoakConfig(ToolJob):
    """What `python -m dbo.cli.soak` runs (`seed`: `dbo.cli.job_base.ToolJob`; weights,
    token counts and inputs derive from it)."""

    steps: int = 2000
    """Steps in all, warmup included."""
    backend: str = DEFAULT_BACKEND
    """MoE dispatch/combine backend (`BACKENDS`; with `cuda_graph`, `GRAPH_BACKENDS`)."""
    max_tokens: int = 64
    """Most tokens per rank and step (also MoEConfig.max_tokens_per_rank)."""
    layers: int = 2
    """MoE layers in the stack (each followed by a Linear + GELU)."""
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
    """float32: largest |DBO - reference| at any element of any step (raise it for large
    --hidden). bfloat16 steps are held to `dbo.cli.soak.reference.BF16_REL_TOL` instead."""
    dtype: str = "float32"
    """Model dtype: "float32" (checked against the model run without DBO) or "bfloat16"
    (checked layer by layer against a float32 dense reference, `dbo.cli.soak.reference`)."""
    joined_experts: bool = False
    """The DBO steps join their experts (`DBOConfig.joined_experts`): each MoE layer's
    experts run once over both ubatches' rows."""
    cuda_graph: bool = False
    """Run the DBO steps as CUDA graph replays (`dbo.graphs.GraphedRunner`; GPUs only),
    each step padded up to the next of `graph_sizes` (`dbo.cli.soak.padding`)."""
    graph_sizes: Optional[tuple[int, ...]] = None
    """Capture sizes, increasing, each in [2, max_tokens], the last = max_tokens; None:
    powers of two below max_tokens, then max_tokens."""
    pad_steps: bool = False
    """Pad every step as `cuda_graph` does, but run it eagerly: the padding path on any
    device (implied by `cuda_graph`; tests use it on CPU)."""
    bound_kib: int = DEFAULT_BOUND_KIB
    """Largest allowed growth (KiB) of tracemalloc and of tensor storage after warmup, and
    on CPU of the RSS over the run's later half."""
    trace_window: int = 0
    """tracemalloc only in the last N steps before each memory sample; 0: every step."""
    bad_every: int = 0
    """Every N-th step one rank (in turn) gets rows one value too wide, which the model's
    `dbo_check_inputs` rejects: every rank stops at the vote, and the next step reuses the
    group (`dbo.cli.soak.workload.bad_input_rank`). 0: never."""

    def __post_init__(self) -> None:
        for name in ("steps", "max_tokens", "layers", "report_every", "hidden",
                     "intermediate", "num_experts", "top_k"):
            check_int_option(name, getattr(self, name), low=1)
        for name in ("warmup", "bound_kib"):
            check_int_option(name, getattr(self, name), low=0)
        super().__post_init__()  # --seed
        check_int_option("trace_window", self.trace_window, low=0)
        check_int_option("bad_every", self.bad_every, low=0)
        if self.bad_every == 1:
            raise ValueError("--bad-every=1 would reject every step's input, leaving none "
                             "to check: use --bad-every >= 2, or 0 for none")
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
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.dtype == "bfloat16" and self.atol != SoakConfig.atol:
            raise ValueError(f"--atol={self.atol} with --dtype bfloat16: --atol bounds float32 "
                             f"steps only; bfloat16 steps are held to a bound derived from "
                             f"bfloat16 rounding (dbo.cli.soak.reference): drop --atol")
        self._check_padding()
        self._check_backend()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def padded(self) -> bool:
        """Whether each step is padded up to a capture size (`dbo.cli.soak.padding`)."""
        return self.cuda_graph or self.pad_steps

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The sizes steps are padded to (`graph_sizes`, or its default)."""
        if self.graph_sizes is not None:
            return self.graph_sizes
        return default_graph_sizes(self.max_tokens)

    def _check_padding(self) -> None:
        if self.graph_sizes is not None and not self.padded:
            raise ValueError("--graph-sizes without --cuda-graph: the sizes are what steps "
                             "are padded to for their graphs; add --cuda-graph or drop "
                             "--graph-sizes")
        if not self.padded:
            return
        if self.max_tokens < MIN_GRAPH_SIZE:
            raise ValueError(f"--max-tokens={self.max_tokens} with --cuda-graph: steps are "
                             f"padded to at least {MIN_GRAPH_SIZE} rows (a 1-row step cannot "
                             f"split); use --max-tokens >= {MIN_GRAPH_SIZE}")
        sizes = self.graph_sizes
        if sizes is not None:
            if (not isinstance(sizes, tuple) or not sizes
                    or any(isinstance(n, bool) or not isinstance(n, int) for n in sizes)):
                raise ValueError(f"--graph-sizes={sizes!r}: give increasing integers, e.g. "
                                 f"--graph-sizes 2,8,32,{self.max_tokens}")
            text = ",".join(map(str, sizes))
            if list(sizes) != sorted(set(sizes)) or sizes[0] < MIN_GRAPH_SIZE:
                raise ValueError(f"--graph-sizes={text}: must be strictly increasing and at "
                                 f"least {MIN_GRAPH_SIZE} (a 1-row step cannot split)")
            if sizes[-1] != self.max_tokens:
                raise ValueError(f"--graph-sizes={text}: the largest must be --max-tokens="
                                 f"{self.max_tokens}, so that every step fits one: end the "
                                 f"list with {self.max_tokens}")
        if self.warmup < len(self.capture_sizes):
            raise ValueError(f"--warmup={self.warmup} is shorter than the capture sweep "
                             f"({len(self.capture_sizes)} steps, one per graph size): the "
                             f"memory baseline must follow every capture; use --warmup >= "
                             f"{len(self.capture_sizes)} or fewer --graph-sizes")

    def _check_backend(self) -> None:
        if self.cuda_graph:
            check_graph_backends((self.backend,), GRAPH_BACKENDS, option="--backend=")
        if self.cuda_graph and self.experts == "reference":
            raise ValueError("--cuda-graph with --experts=reference: the reference experts "
                             "select each expert's rows on the host; use triton or auto")
        # What the backend declares of the rows it moves (`PrepareFinalize.row_dtypes`,
        # `hidden_sizes`): DeepEP's kernels move bfloat16 rows of a few hidden sizes.
        cls = backend_class(self.backend, 2)
        if cls.row_dtypes is not None and DTYPES[self.dtype] not in cls.row_dtypes:
            names = [name for name, dtype in DTYPES.items() if dtype in cls.row_dtypes]
            raise ValueError(f"--backend={self.backend} with --dtype {self.dtype}: "
                             f"{cls.library}'s kernels move {' or '.join(names)} rows only; add "
                             f"--dtype {names[0]}")
        if cls.hidden_sizes is not None and self.hidden not in cls.hidden_sizes:
            raise ValueError(f"--backend={self.backend} with --hidden={self.hidden}: "
                             f"{cls.kernels} are compiled for hidden sizes "
                             f"{', '.join(map(str, cls.hidden_sizes))}; use one of them")



def memory_need(job: SoakConfig, world_size: int) -> tuple[int, int]:
    """Lower bounds of what one rank of the soak holds, in bytes: (its weights, what one
    token of a step adds). Weights per layer: its share of the routed experts, the shared
    expert ([3 I, H] each), the router [E, H] and the dense Linear [H, H]. Per token: the
    outputs kept per layer (its input [H] and router logits [E]), a few hidden rows and
    its top-k expert rows ([H] in, [2 I] between the expert GEMMs)."""
    H, I, E, K, L = job.hidden, job.intermediate, job.num_experts, job.top_k, job.layers
    size = job.torch_dtype.itemsize
    weights = L * ((E // world_size + 1) * 3 * H * I + E * H + H * H)
    per_token = L * (H + E) + 4 * H + K * (H + 2 * I)
    return weights * size, per_token * size
