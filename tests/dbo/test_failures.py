"""Layers 1-2: failure containment, collective timeouts and cross-rank agreement.

- An exception in any phase of either ubatch surfaces from the runner as the original
  type with rank, ubatch, layer and phase in its notes; nothing hangs; after a failure
  that came before any collective, the next step works.
- A failure after this rank issued collectives says the process group must be
  re-created; a peer left waiting fails within the group's timeout, naming where it was.
- Injected disagreement (split wishes, token counts, capacity): every rank takes the
  same path, and every rank issues the identical sequence of collectives.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dbo
from dbo import DBOConfig, DBORunner, dbo_current_ubatch_id
from dbo.failures import record_collectives
from moe import MoEConfig, MoELayer, init_moe_weights
from moe.backends.base import Pending
from moe.models.transformer import MoETransformer, get_preset, make_batch
from tests.dist_utils import run_distributed

DBO = DBOConfig(split="requests", min_prefill_tokens=2, min_decode_tokens=2, max_imbalance=1.0)


class Injected(KeyError):
    """A distinctive exception type, to check the original type comes back."""


def tiny_model() -> MoETransformer:
    model = MoETransformer(get_preset("tiny", backend="local", experts="reference"))
    model.init_weights(0)
    return model


def fail_in(ubatch: int, what):
    def wrapped(*args, **kwargs):
        if dbo_current_ubatch_id() == ubatch:
            raise Injected("boom")
        return what(*args, **kwargs)
    return wrapped


def inject(model: MoETransformer, phase: str, layer: int, ubatch: int) -> None:
    """Make `phase` of `layer` raise in `ubatch` only (instance-level patches)."""
    block = model.layers[layer]
    moe_layer = block.ffn
    assert isinstance(moe_layer, MoELayer), "pick a MoE layer"
    kernel = moe_layer._kernel(torch.device("cpu"))
    backend = kernel.backend
    if phase == "attention":
        block.attn.forward = fail_in(ubatch, block.attn.forward)
    elif phase == "router":
        moe_layer.router.forward = fail_in(ubatch, moe_layer.router.forward)
    elif phase == "dispatch_send":
        backend.prepare_async = fail_in(ubatch, backend.prepare_async)
    elif phase == "combine_send":
        backend.finalize_async = fail_in(ubatch, backend.finalize_async)
    elif phase in ("dispatch_recv", "combine_recv"):
        name = "prepare_async" if phase == "dispatch_recv" else "finalize_async"
        real = getattr(backend, name)

        def with_failing_receiver(*args, **kwargs):
            pending = real(*args, **kwargs)
            return Pending(pending.hook, fail_in(ubatch, pending.receiver))
        setattr(backend, name, with_failing_receiver)
    elif phase == "experts":
        kernel.experts.apply = fail_in(ubatch, kernel.experts.apply)
    elif phase == "shared_experts":
        moe_layer.shared_experts.forward = fail_in(ubatch, moe_layer.shared_experts.forward)
    else:
        raise AssertionError(phase)


PHASES = ["attention", "router", "dispatch_send", "dispatch_recv", "experts", "combine_send",
          "shared_experts", "combine_recv"]


@pytest.mark.parametrize("ubatch", [0, 1])
@pytest.mark.parametrize("phase", PHASES)
def test_failure_in_any_phase_names_it_and_the_next_step_works(phase, ubatch):
    model = tiny_model()
    moe_layer_index = next(i for i, b in enumerate(model.layers) if isinstance(b.ffn, MoELayer))
    batch = make_batch(model.config, num_tokens=24, num_requests=4, seed=1, device="cpu")
    args, kwargs = (batch.input_ids_T, batch.positions_T), {"seq_lens": batch.seq_lens}
    with torch.no_grad():
        expected = model(*args, **kwargs)
    runner = DBORunner(model, DBO)
    inject(model, phase, moe_layer_index, ubatch)
    with torch.no_grad(), pytest.raises(Injected) as info:
        runner(*args, **kwargs)
    exc = info.value
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert (exc.dbo_ubatch_id, exc.dbo_layer, exc.dbo_phase) == (ubatch, moe_layer_index, phase)
    assert f"ubatch {ubatch}, layer {moe_layer_index}, phase {phase}" in notes
    # One process: no collective was issued, and there is no process group to speak of
    # (the notes on a group's state: the two-rank tests below).
    assert exc.dbo_collectives_issued == 0 and "process group" not in notes, notes
    assert not dbo.dbo_enabled()
    # The failure came before any collective (EP size 1): the next step works.
    fresh = tiny_model()
    runner.model = fresh
    with torch.no_grad():
        torch.testing.assert_close(runner(*args, **kwargs), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ two gloo ranks
def ep_layer(group, backend="a2a", capacity=None) -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                    max_tokens_per_rank=capacity, backend=backend, experts="reference")
    layer = MoELayer(cfg, group=group)
    layer.load_weights(init_moe_weights(cfg, seed=2))
    return layer


def outcome(step) -> dict:
    """Run `step`; report the exception it raised (type, notes, seconds until raised)."""
    start = time.monotonic()
    try:
        with torch.no_grad():
            step()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "notes": "\n".join(getattr(exc, "__notes__", [])),
                "elapsed": time.monotonic() - start}
    return {"type": None}


def failure_after_collectives(rank: int, world_size: int, timeout_s: float) -> dict:
    group = dbo.new_group(timeout_s=timeout_s)
    layer = ep_layer(group)
    if rank == 0:
        kernel = layer._kernel(torch.device("cpu"))
        kernel.experts.apply = fail_in(0, kernel.experts.apply)
    runner = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=2), group=group)
    return outcome(lambda: runner(torch.randn(12, 16)))


@pytest.mark.distributed
def test_failure_after_collectives_says_recreate_and_peer_times_out():
    timeout_s = 3.0
    failed, waiting = run_distributed(2, failure_after_collectives, timeout_s)
    assert failed["type"] == "Injected"
    assert "rank 0, ubatch 0, layer 0, phase experts" in failed["notes"]
    assert "re-create the process group" in failed["notes"]
    # Rank 1 was left in a collective rank 0 never joined: it fails too, with its own
    # place named (freed by rank 0 leaving the group here; by the timeout at the latest).
    assert waiting["type"] == "RuntimeError", waiting
    assert "rank 1, ubatch" in waiting["notes"] and "phase" in waiting["notes"]
    assert "re-create the process group" in waiting["notes"]
    assert waiting["elapsed"] < 10 * timeout_s + 20


def one_rank_skips_a_step(rank: int, world_size: int, timeout_s: float) -> dict:
    group = dbo.new_group(timeout_s=timeout_s)
    layer = ep_layer(group)
    x = torch.randn(10, 16)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        # Skip the step but stay connected: only the group's timeout can free rank 0
        # (exiting would close the connection and fail rank 0 at once). Wait until rank 0
        # has failed, at most 4 timeouts (then leave: the test sees rank 0 late).
        try:
            store.wait(["rank 0 done"], timedelta(seconds=4 * timeout_s))
        except RuntimeError:
            pass
        return {"skipped": True}
    result = outcome(lambda: dbo.UBatchScheduler("cpu").run([lambda: layer(x[:5]),
                                                              lambda: layer(x[5:])]))
    store.set("rank 0 done", "1")
    return result


@pytest.mark.distributed
def test_timeout_when_a_rank_skips_a_step_names_rank_ubatch_layer_phase():
    timeout_s = 2.0
    result, _ = run_distributed(2, one_rank_skips_a_step, timeout_s)
    assert result["type"] == "RuntimeError", result
    assert "[dbo] rank 0, ubatch 0, layer 0, phase dispatch_send" in result["notes"]
    # Freed by the timeout: not before it, and well before the skipping rank returned.
    assert 0.9 * timeout_s <= result["elapsed"] < 3.5 * timeout_s, result["elapsed"]


def capacity_disagreement(rank: int, world_size: int) -> str:
    layer = ep_layer(dist.group.WORLD, backend="a2a_ll", capacity=8)
    # The runner learns the capacity from the layer (`dbo_max_tokens_per_rank`), per
    # model call: a split step whose ubatches fit runs though its total does not.
    split = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=2))
    with torch.no_grad():
        split(torch.randn(6 if rank == 0 else 11, 16))  # ubatches of 3 and 6 tokens
    assert split.last_decision.split
    # Rank 0 does not split 6 tokens: the step runs unsplit, rank 1's 11 overflow.
    runner = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=8))
    try:
        with torch.no_grad():
            runner(torch.randn(6 if rank == 0 else 11, 16))  # only rank 1 overflows
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_capacity_overflow_on_one_rank_stops_every_rank_together():
    for rank, message in enumerate(run_distributed(2, capacity_disagreement)):
        assert message.startswith("rank 1 of the group has 11 tokens in one model call "
                                  "this step (unsplit; each rank: rank 0: 6, rank 1: 11)"), \
            (rank, message)
        assert "more than the model's capacity max_tokens_per_rank=8" in message


def collective_sequences(rank: int, world_size: int) -> dict:
    return {backend: _sequences(backend, rank) for backend in ("a2a", "a2a_ll", "naive")}


def _sequences(backend: str, rank: int) -> list:
    layer = ep_layer(dist.group.WORLD, backend=backend, capacity=16)
    runner = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=6))
    gen = torch.Generator().manual_seed(100 + rank)
    sequences = []
    with torch.no_grad():
        for step in range(12):
            # Token counts differ across ranks, 0 included; some ranks want to split
            # (>= 6 tokens), others do not: the vote decides for all.
            n = 0 if (step + rank) % 5 == 0 else int(torch.randint(1, 17, (1,), generator=gen))
            with record_collectives() as log:
                runner(torch.randn(n, 16, generator=gen))
            sequences.append((runner.last_decision.split, tuple(log)))
    return sequences


@pytest.mark.distributed
def test_every_rank_issues_the_identical_collective_sequence():
    rank0, rank1 = run_distributed(2, collective_sequences)
    for backend in ("a2a", "a2a_ll", "naive"):
        assert rank0[backend] == rank1[backend], backend
        splits = [split for split, _ in rank0[backend]]
        assert any(splits) and not all(splits), backend  # the vote went both ways
        assert all(len(log) > 1 for _, log in rank0[backend])
