"""The overlap mode a step's shape predicts, from a calibration's measured phase times:
what `DBORunner(..., calibration=cal)` runs under `DBOConfig(overlap="auto")` instead of
the token thresholds, with no trial steps (the choice itself: `dbo.mode_policy`).

    predictor = OverlapPredictor(Calibration.load("dbo_out/bench/calibration.json")
                                 .select(backend="a2a"))
    p = predictor.predict(tokens=4096, decode=False)   # None: the shape is not covered
    p.chosen, p.reason                                 # "dbo" | "sbo" | "none", one line

A shape (tokens per rank, decode or not) is covered where the calibration has a point of
that phase at those tokens, or one on each side: then every phase time, the rows per
expert and the weight bytes are interpolated linearly in the tokens between the two
nearest (the measured times grow about linearly with the tokens between sweep points;
outside the measured range nothing is extrapolated). No MoE: the runtime core's. A
runner votes a digest of its calibration (`dbo.step_vote.calibration_digest`): ranks
predicting from different ones would run different modes, and so different collectives.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

from dbo.calibration import Calibration, MeasuredPoint
from dbo.cost_model import PhaseTimes, Prediction, StepShape, predict

__all__ = ["OverlapPredictor", "covering_point", "point_inputs"]

# The fields of a MeasuredPoint that scale with the step's tokens.
_SCALED = ("attention", "experts", "dispatch", "combine", "shared", "comm_latency",
           "rows_per_expert", "expert_weight_bytes", "attention_weight_bytes",
           "shared_weight_bytes", "host_ms", "host_dbo_ms", "host_sbo_ms", "host_joined_ms",
           "split_compute")


def point_inputs(point: MeasuredPoint, calibration: Optional[Calibration] = None
                 ) -> tuple[PhaseTimes, StepShape]:
    """The cost model's inputs at a measured point (no launch cost: the measured phase
    times already hold the launches of an unsplit step; the measured host times of the
    unsplit, DBO and SBO steps as their host floors, or under CUDA graphs as the host
    time before each replay). With `calibration`, the comm kernels' SM share of the
    point's backend and link (`Calibration.comm_sm_share_for`)."""
    share = (None if calibration is None
             else calibration.comm_sm_share_for(point.backend, point.regime))
    times = PhaseTimes(attention=point.attention, experts=point.experts,
                       dispatch=point.dispatch, combine=point.combine, shared=point.shared,
                       comm_latency=point.comm_latency)
    shape = StepShape(layers=point.layers, tokens=point.tokens,
                      rows_per_expert=point.rows_per_expert,
                      expert_weight_bytes=point.expert_weight_bytes,
                      attention_weight_bytes=point.attention_weight_bytes,
                      shared_weight_bytes=point.shared_weight_bytes, host_ms=point.host_ms,
                      host_dbo_ms=point.host_dbo_ms, host_sbo_ms=point.host_sbo_ms,
                      host_joined_ms=point.host_joined_ms,
                      cuda_graph=point.cuda_graph,
                      comm_sm_share=share, own_row_share=point.own_row_share,
                      split_compute_ms=point.split_compute)
    return times, shape


def check_one_per_shape(calibration: Calibration) -> None:
    """ValueError when two points share a shape (e.g. one per backend): a runner's
    calibration must hold one point per (tokens, decode)."""
    seen: dict[tuple[int, bool], MeasuredPoint] = {}
    for point in calibration.points:
        key = (point.tokens, point.decode)
        if key in seen:
            backends = sorted({seen[key].backend or "?", point.backend or "?"})
            raise ValueError(
                f"the calibration holds several points at {point.tokens} "
                f"{'decode' if point.decode else 'prefill'} tokens (backends {backends}): "
                f"pass one backend's, calibration.select(backend=...)")
        seen[key] = point


def covering_point(calibration: Calibration, *, tokens: int, decode: bool
                   ) -> Optional[MeasuredPoint]:
    """The measured point at `tokens`, or one interpolated between the nearest measured
    points on either side (same phase, same layers); None when not covered."""
    points = sorted((p for p in calibration.points if p.decode == decode),
                    key=lambda p: p.tokens)
    sizes = [p.tokens for p in points]
    i = bisect.bisect_left(sizes, tokens)
    if i < len(points) and sizes[i] == tokens:
        return points[i]
    if i == 0 or i == len(points) or points[i - 1].layers != points[i].layers:
        return None
    lo, hi = points[i - 1], points[i]
    t = (tokens - lo.tokens) / (hi.tokens - lo.tokens)
    mixed = {name: getattr(lo, name) + t * (getattr(hi, name) - getattr(lo, name))
             for name in _SCALED}
    # A figure measured at one end only is not known in between.
    mixed["split_compute"] = (mixed["split_compute"] if lo.split_compute > 0
                              and hi.split_compute > 0 else 0.0)
    return dataclasses.replace(lo, tokens=tokens, measured_ms={},
                               label=f"interpolated between {lo.tokens} and {hi.tokens}",
                               **mixed)


class OverlapPredictor:
    """`predict(tokens=, decode=)`: the cost model's prediction at a covered shape (cached
    per shape), else None.

    Args:
        calibration: machine figures and measured points, one per shape.
        margin: an overlap mode must be predicted to win by this much (0.01 = 1%).
        sbo_chunks: combine chunks (by rows) of a single-batch-overlap step
            (`dbo.cost_model`).
        sbo_groups: combine groups (by expert group) of a single-batch-overlap step.
            Both None: each measured point's own (`MeasuredPoint.sbo_chunks`,
            `MeasuredPoint.sbo_groups`); one given: that one, the other 1 (at most one
            above 1).
        joined: the runner's split steps join their experts (`DBOConfig.joined_experts`):
            the split mode predicted and offered is "joined", not "dbo".
    """

    def __init__(self, calibration: Calibration, *, margin: float = 0.01,
                 sbo_chunks: Optional[int] = None, sbo_groups: Optional[int] = None,
                 joined: bool = False) -> None:
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a dbo.Calibration, got a "
                            f"{type(calibration).__name__}: load one with "
                            f"Calibration.load(path)")
        for name, value in (("sbo_chunks", sbo_chunks), ("sbo_groups", sbo_groups)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"OverlapPredictor({name}={value!r}): must be None (each "
                                 f"point's own) or an int >= 1.")
        if (sbo_chunks or 1) > 1 and (sbo_groups or 1) > 1:
            raise ValueError(f"OverlapPredictor(sbo_chunks={sbo_chunks}, sbo_groups="
                             f"{sbo_groups}): SBO chunks its combine by rows or by expert "
                             f"group, not both; set one to 1.")
        check_one_per_shape(calibration)
        self.calibration = calibration
        self.margin = margin
        self.sbo_chunks = sbo_chunks
        self.sbo_groups = sbo_groups
        self.joined = joined
        self._cache: dict[tuple[int, bool], Optional[Prediction]] = {}

    def predict(self, *, tokens: int, decode: bool) -> Optional[Prediction]:
        key = (tokens, decode)
        if key not in self._cache:
            point = covering_point(self.calibration, tokens=tokens, decode=decode)
            self._cache[key] = None if point is None else predict(
                *point_inputs(point, self.calibration), self.calibration, margin=self.margin,
                joined=self.joined, **self._sbo_form(point))
        return self._cache[key]

    def _sbo_form(self, point: MeasuredPoint) -> dict[str, int]:
        """The SBO step's combine form at `point`: the predictor's, else the point's."""
        if self.sbo_chunks is None and self.sbo_groups is None:
            return {"sbo_chunks": point.sbo_chunks, "sbo_groups": point.sbo_groups}
        return {"sbo_chunks": self.sbo_chunks or 1, "sbo_groups": self.sbo_groups or 1}
