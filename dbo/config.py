"""Configuration of a DBO step: whether to split, how to split, how to merge.

    DBORunner(model)                       # split mode: what the model or the call says
    DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=256))

One frozen, keyword-only dataclass; every field has a one-line doc and `__post_init__`
rejects bad values with a message that says how to fix them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Any, Callable, Union

# An argument of the model call: its position (int) or its keyword name (str).
ArgName = Union[int, str]

# The named split modes (see `DBOConfig.split`; None there picks one per call,
# `dbo.split.modes.auto_split_mode`).
SPLIT_MODES: tuple[str, ...] = ("tokens", "requests", "batch")

# The overlap policies (see `DBOConfig.overlap`, `dbo.overlap`).
OVERLAP_MODES: tuple[str, ...] = ("dbo", "auto", "sbo", "none")

# A callable split mode: `split(args, kwargs)` returns one `(args, kwargs)` pair per
# ubatch, or None to run the step unsplit.
SplitFn = Callable[[tuple, dict], Union[list[tuple[tuple, dict]], None]]

# A custom merge: `merge([out0, out1])` returns the step's output.
MergeFn = Callable[[list[Any]], Any]


@dataclass(frozen=True, kw_only=True)
class DBOConfig:
    """How `DBORunner` splits a step into two ubatches and merges their outputs."""

    enabled: bool = True
    """Run steps as two overlapped ubatches when the policy allows; False: call the model as is."""
    split: Union[str, SplitFn, None] = None
    """Split mode: "tokens" (dim 0 = independent tokens), "requests" (`seq_lens=` kwarg), "batch" (dim 0 = sequences), a callable, or None (auto, per call: the model's `dbo_split_mode()`, else "requests" when the call has a `seq_lens=` keyword, else "tokens"; `SplitPlan.reason` says which)."""
    overlap: str = "dbo"
    """Overlap policy per step (`dbo.overlap`): "dbo" splits above the thresholds, else no overlap; "auto" splits above them, else single-batch overlap (shared experts under the dispatch, one ubatch) where the model offers it; "sbo" never splits, always single-batch overlap where offered; "none" never overlaps."""
    joined_experts: bool = False
    """In a split step, run each MoE layer's experts once over both ubatches' dispatched rows (the ubatches meet there, `dbo.meet`), so each expert's weights are read once per step rather than once per ubatch; the attention, dispatch and combine still overlap across the ubatches. For weight-bound experts (decode, many experts per rank), where the split's second weight read costs what the overlap hides."""
    num_ubatches: int = 2
    """Number of ubatches per split step; only 2 is supported."""
    min_decode_tokens: int = 32
    """Smallest decode step (every request has one token; every "tokens" mode step) that is split."""
    min_prefill_tokens: int = 512
    """Smallest step with a multi-token request (prefill, "batch" mode with S > 1) that is split."""
    max_imbalance: float = 0.1
    """Largest |n0 - n1| / total of a "requests" mode split at a request boundary; beyond it a request is cut inside where `split_inside_requests` allows, else the step runs unsplit (1.0: any boundary, never a cut)."""
    split_inside_requests: Optional[bool] = None
    """"requests" mode (also as chosen by split=None): may a request be cut across the two ubatches? None: only where the model's `dbo_can_split_inside_request()` says True (token-wise models, or a per-ubatch KV cache that holds the head); True: the caller says it may (refused for a model that says False); False: never."""
    gemm_sm_carveout: Optional[int] = 4
    """SMs that torch's (cuBLAS) GEMMs leave free for the comm kernels while a split step runs (`streams.gemm_carveout`); None or 0: every SM. NCCL runs the scale-out all-to-all on 4 CTAs."""
    merge: Union[MergeFn, None] = None
    """Custom merge of the per-ubatch outputs, `merge([out0, out1])`; None: concatenate along dim 0."""
    unsplit_args: tuple[ArgName, ...] = ()
    """Tensor arguments both ubatches get whole (e.g. a mask or table not indexed by row), by position (0, 1, ...) or keyword name; other tensors must have the step's rows in dim 0."""
    split_kwargs: tuple[str, ...] = ()
    """Keyword tensors that are row-major (dim 0 = the step's tokens, or sequences in "batch" mode), split like the positional ones without the runner's one-time warning."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"DBOConfig.enabled must be True or False, got {self.enabled!r} "
                            f"(a {type(self.enabled).__name__}, not a bool)")
        if isinstance(self.split, str):
            if self.split not in SPLIT_MODES:
                raise ValueError(
                    f"DBOConfig.split={self.split!r} is not a split mode: use one of "
                    f"{', '.join(repr(m) for m in SPLIT_MODES)}, None (the default: the "
                    f"model's or the call's mode), or a callable "
                    f"split(args, kwargs) -> [(args0, kwargs0), (args1, kwargs1)] | None")
        elif self.split is not None and not callable(self.split):
            raise ValueError(
                f"DBOConfig.split must be one of {', '.join(repr(m) for m in SPLIT_MODES)}, "
                f"None (the model's or the call's mode) or a callable, got a "
                f"{type(self.split).__name__}: {self.split!r}")
        if not isinstance(self.joined_experts, bool):
            raise TypeError(f"DBOConfig.joined_experts must be True or False, got "
                            f"{self.joined_experts!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"DBOConfig.overlap={self.overlap!r} is not an overlap policy: use "
                             f"one of {', '.join(repr(m) for m in OVERLAP_MODES)}")
        if not _is_int(self.num_ubatches) or self.num_ubatches != 2:
            raise ValueError(f"DBOConfig.num_ubatches={self.num_ubatches!r}: only 2 ubatches "
                             f"are supported, set num_ubatches=2 (the default)")
        if self.gemm_sm_carveout is not None and (
                not _is_int(self.gemm_sm_carveout) or self.gemm_sm_carveout < 0):
            raise ValueError(f"DBOConfig.gemm_sm_carveout={self.gemm_sm_carveout!r}: an int >= 0 "
                             f"(SMs left to the comm kernels), or None for every SM")
        for name in ("min_decode_tokens", "min_prefill_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"DBOConfig.{name}={value!r} must be an int >= 0 (a token "
                                 f"count; steps with fewer tokens run unsplit)")
        if (isinstance(self.max_imbalance, bool) or not isinstance(self.max_imbalance, (int, float))
                or not 0.0 <= self.max_imbalance <= 1.0):
            raise ValueError(
                f"DBOConfig.max_imbalance={self.max_imbalance!r} must be a number in [0, 1]: "
                f"0.0 cuts a request (where allowed) or runs unsplit unless the request "
                f"boundaries balance exactly, 1.0 splits at any request boundary")
        if self.split_inside_requests is not None and not isinstance(
                self.split_inside_requests, bool):
            raise TypeError(f"DBOConfig.split_inside_requests={self.split_inside_requests!r} "
                            f"must be None (the model decides), True or False")
        if self.split_inside_requests and self.split not in ("requests", None):
            raise ValueError(
                f"DBOConfig.split_inside_requests=True cuts the requests of split='requests', "
                f"but split={getattr(self.split, '__name__', self.split)!r} has none to cut "
                f"(\"tokens\": every row is its own request; \"batch\": a padded sequence "
                f"stays whole; a callable splits as it likes): drop split_inside_requests")
        if self.merge is not None and not callable(self.merge):
            raise ValueError(f"DBOConfig.merge must be None or a callable merge([out0, out1]), "
                             f"got a {type(self.merge).__name__}: {self.merge!r}")
        self._check_arg_declarations()

    def _check_arg_declarations(self) -> None:
        """`unsplit_args` / `split_kwargs`: tuples (lists are taken as tuples) of names."""
        for name, allowed in (("unsplit_args", "positions (ints >= 0) or keyword names"),
                              ("split_kwargs", "keyword names")):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise ValueError(f"DBOConfig.{name}={value!r} must be a tuple of {allowed}, "
                                 f"e.g. {name}=({value!r},)")
            object.__setattr__(self, name, tuple(value))
            for item in value:
                is_position = name == "unsplit_args" and _is_int(item) and item >= 0
                if not is_position and not (isinstance(item, str) and item.isidentifier()):
                    raise ValueError(f"DBOConfig.{name} holds {item!r}: it takes {allowed} "
                                     f"of the model call's arguments")
        both = sorted(set(self.split_kwargs) & set(self.unsplit_args), key=str)
        if both:
            raise ValueError(f"DBOConfig names {both} in both unsplit_args and split_kwargs: "
                             f"an argument is either passed whole or split, keep it in one")
        declared = self.unsplit_args + self.split_kwargs
        if callable(self.split) and declared:
            raise ValueError(f"DBOConfig(unsplit_args=..., split_kwargs=...) declare how a "
                             f"named split mode treats arguments, but the callable split "
                             f"{getattr(self.split, '__name__', self.split)!r} splits them "
                             f"itself: drop {list(declared)}")
        if self.split == "requests" and "seq_lens" in declared:
            raise ValueError("DBOConfig(split='requests') gives each ubatch its own seq_lens: "
                             "drop 'seq_lens' from unsplit_args / split_kwargs")
        if self.split is None and "seq_lens" in declared:
            raise ValueError("DBOConfig(split=None) splits a call with seq_lens= by its "
                             "requests, each ubatch getting its own seq_lens: drop 'seq_lens' "
                             "from unsplit_args / split_kwargs, or set split='tokens' if it "
                             "is a plain argument of independent rows")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
