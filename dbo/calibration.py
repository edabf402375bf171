"""`Calibration`: the machine figures the cost model (`dbo.cost_model`) reads, with JSON
load and save.

    cal = Calibration.illustrative_h100()
    cal.save("cal.json"); Calibration.load("cal.json") == cal

The defaults are ILLUSTRATIVE figures for an H100/H200, not a measurement of the machine
at hand; each field's doc says where its default comes from (a measurement on 2x H200,
BENCHMARKS.md, DeepEP's own tests, or a public spec sheet). `dbo bench` writes a
calibration file of the machine it ran on (`<out>/calibration.json`): the same figures
plus `points`, the per-phase times it measured at each shape (`MeasuredPoint`), and the
device, torch version and date.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from dbo.calibration_fields import (FieldError, build_checked, check_int, check_keys, check_str,
                                    finite_positive, in_range, show)

__all__ = ["Calibration", "CommRegime", "MeasuredPoint"]


@dataclass(frozen=True, kw_only=True)
class CommRegime:
    """One kind of link: bandwidth per GPU and the fixed latency of one collective."""

    bandwidth_gbs: float
    """Achieved bytes per second per GPU, in GB/s (1e9 bytes)."""
    latency_us: float
    """Fixed cost of one dispatch or combine collective, in us (does not shrink with
    the batch)."""

    def __post_init__(self) -> None:
        if not finite_positive(self.bandwidth_gbs):
            raise FieldError("CommRegime", "bandwidth_gbs", self.bandwidth_gbs,
                              "must be a finite number > 0 (GB/s per GPU).")
        if not in_range(self.latency_us, 0.0, math.inf):
            raise FieldError("CommRegime", "latency_us", self.latency_us,
                              "must be a finite number >= 0 (us per collective).")


@dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    """Per-phase times of one whole unsplit step on one rank at one shape, measured (ms,
    all layers; `dbo.cost_model.PhaseTimes`), with what the cost model needs of the shape
    (`StepShape`) and the step times measured beside them."""

    tokens: int
    """Tokens per rank in the step."""
    decode: bool
    """The runner planned the step as decode (every request one token, or "tokens" split)."""
    layers: int
    """MoE layers in the step."""
    attention: float
    """Compute outside the MoE layers, plus the router (what the dispatch needs)."""
    experts: float
    """The MoE layers' compute less router and shared experts: routed experts, packing."""
    dispatch: float
    """The step's dispatch collectives replayed alone."""
    combine: float
    """The step's combine collectives replayed alone."""
    shared: float = 0.0
    """Shared-expert compute."""
    comm_latency: float = 0.0
    """Fixed part of one collective, ms (not measured by the bench: the regime's figure)."""
    rows_per_expert: float = 1.0
    """Rows each local expert's GEMM gets in the unsplit step."""
    expert_weight_bytes: float = 0.0
    """Routed-expert weight bytes of this rank, all layers."""
    attention_weight_bytes: float = 0.0
    """Weight bytes outside the MoE layers (embeddings left out), all layers."""
    shared_weight_bytes: float = 0.0
    """Shared-expert weight bytes, all layers."""
    backend: str = ""
    """The MoE backend it ran ("" unknown)."""
    label: str = ""
    """Where it comes from, e.g. "bench layer tiny w2 CPU gloo"."""
    measured_ms: dict[str, float] = field(default_factory=dict)
    """Step times measured here: "none" (DBO off), "dbo" (DBO on), "sbo" (single-batch overlap)."""
    cuda_graph: bool = False
    """The step times are of CUDA-graph replays, and the phase times were brought to that
    mode: the hook-timed (eager) attention, shared and experts multiplied by
    `compute_scale`, the eagerly replayed dispatch and combine by `comm_scale`."""
    compute_scale: float = 1.0
    """Graphed compute-alone step / sum of the eager compute phases (1.0: not rescaled)."""
    comm_scale: float = 1.0
    """Graphed comm-alone replay / eager dispatch + combine (1.0: not rescaled)."""
    preset: str = ""
    """The model shape the bench ran (`moe.models.presets` name; "" unknown: `dbo plan`
    does not use the point)."""
    mode: str = ""
    """The bench's --mode: "layer" (an attention stand-in), "decode" or "model"."""
    num_experts: int = 0
    """Routed experts over all ranks (0 unknown)."""
    world_size: int = 0
    """Ranks of the run (0 unknown)."""
    regime: str = ""
    """The link its collectives crossed, a `Calibration.regimes` name ("nvlink",
    "scale_out"; "" unknown or CPU gloo)."""
    context: int = 0
    """Decode: KV-cache tokens per request (0 otherwise)."""
    host_ms: float = 0.0
    """The host's time to issue the unsplit step (call to return), ms; 0: not measured,
    or not an issue time (a backend that reads device values on the host waits for the
    device inside it). Under `cuda_graph`, the host's time before and around the replay
    (no layer's Python runs), which the GPU waits for."""
    host_dbo_ms: float = 0.0
    """The same for the DBO step (the runner's vote, the scheduler, every layer's Python
    once per ubatch); 0: not measured (the model then takes 2 * host_ms)."""
    host_sbo_ms: float = 0.0
    """The same for the single-batch-overlap step (the runner's vote, the own-rows
    pass); 0: not measured (the model then takes host_ms)."""
    host_joined_ms: float = 0.0
    """The same for the joined DBO step (`DBOConfig.joined_experts`); 0: not measured
    (the model then takes host_dbo_ms)."""
    split_compute: float = 0.0
    """The DBO step's compute alone, ms: the probe's split compute (the step with its
    collectives replaced by their recorded results; graphed where the steps were); 0:
    not measured. The model then takes the two ubatches' compute from it."""
    sbo_chunks: int = 1
    """Chunks of the combine in the point's single-batch-overlap step
    (`A2ALLOptions.combine_chunks` where the backend chunks its combine, else 1)."""
    sbo_groups: int = 1
    """Expert groups of the point's single-batch-overlap step, each group's combine sent
    while the next group's experts run (`A2ALLOptions.combine_groups` where the backend
    groups its combine, else 1); at most one of `sbo_chunks` and `sbo_groups` above 1."""
    own_row_share: float = 0.0
    """Share of the received rows this rank sent itself, computed last in an SBO step
    and in a DBO step's last MoE layer, under the combine (1/W where the backend splits
    its combine and the layer does; 0 otherwise)."""

    def __post_init__(self) -> None:
        owner = "MeasuredPoint"
        for name, low in (("tokens", 1), ("layers", 1), ("num_experts", 0), ("world_size", 0),
                          ("context", 0), ("sbo_chunks", 1), ("sbo_groups", 1)):
            check_int(owner, name, getattr(self, name), low)
        if self.sbo_chunks > 1 and self.sbo_groups > 1:
            raise FieldError(owner, "sbo_groups", self.sbo_groups,
                             f"must be 1 where sbo_chunks={self.sbo_chunks} (an SBO step "
                             f"chunks its combine by rows or by expert group, not both).")
        for name in ("decode", "cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(owner, name, getattr(self, name), "must be True or False.")
        for name in ("backend", "label", "preset", "mode", "regime"):
            check_str(owner, name, getattr(self, name))
        if not isinstance(self.measured_ms, dict):
            raise FieldError(owner, "measured_ms", self.measured_ms,
                              'must be an object of step times, ms ({"none": ..., "dbo": ..., '
                              '"sbo": ...}).')
        values = {name: getattr(self, name) for name in (
            "attention", "experts", "dispatch", "combine", "shared", "comm_latency",
            "expert_weight_bytes", "attention_weight_bytes", "shared_weight_bytes", "host_ms",
            "host_dbo_ms", "host_sbo_ms", "host_joined_ms", "split_compute")}
        values.update({f"measured_ms[{k!r}]": v for k, v in self.measured_ms.items()})
        for name, value in values.items():
            if not in_range(value, 0.0, math.inf):
                raise FieldError(owner, name, value, "must be a finite number >= 0 (ms, or "
                                                      "bytes).")
        for name in ("compute_scale", "comm_scale"):
            if not finite_positive(getattr(self, name)):
                raise FieldError(owner, name, getattr(self, name),
                                  "must be a finite number > 0 (1.0: not rescaled).")
        if not in_range(self.own_row_share, 0.0, 1.0, high_open=True):
            raise FieldError(owner, "own_row_share", self.own_row_share,
                              "must be in [0, 1) (1/W with an own-rows pass, else 0).")
        if not finite_positive(self.rows_per_expert):
            raise FieldError(owner, "rows_per_expert", self.rows_per_expert,
                              "must be a finite number > 0.")


def _default_efficiency() -> tuple[tuple[float, float], ...]:
    # Grouped-GEMM rate as a fraction of `dense_tflops`, against rows per expert.
    # 256 -> 0.72 and 1024 -> 0.81 and 4096 -> 0.94: BENCHMARKS.md section 2, H200
    # (ds-e128@4096, mean of ds-e32@4096 and ds-e128@16384, ds-e8@4096, "of dense").
    # 16 and 64 are illustrative guesses: there the weight read bounds the time anyway.
    return ((16.0, 0.15), (64.0, 0.40), (256.0, 0.72), (1024.0, 0.81), (4096.0, 0.94))


def _default_regimes() -> dict[str, CommRegime]:
    # nvlink: all_to_all_single at 379-446 GB/s on 2x H200 (measured, torch 2.11, NCCL 2.28);
    # scale_out: host-staged NCCL at ~46 GB/s, about one 400 Gb/s NIC per GPU
    # (measured there with NCCL_P2P_DISABLE=1; BENCHMARKS.md "scale-out emulated").
    # Latencies are illustrative: DeepEP's low-latency dispatch send is 21 us on NVLink
    # (DeepEP's own tests, measured on 2x H100).
    return {"nvlink": CommRegime(bandwidth_gbs=400.0, latency_us=20.0),
            "scale_out": CommRegime(bandwidth_gbs=46.0, latency_us=30.0)}


def _default_comm_sm_shares() -> dict[str, float]:
    # SMs the comm kernels' grids hold, over an H100/H200's 132: NCCL's all_to_all_single
    # (a2a, a2a_ll) on 32 CTAs over NVLink (BENCHMARKS.md section 11, "SMs d/c") and on
    # 4 CTAs scale-out emulated (`streams.gemm_carveout`, BENCHMARKS.md section 3).
    return {"a2a/nvlink": 32 / 132, "a2a_ll/nvlink": 32 / 132,
            "a2a/scale_out": 4 / 132, "a2a_ll/scale_out": 4 / 132}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Machine figures for `dbo.cost_model` (illustrative H100/H200 defaults)."""

    dense_tflops: float = 700.0
    """Sustained dense bf16 GEMM rate, TFLOP/s: the expert-sized GEMM chain ran at
    635-728 TFLOP/s on an H200 at its power cap (measured)."""
    gemm_efficiency: tuple[tuple[float, float], ...] = field(default_factory=_default_efficiency)
    """(rows per expert, fraction of dense_tflops) points, rows increasing; read by
    log-linear interpolation, clamped at both ends."""
    memory_gbs: float = 3000.0
    """HBM bandwidth achieved by a weight read, GB/s: illustrative, ~90% of the H100
    SXM's 3.35 TB/s spec (H200: 4.8 TB/s spec)."""
    launch_us: float = 5.0
    """Host cost of one eager kernel launch, us: illustrative; BENCHMARKS.md's host
    bench puts one fused-MoE call (several launches) at 492 us of host time."""
    comm_sm_share: float = 0.18
    """Fraction of the SMs the comm kernels hold while they run: DeepEP's normal kernels
    on 24 of an H100's 132 SMs (DeepEP's own tests). Where `comm_sm_shares` names the
    point's backend and link, that figure is used instead."""
    comm_sm_shares: dict[str, float] = field(default_factory=_default_comm_sm_shares)
    """Fraction of the SMs the comm kernels hold, per "<backend>/<regime>" (e.g.
    "a2a_ll/scale_out"): how many SMs a backend's kernels take depends on both."""
    overlap_clock: float = 1.0
    """SM clock during overlapped compute, as a fraction of the clock in the measured
    phase times (< 1 where concurrent comm pushes a power-capped GPU lower); 1.0 = not
    measured (BENCHMARKS.md: both GPUs run at their 700 W cap either way)."""
    persistent_min_rows: float = 512.0
    """Rows per expert of the unsplit step from which its expert GEMMs run the persistent
    kernel (`moe.kernels.fused_moe.rules`: PERSISTENT_GEMM1_MIN_ROWS, PERSISTENT_GEMM2_MIN_ROWS),
    which a step whose comm shares the SMs (DBO, SBO) never runs. The phase times and
    `gemm_efficiency` come from unsplit steps, so from there on the cost model takes
    SBO's expert passes at the rate the probe measured for the DBO step's experts (the
    same kernels at half the rows: `MeasuredPoint.split_compute`) instead of the curve."""
    regimes: dict[str, CommRegime] = field(default_factory=_default_regimes)
    """Link kinds by name (e.g. "nvlink", "scale_out")."""
    points: tuple[MeasuredPoint, ...] = ()
    """Per-phase times measured at each shape (`dbo bench`); empty: none measured."""
    device: str = ""
    """The device the points were measured on ("" for the illustrative figures)."""
    torch_version: str = ""
    """torch.__version__ of the run that measured the points."""
    date: str = ""
    """When the points were measured (ISO 8601, UTC)."""

    def __post_init__(self) -> None:
        owner = "Calibration"
        for name in ("dense_tflops", "memory_gbs"):
            if not finite_positive(getattr(self, name)):
                raise FieldError(owner, name, getattr(self, name), "must be a finite number > 0.")
        if not in_range(self.launch_us, 0.0, math.inf):
            raise FieldError(owner, "launch_us", self.launch_us,
                              "must be a finite number >= 0 (us per launch).")
        if not in_range(self.comm_sm_share, 0.0, 1.0, high_open=True):
            raise FieldError(owner, "comm_sm_share", self.comm_sm_share,
                              "must be in [0, 1) (the fraction of SMs the comm kernels hold).")
        shares = self.comm_sm_shares
        if not isinstance(shares, dict) or not all(
                isinstance(k, str) and in_range(v, 0.0, 1.0, high_open=True)
                for k, v in shares.items()):
            raise FieldError(owner, "comm_sm_shares", shares,
                              'must map "<backend>/<regime>" to a fraction in [0, 1).')
        if not finite_positive(self.persistent_min_rows):
            raise FieldError(owner, "persistent_min_rows", self.persistent_min_rows,
                              "must be a finite number > 0 (rows per expert).")
        if not in_range(self.overlap_clock, 0.0, 1.0, low_open=True):
            raise FieldError(owner, "overlap_clock", self.overlap_clock,
                              "must be a finite number in (0, 1] (1.0 = no clock drop "
                              "measured).")
        points = self.gemm_efficiency
        if (not isinstance(points, (list, tuple)) or not points
                or any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in points)):
            raise FieldError(owner, "gemm_efficiency", points,
                              "must be a non-empty list of (rows per expert, efficiency) pairs.")
        rows = [p[0] for p in points]
        if any(not finite_positive(r) for r in rows) or rows != sorted(set(rows)):
            raise FieldError(owner, "gemm_efficiency", points,
                              "its rows per expert must be finite, > 0 and strictly increasing.")
        if any(not in_range(p[1], 0.0, 1.0, low_open=True) for p in points):
            raise FieldError(owner, "gemm_efficiency", points,
                              "every efficiency must be in (0, 1].")
        if (not isinstance(self.regimes, dict) or not self.regimes
                or not all(isinstance(r, CommRegime) for r in self.regimes.values())):
            raise FieldError(owner, "regimes", self.regimes, "must map names to CommRegime.")
        if not isinstance(self.points, (list, tuple)):
            raise FieldError(owner, "points", self.points, "must be a list of MeasuredPoint.")
        object.__setattr__(self, "points", tuple(self.points))
        if not all(isinstance(p, MeasuredPoint) for p in self.points):
            raise ValueError("Calibration.points: must hold MeasuredPoint values.")
        for name in ("device", "torch_version", "date"):
            check_str(owner, name, getattr(self, name))

    def select(self, **where: Any) -> "Calibration":
        """This calibration with only the points whose fields equal `where`, e.g.
        `select(backend="a2a")` (a runner takes one point per shape)."""
        names = {f.name for f in dataclasses.fields(MeasuredPoint)}
        unknown = sorted(set(where) - names)
        if unknown:
            raise ValueError(f"Calibration.select: unknown fields {unknown}; known: "
                             f"{sorted(names)}")
        kept = tuple(p for p in self.points
                     if all(getattr(p, k) == v for k, v in where.items()))
        return dataclasses.replace(self, points=kept)

    @classmethod
    def illustrative_h100(cls) -> "Calibration":
        """The defaults: illustrative H100/H200 figures, not a measurement."""
        return cls()

    def efficiency(self, rows_per_expert: float) -> float:
        """Fraction of `dense_tflops` a grouped GEMM reaches at `rows_per_expert`."""
        points = self.gemm_efficiency
        if rows_per_expert <= points[0][0]:
            return points[0][1]
        for (r0, e0), (r1, e1) in zip(points, points[1:]):
            if rows_per_expert <= r1:
                t = math.log(rows_per_expert / r0) / math.log(r1 / r0)
                return e0 + t * (e1 - e0)
        return points[-1][1]

    def comm_sm_share_for(self, backend: str, regime: str) -> float:
        """The comm kernels' SM share of `backend` over the link `regime`
        (`comm_sm_shares`), else `comm_sm_share`."""
        return self.comm_sm_shares.get(f"{backend}/{regime}", self.comm_sm_share)

    def regime(self, name: str) -> CommRegime:
        """The link kind `name` (ValueError naming the known ones)."""
        if name not in self.regimes:
            raise ValueError(f"comm regime {name!r}: not in the calibration; known: "
                             f"{sorted(self.regimes)}")
        return self.regimes[name]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gemm_efficiency"] = [list(p) for p in self.gemm_efficiency]
        out["points"] = [dataclasses.asdict(p) for p in self.points]
        return out

    @classmethod
    def from_json(cls, data: Any) -> "Calibration":
        """A calibration from its JSON form; unknown keys and bad values raise ValueError
        naming the field, a point by its index ("points[3].tokens=...: must be ...")."""
        if not isinstance(data, dict):
            raise ValueError(f"calibration JSON must be an object, got {type(data).__name__}")
        kwargs = dict(data)
        check_keys(cls, kwargs, where="calibration JSON")
        if "gemm_efficiency" in kwargs:
            pairs = kwargs["gemm_efficiency"]
            if not isinstance(pairs, list) or not all(isinstance(p, list) for p in pairs):
                raise ValueError(f"gemm_efficiency={show(pairs)}: must be a list of [rows per "
                                 f"expert, efficiency] pairs")
            kwargs["gemm_efficiency"] = tuple(tuple(p) for p in pairs)
        if "regimes" in kwargs:
            regimes = kwargs["regimes"]
            if not isinstance(regimes, dict) or not all(isinstance(r, dict)
                                                        for r in regimes.values()):
                raise ValueError(f"regimes={show(regimes)}: must map names to "
                                 f"{{bandwidth_gbs, latency_us}}")
            kwargs["regimes"] = {k: build_checked(CommRegime, v, owner=f"regimes[{k!r}]")
                                 for k, v in regimes.items()}
        if "points" in kwargs:
            points = kwargs["points"]
            if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
                raise ValueError(f"points={show(points)}: must be a list of objects")
            kwargs["points"] = tuple(build_checked(MeasuredPoint, p, owner=f"points[{i}]")
                                     for i, p in enumerate(points))
        return cls(**kwargs)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Calibration":
        """Read a calibration file. ValueError, one line naming the file, the field and
        what it must be, for anything else than what `save` writes."""
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"calibration file {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"calibration file {path}: not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start}): write it with Calibration.save") from None
        except RecursionError:
            raise ValueError(f"calibration file {path}: its JSON is nested too deeply to "
                             f"read: write it with Calibration.save") from None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"calibration file {path}: {exc}") from None
