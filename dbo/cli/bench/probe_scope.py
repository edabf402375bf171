"""Which sweep points the ceiling probe and the phase times can measure, and why not.

    scope = probe_scope(off.model)
    scope.measurable, scope.note, scope.gate_reason   # note: "" where measurable
    scope.reason                                      # the note's why, alone

The probe (`dbo.cli.bench.ceiling`) and the per-phase times (`dbo.cli.bench.phases`) see
a step's communication only as the torch.distributed collectives it issues: they record
them, replay them alone ("comm alone") and replace them by their recorded results
("compute alone"). A backend whose exchange runs in its own kernels (DeepEP's, or
NVSHMEM's `all_to_all_vdev` for symm_mem) issues none of them, so its "comm alone" is
empty (measured: 0.012 ms for deepep_ht at 4096 tokens/rank, 2x H200) and its "compute
alone" still communicates: the ceiling, eta, the split compute and the phase times the
cost model predicts from would all be wrong. `PrepareFinalize.comm_recordable` says
which backends are recordable; where one is not, the sweep reports none of those
figures, says why (`Point.probe_note`, from `ProbeScope.note`), and gates on the token
threshold and the trials alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dbo.cli.bench.ceiling import moe_layers

__all__ = ["ProbeScope", "probe_scope"]


@dataclass(frozen=True)
class ProbeScope:
    """The backends of a model whose exchange the probe cannot record (none: measurable)."""

    unrecordable: tuple[str, ...] = ()

    @property
    def measurable(self) -> bool:
        return not self.unrecordable

    @property
    def note(self) -> str:
        """"" where measurable, else why not and what the point reports instead (one line)."""
        if self.measurable:
            return ""
        return (f"{self.reason}; no compute/comm/both/split/ceiling/eta and no prediction; "
                f"gated on the token threshold and the trials")

    @property
    def reason(self) -> str:
        """Why the probe cannot measure these backends ("" where measurable), without
        what the layer bench reports instead (`dbo bench --hf` adds its own:
        `hf_probe.skipped`)."""
        if self.measurable:
            return ""
        return (f"probe n/a for backend {self._names}: its dispatch/combine runs in its own "
                f"kernels, not torch.distributed collectives, so the probe can neither "
                f"replay its traffic alone nor take it out of the step")

    @property
    def gate_reason(self) -> str:
        """The gate's words for the missing ceiling (`GatePolicy.decide(no_probe_reason=)`)."""
        return (f"no probe (backend {self._names} communicates outside torch.distributed "
                f"collectives)")

    @property
    def _names(self) -> str:
        return ", ".join(repr(n) for n in self.unrecordable)


def probe_scope(model: nn.Module) -> ProbeScope:
    """Which of `model`'s MoE layers' backends are not `PrepareFinalize.comm_recordable`."""
    return ProbeScope(tuple(sorted({layer.backend.name for layer in moe_layers(model)
                                    if not getattr(layer.backend, "comm_recordable", False)})))
