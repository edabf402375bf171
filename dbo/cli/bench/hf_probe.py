"""The ceiling probe of `dbo bench --hf` prefill points (`dbo.cli.bench.hf_sweep`): the
layer bench's probe (`dbo.cli.bench.ceiling`) run on the converted model.

    probe = probe_hf_point(model, inputs, tokens=4096, runner=graphed or runner,
                           device=device, group=group, warmup=5, iters=20, cuda_graph=True,
                           gemm_sm_carveout=4)
    probe.fields(t_nodbo_ms=..., t_dbo_ms=..., perf=True)   # HFPoint's probe fields

After a point's rounds of DBO off and on, once per point: compute alone (the DBO-off
step with its collectives replaced by their recorded results), comm alone (the recorded
collectives replayed) and both on two CUDA streams (`probe_ceiling`), then the DBO-on
step's compute alone (`probe_split_compute`), each timed as the point's steps are (with
`cuda_graph` captured and replayed). A converted model's MoE layers are `moe.layer.
MoELayer`s inside `moe.hf.block.HFMoEBlock`s, which is all the probe hooks into.
Not measured (fields None, `note` says why): on CPU (gloo runs each collective on the
calling thread: no streams to overlap), and for a backend whose exchange is not made of
torch.distributed collectives (`dbo.cli.bench.probe_scope`: symm_mem, DeepEP's); the gate
(`dbo.cli.bench.hf_gate`) then skips its probe rule and says why (`no_probe_reason`).
ceiling and eta are the layer bench's (`dbo.cli.bench.point`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from dbo import DBORunner, GraphedRunner
from dbo.cli.bench.ceiling import Ceiling, probe_ceiling, probe_split_compute
from dbo.cli.bench.point import efficiency
from dbo.cli.bench.probe_scope import probe_scope
from dbo.cli.bench.timing import Timing
from dbo.cli.bench.workload import Workload

__all__ = ["HFProbe", "NO_PROBE_ON_CPU", "PROBE_NA_CPU", "PROBE_NO_FIGURES", "no_probe_reason",
           "probe_hf_point"]

PROBE_NA_CPU = ("probe n/a on CPU: gloo runs each collective synchronously on the calling "
                "thread, there are no streams to overlap")
PROBE_NO_FIGURES = "no compute/comm/both/split/ceiling/eta"
NO_PROBE_ON_CPU = "probe skipped on CPU"


@dataclass(frozen=True)
class HFProbe:
    """One point's probe: the ceiling (compute, comm, both) and the split compute, both
    None where not measured (`note` says why, "" where measured)."""

    ceiling: Optional[Ceiling]
    split: Optional[Timing]
    note: str

    def fields(self, *, t_nodbo_ms: float, t_dbo_ms: float, perf: bool) -> dict[str, Any]:
        """`HFPoint`'s probe fields (times max over ranks): T_compute, T_comm, T_both,
        T_split, ceiling = (T_compute + T_comm) / T_both, eta = (T_noDBO - T_DBO) /
        (T_noDBO - T_both) with its note (`point.efficiency`; None in a functional run,
        `perf` False), and `probe_note`."""
        out: dict[str, Any] = dict(probe_note=self.note)
        if self.split is not None:
            out.update(t_split_ms=self.split.max_ms)
        if self.ceiling is None:
            return out
        c = self.ceiling
        eta, eta_note = (efficiency(t_nodbo_ms, t_dbo_ms, c.both.max_ms) if perf
                         else (None, ""))
        out.update(t_compute_ms=c.compute.max_ms, t_comm_ms=c.comm.max_ms,
                   t_both_ms=c.both.max_ms, ceiling=c.ceiling, eta=eta, eta_note=eta_note)
        return out

    def per_rank_ms(self) -> dict[str, list[float]]:
        """Each measured timing's per-rank medians, keyed as `HFPoint.per_rank_ms`."""
        out: dict[str, list[float]] = {}
        if self.ceiling is not None:
            out.update(t_compute=list(self.ceiling.compute.per_rank_ms),
                       t_comm=list(self.ceiling.comm.per_rank_ms),
                       t_both=list(self.ceiling.both.per_rank_ms))
        if self.split is not None:
            out["t_split"] = list(self.split.per_rank_ms)
        return out


def skipped(model: nn.Module, device: torch.device) -> str:
    """Why the probe cannot measure `model` on `device` ("" where it can)."""
    if device.type != "cuda":
        return PROBE_NA_CPU
    scope = probe_scope(model)
    return "" if scope.measurable else f"{scope.reason}; {PROBE_NO_FIGURES}"


def no_probe_reason(model: nn.Module, device: torch.device) -> str:
    """The gate's words for a point without a ceiling (`GatePolicy.decide(
    no_probe_reason=)`), as the layer bench's: on CPU, or the backends the probe cannot
    record; "" where the probe measures `model` on `device`."""
    if device.type != "cuda":
        return NO_PROBE_ON_CPU
    scope = probe_scope(model)
    return "" if scope.measurable else scope.gate_reason


def probe_hf_point(model: nn.Module, inputs: dict[str, Any], *, tokens: int,
                   runner: Union[DBORunner, GraphedRunner], device: torch.device,
                   group: Optional[dist.ProcessGroup], warmup: int, iters: int,
                   cuda_graph: bool, gemm_sm_carveout: Optional[int]) -> HFProbe:
    """Probe one point (module doc) on every rank together: `model` the converted model,
    `inputs` its prefill call's keyword arguments, `runner` the point's DBO-on runner
    (the `GraphedRunner` under `cuda_graph`). Runs the runner's steps: read its
    `last_decision` before calling this."""
    note = skipped(model, device)
    if note:
        return HFProbe(None, None, note)
    timing = dict(device=device, group=group, warmup=warmup, iters=iters,
                  cuda_graph=cuda_graph)
    ceiling = probe_ceiling(Workload(model, (), inputs, tokens, None), **timing,
                            gemm_sm_carveout=gemm_sm_carveout)
    split = probe_split_compute(Workload(model, (), inputs, tokens, runner), **timing)
    return HFProbe(ceiling, split, "")
