"""`dbo plan --calibration FILE`: rescale the plan's roofline phase times by what a
calibration's measured points (`Calibration.points`, written by `dbo bench`) show.

    scale = measured_scale(cal, model, "deepseek-v3-like", decode=True, backend=None,
                           context_len=4096)      # None: no points of that shape
    times = scale.apply(times, tokens=256, comm_regime="nvlink")

For each measured point of the planned preset and phase (decode or prefill; "layer" points
serve both, `serves_phase`), each phase
time's ratio r = measured / roofline, the roofline (`dbo.cli.plan_model.step_inputs`)
evaluated at the point's own shape: its tokens, layers, experts, ranks on one node, the
link it crossed (`MeasuredPoint.regime`) and its KV context. At a planned token count the
ratio is interpolated linearly in the tokens between the two nearest measured points and
held at the nearest one outside them (extrapolated flat), and the plan's roofline phase
time is multiplied by it. What stays roofline:
- attention, from "layer" points (the bench's attention stand-in is not the model's);
- a phase whose measured or roofline time is 0 (e.g. no shared experts);
- dispatch and combine where the points crossed another link than the one that bounds
  the plan's comm (`plan_model.comm_time`), or an unknown one (CPU gloo).
The result stays a prediction: the roofline's growth with the tokens, the EP size and the
cluster, scaled by a ratio measured at other shapes.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Optional

from dbo import Calibration, MeasuredPoint, PhaseTimes
from dbo.cli.plan_model import Cluster, step_inputs

__all__ = ["MeasuredScale", "measured_scale"]

COMPUTE = ("attention", "shared", "experts")
COMM = ("dispatch", "combine")


@dataclass(frozen=True, kw_only=True)
class MeasuredScale:
    """Per phase, the (tokens, measured / roofline) of the points, tokens increasing."""

    ratios: dict[str, tuple[tuple[int, float], ...]]
    """Phase name -> its ratios; a phase absent stays roofline."""
    regime: str
    """The link the points' comm crossed ("" unknown: comm stays roofline)."""
    source: str
    """Which points: backend and token counts."""

    def ratio(self, phase: str, tokens: int) -> Optional[float]:
        """The ratio at `tokens` (module doc), None where the phase stays roofline."""
        known = self.ratios.get(phase)
        if not known:
            return None
        sizes = [t for t, _ in known]
        i = bisect.bisect_left(sizes, tokens)
        if i == 0:
            return known[0][1]
        if i == len(known):
            return known[-1][1]
        (t0, r0), (t1, r1) = known[i - 1], known[i]
        return r0 + (tokens - t0) / (t1 - t0) * (r1 - r0)

    def apply(self, times: PhaseTimes, *, tokens: int, comm_regime: str) -> PhaseTimes:
        """`times` with each phase multiplied by its ratio at `tokens`; dispatch and
        combine only where `comm_regime` (the link that bounds the plan's comm) is the
        points' own."""
        phases = COMPUTE + (COMM if comm_regime == self.regime else ())
        scaled = {p: getattr(times, p) * r for p in phases
                  if (r := self.ratio(p, tokens)) is not None}
        return dataclasses.replace(times, **scaled)

    def describe(self, comm_regime: str) -> str:
        """One line: which phases were rescaled from which points, which stayed roofline."""
        done, kept = [], []
        for phase in COMPUTE + COMM:
            known = self.ratios.get(phase)
            if phase in COMM and known and comm_regime != self.regime:
                kept.append(f"{phase} (points crossed {self.regime}, the plan's comm is "
                            f"bound by {comm_regime})")
            elif known:
                done.append(f"{phase} " + ", ".join(f"x{r:.3g}@{t}" for t, r in known))
            else:
                kept.append(phase)
        return (f"measured rescale ({self.source}; measured/roofline @tokens): "
                f"{'; '.join(done) or 'nothing'}; roofline: {', '.join(kept) or 'nothing'}")


def _point_model(model: object, point: MeasuredPoint) -> object:
    """The planned preset's config with the point's expert count (grouped top-k dropped
    where the groups no longer fit, as the bench does)."""
    moe = model.moe  # type: ignore[attr-defined]
    changes: dict[str, object] = {"num_experts": point.num_experts}
    if moe.n_group is not None and (point.num_experts % moe.n_group
                                    or point.num_experts // moe.n_group * moe.topk_group
                                    < moe.top_k):
        changes.update(n_group=None, topk_group=None)
    return dataclasses.replace(model, moe=dataclasses.replace(moe, **changes))


def _roofline(model: object, point: MeasuredPoint, cal: Calibration, context_len: int
              ) -> PhaseTimes:
    link = cal.regime(point.regime or "nvlink")
    cluster = Cluster(gpus_per_node=point.world_size, ep_size=point.world_size,
                      intra_gbs=link.bandwidth_gbs, intra_latency_us=link.latency_us,
                      inter_gbs=link.bandwidth_gbs, inter_latency_us=link.latency_us)
    times, _ = step_inputs(_point_model(model, point), cluster, cal, tokens=point.tokens,
                           decode=point.decode, context_len=point.context or context_len,
                           layers=point.layers, fp8_dispatch=False, kernels_per_layer=0)
    return times


def serves_phase(point: MeasuredPoint, decode: bool) -> bool:
    """Whether `point` rescales the plan's decode (or prefill) phases. A "layer" point
    serves both: only its MoE phases are used (its attention stand-in is not the
    model's), and those do not depend on the phase, only on the tokens per rank (the
    runner, which sees one token per row and no requests, records it as decode)."""
    return point.mode == "layer" or point.decode == decode


def measured_scale(cal: Calibration, model: object, preset: str, *, decode: bool,
                   backend: Optional[str], context_len: int) -> Optional[MeasuredScale]:
    """The ratios of `cal`'s points of `preset` at this phase (and `backend`, when given),
    or None where it has none (`context_len`: the KV context of points that record
    none, the prefill sequence cap). ValueError when they hold several backends or several
    runs at one token count and `backend` does not pick one."""
    points = [p for p in cal.points if p.preset == preset and serves_phase(p, decode)
              and p.num_experts > 0 and p.world_size > 0
              and (backend is None or p.backend == backend)]
    if not points:
        return None
    backends = sorted({p.backend for p in points})
    phase = "decode" if decode else "prefill"
    if len(backends) > 1:
        raise ValueError(f"--calibration holds {phase} points of {preset} for backends "
                         f"{backends}: pick one with --backend NAME")
    by_tokens: dict[int, MeasuredPoint] = {}
    for p in points:
        if p.tokens in by_tokens:
            raise ValueError(f"--calibration holds two {phase} points of {preset} at "
                             f"{p.tokens} tokens ({by_tokens[p.tokens].label!r}, {p.label!r}): "
                             f"keep one run's points in the file")
        by_tokens[p.tokens] = p
    regimes = {p.regime for p in points}
    regime = regimes.pop() if len(regimes) == 1 else ""
    ratios: dict[str, list[tuple[int, float]]] = {}
    for tokens in sorted(by_tokens):
        p = by_tokens[tokens]
        roof = _roofline(model, p, cal, context_len)
        for name in COMPUTE + COMM:
            if name == "attention" and p.mode == "layer":
                continue
            if name in COMM and (not regime or p.world_size < 2):
                continue
            measured, predicted = getattr(p, name), getattr(roof, name)
            if measured > 0 and predicted > 0:
                ratios.setdefault(name, []).append((tokens, measured / predicted))
    source = f"{backends[0] or 'backend ?'} {phase} points at {sorted(by_tokens)} tokens"
    return MeasuredScale(ratios={k: tuple(v) for k, v in ratios.items()}, regime=regime,
                         source=source)
