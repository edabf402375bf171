"""The backends' own kernels: `a2a_ll`'s slot layout (`slots`, `slots_triton`) and
`symm_mem`'s send order (`send_order_triton`). Like `moe.kernels` they import nothing of
the MoE runtime above the workspace (`tests/test_layers.py`). The backends import them
from their modules; no tool does, so this package re-exports nothing."""

__all__: list[str] = []
