"""Layer 1 (CPU) and Layer 2 (two gloo processes): `save_pretrained` of a converted model
(`moe.hf.save`) writes the checkpoint the unconverted model writes -- the same tensor
names and values -- on the fused path and the experts path, so that transformers'
`from_pretrained` and `moe.hf.load` both read it back to the unconverted model's logits.
Under expert parallelism every rank calls it, rank 0 gathers every rank's experts and
writes, the other ranks write nothing; `moe.hf.load` under EP reads each rank's experts
only. What it cannot write is refused in one line, with no file written.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import moe.hf  # noqa: E402
from moe.hf import coverage, expert_bytes  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import assert_logits_close, batch, logits, save, tiny_model  # noqa: E402

# (model, conversion): the fused path, the experts path on a fused architecture, and
# experts-path families stored per expert under other names, transposed with biases,
# and ungated.
CASES = [("qwen2_moe", "auto"), ("deepseek_v3", "auto"), ("mixtral", "experts"),
         ("phimoe", "auto"), ("gpt_oss", "auto"), ("nemotron_h", "auto")]


def _model(name: str) -> nn.Module:
    return tiny_model(name) if name in ("qwen2_moe", "deepseek_v3", "mixtral") \
        else coverage.tiny_model(name)


def _tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (all its shards)."""
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, file)))
    return out


def _assert_same_files(path, reference) -> None:
    """The two folders hold the same tensors, bit for bit: converting and saving back only
    copies, gathers and transposes the experts, it computes nothing."""
    saved, want = _tensors(path), _tensors(reference)
    assert sorted(saved) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("name, conversion", CASES)
def test_save_pretrained_writes_the_unconverted_checkpoint(name, conversion, tmp_path):
    from transformers import AutoModelForCausalLM
    reference = save(_model(name), tmp_path / "reference")
    model = AutoModelForCausalLM.from_pretrained(reference).eval()  # as people load it
    ids, mask = batch(3, 6, seed=1)
    expected = logits(model, ids, mask)
    moe.hf.convert(model, conversion=conversion)
    model.save_pretrained(tmp_path / "converted")
    _assert_same_files(tmp_path / "converted", reference)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert_logits_close(logits(back, ids, mask), expected)
    assert_logits_close(logits(moe.hf.load(tmp_path / "converted"), ids, mask), expected)


def test_a_loaded_model_saves_and_zero_compute_rows_are_zeros(tmp_path):
    """A model from `moe.hf.load` saves as one from `convert` does. LongCat-Flash's
    gate_up_proj holds E + Z experts, Z zero-compute ones whose rows the model never
    reads and the converted block does not keep: they are written as zeros, and the
    logits do not change."""
    from transformers import AutoModelForCausalLM
    model = coverage.tiny_model("longcat_flash")
    reference = save(model, tmp_path / "reference")
    ids, mask = batch(3, 6, seed=2)
    expected = logits(model, ids, mask)
    moe.hf.load(reference).save_pretrained(tmp_path / "saved")
    saved, want = _tensors(tmp_path / "saved"), _tensors(reference)
    assert sorted(saved) == sorted(want)
    routed = model.config.n_routed_experts
    zero = re.compile(r"\.experts\.(\d+)\.(gate|up)_proj\.weight$")
    rows = [n for n in want if (m := zero.search(n)) and int(m.group(1)) >= routed]
    assert rows, "the tiny LongCat-Flash has zero-compute experts"
    for name in want:
        expect = torch.zeros_like(want[name]) if name in rows else want[name]
        assert torch.equal(saved[name], expect), name
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert_logits_close(logits(back, ids, mask), expected)


def test_shards_and_the_transformers_format_switch_pass_through(tmp_path):
    """transformers' own options apply: shards with their index, and
    `save_original_format=False` (its in-memory names, which both loaders read)."""
    model = tiny_model("qwen3_moe")
    ids, mask = batch(2, 5, seed=3)
    expected = logits(model, ids, mask)
    moe.hf.convert(model)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _tensors(tmp_path / "fused")
    for folder in ("sharded", "fused"):
        assert_logits_close(logits(moe.hf.load(tmp_path / folder), ids, mask), expected)


def test_what_cannot_be_saved_is_refused_in_one_line(tmp_path):
    model = moe.hf.convert(tiny_model("qwen3_moe"))
    with pytest.raises(ValueError) as exc:
        model.save_pretrained(tmp_path / "a", state_dict=model.state_dict())
    message = str(exc.value)
    assert "\n" not in message and "save_pretrained(state_dict=) of a converted model" in message
    # An experts module with a tensor the experts path does not carry over: saving would
    # drop it, so nothing is written.
    model = coverage.tiny_model("olmoe")
    model.model.layers[1].mlp.experts.scale = nn.Parameter(torch.ones(4))
    moe.hf.convert(model)
    with pytest.raises(ValueError) as exc:
        model.save_pretrained(tmp_path / "b")
    message = str(exc.value)
    assert "\n" not in message and message.startswith(
        "moe.hf: cannot save 'model.layers.1.mlp.experts.scale' [4] of the unconverted model: "
        "the converted block lacks it; save the model before converting it"), message
    assert not os.path.exists(tmp_path / "b")


# ------------------------------------------------------------------ two ranks
def _record_reads(log: list[tuple[str, object]]) -> None:
    """Log every tensor a `Checkpoint` reads in this process: (name, rows or None)."""
    from moe.hf.checkpoint import Checkpoint
    read, read_rows = Checkpoint.read, Checkpoint.read_rows

    def whole(self, name, **kwargs):
        log.append((name, None))
        return read(self, name, **kwargs)

    def rows(self, name, first, stop):
        log.append((name, (first, stop)))
        return read_rows(self, name, first, stop)

    Checkpoint.read, Checkpoint.read_rows = whole, rows


def _ep_ranks(rank: int, world: int, root: str) -> dict:
    """Every rank converts and saves into its own folder (rank 0's is written, the other's
    must stay absent), then loads the reference checkpoint under EP, logging what it
    reads."""
    group = dist.group.WORLD
    result: dict = {}
    log: list[tuple[str, object]] = []
    _record_reads(log)
    for name in ("qwen3_moe", "gpt_oss"):
        model = _model(name)
        ids, mask = batch(2 + rank, 5, seed=20 + rank)
        expected = logits(model, ids, mask)
        moe.hf.convert(model, group=group)
        model.save_pretrained(os.path.join(root, f"{name}-rank{rank}"))
        del log[:]
        loaded = moe.hf.load(os.path.join(root, f"{name}-reference"), group=group)
        assert_logits_close(logits(loaded, ids, mask), expected)
        result[name] = dict(reads=list(log), bytes=expert_bytes(loaded),
                            experts=loaded.config.num_experts
                            if name == "qwen3_moe" else loaded.config.num_local_experts)
    return result


def test_expert_parallel_save_gathers_on_rank_0_and_load_reads_each_ranks_experts(tmp_path):
    from transformers import AutoModelForCausalLM
    full = {}
    for name in ("qwen3_moe", "gpt_oss"):
        save(_model(name), tmp_path / f"{name}-reference")
        full[name] = expert_bytes(moe.hf.convert(_model(name)))
    results = run_distributed(2, _ep_ranks, os.fspath(tmp_path))
    ids, mask = batch(3, 6, seed=30)
    for name in ("qwen3_moe", "gpt_oss"):
        assert not os.path.exists(tmp_path / f"{name}-rank1")  # rank 1 writes nothing
        _assert_same_files(tmp_path / f"{name}-rank0", tmp_path / f"{name}-reference")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-rank0").eval()
        assert_logits_close(logits(back, ids, mask), logits(_model(name), ids, mask))
        for rank, result in enumerate(results):
            got = result[name]
            assert got["bytes"] * 2 == full[name], (name, rank)
            half = got["experts"] // 2
            mine = range(rank * half, (rank + 1) * half)
            expert_reads = [(n, rows) for n, rows in got["reads"] if ".experts." in n]
            assert expert_reads, name
            for tensor, rows in expert_reads:
                index = re.search(r"\.experts\.(\d+)\.", tensor)
                if index is not None:  # per-expert tensors: this rank's experts only
                    assert rows is None and int(index.group(1)) in mine, (rank, tensor)
                else:  # tensors over all experts: this rank's rows only
                    assert rows == (mine.start, mine.stop), (rank, tensor, rows)
