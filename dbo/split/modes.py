"""Which split mode a call takes under `DBOConfig(split=None)` (the default), and why.

    mode, why = auto_split_mode(kwargs, model_mode=hooks.split_mode, model_name=hooks.name)
    mode, why = SplitModeChooser().choose(hooks, config, kwargs)   # kept per call kind

`DBOConfig(split=None)` picks a named mode per call (`auto_split_mode`): the one the
model declares with a `dbo_split_mode()` method (or attribute; looked up on the model
itself, like `dbo_can_split_inside_request`: `dbo.model_hooks`), else "requests" when
the call has a `seq_lens=` keyword, else "tokens". The runner says which, and why, in
the plan's reason.
"""
from __future__ import annotations

from typing import Any, Optional

from dbo.config import DBOConfig
from dbo.model_hooks import SPLIT_MODE_HOOK, ModelHooks

__all__ = ["SEQ_LENS_KWARG", "SPLIT_MODE_HOOK", "SplitModeChooser", "auto_split_mode",
           "model_split_mode"]

SEQ_LENS_KWARG = "seq_lens"


def model_split_mode(model: Any) -> Optional[str]:
    """The named split mode `model` declares (`dbo_split_mode()`, or a `dbo_split_mode`
    attribute), or None where it declares none. Raises ValueError for anything other
    than a named mode (`dbo.model_hooks.ModelHooks.split_mode`)."""
    return ModelHooks.of(model).split_mode


def auto_split_mode(kwargs: dict, *, model_mode: Optional[str], model_name: str
                    ) -> tuple[str, str]:
    """The named mode `DBOConfig(split=None)` takes for a call with keyword arguments
    `kwargs`, and why: `model_mode` (the model's `dbo_split_mode`) where it declares
    one, else "requests" where the call has `seq_lens=`, else "tokens"."""
    if model_mode is not None:
        return model_mode, f"{model_name}.{SPLIT_MODE_HOOK} says so"
    if SEQ_LENS_KWARG in kwargs:
        return "requests", f"the call has {SEQ_LENS_KWARG}="
    return "tokens", (f"{model_name} declares no {SPLIT_MODE_HOOK} and the call has no "
                      f"{SEQ_LENS_KWARG}=")


class SplitModeChooser:
    """The split mode of each call of one runner and, where `DBOConfig(split=None)` chose
    it, the words for the plan's reason (`auto_split_mode`). The choice depends only on
    the model, the config and whether the call has `seq_lens=`: it is kept per the last,
    and made again only when the model's hooks or the config are replaced."""

    def __init__(self) -> None:
        self._for: tuple[Any, Any] = (None, None)  # (hooks, config) of `_modes`
        self._modes: dict[bool, tuple[str, str]] = {}  # has seq_lens= -> (mode, why)

    def choose(self, hooks: ModelHooks, config: DBOConfig, kwargs: dict
               ) -> tuple[Any, Optional[str]]:
        """(mode, why): `config.split` and None where it names one; else the chosen mode."""
        if config.split is not None:
            return config.split, None
        if self._for[0] is not hooks or self._for[1] is not config:
            self._for, self._modes = (hooks, config), {}
        has_seq_lens = SEQ_LENS_KWARG in kwargs
        chosen = self._modes.get(has_seq_lens)
        if chosen is None:
            chosen = self._modes[has_seq_lens] = _choose(hooks, config, kwargs)
        return chosen


def _choose(hooks: ModelHooks, config: DBOConfig, kwargs: dict) -> tuple[str, str]:
    mode, why = auto_split_mode(kwargs, model_mode=hooks.split_mode, model_name=hooks.name)
    if config.split_inside_requests and mode != "requests":
        raise ValueError(
            f"DBOConfig(split_inside_requests=True) cuts requests, but split=None chose "
            f"{mode!r} for this call ({why}), which has none to cut: pass the tokens "
            f"per request as seq_lens=[...] (split='requests'), or drop "
            f"split_inside_requests")
    return mode, f"split=None chose {mode!r}: {why}"
