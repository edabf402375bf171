"""Step timing for the bench: CUDA events on GPU, perf_counter on CPU; medians; all ranks.

    t = time_steps(workload.step, device=device, group=group, warmup=5, iters=20)
    t.rank0_ms, t.max_ms, t.per_rank_ms, t.host_max_ms

Every timed step starts from an idle device with the ranks aligned: barrier, device
synchronize, start event, the step, end event. So a step's time includes its own host
launch overhead and host syncs (DBO's greenlet switches included), and no rank's skew
leaks into another's step. Steps are not pipelined back to back. Each rank reports the
median over `iters` of its own steps; the ranks' medians are gathered (one small
collective, after the timed loop). Beside it, the **host time** of each step: from the
call of the step to its return, without waiting for the device (the time the host
needs to issue the step; where it nears the step time, the step is host-bound). For a
CUDA graph that is the replay's launch (plus, through a `GraphedRunner`, the vote and
the input copies). On CPU the two are the same. `median_of_rounds` folds the Timings of
repeated rounds into one: per rank, the median of that rank's round medians.
`host_bound(host_ms, step_ms)` is the rule the reports use to call a GPU step host-bound.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist

from dbo import HOST_BOUND_SHARE, capture_graph
from moe.bench.timing import barrier


@dataclass(frozen=True)
class Timing:
    """Median step times in milliseconds: each rank's, in rank order."""

    per_rank_ms: tuple[float, ...]
    host_per_rank_ms: tuple[float, ...] = ()
    """Each rank's median host time per step (module doc); empty where not measured."""

    @property
    def host_max_ms(self) -> Optional[float]:
        """The slowest rank's median host time per step; None where not measured."""
        return max(self.host_per_rank_ms) if self.host_per_rank_ms else None

    @property
    def rank0_ms(self) -> float:
        return self.per_rank_ms[0]

    @property
    def max_ms(self) -> float:
        """The slowest rank's median: the step time the group sees."""
        return max(self.per_rank_ms)


def median_of_rounds(rounds: Sequence[Timing]) -> Timing:
    """One Timing from several rounds of the same measurement: per rank, the median of its
    round medians (so one slow round moves the result less than a mean would)."""
    if not rounds:
        raise ValueError("median_of_rounds needs at least one round")
    ranks = {len(t.per_rank_ms) for t in rounds}
    if len(ranks) != 1:
        raise ValueError(f"rounds disagree on the number of ranks: {sorted(ranks)}")
    num_ranks = ranks.pop()
    host: tuple[float, ...] = ()
    if all(len(t.host_per_rank_ms) == num_ranks for t in rounds):
        host = tuple(statistics.median(t.host_per_rank_ms[r] for t in rounds)
                     for r in range(num_ranks))
    return Timing(tuple(statistics.median(t.per_rank_ms[r] for t in rounds)
                        for r in range(num_ranks)), host)


# HOST_BOUND_SHARE (from dbo.cost_model, which applies the same rule): a GPU step whose
# host time is at least this share of its step time is host-bound.
# The end event is recorded after the step returns, so a step's time is at least its host
# time: at 90% or more the host's launches, not the device's work, set the step time (a
# DBO step of Qwen3-30B-A3B's shapes on 2 GPUs was issued in 24.8 of its 24.8 ms, the
# unsplit step in 11.0), and only less host work per step makes it faster. A step that
# reads on the host (a2a's counts) also waits for the device there: its host time is an
# upper bound of the issue time, and the reports say so.


def host_bound(host_ms: Optional[float], step_ms: float, *,
               share: float = HOST_BOUND_SHARE) -> bool:
    """Whether a step issued in `host_ms` (None: not measured) that took `step_ms` on the
    device is host-bound (`HOST_BOUND_SHARE`). Meaningful on GPU only: on CPU the two
    times are the same measurement."""
    return host_ms is not None and step_ms > 0 and host_ms >= share * step_ms


SpanFn = Callable[[str], ContextManager[Any]]
"""`span(name)`: a context around the timed steps of the timing called `name` (e.g. a
clock-log span, `dbo.cli.bench.sweep`); `no_spans` marks nothing."""


def no_spans(name: str) -> ContextManager[Any]:
    """The `SpanFn` that marks nothing."""
    return contextlib.nullcontext()


def time_steps(fn: Callable[[], Any], *, device: torch.device,
               group: Optional[dist.ProcessGroup], warmup: int, iters: int,
               span: Optional[ContextManager[Any]] = None, cuda_graph: bool = False) -> Timing:
    """Run `fn` `warmup` times untimed, then `iters` times timed (inside `span`, when
    given: e.g. a clock-log span that should not see warmup or compilation); gather the
    medians. With `cuda_graph`, the warmup steps are followed by a capture of `fn` in a
    CUDA graph (`dbo.graphs.capture_graph`), and replays of the graph are timed (the
    graph is released on return)."""
    if cuda_graph:
        fn = capture_graph(fn, device=device, warmup=max(warmup, 1)).replay
        fn()  # the first replay uploads the graph: keep it out of the timed steps
    else:
        for _ in range(warmup):
            fn()
    _sync(device)
    with span if span is not None else contextlib.nullcontext():
        samples = [_time_one(fn, device, group) for _ in range(iters)]
    device_ms = statistics.median(s[0] for s in samples)
    host_ms = statistics.median(s[1] for s in samples)
    return Timing(gather_floats(device_ms, group), gather_floats(host_ms, group))


def _time_one(fn: Callable[[], Any], device: torch.device,
              group: Optional[dist.ProcessGroup]) -> tuple[float, float]:
    """(step ms, host ms) of one step (module doc)."""
    barrier(group, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - begin) * 1e3
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), host_ms
    begin = time.perf_counter()
    fn()
    elapsed_ms = (time.perf_counter() - begin) * 1e3
    return elapsed_ms, elapsed_ms


def gather_floats(value: float, group: Optional[dist.ProcessGroup]) -> tuple[float, ...]:
    """Every rank's `value`, in rank order (a 1-tuple without torch.distributed)."""
    if group is None or not dist.is_initialized():
        return (float(value),)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, float(value), group=group)
    return tuple(float(v) for v in out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(tokens: int, ms: float) -> float:
    """Tokens per second of `tokens` in `ms` milliseconds (inf for a zero time)."""
    return tokens / (ms / 1e3) if ms > 0 else float("inf")


def timed_with_trial(step: Callable[[], Any], *, t_off: Timing, timing: dict[str, Any],
                     trial_iters: int, trial: bool,
                     span: Optional[ContextManager[Any]] = None
                     ) -> tuple[Timing, Optional[float]]:
    """One round of an overlap mode: its gate trial where `trial` (a short timing of its
    own, `trial_iters` steps: T_noDBO / its time, the slowest rank's on both sides, so the
    same on every rank), then its timing (inside `span`)."""
    speedup = None
    if trial:
        speedup = t_off.max_ms / time_steps(step, **{**timing, "iters": trial_iters}).max_ms
    return time_steps(step, **timing, span=span), speedup


def set_mode_times(point: Any, mode: str, rounds: Sequence[Timing], *, total_tokens: int,
                   speedup: bool = True) -> Timing:
    """Set `point`'s fields of an overlap mode from its rounds' median (returned):
    t_<mode>_ms (the slowest rank's) and _rank0, host_<mode>_ms, tokens_per_s_<mode> (of
    `total_tokens` over all ranks), speedup_<mode> = T_noDBO / its time (None unless
    `speedup`), and per_rank_ms / rounds_ms["t_<mode>"]."""
    median = median_of_rounds(rounds)
    setattr(point, f"t_{mode}_ms", median.max_ms)
    setattr(point, f"t_{mode}_ms_rank0", median.rank0_ms)
    setattr(point, f"host_{mode}_ms", median.host_max_ms)
    setattr(point, f"tokens_per_s_{mode}", rate(total_tokens, median.max_ms))
    setattr(point, f"speedup_{mode}", point.t_nodbo_ms / median.max_ms if speedup else None)
    point.per_rank_ms[f"t_{mode}"] = list(median.per_rank_ms)
    point.rounds_ms[f"t_{mode}"] = [t.max_ms for t in rounds]
    return median
