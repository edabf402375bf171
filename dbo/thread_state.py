"""Per-thread PyTorch state that every greenlet of a thread shares.

Grad mode and autocast are thread-local in PyTorch, so when one ubatch enters
`torch.no_grad()` and yields inside it, the other ubatch would run without grad too.
The scheduler snapshots this state when a ubatch hands off and re-applies the resumed
ubatch's snapshot, calling into PyTorch only for what differs. (The current CUDA stream
is handled separately, through `streams.CurrentStream`.)

A snapshot is a plain tuple `(grad_enabled, autocast_enabled, autocast_dtype or None)`:
it is taken on every hand-off, and a dataclass would cost ~1 us more each time. The
autocast dtype is read only while autocast is on (it matters only then).
"""
from __future__ import annotations

from typing import Optional

import torch

ThreadState = tuple[bool, bool, Optional[torch.dtype]]

_is_grad_enabled = torch.is_grad_enabled
_is_autocast_enabled = torch.is_autocast_enabled


def capture_thread_state(device_type: str) -> ThreadState:
    """The thread's grad mode and `device_type` autocast state now."""
    if _is_autocast_enabled(device_type):
        return (_is_grad_enabled(), True, torch.get_autocast_dtype(device_type))
    return (_is_grad_enabled(), False, None)


def apply_thread_state(device_type: str, state: ThreadState, previous: ThreadState) -> None:
    """Make `state` the thread's state, given that `previous` is the state now."""
    if state is previous or state == previous:
        return
    if state[0] != previous[0]:
        torch.set_grad_enabled(state[0])
    if state[1] != previous[1]:
        torch.set_autocast_enabled(device_type, state[1])
    if state[2] is not None and state[2] != previous[2]:
        torch.set_autocast_dtype(device_type, state[2])
