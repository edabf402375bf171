"""One call's arguments into this rank's `SplitPlan` and, when it splits, each ubatch's
arguments, per split mode (`DBOConfig.split`; None: `dbo.split.modes`). The runner
applies the policy around this (`dbo.mode_policy`) and runs the ubatches.

    cut = split_call(args, kwargs, config, whole_requests=lambda: None)
    cut.plan.split, cut.ubatch_args, cut.rows       # rows per ubatch, for `merge_outputs`

Only top-level arguments are split; the others are passed to both ubatches unchanged:
- "tokens": dim 0 of the first tensor argument (not declared whole) is the step's
  tokens; tensor arguments are halved along it; rows are independent tokens (a call
  without request lengths: each row is its own request, so no request is cut).
- "requests": as "tokens", balanced on the `seq_lens=` keyword argument (tokens per
  request); each ubatch gets its own `seq_lens` (same type) counting only its tokens.
  A request is cut across the ubatches only where the model's
  `dbo_can_split_inside_request()` says it may (or `DBOConfig.split_inside_requests`);
  otherwise a step whose request boundaries are more than `max_imbalance` apart runs
  unsplit (`dbo.split.balance`).
- "batch": dim 0 is sequences (padded [B, S, ...] inputs): tensors are split at a
  sequence boundary; S == 1 (or 1-D inputs) counts as decode.
- a callable `split(args, kwargs) -> [(args0, kwargs0), (args1, kwargs1)] | None`.
  Where the step has a tensor argument, the ubatches' rows (dim 0 of each one's first
  tensor) must add up to the step's (dim 0 of its first tensor), or it is refused with a
  ValueError naming the callable.

In the named modes a tensor argument (not 0-dim) must have the step's rows in dim 0 or
be declared whole in `DBOConfig.unsplit_args` (by position or keyword name): any other
is refused with a ValueError naming it, every step, split or not, since handing it whole
to both ubatches would hide the shape bug the unsplit call raises for. Positional tensors
with the step's rows are split silently; a keyword tensor with them is split too, and
warned about once per runner (`SplitArgumentWarning`, on its first split step) unless it
is declared row-major in `DBOConfig.split_kwargs`: its dim 0 may equal the rows by
chance (`dbo.split.args`). The warning is the runner's to give (`CallSplit.split_args`).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from dbo.config import DBOConfig
from dbo.split.args import SplitArgs, UBatchArgs, find_split_args, slice_args
from dbo.split.balance import plan_split, plan_token_split
from dbo.split.modes import SEQ_LENS_KWARG, auto_split_mode
from dbo.split.plan import SplitPlan, UBatchSlice

__all__ = ["CallSplit", "first_tensor", "num_rows", "split_call"]


@dataclass(frozen=True, kw_only=True)
class CallSplit:
    """One call cut by its split mode: this rank's plan and, when split, the ubatches'
    inputs."""

    plan: SplitPlan
    ubatch_args: list[UBatchArgs] = field(default_factory=list)
    """One (args, kwargs) per ubatch; empty when not split."""
    rows: Optional[tuple[int, ...]] = None
    """The ubatches' rows for `merge_outputs` (tokens, or sequences in "batch" mode);
    None when not split or split by a callable."""
    split_args: Optional[SplitArgs] = None
    """The arguments a named mode cut, when split: its `undeclared` keywords are warned
    about (`SplitArgumentWarning`)."""


def split_call(args: tuple, kwargs: dict, config: DBOConfig, *,
               whole_requests: Callable[[], Optional[str]], thresholds: bool = True,
               mode: Any = None) -> CallSplit:
    """The plan the split mode and the thresholds give for `model(*args, **kwargs)`.

    `mode`: the split mode to apply (a named one or a callable); None: `config.split`,
    where that is None too `auto_split_mode` without a model's say (the runner passes
    the mode it chose with the model's). `whole_requests()`: why no request may be cut
    (`dbo.split.balance.request_cut_blocker`) or None, asked only in "requests" mode.
    `thresholds=False`: as if both thresholds were 0.
    Raises TypeError / ValueError for arguments the mode cannot split (module doc).
    """
    planning = config if thresholds else dataclasses.replace(
        config, min_decode_tokens=0, min_prefill_tokens=0)
    if mode is None:
        mode = config.split
    if mode is None:
        mode = auto_split_mode(kwargs, model_mode=None, model_name="the model")[0]
    if callable(mode):
        return _split_by_callable(mode, args, kwargs, config)
    if mode == "tokens":
        which = find_split_args(args, kwargs, config, mode)
        plan = plan_token_split(which.rows, planning)
        if not plan.split:
            return CallSplit(plan=plan)
        return CallSplit(plan=plan, rows=plan.num_tokens, split_args=which, ubatch_args=[
            slice_args(args, kwargs, which, ub.token_start, ub.token_end)
            for ub in plan.ubatches])
    if mode == "requests":
        if SEQ_LENS_KWARG not in kwargs:
            raise TypeError(
                f"split='requests' needs the tokens per request as a keyword argument: "
                f"runner(..., {SEQ_LENS_KWARG}=[5, 3, ...]); got keyword arguments "
                f"{sorted(kwargs)}. Use split='tokens' for independent tokens")
        seq_lens = kwargs[SEQ_LENS_KWARG]
        rest = {k: v for k, v in kwargs.items() if k != SEQ_LENS_KWARG}
        which = find_split_args(args, rest, config, mode)
        plan = plan_split(seq_lens, planning, num_tokens=which.rows,
                          whole_requests=whole_requests())
        if not plan.split:
            return CallSplit(plan=plan)
        ubatch_args = []
        for ub in plan.ubatches:
            a, k = slice_args(args, rest, which, ub.token_start, ub.token_end)
            k[SEQ_LENS_KWARG] = _like(seq_lens, ub)
            ubatch_args.append((a, {key: k[key] for key in kwargs}))  # keep kwarg order
        return CallSplit(plan=plan, ubatch_args=ubatch_args, rows=plan.num_tokens,
                         split_args=which)
    assert mode == "batch", mode  # DBOConfig (or ModelHooks.split_mode) validated it
    which = find_split_args(args, kwargs, config, mode)
    seq_len = which.row_shape[1] if len(which.row_shape) >= 2 else 1
    plan = plan_split([seq_len] * which.rows, planning, allow_split_inside_request=False)
    if not plan.split:
        return CallSplit(plan=plan)
    return CallSplit(plan=plan, split_args=which,
                     rows=tuple(ub.num_requests for ub in plan.ubatches), ubatch_args=[
                         slice_args(args, kwargs, which, ub.request_start, ub.request_end)
                         for ub in plan.ubatches])


def _split_by_callable(split_fn: Callable[..., Any], args: tuple, kwargs: dict,
                       config: DBOConfig) -> CallSplit:
    name = getattr(split_fn, "__name__", repr(split_fn))
    result = split_fn(args, kwargs)
    if result is None:
        return CallSplit(plan=SplitPlan(split=False, num_tokens=(num_rows(args, kwargs),),
                                        reason=f"the split callable {name} returned None"))
    if (not isinstance(result, (list, tuple)) or len(result) != config.num_ubatches
            or not all(_is_args_pair(r) for r in result)):
        raise ValueError(
            f"the split callable {name} returned {_describe(result)}: it must return "
            f"None (no split) or a list of {config.num_ubatches} (args: tuple, "
            f"kwargs: dict) pairs, one per ubatch")
    ubatch_args = [(tuple(a), dict(k)) for a, k in result]
    rows = [num_rows(a, k) for a, k in ubatch_args]
    step_rows = num_rows(args, kwargs)
    if step_rows and sum(rows) != step_rows:  # rows known: the first tensor's dim 0
        raise ValueError(
            f"the split callable {name} returned ubatches of {' + '.join(map(str, rows))} = "
            f"{sum(rows)} rows but the step has {step_rows} rows (dim 0 of its first tensor "
            f"argument): each row must go to exactly one ubatch")
    plan = SplitPlan(split=True, num_tokens=tuple(rows), ubatches=(),
                     reason=f"split by the callable {name}")
    return CallSplit(plan=plan, ubatch_args=ubatch_args)


def first_tensor(args: Sequence[Any], kwargs: dict) -> Optional[torch.Tensor]:
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def num_rows(args: Sequence[Any], kwargs: dict) -> int:
    """Dim 0 of the first tensor argument (0 without one, or for a 0-dim tensor)."""
    x = first_tensor(args, kwargs)
    return x.shape[0] if x is not None and x.dim() > 0 else 0


def _like(seq_lens: Any, ub: UBatchSlice) -> Any:
    """The ubatch's seq_lens in the type the caller passed (list, tuple or tensor)."""
    assert ub.seq_lens is not None
    if isinstance(seq_lens, torch.Tensor):
        return torch.tensor(ub.seq_lens, dtype=seq_lens.dtype, device=seq_lens.device)
    if isinstance(seq_lens, tuple):
        return tuple(ub.seq_lens)
    return list(ub.seq_lens)


def _is_args_pair(value: Any) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == 2
            and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict))


def _describe(value: Any) -> str:
    """A short structural description (types and lengths, never tensor contents)."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor{list(v.shape)}"
        if isinstance(v, (list, tuple, dict)):
            return f"{type(v).__name__} of {len(v)}"
        return type(v).__name__
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}: [{', '.join(one(v) for v in value[:4])}" \
               f"{', ...' if len(value) > 4 else ''}]"
    return f"a {one(value)}"
