"""Triton kernels and their torch references, below the MoE runtime: they import
nothing of it above the workspace (no `moe.config`, `moe.experts`, `moe.layer`); what
they need comes as arguments (`tests/test_layers.py` holds them to it).

- `fused_moe/`: the fused-MoE expert GEMMs (its own rules and launch choice);
- `policy.py`: `KernelPolicy`, the choice between kernel paths every kernel room reads;
- `launch.py`: compiled-handle launches; `rows*.py`: packing rows and the sums over
  them (the backends' and the fused MoE's k-sum); `route_triton.py`: the router's
  kernel; `topk_sum.py`: the weighted k-sum in torch.

The backends' slot and send-order kernels are in `moe.backends.kernels`, rotary in
`moe.models.rotary`.

The tools import the kernel policy from here and the fused MoE from `moe.kernels.fused_moe`
(`__all__`, tests/test_layers.py).
"""
from moe.kernels.policy import KernelPolicy

__all__ = ["KernelPolicy"]
