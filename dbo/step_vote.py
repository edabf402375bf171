"""A runner's step vote: what every rank of its group agrees on before a step, in the
step's one all-reduce (`dbo.vote.cast_ballot`), and the capacity check after it.

    votes = StepVotes(calibration=cal)          # one per DBORunner
    tally = votes.vote(hooks, config, group, plan, rejected)   # may raise on every rank
    votes.check_capacity(plan, tally, group=group)             # likewise
    with step_token_limit(64, 32):              # a caller's limit on one call's tokens
        runner(x)

Ranks that issue different collectives hang until the group's timeout, or gloo aborts
the process ("EnforceNotMet 512 vs 256"). So every decision of a step that changes its
collectives is voted, or derived from voted data only:

- the split: every rank's wish, voted (MIN);
- the overlap mode (`dbo.mode_policy`): the voted split, the group's
  largest token count and whether every rank's step is decode (voted), `DBOConfig.overlap`,
  the model's SBO blocker and a digest of the calibration (fields of the fingerprint);
- the chunked SBO combine and the split combine: the overlap mode, the split, and the MoE
  layers' config (their `dbo_agreement` fields);
- the capacity: the model's capacity hooks (fields), the token limit in force
  (`step_token_limit`, mixed into the fingerprint per step), and the group's largest
  token count (voted).

Where the fingerprints differ, every rank raises `ConfigMismatchError` naming the fields
(`dbo.agreement.stop_step`). The fields are collected on the runner's first step and
again only when its `model` or `config` object is replaced.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional

import torch.distributed as dist

from dbo.agreement import Agreement, AgreementCache, Fields, gather_objects, stop_step
from dbo.calibration import Calibration
from dbo.config import DBOConfig
from dbo.failures import mark_stopped_together
from dbo.model_hooks import ModelHooks
from dbo.split import SplitPlan
from dbo.vote import Ballot, Tally, cast_ballot

__all__ = ["StepVotes", "TokenLimit", "calibration_digest", "current_token_limit",
           "step_token_limit"]

# The agreement field of the token limit in force (added to the fields on a mismatch).
TOKEN_LIMIT_FIELD = "step_token_limit"


@dataclass(frozen=True)
class TokenLimit:
    """The most tokens one model call of this rank holds: unsplit, and per DBO ubatch."""

    tokens_per_rank: int
    tokens_per_ubatch: int
    #: What the error for a bad value names (a subclass names its own entry point).
    entered_by: ClassVar[str] = "step_token_limit"

    def __post_init__(self) -> None:
        for name in ("tokens_per_rank", "tokens_per_ubatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.entered_by}: {name}={value!r} must be a positive int")


_LIMIT: ContextVar[Optional[TokenLimit]] = ContextVar("dbo_step_token_limit", default=None)


@contextmanager
def step_token_limit(tokens_per_rank: int,
                     tokens_per_ubatch: Optional[int] = None) -> Iterator[TokenLimit]:
    """Within: at most `tokens_per_rank` tokens per model call (`tokens_per_ubatch` in a
    DBO ubatch; default `tokens_per_rank`), e.g. the smaller exchange of a fixed-capacity
    backend (`moe.backends.capacity.exchange_capacity` enters this). Every rank of the
    group must enter it with the same values: a runner's step votes them (a
    `ConfigMismatchError` on every rank where they differ) and stops a step over them on
    every rank, like the model's capacity. A context variable: it follows the code that
    entered it, into the greenlets of a DBO step."""
    value = TokenLimit(tokens_per_rank, tokens_per_ubatch or tokens_per_rank)
    token = _LIMIT.set(value)
    try:
        yield value
    finally:
        _LIMIT.reset(token)


def current_token_limit() -> Optional[TokenLimit]:
    """The `step_token_limit` in force, or None."""
    return _LIMIT.get()


def calibration_digest(calibration: Optional[Calibration], *, margin: float,
                       sbo_chunks: Optional[int],
                       sbo_groups: Optional[int] = None) -> Optional[str]:
    """A short text that differs where two calibrations (with the predictor's margin and
    SBO chunks and groups) could predict differently: a hash of their figures and points,
    not of where or when they were measured. None without a calibration."""
    if calibration is None:
        return None
    content = {k: v for k, v in calibration.to_json().items()
               if k not in ("device", "torch_version", "date")}
    text = json.dumps([content, margin, sbo_chunks, sbo_groups], sort_keys=True)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return f"{digest} ({len(calibration.points)} points, margin {margin})"


class StepVotes:
    """One runner's side of its steps' votes: its fields (`fields`), the agreement
    caches (eager steps and `GraphedRunner` steps, whose fields differ by `cuda_graph`),
    the vote (`vote`) and the capacity check after it (`check_capacity`). The model is
    read through its `ModelHooks` (`dbo.model_hooks`)."""

    def __init__(self, *, calibration: Optional[str] = None) -> None:
        self.calibration = calibration
        self._caches = {False: AgreementCache(), True: AgreementCache()}

    def fields(self, hooks: ModelHooks, config: DBOConfig, cuda_graph: bool = False
               ) -> Fields:
        """The runner's own fields that every rank must share (the model's modules add
        theirs, `dbo.agreement`); the model's SBO blocker (`ModelHooks.sbo_blocker`, read
        once per model) is one, so the mode it helps choose is the same on every rank."""
        split = config.split
        return {"DBOConfig.enabled": config.enabled,
                "DBOConfig.split": split if isinstance(split, str) else "auto" if split is None
                else f"callable {getattr(split, '__qualname__', type(split).__name__)}",
                "DBOConfig.overlap": config.overlap,
                "DBOConfig.joined_experts": config.joined_experts, "cuda_graph": cuda_graph,
                "calibration": self.calibration, "sbo_blocker": hooks.sbo_blocker}

    def vote(self, hooks: ModelHooks, config: DBOConfig, group: Optional[dist.ProcessGroup],
             plan: Optional[SplitPlan], rejected: Optional[BaseException], *,
             have_graphs: tuple[bool, bool] = (True, True), cuda_graph: bool = False) -> Tally:
        """Cast this rank's ballot (module doc); where any rank rejected its inputs or
        the fingerprints differ, every rank raises here (`stop_step`)."""
        agreement: Optional[Agreement] = None
        try:
            agreement = self._caches[cuda_graph].get(
                hooks, config, lambda: self.fields(hooks, config, cuda_graph))
        except Exception as exc:  # a hook's bad field: stop every rank, as for bad input
            rejected = rejected if rejected is not None else exc
        limit = current_token_limit()
        fingerprint = 0
        if agreement is not None:
            fingerprint = agreement.fingerprint if limit is None else _mix(
                agreement.fingerprint, limit)
        ok = rejected is None and plan is not None
        tally = cast_ballot(Ballot(
            inputs_ok=ok, want_split=ok and plan.split,
            num_tokens=plan.total_tokens if ok else 0,
            max_ubatch_tokens=max(plan.num_tokens, default=0) if ok and plan.split else 0,
            fingerprint=fingerprint, have_graphs=have_graphs,
            decode=ok and plan.is_decode), group)
        if tally.stops:
            if agreement is not None and not tally.configs_agree:
                agreement = dataclasses.replace(agreement, fields={
                    **agreement.fields, TOKEN_LIMIT_FIELD: _limit_value(limit)})
            try:
                stop_step(tally, rejected=rejected, agreement=agreement, group=group)
            finally:
                rejected = None  # no frame of a stopped step may keep its error (`stop_step`)
        return tally

    def check_capacity(self, plan: SplitPlan, tally: Tally, *,
                       group: Optional[dist.ProcessGroup], cuda_graph: bool = False) -> None:
        """Raise on every rank when one model call of a rank of the group would carry more
        tokens this step (its step unsplit, its largest ubatch split; `plan` and `tally`
        after the vote) than the model's capacity (`dbo_max_tokens_per_rank`, per ubatch
        of a split step `dbo_max_tokens_per_ubatch`) or the `step_token_limit` in force.
        Every rank sees the same largest count and limits (voted), so every rank raises
        together, before any collective of the model; the ranks' counts are then
        gathered (one `all_gather_object`) to name the ranks over the limit."""
        cache = self._caches[cuda_graph]
        field = "max_tokens_per_rank"
        capacity = cache.capacity
        if plan.split and cache.ubatch_capacity is not None:
            field, capacity = "max_tokens_per_ubatch", cache.ubatch_capacity
        name = f"the model's capacity {field}"
        where = f"the smallest its modules report, e.g. MoEConfig.{field}"
        limit = current_token_limit()
        if limit is not None:
            value, which = ((limit.tokens_per_ubatch, "tokens_per_ubatch") if plan.split
                            else (limit.tokens_per_rank, "tokens_per_rank"))
            if capacity is None or value < capacity:
                capacity, name = value, f"the step_token_limit in force ({which})"
                where = "entered by the caller, e.g. moe.backends.capacity.exchange_capacity"
        most = tally.max_ubatch_tokens if plan.split else tally.max_tokens
        if capacity is None or most <= capacity:
            return
        mine = max(plan.num_tokens) if plan.split else plan.total_tokens
        counts = gather_objects(mine, group)
        over = [rank for rank, n in enumerate(counts) if n > capacity]
        who = (f"rank {over[0]} of the group has" if len(over) == 1 else
               "ranks " + ", ".join(map(str, over)) + " of the group have up to")
        exc = ValueError(
            f"{who} {most} tokens in one model call this step "
            f"({'its largest ubatch' if plan.split else 'unsplit'}; each rank: "
            + ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts))
            + f"), more than {name}={capacity} ({where}): every rank stops here so none "
            f"waits in a collective; split the batch or raise the capacity")
        mark_stopped_together(exc)
        raise exc


# ---------------------------------------------------------------------------- helpers
def _limit_value(limit: Optional[TokenLimit]) -> Optional[tuple[int, int]]:
    return None if limit is None else (limit.tokens_per_rank, limit.tokens_per_ubatch)


def _mix(fingerprint: int, limit: TokenLimit) -> int:
    """`fingerprint` with the token limit in force hashed in, in [0, 2**62)."""
    text = repr((fingerprint, limit.tokens_per_rank, limit.tokens_per_ubatch))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                          "little") >> 2
