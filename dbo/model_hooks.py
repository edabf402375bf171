"""The model's side of the runtime: every hook a model (or its modules) may define, and
`ModelHooks`, the one object that finds them.

    hooks = ModelHooks.of(model)        # walks the model's modules once
    hooks.capacity(), hooks.agreement_fields(), hooks.sbo_blocker, hooks.split_mode

The runtime core never imports `moe`: where it needs something from a model it asks
these duck-typed hooks, all optional. On "the model" hooks are looked up on the model
itself (a function, an `nn.Module`, a module wrapped by `torch.compile`); on "its
modules" on every module of an `nn.Module` (`named_modules()`), or on the model itself
when it is a plain callable.

- `dbo_agreement()`, on its modules: a mapping of field names to values every rank must
  share (None, bool, int, float, str, `torch.dtype` / `torch.device`, tuples of these),
  prefixed with the module's name. Asked by `dbo.agreement`: hashed into the
  fingerprint that each step's vote carries.
- `dbo_check_inputs(*args, **kwargs)`, on the model: returns nothing, raises where the
  model's forward would (a cheap check, no device reads). Asked by the runner and
  `GraphedRunner` before the vote (`dbo.agreement.check_inputs`).
- `dbo_max_tokens_per_rank()`, on its modules: the most tokens one rank may hold in a
  step (an int >= 1), or None; the smallest counts. `dbo_max_tokens_per_ubatch()`:
  likewise per ubatch of a DBO step (None: the step's). Asked by `dbo.agreement` (they
  are fields too) and `dbo.step_vote`: a step over them stops on every rank.
- `dbo_sbo_blocker()`, on its modules: why the model cannot overlap within one batch,
  or None; the first reason counts, and no module with the hook means no single-batch
  overlap. Asked by the mode policy (`dbo.mode_policy`, `dbo.overlap`); voted as a
  field (`dbo.step_vote`).
- `dbo_can_split_inside_request()`, on the model: True where a request's tokens may
  run in two calls (its output for a token does not depend on the request's other
  tokens in the same call). Asked by `dbo.split.balance.request_cut_blocker`
  ("requests" mode).
- `dbo_split_mode`, a method or an attribute on the model: the named split mode
  `DBOConfig(split=None)` takes ("tokens", "requests" or "batch"). Asked by
  `dbo.split.modes`.
- `cuda_graph_blocker`, an attribute or property on its modules: why a step through it
  cannot be captured in a CUDA graph, or None. Asked by `dbo.graphs.GraphedRunner`
  before any capture.

The hooks are found once per model (`ModelHooks.of`; a runner keeps one, found again
only when its `model` is replaced), not when a module is added or altered in place. The
values the runtime keeps for the model's life (`sbo_blocker`, `split_mode`,
`can_split_inside_request`, `graph_blockers`) are read once, on first use (a hook that
raises is asked again next time); the others are called each time they are
asked (the agreement and capacities once per `model` or `config` object, the input
check every step).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Optional

from torch import nn

from dbo.config import SPLIT_MODES

__all__ = ["AGREEMENT_HOOK", "CAPACITY_HOOK", "CHECK_INPUTS_HOOK", "CUDA_GRAPH_HOOK",
           "CUT_HOOK", "HOOKS", "ModelHooks", "NO_SBO_HOOK", "SBO_HOOK", "SPLIT_MODE_HOOK",
           "UBATCH_CAPACITY_HOOK", "model_name"]

AGREEMENT_HOOK = "dbo_agreement"
CHECK_INPUTS_HOOK = "dbo_check_inputs"
CAPACITY_HOOK = "dbo_max_tokens_per_rank"
UBATCH_CAPACITY_HOOK = "dbo_max_tokens_per_ubatch"
SBO_HOOK = "dbo_sbo_blocker"
CUT_HOOK = "dbo_can_split_inside_request"
SPLIT_MODE_HOOK = "dbo_split_mode"
CUDA_GRAPH_HOOK = "cuda_graph_blocker"
#: Every hook, in the order of the list above.
HOOKS = (AGREEMENT_HOOK, CHECK_INPUTS_HOOK, CAPACITY_HOOK, UBATCH_CAPACITY_HOOK, SBO_HOOK,
         CUT_HOOK, SPLIT_MODE_HOOK, CUDA_GRAPH_HOOK)

NO_SBO_HOOK = f"no module of the model overlaps within one batch (no {SBO_HOOK} hook)"

# (module name, module, its hook) of each module that has the hook.
Found = tuple[tuple[str, Any, Callable[..., Any]], ...]


def model_name(model: Any) -> str:
    """A function's name, else its class's (an nn.Module's, a callable object's); a
    module wrapped by `torch.compile` is named by the module it compiles."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if inspect.isfunction(model) or inspect.ismethod(model):
        return model.__qualname__
    return type(model).__name__


@dataclass(frozen=True, eq=False)
class ModelHooks:
    """The hooks one model defines (module doc), found once by `ModelHooks.of(model)`."""

    model: Any
    """The model they were found on (compared by identity to know when to look again)."""
    owners: tuple[tuple[str, Any], ...]
    """(name, module) of every module of the model, or `("", model)` for a plain callable."""
    agreement: Found
    max_tokens_per_rank: Found
    max_tokens_per_ubatch: Found
    sbo_blockers: Found
    check_inputs_hook: Optional[Callable[..., Any]]
    cut_hook: Optional[Callable[[], Any]]
    split_mode_hook: Any
    """The model's `dbo_split_mode` (a method, or the mode itself), or None."""

    @classmethod
    def of(cls, model: Any) -> "ModelHooks":
        """Find `model`'s hooks (one walk over its modules)."""
        owners = (tuple(model.named_modules()) if isinstance(model, nn.Module)
                  else (("", model),))

        def found(name: str) -> Found:
            return tuple((prefix, owner, hook) for prefix, owner in owners
                         for hook in (getattr(owner, name, None),) if hook is not None)
        return cls(model=model, owners=owners, agreement=found(AGREEMENT_HOOK),
                   max_tokens_per_rank=found(CAPACITY_HOOK),
                   max_tokens_per_ubatch=found(UBATCH_CAPACITY_HOOK),
                   sbo_blockers=found(SBO_HOOK),
                   check_inputs_hook=getattr(model, CHECK_INPUTS_HOOK, None),
                   cut_hook=getattr(model, CUT_HOOK, None),
                   split_mode_hook=getattr(model, SPLIT_MODE_HOOK, None))

    def __repr__(self) -> str:
        found = [name for name, hooks in (
            (AGREEMENT_HOOK, self.agreement), (CAPACITY_HOOK, self.max_tokens_per_rank),
            (UBATCH_CAPACITY_HOOK, self.max_tokens_per_ubatch), (SBO_HOOK, self.sbo_blockers),
            (CHECK_INPUTS_HOOK, self.check_inputs_hook), (CUT_HOOK, self.cut_hook),
            (SPLIT_MODE_HOOK, self.split_mode_hook)) if hooks]
        return f"ModelHooks({self.name}: {', '.join(found) or 'no hooks'})"

    @property
    def type_name(self) -> str:
        """The model's class name, as errors about its hooks name it."""
        return type(self.model).__name__

    @cached_property
    def name(self) -> str:
        """`model_name(model)`."""
        return model_name(self.model)

    # ------------------------------------------------------------ asked when needed
    def capacity(self, per_ubatch: bool = False) -> Optional[int]:
        """The smallest `dbo_max_tokens_per_rank()` (`per_ubatch`: `dbo_max_tokens_per_
        ubatch()`) of the model's modules; None when none reports a limit. Raises
        TypeError for anything but a positive int or None."""
        found, hook_name = ((self.max_tokens_per_ubatch, UBATCH_CAPACITY_HOOK) if per_ubatch
                            else (self.max_tokens_per_rank, CAPACITY_HOOK))
        limits = []
        for _, owner, hook in found:
            limit = hook()
            if limit is None:
                continue
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise TypeError(f"{type(owner).__name__}.{hook_name}() returned {limit!r}: "
                                f"it must return a positive int (tokens per rank) or None")
            limits.append(limit)
        return min(limits, default=None)

    def agreement_fields(self) -> dict[str, Any]:
        """The `dbo_agreement()` fields of the model's modules, each prefixed with its
        module's name. Raises TypeError for a hook that returns no mapping."""
        fields: dict[str, Any] = {}
        for prefix, owner, hook in self.agreement:
            own = hook()
            if not isinstance(own, Mapping):
                raise TypeError(f"{type(owner).__name__}.{AGREEMENT_HOOK}() returned a "
                                f"{type(own).__name__}: it must return a mapping of field "
                                f"names to values")
            for name, value in own.items():
                fields[f"{prefix}.{name}" if prefix else str(name)] = value
        return fields

    # ------------------------------------------------------------ read once, kept
    @cached_property
    def sbo_blocker(self) -> Optional[str]:
        """Why the model cannot run a single-batch-overlap step (the first module's
        reason, or that none has the hook), or None when it can."""
        for _, _, hook in self.sbo_blockers:
            reason = hook()
            if reason is not None:
                return str(reason)
        return None if self.sbo_blockers else NO_SBO_HOOK

    @cached_property
    def can_split_inside_request(self) -> Optional[bool]:
        """The model's `dbo_can_split_inside_request()`, None without the hook. Raises
        TypeError when it returns something other than a bool."""
        says = None if self.cut_hook is None else self.cut_hook()
        if says is not None and not isinstance(says, bool):
            raise TypeError(f"{self.type_name}.{CUT_HOOK}() returned {says!r}: it must "
                            f"return True (a request's tokens may run in two calls) or False")
        return says

    @cached_property
    def split_mode(self) -> Optional[str]:
        """The named split mode the model declares (`dbo_split_mode`), or None. Raises
        ValueError for anything other than a named mode."""
        hook = self.split_mode_hook
        if hook is None:
            return None
        mode = hook() if callable(hook) else hook
        if not isinstance(mode, str) or mode not in SPLIT_MODES:
            raise ValueError(f"{self.type_name}.{SPLIT_MODE_HOOK} gives {mode!r}: it must "
                             f"give one of {', '.join(repr(m) for m in SPLIT_MODES)} (or "
                             f"pass DBOConfig(split=...) to the runner)")
        return mode

    @cached_property
    def graph_blockers(self) -> tuple[str, ...]:
        """Why the model cannot be captured in a CUDA graph: the `cuda_graph_blocker` of
        each of its modules that has one set (an `nn.Module`'s only)."""
        if not isinstance(self.model, nn.Module):
            return ()
        return tuple(f"{name or type(module).__name__}: {reason}"
                     for name, module in self.owners
                     for reason in (getattr(module, CUDA_GRAPH_HOOK, None),) if reason)
