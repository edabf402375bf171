"""dbo: dual-batch overlap for Mixture-of-Experts models in PyTorch.

The names below are the runtime core's front door: the tools (`dbo.cli`, `moe.bench`,
`traces`) import the core from here only, never from its modules (tests/test_layers.py).
"""
from dbo.agreement import ConfigMismatchError, PeerInputError
from dbo.calibration import Calibration, MeasuredPoint
from dbo.config import SPLIT_MODES, DBOConfig
from dbo.cost_model import HOST_BOUND_SHARE, MODES, PhaseTimes, Prediction, StepShape, predict
from dbo.failures import GroupUnusableError
from dbo.graphs import GraphedRunner, capture_graph, decided_step
from dbo.groups import destroy_group, new_group
from dbo.merge import merge_outputs
from dbo.overlap import collect_sbo_blocker
from dbo.predicted_overlap import OverlapPredictor, point_inputs
from dbo.ranges import (
    PHASES,
    PhaseHandle,
    TraceConfig,
    configure,
    current_config,
    end_phase,
    label_range,
    phase_name,
    phase_range,
    start_label,
    start_phase,
    step_name,
)
from dbo.runner import DBORunner, NoYieldWarning
from dbo.scheduler import UBatchScheduler
from dbo.split import SplitArgumentWarning, SplitPlan, UBatchSlice, plan_split, plan_token_split
from dbo.vote import vote_split
from dbo.yield_points import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_is_last_ubatch,
    dbo_maybe_run_recv_hook,
    dbo_other_ubatch_started,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_async,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)

__all__ = [
    "Calibration",
    "ConfigMismatchError",
    "DBOConfig",
    "DBORunner",
    "GraphedRunner",
    "GroupUnusableError",
    "HOST_BOUND_SHARE",
    "MODES",
    "MeasuredPoint",
    "NoYieldWarning",
    "OverlapPredictor",
    "PeerInputError",
    "PhaseTimes",
    "Prediction",
    "SPLIT_MODES",
    "SplitArgumentWarning",
    "SplitPlan",
    "StepShape",
    "UBatchScheduler",
    "UBatchSlice",
    "capture_graph",
    "collect_sbo_blocker",
    "decided_step",
    "destroy_group",
    "merge_outputs",
    "new_group",
    "plan_split",
    "plan_token_split",
    "point_inputs",
    "predict",
    "vote_split",
    # the phase ranges (dbo.ranges)
    "PHASES",
    "PhaseHandle",
    "TraceConfig",
    "configure",
    "current_config",
    "end_phase",
    "label_range",
    "phase_name",
    "phase_range",
    "start_label",
    "start_phase",
    "step_name",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_is_last_ubatch",
    "dbo_maybe_run_recv_hook",
    "dbo_other_ubatch_started",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_async",
    "dbo_switch_to_compute_sync",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
]
