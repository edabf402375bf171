"""`exchange_capacity`: a smaller exchange for calls known to hold fewer tokens than a
fixed-capacity backend's configured capacity.

    with exchange_capacity(tokens_per_rank=64, tokens_per_ubatch=32):
        logits = model(decode_ids)       # a2a_ll sends W x 64 slot rows, not W x C

A fixed-capacity backend (`a2a_ll`) pads every exchange to its capacity C
(`MoEConfig.max_tokens_per_rank`; in a DBO step `max_tokens_per_ubatch`): W * C slot
rows each way, whatever the call holds. A model whose capacity is set for its prompt
(B * S tokens per rank) would move the prompt's slots again at every decode step of B
tokens. Within this context the backend sizes its slots for at most `tokens_per_rank`
(a DBO ubatch: `tokens_per_ubatch`) instead, never above its configured capacity.

Every rank of the group must enter it with the same values (the exchange's sizes must
agree on every rank), and every rank's tokens must fit. It enters
`dbo.step_vote.step_token_limit` with its values, so a `DBORunner` step (DBO on or off)
votes them and raises `ConfigMismatchError` on every rank where the ranks entered
different ones (or one none), and stops a step whose tokens exceed them on every rank,
before any collective. A call outside a runner that exceeds it raises ValueError naming
it on the rank that holds them (its peers are not told). `moe.hf.generate` uses it for
its decode steps, with the largest batch over the ranks. Under a CUDA graph the capture
keeps the sizes it saw: replay a graph only within the values it was captured with.
The value is a context variable: it follows the code that entered it, greenlets of a
DBO step included (they run in the context of the call that started them).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional

from dbo.step_vote import TokenLimit, current_token_limit, step_token_limit

__all__ = ["ExchangeCapacity", "exchange_capacity", "step_capacity"]


@dataclass(frozen=True)
class ExchangeCapacity(TokenLimit):
    """Slot rows per rank of one exchange: of a whole step, and of a DBO ubatch (the
    token limit it enters, `dbo.step_vote.TokenLimit`)."""

    entered_by: ClassVar[str] = "exchange_capacity"


@contextmanager
def exchange_capacity(tokens_per_rank: int,
                      tokens_per_ubatch: Optional[int] = None) -> Iterator[ExchangeCapacity]:
    """Within: fixed-capacity backends send slots of at most `tokens_per_rank` rows per
    rank (`tokens_per_ubatch` in a DBO ubatch; default `tokens_per_rank`)."""
    value = ExchangeCapacity(tokens_per_rank, tokens_per_ubatch or tokens_per_rank)
    with step_token_limit(value.tokens_per_rank, value.tokens_per_ubatch):
        yield value


def step_capacity(configured: int, *, ubatch: bool, num_tokens: int, backend: str) -> int:
    """The slot rows of this exchange: `configured` (the backend's capacity for a step or,
    `ubatch`, a DBO ubatch; `num_tokens` already checked against it), or the smaller
    `exchange_capacity` in force; ValueError where `num_tokens` exceeds that."""
    current = current_token_limit()  # `exchange_capacity` entered it
    if current is None:
        return configured
    limit = current.tokens_per_ubatch if ubatch else current.tokens_per_rank
    if num_tokens > limit:
        raise ValueError(
            f"backend {backend!r}: {num_tokens} tokens on this rank exceed the "
            f"exchange_capacity({'tokens_per_ubatch' if ubatch else 'tokens_per_rank'}="
            f"{limit}) in force: enter it with the largest token count of any rank")
    return min(configured, limit)
