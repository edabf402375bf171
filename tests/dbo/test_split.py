"""Layer 1 (CPU): the split policy in dbo.split and the DBOConfig checks, property-based."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dbo.config import DBOConfig
from dbo.split import (
    SplitPlan,
    normalize_seq_lens,
    plan_split,
    plan_token_split,
    request_positions,
)

NO_THRESHOLD = DBOConfig(min_decode_tokens=0, min_prefill_tokens=0)

seq_lens_st = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=24)
configs_st = st.builds(
    DBOConfig,
    min_decode_tokens=st.integers(min_value=0, max_value=12),
    min_prefill_tokens=st.integers(min_value=0, max_value=60),
    max_imbalance=st.one_of(st.sampled_from([0.0, 1.0]),
                            st.floats(min_value=0.0, max_value=1.0, allow_nan=False)),
)


def _boundary_imbalances(lens: list[int]) -> list[float]:
    """Imbalance of every request-boundary split that leaves tokens on both sides."""
    total = sum(lens)
    out = []
    for k in range(len(lens) + 1):
        n0 = sum(lens[:k])
        if 0 < n0 < total:
            out.append(abs(total - 2 * n0) / total)
    return out


def _check_slices(lens: list[int], plan: SplitPlan) -> None:
    """Invariants every split plan must satisfy."""
    total = sum(lens)
    ub0, ub1 = plan.ubatches
    assert plan.num_tokens == (ub0.num_tokens, ub1.num_tokens)
    assert sum(plan.num_tokens) == total
    assert ub0.num_tokens > 0 and ub1.num_tokens > 0
    assert (ub0.token_start, ub0.token_end, ub1.token_start, ub1.token_end) == \
        (0, ub0.num_tokens, ub0.num_tokens, total)
    for ub in plan.ubatches:  # rebased: each ubatch's seq_lens count only its tokens
        assert sum(ub.seq_lens) == ub.num_tokens
        assert ub.cu_seqlens()[0] == 0 and ub.cu_seqlens()[-1] == ub.num_tokens
        assert len(ub.seq_lens) == ub.num_requests
        assert ub0.first_request_offset == 0
    if ub1.first_request_offset == 0:  # a request-boundary split
        assert ub0.request_end == ub1.request_start
        assert list(ub0.seq_lens) + list(ub1.seq_lens) == lens
    else:  # request r split inside: head in ubatch 0, tail opens ubatch 1
        r = ub1.request_start
        assert ub0.request_end == r + 1
        assert ub0.seq_lens[-1] == ub1.first_request_offset > 0
        assert ub0.seq_lens[-1] + ub1.seq_lens[0] == lens[r]
        assert list(ub0.seq_lens[:-1]) == lens[:r] and list(ub1.seq_lens[1:]) == lens[r + 1:]
    # Positions within requests: the step's, sliced, equal each ubatch's own, rebased.
    step_pos = request_positions(lens)
    for ub in plan.ubatches:
        assert torch.equal(step_pos[ub.token_start:ub.token_end],
                           request_positions(ub.seq_lens,
                                             first_request_offset=ub.first_request_offset))


@settings(max_examples=250, deadline=None)
@given(lens=seq_lens_st, config=configs_st)
def test_plan_split_properties(lens: list[int], config: DBOConfig) -> None:
    plan = plan_split(lens, config)
    total = sum(lens)
    is_decode = total > 0 and max(lens) <= 1
    threshold = config.min_decode_tokens if is_decode else config.min_prefill_tokens
    boundaries = _boundary_imbalances(lens)
    expect_split = total >= 2 and total >= threshold and (bool(boundaries)
                                                          or config.max_imbalance < 1.0)
    assert plan.split == expect_split, plan.reason
    assert plan.reason and plan.is_decode == is_decode
    if not plan.split:
        assert plan.ubatches == () and plan.num_tokens == (total,)
        return
    _check_slices(lens, plan)
    ub0, ub1 = plan.ubatches
    n0, n1 = plan.num_tokens
    best = min(boundaries, default=1.0)
    if ub1.first_request_offset:
        # Only when the best boundary is too lopsided, and then exactly balanced.
        assert best > config.max_imbalance and best > total % 2 / total
        assert n0 == total // 2
        assert "inside request" in plan.reason
    else:
        assert abs(n0 - n1) / total == best  # the best boundary, nothing worse
        if is_decode:
            assert n0 == total // 2 and "decode" in plan.reason


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(min_value=1, max_value=30), min_size=2, max_size=24))
def test_max_imbalance_one_never_splits_inside_a_request(lens: list[int]) -> None:
    plan = plan_split(lens, DBOConfig(min_prefill_tokens=0, min_decode_tokens=0,
                                      max_imbalance=1.0))
    assert plan.split
    assert all(ub.first_request_offset == 0 for ub in plan.ubatches)
    _check_slices(lens, plan)


@settings(max_examples=100, deadline=None)
@given(lens=seq_lens_st)
def test_no_split_inside_request_when_disallowed(lens: list[int]) -> None:
    plan = plan_split(lens, DBOConfig(min_prefill_tokens=0, min_decode_tokens=0,
                                      max_imbalance=0.0), allow_split_inside_request=False)
    assert plan.split == bool(_boundary_imbalances(lens))
    if plan.split:
        assert plan.ubatches[1].first_request_offset == 0
        _check_slices(lens, plan)


@settings(max_examples=150, deadline=None)
@given(lens=seq_lens_st, config=configs_st)
def test_whole_requests_split_at_a_boundary_within_max_imbalance_or_not_at_all(
        lens: list[int], config: DBOConfig) -> None:
    """With `whole_requests` no request is cut: the step splits where `plan_split` would
    have split at a boundary, and runs unsplit, saying why, where it would have cut."""
    free = plan_split(lens, config)
    plan = plan_split(lens, config, whole_requests="the model mixes tokens")
    cut = free.split and free.ubatches[1].first_request_offset > 0
    assert plan.split == (free.split and not cut), plan.reason
    if plan.split:
        assert plan == free
    elif cut:
        assert plan.reason.endswith("no request is cut: the model mixes tokens")
        assert plan.num_tokens == (sum(lens),) and plan.ubatches == ()


@given(num_requests=st.integers(min_value=2, max_value=300))
def test_decode_halves_requests(num_requests: int) -> None:
    plan = plan_split([1] * num_requests, NO_THRESHOLD)
    assert plan.split and plan.is_decode
    ub0, ub1 = plan.ubatches
    assert (ub0.num_requests, ub1.num_requests) == (num_requests // 2,
                                                    num_requests - num_requests // 2)
    assert ub0.seq_lens == (1,) * ub0.num_requests


@given(num_tokens=st.integers(min_value=0, max_value=10_000))
def test_token_split_halves(num_tokens: int) -> None:
    plan = plan_token_split(num_tokens, NO_THRESHOLD)
    assert plan.split == (num_tokens >= 2)
    if plan.split:
        assert plan.num_tokens == (num_tokens // 2, num_tokens - num_tokens // 2)
        assert plan.ubatches[1].token_start == num_tokens // 2
        assert plan.ubatches[0].seq_lens is None
        with pytest.raises(ValueError, match="no request structure"):
            plan.ubatches[0].cu_seqlens()


def test_split_inside_single_request() -> None:
    plan = plan_split([10], DBOConfig(min_prefill_tokens=0))
    assert plan.split
    ub0, ub1 = plan.ubatches
    assert (ub0.seq_lens, ub1.seq_lens, ub1.first_request_offset) == ((5,), (5,), 5)
    assert (ub0.request_start, ub0.request_end, ub1.request_start, ub1.request_end) == (0, 1, 0, 1)


def test_boundary_within_imbalance_is_kept() -> None:
    # 10 + 8 is 0.11 off balance: kept with 0.2, cut inside request 0 with 0.1.
    assert plan_split([10, 8], DBOConfig(min_prefill_tokens=0, max_imbalance=0.2)
                      ).ubatches[1].first_request_offset == 0
    cut = plan_split([10, 8], DBOConfig(min_prefill_tokens=0, max_imbalance=0.1))
    assert cut.ubatches[1].first_request_offset == 9 and cut.num_tokens == (9, 9)


@pytest.mark.parametrize("lens, is_decode", [([1] * 8, True), ([4, 4], False)])
def test_thresholds(lens: list[int], is_decode: bool) -> None:
    name = "min_decode_tokens" if is_decode else "min_prefill_tokens"
    other = "min_prefill_tokens" if is_decode else "min_decode_tokens"
    # Only the threshold of the step's kind applies; "below" means strictly fewer tokens.
    assert plan_split(lens, DBOConfig(**{name: 8, other: 1000})).split
    below = plan_split(lens, DBOConfig(**{name: 9, other: 0}))
    assert not below.split
    assert f"8 tokens < {name}=9" in below.reason


def test_token_split_uses_decode_threshold() -> None:
    assert plan_token_split(32, DBOConfig(min_decode_tokens=32, min_prefill_tokens=10_000)).split
    plan = plan_token_split(31, DBOConfig(min_decode_tokens=32))
    assert not plan.split and "min_decode_tokens=32" in plan.reason


@pytest.mark.parametrize("lens, reason", [([], "0 tokens"), ([0, 0], "0 tokens"),
                                          ([1], "1 token"), ([0, 1, 0], "1 token")])
def test_zero_or_one_token_never_splits(lens: list[int], reason: str) -> None:
    plan = plan_split(lens, NO_THRESHOLD)
    assert not plan.split and reason in plan.reason


def test_single_request_without_split_inside_reports_empty_side() -> None:
    plan = plan_split([50], DBOConfig(min_prefill_tokens=0, max_imbalance=1.0))
    assert not plan.split and "empty" in plan.reason and "max_imbalance=1.0" in plan.reason


def test_tensor_seq_lens() -> None:
    plan = plan_split(torch.tensor([3, 5, 2], dtype=torch.int32), NO_THRESHOLD)
    assert plan.split and plan.ubatches[0].seq_lens == (3, 2)


def test_bad_seq_lens() -> None:
    with pytest.raises(ValueError, match=r"seq_lens sum to 8 tokens but the batch has 9"):
        plan_split([5, 3], NO_THRESHOLD, num_tokens=9)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=-2 is negative"):
        plan_split([5, -2], NO_THRESHOLD)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        normalize_seq_lens(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        normalize_seq_lens(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"must hold ints.*2\.5"):
        normalize_seq_lens([1, 2.5])
    with pytest.raises(TypeError, match="list/tuple of ints"):
        normalize_seq_lens(7)  # type: ignore[arg-type]


def test_config_checks() -> None:
    with pytest.raises(ValueError, match=r"'tokenz' is not a split mode.*'tokens', 'requests', 'batch'"):
        DBOConfig(split="tokenz")
    with pytest.raises(ValueError, match="None .the model's or the call's mode. or a callable"):
        DBOConfig(split=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_ubatches=3: only 2"):
        DBOConfig(num_ubatches=3)
    with pytest.raises(ValueError, match="min_prefill_tokens=-1"):
        DBOConfig(min_prefill_tokens=-1)
    with pytest.raises(ValueError, match="min_decode_tokens=1.5"):
        DBOConfig(min_decode_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_imbalance=1.5 must be a number in \[0, 1\]"):
        DBOConfig(max_imbalance=1.5)
    with pytest.raises(ValueError, match="merge must be None or a callable"):
        DBOConfig(merge="cat")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enabled must be True or False, got 1"):
        DBOConfig(enabled=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enabled must be True or False, got 'false'"):
        DBOConfig(enabled="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="joined_experts must be True or False, got 1"):
        DBOConfig(joined_experts=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        DBOConfig("tokens")  # type: ignore[misc]  # keyword-only
    with pytest.raises(TypeError, match=r"split_inside_requests='yes' must be None"):
        DBOConfig(split="requests", split_inside_requests="yes")  # type: ignore[arg-type]
    for mode in ("tokens", "batch"):
        with pytest.raises(ValueError, match=rf"split_inside_requests=True cuts the requests "
                                             rf"of split='requests', but split='{mode}'"):
            DBOConfig(split=mode, split_inside_requests=True)
    assert DBOConfig(split="batch", split_inside_requests=False).split == "batch"
    DBOConfig(split=lambda args, kwargs: None, merge=lambda outs: outs[0])  # callables are fine
