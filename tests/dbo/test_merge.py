"""Layer 1 (CPU): merging per-ubatch outputs (dbo.merge)."""
from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Optional

import pytest
import torch

from dbo.merge import merge_outputs


@dataclasses.dataclass(frozen=True)
class Output:
    hidden: torch.Tensor
    extras: dict
    aux: Optional[torch.Tensor] = None
    name: str = "out"
    num_rows: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_rows", self.hidden.shape[0])


class Pair(NamedTuple):
    a: torch.Tensor
    b: list


def _halves(full: torch.Tensor, n0: int) -> tuple[torch.Tensor, torch.Tensor]:
    return full[:n0], full[n0:]


def test_tensor_cat_dim0() -> None:
    x = torch.randn(7, 3)
    assert torch.equal(merge_outputs(list(_halves(x, 3))), x)


def test_single_output_passes_through() -> None:
    out = {"x": torch.randn(2)}
    assert merge_outputs([out]) is out


def test_nested_structures() -> None:
    h, k, v = torch.randn(5, 4), torch.randn(5, 2, 3), torch.arange(5)
    def part(lo: int, hi: int) -> dict:
        return {"h": h[lo:hi], "kv": (k[lo:hi], [v[lo:hi], None]), "layer": 3,
                "meta": {"tag": "x", "mask": None}}
    merged = merge_outputs([part(0, 2), part(2, 5)])
    assert torch.equal(merged["h"], h)
    assert isinstance(merged["kv"], tuple) and isinstance(merged["kv"][1], list)
    assert torch.equal(merged["kv"][0], k) and torch.equal(merged["kv"][1][0], v)
    assert merged["kv"][1][1] is None
    assert merged["layer"] == 3 and merged["meta"] == {"tag": "x", "mask": None}
    assert list(merged) == ["h", "kv", "layer", "meta"]  # key order kept


def test_dataclass_namedtuple_and_dict_subclasses() -> None:
    h = torch.randn(6, 2)
    parts = [Output(hidden=h[:4], extras=collections.OrderedDict(p=Pair(h[:4], [1]))),
             Output(hidden=h[4:], extras=collections.OrderedDict(p=Pair(h[4:], [1])))]
    merged = merge_outputs(parts)
    assert type(merged) is Output and torch.equal(merged.hidden, h)
    assert merged.num_rows == 6  # init=False fields are recomputed by the constructor
    assert merged.aux is None and merged.name == "out"
    assert type(merged.extras) is collections.OrderedDict
    pair = merged.extras["p"]
    assert type(pair) is Pair and torch.equal(pair.a, h) and pair.b == [1]
    dd = [collections.defaultdict(list, x=torch.ones(1)), collections.defaultdict(list, x=torch.zeros(2))]
    out = merge_outputs(dd)
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert torch.equal(out["x"], torch.tensor([1.0, 0.0, 0.0]))


def test_autograd_flows_through_merge() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    merged = merge_outputs([x[:1] * 2, x[1:] * 2])
    merged.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 3), 2.0))


def test_mismatched_leaves() -> None:
    with pytest.raises(ValueError, match=r"output\['step'\] differs between ubatches \(1 on ubatch 0, 2 on ubatch 1\).*DBOConfig\(merge="):
        merge_outputs([{"step": 1}, {"step": 2}])
    with pytest.raises(ValueError, match=r"output\[1\] is None on some ubatches"):
        merge_outputs([(torch.ones(1), None), (torch.ones(1), torch.ones(1))])
    with pytest.raises(TypeError, match=r"output\.aux is a tensor on some ubatches only"):
        merge_outputs([Output(hidden=torch.ones(1), extras={}, aux=torch.ones(1)),
                       Output(hidden=torch.ones(1), extras={}, aux=3)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"output has keys \['a'\] on ubatch 0 but \['b'\] on ubatch 1"):
        merge_outputs([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(ValueError, match=r"output has lengths \[2, 1\]"):
        merge_outputs([[torch.ones(1), torch.ones(1)], [torch.ones(1)]])
    with pytest.raises(TypeError, match="different types"):
        merge_outputs([(torch.ones(1),), [torch.ones(1)]])
    with pytest.raises(ValueError, match=r"cannot concatenate output\['h'\] along dim 0.*\[1, 3\].*\[1, 4\]"):
        merge_outputs([{"h": torch.ones(1, 3)}, {"h": torch.ones(1, 4)}])


def test_zero_dim_tensor_needs_custom_merge() -> None:
    with pytest.raises(TypeError, match=r"output\.loss is a 0-dim tensor.*DBOConfig\(merge=fn\)"):
        @dataclasses.dataclass
        class WithLoss:
            loss: torch.Tensor
        merge_outputs([WithLoss(torch.tensor(1.0)), WithLoss(torch.tensor(2.0))])


def test_rows_check_catches_non_row_major_tensors() -> None:
    ok = merge_outputs([torch.ones(2, 5), torch.ones(3, 5)], rows=(2, 3))
    assert ok.shape == (5, 5)
    # A per-step statistic (e.g. tokens per expert, [E]) is not row-major: refuse it.
    with pytest.raises(ValueError, match=r"output\[1\] has shape \[8\] on ubatch 0, which holds 2 rows"):
        merge_outputs([(torch.ones(2, 5), torch.ones(8)), (torch.ones(3, 5), torch.ones(8))],
                      rows=(2, 3))
    with pytest.raises(ValueError, match="gives 1 row counts for 2"):
        merge_outputs([torch.ones(1), torch.ones(1)], rows=(1,))


def test_bad_outputs_argument() -> None:
    with pytest.raises(TypeError, match="non-empty list"):
        merge_outputs([])
    with pytest.raises(TypeError, match="non-empty list"):
        merge_outputs(torch.ones(2))  # type: ignore[arg-type]
