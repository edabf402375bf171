"""Layer 3 (CPU, two gloo processes): every MoE model family of the installed transformers,
found at run time (`moe.hf.coverage.discover`), built tiny and random, converted by
`moe.hf.convert` and checked against the unconverted model -- the measured coverage that
docs/hf_models.md reports.

Per family, in this process (backend "local"): the converted model's logits (its hidden
states where transformers has no causal LM for the text model) equal the unconverted
model's with DBO off and with DBO on (split="batch", the step split), 8 greedy tokens
of `moe.hf.generate` equal the unconverted model's `generate` -- once with every step
split (each ubatch its own cache), once with the decode steps unsplit (the two caches
joined and parted again: `moe.hf.kv`) -- and the converted model's `save_pretrained`,
read back by transformers' `from_pretrained` and by `moe.hf.load` (or refused by it in
one line: the record's `load`), gives the unconverted model's outputs again. On two gloo ranks, spawned once for all
families, the experts sharded (backend "a2a"): each rank's logits on its own batch with
DBO off and on (the split step handing over between the ubatches inside the MoE blocks'
dispatch and combine), and one MoE block called with tokens on rank 0 and none on rank 1.

A family is "ok" when every check passes, "refused" when `moe.hf.convert` refuses it
(naming the block and what dbo lacks), "not built" when no tiny model of it builds here,
"failed" when a check differs (a dbo bug: the test fails). The result goes to
docs/hf_models.json; the committed docs/hf_models.md must be its rendering
(`python -m moe.hf.coverage --markdown` writes it). Under another transformers version
than the recorded one, the checks run the same and the record is left alone (delete
docs/hf_models.json to record a new version).

Tolerance: 1e-5 of the logits' scale (`tests.hf_utils.assert_logits_close`): float32 on
the CPU, the experts' GEMMs over other row groupings and sums in another order.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from dbo.scheduler import UBatchScheduler  # noqa: E402
from moe.hf import coverage  # noqa: E402
from moe.hf.coverage import Result  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import assert_logits_close, batch  # noqa: E402

NEW_TOKENS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every step split (the prompt and each decode step: each ubatch decodes with its own cache).
SPLIT = dbo.DBOConfig(split="batch", split_kwargs=("attention_mask",), min_prefill_tokens=1,
                      min_decode_tokens=1)
# The prompt split, the decode steps not: every decode step joins the two caches.
JOINED = dbo.DBOConfig(min_prefill_tokens=1, min_decode_tokens=1 << 20)
# Rank r's batch [B, S] (B >= 2: the step splits on both ranks).
RANK_SHAPES = ((3, 6), (2, 5))


class Outputs(nn.Module):
    """The model's logits (or, without an LM head, its last hidden states) as one tensor,
    so that the runner merges the ubatches' outputs whatever else the model returns (a
    cache, for some models even with use_cache=False)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = getattr(out, "logits", None)
        return out.last_hidden_state if logits is None else logits


def _outputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
             config: Optional[dbo.DBOConfig] = None, group: Any = None) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config is None:
            return Outputs(model)(ids, mask)
        runner = dbo.DBORunner(Outputs(model), config, group=group)
        out = runner(ids, attention_mask=mask)
        assert runner.last_decision.split, runner.last_decision.reason
        return out


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _vocab(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    return min(64, getattr(config, "vocab_size", 64) or 64)


def _check_local(family: coverage.MoEFamily, folder: str) -> Result:
    """The family's checks in this process (the module doc); `folder` for its checkpoint."""
    def result(status: str, reason: str = "", conversion: str = "",
               load: Optional[str] = None) -> Result:
        return Result(family=family.family, model_type=family.model_type, status=status,
                      reason=reason, conversion=conversion, load=load)

    if family.model_type is None:
        return result("not built", "its package defines no model type")
    try:
        model = coverage.tiny_model(family.model_type)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises is the reason
        return result("not built", f"no tiny model: {_line(exc)}")
    ids, mask = batch(3, 6, seed=1, vocab=_vocab(model))
    forward_error = ""
    try:
        expected = _outputs(model, ids, mask)
    except Exception as exc:  # noqa: BLE001 - e.g. a vision backbone: no input_ids
        expected, forward_error = None, _line(exc)
    reference = None
    notes = []
    if expected is not None and model.can_generate():
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reference = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                           do_sample=False)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"generate not checked: transformers' own generate fails "
                         f"({_line(exc)})")
    elif expected is not None:
        notes.append("generate not checked: transformers has no causal LM for the text "
                     "model (hidden states compared)")
    try:
        moe.hf.convert(model)
    except ValueError as exc:
        return result("refused", str(exc))
    conversion = model.dbo_conversion_summary
    if expected is None:
        return result("not built", f"the tiny model's forward fails: {forward_error}",
                      conversion)
    try:
        assert_logits_close(_outputs(model, ids, mask), expected)
        assert_logits_close(_outputs(model, ids, mask, SPLIT), expected)
        if reference is not None:
            tokens = moe.hf.generate(dbo.DBORunner(model, SPLIT), ids, attention_mask=mask,
                                     max_new_tokens=NEW_TOKENS)
            assert torch.equal(tokens, reference), (tokens, reference)
            try:
                tokens = moe.hf.generate(dbo.DBORunner(model, JOINED), ids,
                                         attention_mask=mask, max_new_tokens=NEW_TOKENS)
            except ValueError as exc:  # a cache dbo cannot join: named, not wrong
                why = str(exc).split(": ", 1)[-1].split(" (it handles")[0]
                notes.append(f"generate refuses decode steps that do not split: {why}")
            else:
                assert torch.equal(tokens, reference), (tokens, reference)
    except Exception as exc:  # noqa: BLE001 - a difference or a crash: a dbo bug
        return result("failed", f"one process: {_line(exc)}", conversion)
    try:
        load = _check_checkpoint(model, ids, mask, expected, folder)
    except Exception as exc:  # noqa: BLE001 - a difference or a crash: a dbo bug
        return result("failed", f"save_pretrained and load: {_line(exc)}", conversion)
    return result("ok", "; ".join(notes), conversion, load)


def _check_checkpoint(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                      expected: torch.Tensor, folder: str) -> str:
    """The converted model's `save_pretrained` into `folder`, read back by transformers
    (the model's class's `from_pretrained`) and by `moe.hf.load`, each with the
    unconverted model's outputs; "ok", or `moe.hf.load`'s refusal (one line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
        back = type(model).from_pretrained(folder).eval()
        assert_logits_close(_outputs(back, ids, mask), expected)
        try:
            loaded = moe.hf.load(folder)
        except ValueError as exc:
            assert "\n" not in str(exc), str(exc)
            return str(exc)
    assert_logits_close(_outputs(loaded, ids, mask), expected)
    return "ok"


def _quiet() -> None:
    """transformers' notes on the tiny configs (kernels it falls back from, rope factors)."""
    from transformers.utils import logging
    logging.set_verbosity_error()


def _ep_ranks(rank: int, world: int, model_types: list[str]) -> dict[str, Optional[str]]:
    """Per model type: None when this rank's checks pass, else what differs."""
    _quiet()
    group = dist.group.WORLD
    found: dict[str, Optional[str]] = {}
    for model_type in model_types:
        model = coverage.tiny_model(model_type)
        ids, mask = batch(*RANK_SHAPES[rank], seed=10 + rank, vocab=_vocab(model))
        expected = _outputs(model, ids, mask)
        probe = ZeroTokenProbe(model, rank)
        moe.hf.convert(model, group=group)
        # Every collective first, on every rank alike; the comparisons after them, so that
        # a difference on one rank leaves the ranks' collectives in step.
        outputs = [_outputs(model, ids, mask)]
        with _count_handoffs(model) as (handoffs, calls):
            outputs.append(_outputs(model, ids, mask, SPLIT, group))
        probe_out = probe.run(model, group)
        try:
            for out in outputs:
                assert_logits_close(out, expected)
            # The split step hands over between the ubatches in each half (dispatch,
            # combine) of every converted block each ubatch calls, and nowhere else.
            assert calls[0] > 0 and handoffs[0] == 2 * calls[0], (handoffs[0], calls[0])
            probe.check(probe_out)
            found[model_type] = None
        except Exception as exc:  # noqa: BLE001 - recorded; the peer rank records its own
            found[model_type] = f"rank {rank}: {_line(exc)}"
    return found


@contextlib.contextmanager
def _count_handoffs(model: nn.Module) -> Iterator[tuple[list[int], list[int]]]:
    """([hand-offs], [calls]) within: the hand-offs between ubatches
    (`UBatchScheduler.yield_` with the other ubatch still running) and the calls of the
    model's converted blocks (a block a model calls only for some inputs, e.g.
    Ernie-4.5-VL's vision experts, is not called for text)."""
    handoffs, calls = [0], [0]
    original = UBatchScheduler.yield_

    def counting(self: UBatchScheduler) -> None:
        if self.running.yield_to is not None:
            handoffs[0] += 1
        original(self)

    def called(module: nn.Module, args: tuple) -> None:
        calls[0] += 1

    hooks = [m.register_forward_pre_hook(called) for m in model.modules()
             if isinstance(m, (moe.hf.HFExperts, moe.hf.HFMoEBlock))]
    UBatchScheduler.yield_ = counting
    try:
        yield handoffs, calls
    finally:
        UBatchScheduler.yield_ = original
        for hook in hooks:
            hook.remove()


class ZeroTokenProbe:
    """The first MoE block called with 5 tokens on rank 0 and none on rank 1 (the same
    input on every rank, its unconverted output taken before the conversion). Where the
    block does not run alone (a decoder layer holding the experts, a block that needs
    the input ids), its experts module is called instead, with a routing drawn here."""

    def __init__(self, model: nn.Module, rank: int) -> None:
        from moe.hf.convert import find_moe_blocks
        self.rank = rank
        self.path, block = find_moe_blocks(model)[0]
        self.old_experts = block.experts  # kept: the conversion replaces it
        hidden = model.config.get_text_config().hidden_size
        self.x = torch.randn(1, 5, hidden, generator=torch.Generator().manual_seed(3))
        try:
            with torch.no_grad():
                self.ref = _first(block(self.x))
                if rank == 1:
                    _first(block(self.x[:, :0]))
            self.block_ok = True
        except Exception:  # noqa: BLE001 - the block does not run alone here
            self.block_ok = False

    def run(self, model: nn.Module, group: Any) -> torch.Tensor:
        """The converted block's (or experts') output on this rank's tokens (collectives:
        call on every rank)."""
        agreed = torch.tensor([int(self.block_ok)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        self.block_ok = bool(agreed.item())
        block = model.get_submodule(self.path)
        rows = slice(None) if self.rank == 0 else slice(0, 0)
        with torch.no_grad():
            if self.block_ok:
                return _first(block(self.x[:, rows]))
            experts = block.experts
            x_TH = self.x[0]
            gen = torch.Generator().manual_seed(4)
            top_k, num_experts = experts.config.top_k, experts.config.num_experts
            ids_TK = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                                  for _ in range(x_TH.shape[0])])
            weights_TK = torch.rand(ids_TK.shape, generator=gen)
            self.ref = self.old_experts(x_TH, ids_TK, weights_TK)
            return experts(x_TH[rows], ids_TK[rows], weights_TK[rows])

    def check(self, out: torch.Tensor) -> None:
        if self.rank == 0:
            assert_logits_close(out, self.ref)
        else:
            assert out.numel() == 0, out.shape


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def test_every_moe_family_of_transformers_converts_and_matches(tmp_path):
    _quiet()
    families = coverage.discover()
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"} <= {f.family for f in families}
    local = [_check_local(f, os.fspath(tmp_path / f.family)) for f in families]
    passing = [r.model_type for r in local if r.status == "ok"]
    ranks = run_distributed(2, _ep_ranks, passing)
    results = []
    for result in local:
        problems = [found[result.model_type] for found in ranks
                    if result.status == "ok" and found.get(result.model_type)]
        if problems:
            result = Result(family=result.family, model_type=result.model_type,
                            status="failed", reason=f"two ranks: {problems[0]}",
                            conversion=result.conversion, load=result.load)
        results.append(result)
    failed = [f"{r.family}: {r.reason}" for r in results if r.status == "failed"]
    assert not failed, "\n".join(failed)
    fused = {r.family for r in results if r.status == "ok" and " fused (" in r.conversion}
    assert fused == {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}, fused
    # The committed record documents one transformers version; another one (5.17 on the
    # GPU machines) is checked the same way, its record written beside the test's files.
    record = os.path.join(ROOT, coverage.JSON_PATH)
    installed = __import__("transformers").__version__
    if os.path.exists(record) and coverage.load(record)[0] != installed:
        coverage.save(results, os.fspath(tmp_path / "hf_models.json"))
        return
    coverage.save(results, record)
    version, recorded = coverage.load(record)
    with open(os.path.join(ROOT, coverage.MARKDOWN_PATH), encoding="utf-8") as f:
        page = f.read()
    assert page == coverage.markdown(version, recorded), (
        "docs/hf_models.md is not the rendering of this run's result: run "
        "python -m moe.hf.coverage --markdown and commit both files")
