"""Triton fused-MoE experts against the reference (layer 3: the Triton interpreter on
CPU; GPU-marked on CUDA).

`TritonExperts` against `ReferenceExperts` (per-expert float32 loop) over the edge cases:
experts with no rows, N = 0 / 1, top-k 1 and 8, 1 to 64 local experts, ids -1, odd hidden
sizes, fp32 / fp16 / bf16 (the interpreter needs a patched tl.dot for bf16, see
`tests.moe.triton_problems.bf16_dot_in_interpreter`); dropped rows, the k-sum, block
sizes, workspaces, strided routing weights, bad inputs. `test_gpu_shapes` runs the
compiled, autotuned kernels on CUDA. The align: test_triton_experts_align.py; the GEMM
load paths and tiles: test_triton_experts_kernels.py; the benchmark and tuner CLIs:
test_triton_experts_bench.py.
"""
from __future__ import annotations

import pytest
import torch

from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.workspace import Workspace
from tests.moe.triton_problems import (DEVICE, TOLERANCES, bf16_dot_in_interpreter,  # noqa: F401
                                       check_against_reference, make_problem, needs_triton)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("needs_triton")]


# ----------------------------------------------------------------------- experts vs ref


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k, drop_frac",
    [
        (1, 16, 8, 1, 1, 0.0),  # T = 1, one expert
        (1, 24, 8, 64, 8, 0.0),  # T = 1, top-8 of 64: 56 experts without rows
        (3, 16, 8, 8, 1, 0.0),  # most experts empty
        (6, 33, 20, 8, 8, 0.0),  # odd hidden, I not a multiple of the tile
        (8, 24, 8, 4, 8, 0.0),  # top-k 8 with repeats (K > E)
        (40, 16, 20, 1, 1, 0.0),  # one expert, several blocks
        (25, 33, 8, 6, 2, 0.4),  # ids -1 mixed in
        (8, 33, 20, 16, 8, 0.3),  # all of it at once
    ],
)
def test_matches_reference_fp32(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, drop_frac: float
) -> None:
    check_against_reference(
        *make_problem(num_tokens, hidden, inter, num_experts, top_k, drop_frac=drop_frac)
    )


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k", [(9, 33, 20, 3, 2), (8, 16, 8, 16, 8)]
)
def test_matches_reference_fp16(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int
) -> None:
    problem = make_problem(
        num_tokens, hidden, inter, num_experts, top_k, dtype=torch.float16, drop_frac=0.2
    )
    check_against_reference(*problem)


def test_dropped_rows_are_zero() -> None:
    x, w13, w2, ids, weights = make_problem(6, 16, 8, 4, 2)
    ids[1] = -1
    ids[4, 0] = -1
    out = check_against_reference(x, w13, w2, ids, weights)
    assert torch.equal(out[1], torch.zeros_like(out[1]))

    ids.fill_(-1)
    out = TritonExperts().apply(x, w13, w2, ids, weights)
    assert torch.equal(out, torch.zeros_like(out))


def test_dropped_rows_are_skipped() -> None:
    """Rows of ids -1 are neither written by GEMM2 nor read by the k-sum (they stay as the
    workspace left them, here NaN), and the output matches the reference."""
    import moe.kernels.fused_moe.host as fm

    x, w13, w2, ids, weights = make_problem(20, 16, 8, 4, 3, dtype=torch.float16,
                                            drop_frac=0.5)
    ws = Workspace()
    ws.get("triton.rows", (ids.numel(), 16), x.dtype, DEVICE).fill_(float("nan"))
    out = fm.fused_moe(x, w13, w2, ids, weights, block_m=16, workspace=ws)
    y = ws.get("triton.rows", (ids.numel(), 16), x.dtype, DEVICE)
    dropped = ids.reshape(-1) < 0
    assert dropped.any() and (~dropped).any()
    assert torch.isnan(y[dropped]).all(), "GEMM2 skips the rows of ids -1"
    assert not torch.isnan(y[~dropped]).any()
    ref = ReferenceExperts().apply(x, w13, w2, ids, weights)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])


def test_sum_routed_rows() -> None:
    """The k-sum adds the rows of ids >= 0 in k order in fp32, over column blocks."""
    from moe.kernels.fused_moe.host import sum_routed_rows

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 3, (9, 5), generator=gen)
    y = torch.randn(45, 1100, generator=gen).to(torch.bfloat16)  # > one 1024-column block
    out = torch.empty(9, 1100, dtype=torch.bfloat16, device=DEVICE)
    sum_routed_rows(y.to(DEVICE), ids.to(DEVICE), out)
    want = (y.float().view(9, 5, 1100) * (ids >= 0).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out.cpu().float(), want, rtol=8e-3, atol=1e-2)


def test_zero_tokens() -> None:
    x, w13, w2, ids, weights = make_problem(0, 16, 8, 4, 2)
    out = TritonExperts().apply(x, w13, w2, ids, weights)
    assert out.shape == (0, 16) and out.dtype == x.dtype


def test_block_sizes_and_determinism() -> None:
    from moe.kernels.fused_moe.host import fused_moe
    from moe.kernels.fused_moe.rules import choose_block_m

    # Powers of two from 16 to 128, growing with the rows per expert; below the
    # weight-bound regime never longer than the mean segment beyond the 16-row minimum
    # (decode wastes little padding), from it on 128 rows (each weight tile read once).
    from moe.kernels.fused_moe.rules import WEIGHT_BOUND_MIN_ROWS
    sizes = [choose_block_m(rows, 8) for rows in range(0, 8 * 2048, 8)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128
    assert set(sizes) == {16, 32, 128}
    for b, rows in zip(sizes, range(0, 8 * 2048, 8)):
        per_expert = rows / 8
        assert b == 128 if per_expert >= WEIGHT_BOUND_MIN_ROWS else b <= max(16, per_expert)
    problem = make_problem(30, 24, 8, 2, 2, drop_frac=0.1)
    ref = ReferenceExperts().apply(*problem)
    outs = [fused_moe(*problem, block_m=block_m) for block_m in (16, 32, 16)]
    for out in outs:
        torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    assert torch.equal(outs[0], outs[2]), "same inputs and tiles give bitwise equal output"


def test_workspace_reuse() -> None:
    ws = Workspace()
    big = make_problem(20, 16, 8, 3, 2, seed=1)
    small = make_problem(7, 16, 8, 3, 2, seed=2, drop_frac=0.3)
    check_against_reference(*big, workspace=ws)
    num_allocations = ws.num_allocations
    out_small = check_against_reference(*small, workspace=ws)
    out_big = check_against_reference(*big, workspace=ws)
    assert ws.num_allocations == num_allocations, "a smaller or equal call must not grow it"
    assert out_small.data_ptr() != out_big.data_ptr(), "outputs are fresh, never workspace"


def test_strided_routing_weights_are_read_in_place() -> None:
    """Weights as a strided view (as unpacked from a backend's packed rows) give the
    contiguous weights' result exactly: GEMM2 reads them by row stride, no copy."""
    from moe.kernels.fused_moe.host import fused_moe

    x, w13, w2, ids, weights = make_problem(19, 24, 16, 6, 3, drop_frac=0.2, seed=3)
    wide = torch.full((19, 11), float("nan"), device=DEVICE)  # NaN: a wrong column shows
    wide[:, 2:5] = weights
    strided = wide[:, 2:5]
    assert not strided.is_contiguous()
    out = fused_moe(x, w13, w2, ids, strided)
    assert torch.equal(out, fused_moe(x, w13, w2, ids, weights))
    assert torch.isfinite(out).all()


def test_rejects_bad_inputs() -> None:
    x, w13, w2, ids, weights = make_problem(4, 16, 8, 2, 1)
    with pytest.raises(TypeError, match="dtype"):
        TritonExperts().apply(x.half(), w13, w2, ids, weights)
    with pytest.raises(ValueError, match="contiguous"):
        TritonExperts().apply(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, ids, weights)
    with pytest.raises(ValueError, match="w2"):
        TritonExperts().apply(x, w13, w2[:, :, :4], ids, weights)


def test_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TritonExperts.name == "triton"
    if DEVICE.type == "cpu":
        assert TritonExperts.is_available(DEVICE) == (True, "")
        monkeypatch.delenv("TRITON_INTERPRET")
        ok, reason = TritonExperts.is_available(torch.device("cpu"))
        assert not ok and "TRITON_INTERPRET" in reason and "pip install triton" in reason
    else:
        assert TritonExperts.is_available(DEVICE) == (True, "")
    ok, reason = TritonExperts.is_available(torch.device("meta"))
    assert not ok and "pip install triton" in reason


@pytest.mark.usefixtures("bf16_dot_in_interpreter")
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [(11, 33, 20, 4, 2)])
def test_matches_reference_bf16(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int
) -> None:
    problem = make_problem(
        num_tokens, hidden, inter, num_experts, top_k, dtype=torch.bfloat16, drop_frac=0.2
    )
    check_against_reference(*problem)


_BF16 = torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, num_tokens, hidden, inter, num_experts, top_k",
    [
        (_BF16, 1, 256, 128, 16, 8),  # decode: BLOCK_M 16
        (_BF16, 300, 512, 256, 16, 8),  # BLOCK_M 64
        (_BF16, 2048, 1024, 384, 64, 8),  # BLOCK_M 128
        (_BF16, 513, 200, 72, 5, 2),  # sizes not multiples of 16: masked, unpipelined loads
        (torch.float16, 300, 512, 256, 16, 8),
        (torch.float32, 300, 512, 256, 16, 8),  # exact fp32 (allow_tf32 is off by default)
    ],
)
def test_gpu_shapes(
    dtype: torch.dtype, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int
) -> None:
    """Compiled, autotuned kernels on CUDA (the first run compiles ~60 configs: minutes);
    16-bit aligned shapes take the TMA loads there."""
    problem = make_problem(
        num_tokens, hidden, inter, num_experts, top_k, dtype=dtype, drop_frac=0.1
    )
    check_against_reference(*problem)
