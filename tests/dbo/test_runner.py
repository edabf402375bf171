"""Layer 1 (CPU): DBORunner on a small dense model that yields between layers.

The model is row-independent, so running it as two ubatches and concatenating must give
exactly the unsplit output (torch.equal) in every split mode and batch size.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.split import request_positions
from dbo.yield_points import dbo_current_ubatch_id, dbo_enabled, dbo_yield

HIDDEN = 16
NO_THRESHOLD = dict(min_decode_tokens=0, min_prefill_tokens=0)


class RowLinear(nn.Module):
    """y = x W^T + b computed as a per-row multiply and reduce.

    nn.Linear's CPU GEMM picks its blocking, and so its summation order, from the number
    of rows: a row of a 3-row batch can differ in the last bit from the same row in a
    37-row batch. A reduction over the last dim only keeps each row's arithmetic the same
    whatever the batch, which is what lets these tests compare DBO bitwise.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d_in] -> [..., d_out]
        return (x.unsqueeze(-2) * self.weight).sum(-1) + self.bias


class DenseModel(nn.Module):
    """RowLinear + GELU stack; yields after every layer; records which ubatch ran what."""

    def __init__(self, linear: type[nn.Module] = RowLinear) -> None:
        super().__init__()
        self.layers = nn.ModuleList([linear(HIDDEN, 32), linear(32, 32), linear(32, HIDDEN)])
        self.calls: list[int] = []             # ubatch id of every forward call
        self.trace: list[tuple[int, int]] = []  # (ubatch id, layer) in execution order
        self.seen_seq_lens: list[Any] = []

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                scale: float = 1.0, seq_lens: Any = None) -> dict[str, Any]:
        ubatch_id = dbo_current_ubatch_id()
        self.calls.append(ubatch_id)
        self.seen_seq_lens.append(seq_lens)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
            self.trace.append((ubatch_id, i))
            dbo_yield()
        if positions is not None:
            x = x + positions.unsqueeze(-1).to(x.dtype)
        return {"hidden": x * scale, "tag": "dense", "aux": None}

    def dbo_can_split_inside_request(self) -> bool:
        return True  # every row is computed on its own

    def reset(self) -> None:
        self.calls.clear()
        self.trace.clear()
        self.seen_seq_lens.clear()


@pytest.fixture
def model() -> DenseModel:
    torch.manual_seed(0)
    return DenseModel()


def _seq_lens_for(num_tokens: int) -> list[int]:
    return {0: [], 1: [1], 2: [2], 37: [10, 1, 20, 6]}[num_tokens]


def _halve(args: tuple, kwargs: dict) -> Optional[list[tuple[tuple, dict]]]:
    """A callable split mode: halve dim 0 of every tensor; None (no split) below 2 rows."""
    x = args[0]
    if x.shape[0] < 2:
        return None
    half = x.shape[0] // 2
    lo = {k: v[:half] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    hi = {k: v[half:] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return [((x[:half], *args[1:]), lo), ((x[half:], *args[1:]), hi)]


def _inputs(mode: str, n: int) -> tuple[tuple, dict]:
    if mode == "batch":
        return (torch.randn(n, 5, HIDDEN),), {"positions": torch.randint(0, 9, (n, 5))}
    kwargs: dict[str, Any] = {"positions": torch.arange(n), "scale": 0.5}
    if mode == "requests":
        kwargs["seq_lens"] = _seq_lens_for(n)
    return (torch.randn(n, HIDDEN),), kwargs


@pytest.mark.parametrize("n", [0, 1, 2, 37])
@pytest.mark.parametrize("mode", ["tokens", "requests", "batch", "callable"])
def test_dbo_output_equals_unsplit_bitwise(model: DenseModel, mode: str, n: int) -> None:
    args, kwargs = _inputs(mode, n)
    split = _halve if mode == "callable" else mode
    declared = {} if mode == "callable" else {"split_kwargs": ("positions",)}
    runner = DBORunner(model, DBOConfig(split=split, **declared, **NO_THRESHOLD))
    out = runner(*args, **kwargs)
    decision = runner.last_decision
    calls, trace = list(model.calls), list(model.trace)
    model.reset()
    expected = model(*args, **kwargs)

    assert torch.equal(out["hidden"], expected["hidden"])
    assert out["tag"] == "dense" and out["aux"] is None
    rows = n  # tokens, or sequences in "batch" mode
    assert decision is not None and decision.split == (rows >= 2), decision.reason
    if decision.split:
        # Two ubatches really ran, interleaved at every yield: 0, 1, 0, 1, ...
        assert calls == [0, 1]
        assert trace == [(u, layer) for layer in range(3) for u in (0, 1)]
    else:
        assert calls == [0]


def test_batch_mode_decode_and_prefill_thresholds(model: DenseModel) -> None:
    runner = DBORunner(model, DBOConfig(split="batch", min_decode_tokens=4,
                                        min_prefill_tokens=1000))
    runner(torch.randn(4, 1, HIDDEN))  # S == 1: decode, 4 tokens
    assert runner.last_decision.split and runner.last_decision.is_decode
    assert runner.last_decision.num_tokens == (2, 2)
    runner(torch.randn(3, 1, HIDDEN))  # 3 tokens, below 4
    assert not runner.last_decision.split
    assert "3 tokens < min_decode_tokens=4" in runner.last_decision.reason
    runner(torch.randn(4, 8, HIDDEN))  # 32 tokens of prefill, below 1000
    assert "32 tokens < min_prefill_tokens=1000 (prefill)" in runner.last_decision.reason
    runner(torch.randn(1, 8, HIDDEN))  # one sequence cannot be halved
    ids = DBORunner(lambda ids: ids * 2, DBOConfig(split="batch", min_decode_tokens=4))
    assert torch.equal(ids(torch.arange(5)), torch.arange(5) * 2)  # 1-D: [B] token ids
    assert ids.last_decision.is_decode and ids.last_decision.num_tokens == (2, 3)
    runner_any = DBORunner(model, DBOConfig(split="batch", **NO_THRESHOLD))
    runner_any(torch.randn(1, 8, HIDDEN))
    assert not runner_any.last_decision.split
    assert "empty" in runner_any.last_decision.reason


def test_decision_reporting(model: DenseModel) -> None:
    runner = DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=16))
    x = torch.randn(20, HIDDEN)
    runner(x, seq_lens=[10, 10])
    d = runner.last_decision
    assert d.split and d.num_tokens == (10, 10) and not d.vetoed
    assert "request boundary" in d.reason
    runner(x, seq_lens=[17, 3])
    d = runner.last_decision
    assert d.split and d.num_tokens == (10, 10) and "inside request 0" in d.reason
    assert d.ubatches[1].first_request_offset == 10
    runner(x[:8], seq_lens=[8])
    d = runner.last_decision
    assert not d.split and d.num_tokens == (8,)
    assert d.reason == "8 tokens < min_prefill_tokens=16 (prefill)"
    # The defaults keep small steps unsplit.
    default = DBORunner(model)
    default(torch.randn(8, HIDDEN))
    assert not default.last_decision.split and "min_decode_tokens=32" in default.last_decision.reason


@pytest.mark.parametrize("kind", ["list", "tuple", "tensor"])
def test_seq_lens_keep_their_type(model: DenseModel, kind: str) -> None:
    lens = [3, 5, 4]
    seq_lens = {"list": lens, "tuple": tuple(lens),
                "tensor": torch.tensor(lens, dtype=torch.int32)}[kind]
    runner = DBORunner(model, DBOConfig(split="requests", max_imbalance=1.0, **NO_THRESHOLD))
    runner(torch.randn(12, HIDDEN), seq_lens=seq_lens)
    assert runner.last_decision.num_tokens == (8, 4)
    ub0, ub1 = model.seen_seq_lens
    assert type(ub0) is type(seq_lens) and type(ub1) is type(seq_lens)
    if kind == "tensor":
        assert ub0.dtype == torch.int32
        assert ub0.tolist() == [3, 5] and ub1.tolist() == [4]
    else:
        assert list(ub0) == [3, 5] and list(ub1) == [4]


def test_split_request_offset_is_visible_to_the_model() -> None:
    """A model that needs positions within requests (as a KV cache does) gets them right."""
    def model(x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        decision = runner.last_decision
        offset = decision.ubatches[dbo_current_ubatch_id()].first_request_offset \
            if dbo_enabled() else 0
        return x + request_positions(seq_lens, first_request_offset=offset).unsqueeze(-1)

    runner = DBORunner(model, DBOConfig(split="requests", split_inside_requests=True,
                                        **NO_THRESHOLD))
    x, seq_lens = torch.zeros(30, 2), [4, 25, 1]
    out = runner(x, seq_lens=seq_lens)
    assert runner.last_decision.ubatches[1].first_request_offset == 11
    assert torch.equal(out, model(x, seq_lens))


class CallMixing(nn.Module):
    """Each token gets the mean of its request's tokens in the call: cutting a request
    across two calls changes its tokens' outputs."""

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return torch.cat([part.mean(0, keepdim=True).expand_as(part)
                          for part in x.split(list(seq_lens))])


class SaysNo(CallMixing):
    def dbo_can_split_inside_request(self) -> bool:
        return False


@pytest.mark.parametrize("mixing", [CallMixing, SaysNo])
def test_requests_stay_whole_unless_the_model_says_they_may_be_cut(mixing: type) -> None:
    """The default config cuts no request of a model that does not say it may be cut: a
    lopsided step runs unsplit (saying why), a balanced one splits at a boundary."""
    runner = DBORunner(mixing(), DBOConfig(split="requests", **NO_THRESHOLD))
    x = torch.randn(20, HIDDEN)
    for seq_lens in ([17, 3], [20]):
        assert torch.equal(runner(x, seq_lens=seq_lens), mixing()(x, seq_lens))
        d = runner.last_decision
        assert not d.split and "no request is cut" in d.reason, d.reason
    assert ("does not say that a request may run in two calls" if mixing is CallMixing
            else "SaysNo.dbo_can_split_inside_request() is False") in d.reason
    runner(x, seq_lens=[9, 1, 10])  # imbalance 0.0: a boundary split, as before
    assert runner.last_decision.num_tokens == (10, 10)
    assert runner.last_decision.ubatches[1].first_request_offset == 0
    # Any boundary on request: max_imbalance=1.0.
    lopsided = DBORunner(mixing(), DBOConfig(split="requests", max_imbalance=1.0,
                                             **NO_THRESHOLD))
    assert torch.equal(lopsided(x, seq_lens=[17, 3]), mixing()(x, [17, 3]))
    assert lopsided.last_decision.num_tokens == (17, 3)


def test_split_inside_requests_true_and_false() -> None:
    """The caller's word overrides a model without the hook; never one that says no."""
    forced = DBORunner(CallMixing(), DBOConfig(split="requests", split_inside_requests=True,
                                               **NO_THRESHOLD))
    forced(torch.randn(20, HIDDEN), seq_lens=[17, 3])
    assert forced.last_decision.ubatches[1].first_request_offset == 10
    with pytest.raises(ValueError, match=r"split_inside_requests=True\), but SaysNo\."
                       r"dbo_can_split_inside_request\(\) is False"):
        DBORunner(SaysNo(), DBOConfig(split="requests", split_inside_requests=True))
    forced.model = SaysNo()  # a replaced model is asked again, before its first step
    with pytest.raises(ValueError, match="is False"):
        forced(torch.randn(20, HIDDEN), seq_lens=[17, 3])
    torch.manual_seed(0)
    never = DBORunner(DenseModel(), DBOConfig(split="requests", split_inside_requests=False,
                                              **NO_THRESHOLD))
    never(torch.randn(20, HIDDEN), seq_lens=[17, 3])
    assert not never.last_decision.split
    assert "DBOConfig.split_inside_requests=False" in never.last_decision.reason


def test_cut_hook_must_return_a_bool() -> None:
    class Vague(CallMixing):
        def dbo_can_split_inside_request(self) -> str:
            return "yes"

    with pytest.raises(TypeError, match=r"Vague.dbo_can_split_inside_request\(\) returned "
                                        r"'yes': it must return True"):
        DBORunner(Vague(), DBOConfig(split="requests"))


def test_tokens_mode_does_not_ask_the_model() -> None:
    """A call without request lengths ("tokens"): every row is its own request, so the
    rows are halved whatever the model says about cutting requests."""
    class Doubles(SaysNo):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    runner = DBORunner(Doubles(), DBOConfig(**NO_THRESHOLD))
    x = torch.randn(6, HIDDEN)
    assert torch.equal(runner(x), x * 2) and runner.last_decision.num_tokens == (3, 3)


def test_disabled_runs_model_as_is(model: DenseModel) -> None:
    runner = DBORunner(model, DBOConfig(enabled=False, **NO_THRESHOLD))
    x = torch.randn(64, HIDDEN)
    out = runner(x)
    assert model.calls == [0] and not runner.last_decision.split
    assert "disabled" in runner.last_decision.reason
    assert torch.equal(out["hidden"], model(x)["hidden"])


def test_other_arguments_pass_through(model: DenseModel) -> None:
    calls: list[tuple[int, int]] = []

    def fn(x: torch.Tensor, w: torch.Tensor, k: int, *, bias: torch.Tensor) -> torch.Tensor:
        calls.append((x.shape[0], w.shape[0]))
        return x * w + bias + k

    runner = DBORunner(fn, DBOConfig(unsplit_args=(1,), split_kwargs=("bias",),
                                     **NO_THRESHOLD))
    x, w, bias = torch.randn(9, 4), torch.randn(4), torch.randn(9, 1)
    out = runner(x, w, 3, bias=bias)
    assert calls == [(4, 4), (5, 4)]  # w ([4], declared whole) went whole to both
    assert torch.equal(out, fn(x, w, 3, bias=bias))


def test_custom_merge_and_non_row_major_output() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum()  # a 0-dim per-ubatch statistic

    with pytest.raises(TypeError, match=r"output\[1\] is a 0-dim tensor.*DBOConfig\(merge=fn\)"):
        DBORunner(fn, DBOConfig(**NO_THRESHOLD))(torch.ones(4, 2))

    def merge(outs: list) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([o[0] for o in outs]), sum(o[1] for o in outs)

    runner = DBORunner(fn, DBOConfig(merge=merge, **NO_THRESHOLD))
    out = runner(torch.ones(4, 2))
    assert torch.equal(out[0], torch.full((4, 2), 2.0)) and out[1].item() == 8.0

    with pytest.raises(ValueError, match=r"output has shape \[3\] on ubatch 0, which holds 2 rows"):
        DBORunner(lambda x: x.new_ones(3), DBOConfig(**NO_THRESHOLD))(torch.ones(4, 2))


def test_nn_linear_model_within_tolerance() -> None:
    torch.manual_seed(0)
    model = DenseModel(linear=nn.Linear)
    x = torch.randn(37, HIDDEN)
    out = DBORunner(model, DBOConfig(**NO_THRESHOLD))(x)
    # Not bitwise: nn.Linear's GEMM sums in an order that depends on the row count
    # (see RowLinear); the rows agree to fp32 rounding.
    torch.testing.assert_close(out["hidden"], model(x)["hidden"], rtol=1e-5, atol=1e-6)


def test_gradients_match(model: DenseModel) -> None:
    x = torch.randn(37, HIDDEN, requires_grad=True)
    DBORunner(model, DBOConfig(**NO_THRESHOLD))(x)["hidden"].square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    model(x)["hidden"].square().sum().backward()
    # Input grads are per row (bitwise); weight grads sum over rows, which the split
    # does in two partial sums, so they agree to fp32 rounding only.
    assert torch.equal(grads[-1], x.grad)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5)


def test_nested_runner_runs_unsplit(model: DenseModel) -> None:
    inner = DBORunner(model, DBOConfig(**NO_THRESHOLD))
    outer = DBORunner(lambda x: inner(x)["hidden"], DBOConfig(**NO_THRESHOLD))
    x = torch.randn(6, HIDDEN)
    out = outer(x)
    assert outer.last_decision.split and model.calls == [0, 1]
    assert "inside a running DBO step" in inner.last_decision.reason
    assert torch.equal(out, model(x)["hidden"])


def test_exception_in_a_ubatch_propagates(model: DenseModel) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        dbo_yield()
        if dbo_current_ubatch_id() == 1:
            raise RuntimeError("boom")
        return x

    with pytest.raises(RuntimeError, match="boom") as info:
        DBORunner(fn, DBOConfig(**NO_THRESHOLD))(torch.ones(4))
    assert info.value.dbo_ubatch_id == 1  # type: ignore[attr-defined]


def test_bad_input_errors(model: DenseModel) -> None:
    with pytest.raises(ValueError, match="'tokenz' is not a split mode"):
        DBORunner(model, DBOConfig(split="tokenz"))
    requests = DBORunner(model, DBOConfig(split="requests", **NO_THRESHOLD))
    with pytest.raises(ValueError, match=r"seq_lens sum to 8 tokens but the batch has 9 tokens"):
        requests(torch.randn(9, HIDDEN), seq_lens=[5, 3])
    with pytest.raises(TypeError, match=r"split='requests' needs .* seq_lens=\["):
        requests(torch.randn(9, HIDDEN))
    with pytest.raises(TypeError, match="the call has none"):
        DBORunner(lambda n: n, DBOConfig(**NO_THRESHOLD))(5)
    with pytest.raises(TypeError, match="0-dim tensor"):
        DBORunner(model, DBOConfig(**NO_THRESHOLD))(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"split callable bad returned a list.*2 \(args: tuple"):
        def bad(args: tuple, kwargs: dict) -> list:
            return [args]
        DBORunner(model, DBOConfig(split=bad))(torch.randn(4, HIDDEN))
    with pytest.raises(TypeError, match="needs a callable model"):
        DBORunner(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a DBOConfig"):
        DBORunner(model, {"split": "tokens"})  # type: ignore[arg-type]


# ------------------------------------------------- the default split mode (split=None)
class DeclaresRequests(DenseModel):
    """`DenseModel` that declares its split mode, as `MoETransformer` does."""

    def dbo_split_mode(self) -> str:
        return "requests"


def test_default_split_takes_the_mode_the_model_declares() -> None:
    torch.manual_seed(0)
    model = DeclaresRequests()
    runner = DBORunner(model, DBOConfig(max_imbalance=1.0, **NO_THRESHOLD))
    x = torch.randn(12, HIDDEN)
    out = runner(x, seq_lens=[3, 5, 4])
    d = runner.last_decision
    # "requests": cut at a request boundary, each ubatch with its own seq_lens ("tokens"
    # would have halved the rows and handed both ubatches all three lengths).
    assert d.split and d.num_tokens == (8, 4) and model.seen_seq_lens == [[3, 5], [4]]
    assert d.reason.endswith("(split=None chose 'requests': DeclaresRequests.dbo_split_mode "
                             "says so)"), d.reason
    model.reset()
    assert torch.equal(out["hidden"], model(x, seq_lens=[3, 5, 4])["hidden"])
    # An attribute declares it as well as a method.
    fn = lambda x, seq_lens: x * 2  # noqa: E731
    fn.dbo_split_mode = "requests"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"split='requests' needs the tokens per request"):
        DBORunner(fn, DBOConfig(**NO_THRESHOLD))(torch.ones(4, 2))


def test_default_split_is_requests_for_a_call_with_seq_lens_else_tokens(
        model: DenseModel) -> None:
    runner = DBORunner(model, DBOConfig(max_imbalance=1.0, **NO_THRESHOLD))
    runner(torch.randn(12, HIDDEN), seq_lens=[3, 5, 4])
    d = runner.last_decision
    assert d.num_tokens == (8, 4) and model.seen_seq_lens == [[3, 5], [4]]
    assert "(split=None chose 'requests': the call has seq_lens=)" in d.reason
    model.reset()
    runner(torch.randn(12, HIDDEN))
    d = runner.last_decision
    assert d.num_tokens == (6, 6) and d.is_decode and model.seen_seq_lens == [None, None]
    assert d.reason == ("halved 12 independent tokens into 6 + 6 (split=None chose 'tokens': "
                        "DenseModel declares no dbo_split_mode and the call has no seq_lens=)")
    assert runner.agreement_fields()["DBOConfig.split"] == "auto"
    # The choice is kept per model and config: a replaced model is asked afresh.
    runner.model = DeclaresRequests()
    with pytest.raises(TypeError, match=r"split='requests' needs the tokens per request"):
        runner(torch.randn(12, HIDDEN))


def test_explicit_split_modes_ignore_the_model_s_declaration() -> None:
    torch.manual_seed(0)
    model = DeclaresRequests()
    runner = DBORunner(model, DBOConfig(split="tokens", **NO_THRESHOLD))
    runner(torch.randn(12, HIDDEN), seq_lens=[3, 5, 4])
    d = runner.last_decision
    assert d.num_tokens == (6, 6) and "split=None" not in d.reason
    assert model.seen_seq_lens == [[3, 5, 4], [3, 5, 4]]  # "tokens" passes it whole


def test_default_split_refusals() -> None:
    class Says(DenseModel):
        def dbo_split_mode(self) -> str:
            return "rows"

    with pytest.raises(ValueError, match=r"Says.dbo_split_mode gives 'rows': it must give one "
                                         r"of 'tokens', 'requests', 'batch'"):
        DBORunner(Says())
    # A model that declares "requests" has its cut policy checked at once, as split="requests".
    with pytest.raises(ValueError, match=r"split_inside_requests=True\), but SaysNo"):
        DBORunner(type("SaysNoRequests", (SaysNo,), {"dbo_split_mode": lambda self: "requests"})(),
                  DBOConfig(split_inside_requests=True))
    runner = DBORunner(lambda x: x, DBOConfig(split_inside_requests=True, **NO_THRESHOLD))
    with pytest.raises(ValueError, match=r"split_inside_requests=True\) cuts requests, but "
                                         r"split=None chose 'tokens' for this call"):
        runner(torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"DBOConfig\(split=None\) splits a call with seq_lens="):
        DBOConfig(unsplit_args=("seq_lens",))


def test_a_call_the_model_s_input_check_does_not_take_raises_one_clear_error() -> None:
    class Checked(nn.Module):
        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

        def dbo_check_inputs(self, x: torch.Tensor, *, mask: torch.Tensor) -> None:
            if mask.dtype != torch.bool:
                raise TypeError(f"mask must be bool, got {mask.dtype}")

    runner = DBORunner(Checked(), DBOConfig(**NO_THRESHOLD))
    with pytest.raises(TypeError) as info:
        runner(torch.ones(4, 2))
    # The middle is inspect.Signature.bind's own words, which Python 3.12 changed
    # ("missing a required keyword-only argument"): either is this call's error.
    assert re.match(r"Checked does not take this call's arguments: missing a required "
                    r"(keyword-only )?argument: 'mask' \(got 1 positional and the keywords "
                    r"\[\]\)", str(info.value)), str(info.value)
    # One process, no group: no note about one, and no chained hook error.
    assert not getattr(info.value, "__notes__", []) and info.value.__cause__ is None
    assert info.value.__context__ is None
    with pytest.raises(TypeError, match="mask must be bool, got torch.float32"):
        runner(torch.ones(4, 2), mask=torch.ones(4, 1))  # the hook's own TypeError


# ------------------------------------------------------ a model that never yields
def test_a_model_that_never_yields_is_warned_about_once(model: DenseModel) -> None:
    from dbo.runner import NoYieldWarning

    linear = nn.Linear(HIDDEN, HIDDEN)
    runner = DBORunner(linear, DBOConfig(**NO_THRESHOLD))
    x = torch.randn(8, HIDDEN)
    with pytest.warns(NoYieldWarning, match=r"DBORunner over Linear: the model never yielded "
                                            r"to the other ubatch.*backend 'local'.*Warned "
                                            r"once per runner") as caught:
        runner(x)
    assert len(caught) == 1
    assert runner.last_decision.reason.endswith("; the model never yielded to the other "
                                                "ubatch, so the two ubatches ran one after "
                                                "the other and overlapped nothing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        runner(x)
        assert "never yielded" not in runner.last_decision.reason
        runner(x[:1])  # unsplit: nothing to say
        # A model that yields (DenseModel, after each layer) is never warned about.
        yielding = DBORunner(model, DBOConfig(**NO_THRESHOLD))
        yielding(x)
        assert yielding.last_decision.split and "never yielded" not in \
            yielding.last_decision.reason


def test_the_scheduler_says_whether_the_ubatches_interleaved() -> None:
    from dbo.scheduler import UBatchScheduler

    scheduler = UBatchScheduler("cpu")
    assert scheduler.last_run_interleaved is None
    scheduler.run([lambda: 0, lambda: 1])
    assert scheduler.last_run_interleaved is False
    scheduler.run([lambda: dbo_yield(), lambda: 1])   # ubatch 0 hands off once
    assert scheduler.last_run_interleaved is True
    scheduler.run([lambda: 0, lambda: dbo_yield()])   # ubatch 1's yield comes too late
    assert scheduler.last_run_interleaved is False
    scheduler.run([lambda: dbo_yield()])              # one ubatch: nothing to interleave
    assert scheduler.last_run_interleaved is None


def test_a_split_callable_that_drops_rows_is_refused_naming_it(model: DenseModel) -> None:
    def drops_rows(args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        x = args[0]
        return [((x[:2],), {}), ((x[2:4],), {})]  # 4 of the step's rows

    runner = DBORunner(model, DBOConfig(split=drops_rows, **NO_THRESHOLD))
    with pytest.raises(ValueError, match=r"split callable drops_rows returned ubatches of "
                                         r"2 \+ 2 = 4 rows but the step has 10 rows"):
        runner(torch.randn(10, HIDDEN))
    assert model.calls == []  # refused before the model ran


def test_a_runner_shared_by_two_threads_refuses_the_second_before_it_runs() -> None:
    import threading

    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def blocking(x: torch.Tensor) -> torch.Tensor:
        calls.append(threading.current_thread().name)
        if threading.current_thread().name == "first":
            entered.set()
            assert release.wait(30)
        dbo_yield()
        return x

    runner = DBORunner(blocking, DBOConfig(**NO_THRESHOLD))
    results: dict[str, Any] = {}

    def call(name: str) -> None:
        try:
            results[name] = runner(torch.ones(4, 2))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[name] = exc

    first = threading.Thread(target=call, args=("first",), name="first")
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=call, args=("second",), name="second")
    second.start()
    second.join(30)
    release.set()
    first.join(30)
    error = results["second"]
    assert isinstance(error, RuntimeError) and str(error).startswith(
        "a DBORunner runs one step at a time on one thread; give each thread its own "
        "runner"), repr(error)
    assert "second" not in calls  # nothing of the model ran on the second thread
    assert torch.equal(results["first"], torch.ones(4, 2))  # the first step is unharmed
    assert torch.equal(runner(torch.ones(4, 2)), torch.ones(4, 2))  # and the next runs
