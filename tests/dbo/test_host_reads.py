"""Layer 1 (CPU): `dbo.host_reads` records each kind of host read of device data, with its
stack, and inside a DBO step the ubatch, segment and whether the other ubatch had started."""
from __future__ import annotations

import torch

from dbo import UBatchScheduler, dbo_yield
from dbo.host_reads import format_host_reads, record_host_reads


def _ops(fn) -> list[str]:
    with record_host_reads() as reads:
        fn()
    return [r.op for r in reads]


def test_each_kind_of_host_read_is_recorded_and_free_ops_are_not():
    x = torch.arange(6.0)
    counts = torch.tensor([1, 2])
    mask = x > 2
    reads = {
        "item": lambda: x[0].item(),
        "bool": lambda: bool(x[1] > 0),
        "all in an if": lambda: 1 if (x >= 0).all() else 0,
        "nonzero": lambda: torch.nonzero(x),
        "boolean index": lambda: x[mask],
        "boolean index_put": lambda: x.clone().index_put_((mask,), torch.zeros(3)),
        "equal": lambda: torch.equal(x, x),
        "unique": lambda: torch.unique(x),
        "masked_select": lambda: torch.masked_select(x, mask),
        "repeat_interleave": lambda: torch.repeat_interleave(counts),
        "tolist": lambda: x.tolist(),
        "cpu": lambda: x.cpu(),
        "tensor from a list": lambda: torch.tensor([1.0, 2.0]),
    }
    for name, fn in reads.items():
        assert len(_ops(fn)) == 1, name
    free = {
        "arithmetic": lambda: (x * 2 + 1).sum(),
        "long index": lambda: x[counts],
        "masked_fill": lambda: x.masked_fill(mask, 0.0),
        "repeat_interleave with output_size": lambda: torch.repeat_interleave(
            x[:2], counts, output_size=3),
        "a Python scalar": lambda: x.clone().__setitem__(slice(0, 2), -1.0),
        "to its own device": lambda: x.to(x.device),
        "assert_async": lambda: torch._assert_async(x[1] > 0),
    }
    for name, fn in free.items():
        assert _ops(fn) == [], name


def _reader():
    return torch.arange(4.0)[2].item()


def test_a_read_names_its_frames_innermost_first_outside_a_step():
    with record_host_reads() as reads:
        _reader()
    (read,) = reads
    assert read.op == "aten._local_scalar_dense.default" and read.kind == "sync"
    assert read.ubatch_id is None and read.owner == "tests"
    assert read.where.startswith("tests.dbo.test_host_reads:") and read.where.endswith("_reader")
    assert "outside a step" in format_host_reads(reads)


def test_reads_in_both_ubatches_carry_ubatch_segment_and_other_started():
    x = torch.arange(4.0)

    def ubatch():
        x.sum().item()
        dbo_yield()
        x.tolist()

    with record_host_reads() as reads:
        UBatchScheduler("cpu").run([ubatch, ubatch])
    assert [(r.ubatch_id, r.segment, r.other_started) for r in reads] == [
        (0, 0, False), (1, 0, True), (0, 1, True), (1, 1, True)]
    assert [r.op for r in reads] == ["aten._local_scalar_dense.default"] * 2 + ["Tensor.tolist"] * 2
