"""dbo: dual-batch overlap for Mixture-of-Experts models in PyTorch."""
from dbo.agreement import ConfigMismatchError, PeerInputError
from dbo.config import SPLIT_MODES, DBOConfig
from dbo.failures import GroupUnusableError
from dbo.graphs import GraphedRunner
from dbo.groups import destroy_group, new_group
from dbo.merge import merge_outputs
from dbo.runner import DBORunner, NoYieldWarning
from dbo.scheduler import UBatchScheduler
from dbo.split import SplitArgumentWarning, SplitPlan, UBatchSlice, plan_split
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
    "ConfigMismatchError",
    "DBOConfig",
    "DBORunner",
    "GraphedRunner",
    "GroupUnusableError",
    "NoYieldWarning",
    "PeerInputError",
    "SPLIT_MODES",
    "SplitArgumentWarning",
    "SplitPlan",
    "UBatchScheduler",
    "UBatchSlice",
    "destroy_group",
    "merge_outputs",
    "new_group",
    "plan_split",
    "vote_split",
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
