"""Layer 3 (Triton interpreter on CPU; GPU-marked on CUDA): `moe.models.rotary`: the Triton kernel (interpreted on CPU, and on CUDA) against the
torch version, bit for bit."""
from __future__ import annotations

import pytest
import torch

from moe.models import rotary
from moe.kernels.policy import KernelPolicy
from moe.models.attention import rotary_cos_sin


def _inputs(num_tokens: int, heads: int, dim: int, dtype: torch.dtype, *, device: str = "cpu",
            extra_cols: int = 0, seed: int = 0) -> tuple:
    """x [T, heads, dim] as a view into wider rows (as q is in the QKV output), cos, sin."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, heads * dim + extra_cols, generator=gen).to(dtype)
    x = wide.to(device)[:, :heads * dim].view(num_tokens, heads, dim)
    positions = torch.randint(0, 5000, (num_tokens,), generator=gen)
    cos, sin = rotary_cos_sin(positions.to(device), head_dim=dim, theta=10000.0)
    return x, cos, sin


def _both(monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple:
    """(Triton's output, the torch version's). Triton's interpreter rounds fp32 to bf16
    by truncation (the GPU rounds to nearest even, as torch does): on CPU the expected
    bf16 output is the torch version's fp32 result truncated, so the fp32 math is still
    compared bit for bit."""
    torch_ops = KernelPolicy(implementation="torch")
    expected = rotary.apply_rotary(x, cos, sin, policy=torch_ops)
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        fp32_bits = rotary.apply_rotary(x.float(), cos, sin, policy=torch_ops).view(torch.int32)
        expected = (fp32_bits & -65536).view(torch.float32).to(torch.bfloat16)
    return rotary.apply_rotary(x, cos, sin, policy=KernelPolicy(implementation="triton")), expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,heads,dim,extra", [
    (5, 4, 16, 0),  # contiguous
    (7, 3, 24, 96),  # D/2 = 12 (not a power of two), a strided view
    (1, 1, 2, 0),  # the smallest head
    (3, 9, 128, 8 * 128),  # wide heads in a QKV-like row
])
def test_triton_matches_torch_bit_for_bit(monkeypatch, dtype, num_tokens, heads, dim, extra):
    x, cos, sin = _inputs(num_tokens, heads, dim, dtype, extra_cols=extra)
    out, expected = _both(monkeypatch, x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, expected)
    # The rotation moved the values: the check above is not comparing copies of x.
    assert not torch.equal(out, x.contiguous())


def test_heads_beyond_one_block(monkeypatch):
    """More heads than one program holds: the head blocks tile every head."""
    x, cos, sin = _inputs(2, 70, 128, torch.float32)
    out, expected = _both(monkeypatch, x, cos, sin)
    assert torch.equal(out, expected)


def test_rotation_keeps_each_pair_norm_and_position_zero_is_identity():
    x, cos, sin = _inputs(6, 2, 8, torch.float32)
    cos[0], sin[0] = 1.0, 0.0
    out = rotary.apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[0], x[0])
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(x))


def test_empty_batch(monkeypatch):
    x, cos, sin = _inputs(0, 4, 16, torch.bfloat16)
    out, expected = _both(monkeypatch, x, cos, sin)
    assert out.shape == (0, 4, 16) and expected.shape == (0, 4, 16)


@pytest.mark.parametrize("shape,cos_shape,dtype,message", [
    ((4, 2, 7), (4, 3), torch.float32, r"D even, got \(4, 2, 7\)"),
    ((4, 16), (4, 8), torch.float32, r"\[T, N, D\]"),
    ((4, 2, 16), (4, 16), torch.float32,
     r"cos must be float32 \[4, 8\], got torch.float32 \(4, 16\)"),
    ((4, 2, 16), (4, 8), torch.bfloat16, r"cos must be float32 \[4, 8\], got torch.bfloat16"),
])
def test_bad_inputs_name_the_problem(shape, cos_shape, dtype, message):
    x = torch.zeros(shape)
    trig = torch.zeros(cos_shape, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        rotary.apply_rotary(x, trig, trig)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_torch_bit_for_bit(monkeypatch, dtype):
    x, cos, sin = _inputs(300, 136, 128, dtype, device="cuda", extra_cols=16 * 128)
    out, expected = _both(monkeypatch, x, cos, sin)
    auto = rotary.apply_rotary(x, cos, sin)
    assert torch.equal(out, expected) and torch.equal(auto, expected)
