"""Where to split one step into two ubatches (pure functions, no torch.distributed).

    plan = plan_split(seq_lens, config)          # requests: token-balanced
    plan = plan_token_split(num_tokens, config)  # independent tokens: halve
    if plan.split:
        ub0, ub1 = plan.ubatches                 # token ranges + per-ubatch seq_lens

Policy (DESIGN.md, "Splitting"):
- Steps below a token threshold run unsplit: `min_decode_tokens` when every request has
  one token (decode), else `min_prefill_tokens`. 0 or 1 tokens never split, nor does a
  step whose split would leave a ubatch without tokens.
- Decode halves the requests. Otherwise the best request-boundary split (least
  |n0 - n1|) is taken unless its imbalance |n0 - n1| / total exceeds `max_imbalance`;
  then, where a request may be cut (`request_cut_blocker`), one request is split inside
  so that ubatch 0 gets floor(total / 2) tokens, and where none may, the step runs
  unsplit. The head of a cut request stays in ubatch 0 and its tail opens ubatch 1; each
  ubatch's `seq_lens` count only its own tokens, so its cu_seqlens start at 0
  ("rebased"), and `first_request_offset` says where ubatch 1's first request resumes.
- A cut is only right for a model whose output for a token does not depend on the
  request's other tokens in the same call, or that carries the head's state into the
  tail's call (a per-ubatch KV cache at `first_request_offset`): attention over the
  call's tokens alone would give the tail wrong outputs. The model says so with a
  `dbo_can_split_inside_request() -> bool` method (looked up on the model itself, not
  its submodules: one token-wise layer says nothing about the others); without it, or
  with `DBOConfig.split_inside_requests=False`, no request is cut.
- Token-major tensors (hidden states, absolute positions, slot mappings) are sliced by
  `[token_start:token_end]`; absolute positions need no fix-up.

Legend: T = tokens of the step, R = requests of the step.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Any, Optional, Sequence, Union

import torch

from dbo.config import DBOConfig
from dbo.model_hooks import CUT_HOOK, ModelHooks
from dbo.split.plan import SplitPlan, UBatchSlice

SeqLens = Union[Sequence[int], torch.Tensor]



def normalize_seq_lens(seq_lens: SeqLens, *, num_tokens: Optional[int] = None) -> tuple[int, ...]:
    """Check `seq_lens` (tokens per request: ints or a 1-D int tensor); return a tuple.

    Raises ValueError for negative lengths or, when `num_tokens` is given, a sum that
    differs from it; TypeError for non-integer input.
    """
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1 or seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex \
                or seq_lens.dtype == torch.bool:
            raise TypeError(f"seq_lens must be a 1-D integer tensor (tokens per request), got "
                            f"shape {list(seq_lens.shape)} dtype {seq_lens.dtype}: pass e.g. "
                            f"torch.tensor([5, 3], dtype=torch.int32)")
        lens = tuple(int(v) for v in seq_lens.tolist())
    elif isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence):
        raise TypeError(f"seq_lens must be a list/tuple of ints or a 1-D int tensor (tokens "
                        f"per request), got a {type(seq_lens).__name__}: {seq_lens!r}")
    else:
        bad = [v for v in seq_lens if isinstance(v, bool) or not isinstance(v, int)]
        if bad:
            raise TypeError(f"seq_lens must hold ints (tokens per request), got {bad[0]!r} "
                            f"({type(bad[0]).__name__}) in {list(seq_lens)}")
        lens = tuple(seq_lens)
    negative = [(i, v) for i, v in enumerate(lens) if v < 0]
    if negative:
        i, v = negative[0]
        raise ValueError(f"seq_lens[{i}]={v} is negative: each entry is a request's token "
                         f"count in this step (>= 0)")
    if num_tokens is not None and sum(lens) != num_tokens:
        raise ValueError(f"seq_lens sum to {sum(lens)} tokens but the batch has {num_tokens} "
                         f"tokens (dim 0 of the token-major inputs): pass one entry per "
                         f"request, counting this step's tokens only; got {_short(lens)}")
    return lens


def plan_token_split(num_tokens: int, config: DBOConfig = DBOConfig()) -> SplitPlan:
    """Plan a "tokens" mode split: independent rows, halved (ubatch 0 gets T // 2).

    Rows carry no request structure, so they are treated like decode tokens and
    `config.min_decode_tokens` applies.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
    skip = _below_threshold(num_tokens, is_decode=True, config=config)
    if skip is not None:
        return _unsplit(num_tokens, skip, is_decode=True)
    half = num_tokens // 2
    ubatches = (
        UBatchSlice(ubatch_id=0, token_start=0, token_end=half, request_start=0,
                    request_end=half, seq_lens=None),
        UBatchSlice(ubatch_id=1, token_start=half, token_end=num_tokens, request_start=half,
                    request_end=num_tokens, seq_lens=None),
    )
    return SplitPlan(split=True, reason=f"halved {num_tokens} independent tokens into "
                     f"{half} + {num_tokens - half}", num_tokens=(half, num_tokens - half),
                     is_decode=True, ubatches=ubatches)


def plan_split(seq_lens: SeqLens, config: DBOConfig = DBOConfig(), *,
               num_tokens: Optional[int] = None,
               allow_split_inside_request: bool = True,
               whole_requests: Optional[str] = None) -> SplitPlan:
    """Plan a token-balanced split of a step whose requests have `seq_lens` tokens.

    Args:
        seq_lens: tokens per request in this step ([R] ints or a 1-D int tensor).
        config: thresholds (`min_decode_tokens`, `min_prefill_tokens`, `max_imbalance`).
        num_tokens: when given, `seq_lens` must sum to it (dim 0 of the token tensors).
        allow_split_inside_request: False keeps every request whole and takes the best
            boundary whatever `max_imbalance` says ("batch" mode: padded rows of one
            length, which split as evenly as whole rows can).
        whole_requests: why no request may be cut (`request_cut_blocker`), or None when
            one may: a step whose best boundary exceeds `max_imbalance` then runs
            unsplit, with this in its reason.
    """
    lens = normalize_seq_lens(seq_lens, num_tokens=num_tokens)
    prefix = [0, *itertools.accumulate(lens)]  # prefix[k] = tokens of requests [0, k)
    total = prefix[-1]
    is_decode = total > 0 and max(lens) <= 1
    skip = _below_threshold(total, is_decode=is_decode, config=config)
    if skip is not None:
        return _unsplit(total, skip, is_decode=is_decode)

    cut = _best_boundary(prefix)  # None: every boundary leaves a side without tokens
    imbalance = 1.0 if cut is None else abs(total - 2 * prefix[cut]) / total
    if is_decode:
        assert cut is not None  # total >= 2 one-token requests
        return _boundary_plan(lens, prefix, cut, is_decode,
                              f"decode: halved {_nonempty(lens)} requests into "
                              f"{prefix[cut]} + {total - prefix[cut]}")
    # A boundary as balanced as the token count allows (odd totals: off by one) is never
    # worse than a cut inside a request.
    as_good_as_any = cut is not None and abs(total - 2 * prefix[cut]) <= total % 2
    if imbalance <= config.max_imbalance or as_good_as_any or not allow_split_inside_request:
        if cut is None:
            why = ("splitting inside a request is off for this split mode"
                   if not allow_split_inside_request else
                   f"max_imbalance={config.max_imbalance} forbids splitting inside a request")
            return _unsplit(total, f"either ubatch would be empty: the {total} tokens are in "
                            f"one request and {why}", is_decode=False)
        if imbalance <= config.max_imbalance:
            why = f"<= max_imbalance {config.max_imbalance}"
        elif as_good_as_any:
            why = f"as balanced as {total} tokens allow"
        else:
            why = "splitting inside a request is off for this split mode"
        return _boundary_plan(lens, prefix, cut, is_decode,
                              f"split at request boundary {cut}: {prefix[cut]} + "
                              f"{total - prefix[cut]} tokens (imbalance {imbalance:.3f}, {why})")

    if whole_requests is not None:
        best = ("the tokens are in one request" if cut is None else
                f"the best request-boundary split {prefix[cut]} + {total - prefix[cut]} has "
                f"imbalance {imbalance:.3f} > max_imbalance {config.max_imbalance}")
        return _unsplit(total, f"no balanced split: {best}, and no request is cut: "
                        f"{whole_requests}", is_decode=False)
    half = total // 2
    r = bisect.bisect_right(prefix, half) - 1  # request holding token `half`
    assert prefix[r] < half < prefix[r + 1], "a boundary at half is taken above"
    offset = half - prefix[r]
    head, tail = offset, lens[r] - offset
    before = ("no request boundary" if cut is None else
              f"best request-boundary split {prefix[cut]} + {total - prefix[cut]}")
    ubatches = (
        UBatchSlice(ubatch_id=0, token_start=0, token_end=half, request_start=0,
                    request_end=r + 1, seq_lens=(*lens[:r], head)),
        UBatchSlice(ubatch_id=1, token_start=half, token_end=total, request_start=r,
                    request_end=len(lens), seq_lens=(tail, *lens[r + 1:]),
                    first_request_offset=offset),
    )
    return SplitPlan(
        split=True, is_decode=False, ubatches=ubatches, num_tokens=(half, total - half),
        reason=f"split inside request {r} at its token {offset}: {half} + {total - half} "
               f"tokens ({before}, imbalance {imbalance:.3f} > max_imbalance "
               f"{config.max_imbalance})")


def request_positions(seq_lens: SeqLens, *, first_request_offset: int = 0,
                      device: Union[torch.device, str, None] = None) -> torch.Tensor:
    """Positions of each token within its request's tokens of the step, int64 [T].

    For a ubatch, pass its `seq_lens` and `first_request_offset`: the result equals the
    step's `request_positions(step_seq_lens)[token_start:token_end]`.
    """
    lens = normalize_seq_lens(seq_lens)
    if isinstance(first_request_offset, bool) or not isinstance(first_request_offset, int) \
            or first_request_offset < 0:
        raise ValueError(f"first_request_offset={first_request_offset!r} must be an int >= 0")
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    request_of_token = torch.repeat_interleave(
        torch.arange(len(lens), dtype=torch.int64, device=device), lens_t)
    first_token_of_request = torch.cumsum(lens_t, 0) - lens_t
    positions = torch.arange(sum(lens), dtype=torch.int64, device=device) \
        - first_token_of_request[request_of_token]
    if lens and first_request_offset:
        positions[:lens[0]] += first_request_offset
    return positions


def request_cut_blocker(model: Any, config: DBOConfig) -> Optional[str]:
    """Why "requests" mode may not cut a request of `model` (or of the model whose
    `ModelHooks` it is: `dbo.model_hooks`) across the two ubatches, or None when it may
    (module doc):
    `config.split_inside_requests`, else the model's `dbo_can_split_inside_request()`.

    Raises ValueError when the config asks for cuts that the model says are wrong, and
    TypeError when the hook returns something other than a bool.
    """
    hooks = model if isinstance(model, ModelHooks) else ModelHooks.of(model)
    name = hooks.type_name
    says = hooks.can_split_inside_request
    if config.split_inside_requests is False:
        return "DBOConfig.split_inside_requests=False"
    if config.split_inside_requests:
        if says is False:
            raise ValueError(
                f"DBOConfig(split_inside_requests=True), but {name}.{CUT_HOOK}() is False: "
                f"a request cut across the two ubatches would give it wrong outputs (its "
                f"tail would run without its head). Drop split_inside_requests (requests "
                f"then stay whole), or set max_imbalance=1.0 to split at any request boundary")
        return None
    if says:
        return None
    why = (f"{name}.{CUT_HOOK}() is False" if says is False else
           f"{name} does not say that a request may run in two calls (no {CUT_HOOK}() "
           f"method; DBOConfig(split_inside_requests=True) if it may)")
    return f"{why}; max_imbalance=1.0 splits at any request boundary"


# ---------------------------------------------------------------------------- helpers
def _below_threshold(total: int, *, is_decode: bool, config: DBOConfig) -> Optional[str]:
    """The reason not to split a step of `total` tokens, or None."""
    if total == 0:
        return "empty batch: 0 tokens"
    if total == 1:
        return "1 token cannot be split"
    name = "min_decode_tokens" if is_decode else "min_prefill_tokens"
    minimum = getattr(config, name)
    if total < minimum:
        kind = "decode" if is_decode else "prefill"
        return f"{total} tokens < {name}={minimum} ({kind})"
    return None


def _best_boundary(prefix: list[int]) -> Optional[int]:
    """The request boundary k (0 < prefix[k] < total) closest to half, ties to the left."""
    total = prefix[-1]
    best: Optional[int] = None
    j = bisect.bisect_left(prefix, total / 2)  # first boundary with prefix >= half
    for k in (bisect.bisect_left(prefix, prefix[j - 1]) if j > 0 else None, j):
        # bisect_left again: among zero-length requests, cut before them (they go right)
        if k is None or not 0 < prefix[k] < total:
            continue
        if best is None or abs(total - 2 * prefix[k]) < abs(total - 2 * prefix[best]):
            best = k
    return best


def _boundary_plan(lens: tuple[int, ...], prefix: list[int], cut: int, is_decode: bool,
                   reason: str) -> SplitPlan:
    total = prefix[-1]
    ubatches = (
        UBatchSlice(ubatch_id=0, token_start=0, token_end=prefix[cut], request_start=0,
                    request_end=cut, seq_lens=lens[:cut]),
        UBatchSlice(ubatch_id=1, token_start=prefix[cut], token_end=total, request_start=cut,
                    request_end=len(lens), seq_lens=lens[cut:]),
    )
    return SplitPlan(split=True, reason=reason, is_decode=is_decode, ubatches=ubatches,
                     num_tokens=(prefix[cut], total - prefix[cut]))


def _unsplit(total: int, reason: str, *, is_decode: bool) -> SplitPlan:
    return SplitPlan(split=False, reason=reason, num_tokens=(total,), is_decode=is_decode)


def _nonempty(lens: tuple[int, ...]) -> int:
    return sum(1 for v in lens if v)


def _short(values: tuple[int, ...], limit: int = 16) -> str:
    if len(values) <= limit:
        return str(list(values))
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} entries)]"
