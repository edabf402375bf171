"""What every rank of a group must agree on before a step, and the errors when they don't.

    hooks = ModelHooks.of(model)                          # `dbo.model_hooks`
    agreement = cache.get(hooks, config, runner_fields)   # fields + fingerprint, cached
    check_inputs(hooks, args, kwargs)      # the model's cheap input check, if it has one
    tally = cast_ballot(Ballot(..., fingerprint=agreement.fingerprint), group)
    if tally.stops:
        stop_step(tally, rejected=..., agreement=agreement, group=group)   # raises

The configuration that shapes a step's collectives (the MoE sizes, dtype, backend,
capacity, whether DBO is on) must be the same on every rank; where it differs the ranks
issue different collectives and hang, or gloo aborts the process. The runner gathers it
from duck-typed hooks (declared in `dbo.model_hooks`), so that this core never imports
`moe`:

- `dbo_agreement() -> Mapping[str, value]` on any module of the model (`nn.Module`s are
  walked; a plain callable model may define it itself): named fields, prefixed with the
  module's name (e.g. `layers.1.ffn.top_k`). Values are None, bool, int, float, str,
  `torch.dtype` / `torch.device`, or tuples of these (hashed by their text, the same in
  every process).
- `dbo_check_inputs(*args, **kwargs)` on the model: a cheap check of one step's inputs
  (no device reads) that raises where the model's forward would.
- `dbo_max_tokens_per_rank() -> int | None` on any module of the model: the most tokens
  one rank may hold in a step (a fixed-capacity buffer's size), None for no limit. The
  step's capacity is the smallest reported (`Agreement.capacity`); the runner stops a
  step in which any rank has more, on every rank, after the vote and before any
  collective of the model. The capacity is thus stated once, where the buffers are.
- `dbo_max_tokens_per_ubatch() -> int | None`, likewise: the most tokens one rank may
  hold in one ubatch of a DBO step (`Agreement.ubatch_capacity`), None: the step's.

The fields are hashed into a 62-bit fingerprint carried by every step's vote; they are
collected on the runner's first step and again only when its `model` or `config` object
is replaced (not when a module is added or altered in place). Only when the vote says
a rank rejected its inputs or the fingerprints differ do the ranks exchange their error
texts and fields (`stop_step`, one `all_gather_object`), then every rank raises, before
any collective of the model: the rejecting rank its own error, the others a
`PeerInputError`; on a mismatch every rank a `ConfigMismatchError` naming the fields.

A constructor that makes collectives of its own (an MoE backend's process group or
buffers) agrees first, with `agree_before_building(fields, group, what=...)`: one
all-gather of the fingerprint, and the same `ConfigMismatchError` on every rank where
the ranks were given different configurations.
"""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from dbo.failures import add_note, mark_stopped_together
from dbo.model_hooks import AGREEMENT_HOOK, CAPACITY_HOOK, UBATCH_CAPACITY_HOOK, ModelHooks
from dbo.vote import Tally, group_rank, vote_device

# Fields listed in a ConfigMismatchError's message (all are on `.fields`).
MAX_LISTED_FIELDS = 6
# Characters of a peer's error text carried into a PeerInputError.
MAX_ERROR_CHARS = 500
_ABSENT = "<absent>"

Fields = dict[str, Any]


class ConfigMismatchError(RuntimeError):
    """The ranks of a group run with different configurations (raised on every rank).

    `fields`: the names that differ; `values`: name -> the value on each rank."""

    def __init__(self, message: str, *, fields: tuple[str, ...] = (),
                 values: Optional[dict[str, tuple[Any, ...]]] = None) -> None:
        super().__init__(message)
        self.fields = fields
        self.values = values or {}


class PeerInputError(RuntimeError):
    """Another rank of the group rejected its inputs to this step; no rank ran it.

    `ranks`: the ranks (of the group) that rejected theirs."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class Agreement:
    """The fields that must agree across ranks, and their fingerprint in [0, 2**62);
    `capacity`: the model's tokens per rank and step (`collect_capacity`), None: no limit;
    `ubatch_capacity`: per rank and ubatch of a DBO step, None: `capacity`."""

    fields: Fields
    fingerprint: int
    capacity: Optional[int] = None
    ubatch_capacity: Optional[int] = None

    @classmethod
    def of(cls, fields: Mapping[str, Any], capacity: Optional[int] = None,
           ubatch_capacity: Optional[int] = None) -> "Agreement":
        stable = {name: _stable(value, name) for name, value in sorted(fields.items())}
        digest = hashlib.blake2b(repr(sorted(stable.items())).encode(), digest_size=8).digest()
        return cls(stable, int.from_bytes(digest, "little") >> 2, capacity, ubatch_capacity)


def collect_capacity(model: Any, hook_name: str = CAPACITY_HOOK) -> Optional[int]:
    """The smallest `dbo_max_tokens_per_rank()` (or `dbo_max_tokens_per_ubatch()`, by
    `hook_name`) of `model`'s modules; None when none reports a limit
    (`dbo.model_hooks.ModelHooks.capacity`)."""
    assert hook_name in (CAPACITY_HOOK, UBATCH_CAPACITY_HOOK), hook_name
    return ModelHooks.of(model).capacity(per_ubatch=hook_name == UBATCH_CAPACITY_HOOK)


def collect_agreement(model: Any) -> Fields:
    """The `dbo_agreement()` fields of `model`'s modules, each prefixed with its module's
    name (`dbo.model_hooks.ModelHooks.agreement_fields`)."""
    return ModelHooks.of(model).agreement_fields()


class AgreementCache:
    """A runner's `Agreement`, recollected only when its model (its `ModelHooks`) or
    config object is replaced. Compared by identity: a step costs two `is` tests."""

    def __init__(self) -> None:
        self._hooks: Optional[ModelHooks] = None
        self._config: Any = None
        self._agreement: Optional[Agreement] = None

    def get(self, hooks: ModelHooks, config: Any, own: Callable[[], Fields]) -> Agreement:
        """The agreement of the model (`hooks`) and the runner's `own()` fields (made from
        `config`)."""
        if self._agreement is None or hooks is not self._hooks or config is not self._config:
            self._agreement = None  # a hook that raises leaves nothing behind
            capacity = hooks.capacity()  # a field too: every rank must check alike
            ubatch = hooks.capacity(per_ubatch=True)
            self._agreement = Agreement.of(
                {**own(), **hooks.agreement_fields(), "capacity": capacity,
                 "ubatch_capacity": ubatch}, capacity, ubatch)
            self._hooks, self._config = hooks, config
        return self._agreement

    @property
    def capacity(self) -> Optional[int]:
        """The collected agreement's capacity (None before the first `get`)."""
        return None if self._agreement is None else self._agreement.capacity

    @property
    def ubatch_capacity(self) -> Optional[int]:
        """The collected agreement's capacity per ubatch (None: before the first `get`,
        or the step's `capacity` applies)."""
        return None if self._agreement is None else self._agreement.ubatch_capacity


def check_inputs(model: Any, args: tuple, kwargs: dict) -> None:
    """Run the model's `dbo_check_inputs(*args, **kwargs)` hook, if it has one (`model`:
    the model, or its `ModelHooks`).

    A call whose arguments the hook does not take (a missing or unknown argument) raises
    a TypeError that names the model and the arguments, not the hook's signature."""
    hooks = model if isinstance(model, ModelHooks) else ModelHooks.of(model)
    check: Optional[Callable[..., Any]] = hooks.check_inputs_hook
    if check is None:
        return
    try:
        check(*args, **kwargs)
        return
    except TypeError:
        unfit = _unfit_call(check, args, kwargs)
        if unfit is None:
            raise  # the hook's own TypeError about the values
    # Raised outside the handler: one error, not the hook's binding error chained to it.
    raise TypeError(f"{hooks.type_name} does not take this call's arguments: {unfit} "
                    f"(got {len(args)} positional and the keywords {sorted(kwargs)}): call "
                    f"the runner with the arguments of the model's forward")


def stop_step(tally: Tally, *, rejected: Optional[BaseException],
              agreement: Optional[Agreement],
              group: Optional[dist.ProcessGroup]) -> None:
    """Raise on every rank after a vote that `tally.stops`: every rank calls this after
    the same tally, so the exchange of texts and fields below is collective."""
    try:
        assert tally.stops
        mine = {"error": None if rejected is None else _error_text(rejected),
                "fields": None if tally.configs_agree or agreement is None else agreement.fields}
        reports = gather_objects(mine, group)
        me = group_rank(group)
        errors = {rank: r["error"] for rank, r in enumerate(reports) if r["error"] is not None}
        if not tally.configs_agree:
            exc: BaseException = _mismatch([r["fields"] for r in reports], errors)
            mark_stopped_together(exc)
            raise exc from rejected
        if rejected is not None:
            others = {rank: text for rank, text in errors.items() if rank != me}
            if len(reports) > 1:
                add_note(rejected, f"[dbo] rank {me} of the group rejected its inputs to "
                                   f"this step (this error); its peers raised PeerInputError")
            if others:
                add_note(rejected, "[dbo] the group's other rejecting ranks: " + "; ".join(
                    f"rank {rank}: {text}" for rank, text in others.items()))
            mark_stopped_together(rejected)
            raise rejected
        ranks = tuple(sorted(errors)) or (tally.rejected_by,)
        which = (f"rank {ranks[0]}" if len(ranks) == 1
                 else "ranks " + ", ".join(str(r) for r in ranks))
        said = "; ".join(f"rank {rank}: {text}" for rank, text in errors.items())
        exc = PeerInputError(f"{which} of the group rejected its inputs to this step ({said}); "
                             f"no rank ran the step", ranks=ranks)
        mark_stopped_together(exc)
        raise exc
    finally:
        # The error raised here holds this frame (and its callers') through its traceback:
        # a frame that still held the error would make a reference cycle, keeping the
        # runner, its model and CUDA graphs alive until the garbage collector runs (the
        # callers clear theirs too). A 2-GPU run whose captured graphs were still alive
        # this way hung in destroy_process_group.
        rejected = exc = None


def agree_before_building(fields: Mapping[str, Any], group: Optional[dist.ProcessGroup], *,
                          what: str) -> None:
    """Raise `ConfigMismatchError` on every rank of `group` whose ranks pass different
    `fields` (values as for `dbo_agreement`), before a constructor issues any collective
    of its own (a new process group, a shared buffer): ranks that built different things
    would wait in different collectives until the group's timeout.

    Collective over `group`: one all-gather of one int64 fingerprint per rank (on the
    device for NCCL groups, `dbo.vote.vote_device`); only when they differ, one
    `all_gather_object` of the fields to name the ones that differ. Nothing without a
    group of more than one rank. `what`: the configuration's name, for the message
    (e.g. "MoEConfig")."""
    if group is None or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size(group) == 1:
        return
    agreement = Agreement.of(fields)
    device = vote_device(group)
    mine = torch.tensor([agreement.fingerprint], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if len({int(fp) for fp in every}) == 1:
        return
    raise _mismatch(gather_objects(agreement.fields, group), {}, lead=(
        f"the ranks of the group were given different configurations ({what}): built "
        f"apart they would wait in different collectives until the group's timeout, or "
        f"compute a silently mixed model"), fix=f"Build every rank's {what} alike")


# ---------------------------------------------------------------------------- helpers
def _unfit_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[str]:
    """Why `fn(*args, **kwargs)` cannot bind (e.g. "missing a required argument:
    'seq_lens'"), or None where it can or `fn` has no signature to read."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    except ValueError:  # no signature (a builtin)
        return None
    return None


def gather_objects(mine: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's `mine`, in rank order (one `all_gather_object`; `[mine]` without a
    group of more than one rank). Collective: every rank of `group` must call it."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    return reports


def _mismatch(per_rank: list[Optional[Fields]], errors: dict[int, str], *,
              lead: str = ("the ranks of the group disagree on their configuration, so "
                           "their steps would issue different collectives"),
              fix: str = "Build every rank's model and DBOConfig alike"
              ) -> ConfigMismatchError:
    known = [fields for fields in per_rank if fields is not None]
    names = sorted(set().union(*known)) if known else []
    values = {}
    for name in names:
        row = tuple(_ABSENT if fields is None else fields.get(name, _ABSENT)
                    for fields in per_rank)
        if len(set(map(repr, row))) > 1:
            values[name] = row
    listed = [f"{name}: " + ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(row))
              for name, row in list(values.items())[:MAX_LISTED_FIELDS]]
    if len(values) > MAX_LISTED_FIELDS:
        listed.append(f"and {len(values) - MAX_LISTED_FIELDS} more")
    unreported = [rank for rank, fields in enumerate(per_rank) if fields is None]
    if unreported:
        listed.append("no fields from rank(s) " + ", ".join(map(str, unreported)))
    message = f"{lead}: " + "; ".join(listed) + f". {fix}"
    if errors:
        message += " (rejected inputs too: " + "; ".join(
            f"rank {rank}: {text}" for rank, text in errors.items()) + ")"
    return ConfigMismatchError(message, fields=tuple(values), values=values)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def _stable(value: Any, name: str) -> Any:
    """`value` as something whose repr is the same in every process."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return tuple(_stable(v, name) for v in value)
    raise TypeError(f"{AGREEMENT_HOOK}() field {name!r} is a {type(value).__name__}: use None, "
                    f"bool, int, float, str, torch.dtype, torch.device or a tuple of them "
                    f"(values every process writes alike)")
