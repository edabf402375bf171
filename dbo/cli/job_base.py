"""The fields the tools' job configs share, declared and checked once.

    ToolJob        every tool's config: `seed`
    ModelJob       a job on a named model (a preset, a Hugging Face architecture) whose
                   routed expert count the command line may override: `num_experts`

`dbo.cli.bench.config.SweepJob`, a ModelJob, adds what the two `dbo bench` sweeps share.
A config derives from the one that fits and calls `super().__post_init__()` in its own
`__post_init__`; its flags, defaults and error messages are its own. The soak's
`num_experts` is no override (its model has no other count), so it stays a field of
`SoakConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dbo.cli import check_seed


@dataclass(frozen=True, kw_only=True)
class ToolJob:
    """What every tool's job config holds."""

    seed: int = 0
    """Weights and inputs derive from it (each tool's --help says which)."""

    def __post_init__(self) -> None:
        check_seed(self.seed)


@dataclass(frozen=True, kw_only=True)
class ModelJob(ToolJob):
    """A job on a named model whose routed expert count it may override."""

    num_experts: Optional[int] = None
    """Routed experts over all ranks (a multiple of the world size), in place of the
    model's; None: the model's (a tool may cap it, e.g. `dbo bench` per rank)."""
    #: Whether a bad value is named as its command-line option (`--num-experts=0: must be
    #: >= 1`, `dbo run`) or as the field (`num_experts=0 must be a positive int (or
    #: unset)`, the bench configs, which are also built in Python).
    errors_name_options: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.num_experts
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"--num-experts={value}: must be >= 1" if self.errors_name_options
                             else f"num_experts={value!r} must be a positive int (or unset)")
