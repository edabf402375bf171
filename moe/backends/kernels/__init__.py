"""The backends' own kernels: `a2a_ll`'s slot layout (`slots`, `slots_triton`) and
`symm_mem`'s send order (`send_order_triton`). Like `moe.kernels` they import nothing of
the MoE runtime above the workspace (`tests/test_layers.py`)."""
