"""A cost model of one step: its time with no overlap, with two ubatches (DBO), with two
ubatches whose experts run joined and with single-batch overlap (SBO), what splitting
costs, and which mode to run.

    times = PhaseTimes(attention=4.0, shared=0.5, experts=6.0, dispatch=3.0, combine=3.0)
    shape = StepShape(layers=58, tokens=4096, rows_per_expert=1024.0,
                      expert_weight_bytes=58 * 3 * 44e6)
    p = predict(times, shape, Calibration())
    p.times_ms["dbo"], p.chosen, p.reason

Pure Python (no torch). Every time is in ms; a `PhaseTimes` holds the whole unsplit
step (all layers) on one rank; the model works per MoE layer and multiplies by L.

Per layer (unsplit): a = attention / L (attention, norms, router: what the dispatch
needs), s = shared / L (shared experts: needs no dispatch), x = experts / L, d = dispatch
/ L, c = combine / L, lam = comm_latency (per collective, does not halve with the batch).

Terms (source of each parameter after the colon):
  W_e = expert_weight_bytes / L / memory_gbs : StepShape (the caller's model), Calibration
  W_a, W_s likewise for attention and shared-expert weights : StepShape, Calibration
  g = eff(r) / eff(r / 2), r = rows per expert : Calibration.gemm_efficiency curve
  ov(u, m) = max(m, u / kappa + f * m)   compute u under comm m; f = comm_sm_share,
             kappa = overlap_clock (compute runs at (1 - f) speed while comm runs) : Calibration
  host(k) = L * k * launch_us            k launches per layer : StepShape, Calibration
  h, h_dbo, h_sbo = the measured host time to issue the unsplit, DBO and SBO step :
             StepShape (the bench); h_dbo = 2 h and h_sbo = h where only h was measured
  step(gpu, h) = max(gpu, h) for an eager step (the host issues while the GPU runs: the
             slower of the two sets the step), gpu + h under CUDA graphs (`cuda_graph`:
             the host time is the runner's vote and the replay's launch, spent before the
             GPU has any of the step's work)
  none:   T = step(L * (a + x + d + c + s), max(host(k), h))   under CUDA graphs
          T = step(L * (a + x + d + ov(s, c)), max(host(k), h))   eager
          The DBO-off step has no comm stream (no scheduler: its collectives block the
          compute stream), so nothing in it overlaps: a graph replay, with no launch gaps,
          takes the sum of its phases. Eager, the host queues the kernels after each
          collective while it runs, so the launch gaps the compute-alone probe holds do
          not recur in the step: measured eager steps ran 3-8% below the sum of their
          phases on 2 and 4 H200s, and the model keeps taking min(s, c) per layer off
          for them, an allowance of that size (written as the shared experts under
          the combine).
  DBO, per ubatch: a2 = max(a / 2, W_a)           weights read twice (each ubatch reads them)
                   s2 = max(s / 2, W_s)
                   x2 = max(g * x / 2, W_e)       half-size GEMM efficiency, weights twice
                   (a2, s2, x2 scaled together to the measured split compute where the
                   bench measured it: 2 * L * (a2 + s2 + x2) = split_compute_ms)
                   y2 = x2 + s2                   shared experts beside the routed ones
                   d2 = (d - lam) / 2 + lam       the latency is paid per ubatch
                   c2 = (c - lam) / 2 + lam
          layer = ov(a2, d2) + ov(y2, d2) + ov(y2, c2) + ov(a2, c2)
                  (ubatch 1's attention under ubatch 0's dispatch, experts under the
                  other's dispatch and combine, the next attention under the combine)
          fill/drain = a2 + tail - ov(a2, c2): ubatch 0's first attention has no comm
                  under it, and the step's last combine has only the last ubatch's
                  v2 = s2 + o * x2 under it: its shared experts (queued between the
                  combine's send and receive, as in every layer) and, where the
                  backend splits its combine (o = own_row_share: the last MoE layer's
                  own rows, `MoEConfig.split_last_combine`), its own rows, which then
                  leave ubatch 0's combine for it:
                  tail = ov(y2 - v2, c2) + ov(v2, c2) - ov(y2, c2)
                  (v2 = 0: c2 exposed; compute-bound and v2 >= c2: only the SM share)
                  + [first_dispatch_exposed] (a2 + d2 - ov(a2, d2)): the step's first
                  dispatch waits on the host before ubatch 1 queues work (a2a)
          T = step(L * layer + fill/drain, max(host(2k), h_dbo))  twice the launches
  SBO, as `moe.modular_kernel` runs it: the shared experts under the dispatch, then the
          experts over the other ranks' rows in n = sbo_chunks chunks of rows (each
          chunk's combine under the next chunk's experts), then this rank's own rows
          (share o = own_row_share, never sent) under the last chunk's combine. Every
          pass is a smaller GEMM than the unsplit step's and reads the expert weights its
          rows need, all of them at decode sizes:
          pass(q) = max(q * x * eff(r) / eff(q * r), W_e)   a pass over a share q of the
                                              rows, at the GEMM efficiency of its rows
          pass(q) = max(2 q * x2m * eff(r / 2) / eff(q * r), W_e)   instead where
                  r >= persistent_min_rows and the probe measured the split compute on
                  the GPU (h_dbo measured, below 90% of it): the unsplit step (x, the
                  curve) ran the persistent GEMM, which the passes, like DBO's
                  ubatches, never run (the comm shares the SMs); x2m = split_compute /
                  (2 L) - a2 - s2 is one ubatch's experts as measured, the same kernels
                  over r / 2 rows (2 ranks: exactly an SBO pass)
          x_n = pass((1 - o) / n), x_o = pass(o)
          c_n = (c - lam) / n + lam           the measured combine is the other ranks'
                                              rows alone (the own rows never cross the
                                              link, in the unsplit step either): each
                                              chunk carries 1/n of it
          layer = a + ov(s, d) + x_n + (n - 1) * ov(x_n, c_n) + tail
          tail = ov(x_o, c_n) if o > 0, else c_n (the last combine exposed)
          T = step(L * layer, max(host(k + n - 1 + [o > 0]), h_sbo))
  SBO by expert group (G = sbo_groups > 1, `A2ALLOptions.combine_groups`): the shared
          experts under the dispatch, then for each of G groups of this rank's experts
          the experts over EVERY received row (own rows included: no own-rows pass)
          with only that group's 1/G of the local experts, each group's combine sent
          while the next group's experts run. Each expert's weights are read once and
          its rows are the unsplit step's, so the GEMM efficiency is unchanged:
          x_g = max(x / G, W_e / G)           one group: 1/G of the work and weights
          c_g = c                             a backend of fixed-size slots (a2a_ll,
                                              `group_carries_all`): each group's combine
                                              carries all the combine's rows, G times
                                              the bytes in all
          c_g = (c - lam) / G + lam           an expert-major backend: each group's
                                              combine carries its 1/G of the rows
          layer = a + ov(s, d) + x_g + (G - 1) * ov(x_g, c_g) + c_g
                                              (the last group's combine exposed)
          T = step(L * layer, max(host(k + G - 1), h_sbo))
          (G = 1 is the row-chunked term above; both above 1 is refused.) With
          c_g = c, x_g + (G - 1) * ov(x_g, c) + c >= G * x_g + c = max(x, W_e) + c:
          the grouped a2a_ll step is never predicted faster on the GPU than SBO's
          single pass without own rows (n = 1, o = 0), only than row chunks that
          each re-read the weights.
  joined (DBO with `DBOConfig.joined_experts`): two ubatches, whose experts run once over
          both ubatches' rows after both dispatches have arrived (each expert's weights
          read once, every SM: no transfer runs beside them). Comm per layer: the first
          (F) and second (S) ubatch's dispatches, then S's combine, then F's:
          layer = ov(a2, d2)          S's attention under F's dispatch
                  + d2                S's dispatch (the experts need both)
                  + x                 the unsplit step's experts, as measured
                  + ov(s2, c2)        S's shared experts under S's combine
                  + ov(a2 + s2, c2)   S's next attention, F's shared experts under F's
          a2, s2 as DBO's, unscaled by the measured split compute (whose excess is the
          split experts' cost, not paid here); fill/drain = a2 + ov(s2, c2) - ov(a2 +
          s2, c2) + [first_dispatch_exposed]: the first attention has nothing under it,
          the last combine no next attention
          T = step(L * layer + fill/drain, max(host(2k), h_joined or h_dbo))
          Offered (`predict`'s `joined`) only where the runner joins its experts.
  choice: the fastest mode, unless its gain T_none / T_mode - 1 is below `margin`:
          then "none" (an overlap mode that is predicted to win by less never runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from dbo.calibration import Calibration

__all__ = ["PhaseTimes", "StepShape", "Prediction", "predict", "MODES"]

MODES = ("none", "dbo", "sbo", "joined")


def _check_nonneg(owner: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not 0.0 <= float(value) < math.inf):
            raise ValueError(f"{owner}.{name}={value!r}: must be a finite number >= 0.")


@dataclass(frozen=True, kw_only=True)
class PhaseTimes:
    """Per-phase times of one whole unsplit step on one rank, in ms (all layers)."""

    attention: float
    """Compute the dispatch depends on: attention, norms, router."""
    experts: float
    """Routed-expert compute."""
    dispatch: float
    """Dispatch communication (latency included)."""
    combine: float
    """Combine communication (latency included)."""
    shared: float = 0.0
    """Compute that does not depend on the dispatch (shared experts)."""
    comm_latency: float = 0.0
    """Fixed part of one dispatch or combine collective, ms (kept whole per ubatch)."""

    def __post_init__(self) -> None:
        _check_nonneg("PhaseTimes", self, ("attention", "experts", "dispatch", "combine",
                                           "shared", "comm_latency"))


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What the model needs to know about the step besides its phase times."""

    layers: int
    """MoE layers in the step (L)."""
    tokens: int
    """Tokens on this rank in the step."""
    rows_per_expert: float
    """Rows each local expert's GEMM gets in the unsplit step (halved by DBO)."""
    expert_weight_bytes: float = 0.0
    """Bytes of routed-expert weights one pass reads on this rank, all layers."""
    attention_weight_bytes: float = 0.0
    """Bytes of attention weights one pass reads, all layers."""
    shared_weight_bytes: float = 0.0
    """Bytes of shared-expert weights one pass reads, all layers."""
    kernels_per_layer: int = 0
    """Kernel launches per layer of the unsplit step (0: host cost left out, e.g. under
    CUDA graphs)."""
    first_dispatch_exposed: bool = False
    """The step's first dispatch waits on the host before the second ubatch queues work
    (backends that read counts on the host: a2a)."""
    host_ms: float = 0.0
    """Measured host time to issue the unsplit step, ms (0: not known). Eager: a floor
    of the step; under CUDA graphs (`cuda_graph`) added to its GPU time."""
    host_dbo_ms: float = 0.0
    """Measured host time to issue the DBO step, ms (0: not known: 2 * host_ms, every
    layer's Python once per ubatch). The runner's vote, the scheduler's switches and
    twice the layers' Python: 1.7-3.2x host_ms measured on 2x H200, eager."""
    host_sbo_ms: float = 0.0
    """Measured host time to issue the SBO step, ms (0: not known: host_ms). The
    runner's vote and the own-rows pass's launches on top of the unsplit step's."""
    host_joined_ms: float = 0.0
    """Measured host time to issue the joined DBO step, ms (0: not known: the DBO
    step's). One experts call per layer where DBO makes two, and the meeting's switch."""
    cuda_graph: bool = False
    """The step is a CUDA-graph replay: its host time (the runner's vote, the replay's
    launch) is spent before the GPU has any of its work, so it adds to the GPU time
    instead of bounding it."""
    comm_sm_share: Optional[float] = None
    """The comm kernels' SM share for this step's backend and link (None: the
    calibration's `comm_sm_share`; `Calibration.comm_sm_share_for`)."""
    split_compute_ms: float = 0.0
    """Measured compute of the DBO step alone, ms (the bench's probe: `t_split`); 0: not
    measured. Where given, the two ubatches' attention and experts (a2, s2, x2) are
    scaled together so that 2 * L * (a2 + s2 + x2) equals it: what splitting really
    costs (half-size kernels, twice the kernels, weights read twice) instead of the
    modelled terms."""
    own_row_share: float = 0.0
    """Share of the received rows this rank sent itself (1/W under even routing, with a
    backend that splits its combine: a2a, a2a_ll; 0 otherwise). An SBO step computes
    them in a pass of their own, after the other ranks' rows have been sent back; so does
    a DBO step's last ubatch in the last MoE layer, under the step's final combine."""

    def __post_init__(self) -> None:
        for name in ("layers", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepShape.{name}={value!r}: must be an int >= 1.")
        if isinstance(self.kernels_per_layer, bool) or not isinstance(self.kernels_per_layer, int) \
                or self.kernels_per_layer < 0:
            raise ValueError(f"StepShape.kernels_per_layer={self.kernels_per_layer!r}: must be "
                             f"an int >= 0.")
        if not 0.0 <= self.own_row_share < 1.0:
            raise ValueError(f"StepShape.own_row_share={self.own_row_share!r}: must be in "
                             f"[0, 1) (1/W for W ranks, 0 without an own-rows pass).")
        _check_nonneg("StepShape", self, ("rows_per_expert", "expert_weight_bytes",
                                          "attention_weight_bytes", "shared_weight_bytes",
                                          "split_compute_ms",
                                          "host_ms", "host_dbo_ms", "host_sbo_ms",
                                          "host_joined_ms"))
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"StepShape.cuda_graph={self.cuda_graph!r}: must be True or "
                             f"False.")
        share = self.comm_sm_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0.0 <= share < 1.0):
            raise ValueError(f"StepShape.comm_sm_share={share!r}: must be None or in [0, 1) "
                             f"(the fraction of SMs the comm kernels hold).")
        if self.rows_per_expert <= 0:
            raise ValueError(f"StepShape.rows_per_expert={self.rows_per_expert!r}: must be > 0.")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The predicted step time of each mode, the choice and why (a prediction, not a
    measurement)."""

    times_ms: dict[str, float]
    """Predicted step time per mode ("none", "dbo", "sbo", "joined")."""
    chosen: str
    """The mode to run."""
    reason: str
    """One line: why that mode."""
    dbo_costs_ms: dict[str, float]
    """What splitting costs against a perfect overlap, per term (weights_read_twice,
    half_gemm, fill_drain, comm_sm_share, clock, launches: the DBO step's host time
    beyond its GPU time, or all of it under CUDA graphs)."""

    def gain(self, mode: str) -> float:
        """T_none / T_mode - 1 (0.25 = 25% faster)."""
        return self.times_ms["none"] / self.times_ms[mode] - 1.0


def _ov(u: float, m: float, *, f: float, kappa: float) -> float:
    """Compute u under comm m, compute slowed to (1 - f) while comm runs."""
    return max(m, u / kappa + f * m)


def _dbo_gpu(a2: float, y2: float, v2: float, d2: float, c2: float, L: int, *, f: float,
             kappa: float, first_dispatch_exposed: bool) -> float:
    ov = lambda u, m: _ov(u, m, f=f, kappa=kappa)  # noqa: E731
    return (L * (ov(a2, d2) + ov(y2, d2) + ov(y2, c2) + ov(a2, c2))
            + _fill_drain(a2, y2, v2, d2, c2, ov, first_dispatch_exposed))


def _joined_gpu(a2: float, s2: float, xj: float, d2: float, c2: float, L: int, *,
                f: float, kappa: float, first_dispatch_exposed: bool) -> float:
    ov = lambda u, m: _ov(u, m, f=f, kappa=kappa)  # noqa: E731
    layer = ov(a2, d2) + d2 + xj + ov(s2, c2) + ov(a2 + s2, c2)
    first = (a2 + d2 - ov(a2, d2)) if first_dispatch_exposed else 0.0
    return L * layer + a2 + ov(s2, c2) - ov(a2 + s2, c2) + first


def _fill_drain(a2: float, y2: float, v2: float, d2: float, c2: float,
                ov: Callable[[float, float], float], first_dispatch_exposed: bool) -> float:
    first = (a2 + d2 - ov(a2, d2)) if first_dispatch_exposed else 0.0
    # The last ubatch's last layer: v2 of its y2 runs under its own (final) combine, not
    # under ubatch 0's.
    last = ov(y2 - v2, c2) + ov(v2, c2) - ov(y2, c2)
    return a2 + last - ov(a2, c2) + first


HOST_BOUND_SHARE = 0.9
"""A step whose measured host time is at least this share of its time was set by the
host, not the GPU (the bench applies the same rule: `dbo.cli.bench.timing.host_bound`)."""


def _split_expert_rate(shape: StepShape, cal: Calibration, *, a2: float,
                       s2: float) -> Optional[float]:
    """One DBO ubatch's expert time per layer as the probe measured it (the split compute
    less the modelled attention and shared halves), where SBO's passes should take it:
    the unsplit step ran the persistent GEMM (`Calibration.persistent_min_rows`), which
    the passes, like the ubatches, never run; and the split compute is the GPU's time
    (the DBO step's host issue time was measured, below it). None: use the curve."""
    split, h_dbo = shape.split_compute_ms, shape.host_dbo_ms
    if (shape.rows_per_expert < cal.persistent_min_rows or split <= 0 or h_dbo <= 0
            or (not shape.cuda_graph and h_dbo >= HOST_BOUND_SHARE * split)):
        return None
    x2 = split / (2 * shape.layers) - a2 - s2
    return x2 if x2 > 0 else None


def predict(times: PhaseTimes, shape: StepShape, calibration: Calibration, *,
            margin: float = 0.01, sbo_chunks: int = 1, sbo_groups: int = 1,
            group_carries_all: bool = True, joined: bool = False) -> Prediction:
    """Predicted step time with no overlap, DBO, joined DBO and SBO (module docstring:
    the terms), and the mode to run: the fastest, if it beats no overlap by at least
    `margin`. `joined`: the runner's split steps join their experts, so the split mode
    offered is "joined" rather than "dbo" (both are predicted).

    `sbo_chunks` (n) chunks SBO's combine by rows, `sbo_groups` (G) by expert group; at
    most one of them above 1. `group_carries_all`: each group's combine carries all the
    combine's rows (fixed-size slots, a2a_ll), else 1/G of them (expert-major)."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin!r}: must be in [0, 1) (0.01 = 1%).")
    for name, value in (("sbo_chunks", sbo_chunks), ("sbo_groups", sbo_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1.")
    if sbo_chunks > 1 and sbo_groups > 1:
        raise ValueError(f"sbo_chunks={sbo_chunks} and sbo_groups={sbo_groups}: SBO chunks "
                         f"its combine by rows or by expert group, not both; set one to 1.")
    for name, flag in (("group_carries_all", group_carries_all), ("joined", joined)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r}: must be True or False.")
    cal, L = calibration, shape.layers
    f = cal.comm_sm_share if shape.comm_sm_share is None else shape.comm_sm_share
    kappa = cal.overlap_clock
    a, s, x = times.attention / L, times.shared / L, times.experts / L
    d, c = times.dispatch / L, times.combine / L
    lam = min(times.comm_latency, d, c)
    to_ms = 1e-6 / cal.memory_gbs  # bytes -> ms at memory_gbs GB/s
    w_a = shape.attention_weight_bytes / L * to_ms
    w_s = shape.shared_weight_bytes / L * to_ms
    w_e = shape.expert_weight_bytes / L * to_ms
    g = cal.efficiency(shape.rows_per_expert) / cal.efficiency(shape.rows_per_expert / 2)
    launch_ms = cal.launch_us * 1e-3

    def host(k: int) -> float:
        return L * k * launch_ms if shape.kernels_per_layer else 0.0

    k, h = shape.kernels_per_layer, shape.host_ms
    h_dbo = shape.host_dbo_ms or 2 * h
    h_sbo = shape.host_sbo_ms or h
    ov = lambda u, m: _ov(u, m, f=f, kappa=kappa)  # noqa: E731

    def step(gpu: float, host_ms: float) -> float:
        return gpu + host_ms if shape.cuda_graph else max(gpu, host_ms)

    # Graphed: serial (no comm stream, no launch gaps to hide); eager: module docstring.
    tail_none = s + c if shape.cuda_graph else ov(s, c)
    t_none = step(L * (a + x + d + tail_none), max(host(k), h))

    a2, s2, x2 = max(a / 2, w_a), max(s / 2, w_s), max(g * x / 2, w_e)
    d2, c2 = (d - lam) / 2 + lam, (c - lam) / 2 + lam
    exposed = shape.first_dispatch_exposed
    t_joined = step(_joined_gpu(a2, s2, x, d2, c2, L, f=f, kappa=kappa,
                                first_dispatch_exposed=exposed),
                    max(host(2 * k), shape.host_joined_ms or h_dbo))
    if shape.split_compute_ms > 0 and a2 + s2 + x2 > 0:  # measured: take it
        sigma = shape.split_compute_ms / (2 * L * (a2 + s2 + x2))
        a2, s2, x2 = a2 * sigma, s2 * sigma, x2 * sigma
    y2 = x2 + s2
    v2 = s2 + shape.own_row_share * x2
    gpu_dbo = _dbo_gpu(a2, y2, v2, d2, c2, L, f=f, kappa=kappa, first_dispatch_exposed=exposed)
    host_dbo = max(host(2 * k), h_dbo)
    t_dbo = step(gpu_dbo, host_dbo)

    n, o, r = sbo_chunks, shape.own_row_share, shape.rows_per_expert
    x2_split = _split_expert_rate(shape, cal, a2=max(a / 2, w_a), s2=max(s / 2, w_s))

    def sbo_pass(q: float) -> float:  # experts over a share q of the rows
        if x2_split is not None:  # the DBO ubatches' measured experts, at q * r rows
            return max(2 * q * x2_split * cal.efficiency(r / 2) / cal.efficiency(q * r), w_e)
        return max(q * x * cal.efficiency(r) / cal.efficiency(q * r), w_e)

    if sbo_groups > 1:  # by expert group: every row, 1/G of the experts per pass
        G = sbo_groups
        x_g = max(x / G, w_e / G)
        c_g = c if group_carries_all else (c - lam) / G + lam
        t_sbo = step(L * (a + ov(s, d) + x_g + (G - 1) * ov(x_g, c_g) + c_g),
                     max(host(k + G - 1), h_sbo))
    else:
        x_n, x_o = sbo_pass((1.0 - o) / n), (sbo_pass(o) if o > 0 else 0.0)
        c_n = (c - lam) / n + lam
        tail = ov(x_o, c_n) if o > 0 else c_n
        t_sbo = step(L * (a + ov(s, d) + x_n + (n - 1) * ov(x_n, c_n) + tail),
                     max(host(k + n - 1 + (o > 0)), h_sbo))

    costs = {
        "weights_read_twice": 2 * L * (max(0.0, w_a - a / 2) + max(0.0, w_s - s / 2)
                                       + max(x / 2, w_e) - x / 2),
        "half_gemm": 2 * L * (x2 - max(x / 2, w_e)),
        "fill_drain": _fill_drain(a2, y2, v2, d2, c2, ov, exposed),
        "comm_sm_share": gpu_dbo - _dbo_gpu(a2, y2, v2, d2, c2, L, f=0.0, kappa=kappa,
                                            first_dispatch_exposed=exposed),
        "clock": gpu_dbo - _dbo_gpu(a2, y2, v2, d2, c2, L, f=f, kappa=1.0,
                                    first_dispatch_exposed=exposed),
        "launches": host_dbo if shape.cuda_graph else max(0.0, host_dbo - gpu_dbo),
    }
    times_ms = {"none": t_none, "dbo": t_dbo, "sbo": t_sbo, "joined": t_joined}
    chosen, reason = _choose(times_ms, times, costs, margin=margin,
                             split_mode="joined" if joined else "dbo",
                             host_bound=not shape.cuda_graph and max(host(k), h) >= t_none)
    return Prediction(times_ms=times_ms, chosen=chosen, reason=reason, dbo_costs_ms=costs)


def _choose(times_ms: dict[str, float], times: PhaseTimes, costs: dict[str, float], *,
            margin: float, split_mode: str, host_bound: bool) -> tuple[str, str]:
    """The fastest of `split_mode` ("dbo" or "joined") and "sbo" where it beats no
    overlap by `margin`, else "none"; and why."""
    offered = (split_mode, "sbo")
    best = min(offered, key=lambda m: times_ms[m])
    gains = {m: times_ms["none"] / times_ms[m] - 1.0 for m in offered}
    comm = times.dispatch + times.combine
    share = comm / max(comm + times.attention + times.shared + times.experts, 1e-12)
    summary = (f"{split_mode} {gains[split_mode]:+.1%}, sbo {gains['sbo']:+.1%}; comm is "
               f"{share:.0%} of the unsplit GPU time")
    if gains[best] >= margin:
        return best, f"{best}: predicted {gains[best]:+.1%} over no overlap ({summary})"
    if host_bound:
        why = "the step is host-bound (launches)"
    else:
        top = max(costs, key=lambda t: costs[t])
        why = (f"largest DBO cost: {top.replace('_', ' ')} {costs[top]:.3g} ms"
               if costs[top] > 0 else "little comm to hide")
        if gains[split_mode] >= 0 and comm == 0:
            why = "no comm to hide"
    return "none", (f"none: best overlap {best} predicts {gains[best]:+.1%}, below the "
                    f"{margin:.0%} margin ({summary}; {why})")

