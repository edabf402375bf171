"""Layer 1 (CPU, one process, no group): what a model must keep to be split by DBORunner.

A tensor argument whose dim 0 is not the step's rows is refused unless declared whole
(`DBOConfig.unsplit_args`); a keyword tensor split by rows without being declared
row-major (`DBOConfig.split_kwargs`) is warned about once per runner; an output leaf
that is not a tensor must be equal on both ubatches; errors raised inside a ubatch name
the rows of the step it ran, and `MoETransformer`'s input errors name the caller's shapes.
"""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from dbo import DBOConfig, DBORunner, SplitArgumentWarning
from moe.models.transformer import MoETransformer, get_preset

ALWAYS = {"min_decode_tokens": 0, "min_prefill_tokens": 0}


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [T, H] times a per-row mask [T]: a call with a mask of other rows is a bug."""
    return x * mask[:, None]


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


# ------------------------------------------------------------- arguments of other rows
def test_tensor_argument_with_other_rows_is_refused_not_halved() -> None:
    x, mask = torch.randn(64, 8), torch.ones(32)
    with pytest.raises(RuntimeError):
        masked(x, mask)  # the unsplit call raises; each 32-row half would "work"
    runner = DBORunner(masked, DBOConfig(**ALWAYS))
    with pytest.raises(ValueError, match=r"positional argument 1 has shape \[32\], but the "
                       r"step has 64 rows .*positional argument 0, shape \[64, 8\].*"
                       r"DBOConfig\(unsplit_args=\(1,\)\)"):
        runner(x, mask)
    with pytest.raises(ValueError, match=r"keyword argument mask= has shape \[32\].*"
                       r"unsplit_args=\('mask',\)"):
        runner(x, mask=mask)
    # Refused on steps too small to split as well: the rule does not depend on the size.
    small = DBORunner(masked, DBOConfig(min_decode_tokens=1000))
    with pytest.raises(ValueError, match=r"has shape \[32\], but the step has 64 rows"):
        small(x, mask)


def test_argument_declared_whole_goes_to_both_ubatches() -> None:
    seen: list[tuple[int, int]] = []

    def fn(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        seen.append((x.shape[0], table.shape[0]))
        return x + table.sum(0)

    x, table = torch.randn(64, 8), torch.randn(32, 8)
    for key, call in ((1, lambda r: r(x, table)), ("table", lambda r: r(x, table=table))):
        seen.clear()
        out = call(DBORunner(fn, DBOConfig(unsplit_args=(key,), **ALWAYS)))
        assert seen == [(32, 32), (32, 32)]  # rows of x halved, the table whole
        assert torch.equal(out, fn(x, table))
    # A tensor declared whole with the step's rows is not split either, and the rows
    # come from the first tensor that is not declared whole.
    seen.clear()
    runner = DBORunner(lambda t, x: fn(x, t), DBOConfig(unsplit_args=(0,), **ALWAYS))
    runner(torch.randn(10, 8), torch.randn(64, 8))
    assert seen == [(32, 10), (32, 10)]


def test_batch_mode_refuses_a_tensor_of_other_rows() -> None:
    runner = DBORunner(lambda x, freqs: x + freqs, DBOConfig(split="batch", **ALWAYS))
    with pytest.raises(ValueError, match=r"positional argument 1 has shape \[5, 8\], but the "
                       r"step has 4 rows \(sequences"):
        runner(torch.randn(4, 5, 8), torch.randn(5, 8))
    whole = DBORunner(lambda x, freqs: x + freqs,
                      DBOConfig(split="batch", unsplit_args=(1,), **ALWAYS))
    x, freqs = torch.randn(4, 5, 8), torch.randn(5, 8)
    assert torch.equal(whole(x, freqs), x + freqs) and whole.last_decision.split


# ------------------------------------------------------------- keyword tensors of the rows
def test_undeclared_keyword_tensor_is_warned_about_once() -> None:
    def fn(x: torch.Tensor, *, pos: torch.Tensor) -> torch.Tensor:
        return x + pos[:, None]

    x, pos = torch.randn(16, 4), torch.arange(16.0)
    runner = DBORunner(fn, DBOConfig(min_decode_tokens=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner(x[:4], pos=pos[:4])  # not split: nothing was cut, nothing to say
        assert caught == []
        with pytest.warns(SplitArgumentWarning, match=r"keyword tensor pos= .*16 rows.*"
                          r"split_kwargs=\('pos',\).*unsplit_args=\('pos',\)"):
            out = runner(x, pos=pos)
        assert torch.equal(out, fn(x, pos=pos))
        caught.clear()
        runner(x, pos=pos)
        assert [w for w in caught if issubclass(w.category, SplitArgumentWarning)] == []
        # All keywords: the one that gives the rows is not warned about, the others are.
        with pytest.warns(SplitArgumentWarning) as named:
            DBORunner(fn, DBOConfig(**ALWAYS))(x=x, pos=pos)
        assert ["pos=" in str(w.message) for w in named
                if issubclass(w.category, SplitArgumentWarning)] == [True]


@pytest.mark.parametrize("declared", ["split_kwargs", "unsplit_args"])
def test_declared_keyword_tensor_is_not_warned_about(declared: str) -> None:
    x, pos = torch.randn(16, 4), torch.arange(16.0)
    runner = DBORunner(lambda x, *, pos: x + pos.sum(),
                       DBOConfig(**{declared: ("pos",)}, **ALWAYS))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitArgumentWarning)
        out = runner(x, pos=pos)
    # split: each half adds the sum of its own positions; whole: of all of them
    halves = torch.cat([x[:8] + pos[:8].sum(), x[8:] + pos[8:].sum()])
    assert torch.equal(out, halves if declared == "split_kwargs" else x + pos.sum())


# ------------------------------------------------------------- non-tensor outputs
def test_non_tensor_output_leaves_must_be_equal() -> None:
    runner = DBORunner(lambda x: {"y": x * 2, "rows": x.shape[0]}, DBOConfig(**ALWAYS))
    with pytest.raises(ValueError, match=r"output\['rows'\] differs between ubatches "
                       r"\(4 on ubatch 0, 5 on ubatch 1\)"):
        runner(torch.randn(9, 2))
    tagged = DBORunner(lambda x: (x * 2, "tag"), DBOConfig(**ALWAYS))
    out = tagged(torch.ones(9, 2))
    assert out[1] == "tag" and torch.equal(out[0], torch.full((9, 2), 2.0))


# ------------------------------------------------------------- errors in the caller's terms
def test_model_hook_names_the_callers_shapes() -> None:
    model = MoETransformer(get_preset("tiny", backend="local", experts="reference"))
    runner = DBORunner(model, DBOConfig(split="requests", **ALWAYS))
    with pytest.raises(ValueError) as info:
        runner(torch.zeros(1024), torch.arange(1024), seq_lens=[512, 512])
    assert "input_ids_T must be a 1-D integer tensor [T], got (1024,)" in str(info.value)
    assert "[dbo] ubatch" not in notes(info.value)  # raised before the split


def test_error_inside_a_ubatch_names_the_rows_it_ran() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2:
            raise ValueError(f"x has shape {tuple(x.shape)}: rows must be even")
        return x

    runner = DBORunner(fn, DBOConfig(**ALWAYS))
    with pytest.raises(ValueError, match=r"x has shape \(51, 48\)") as info:
        runner(torch.randn(101, 48))  # 50 + 51 rows: ubatch 1 fails
    assert ("[dbo] ubatch 1 ran rows [50, 101) of the step's 101 rows: shapes in this "
            "error are the ubatch's, not the step's") in notes(info.value)
    assert info.value.dbo_ubatch_rows == (50, 101)

    batch = DBORunner(fn, DBOConfig(split="batch", **ALWAYS))
    with pytest.raises(ValueError) as info:
        batch(torch.randn(6, 3, 2))  # 3 + 3 sequences: ubatch 0 fails first
    assert "[dbo] ubatch 0 ran rows [0, 3) of the step's 6 rows" in notes(info.value)

    def halves(args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        x = args[0]
        return [((x[:4],), {}), ((x[4:],), {})]
    custom = DBORunner(fn, DBOConfig(split=halves))
    with pytest.raises(ValueError) as info:
        custom(torch.randn(9, 2))
    assert "[dbo] ubatch 1 ran 5 rows of the step's 9 rows" in notes(info.value)

    unsplit = DBORunner(fn, DBOConfig(min_decode_tokens=1000))
    with pytest.raises(ValueError) as info:
        unsplit(torch.randn(101, 48))
    assert "[dbo] ubatch" not in notes(info.value)


# ------------------------------------------------------------- the declarations
@pytest.mark.parametrize("kwargs, text", [
    ({"unsplit_args": "mask"}, "DBOConfig.unsplit_args='mask' must be a tuple"),
    ({"unsplit_args": (-1,)}, "DBOConfig.unsplit_args holds -1"),
    ({"unsplit_args": (True,)}, "DBOConfig.unsplit_args holds True"),
    ({"split_kwargs": (0,)}, "DBOConfig.split_kwargs holds 0: it takes keyword names"),
    ({"split_kwargs": ("not a name",)}, "DBOConfig.split_kwargs holds 'not a name'"),
    ({"unsplit_args": ("pos",), "split_kwargs": ("pos",)},
     "names ['pos'] in both unsplit_args and split_kwargs"),
    ({"split": lambda a, k: None, "unsplit_args": (1,)}, "splits them itself: drop [1]"),
    ({"split": "requests", "split_kwargs": ("seq_lens",)}, "drop 'seq_lens'"),
])
def test_bad_declarations_are_refused(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError) as info:
        DBOConfig(**kwargs)
    assert text in str(info.value)


def test_declarations_given_as_lists_are_kept_as_tuples() -> None:
    config = DBOConfig(unsplit_args=[1, "mask"], split_kwargs=["pos"])
    assert config.unsplit_args == (1, "mask") and config.split_kwargs == ("pos",)
    assert hash(config) == hash(DBOConfig(unsplit_args=(1, "mask"), split_kwargs=("pos",)))
