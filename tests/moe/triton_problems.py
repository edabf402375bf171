"""What the Triton expert tests (tests/moe/test_triton_experts*.py) share: the device, the
tolerances against the float32 reference, the skip where Triton cannot run, random
problems and the check against `ReferenceExperts`, and bf16 under the interpreter.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports a kernel:
every Triton program then runs in Python, so the problems stay tiny.
"""
from __future__ import annotations

import pytest
import torch

from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.workspace import Workspace

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances against the float32 reference. fp32: only the summation order differs.
# fp16: the kernel rounds the [N*K, I] activation and each weighted [N*K, H] row to fp16
# (2^-11 relative each) where the reference stays in fp32, plus the final rounding.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),  # 8-bit mantissa: 2^-8 per rounding
}


@pytest.fixture
def needs_triton() -> None:
    """Skips the test where the Triton experts cannot run (each test module uses it)."""
    ok, reason = TritonExperts.is_available(DEVICE)
    if not ok:
        pytest.skip(reason)


def make_problem(
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    *,
    dtype: torch.dtype = torch.float32,
    drop_frac: float = 0.0,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """x, w13, w2, ids, weights scaled so outputs are O(1); ids distinct per token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    ids = scores.topk(min(top_k, num_experts), dim=1).indices
    if top_k > num_experts:  # allow repeats when K > E (still a valid routing)
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    drop = torch.rand(num_tokens, top_k, generator=gen) < drop_frac
    ids = ids.masked_fill(drop, -1)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    tensors = (x.to(dtype), w13.to(dtype), w2.to(dtype))
    return tuple(t.to(DEVICE) for t in (*tensors, ids, weights))


def check_against_reference(
    *problem: torch.Tensor, workspace: Workspace | None = None
) -> torch.Tensor:
    out = TritonExperts().apply(*problem, workspace=workspace)
    ref = ReferenceExperts().apply(*problem)
    x = problem[0]
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[x.dtype])
    return out


@pytest.fixture
def bf16_dot_in_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let bf16 run under the interpreter: it stores bf16 as uint16 and its tl.dot multiplies
    the bit patterns (triton-lang/triton#11584, "not supported yet"). Widening the operands
    to fp32 there is exact, so the rest of the bf16 path (loads, casts, stores) is tested."""
    if DEVICE.type != "cpu":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is None or not hasattr(interpreter, "TensorHandle"):
        pytest.skip("Triton interpreter internals changed; bf16 is covered by test_gpu_shapes")

    def widen(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched(self: object, a: object, b: object, d: object, *args: object) -> object:
        return create_dot(self, widen(a), widen(b), d, *args)

    monkeypatch.setattr(builder, "create_dot", patched)
