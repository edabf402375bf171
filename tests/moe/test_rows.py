"""Layer 3 (Triton interpreter on CPU): `moe.kernels.rows`: packing token rows by source index and the gather-sum, Triton
(interpreted on CPU) against torch and against sums written out by hand."""
from __future__ import annotations

import pytest
import torch

from moe.row_layout import RowLayout
from moe.kernels import rows
from moe.kernels.policy import KernelPolicy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = ["triton", "torch"]


@pytest.fixture
def path(request):
    return KernelPolicy(implementation=request.param)


def make_tokens(num_tokens: int, hidden: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids = torch.randint(-1, 40, (num_tokens, top_k), generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("hidden,top_k,dtype", [(24, 3, torch.float32), (1100, 8, torch.bfloat16),
                                                (33, 1, torch.float16)])
def test_pack_rows_writes_each_source_and_pads_the_rest(path, hidden, top_k, dtype):
    x, ids, weights = make_tokens(7, hidden, top_k, dtype)
    layout = RowLayout(hidden, top_k, dtype)
    src = torch.tensor([3, -1, 0, 6, 3, -1, 5, 1, 2, -1, 4], device=DEVICE)
    packed = torch.full((src.shape[0], layout.row_bytes), 0xAB, dtype=torch.uint8, device=DEVICE)
    rows.pack_rows(packed, layout, x, ids, weights, src, policy=path)
    got_ids, got_weights, got_x = layout.unpack(packed)
    for s, t in enumerate(src.tolist()):
        if t >= 0:
            assert torch.equal(got_ids[s], ids[t]) and torch.equal(got_weights[s], weights[t])
            assert torch.equal(got_x[s], x[t]), f"row {s} (token {t})"
        else:
            assert (got_ids[s] == -1).all() and (got_weights[s] == 0).all()
            assert (got_x[s] == 0).all(), f"padding row {s} keeps stale x"


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_pack_rows_without_tokens_writes_padding(path):
    layout = RowLayout(16, 2, torch.bfloat16)
    x, ids, weights = make_tokens(0, 16, 2, torch.bfloat16)
    packed = torch.full((4, layout.row_bytes), 7, dtype=torch.uint8, device=DEVICE)
    rows.pack_rows(packed, layout, x, ids, weights, torch.full((4,), -1, device=DEVICE),
                   policy=path)
    got_ids, got_weights, got_x = layout.unpack(packed)
    assert (got_ids == -1).all() and (got_weights == 0).all() and (got_x == 0).all()


def test_pack_rows_checks_its_row_count():
    layout = RowLayout(16, 2, torch.float32)
    x, ids, weights = make_tokens(3, 16, 2, torch.float32)
    packed = torch.empty(4, layout.row_bytes, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="4 rows but 3 sources"):
        rows.pack_rows(packed, layout, x, ids, weights, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("width,hidden,dtype", [(1, 24, torch.float32), (2, 1100, torch.bfloat16),
                                                (3, 33, torch.float16)])
def test_sum_rows_adds_the_selected_rows_in_fp32(path, width, hidden, dtype):
    gen = torch.Generator().manual_seed(width)
    num_tokens, num_rows = 9, 20
    src = torch.randn(num_rows, hidden, generator=gen).to(dtype).to(DEVICE)
    sel = torch.randint(-1, num_rows, (num_tokens, width), generator=gen)
    sel[0] = -1  # a token no rank computed anything for
    out = rows.sum_rows(src, sel.to(DEVICE), policy=path)
    want = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for w in range(width):
            if sel[t, w] >= 0:
                want[t] += src[sel[t, w]].float().cpu()
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    # The fp32 sums in w order, rounded once to the rows' dtype: exact, except that the
    # Triton interpreter rounds fp32 -> 16-bit by truncation (the GPU rounds to nearest):
    # there, one ulp.
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 0.0)
    rtol = ulp if path.implementation == "triton" and DEVICE == "cpu" else 0.0
    torch.testing.assert_close(out.float().cpu(), want.to(dtype).float(), rtol=rtol, atol=0)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_sum_rows_reads_a_strided_source_and_no_tokens(path):
    base = torch.randn(6, 40, device=DEVICE)
    src = base[:, 4:36]  # row stride 40, as in a packed buffer
    sel = torch.tensor([[5, 0], [-1, 2]], device=DEVICE)
    out = rows.sum_rows(src, sel, policy=path)
    torch.testing.assert_close(out, torch.stack([src[5] + src[0], src[2]]), rtol=0, atol=0)
    empty = rows.sum_rows(src, torch.empty(0, 2, dtype=torch.int64, device=DEVICE),
                          policy=path)
    assert empty.shape == (0, 32)


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="'cuda'.*auto"):
        KernelPolicy(implementation="cuda")
