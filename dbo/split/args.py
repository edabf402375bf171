"""Which arguments of a step a named split mode cuts (pure functions, no torch.distributed).

    which = find_split_args(args, kwargs, config, "tokens") # refuses ambiguous tensors
    args0, kwargs0 = slice_args(args, kwargs, which, 0, 32) # rows [0, 32) of each

The step's rows are dim 0 of its first tensor argument that is not declared whole
(`DBOConfig.unsplit_args`): tokens in "tokens"/"requests" mode, sequences in "batch"
mode. Every other top-level tensor argument (0-dim ones aside) must either have those
rows in dim 0 — it is then split with them — or be declared whole; a tensor with other
rows is refused (ValueError naming it), since passing it whole to both ubatches would
hide a shape bug the unsplit call raises for (`model(x[64, 8], mask[32])`). Positional
tensors with the step's rows are split silently (the convention); keyword tensors too,
but a keyword not declared row-major (`DBOConfig.split_kwargs`) is reported once per
runner (`SplitArgumentWarning`), since its dim 0 may equal the rows by chance (the
keyword tensor that gives the rows, when no positional one does, is not). Non-tensor
arguments, and tensors inside lists or dicts, go whole to both ubatches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from dbo.config import DBOConfig

# The inputs of one ubatch: positional and keyword arguments of one model call.
UBatchArgs = tuple[tuple, dict]


class SplitArgumentWarning(UserWarning):
    """A keyword tensor was split by rows without being declared row-major."""


@dataclass(frozen=True, kw_only=True)
class SplitArgs:
    """The arguments of one step that are cut along dim 0, and the step's rows."""

    mode: str
    """The named split mode that cuts them ("tokens", "requests" or "batch")."""
    rows: int
    """Dim 0 of the row-major arguments (tokens, or sequences in "batch" mode)."""
    row_shape: tuple[int, ...]
    """Shape of the tensor argument that gave the rows (the first one not declared whole)."""
    positions: frozenset[int]
    """Positional arguments that are split."""
    keywords: frozenset[str]
    """Keyword arguments that are split."""
    undeclared: tuple[str, ...] = ()
    """Split keyword arguments not named in `DBOConfig.split_kwargs`, other than the one
    that gave the rows (warned about)."""


def find_split_args(args: tuple, kwargs: dict, config: DBOConfig, mode: str) -> SplitArgs:
    """Sort the step's top-level tensor arguments into split and whole (see module doc)
    for the named split `mode` (`config.split`, or the one `split=None` chose).

    Raises TypeError when no tensor gives the rows, ValueError for a tensor whose dim 0
    is not the step's rows and that is not declared whole.
    """
    whole = set(config.unsplit_args)
    named = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    source = next(((key, v) for key, v in named
                   if isinstance(v, torch.Tensor) and key not in whole), None)
    if source is None:
        raise TypeError(f"split={mode!r} splits tensor arguments, but the call has none that "
                        f"is split (positional: {[type(a).__name__ for a in args]}, keyword: "
                        f"{sorted(kwargs)}, declared whole: {list(config.unsplit_args)}): pass "
                        f"the inputs as tensors, or give DBOConfig(split=fn) a callable that "
                        f"splits them")
    key, x = source
    if x.dim() == 0:
        raise TypeError(f"split={mode!r} splits along dim 0 of the first tensor argument, "
                        f"but {_name(key)} is a 0-dim tensor ({x!r}): pass the token-major "
                        f"(or batch-major) input first")
    rows = x.shape[0]
    unit = "sequences" if mode == "batch" else "tokens"
    positions, keywords, undeclared = set(), set(), []
    for key, value in named:
        if key in whole or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.shape[0] != rows:
            raise ValueError(
                f"DBORunner(split={mode!r}): {_name(key)} has shape {list(value.shape)}, but "
                f"the step has {rows} rows ({unit}: dim 0 of {_name(source[0])}, shape "
                f"{list(x.shape)}). Each ubatch gets its rows of every tensor argument, so "
                f"dim 0 must be {rows}; if both ubatches need this tensor whole, declare it: "
                f"DBOConfig(unsplit_args=({key!r},))")
        if isinstance(key, int):
            positions.add(key)
        else:
            keywords.add(key)
            if key not in config.split_kwargs and key != source[0]:  # the rows' own source
                undeclared.append(key)
    return SplitArgs(mode=mode, rows=rows, row_shape=tuple(x.shape),
                     positions=frozenset(positions), keywords=frozenset(keywords),
                     undeclared=tuple(undeclared))


def undeclared_warning(keyword: str, which: SplitArgs) -> str:
    """The text of the one-time warning about a split keyword tensor."""
    return (f"DBORunner(split={which.mode!r}) splits the keyword tensor {keyword}= along "
            f"dim 0, because its dim 0 equals the step's {which.rows} rows: if it is "
            f"row-major, say so with DBOConfig(split_kwargs=({keyword!r},)); if both ubatches "
            f"need it whole, DBOConfig(unsplit_args=({keyword!r},)). Warned once per runner")


def slice_args(args: tuple, kwargs: dict, which: SplitArgs, start: int, end: int) -> UBatchArgs:
    """Rows [start, end) of the arguments `which` names (views, no copies); others whole."""
    return (tuple(a[start:end] if i in which.positions else a for i, a in enumerate(args)),
            {k: v[start:end] if k in which.keywords else v for k, v in kwargs.items()})


def _name(key: Union[int, str]) -> str:
    return f"positional argument {key}" if isinstance(key, int) else f"keyword argument {key}="

