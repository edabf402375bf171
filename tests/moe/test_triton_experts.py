"""Triton fused-MoE experts (layer 3: the Triton interpreter on CPU; GPU-marked on CUDA).

`moe.kernels.align` and its Triton twin `moe.kernels.align_triton` on their own, then
`TritonExperts` against `ReferenceExperts` (per-expert float32 loop) over the edge cases:
experts with no rows, N = 0 / 1, top-k 1 and 8, 1 to 64 local experts, ids -1, odd hidden
sizes, several blocks per expert, fp32 / fp16 / bf16 (the interpreter needs a patched
tl.dot for bf16, see `bf16_dot_in_interpreter`). Without CUDA, tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports a kernel, and shapes stay
tiny; `test_gpu_shapes` runs the compiled, autotuned kernels on CUDA.

Cost under the interpreter: every program runs in Python, and the Triton align sorts
more than 64 routed rows as one 1024-key chunk (seconds). So the GEMM tests route at
most 64 rows through `fused_moe`, or take the torch align (the same buffers, as
`test_triton_align_matches_torch` checks) where a layout needs more rows.
"""
from __future__ import annotations

import pytest
import torch

from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.kernels.fused_moe.align import align_routing, max_padded_rows
from moe.kernels.fused_moe.align_triton import align_routing_triton
from moe.kernels.policy import KernelPolicy
from moe.workspace import Workspace

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances against the float32 reference. fp32: only the summation order differs.
# fp16: the kernel rounds the [N*K, I] activation and each weighted [N*K, H] row to fp16
# (2^-11 relative each) where the reference stays in fp32, plus the final rounding.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),  # 8-bit mantissa: 2^-8 per rounding
}


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
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


# --------------------------------------------------------------------------------- align


# At most 64 routed rows (one SMALL_CHUNK by default), except the last case: the only
# one whose default chunk is CHUNK (1024 rows), each a sort of seconds when interpreted.
ALIGN_CASES = [
    (1, 1, 1, 16, 0.0),
    (7, 2, 64, 16, 0.0),  # most experts empty
    (40, 1, 1, 16, 0.0),  # one expert, three blocks
    (8, 8, 8, 32, 0.25),  # ids -1 in the mix
    (16, 4, 5, 16, 1.0),  # everything dropped
    (21, 3, 4, 64, 0.1),
    # 68 blocks of one expert and 117 dropped rows: 75 chunks of 16 (many scan steps),
    # or by default two chunks of CHUNK rows, the second mostly past the last row.
    (1200, 1, 1, 16, 0.1),
]


def _random_ids(num_tokens: int, top_k: int, num_experts: int, drop_frac: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    return ids.masked_fill(torch.rand(num_tokens, top_k, generator=gen) < drop_frac, -1)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, drop_frac", ALIGN_CASES)
def test_align_layout(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, drop_frac: float
) -> None:
    ids = _random_ids(num_tokens, top_k, num_experts, drop_frac)
    routing = align_routing(ids.to(DEVICE), num_experts, block_m)

    num_routed = num_tokens * top_k
    sorted_ids = routing.sorted_ids_P.cpu().long()
    block_experts = routing.block_expert_ids_B.cpu().long()
    used = int(routing.num_padded_rows.item())
    assert routing.num_routed == num_routed and routing.block_m == block_m
    assert sorted_ids.numel() == max_padded_rows(num_routed, num_experts, block_m)
    assert sorted_ids.numel() % block_m == 0
    assert block_experts.numel() == sorted_ids.numel() // block_m
    assert used % block_m == 0 and used <= sorted_ids.numel()
    assert (sorted_ids[used:] == num_routed).all(), "rows past the used range are padding"
    assert (block_experts[used // block_m :] == -1).all(), "idle blocks carry expert -1"

    # Every (token, k) appears exactly once, in a block of its expert (-1: dropped block).
    real = sorted_ids[:used] < num_routed
    assert sorted(sorted_ids[:used][real].tolist()) == list(range(num_routed))
    row_expert = block_experts[:used // block_m].repeat_interleave(block_m)
    flat_ids = ids.reshape(-1)
    assert torch.equal(row_expert[real], flat_ids[sorted_ids[:used][real]])

    # Segments: experts ascending, dropped last, each padded to a multiple of BLOCK_M with
    # the fewest blocks; token order kept inside a segment.
    blocks = block_experts[: used // block_m]
    segment_order = torch.where(blocks < 0, num_experts, blocks)
    assert torch.equal(segment_order, segment_order.sort().values)
    for expert in range(-1, num_experts):
        count = int((flat_ids == expert).sum())
        assert int((blocks == expert).sum()) == -(-count // block_m)
        rows = sorted_ids[:used][real & (row_expert == expert)]
        assert torch.equal(rows, rows.sort().values)

    # Tile table: the blocks of experts (no padding-only, dropped or idle block), those
    # with more than half their rows used first, then the half-used ones, each in order.
    num_full, num_half = routing.num_tiles.cpu().tolist()
    tiles = routing.tile_rows_B.cpu().long()[: num_full + num_half]
    used_rows = real.view(-1, block_m).sum(1)
    is_expert = blocks >= 0
    want_full = (torch.nonzero(is_expert & (used_rows > block_m // 2)).view(-1)) * block_m
    want_half = torch.nonzero(is_expert & (used_rows > 0) & (used_rows <= block_m // 2))
    assert torch.equal(tiles[:num_full], want_full)
    assert torch.equal(tiles[num_full:], want_half.view(-1) * block_m)


def assert_same_routing(ids: torch.Tensor, num_experts: int, block_m: int, **kwargs: int) -> None:
    """The Triton align equals the torch one (whose layout test_align_layout checks) on
    every row that is read: the used rows and all block entries."""
    want = align_routing(ids, num_experts, block_m)
    got = align_routing_triton(ids, num_experts, block_m, **kwargs)
    used = int(want.num_padded_rows.item())
    assert int(got.num_padded_rows.item()) == used
    assert (got.block_m, got.num_routed) == (want.block_m, want.num_routed)
    assert got.sorted_ids_P.shape == want.sorted_ids_P.shape
    assert torch.equal(got.sorted_ids_P[:used], want.sorted_ids_P[:used])
    assert torch.equal(got.block_expert_ids_B, want.block_expert_ids_B)
    assert torch.equal(got.num_tiles, want.num_tiles)
    num_tiles = int(want.num_tiles.sum())
    assert torch.equal(got.tile_rows_B[:num_tiles], want.tile_rows_B[:num_tiles])


@pytest.mark.parametrize("chunk", [16, None])  # 16: many count/scatter programs
@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, drop_frac", ALIGN_CASES)
def test_triton_align_matches_torch(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, drop_frac: float,
    chunk: int | None,
) -> None:
    ids = _random_ids(num_tokens, top_k, num_experts, drop_frac).to(DEVICE)
    assert_same_routing(ids, num_experts, block_m, chunk=chunk)


def test_triton_align_int32_empty_and_workspace() -> None:
    ids = _random_ids(9, 4, 6, 0.2).to(DEVICE)
    assert_same_routing(ids.int(), 6, 16, chunk=16)
    empty = align_routing_triton(torch.empty(0, 4, dtype=torch.int64, device=DEVICE), 8, 16)
    assert empty.sorted_ids_P.numel() == 0 and int(empty.num_padded_rows.item()) == 0
    ws = Workspace()
    first = align_routing_triton(ids, 6, 16, workspace=ws)
    allocations = ws.num_allocations
    again = align_routing_triton(ids[:5], 6, 16, workspace=ws)
    assert ws.num_allocations == allocations, "the smaller call reuses every buffer"
    assert again.sorted_ids_P.data_ptr() == first.sorted_ids_P.data_ptr()
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        align_routing_triton(ids, 6, 16, chunk=24)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_experts, block_m", [(8192, 128, 128), (3000, 32, 64),
                                                              (1, 256, 16)])
def test_gpu_triton_align_matches_torch(num_tokens: int, num_experts: int, block_m: int) -> None:
    ids = _random_ids(num_tokens, 8, num_experts, 0.4).to(DEVICE)
    assert_same_routing(ids, num_experts, block_m)


def test_align_empty_and_workspace() -> None:
    routing = align_routing(torch.empty(0, 4, dtype=torch.int64, device=DEVICE), 8, 16)
    assert routing.sorted_ids_P.numel() == 0 and int(routing.num_padded_rows.item()) == 0

    ws = Workspace()
    ids = torch.tensor([[2, 0], [1, -1], [2, 2]], device=DEVICE)
    first = align_routing(ids, 3, 16, workspace=ws)
    again = align_routing(ids[:2], 3, 16, workspace=ws)
    assert ws.num_allocations == 3, "sorted ids, block experts and tiles, reused by the smaller call"
    assert again.sorted_ids_P.data_ptr() == first.sorted_ids_P.data_ptr()
    num_blocks = int(again.num_padded_rows.item()) // 16
    assert again.block_expert_ids_B[:num_blocks].tolist() == [0, 1, 2, -1]


def test_align_rejects_bad_block_m() -> None:
    with pytest.raises(ValueError, match="power of two"):
        align_routing(torch.zeros(2, 1, dtype=torch.int64), 1, 24)


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


@pytest.mark.parametrize("tma, sorted_x", [(True, False), (True, True)])
@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k, block_m",
    [
        (9, 32, 24, 3, 2, 16),  # I = 24: a weight tile runs past the gate into the up rows
        (7, 24, 40, 8, 8, 16),  # many experts, the last tile reads past the last expert
        (40, 16, 8, 1, 1, 32),  # one expert, two blocks
    ],
)
def test_load_variants_match_reference(
    tma: bool, sorted_x: bool, num_tokens: int, hidden: int, inter: int, num_experts: int,
    top_k: int, block_m: int,
) -> None:
    """Tensor-descriptor (TMA) loads and the pre-sorted x, emulated by the interpreter on
    CPU (the GPU picks them by itself): same results as the pointer loads."""
    from moe.kernels.fused_moe.host import fused_moe

    problem = make_problem(num_tokens, hidden, inter, num_experts, top_k,
                           dtype=torch.float16, drop_frac=0.2)
    ref = ReferenceExperts().apply(*problem)
    out = fused_moe(*problem, block_m=block_m, policy=KernelPolicy(tma=tma, sorted_x=sorted_x))
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])
    plain = fused_moe(*problem, block_m=block_m, policy=KernelPolicy(tma=False, sorted_x=False))
    # The same tiles in the same order: only the load path differs.
    assert torch.equal(out, plain)
    # From a workspace (the sorted x and GEMM2's rows share one buffer), twice.
    ws = Workspace()
    for _ in range(2):
        out_ws = fused_moe(*problem, block_m=block_m, workspace=ws,
                           policy=KernelPolicy(tma=tma, sorted_x=sorted_x))
        assert torch.equal(out_ws, plain)


@pytest.mark.parametrize("sorted_x", [False, True])
@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k, block_m, drop_frac",
    [
        (7, 24, 40, 8, 8, 16, 0.2),  # many tiles over 3 programs; no half tiles (16 rows)
        (40, 16, 8, 1, 1, 32, 0.0),  # one expert: a full block, then a half-used one
        (16, 32, 24, 3, 4, 32, 0.3),  # 1 full and 2 half tiles, ids -1 (no tiles for them)
        (20, 16, 8, 4, 2, 64, 1.0),  # every id elsewhere: an empty tile table
    ],
)
def test_persistent_matches_reference(
    sorted_x: bool, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
    block_m: int, drop_frac: float,
) -> None:
    """The persistent GEMMs (tile table, round-robin programs, half tiles), emulated by the
    interpreter: the reference's result, and the one-program-per-tile kernel's bit for bit
    (same k order per row)."""
    from moe.kernels.fused_moe.host import fused_moe

    problem = make_problem(num_tokens, hidden, inter, num_experts, top_k,
                           dtype=torch.float16, drop_frac=drop_frac)
    out = fused_moe(*problem, block_m=block_m,
                    policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=True))
    ref = ReferenceExperts().apply(*problem)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])
    plain = fused_moe(*problem, block_m=block_m,
                      policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=False))
    assert torch.equal(out, plain)


def test_persistent_half_tiles_and_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half-used blocks compute only their upper half (the lower stays unwritten) and
    every used row equals the full-height result; the host's choice of kernel."""
    import moe.kernels.fused_moe.host as fm
    from moe.kernels.fused_moe import rules as policy
    from moe.kernels.fused_moe.host import launch_persistent

    block_m, hidden, inter = 32, 32, 8
    ids = _counted_ids({0: 40, 1: 20, 2: 16, -1: 5}).view(-1, 1).to(DEVICE)  # as above
    x, w13, *_ = make_problem(ids.shape[0], hidden, inter, 4, 1, dtype=torch.float16)
    routing = align_routing(ids, 4, block_m)  # the Triton align's buffers (see above)
    assert routing.num_tiles.tolist() == [2, 2]  # full: 0's first, 1's; half: 0's last, 2's
    lower_halves = list(range(48, 64)) + list(range(112, 128))
    used = (routing.sorted_ids_P[:128] < routing.num_routed).nonzero().view(-1)
    acts = {}
    for half in (True, False):
        act = torch.full((routing.sorted_ids_P.numel(), inter), float("nan"), dtype=x.dtype,
                         device=DEVICE)
        launch_persistent(x, w13, act, None, routing, n=inter, k=hidden, a_rows_div=1,
                          a_sorted=False, half_tail=half)
        assert torch.isnan(act[lower_halves]).all() == half, f"half_tail={half}"
        assert not torch.isnan(act[used]).any()
        acts[half] = act
    torch.testing.assert_close(acts[True][used], acts[False][used], rtol=0, atol=0)

    # The policy applies its named limits: GEMM2 by rows per expert, GEMM1 by rows and
    # depth, both only on 128-row blocks.
    prefer = policy.prefer_persistent
    rows2, rows1, deep = (policy.PERSISTENT_GEMM2_MIN_ROWS, policy.PERSISTENT_GEMM1_MIN_ROWS,
                          policy.PERSISTENT_GEMM1_MIN_K)
    assert prefer(128, gated=False, k=16, rows_per_expert=rows2)
    assert not prefer(128, gated=False, k=deep, rows_per_expert=rows2 - 1)
    assert prefer(128, gated=True, k=deep, rows_per_expert=rows1)
    assert not prefer(128, gated=True, k=deep, rows_per_expert=rows1 - 1)
    assert not prefer(128, gated=True, k=deep - 1, rows_per_expert=10 * rows1)
    for block_m in (16, 32, 64):
        assert not prefer(block_m, gated=False, k=deep, rows_per_expert=10 * rows2)
        assert not prefer(block_m, gated=True, k=deep, rows_per_expert=10 * rows1)
    # x is sorted first only for the one-program-per-tile GEMM1, and only when large.
    monkeypatch.setattr(policy, "SORTED_X_MIN_BYTES", x.numel() * x.element_size())
    assert policy.prefer_sorted_x(x, persistent_gemm1=False)
    assert not policy.prefer_sorted_x(x[1:], persistent_gemm1=False)
    assert not policy.prefer_sorted_x(x, persistent_gemm1=True)
    fp32 = make_problem(4, 16, 8, 2, 1)
    with pytest.raises(ValueError, match=r"persistent=True.*16-bit"):
        fm.fused_moe(*fp32, policy=KernelPolicy(persistent=True))


def test_tma_and_sorted_x_reject_what_they_cannot_load() -> None:
    from moe.kernels.fused_moe.host import fused_moe, tma_unsupported_reason

    fp32 = make_problem(4, 16, 8, 2, 1)
    assert "16-bit" in tma_unsupported_reason(*fp32[:3])
    with pytest.raises(ValueError, match="16-bit"):
        fused_moe(*fp32, policy=KernelPolicy(tma=True))
    odd = make_problem(4, 20, 8, 2, 1, dtype=torch.float16)  # 40-byte rows
    with pytest.raises(ValueError, match="16-byte aligned"):
        fused_moe(*odd, policy=KernelPolicy(tma=True))
    x, w13, w2, ids, weights = make_problem(4, 16, 8, 2, 1, dtype=torch.float16)
    strided = w13.transpose(0, 1).contiguous().transpose(0, 1)  # rows contiguous, experts not
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x, strided, w2, ids, weights, policy=KernelPolicy(tma=True))
    with pytest.raises(ValueError, match="needs tma"):
        fused_moe(x, w13, w2, ids, weights, policy=KernelPolicy(tma=False, sorted_x=True))


def test_gather_rows_copies_routed_rows_and_zeros_padding() -> None:
    from moe.kernels.fused_moe.host import gather_rows

    num_tokens, top_k, hidden = 10, 2, 24
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [0, 1], [2, 2]] * 2).to(DEVICE)
    routing = align_routing_triton(ids, 3, 16)
    dst = torch.full((routing.sorted_ids_P.numel(), hidden), float("nan"), device=DEVICE)
    gather_rows(x, dst, routing, rows_div=top_k)
    used = int(routing.num_padded_rows)
    sorted_ids = routing.sorted_ids_P[:used].long()
    real = sorted_ids < ids.numel()
    assert torch.equal(dst[:used][real], x[sorted_ids[real] // top_k])
    assert torch.equal(dst[:used][~real], torch.zeros_like(dst[:used][~real]))
    assert torch.isnan(dst[used:]).all(), "rows past num_padded_rows are not touched"


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


def _counted_ids(counts: dict[int, int], seed: int = 3) -> torch.Tensor:
    """[N, 1] ids with `counts[e]` rows for each expert e (-1: elsewhere), shuffled."""
    ids = torch.cat([torch.full((n,), e) for e, n in counts.items()])
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("tma", [False, True])
def test_half_tail_tiles(tma: bool) -> None:
    """GEMM1 with half tiles: a block whose lower half is padding computes only its upper
    half (those activation rows stay unwritten); every used row is as with full tiles."""
    from moe.kernels.fused_moe.host import _launch, kernel_launch
    from moe.kernels.fused_moe.rules import GemmTiles

    block_m, hidden, inter = 32, 32, 8
    # Expert 0: 40 rows (a full block, then 8: half); expert 1: 20 (more than half used:
    # full); expert 2: 16 (exactly half: half); expert 3: none; 5 rows elsewhere.
    ids = _counted_ids({0: 40, 1: 20, 2: 16, -1: 5}).view(-1, 1).to(DEVICE)
    x, w13, *_ = make_problem(ids.shape[0], hidden, inter, 4, 1, dtype=torch.float16)
    # The torch align: the Triton one's buffers (test_triton_align_matches_torch) without
    # its interpreted sort of a 1024-row chunk, which costs seconds.
    routing = align_routing(ids, 4, block_m)
    num_rows = routing.sorted_ids_P.numel()
    # Sorted rows: expert 0 in [0, 64), expert 1 in [64, 96), expert 2 in [96, 128).
    lower_halves = list(range(48, 64)) + list(range(112, 128))
    used = (routing.sorted_ids_P[:128] < routing.num_routed).nonzero().view(-1)  # experts' rows
    acts = {}
    for half in (True, False):
        act = torch.full((num_rows, inter), float("nan"), dtype=x.dtype, device=DEVICE)
        _launch(kernel_launch(x, w13, act, None, routing, n=inter, k=hidden, a_rows_div=1,
                              a_sorted=False, tma=tma, tiles=GemmTiles(half_tail=half)))
        assert torch.isnan(act[lower_halves]).all() == half, f"half_tail={half}"
        assert not torch.isnan(act[64:96]).any(), "expert 1's block is more than half used"
        acts[half] = act
    torch.testing.assert_close(acts[True][used], acts[False][used], rtol=0, atol=0)


@pytest.mark.parametrize("tma", [False, True])
def test_gemm2_tail_rows_ride_on_the_block_before(tma: bool) -> None:
    """GEMM2 tails (`TAIL_M`): an expert's last block with at most 16 used rows is computed
    by the expert's block before it, on its weight loads, in a swapped dot. Every local
    row is written and equals the result without tails, bit for bit; GEMM1 and tiles
    other than whole blocks refuse tails."""
    from moe.kernels.fused_moe.host import _launch, kernel_launch
    from moe.kernels.fused_moe.rules import GemmTiles

    block_m, hidden, inter = 32, 32, 16
    # Sorted 32-row blocks: expert 0: 40 rows in [0, 64), its last 8 ride on block 0;
    # 1: 20 in [64, 96), a lone block; 2: 16 in [96, 128), short but alone; 3: 81 in
    # [128, 224), a last block of 17 (> 16) runs itself; 4: 80 in [224, 320), its last
    # 16 ride on block 8. 5 rows elsewhere (expert -1).
    ids = _counted_ids({0: 40, 1: 20, 2: 16, 3: 81, 4: 80, -1: 5}).view(-1, 1).to(DEVICE)
    x, w13, w2, _, weights = make_problem(ids.shape[0], hidden, inter, 5, 1,
                                          dtype=torch.float16)
    routing = align_routing(ids, 5, block_m)  # as in test_half_tail_tiles
    act = torch.randn(routing.sorted_ids_P.numel(), inter, generator=torch.Generator()
                      .manual_seed(3)).to(x.dtype).to(DEVICE)
    local = (ids.view(-1) >= 0).nonzero().view(-1)
    ys = {}
    for tiles in (GemmTiles(tail_rows=16), GemmTiles(half_tail=True, tail_rows=16),
                  GemmTiles(half_tail=True), GemmTiles()):
        y = torch.full((ids.shape[0], hidden), float("nan"), dtype=x.dtype, device=DEVICE)
        _launch(kernel_launch(act, w2, y, weights, routing, n=hidden, k=inter, a_rows_div=1,
                              a_sorted=True, tma=tma, tiles=tiles))
        assert not torch.isnan(y[local]).any(), f"{tiles}"
        ys[tiles] = y[local]
    for tiles, y in ys.items():
        torch.testing.assert_close(y, ys[GemmTiles()], rtol=0, atol=0, msg=f"{tiles}")
    for bad, why in ((GemmTiles(tail_rows=24), "power of two"),
                     (GemmTiles(rows=16, tail_rows=16), "whole-block"),
                     (GemmTiles(tail_rows=32), "half the block")):
        with pytest.raises(ValueError, match=why):
            kernel_launch(act, w2, y, weights, routing, n=hidden, k=inter, a_rows_div=1,
                          a_sorted=True, tma=tma, tiles=bad)
    with pytest.raises(ValueError, match="GEMM2"):
        kernel_launch(x, w13, act, None, routing, n=inter, k=hidden, a_rows_div=1,
                      a_sorted=False, tma=tma, tiles=GemmTiles(tail_rows=16))


def test_short_tiles_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 128-row blocks GEMM1 runs 64-row tiles in its short-tile range (padding-only
    tiles return at once) and GEMM2 128-row tiles with half tails: the padding-only tiles
    of GEMM1 leave their activation rows unwritten, the used rows are those of one tile
    height, bit for bit."""
    import moe.kernels.fused_moe.align_triton as align_triton
    import moe.kernels.fused_moe.host as fm
    from moe.kernels.fused_moe import rules as policy

    tiles = policy.GemmTiles
    short_min, short_max = policy.SHORT_GEMM1_MIN_ROWS, policy.SHORT_GEMM1_MAX_ROWS
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_min - 1) == tiles(128)
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_min) == tiles(64)
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_max) == tiles(64)
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_max + 1) == tiles(128)
    gemm2 = policy.gemm_tiles(128, gated=False, rows_per_expert=1)
    assert gemm2 == tiles(128, True, policy.GEMM2_TAIL_ROWS), "any rows: half tiles, tails"
    for block_m in (16, 32, 64):  # shorter blocks: whole-block tiles, no tails
        for gated in (True, False):
            assert policy.gemm_tiles(block_m, gated=gated, rows_per_expert=100) == tiles(block_m)
    # fused_moe aligns these 334 rows in 64-row chunks: the interpreter sorts a chunk of
    # the default 1024 rows in seconds (the align tests cover that chunk).
    monkeypatch.setattr(align_triton, "CHUNK", align_triton.SMALL_CHUNK)
    # ~83 rows per expert is weight-bound (whole tiles): put it in the short-tile range.
    monkeypatch.setattr(policy, "SHORT_GEMM1_MIN_ROWS", 1)
    # Expert 0: 160 rows (blocks [0, 256): rows [192, 256) are padding only); expert 1:
    # 100 (one block, every 64-row tile used); expert 2: 64 (rows [448, 512) padding).
    ids = _counted_ids({0: 160, 1: 100, 2: 64, -1: 10}).view(-1, 1)
    x, w13, w2, _, weights = make_problem(ids.shape[0], 32, 8, 4, 1, dtype=torch.float16)
    problem = (x, w13, w2, ids.to(DEVICE), weights)
    num_rows = max_padded_rows(ids.shape[0], 4, 128)
    ws = Workspace()
    ws.get("triton.act", (num_rows, 8), x.dtype, DEVICE).fill_(float("nan"))
    out = fm.fused_moe(*problem, block_m=128, workspace=ws)
    act = ws.get("triton.act", (num_rows, 8), x.dtype, DEVICE)
    skipped = list(range(192, 256)) + list(range(448, 512))
    assert torch.isnan(act[skipped]).all()
    assert not torch.isnan(act[256:384]).any()
    routing = align_routing_triton(ids.to(DEVICE), 4, 128)
    whole = torch.full_like(act, float("nan"))
    fm._launch(fm.kernel_launch(x, w13, whole, None, routing, n=8, k=32, a_rows_div=1,
                                a_sorted=False, tma=False, tiles=tiles(128)))
    used = (routing.sorted_ids_P[:512] < routing.num_routed).nonzero().view(-1)
    torch.testing.assert_close(act[used], whole[used], rtol=0, atol=0)
    ref = ReferenceExperts().apply(*problem)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])
    with pytest.raises(ValueError, match="divide"):
        fm.kernel_launch(x, w13, x, None, align_routing(ids, 4, 32), n=8, k=32,
                         a_rows_div=1, a_sorted=False, tma=False, tiles=tiles(64))


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


@pytest.mark.usefixtures("bf16_dot_in_interpreter")
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [(11, 33, 20, 4, 2)])
def test_matches_reference_bf16(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int
) -> None:
    problem = make_problem(
        num_tokens, hidden, inter, num_experts, top_k, dtype=torch.bfloat16, drop_frac=0.2
    )
    check_against_reference(*problem)


def test_bench_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark's CPU side: planning, the no-CUDA exit, and a tiny interpreted run."""
    import json

    from moe.bench import experts as bench_experts

    argv = ["--dry-run", "--shapes", "ds-e8,qwen-e128", "--tokens", "64,4096"]
    assert bench_experts.main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 * 2 * len(bench_experts.PATHS)
    if not torch.cuda.is_available():
        assert bench_experts.main(["--shapes", "tiny", "--tokens", "4"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    if DEVICE.type == "cpu":
        argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "5", "--rounds", "1"]
        argv += ["--paths", "triton,reference"]
        assert bench_experts.main(argv) == 0
        record = json.loads(capsys.readouterr().out.splitlines()[-1])
        triton_point = next(p for p in record["points"] if p["path"] == "triton")
        assert triton_point["err"] < 1e-2 and triton_point["tokens"] == 5


def test_bench_profile_window(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--profile-window`: one more call per path after the rounds, alone between
    cudaProfilerStart and Stop (stopped even when the call fails); CUDA only."""
    from moe.bench import experts as bench_experts

    with pytest.raises(SystemExit):
        bench_experts.main(["--profile-window", "--device", "cpu", "--dry-run"])
    assert "--profile-window needs --device cuda" in capsys.readouterr().err

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    bench_experts.profile_one_call(lambda: events.append("call"), DEVICE, "a point")
    assert events == ["sync", "start", "call", "sync", "stop"]
    assert "profile window: a point" in capsys.readouterr().err

    def fail() -> None:
        raise RuntimeError("kernel failed")

    events.clear()
    with pytest.raises(RuntimeError, match="kernel failed"):
        bench_experts.profile_one_call(fail, DEVICE, "a point")
    assert events == ["sync", "start", "stop"]

    if DEVICE.type == "cpu":  # the wiring: one window per path that ran, after its rounds
        monkeypatch.undo()
        windows: list[str] = []
        monkeypatch.setattr(bench_experts, "profile_one_call",
                            lambda fn, device, label: windows.append(label) or fn())
        args = bench_experts.parse_args(["--device", "cpu", "--shapes", "tiny", "--tokens",
                                         "4", "--paths", "triton,dense", "--rounds", "1"])
        args.profile_window = True
        points = bench_experts.bench_shape("tiny", args, DEVICE, 2, [0])
        assert [p.path for p in points] == ["triton", "dense"]
        assert [w.split(":")[0] for w in windows] == ["tiny T=4 triton", "tiny T=4 dense"]
        assert all("GB, x " in w for w in windows)


def test_bench_ep_routing(capsys: pytest.CaptureFixture[str]) -> None:
    """`--ep-ranks W`: one rank's view of EP routing (ids of other ranks -1, every token
    with a local expert), FLOPs over the local rows; a bad W is a usage error."""
    import json

    from moe.bench import experts as bench_experts

    ids_1 = bench_experts.random_tokens("tiny", 200, torch.float32,
                                        torch.Generator().manual_seed(0))[2]
    gen = torch.Generator().manual_seed(0)
    x, weights, ids = bench_experts.random_tokens("tiny", 200, torch.float32, gen, ep_ranks=4)
    num_experts = bench_experts.SHAPES["tiny"][3]
    assert ((ids >= -1) & (ids < num_experts)).all() and (ids_1 >= 0).all()
    assert (ids >= 0).any(dim=1).all(), "every received token has a local expert"
    assert (ids == -1).any(), "ids of the other ranks' experts arrive as -1"
    torch.testing.assert_close(weights.sum(1), torch.ones(200))
    with pytest.raises(SystemExit):
        bench_experts.main(["--ep-ranks", "0", "--dry-run"])
    with pytest.raises(SystemExit):
        bench_experts.main(["--rounds", "0", "--dry-run"])
    if DEVICE.type == "cpu":
        argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "6", "--ep-ranks", "2",
                "--paths", "triton,reference,dense", "--rounds", "1"]
        assert bench_experts.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("one rank of 2 under EP")
        record = json.loads(out[-1])
        assert record["ep_ranks"] == 2
        points = {p["path"]: p for p in record["points"]}
        assert points["triton"]["err"] < 1e-2
        # "of dense": each path's rate over the dense chain's at the same point.
        for path in ("triton", "reference"):
            assert points[path]["vs_dense"] == pytest.approx(
                points[path]["tflops"] / points["dense"]["tflops"])
        assert points["dense"]["vs_dense"] is None and "of dense" in out[1]


def test_bench_writes_table_json_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out`: the table, the JSON record and a PNG of every timed point; `--no-plot`
    leaves the PNG out; a plot of points without times is not drawn."""
    import json

    pytest.importorskip("matplotlib")
    from moe.bench import experts as bench_experts
    from moe.bench.experts_plot import plot_experts

    if DEVICE.type != "cpu":
        pytest.skip("the interpreted smoke run is the CPU path")
    argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4,8",
            "--paths", "triton,dense", "--rounds", "1", "--out", str(tmp_path / "a")]
    assert bench_experts.main(argv) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert json.loads((tmp_path / "a" / "experts.json").read_text())["points"] == record["points"]
    assert "of dense" in (tmp_path / "a" / "experts.txt").read_text()
    png = (tmp_path / "a" / "experts.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    no_plot = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4", "--paths", "dense",
               "--rounds", "1", "--out", str(tmp_path / "b"), "--no-plot"]
    assert bench_experts.main(no_plot) == 0
    assert (tmp_path / "b" / "experts.json").exists()
    assert not (tmp_path / "b" / "experts.png").exists()
    failed = bench_experts.Point("tiny", 4, "triton", None, None, None, 0.1, note="failed")
    assert not plot_experts([failed], tmp_path / "c.png", title="t")
    assert not (tmp_path / "c.png").exists()


def test_bench_sustain(capsys: pytest.CaptureFixture[str]) -> None:
    """`--sustain S` loads each path for S seconds before each timed round; the table
    and JSON carry the clock columns ('-' / null where no clock can be read)."""
    import json
    import time

    from moe.bench import experts as bench_experts

    calls = []
    start = time.perf_counter()
    assert bench_experts.sustain(lambda: calls.append(1), torch.device("cpu"), 0.05) == len(calls)
    assert len(calls) >= 4 and time.perf_counter() - start >= 0.05
    assert bench_experts.sustain(lambda: calls.append(1), torch.device("cpu"), 0.0) == 0
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            bench_experts.main(["--sustain", bad, "--dry-run"])
    capsys.readouterr()
    if DEVICE.type == "cpu":
        # Paths without the interpreter: sustain calls a path at least 4 times a round.
        argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4", "--paths",
                "reference,dense", "--rounds", "1", "--sustain", "0.02"]
        assert bench_experts.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        assert "SM MHz" in out[0] and "capped" in out[0]
        record = json.loads(out[-1])
        assert record["sustain_s"] == 0.02
        for point in record["points"]:
            assert point["ms"] > 0 and point["sm_mhz"] is None and point["capped"] == ""


def test_bench_clock_fields() -> None:
    """A point's clock: the median over the rounds that were read, and the capped count."""
    from moe.bench.experts import clock_fields
    from moe.bench.gpu_clocks import ClockSample

    samples = [ClockSample(1500, 690.0, True), None, ClockSample(1900, 300.0, False),
               ClockSample(1400, 700.0, True)]
    assert clock_fields(samples) == {"sm_mhz": 1500, "capped": "2/3"}
    assert clock_fields([None, None]) == {}


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


@pytest.mark.gpu
@pytest.mark.parametrize("tma, sorted_x", [(False, False), (True, False), (True, True)])
def test_gpu_load_variants(tma: bool, sorted_x: bool) -> None:
    """Each load path compiled on CUDA gives the pointer path's result bit for bit."""
    from moe.kernels.fused_moe.host import fused_moe

    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0+")
    problem = make_problem(2048, 1024, 384, 64, 8, dtype=_BF16, drop_frac=0.1)
    ref = ReferenceExperts().apply(*problem)
    out = fused_moe(*problem, policy=KernelPolicy(tma=tma, sorted_x=sorted_x))
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[_BF16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_experts", [(2048, 64), (4096, 16)])
def test_gpu_persistent(num_tokens: int, num_experts: int) -> None:
    """The persistent kernel compiled and autotuned on CUDA (128-row blocks, half tiles,
    sorted x or not), against the reference and the one-program-per-tile kernel."""
    from moe.kernels.fused_moe.host import fused_moe

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the persistent kernel loads by TMA: compute capability 9.0+")
    problem = make_problem(num_tokens, 1024, 384, num_experts, 8, dtype=_BF16, drop_frac=0.3)
    ref = ReferenceExperts().apply(*problem)
    for sorted_x in (False, True):
        out = fused_moe(*problem, block_m=128,
                        policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=True))
        torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[_BF16])
        plain = fused_moe(*problem, block_m=128,
                          policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=False))
        torch.testing.assert_close(out.float(), plain.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_gemm2_tails() -> None:
    """GEMM2 tails compiled on CUDA (the swapped second dot): at 256 rows per expert, where
    experts end in blocks of at most 32 rows, the same bits as without tails."""
    import moe.kernels.fused_moe.host as fm
    from moe.kernels.fused_moe.rules import GEMM2_TAIL_ROWS, GemmTiles

    problem = make_problem(1024, 1024, 384, 32, 8, dtype=_BF16)
    counts = torch.bincount(problem[3].view(-1), minlength=32)
    assert ((counts > 128) & (counts % 128 > 0) & (counts % 128 <= 32)).any(), "no tails"
    out = fm.fused_moe(*problem, block_m=128, policy=KernelPolicy(persistent=False))
    x, w13, w2, ids, weights = problem
    routing = align_routing_triton(ids, 32, 128)
    act = torch.randn(routing.sorted_ids_P.numel(), 384, device=DEVICE).to(_BF16)
    local = (ids.view(-1) >= 0).nonzero().view(-1)
    ys = []
    for tail in (GEMM2_TAIL_ROWS, 0):
        y = torch.empty(ids.numel(), 1024, dtype=_BF16, device=DEVICE)
        fm._launch(fm.kernel_launch(act, w2, y, weights, routing, n=1024, k=384,
                                    a_rows_div=1, a_sorted=True, tma=True,
                                    tiles=GemmTiles(128, half_tail=True, tail_rows=tail)))
        ys.append(y[local])
    assert torch.equal(ys[0], ys[1])
    ref = ReferenceExperts().apply(*problem)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[_BF16])


def test_tune_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """The tile sweep's CPU side: the candidate list, argument errors, the no-CUDA exit."""
    from moe.bench import tune as tune_experts

    assert tune_experts.main(["--dry-run", "--shapes", "ds-e8,qwen-e128", "--block-m", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 2 and all("tiles:" in line for line in lines)
    # Every listed tile fits the register budget (GEMM1 holds two fp32 accumulators).
    gemm1 = tune_experts.candidate_tiles(64, gated=True, n=2048, k=7168)
    assert gemm1 and all(t.block_n * 64 * 2 // (t.num_warps * 32) <= 128 for t in gemm1)
    assert any(t.block_n == 256 for t in tune_experts.candidate_tiles(64, gated=False, n=7168,
                                                                        k=2048))
    for bad in (["--block-m", "48"], ["--shapes", "nope"], ["--tokens", "x"],
                ["--block-k", "24"], ["--variants", "tma,fast"]):
        with pytest.raises(SystemExit):
            tune_experts.main(bad)
    if not torch.cuda.is_available():
        assert tune_experts.main(["--shapes", "tiny", "--tokens", "4"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
