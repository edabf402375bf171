"""The points of `dbo bench --hf NAME` (`hf_sweep`, `hf_decode`): what each holds, and
the fields its timings give.

`HFPointTimes` is what a prefill point (`HFPoint`) and a decode point
(`hf_decode.HFDecodePoint`) share; `timing_fields` derives the step, host and rate fields
from the rounds' timings; `flat_row` makes a point a CSV row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from dbo.cli.bench.hf_config import HFBenchConfig
from dbo.cli.bench.timing import Timing, host_bound, median_of_rounds, rate

__all__ = ["HFPoint", "HFPointTimes", "HFSweepResult", "flat_row", "timing_fields"]


@dataclass(kw_only=True)
class HFPointTimes:
    """What a prefill point (`HFPoint`) and a decode point (`hf_decode.HFDecodePoint`)
    share: the backend, the three step times (ms, max over ranks unless *_rank0) and
    what `timing_fields` derives from them, the graph fields, the logit differences."""

    regime: str
    arch: str
    backend: str
    world_size: int
    t_hf_ms: float
    t_hf_ms_rank0: float
    t_nodbo_ms: float
    t_nodbo_ms_rank0: float
    t_dbo_ms: float
    t_dbo_ms_rank0: float
    host_hf_ms: Optional[float]
    host_nodbo_ms: Optional[float]
    host_dbo_ms: Optional[float]
    """The host's time to issue one step (`dbo.cli.bench.timing`): unconverted, DBO off,
    DBO on; slowest rank."""
    dbo_host_bound: Optional[bool]
    """Whether the DBO step is host-bound (`timing.host_bound`); None in a functional run
    (on CPU the host time is the step time)."""
    max_tokens_per_rank: Optional[int]
    """The converted layers' capacity (`moe.hf.convert`), None for a backend without one."""
    max_tokens_per_ubatch: Optional[int] = None
    """a2a_ll's capacity of one DBO ubatch (`hf_config.conversions`), else None."""
    tokens_per_s_hf: float
    tokens_per_s_nodbo: float
    tokens_per_s_dbo: float
    speedup: Optional[float]
    """T_noDBO / T_DBO (None in a functional run)."""
    dbo_vs_hf: Optional[float]
    """T_unconverted / T_DBO."""
    nodbo_vs_hf: Optional[float]
    """T_unconverted / T_noDBO."""
    dbo_split: bool
    dbo_split_reason: str
    logits_diff_nodbo: float
    logits_diff_dbo: float
    cuda_graph: bool = False
    """Converted steps replayed from CUDA graphs (the modules' docs)."""
    t_hf_eager_ms: Optional[float] = None
    t_hf_graph_ms: Optional[float] = None
    """The unconverted model eagerly and as a replayed graph (max over ranks; the graph
    None where it did not capture: `hf_graph_note`); under `cuda_graph` only. `t_hf_ms`
    is the faster."""
    hf_graph_note: str = ""
    t_sbo_ms: Optional[float] = None
    t_sbo_ms_rank0: Optional[float] = None
    host_sbo_ms: Optional[float] = None
    tokens_per_s_sbo: Optional[float] = None
    speedup_sbo: Optional[float] = None
    """The SBO step (the DBO-off model through `DBORunner(model, DBOConfig(overlap="sbo"))`:
    one ubatch, shared experts under the dispatch, the combine overlapped as
    `HFBenchConfig.sbo_form` says) and T_noDBO / T_SBO (None in a functional run); all
    None where it did not run (`sbo_note` says why)."""
    logits_diff_sbo: Optional[float] = None
    sbo_note: str = ""
    """Why this point has no SBO time (the model's `dbo_sbo_blocker`, or the runner's
    decision), or empty."""
    t_joined_ms: Optional[float] = None
    t_joined_ms_rank0: Optional[float] = None
    host_joined_ms: Optional[float] = None
    tokens_per_s_joined: Optional[float] = None
    speedup_joined: Optional[float] = None
    """DBO with joined experts (`hf_joined`: the DBO-on step through a runner with
    `joined_experts=True`, each MoE layer's experts once over both ubatches' rows) and
    T_noDBO / T_joined (None in a functional run); all None where it was not timed."""
    logits_diff_joined: Optional[float] = None
    joined_split: bool = False
    joined_split_reason: str = ""
    """Whether the joined step was split (the runner's decision), and why."""
    rounds: int = 1
    per_rank_ms: dict[str, list[float]] = field(default_factory=dict)
    rounds_ms: dict[str, list[float]] = field(default_factory=dict)


_NESTED = ("trial_speedups", "sbo_trial_speedups", "joined_trial_speedups", "per_rank_ms",
           "rounds_ms")
"""The `HFPoint` fields that are no CSV columns (lists and dicts: the JSON's only)."""


@dataclass(kw_only=True)
class HFPoint(HFPointTimes):
    """One backend and token count of the prefill sweep."""

    tokens_per_rank: int
    t_compute_ms: Optional[float] = None
    t_comm_ms: Optional[float] = None
    t_both_ms: Optional[float] = None
    t_split_ms: Optional[float] = None
    """The ceiling probe (`hf_probe`): the DBO-off step's compute alone, its comm alone,
    both on two streams, the DBO-on step's compute alone; None where not measured
    (`probe_note` says why)."""
    ceiling: Optional[float] = None
    """(T_compute + T_comm) / T_both."""
    eta: Optional[float] = None
    """(T_noDBO - T_DBO) / (T_noDBO - T_both); None without a probe or headroom (`eta_note`)."""
    eta_note: str = ""
    probe_note: str = ""
    gate: str = ""
    """"off", "sbo", "dbo" or "joined": the gate's mode (`hf_gate.attach_gate`, which sets
    the gate fields after the point's SBO and joined fields; "" before)."""
    gate_reason: str = ""
    t_gated_ms: Optional[float] = None
    gated_speedup: Optional[float] = None
    """The chosen mode's reported time, and T_noDBO / T_gated (None in a functional run)."""
    trial_speedups: list[float] = field(default_factory=list)
    sbo_trial_speedups: list[float] = field(default_factory=list)
    joined_trial_speedups: list[float] = field(default_factory=list)
    """The gate's separate trials, one per round: that round's T_noDBO / the trial's step,
    DBO on, SBO (none where SBO did not run) and joined."""

    def row(self) -> dict[str, Any]:
        """The flat fields (CSV columns), rounded for people."""
        return flat_row(self, _NESTED, first=("tokens_per_rank",))


@dataclass
class HFSweepResult:
    config: HFBenchConfig
    world_size: int
    shapes: dict[str, Any]
    points: list[HFPoint]


def timing_fields(hf: Timing, offs: list[Timing], ons: list[Timing], *, total_tokens: int,
                  perf: bool) -> dict[str, Any]:
    """The fields of an `--hf` point (`HFPoint`, `hf_decode.HFDecodePoint`) that its
    timings give: the unconverted step `hf`, the DBO-off and DBO-on rounds (medians over
    rounds), step and host times, rates of `total_tokens` over all ranks, and the ratios
    (None in a functional run, `perf` False)."""
    off, on = median_of_rounds(offs), median_of_rounds(ons)
    return dict(
        t_hf_ms=hf.max_ms, t_hf_ms_rank0=hf.rank0_ms,
        t_nodbo_ms=off.max_ms, t_nodbo_ms_rank0=off.rank0_ms, t_dbo_ms=on.max_ms,
        t_dbo_ms_rank0=on.rank0_ms, host_hf_ms=hf.host_max_ms, host_nodbo_ms=off.host_max_ms,
        host_dbo_ms=on.host_max_ms,
        dbo_host_bound=host_bound(on.host_max_ms, on.max_ms) if perf else None,
        tokens_per_s_hf=rate(total_tokens, hf.max_ms),
        tokens_per_s_nodbo=rate(total_tokens, off.max_ms),
        tokens_per_s_dbo=rate(total_tokens, on.max_ms),
        speedup=off.max_ms / on.max_ms if perf else None,
        dbo_vs_hf=hf.max_ms / on.max_ms if perf else None,
        nodbo_vs_hf=hf.max_ms / off.max_ms if perf else None,
        rounds=len(offs),
        per_rank_ms={"t_hf": list(hf.per_rank_ms), "t_nodbo": list(off.per_rank_ms),
                     "t_dbo": list(on.per_rank_ms)},
        rounds_ms={"t_nodbo": [t.max_ms for t in offs], "t_dbo": [t.max_ms for t in ons]})


def flat_row(point: Any, nested: tuple[str, ...], *, first: tuple[str, ...] = ()
             ) -> dict[str, Any]:
    """A point's flat fields (its CSV columns) without the `nested` ones, floats rounded
    to 6 significant digits for people; regime, arch, backend and the point's own `first`
    fields (its size) lead, then the `HFPointTimes` fields, then the rest."""
    out = {k: v for k, v in dataclasses.asdict(point).items() if k not in nested}
    lead = {k: out[k] for k in ("regime", "arch", "backend", *first)}
    out = {**lead, **out}
    return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in out.items()}
