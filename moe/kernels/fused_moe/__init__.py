"""The fused-MoE expert GEMMs: the host (`host.fused_moe`), which takes its paths by
its own rules (`rules`, on a `moe.kernels.policy.KernelPolicy` and the caller's word on
whether other streams' kernels share the SMs), the routing's alignment into expert
blocks (`align`, `align_triton`), the Triton kernels (`gemm_triton`,
`persistent_triton`, `epilogue_triton`), their tiles and autotuners (`tiles`) and an
expert form's flags per GEMM (`form`). What the tuning learned: `KERNELS.md`.

Importing this package imports no Triton (the host and kernel modules do, when
imported themselves).
"""
