"""The overlap ceiling of one step, measured: compute alone, comm alone, both at once.

    ceiling = probe_ceiling(workload, device=device, group=group, warmup=5, iters=20)
    ceiling.serial_ms / ceiling.both.max_ms      # the most any overlap can gain

All three are built from the DBO-off step of the same workload:

- **comm alone**: the step is run once with the torch.distributed collectives recorded
  (name, tensor shapes and dtypes, split sizes, group), in order, segmented by MoE layer
  (a forward pre-hook on each `MoELayer` opens a segment). The replay issues the same
  collectives on buffers of the same sizes: the dispatch and combine traffic of the
  step, its count exchanges included, without the host syncs or any compute.
- **compute alone**: the same step with every collective replaced by a copy of the
  output it produced in the recorded step (`replayed_results`), with the expert kernels
  a DBO step uses (`moe.modular_kernel.sharing_sms`): no communication, but
  exactly the data the real step received, so packing, the host syncs, the experts over
  the rows this rank really gets (masked slots included), attention and shared experts
  all cost what they cost in the real step. (An earlier version routed tokens locally
  instead; that skipped the dispatch's own work and under-estimated compute by ~25% at
  DeepSeek-V3 shapes, making the ceiling unreachable.)
- **both**: compute alone on the compute stream while the replay runs on a second CUDA
  stream, layer by layer (MoE layer i's pre-hook issues layer i's collectives), with no
  dependencies between the two: the best any schedule of this step could do, including
  the SM and memory-bandwidth contention of running comm kernels beside the GEMMs. Its
  GEMMs leave the SMs free that a DBO step's leave (`streams.gemm_carveout`).

T_serial = T_compute + T_comm; the ceiling is T_serial / T_both.

`probe_split_compute` measures a fourth time, from the DBO-on step: **split compute**,
that step with every collective replaced by its recorded result, as compute alone above
but split into the ubatches the runner makes. T_DBO - T_split is what communication still
costs the DBO step (exposed, or slowing the kernels beside it); T_split - T_compute is the
compute the split itself adds (half-size GEMMs, each expert's weights read once per
ubatch, twice the launches). GPU only: on CPU gloo
runs each collective synchronously on the calling thread and there are no streams to
overlap, so the sweep skips the probe there (and says so).

Recording patches the torch.distributed functions the backends call (module attribute
lookup at call time) for the duration of one step; nothing else changes.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dbo.cli.bench.timing import SpanFn, Timing, median_of_rounds, no_spans, time_steps
from dbo.cli.bench.workload import Workload
import streams
from moe import MoELayer, sharing_sms
from streams import new_comm_stream

# The collectives the dispatch/combine backends (and the vote) issue.
RECORDED_COLLECTIVES: tuple[str, ...] = (
    "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


#: The argument each recorded collective writes its result into.
OUTPUT_ARG: dict[str, str] = {"all_to_all_single": "output",
                              "all_gather_into_tensor": "output_tensor",
                              "reduce_scatter_tensor": "output", "all_reduce": "tensor"}


@dataclass(frozen=True)
class RecordedCollective:
    """One collective call: its tensor arguments' specs, its other arguments, and a copy
    of the result it wrote."""

    name: str
    fn: Callable[..., Any]
    tensors: dict[str, TensorSpec]
    others: dict[str, Any]
    result: Optional[Tensor] = None


@dataclass
class CommRecording:
    """The step's collectives; segment 0 precedes the first MoE layer, segment i+1 is
    MoE layer i's (plus whatever follows it before the next MoE layer)."""

    segments: list[list[RecordedCollective]] = field(default_factory=lambda: [[]])

    @property
    def num_collectives(self) -> int:
        return sum(len(s) for s in self.segments)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers in registration (= execution) order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@contextlib.contextmanager
def record_collectives(model: nn.Module) -> Iterator[CommRecording]:
    """Record every collective in RECORDED_COLLECTIVES issued inside the block."""
    recording = CommRecording()
    originals = {name: getattr(dist, name) for name in RECORDED_COLLECTIVES}

    def recorder(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            tensors, others = {}, {}
            for key, value in bound.arguments.items():
                if isinstance(value, Tensor):
                    tensors[key] = TensorSpec(tuple(value.shape), value.dtype, value.device)
                elif isinstance(value, (list, tuple)):
                    others[key] = list(value)
                else:
                    others[key] = value
            out = fn(*args, **kwargs)
            result = bound.arguments[OUTPUT_ARG[name]].clone()
            recording.segments[-1].append(RecordedCollective(name, fn, tensors, others, result))
            return out
        return call

    handles = [layer.register_forward_pre_hook(lambda *_: recording.segments.append([]))
               for layer in moe_layers(model)]
    try:
        for name, fn in originals.items():
            setattr(dist, name, recorder(name, fn))
        yield recording
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for h in handles:
            h.remove()


class CommReplay:
    """Re-issues a recording's collectives on zeroed buffers of the recorded sizes.

    The collectives of a replay run one after another on one stream, so all calls share
    one buffer per argument name (sized for the largest call): no per-layer copies.
    """

    def __init__(self, recording: CommRecording) -> None:
        sizes: dict[tuple[str, torch.device], int] = {}
        for segment in recording.segments:
            for op in segment:
                for key, spec in op.tensors.items():
                    k = (key, spec.device)
                    sizes[k] = max(sizes.get(k, 0), spec.nbytes)
        pools = {k: torch.zeros(max(n, 1), dtype=torch.uint8, device=k[1])
                 for k, n in sizes.items()}
        self.segments: list[list[Callable[[], Any]]] = [
            [self._bind(op, pools) for op in segment] for segment in recording.segments]

    @staticmethod
    def _bind(op: RecordedCollective, pools: dict) -> Callable[[], Any]:
        kwargs = dict(op.others)
        for key, spec in op.tensors.items():
            kwargs[key] = pools[(key, spec.device)][:spec.nbytes].view(spec.dtype).view(spec.shape)
        kwargs["async_op"] = False
        fn = op.fn
        return lambda: fn(**kwargs)

    def run_segment(self, index: int) -> None:
        if index < len(self.segments):
            for call in self.segments[index]:
                call()

    def run_all(self) -> None:
        for i in range(len(self.segments)):
            self.run_segment(i)


#: How far (rows, as a share of the recorded rows) a replayed step's collective may differ
#: from its recording and still be fed the recorded result: GEMMs run with fewer SMs (the
#: probe's `both` step, `streams.gemm_carveout`) pick other cuBLAS kernels, whose bf16
#: rounding can move a token's top-k choice, and with it one rank's send counts, by a row.
ROW_DRIFT_SHARE = 0.05
ROW_DRIFT_MIN = 8


@dataclass
class ReplayDrift:
    """The replayed calls whose output differed from the recording in rows only."""

    calls: int = 0
    max_rows: int = 0

    def note(self) -> str:
        """One line for the log ("" when the replay matched call by call)."""
        if not self.calls:
            return ""
        return (f"{self.calls} replayed collective(s) differed from the recording by up "
                f"to {self.max_rows} row(s) (routing moved with the GEMMs' rounding); "
                f"each got the recorded rows it had room for")


def _drift_rows(out: Tensor, recorded: Tensor) -> Optional[int]:
    """|rows of out - rows of recorded| when the two differ in their first dim only and
    by no more than the allowed drift; else None."""
    if out.dim() == 0 or out.shape[1:] != recorded.shape[1:]:
        return None
    rows = abs(out.shape[0] - recorded.shape[0])
    allowed = max(ROW_DRIFT_MIN, int(ROW_DRIFT_SHARE * recorded.shape[0]))
    return rows if rows <= allowed else None


@contextlib.contextmanager
def replayed_results(recording: CommRecording) -> Iterator[ReplayDrift]:
    """Inside the block, each collective (in recorded order) copies the result it gave in
    the recorded step into its output instead of communicating. The block must issue
    the same collectives as the recorded step (same workload, same inputs); an output
    whose rows differ a little from the recording's (`ROW_DRIFT_SHARE`) gets the
    recorded rows that fit, zeros after them, and is counted in the yielded
    `ReplayDrift`; any other difference raises."""
    calls = [op for segment in recording.segments for op in segment]
    position = [0]
    drift = ReplayDrift()
    originals = {name: getattr(dist, name) for name in RECORDED_COLLECTIVES}

    def fake(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> None:
            op = calls[position[0] % len(calls)]
            position[0] += 1
            out = signature.bind(*args, **kwargs).arguments[OUTPUT_ARG[name]]
            if op.name == name and op.result is not None and op.result.shape == out.shape:
                out.copy_(op.result)
                return
            rows = (_drift_rows(out, op.result) if op.name == name and op.result is not None
                    else None)
            if rows is None:
                raise RuntimeError(f"replayed step diverged from the recording at call "
                                   f"{position[0]}: {name} {tuple(out.shape)} vs recorded "
                                   f"{op.name} {None if op.result is None else tuple(op.result.shape)}")
            n = min(out.shape[0], op.result.shape[0])
            out[:n].copy_(op.result[:n])
            out[n:].zero_()
            drift.calls += 1
            drift.max_rows = max(drift.max_rows, rows)
        return call

    try:
        for name, fn in originals.items():
            setattr(dist, name, fake(name, fn))
        yield drift
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@dataclass(frozen=True)
class Ceiling:
    """Median times of the step's compute alone, comm alone and both at once."""

    compute: Timing
    comm: Timing
    both: Timing
    num_collectives: int
    drifted_calls: int = 0
    """Replayed collectives fed a drifted recorded result (`ReplayDrift`)."""

    @property
    def serial_ms(self) -> float:
        """T_serial = T_compute + T_comm (slowest rank of each)."""
        return self.compute.max_ms + self.comm.max_ms

    @property
    def ceiling(self) -> float:
        """T_serial / T_both: the speedup a perfect overlap of this step would give."""
        return self.serial_ms / self.both.max_ms


def median_ceiling(rounds: list[Ceiling]) -> Ceiling:
    """Compute, comm and both, each folded over rounds (`timing.median_of_rounds`)."""
    return Ceiling(median_of_rounds([c.compute for c in rounds]),
                   median_of_rounds([c.comm for c in rounds]),
                   median_of_rounds([c.both for c in rounds]), rounds[0].num_collectives,
                   max(c.drifted_calls for c in rounds))


def probe_split_compute(workload: Workload, *, device: torch.device,
                        group: Optional[dist.ProcessGroup], warmup: int, iters: int,
                        span: SpanFn = no_spans, cuda_graph: bool = False) -> Timing:
    """Time the DBO-on `workload` with its collectives replaced by the results they gave
    in one recorded step (module doc: split compute); `span("split")` wraps the timed
    steps, as `probe_ceiling`'s spans do. The runner's schedule issues them
    in the same order every step, so the replay matches call by call (else it raises).
    The copies of the results are kernel time of their own (at DeepSeek-V3 shapes with
    4096 tokens per rank on 2 ranks, 1.2 ms per step against 0.14 ms of copies in the
    real step): the figure is a little high, as compute alone is. With `cuda_graph` the
    split step (decided, no vote) is captured and its replays timed."""
    assert workload.runner is not None, "time the DBO-on workload"
    # Graphs capture the step after the vote (`Workload.split_step`): record that one.
    step = workload.split_step if cuda_graph else workload.step
    with record_collectives(workload.model) as recording:
        step()
    with replayed_results(recording) as drift:
        split = time_steps(step, device=device, group=group, warmup=warmup, iters=iters,
                           span=span("split"), cuda_graph=cuda_graph)
    log_drift("split compute", drift)
    return split


def probe_ceiling(workload: Workload, *, device: torch.device,
                  group: Optional[dist.ProcessGroup], warmup: int, iters: int,
                  span: SpanFn = no_spans, gemm_sm_carveout: Optional[int] = None,
                  cuda_graph: bool = False) -> Ceiling:
    """Measure compute alone, comm alone and both on two CUDA streams (GPU only).
    `span(name)` wraps each timing's timed steps ("comm", "compute", "both").
    `gemm_sm_carveout`: SMs torch's GEMMs leave free in `both`, as a DBO step's do
    (`DBOConfig.gemm_sm_carveout`); compute alone uses every SM. With `cuda_graph` each
    timing captures its step and times the replays, as the bench's steps are then."""
    if device.type != "cuda":
        raise ValueError(f"the ceiling probe overlaps two CUDA streams; device is {device}")
    assert workload.runner is None, "probe the DBO-off workload"
    model = workload.model
    with record_collectives(model) as recording:
        workload.step()
    replay = CommReplay(recording)
    timing = dict(device=device, group=group, warmup=warmup, iters=iters,
                  cuda_graph=cuda_graph)
    comm = time_steps(replay.run_all, **timing, span=span("comm"))
    # Compute alone and both run the kernels a DBO step runs: none that holds every SM
    # (moe.modular_kernel.sharing_sms).
    with replayed_results(recording) as drift, sharing_sms(model):
        compute = time_steps(workload.step, **timing, span=span("compute"))
        with _overlapped_comm(workload, replay, device) as both_step, \
                streams.gemm_sm_carveout(gemm_sm_carveout, device):
            both = time_steps(both_step, **timing, span=span("both"))
    log_drift("ceiling probe", drift)
    return Ceiling(compute, comm, both, recording.num_collectives, drift.calls)


def log_drift(what: str, drift: ReplayDrift) -> None:
    """One stderr line when the replay fed drifted outputs (the timing stands: the
    transfers and the compute differ by a row or two)."""
    if drift.calls:
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"[dbo bench] rank {rank}, {what}: {drift.note()}", file=sys.stderr)


@contextlib.contextmanager
def _overlapped_comm(workload: Workload, replay: CommReplay,
                     device: torch.device) -> Iterator[Callable[[], None]]:
    """A step function running the workload (compute stream) and the replay (side stream)."""
    comm_stream = new_comm_stream(device)  # as DBO's: high priority
    next_segment = [0]

    def issue_next() -> None:
        with torch.cuda.stream(comm_stream):
            replay.run_segment(next_segment[0])
        next_segment[0] += 1

    def both_step() -> None:
        compute_stream = torch.cuda.current_stream(device)
        comm_stream.wait_stream(compute_stream)  # start together, after earlier work
        next_segment[0] = 0
        issue_next()
        workload.step()
        while next_segment[0] < len(replay.segments):
            issue_next()
        compute_stream.wait_stream(comm_stream)

    handles = [layer.register_forward_pre_hook(lambda *_: issue_next())
               for layer in moe_layers(workload.model)]
    try:
        yield both_step
    finally:
        for h in handles:
            h.remove()

