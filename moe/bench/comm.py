"""The comm micro-benchmark: dispatch and combine of every backend, alone, over tokens
per rank (`dbo bench-comm`, `dbo.cli.bench_comm`).

Shape legend: T tokens per rank, H hidden, K top-k, E experts over all ranks, W ranks.

    result = run_comm_sweep(CommBenchConfig(tokens=(1, 128)), group=group, device=device)

Every rank runs, for each backend and point: the engine is built (`moe.bench.comm_engines`)
and called once untimed (a construction or first call that raises on any rank skips the
point on every rank, with that rank's one-line reason); then it is timed
(`moe.bench.comm_timing`): eagerly, `warmup` more untimed calls then `iters` calls back to
back, CUDA events around each dispatch and combine and perf_counter around each call; or,
with `cuda_graph`, `graph_layers` dispatch + combine pairs captured in one CUDA graph
(an engine that cannot be captured, or a capture that fails on any rank, skips the point
with the reason) and its replays timed. Figures are per-rank medians; the latency
reported is the slowest rank's median, the bandwidth the mean over ranks of each rank's
bytes over its own median (`moe.bench.comm_metrics`). On GPU one more eager dispatch and
combine run under torch.profiler for the SMs the comm kernels occupy. On CPU (gloo) the
times are host wall times: a functional check, no performance figure (and no graphs).

All backends see the same inputs per point: x_TH random bf16, routing per `routing` from
(seed, rank).
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from moe.backends import check_one_process
from moe.bench.comm_engines import Engine, Shapes, bench_names, make_source, parse_spec
from moe.bench.comm_metrics import (ROUTINGS, CommKernels, algbw_gbps, comm_kernel_sms,
                                    expert_slots, make_routing, make_tokens, rows_to_ranks)
from moe.bench.comm_timing import (DEFAULT_GRAPH_LAYERS, RankTiming, capture_layers,
                                   time_engine, time_replays)

__all__ = ["CommBenchConfig", "CommResult", "Point", "RankTiming", "Skip", "make_point",
           "run_comm_sweep"]

DEFAULT_TOKENS = (1, 128, 512, 2048, 4096, 8192)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class CommBenchConfig:
    """What `dbo bench-comm` runs (DeepSeek-V3's MoE exchange by default)."""

    tokens: tuple[int, ...] = DEFAULT_TOKENS
    """Tokens per rank of each point."""
    backends: tuple[str, ...] = ()
    """Backends to time, in order (`moe.bench.comm_engines.bench_names`); () = all of them."""
    hidden: int = 7168
    """Hidden size H of the rows sent."""
    top_k: int = 8
    """Experts per token K."""
    num_experts: int = 256
    """Routed experts over all ranks E (a multiple of the number of ranks)."""
    iters: int = 50
    """Timed dispatch + combine calls per point."""
    warmup: int = 10
    """Untimed calls per point before them (after the first, checked one); with
    `cuda_graph`, untimed replays of the captured graph."""
    routing: str = "random"
    """"random" (top-K of random scores, as DeepEP's tests) or "balanced"."""
    seed: int = 0
    """Tokens and routing derive from (seed, rank)."""
    dtype: torch.dtype = torch.bfloat16
    """Element type of the rows sent."""
    regime: str = ""
    """The label every output carries (set by the command line: NVLink, CPU gloo, ...)."""
    out_dir: str = "dbo_out/bench_comm"
    """Folder of the CSV, JSON and PNG."""
    plot: bool = True
    """Draw the PNG."""
    cuda_graph: bool = False
    """Time `graph_layers` dispatch + combine pairs replayed from one CUDA graph instead of
    eager calls (GPU only; engines that cannot be captured are skipped with the reason)."""
    graph_layers: int = DEFAULT_GRAPH_LAYERS
    """Dispatch + combine pairs per graph (as many MoE layers of one step); with
    `cuda_graph` only."""

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, tuple) or not self.tokens:
            raise ValueError(f"tokens={self.tokens!r}: give a tuple of tokens per rank, e.g. "
                             f"(1, 128, 4096)")
        for t in self.tokens:
            if not _is_int(t) or t < 1:
                raise ValueError(f"tokens must be positive ints, got {t!r}: every point "
                                 f"needs at least one token per rank")
        # ValueError naming the choices or the options' fields
        names = [parse_spec(spec)[0] for spec in self.backends]
        check_one_process(names)  # symm_mem with a DeepEP LL one aborts the process
        if not isinstance(self.cuda_graph, bool):
            raise TypeError(f"cuda_graph={self.cuda_graph!r}: must be True or False")
        for name in ("hidden", "top_k", "num_experts", "iters", "graph_layers"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r}: must be an int >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                             f"pick at most num_experts experts per token")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}: choose one of {ROUTINGS}")

    @property
    def names(self) -> tuple[str, ...]:
        return self.backends or bench_names()

    def check_device(self, device: torch.device) -> None:
        """ValueError (with the fix) for what `device` cannot run: graphs need CUDA."""
        if self.cuda_graph and torch.device(device).type != "cuda":
            raise ValueError("--cuda-graph needs CUDA GPUs, and none is visible here: drop "
                             "--cuda-graph to time eager calls (on CPU, over gloo)")

    def check_world(self, world_size: int) -> None:
        """ValueError (with the fix) when the experts do not split over the ranks."""
        if world_size < 2:
            raise ValueError(f"{world_size} rank: the comm benchmark needs at least 2 "
                             f"(torchrun --nproc_per_node=2, or 2 GPUs visible)")
        if self.num_experts % world_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the "
                             f"{world_size} ranks: pass --num-experts N with N a multiple "
                             f"of {world_size}")


@dataclass(frozen=True)
class Point:
    """One (backend, tokens per rank): latencies in microseconds (slowest rank's median),
    bandwidths in GB/s (mean over ranks), SMs (most over ranks; None on CPU). Host times:
    per dispatch and per combine call (eager; None graphed) and per dispatch + combine
    pair, i.e. per layer (eager: the two calls; graphed: one replay call / N)."""

    backend: str
    tokens: int
    dispatch_us: float
    combine_us: float
    total_us: float
    host_dispatch_us: Optional[float]
    host_combine_us: Optional[float]
    host_total_us: float
    algbw_dispatch_gbps: Optional[float]
    algbw_combine_gbps: Optional[float]
    algbw_total_gbps: Optional[float]
    algbw_ll_total_gbps: Optional[float]
    sms_dispatch: Optional[int]
    sms_combine: Optional[int]
    comm_kernels: dict[str, int]
    per_rank: dict[str, list[Any]]


@dataclass(frozen=True)
class Skip:
    """A backend (tokens None: every point) or one point that did not run, and why."""

    backend: str
    tokens: Optional[int]
    reason: str


@dataclass(frozen=True)
class CommResult:
    config: CommBenchConfig
    world_size: int
    device: str
    sm_count: Optional[int]
    points: list[Point] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)

    @property
    def functional(self) -> bool:
        """A CPU run: host wall times of gloo collectives, no performance figure."""
        return self.sm_count is None


def _kernel_events(fn: Callable[[], Any], device: torch.device) -> tuple[Any, list[dict]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            doc = json.load(f)
    events = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    return result, [e for e in events if isinstance(e, dict) and e.get("cat") == "kernel"]


def profile_sms(engine: Engine, device: torch.device,
                sm_count: int) -> tuple[CommKernels, CommKernels]:
    """The comm kernels' SMs of one dispatch and of one combine (GPU; every rank at once)."""
    from traces.classify import Classifier

    is_comm = Classifier().is_comm_name
    state, dispatch_events = _kernel_events(engine.dispatch, device)
    _, combine_events = _kernel_events(lambda: engine.combine(state), device)
    return (comm_kernel_sms(dispatch_events, sm_count=sm_count, is_comm=is_comm),
            comm_kernel_sms(combine_events, sm_count=sm_count, is_comm=is_comm))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def agree(reason: Optional[str], group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """The first rank's refusal (prefixed with its rank), on every rank; None if none."""
    if group is None:
        return reason
    reasons: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    return next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why), None)


def _gather(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _progress(line: str) -> None:
    print(f"[bench-comm] {line}", file=sys.stderr, flush=True)


def _mean(values: list[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) else statistics.mean(values)  # type: ignore


def _max(values: list[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) else max(values)  # type: ignore


def make_point(name: str, tokens: int, ranks: list[dict[str, Any]], *,
               itemsize: int, hidden: int) -> Point:
    """Fold the ranks' figures (`_run_point`'s dicts, rank order) into one Point."""
    col = {key: [r[key] for r in ranks] for key in ranks[0]}
    row_bytes = hidden * itemsize
    rank_bytes = [rows * row_bytes for rows in col["rank_rows"]]
    ll_bytes = [slots * row_bytes for slots in col["expert_slots"]]
    timing: list[RankTiming] = col.pop("timing")
    per_rank = {**col, "rank_bytes": rank_bytes, "ll_bytes": ll_bytes,
                "dispatch_us": [t.dispatch_ms * 1e3 for t in timing],
                "combine_us": [t.combine_ms * 1e3 for t in timing],
                "total_us": [t.total_ms * 1e3 for t in timing],
                "host_dispatch_us": [t.host_dispatch_us for t in timing],
                "host_combine_us": [t.host_combine_us for t in timing],
                "host_total_us": [t.host_total_us for t in timing]}
    sms = per_rank.pop("sms")
    kernels = per_rank.pop("kernels")
    phase_sms = [max((s[i] for s in sms if s[i] is not None), default=None) for i in (0, 1)]
    return Point(
        backend=name, tokens=tokens,
        dispatch_us=max(per_rank["dispatch_us"]), combine_us=max(per_rank["combine_us"]),
        total_us=max(per_rank["total_us"]),
        host_dispatch_us=_max(per_rank["host_dispatch_us"]),
        host_combine_us=_max(per_rank["host_combine_us"]),
        host_total_us=max(per_rank["host_total_us"]),
        algbw_dispatch_gbps=_mean([algbw_gbps(b, t.dispatch_ms)
                                   for b, t in zip(rank_bytes, timing)]),
        algbw_combine_gbps=_mean([algbw_gbps(b, t.combine_ms)
                                  for b, t in zip(rank_bytes, timing)]),
        algbw_total_gbps=_mean([algbw_gbps(2 * b, t.total_ms)
                                for b, t in zip(rank_bytes, timing)]),
        algbw_ll_total_gbps=_mean([algbw_gbps(2 * b, t.total_ms)
                                   for b, t in zip(ll_bytes, timing)]),
        sms_dispatch=phase_sms[0], sms_combine=phase_sms[1],
        comm_kernels=kernels[0], per_rank=per_rank)


def run_comm_sweep(cfg: CommBenchConfig, *, group: Optional[dist.ProcessGroup],
                   device: torch.device) -> CommResult:
    """Every backend x every point (see the module); rank 0's result holds every rank's
    figures (the others' are the same)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    cfg.check_world(world)
    cfg.check_device(device)
    cuda = device.type == "cuda"
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if cuda else None
    result = CommResult(cfg, world, torch.cuda.get_device_name(device) if cuda else "cpu",
                        sm_count)
    shapes = Shapes(hidden=cfg.hidden, top_k=cfg.top_k, num_experts=cfg.num_experts,
                    dtype=cfg.dtype)
    say = _progress if rank == 0 else (lambda line: None)
    inputs, traffic = {}, {}
    for t in cfg.tokens:
        ids_TK, weights_TK = make_routing(t, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                          rank=rank, seed=cfg.seed, mode=cfg.routing,
                                          device=device)
        x_TH = make_tokens(t, cfg.hidden, rank=rank, seed=cfg.seed, dtype=cfg.dtype,
                           device=device)
        inputs[t] = (x_TH, weights_TK, ids_TK)
        sent = _gather(rows_to_ranks(ids_TK, num_experts=cfg.num_experts, world_size=world),
                       group)
        traffic[t] = {"rank_rows": sum(s[rank] for s in sent),
                      "expert_slots": expert_slots(ids_TK)}
    for name in cfg.names:
        reason = None
        try:
            source = make_source(name, shapes, group, tokens=cfg.tokens)
        except Exception as exc:  # noqa: BLE001 - reported as the backend's skip reason
            reason = _one_line(exc)
        reason = agree(reason, group)
        if reason is not None:
            result.skipped.append(Skip(name, None, reason))
            say(f"{name}: skipped: {reason}")
            continue
        try:
            for t in cfg.tokens:
                _run_point(cfg, result, name, source, t, inputs[t], traffic[t],
                           group=group, device=device, say=say)
                gc.collect()
        finally:
            source.close()
    return result


def _run_point(cfg: CommBenchConfig, result: CommResult, name: str, source: Any, tokens: int,
               inputs: tuple, traffic: dict[str, int], *, group: Optional[dist.ProcessGroup],
               device: torch.device, say: Callable[[str], None]) -> None:
    reason, engine, rows = None, None, 0
    try:
        engine = source.bind(*inputs)
        reason = engine.graph_blocker() if cfg.cuda_graph else None
        if reason is None:
            state = engine.dispatch()
            rows = engine.rows_delivered(state)
            engine.combine(state)
            del state
    except Exception as exc:  # noqa: BLE001 - reported as the point's skip reason
        reason = _one_line(exc)
    if _skipped(result, name, tokens, agree(reason, group), say):
        return
    if cfg.cuda_graph:
        graph = None
        try:
            graph = capture_layers(engine, layers=cfg.graph_layers, device=device)
        except Exception as exc:  # noqa: BLE001 - reported as the point's skip reason
            reason = _one_line(exc)
        if _skipped(result, name, tokens, agree(reason, group), say):
            return
        timing = time_replays(graph, device=device, group=group, warmup=cfg.warmup,
                              iters=cfg.iters)
        del graph  # its memory pool goes before the next point's
    else:
        timing = time_engine(engine, device=device, group=group, warmup=cfg.warmup,
                             iters=cfg.iters)
    sms, kernels = (None, None), {}
    if result.sm_count is not None:
        d, c = profile_sms(engine, device, result.sm_count)
        sms, kernels = (d.sms, c.sms), {**d.blocks, **c.blocks}
    mine = {**traffic, "rows_delivered": rows, "timing": timing, "sms": sms,
            "kernels": kernels}
    point = make_point(name, tokens, _gather(mine, group),
                       itemsize=cfg.dtype.itemsize, hidden=cfg.hidden)
    result.points.append(point)
    say(f"{name} T={tokens}: dispatch {point.dispatch_us:.1f} us, combine "
        f"{point.combine_us:.1f} us, d+c {point.total_us:.1f} us, host per layer "
        f"{point.host_total_us:.1f} us")


def _skipped(result: CommResult, name: str, tokens: int, reason: Optional[str],
             say: Callable[[str], None]) -> bool:
    """Record the point as skipped where a rank gave a reason (`agree`)."""
    if reason is None:
        return False
    result.skipped.append(Skip(name, tokens, reason))
    say(f"{name} T={tokens}: skipped: {reason}")
    return True
