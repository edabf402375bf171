"""A step's split decision: `SplitPlan` (whether, why, the tokens per ubatch, the group's
figures from the vote, the overlap mode) and its `UBatchSlice`s (each ubatch's token
range and requests). Data only; `dbo.split.balance` and `dbo.split.call` make them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class UBatchSlice:
    """One ubatch of a split step: a token range of the step and its requests."""

    ubatch_id: int
    """0 or 1."""
    token_start: int
    """First token of the ubatch, an index into the step's token-major tensors."""
    token_end: int
    """One past the ubatch's last token."""
    request_start: int
    """First request of the ubatch, an index into the step's requests."""
    request_end: int
    """One past the ubatch's last request (a request split inside counts in both ubatches)."""
    seq_lens: Optional[tuple[int, ...]]
    """Tokens per request of this ubatch only; None in "tokens" mode (no request structure)."""
    first_request_offset: int = 0
    """Where this ubatch's first request starts among that request's tokens of the step (0 unless split inside)."""

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_requests(self) -> int:
        return self.request_end - self.request_start

    def cu_seqlens(self) -> list[int]:
        """Rebased cumulative sequence lengths of this ubatch: [0, ..., num_tokens]."""
        if self.seq_lens is None:
            raise ValueError(f"ubatch {self.ubatch_id} has no request structure (\"tokens\" "
                             f"mode): split with split=\"requests\" to get cu_seqlens")
        return [0, *itertools.accumulate(self.seq_lens)]


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    """The split decision for one step, with the reason for it."""

    split: bool
    """Whether the step runs as two ubatches."""
    reason: str
    """Why (or why not), for logs and tests."""
    num_tokens: tuple[int, ...]
    """Tokens per ubatch when split, else (total,); () when no plan was made (a runner
    called inside a running DBO step)."""
    is_decode: bool = False
    """Every request had one token (or "tokens" mode): the decode threshold applied."""
    ubatches: tuple[UBatchSlice, ...] = ()
    """The two ubatches when split, else empty."""
    vetoed: bool = False
    """This rank wanted to split, but a peer rank of the group did not."""
    group_max_tokens: Optional[int] = None
    """The largest token count of any rank of the group this step (from the vote)."""
    group_decode: Optional[bool] = None
    """Every rank of the group had a decode-shaped step (from the vote; None without one)."""
    overlap: str = "none"
    """The mode the step ran: "dbo" (split), "joined" (split, its experts joined: `DBOConfig.joined_experts`), "sbo" (single-batch overlap) or "none" (`dbo.overlap`)."""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)
