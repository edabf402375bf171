"""DBORunner: run a model's forward as two overlapped ubatches when it pays off.

    runner = DBORunner(model, DBOConfig(split="requests"), group=ep_group)
    out = runner(x_TH, positions_T, seq_lens=[5, 3, 8])   # same result as model(...)
    runner.last_decision.split, runner.last_decision.reason

One step is plan -> vote -> run -> merge (`_step`): plan the split (the split mode's
cut, thresholds and token balance, `dbo.split`; the mode policy, `dbo.mode_policy`),
vote across the group (`dbo.step_vote`: every rank splits or none does; the mode follows
from the voted data), then either call the model once, or run `model(ubatch 0 inputs)`
and `model(ubatch 1 inputs)` as two greenlets of a `UBatchScheduler` — they interleave
where the model calls `dbo_yield*()` — and merge the outputs (`dbo.merge`). While the ubatches
run, torch's GEMMs leave `DBOConfig.gemm_sm_carveout` SMs to the comm kernels beside them
(`streams.gemm_carveout`).
Nothing here assumes MoE: any model whose rows are independent outside its own
request/sequence works, yields or not; but only a model that yields overlaps anything,
so the first split step whose ubatches never interleaved (neither handed off to the
other: `UBatchScheduler.last_run_interleaved`, found once per step at no cost per
yield) is warned about, once per runner (`NoYieldWarning`), and said in that step's
reason.

Split modes (`DBOConfig.split`): "tokens", "requests" (balanced on `seq_lens=`; a
request is cut across the ubatches only where the model allows it), "batch" (padded
sequences), a callable, or None (the default: per call, the mode the model declares
with `dbo_split_mode`, else "requests" for a call with `seq_lens=`, else "tokens"; the
reason ends with which and why); which arguments each cuts, and which tensors it
refuses or warns about (`SplitArgumentWarning`), is `dbo.split.call`'s. An error raised
inside a ubatch gets a note naming the rows of the step that ubatch ran, since the
shapes in its message are the ubatch's.

Every rank of `group` must call the runner on every step (with 0 tokens too), with the
same config: the vote is a collective. To replay steps as CUDA graphs, wrap the runner in
`dbo.graphs.GraphedRunner` (the vote stays outside the graph).

The vote also stops bad steps on every rank at once, before any collective of the model
(`dbo.agreement`): a rank whose inputs are rejected (while planning the split, or by the
model's `dbo_check_inputs` hook) votes "not ok" and re-raises its error, while its peers
raise `PeerInputError`; ranks whose configurations differ (`DBOConfig.enabled`, split
mode, capacity, calibration, SBO blocker, the token limit in force, and what the model's
`dbo_agreement` hooks report) all raise `ConfigMismatchError`. Either way the next step
can run. A runner with `DBOConfig(enabled=False)` checks and votes the same way on every
step (it plans the step as the split mode would, never splits, and checks the
capacity): DBO on or off, no rank's bad input leaves its peers waiting. Its cost is the
vote's one small all-reduce per step (0.3-0.5 ms between 2 gloo ranks on a shared
2-core CPU; over NCCL a host sync on a side stream, `dbo.vote`; docs/models.md). What is
voted, and why no decision of a step is left to one rank's data, is `dbo.step_vote`'s.

The model is read through its hooks, found once per model (`dbo.model_hooks`:
`DBORunner.hooks`). With a calibration (`DBORunner(..., calibration=cal)`,
`DBOConfig(overlap="auto")`), a step whose shape the calibration covers
(`dbo.predicted_overlap`, `dbo.mode_policy`) runs the mode the cost model predicts
fastest instead of the one the thresholds give: it wants to split where
DBO is predicted to win (thresholds aside), and otherwise takes single-batch overlap or
none as predicted at the group's largest token count (the same on every rank). No
trial steps: the reason says "predicted ...", and is logged once per shape. Shapes the
calibration does not cover keep the thresholds. A digest of the calibration is voted:
ranks given different calibrations (or one none) all raise `ConfigMismatchError` naming
the field "calibration".
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dbo.agreement import check_inputs
from dbo.calibration import Calibration
from dbo.config import DBOConfig
from dbo.failures import annotate_step_failure, annotate_ubatch_rows, reset_collectives
from dbo.merge import merge_outputs
from dbo.mode_policy import ModePolicy, Wish
from dbo.model_hooks import ModelHooks
from dbo.predicted_overlap import OverlapPredictor
from dbo.scheduler import UBatchScheduler
from dbo.split import (
    CallSplit,
    SplitArgs,
    SplitArgumentWarning,
    SplitModeChooser,
    SplitPlan,
    first_tensor,
    num_rows,
    request_cut_blocker,
    split_call,
    undeclared_warning,
)
from dbo.step_vote import StepVotes, calibration_digest
from dbo.vote import Tally, plan_after_vote
from dbo.yield_points import dbo_enabled
from streams.gemm_carveout import gemm_sm_carveout

DISABLED_REASON = "DBO disabled (DBOConfig.enabled=False)"
# Raised by a step called while another thread runs one on the same runner: the two
# would share its schedulers, streams and agreement (and issue interleaved collectives).
SHARED_RUNNER = ("a DBORunner runs one step at a time on one thread; give each thread its "
                 "own runner (DBORunner(model, config, group=...) per thread)")


# The words of `NoYieldWarning` (and, the first part, of the step's reason).
NO_YIELD_NOTE = ("the model never yielded to the other ubatch, so the two ubatches ran one "
                 "after the other and overlapped nothing")
NO_YIELD_HELP = ("DBO gains only where the model hands off between its compute and its "
                 "communication (dbo.dbo_yield* calls): an MoE layer over a backend that "
                 "communicates ('a2a', 'a2a_ll', 'naive', DeepEP, 'symm_mem') does; one over "
                 "backend 'local' (one process: nothing to overlap) does not, nor does a "
                 "model without MoE layers of this package (a plain nn.Module, a "
                 "transformers model not converted with moe.hf.convert). Run it without DBO "
                 "(DBOConfig(enabled=False)), or filter NoYieldWarning.")


class NoYieldWarning(UserWarning):
    """A split step's ubatches ran one after the other: the model never yielded."""


class DBORunner:
    """Calls `model(*args, **kwargs)`, split into two interleaved ubatches when allowed.

    Args:
        model: any callable; it is called once per ubatch (or once, unsplit) and must
            return tensors whose dim 0 is its inputs' dim 0 (or use `DBOConfig.merge`).
        config: the split policy and mode.
        group: the process group whose ranks vote on each split (EP/DP group); None:
            the default group when torch.distributed is initialised, else no vote.
        calibration: measured phase times per shape (`dbo.calibration`, one point per
            shape: `cal.select(backend=...)`); with `DBOConfig(overlap="auto")` a covered
            shape runs the predicted mode (module doc). None: the thresholds decide.

    After each call, `last_decision` (a `SplitPlan`) says whether and why the step was
    split; it is set before the model runs, so the model can read its ubatch's slice
    as `runner.last_decision.ubatches[dbo_current_ubatch_id()]` (e.g. the offset of a
    request split inside, for its KV cache).
    """

    def __init__(self, model: Callable[..., Any], config: DBOConfig = DBOConfig(),
                 group: Optional[dist.ProcessGroup] = None, *,
                 calibration: Optional[Calibration] = None) -> None:
        if not callable(model):
            raise TypeError(f"DBORunner needs a callable model (an nn.Module or a "
                            f"function), got a {type(model).__name__}: {model!r}")
        if not isinstance(config, DBOConfig):
            raise TypeError(f"config must be a DBOConfig, got a {type(config).__name__}: "
                            f"{config!r}; build one with DBOConfig(split=..., ...)")
        if calibration is not None and config.overlap != "auto":
            raise ValueError(f"DBORunner(calibration=...) drives the choice of DBOConfig("
                             f"overlap='auto'), but overlap={config.overlap!r}: set "
                             f"overlap='auto' or drop the calibration")
        self.model = model
        self.config = config
        self.group = group
        predictor = (None if calibration is None else
                     OverlapPredictor(calibration, joined=config.joined_experts))
        self._policy = ModePolicy(predictor)  # the step's mode: thresholds, prediction
        # The calibration's digest is voted (`dbo.step_vote`): ranks predicting from
        # different calibrations would run different overlap modes.
        self._votes = StepVotes(calibration=None if predictor is None else
                                calibration_digest(calibration, margin=predictor.margin,
                                                   sbo_chunks=predictor.sbo_chunks,
                                                   sbo_groups=predictor.sbo_groups))
        self._hooks: Optional[ModelHooks] = None  # the model's, see `hooks`
        self.last_decision: Optional[SplitPlan] = None
        self._schedulers: dict[torch.device, UBatchScheduler] = {}
        self._warned_kwargs: set[str] = set()  # see `_warn_undeclared`
        self._split_modes = SplitModeChooser()  # what DBOConfig(split=None) takes per call
        self._warned_no_yield = False  # see `_no_yield`
        self._never_split: tuple[Any, Optional[DBOConfig]] = (None, None)  # `_plan_disabled`
        # Raise now for a model's bad split mode and a refused cut config.
        declared = self.hooks.split_mode if config.split is None else None
        if config.split == "requests" or declared == "requests":
            self._whole_requests()
        # Held while a step runs (`__call__`): a second thread's step is refused at once.
        self._in_step = threading.Lock()

    def __repr__(self) -> str:
        return f"DBORunner(model={type(self.model).__name__}, config={self.config!r})"

    @property
    def hooks(self) -> ModelHooks:
        """The model's hooks (`dbo.model_hooks`), found again only when `model` is
        replaced: the one place the runner (and `GraphedRunner`) reads the model."""
        hooks = self._hooks
        if hooks is None or hooks.model is not self.model:
            hooks = self._hooks = ModelHooks.of(self.model)
        return hooks

    @property
    def predictor(self) -> Optional[OverlapPredictor]:
        """The calibration's predictor (None without one); set once, as its digest is
        what the vote carries."""
        return self._policy.predictor

    # ------------------------------------------------------------------- one step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if dbo_enabled():
            # Already inside a ubatch of an outer step (the outer runner voted).
            self.last_decision = SplitPlan(split=False, num_tokens=(),
                                           reason="called inside a running DBO step")
            return self.model(*args, **kwargs)

        if not self._in_step.acquire(blocking=False):
            raise RuntimeError(SHARED_RUNNER)
        try:
            reset_collectives()
            return self._step(args, kwargs)
        except BaseException as exc:
            annotate_step_failure(exc)
            raise
        finally:
            self._in_step.release()

    def _step(self, args: tuple, kwargs: dict) -> Any:
        """plan -> vote -> run -> merge."""
        wish, rejected = self._plan_step(args, kwargs)
        try:
            plan = self._vote_step(wish, rejected)
        finally:
            rejected = None  # no frame of a stopped step may keep its error (`stop_step`)
        assert wish is not None  # a rejected plan stopped the step in the vote
        outputs = self._run(plan, wish.cut, args, kwargs)
        return self._merge(plan, wish.cut, outputs)

    def _plan_step(self, args: tuple, kwargs: dict
                   ) -> tuple[Optional[Wish], Optional[Exception]]:
        """This rank's wish (`plan`), or the error that rejects its inputs (the model's
        `dbo_check_inputs`, the split mode's checks): it then votes "not ok", so that
        every rank stops (`vote`)."""
        try:
            check_inputs(self.hooks, args, kwargs)
            return self.plan(args, kwargs), None
        except Exception as exc:
            return None, exc

    def _vote_step(self, wish: Optional[Wish], rejected: Optional[Exception]) -> SplitPlan:
        """The step's vote, the mode derived from it (`decide`) and the capacity check;
        sets `last_decision`."""
        try:
            tally = self.vote(None if wish is None else wish.plan, rejected)
        finally:
            rejected = None  # no frame of a stopped step may keep its error (`stop_step`)
        assert wish is not None
        plan = self.decide(wish, tally.split, tally.max_tokens, tally.all_decode)
        self.last_decision = plan
        self.check_capacity(plan, tally)
        return plan

    def _run(self, plan: SplitPlan, cut: CallSplit, args: tuple, kwargs: dict) -> list[Any]:
        """Run a step whose split every rank has agreed on (`plan`, after the vote): one
        output per model call. No collective of its own: `dbo.graphs` captures this."""
        if not plan.split and plan.overlap != "sbo":
            return [self.model(*args, **kwargs)]
        x = first_tensor(args, kwargs)
        scheduler = self._scheduler(x)
        device = x.device if x is not None else torch.device("cpu")
        if not plan.split:  # single-batch overlap: one ubatch, its collectives on comm
            with gemm_sm_carveout(self.config.gemm_sm_carveout, device):
                return scheduler.run([_bind(self.model, args, kwargs)])
        try:
            with gemm_sm_carveout(self.config.gemm_sm_carveout, device):
                outputs = scheduler.run([_bind(self.model, a, k) for a, k in cut.ubatch_args],
                                        joined_experts=plan.overlap == "joined")
        except BaseException as exc:
            # The scheduler named the ubatch (`dbo_ubatch_id`); its shapes are not the
            # ones the user passed, so say which rows of the step it ran.
            annotate_ubatch_rows(exc, cut.rows if cut.rows is not None else plan.num_tokens,
                                 contiguous=not callable(self.config.split))
            raise
        if not scheduler.last_run_interleaved and not self._warned_no_yield:
            self._no_yield()
        return outputs

    def _merge(self, plan: SplitPlan, cut: CallSplit, outputs: list[Any]) -> Any:
        """The step's output: the one call's, or the ubatches' merged (`DBOConfig.merge`,
        else `merge_outputs` by the ubatches' rows)."""
        if not plan.split:
            return outputs[0]
        if self.config.merge is not None:
            return self.config.merge(outputs)
        return merge_outputs(outputs, rows=cut.rows)

    def _execute(self, plan: SplitPlan, cut: CallSplit, args: tuple, kwargs: dict) -> Any:
        """run -> merge of a decided step (what `dbo.graphs.decided_step` captures)."""
        return self._merge(plan, cut, self._run(plan, cut, args, kwargs))

    # ------------------------------------------------------------------- plan
    def plan(self, args: tuple, kwargs: dict) -> Wish:
        """This rank's plan before the vote (its wish, and the ubatches' inputs when it
        splits): the split mode's cut, then the mode policy (`dbo.mode_policy`); with
        DBO off the unsplit plan, its inputs checked as the split mode would."""
        if not self.config.enabled:
            return Wish(CallSplit(plan=self._plan_disabled(args, kwargs)))
        return self._policy.wish(self.config, self._cut(args, kwargs),
                                 lambda: self._cut(args, kwargs, thresholds=False))

    def _plan_disabled(self, args: tuple, kwargs: dict) -> SplitPlan:
        """The unsplit plan of a step with DBO off: its tokens and shape as the split mode
        counts them, and the split mode's checks of the arguments (`seq_lens`, rows), so
        that DBO on or off a step's inputs are checked alike before the vote. A callable
        split is not called: the step's rows are dim 0 of its first tensor."""
        if callable(self.config.split):
            plan = SplitPlan(split=False, num_tokens=(num_rows(args, kwargs),),
                             reason=DISABLED_REASON)
        else:
            if self._never_split[0] is not self.config:
                never = dataclasses.replace(self.config, min_decode_tokens=sys.maxsize,
                                            min_prefill_tokens=sys.maxsize)
                self._never_split = (self.config, never)
            mode, _ = self._split_modes.choose(self.hooks, self.config, kwargs)
            plan = split_call(args, kwargs, self._never_split[1], mode=mode,
                              whole_requests=self._whole_requests).plan
        assert not plan.split
        return dataclasses.replace(plan, reason=DISABLED_REASON)

    def _cut(self, args: tuple, kwargs: dict, *, thresholds: bool = True) -> CallSplit:
        """The cut the split mode and thresholds give (`dbo.split.split_call`; `plan`
        applies the policy); `thresholds=False`: as if both thresholds were 0."""
        mode, why = self._split_modes.choose(self.hooks, self.config, kwargs)
        cut = split_call(args, kwargs, self.config, thresholds=thresholds, mode=mode,
                         whole_requests=self._whole_requests)
        if cut.split_args is not None:
            self._warn_undeclared(cut.split_args)
        if why is None:
            return cut
        return dataclasses.replace(cut, plan=dataclasses.replace(
            cut.plan, reason=f"{cut.plan.reason} ({why})"))

    def _whole_requests(self) -> Optional[str]:
        """Why no request of the model may be cut (`dbo.split.request_cut_blocker`), or
        None; the model's say is read once per model (`ModelHooks`)."""
        return request_cut_blocker(self.hooks, self.config)

    # ------------------------------------------------------------------- vote
    def vote(self, plan: Optional[SplitPlan], rejected: Optional[BaseException], *,
             have_graphs: tuple[bool, bool] = (True, True), cuda_graph: bool = False) -> Tally:
        """The step's one collective (`dbo.step_vote.StepVotes.vote`): this rank's split
        wish and tokens (`plan`, None when `rejected`), whether it accepted its inputs,
        and the fingerprint of what every rank must share. When any rank rejected its
        inputs, or the fingerprints differ, every rank raises here; this rank re-raises
        `rejected`."""
        try:
            return self._votes.vote(self.hooks, self.config, self.group, plan, rejected,
                                    have_graphs=have_graphs, cuda_graph=cuda_graph)
        finally:
            rejected = None  # no frame of a stopped step may keep its error (`stop_step`)

    def decide(self, wish: Wish, split: bool, max_tokens: int,
               all_decode: Optional[bool]) -> SplitPlan:
        """The plan every rank runs: `wish` as the vote left it (`split`, the group's
        largest token count and whether every rank's step is decode) with the step's
        mode and its reason (`dbo.mode_policy`), from voted and agreed data only."""
        voted = plan_after_vote(wish.plan, split, max_tokens, all_decode)
        sbo_blocker = self.hooks.sbo_blocker if self.config.enabled else None
        return self._policy.settle(self.config, wish, voted, sbo_blocker)

    def agreement_fields(self, cuda_graph: bool = False) -> dict[str, Any]:
        """The runner's own fields that every rank must share (`dbo.step_vote`); the
        model's modules add theirs."""
        return self._votes.fields(self.hooks, self.config, cuda_graph)

    def check_capacity(self, plan: SplitPlan, tally: Tally, *, cuda_graph: bool = False
                       ) -> None:
        """Raise on every rank, before any collective of the model, when one model call of
        a rank of the group would carry more tokens this step than the model's capacity
        or the token limit in force (`dbo.step_vote.StepVotes.check_capacity`; `plan`
        and `tally` after the vote). `cuda_graph`: the check of a `GraphedRunner` step."""
        self._votes.check_capacity(plan, tally, group=self.group, cuda_graph=cuda_graph)

    # ------------------------------------------------------------------- warnings
    def _no_yield(self) -> None:
        """The first split step whose ubatches never interleaved (`UBatchScheduler.
        last_run_interleaved`): say so, once per runner, in a `NoYieldWarning` and in
        that step's `last_decision.reason`. Later steps cost one test of a flag."""
        self._warned_no_yield = True
        if self.last_decision is not None and self.last_decision.split:
            self.last_decision = dataclasses.replace(
                self.last_decision, reason=f"{self.last_decision.reason}; {NO_YIELD_NOTE}")
        warnings.warn(f"DBORunner over {self.hooks.name}: {NO_YIELD_NOTE}. "
                      f"{NO_YIELD_HELP} Warned once per runner", NoYieldWarning,
                      stacklevel=5)

    def _warn_undeclared(self, which: SplitArgs) -> None:
        """Once per runner and keyword: a keyword tensor this split step cuts by rows
        without its being declared row-major (`DBOConfig.split_kwargs`)."""
        for keyword in which.undeclared:
            if keyword not in self._warned_kwargs:
                self._warned_kwargs.add(keyword)
                warnings.warn(undeclared_warning(keyword, which),
                              SplitArgumentWarning, stacklevel=6)

    def _scheduler(self, x: Optional[torch.Tensor]) -> UBatchScheduler:
        """One scheduler per input device, reused across steps (it caches streams)."""
        device = x.device if x is not None else None
        scheduler = self._schedulers.get(device)
        if scheduler is None:
            scheduler = self._schedulers[device] = UBatchScheduler(device)
        return scheduler


# ---------------------------------------------------------------------------- helpers
def _bind(model: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[[], Any]:
    def run_ubatch() -> Any:
        return model(*args, **kwargs)
    return run_ubatch
