"""The base of each MoE backend's own options (`MoEConfig.backend_options`).

A backend's options are the settings only it reads (a2a_ll's ubatch capacity, DeepEP's
receive form, ...). Each backend defines its options dataclass in its own file, a
frozen keyword-only subclass of `BackendOptions`, and names it in its class attribute
`PrepareFinalize.options_type`; a backend with none takes `NoOptions`. This module
imports nothing of the project, so `moe.config` can hold the type.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """Base of a backend's options: its fields are read by that backend alone."""

    #: The backend these options belong to (named when they are given to another one);
    #: None for `NoOptions`, which every backend without options takes.
    backend_name: ClassVar[Optional[str]] = None

    def __post_init__(self) -> None:
        """TypeError for a field declared `bool` that holds anything else (a 1 or a
        "yes" would otherwise pass for True); subclasses with checks of their own call
        this first."""
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"{type(self).__name__}.{field.name}={value!r}: must be True "
                                f"or False (a bool, not a {type(value).__name__}).")

    def check(self, config: Any) -> None:
        """Raise ValueError, naming the field and the fix, where these options do not fit
        the rest of `config`, a `moe.config.MoEConfig` (e.g. a capacity above `config.max_tokens_per_rank`); run by
        `MoEConfig.__post_init__`. Nothing by default."""


@dataclass(frozen=True, kw_only=True)
class NoOptions(BackendOptions):
    """The options of a backend that has none of its own."""
