"""The split: one step's call into two ubatches (pure functions, no torch.distributed).

    from dbo.split import plan_split, split_call, SplitPlan, UBatchSlice
    cut = split_call(args, kwargs, config, whole_requests=lambda: None)
    cut.plan.split, cut.plan.reason, cut.ubatch_args, cut.rows

By concept:
- `plan`: `SplitPlan` (the decision, its reason, the group's figures from the vote, the
  overlap mode) and `UBatchSlice` (one ubatch's tokens and requests);
- `balance`: where to cut a step of tokens or requests (`plan_split`,
  `plan_token_split`: thresholds, token balance, cutting inside a request where
  `request_cut_blocker` allows it), `request_positions`, `normalize_seq_lens`;
- `args`: which arguments a named mode cuts (`find_split_args`, `slice_args`,
  `SplitArgumentWarning`);
- `modes`: the mode `DBOConfig(split=None)` takes per call (`auto_split_mode`,
  `SplitModeChooser`);
- `call`: `split_call`, one call's arguments into this rank's plan and each ubatch's
  arguments, per split mode (tokens, requests, batch, a callable).
"""
from dbo.split.args import (
    SplitArgs,
    SplitArgumentWarning,
    UBatchArgs,
    find_split_args,
    slice_args,
    undeclared_warning,
)
from dbo.split.balance import (
    SeqLens,
    normalize_seq_lens,
    plan_split,
    plan_token_split,
    request_cut_blocker,
    request_positions,
)
from dbo.split.call import CallSplit, first_tensor, num_rows, split_call
from dbo.split.modes import (
    SEQ_LENS_KWARG,
    SplitModeChooser,
    auto_split_mode,
    model_split_mode,
)
from dbo.split.plan import SplitPlan, UBatchSlice
from dbo.model_hooks import CUT_HOOK, SPLIT_MODE_HOOK  # the model's say (`dbo.model_hooks`)

__all__ = [
    "CUT_HOOK",
    "SEQ_LENS_KWARG",
    "SPLIT_MODE_HOOK",
    "CallSplit",
    "SeqLens",
    "SplitArgs",
    "SplitArgumentWarning",
    "SplitModeChooser",
    "SplitPlan",
    "UBatchArgs",
    "UBatchSlice",
    "auto_split_mode",
    "find_split_args",
    "first_tensor",
    "model_split_mode",
    "normalize_seq_lens",
    "num_rows",
    "plan_split",
    "plan_token_split",
    "request_cut_blocker",
    "request_positions",
    "slice_args",
    "split_call",
    "undeclared_warning",
]
