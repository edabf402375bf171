"""Layer 1 (CPU) and Layer 2 (two gloo processes): experts modules that hold the experts
interface's tensors in another layout (`moe.hf.stored_experts`): DBRX's `DbrxExperts`,
``mlp.w1`` (gate) / ``mlp.v1`` (up) / ``mlp.w2`` (down transposed), each [E * I, H] with
the experts stacked along its rows, act(x w1_e^T) * (x v1_e^T) w2_e, act the module's
``mlp.activation_fn`` (config.ffn_config.ffn_act_fn).

Checked: the layout's mapping onto dbo's w13 [E, 2I, H] / w2 [E, H, I] (each expert's
rows, DBRX's own per-expert computation, and back to the stored tensors) and its planning
stand-ins (no copy); the tiny DBRX converts on the experts path, its logits equal the
unconverted model's with DBO off and on, its activation is the module's (gelu converts as
gelu, and changes the logits), and an activation dbo has no name for is refused in one
line with the model unchanged; `save_pretrained` writes the unconverted model's
checkpoint tensor for tensor and `moe.hf.load` reads it back; on two gloo ranks each rank
holds its half of the experts, the logits match with DBO off and on, rank 0 alone writes
the whole checkpoint, and `moe.hf.load` reads only rows [first * I, stop * I) of each
stored tensor.

Tolerance: 1e-5 of the logits' scale (`tests.hf_utils.assert_logits_close`): float32 on
the CPU, the experts' GEMMs over other row groupings and sums in another order; one
expert's output to 1e-5 relative (the same products, another GEMM shape). Tensors that
only move (the layout's mapping, the saved checkpoint) are compared exactly.
"""
from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import moe.hf  # noqa: E402
from moe.hf import coverage  # noqa: E402
from moe.hf.generic import HFExperts  # noqa: E402
from moe.hf.save import hf_state_dict  # noqa: E402
from moe.hf.stored_experts import STORED  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import (assert_logits_close, assert_saves_unconverted, batch, dbo_logits,
                             logits, save)  # noqa: E402

LAYOUT = STORED["DbrxExperts"]


def _dbrx(activation: str = "silu", *, seed: int = 0) -> nn.Module:
    """The coverage test's tiny DBRX (4 experts, top-2, I = 32), its experts' activation
    `activation` (a name of transformers' ACT2FN)."""
    config = coverage.tiny_config("dbrx")
    config.ffn_config.ffn_act_fn = {"name": activation}
    torch.manual_seed(seed)
    return coverage.model_class(config)._from_config(config).eval()


def _tensors(path: Any) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def _assert_same_files(path: Any, reference: Any) -> None:
    saved, want = _tensors(path), _tensors(reference)
    assert sorted(saved) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(saved[name], tensor), name


def test_the_layout_maps_each_expert_onto_w13_and_w2_and_back():
    experts = _dbrx().transformer.blocks[0].ffn.experts
    mlp = experts.mlp
    e, width, hidden = experts.num_experts, experts.ffn_hidden_size, experts.hidden_size
    stored = {name: experts.get_parameter(name).detach() for name in LAYOUT.names}
    w13, w2 = LAYOUT.to_interface(stored, width=width)
    assert w13.shape == (e, 2 * width, hidden) and w2.shape == (e, hidden, width)
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(1))
    for k in range(e):
        rows = slice(k * width, (k + 1) * width)
        assert torch.equal(w13[k, :width], mlp.w1[rows]) and torch.equal(w13[k, width:],
                                                                          mlp.v1[rows])
        assert torch.equal(w2[k], mlp.w2[rows].T)
        with torch.no_grad():  # DBRX's own expert against dbo's reading of it
            want = mlp(x, mlp.w1[rows], mlp.v1[rows], mlp.w2[rows])
        got = (nn.functional.silu(x @ w13[k, :width].T) * (x @ w13[k, width:].T)) @ w2[k].T
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # Experts [1, 3) of the stored rows give experts 1 and 2 of w13 / w2.
    part = LAYOUT.to_interface({n: t[width:3 * width] for n, t in stored.items()}, width=width)
    assert torch.equal(part[0], w13[1:3]) and torch.equal(part[1], w2[1:3])
    gate, up = LAYOUT.gate_up_to_stored(w13)
    for back, name in ((gate, "mlp.w1"), (up, "mlp.v1"), (LAYOUT.down_to_stored(w2), "mlp.w2")):
        assert back.is_contiguous() and torch.equal(back, stored[name]), name


def test_planning_reads_sizes_without_copying_and_refuses_bad_shapes():
    experts = _dbrx().transformer.blocks[0].ffn.experts

    def refuse(what: str) -> ValueError:
        return ValueError(what)

    up, down = LAYOUT.interface_stand_ins(experts, refuse=refuse)
    assert up.shape == (4, 64, 64) and down.shape == (4, 64, 32)
    assert up.stride() == (0, 0, 0) and down.stride() == (0, 0, 0)  # one element, expanded
    experts.num_experts = 3  # 128 rows are not 3 experts of one width
    with pytest.raises(ValueError, match=r"expected three \[E \* I, H\] tensors"):
        LAYOUT.interface_stand_ins(experts, refuse=refuse)


def test_dbrx_converts_on_the_experts_path_and_saves_its_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM
    model = _dbrx()
    reference = save(model, tmp_path / "reference")
    ids, mask = batch(3, 6, seed=1)
    expected = logits(model, ids, mask)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moe.hf.convert(model)
    assert model.dbo_conversion_summary == (
        "moe.hf.convert: dbrx: 2 MoE blocks, 2 on the experts path (DbrxExperts: silu(gate) "
        "* up, stored as mlp.w1, mlp.v1, mlp.w2 [E * I, H])")
    assert isinstance(model.transformer.blocks[1].ffn.experts, HFExperts)
    assert not any(".mlp." in name for name in model.state_dict())  # only dbo's copy
    assert_logits_close(logits(model, ids, mask), expected)
    assert_logits_close(dbo_logits(model, ids, mask), expected)
    assert_saves_unconverted(hf_state_dict(model), state)
    model.save_pretrained(tmp_path / "converted")
    _assert_same_files(tmp_path / "converted", reference)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert_logits_close(logits(back, ids, mask), expected)
    assert_logits_close(logits(moe.hf.load(tmp_path / "converted"), ids, mask), expected)


def test_the_activation_is_the_modules_own():
    model = _dbrx("gelu")
    ids, mask = batch(2, 5, seed=2)
    expected = logits(model, ids, mask)
    # silu with the same weights gives other logits: the match below needs gelu.
    silu = logits(_dbrx("silu"), ids, mask)
    assert (silu - expected).abs().max() > 1e-3 * expected.abs().max()
    moe.hf.convert(model)
    assert model.transformer.blocks[0].ffn.experts.form.activation == "gelu"
    assert_logits_close(logits(model, ids, mask), expected)


def test_an_activation_dbo_has_no_name_for_is_refused_unchanged():
    model = _dbrx("quick_gelu")  # x * sigmoid(1.702 x): none of dbo's activations
    before = dict(model.named_modules())
    with pytest.raises(ValueError) as info:
        moe.hf.convert(model)
    text = str(info.value)
    assert "\n" not in text
    assert text == ("moe.hf.convert: block 'transformer.blocks.0.ffn' (DbrxFFN, experts "
                    "DbrxExperts): its activation experts.mlp.activation_fn is none of dbo's "
                    "named activations, which experts stored as mlp.w1, mlp.v1, mlp.w2 "
                    "[E * I, H] need"), text
    assert dict(model.named_modules()) == before


# ------------------------------------------------------------------ two ranks
def _ep_ranks(rank: int, world: int, root: str) -> list[tuple[str, Any]]:
    """Convert, run with DBO off and on, save into a folder of this rank's (rank 0's is
    written, rank 1's must stay absent), then load the reference checkpoint under EP,
    logging what it reads: (name, rows or None for a whole tensor)."""
    from moe.hf.checkpoint import Checkpoint
    group = dist.group.WORLD
    model = _dbrx(seed=5)
    ids, mask = batch(*((3, 6), (2, 5))[rank], seed=10 + rank)
    expected = logits(model, ids, mask)
    mlp = model.transformer.blocks[1].ffn.experts.mlp
    own = slice(rank * 64, (rank + 1) * 64)  # experts 2r, 2r + 1: rows [64 r, 64 (r + 1))
    w1, v1, w2 = (t[own].detach().clone().view(2, 32, 64) for t in (mlp.w1, mlp.v1, mlp.w2))
    moe.hf.convert(model, group=group)
    experts = model.transformer.blocks[1].ffn.experts
    assert experts.num_local_experts == 2 and experts.first_expert == 2 * rank
    assert torch.equal(experts.w13, torch.cat([w1, v1], dim=1))
    assert torch.equal(experts.w2, w2.transpose(1, 2))
    outputs = [logits(model, ids, mask), dbo_logits(model, ids, mask, group=group)]
    model.save_pretrained(os.path.join(root, f"rank{rank}"))
    log: list[tuple[str, Any]] = []
    read, read_rows = Checkpoint.read, Checkpoint.read_rows
    Checkpoint.read = lambda self, name, **kw: log.append((name, None)) or read(self, name, **kw)
    Checkpoint.read_rows = lambda self, name, first, stop: (
        log.append((name, (first, stop))) or read_rows(self, name, first, stop))
    loaded = moe.hf.load(os.path.join(root, "reference"), group=group)
    outputs.append(logits(loaded, ids, mask))
    for out in outputs:
        assert_logits_close(out, expected)
    return log


def test_two_ranks_hold_save_and_load_their_own_experts(tmp_path):
    save(_dbrx(seed=5), tmp_path / "reference")
    reads = run_distributed(2, _ep_ranks, os.fspath(tmp_path))
    assert not os.path.exists(tmp_path / "rank1")  # rank 1 writes nothing
    _assert_same_files(tmp_path / "rank0", tmp_path / "reference")
    for rank, log in enumerate(reads):
        stored = [(name, rows) for name, rows in log if re.search(r"\.mlp\.(w1|v1|w2)$", name)]
        assert len(stored) == 6, (rank, stored)  # 2 blocks x 3 tensors, read once each
        assert all(rows == (64 * rank, 64 * (rank + 1)) for _, rows in stored), (rank, stored)
