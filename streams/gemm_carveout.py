"""Dense GEMMs that leave SMs free for the communication kernels running beside them.

    with gemm_sm_carveout(4, device):   # torch's GEMMs target all SMs but 4
        ...                             # (DBORunner does this around a split step)

cuBLAS's Hopper GEMMs (the `nvjet` kernels) are persistent: about one CTA per SM walks a
schedule of output tiles. When a communication kernel holds a few SMs on another stream,
the GEMM's CTAs on those SMs fall behind and the GEMM ends when they do. Measured on 2
H200s (BENCHMARKS.md section 3, NCCL runs the scale-out emulated all-to-all
on 4 CTAs there): the layer stand-in's six dense GEMMs at 2048 rows took 18% longer
beside an all-to-all than alone. With cuBLASLt and 4 SMs carved out they took 1% longer
than that alone, which was itself 5% slower than cuBLAS on every SM. At the power limit,
in whole DBO steps of DeepSeek-V3 layers, 4 SMs made the step 0.1-0.9 ms (0-2%) faster
at 4096 tokens per rank and 0.7 ms at 8192 (medians of 6 paired rounds; noisy).

Within the block, torch's matmuls go through cuBLASLt
(`torch.backends.cuda.preferred_blas_library`) with an SM count target of every SM but
`num_sms` (`torch._C._set_sm_carveout_experimental`, read by the cuBLASLt path only).
Both are process-wide settings, so they also reach GEMMs other threads issue meanwhile;
the previous values come back on exit, also when the block raises. Nothing changes for
`num_sms` None or 0, off CUDA, or where this torch lacks either setting. Triton kernels
(the expert GEMMs) choose their own grids and are not affected.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

__all__ = ["gemm_sm_carveout", "carveout_supported"]

_LT = "cublaslt"


def carveout_supported(device: torch.device) -> bool:
    """Whether `gemm_sm_carveout` can act on `device`: CUDA (not ROCm), and a torch with
    the SM carveout setting."""
    return (device.type == "cuda" and torch.version.hip is None
            and hasattr(torch._C, "_set_sm_carveout_experimental")
            and hasattr(torch._C, "_get_sm_carveout_experimental"))


@contextlib.contextmanager
def gemm_sm_carveout(num_sms: Optional[int], device: torch.device) -> Iterator[None]:
    """Within: torch's GEMMs leave `num_sms` SMs free (module doc); a no-op for None or 0,
    or where `carveout_supported(device)` is False."""
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int)
                                or num_sms < 0):
        raise ValueError(f"gemm_sm_carveout: num_sms={num_sms!r} must be an int >= 0 or None")
    if not num_sms or not carveout_supported(device):
        yield
        return
    backend = torch.backends.cuda.preferred_blas_library()
    carveout = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library(_LT)
    try:
        torch._C._set_sm_carveout_experimental(num_sms)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(backend)
