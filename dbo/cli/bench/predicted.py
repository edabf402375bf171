"""The bench's cost-model side: each point's predicted step times beside the measured ones,
the gate's choice from a calibration (no trial steps), and the calibration file.

    cal = bench_calibration(cfg)                     # --calibration FILE, or the defaults
    prediction = covered(cal, backend="a2a", tokens=1024, decode=False)   # None: trials
    attach_prediction(point, measured_point, cal)    # point.t_dbo_pred_ms, pred_err_dbo, ...
    write_calibration(result, cal, path)             # <out>/calibration.json (rank 0)

The prediction at a point is the cost model's (`dbo.cost_model.predict`) on the phase
times measured at that same point (`dbo.cli.bench.phases`) with the machine figures of
the calibration: what `dbo plan` and a runner with a calibration would predict there.
pred_err = predicted / measured - 1, for each mode timed at the point (no overlap, DBO,
SBO, and DBO with joined experts where the cost model predicts it: `Prediction.times_ms`
with a "joined" entry; without one the point's joined prediction stays empty). The
point's host times go in with its phases (`dbo.cli.bench.sweep`): for a backend that never
waits on the device, each mode's measured issue time is its floor (eager) or adds to its
GPU time (CUDA graphs: the runner's vote before the replay); the joined step's host time
is reported but not passed in (`MeasuredPoint` has no field for it).
"""
from __future__ import annotations

import dataclasses
import datetime
import platform
from pathlib import Path
from typing import Any, Optional

import torch

from dbo import Calibration, MeasuredPoint, OverlapPredictor, Prediction, point_inputs, predict
from dbo.cli.bench.config import EMULATED_REGIME, NVLINK_REGIME

CALIBRATION_FILE = "calibration.json"
PREDICTION_NOTE = ("pred: the cost model (dbo.cost_model) on this point's measured phase "
                   "times (dispatch, combine replayed alone; attention, shared, experts timed "
                   "by hooks in the compute-alone step; under --cuda-graph both scaled to the "
                   "probe's graphed compute alone and comm alone, compute_scale and "
                   "comm_scale in calibration.json); pred_err = predicted / measured - 1")


def bench_calibration(path: Optional[str]) -> Calibration:
    """The calibration the bench predicts with: `path` (--calibration), else the
    illustrative defaults."""
    return Calibration.load(path) if path else Calibration.illustrative_h100()


def covered(calibration: Calibration, *, backend: str, tokens: int, decode: bool
            ) -> Optional[Prediction]:
    """The prediction at this point where the calibration's points of `backend` cover
    it (measured there, or on both sides), else None (the gate then runs its trials)."""
    own = calibration.select(backend=backend)
    if not own.points:
        return None
    return OverlapPredictor(own).predict(tokens=tokens, decode=decode)


def attach_prediction(point: Any, measured: MeasuredPoint, calibration: Calibration) -> None:
    """Set the point's predicted step times, speedup, choice and errors (`point.Point`)."""
    if point.t_split_ms:  # the probe measured the DBO step's compute alone
        measured = dataclasses.replace(measured, split_compute=point.t_split_ms)
    prediction = predict(*point_inputs(measured, calibration), calibration,
                         sbo_chunks=measured.sbo_chunks, sbo_groups=measured.sbo_groups)
    times = prediction.times_ms
    point.phase_ms = {k: getattr(measured, k)
                      for k in ("attention", "shared", "experts", "dispatch", "combine")}
    point.t_nodbo_pred_ms, point.t_dbo_pred_ms = times["none"], times["dbo"]
    point.t_sbo_pred_ms = times["sbo"]
    point.t_joined_pred_ms = times.get("joined")
    point.speedup_pred = times["none"] / times["dbo"]
    point.pred_choice = prediction.chosen
    point.pred_err_nodbo = times["none"] / point.t_nodbo_ms - 1.0
    measured_ms = {"none": point.t_nodbo_ms, "dbo": point.t_dbo_ms, "sbo": point.t_sbo_ms,
                   "joined": point.t_joined_ms}
    measured_ms = {mode: ms for mode, ms in measured_ms.items() if ms is not None}
    if "dbo" in measured_ms:
        point.pred_err_dbo = times["dbo"] / measured_ms["dbo"] - 1.0
    if "sbo" in measured_ms:
        point.pred_err_sbo = times["sbo"] / measured_ms["sbo"] - 1.0
    if "joined" in measured_ms and "joined" in times:
        point.pred_err_joined = times["joined"] / measured_ms["joined"] - 1.0
    point.measured_point = dataclasses.replace(measured, measured_ms=measured_ms)


def bench_shape(point: MeasuredPoint, cfg: Any, *, num_experts: int, world_size: int
                ) -> MeasuredPoint:
    """`point` with the shape of the run that measured it (`cfg`: a `BenchConfig`), so
    that `dbo plan` can evaluate its roofline at that shape."""
    regime = {NVLINK_REGIME: "nvlink", EMULATED_REGIME: "scale_out"}.get(cfg.regime, "")
    return dataclasses.replace(point, preset=cfg.preset, mode=cfg.mode,
                               num_experts=num_experts, world_size=world_size, regime=regime,
                               context=cfg.context if cfg.mode == "decode" else 0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def write_calibration(result: Any, path: str) -> str:
    """Write the calibration file of a sweep (`sweep.SweepResult`): the machine figures it
    predicted with (--calibration, else the defaults), the measured phase times of every
    point, the device, torch version and date; returns the path."""
    cfg = result.config
    measured = tuple(p.measured_point for p in result.points if p.measured_point is not None)
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    out = dataclasses.replace(bench_calibration(cfg.calibration), points=measured,
                              device=device_name(torch.device(cfg.device)),
                              torch_version=torch.__version__, date=now.isoformat())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    out.save(path)
    return path


def prediction_lines(result: Any) -> list[str]:
    """The table's block of predicted beside measured step times, one line per point:
    no overlap, DBO, SBO and joined, each with its error where that mode was timed ("-"
    where not; joined's prediction "-" too where the cost model makes none)."""
    functional = result.config.functional
    lines = ["predicted (cost model on each point's measured phase times; pred_err = "
             "predicted / measured - 1):",
             f"  {'T/rank':>6} {'backend':>7} {'noDBO pred':>10} {'err':>7} {'DBO pred':>9} "
             f"{'err':>7} {'SBO pred':>9} {'err':>7} {'joined pred':>11} {'err':>7} "
             f"{'pred x':>6} {'meas x':>6} {'pred':>6}  phases att/sh/exp/disp/comb ms"]
    if functional:
        lines.insert(1, "  (CPU: the model assumes comm overlaps compute, which gloo never does)")
    for p in result.points:
        if p.t_nodbo_pred_ms is None:
            if p.probe_note:  # no phase times were measured: say so, predict nothing
                lines.append(f"  {p.tokens_per_rank:>6} {p.backend:>7} {'-':>10} {'-':>7} "
                             f"{'-':>9} {'-':>7} {'-':>9} {'-':>7} {'-':>11} {'-':>7} "
                             f"{'-':>6} {'-':>6} {'-':>6}  no prediction: its phases were not "
                             f"measured (probe note above)")
            continue
        measured = "-" if functional or p.speedup is None else f"{p.speedup:.3f}"
        phases = "/".join(f"{p.phase_ms[k]:.3g}"
                          for k in ("attention", "shared", "experts", "dispatch", "combine"))
        mp = p.measured_point
        if mp is not None and mp.cuda_graph:  # eager phases scaled to the graphed step
            phases += f" (eager x{mp.compute_scale:.3g} compute, x{mp.comm_scale:.3g} comm)"
        err_dbo, err_sbo, err_joined = (_err(e) for e in (p.pred_err_dbo, p.pred_err_sbo,
                                                          p.pred_err_joined))
        joined = "-" if p.t_joined_pred_ms is None else f"{p.t_joined_pred_ms:.3f}"
        lines.append(f"  {p.tokens_per_rank:>6} {p.backend:>7} {p.t_nodbo_pred_ms:>10.3f} "
                     f"{p.pred_err_nodbo:>+7.1%} {p.t_dbo_pred_ms:>9.3f} {err_dbo:>7} "
                     f"{p.t_sbo_pred_ms:>9.3f} {err_sbo:>7} {joined:>11} {err_joined:>7} "
                     f"{p.speedup_pred:>6.3f} {measured:>6} {p.pred_choice:>6}  {phases}")
    return lines


def _err(err: Optional[float]) -> str:
    """A prediction's error, "-" where the mode was not timed."""
    return "-" if err is None else f"{err:+.1%}"
