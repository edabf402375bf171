"""Layers 1-2: what the ranks must agree on before a step (`dbo.agreement`).

Layer 1 (CPU): the fingerprint of the agreement fields, the modules' `dbo_agreement`
hooks, the cache, and a single process's rejected inputs.
Layer 2 (two gloo processes): a rank that rejects its inputs (bad seq_lens, a wrong
input dtype) or a capacity overflow stops every rank at the vote, quickly and before any
collective of the model, and the next step runs; configurations that differ (top_k,
backend, DBOConfig.enabled, CUDA graphs on one rank) raise `ConfigMismatchError` naming
the field on every rank; a disabled runner votes on every step; MoE layers built from
MoEConfigs that differ raise it in their constructor, before their backend makes any
process group. (The step vote's other fields and DBO off: tests/dbo/test_step_vote.py.)
"""
from __future__ import annotations

from dataclasses import replace
import time
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

import dbo
from dbo import ConfigMismatchError, DBOConfig, DBORunner, GraphedRunner, PeerInputError
from dbo.agreement import Agreement, AgreementCache, collect_agreement, collect_capacity
from dbo.model_hooks import ModelHooks
from dbo.failures import record_collectives
from dbo.vote import Ballot, cast_ballot
from moe import MoEConfig, MoELayer, init_moe_weights
from moe.backends.a2a_ll import A2ALLOptions
from moe.models.transformer import MoETransformer, get_preset, make_batch
from tests.dist_utils import run_distributed

# A peer left waiting would be freed by this timeout: the tests require far less.
GROUP_TIMEOUT_S = 30.0
QUICK_S = 10.0
NEXT_STEP_RUNS = "the process group is intact and the next step can run"


def tiny_model(group: Any = None, backend: str = "local", **moe: Any) -> MoETransformer:
    model = MoETransformer(get_preset("tiny", backend=backend, experts="reference", **moe),
                           group=group)
    model.init_weights(0)
    return model


# ---------------------------------------------------------------------- layer 1 (CPU)
def test_fingerprint_is_stable_and_sees_every_field() -> None:
    fields = {"top_k": 2, "dtype": torch.bfloat16, "backend": "a2a", "cap": None}
    agreement = Agreement.of(fields)
    assert agreement == Agreement.of(dict(reversed(list(fields.items()))))
    assert agreement.fields["dtype"] == "torch.bfloat16"
    assert 0 <= agreement.fingerprint < 1 << 62
    for name, other in (("top_k", 1), ("dtype", torch.float32), ("backend", "naive"),
                        ("cap", 16)):
        assert Agreement.of({**fields, name: other}).fingerprint != agreement.fingerprint
    with pytest.raises(TypeError, match="field 'fn' is a function"):
        Agreement.of({"fn": lambda: 0})


def test_moe_layers_report_their_fields_under_their_module_names() -> None:
    fields = collect_agreement(tiny_model())
    assert fields["layers.1.ffn.top_k"] == 2 and fields["layers.2.ffn.num_experts"] == 8
    assert fields["layers.1.ffn.backend"] == "local"
    assert fields["layers.2.ffn.dtype"] == torch.float32
    assert not any(name.startswith("layers.0.") for name in fields)  # the dense layer


def _top1(logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights_TK, ids_TK = logits_TE.topk(top_k, dim=-1)
    return weights_TK.softmax(-1), ids_TK


@pytest.mark.parametrize("field, value", [
    ("intermediate_size", 12), ("scoring", "sigmoid"), ("routed_scaling_factor", 2.5),
    ("num_shared_experts", 1), ("renormalize", False), ("use_correction_bias", True),
    ("custom_routing_function", _top1), ("split_last_combine", False)])
def test_an_moe_field_that_changes_the_math_changes_the_layer_s_fingerprint(
        field: str, value: Any) -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)
    fields = collect_agreement(MoELayer(cfg))
    other = collect_agreement(MoELayer(replace(cfg, **{field: value})))
    assert Agreement.of(fields).fingerprint != Agreement.of(other).fingerprint, field
    assert field in fields and fields[field] != other[field], (field, fields)


def test_grouped_top_k_changes_the_layer_s_fingerprint() -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)
    grouped = collect_agreement(MoELayer(replace(cfg, n_group=2, topk_group=1)))
    assert Agreement.of(collect_agreement(MoELayer(cfg))).fingerprint != \
        Agreement.of(grouped).fingerprint
    assert (grouped["n_group"], grouped["topk_group"]) == (2, 1)


def test_the_cache_collects_again_only_when_the_model_or_config_is_replaced() -> None:
    calls = []

    class Counting:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def dbo_agreement(self) -> dict[str, object]:
            calls.append(1)
            return {"width": 4}

        def dbo_max_tokens_per_rank(self) -> int:  # the capacity, voted on as a field
            return 12

    hooks, cache = ModelHooks.of(Counting()), AgreementCache()
    on, off = DBOConfig(), DBOConfig(enabled=False)
    first = cache.get(hooks, on, lambda: {"enabled": True})
    assert first.fields == {"enabled": True, "width": 4, "capacity": 12,
                            "ubatch_capacity": None}
    assert first.capacity == cache.capacity == 12 and cache.ubatch_capacity is None
    assert cache.get(hooks, on, lambda: {"enabled": True}) is first and len(calls) == 1
    assert cache.get(hooks, off, lambda: {"enabled": False}) is not first and len(calls) == 2
    cache.get(ModelHooks.of(Counting()), off, lambda: {"enabled": False})
    assert len(calls) == 3


def test_ballot_without_a_process_group_is_this_rank_s() -> None:
    tally = cast_ballot(Ballot(inputs_ok=True, want_split=True, num_tokens=7, fingerprint=5))
    assert (tally.stops, tally.split, tally.max_tokens) == (False, True, 7)
    assert cast_ballot(Ballot(inputs_ok=False)).rejected_by == 0
    with pytest.raises(ValueError, match="fingerprint"):
        cast_ballot(Ballot(inputs_ok=True, fingerprint=1 << 62))


def test_the_model_s_input_check_runs_before_the_step_and_the_next_step_runs() -> None:
    model = tiny_model()
    runner = DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=2,
                                        max_imbalance=1.0))
    batch = make_batch(model.config, num_tokens=10, num_requests=2, seed=0)
    with torch.no_grad(), pytest.raises(ValueError, match="1-D integer tensor") as info:
        runner(batch.input_ids_T.float(), batch.positions_T, seq_lens=batch.seq_lens)
    # Stopped at the vote; one process has no group to speak of, so the error is the
    # model's alone (the note on the group: the two-rank tests below).
    assert info.value.dbo_stopped_together
    assert not getattr(info.value, "__notes__", []), info.value.__notes__
    with torch.no_grad():
        out = runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    assert out.shape == (10, model.config.vocab_size) and runner.last_decision.split


# ------------------------------------------------------------- layer 2 (two gloo ranks)
def outcome(step: Callable[[], Any]) -> dict[str, Any]:
    """Run `step`; report what it raised (type, text, notes, seconds, collectives)."""
    start = time.monotonic()
    with record_collectives() as log, torch.no_grad():
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"type": type(exc).__name__, "text": str(exc),
                    "notes": "\n".join(getattr(exc, "__notes__", [])),
                    "fields": getattr(exc, "fields", None),
                    "elapsed": time.monotonic() - start, "collectives": [n for n, _ in log]}
    return {"type": None}


def rejected_inputs(rank: int, world_size: int) -> dict[str, Any]:
    group = dbo.new_group(timeout_s=GROUP_TIMEOUT_S)
    model = tiny_model(group, backend="a2a")

    def without_hook(*args: Any, **kwargs: Any) -> Any:  # only the runner checks seq_lens
        return model(*args, **kwargs)

    split = dict(min_prefill_tokens=2, min_decode_tokens=2)
    runners = {"requests": DBORunner(without_hook, DBOConfig(split="requests", **split),
                                     group=group),
               "model": DBORunner(model, DBOConfig(split="requests", **split), group=group),
               # The capacity is the model's MoE layers' (MoEConfig), not a runner setting.
               "capacity": DBORunner(tiny_model(group, backend="a2a", max_tokens_per_rank=12),
                                     DBOConfig(split="requests"), group=group)}
    batch = make_batch(model.config, num_tokens=10 + rank, num_requests=3, seed=rank)
    ids, positions, lens = batch.input_ids_T, batch.positions_T, batch.seq_lens
    bad_lens = (*lens[:-1], lens[-1] + 1) if rank == 1 else lens
    more = 3 if rank == 1 else 0  # rank 1: 14 tokens, over the capacity of 12
    with torch.no_grad():
        expected = {name: runners[name](ids, positions, seq_lens=lens) for name in runners}
    cases = {  # (runner, inputs): only rank 1's are bad
        "seq_lens, split by the runner": ("requests", (ids, positions), bad_lens),
        "seq_lens, checked by the model": ("model", (ids, positions), bad_lens),
        "dtype": ("model", (ids.float() if rank == 1 else ids, positions), lens),
        "capacity": ("capacity", (torch.cat([ids, ids[:more]]),
                                  torch.cat([positions, torch.arange(more)])),
                     (*lens, more) if more else lens),
    }
    out = {}
    for case, (name, args, seq_lens) in cases.items():
        runner = runners[name]
        result = outcome(lambda: runner(*args, seq_lens=seq_lens))
        with torch.no_grad():
            result["next_step"] = torch.equal(runner(ids, positions, seq_lens=lens),
                                              expected[name])
        out[case] = result
    return out


@pytest.fixture(scope="module")
def rejected() -> list[dict[str, Any]]:
    """The two ranks' outcomes of `rejected_inputs` (one launch for the tests below)."""
    return run_distributed(2, rejected_inputs)


@pytest.mark.distributed
def test_inputs_rejected_on_one_rank_stop_every_rank_at_the_vote(rejected) -> None:
    rank0, rank1 = rejected
    for case, own in (("seq_lens, split by the runner",
                       "seq_lens sum to 12 tokens but the batch has 11 tokens"),
                      ("seq_lens, checked by the model", "sum to 12, but the call has T=11"),
                      ("dtype", "input_ids_T must be a 1-D integer tensor")):
        peer, rejecting = rank0[case], rank1[case]
        assert rejecting["type"] == "ValueError" and own in rejecting["text"], rejecting
        assert peer["type"] == "PeerInputError", peer
        assert peer["text"].startswith("rank 1 of the group rejected its inputs to this step")
        assert own in peer["text"], peer  # the rejecting rank's own message
        for result in (peer, rejecting):
            assert result["elapsed"] < QUICK_S, (case, result)
            assert result["collectives"] == ["all_reduce"], (case, result)  # the vote only
            assert NEXT_STEP_RUNS in result["notes"], (case, result)
            assert result["next_step"], case


@pytest.mark.distributed
def test_capacity_overflow_on_one_rank_says_and_lets_the_next_step_run(rejected) -> None:
    for rank, result in enumerate(rejected):
        result = result["capacity"]
        assert result["type"] == "ValueError" and "has 14 tokens in one model call" in result["text"]
        assert NEXT_STEP_RUNS in result["notes"], result
        assert "re-create the process group" not in result["notes"], result
        assert result["next_step"], rank


EP_LAYER = dict(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                max_tokens_per_rank=16)


def ep_layer_default(field: str) -> Any:
    """The value `ep_layer` gives `field` unless told otherwise."""
    return {"backend": "naive", **EP_LAYER}.get(
        field, getattr(MoEConfig, field, getattr(A2ALLOptions, field, None)))


def ep_layer(group: Any, *, backend: str = "naive", combine_chunks: Optional[int] = None,
             combine_groups: Optional[int] = None, **moe: Any) -> MoELayer:
    """A layer of `EP_LAYER`'s shape on `group`; `combine_chunks`, `combine_groups`:
    a2a_ll's options."""
    given = {k: v for k, v in (("combine_chunks", combine_chunks),
                               ("combine_groups", combine_groups)) if v is not None}
    options = A2ALLOptions(**given) if given else None
    cfg = MoEConfig(**{**EP_LAYER, **moe}, backend=backend, experts="reference",
                    backend_options=options)
    layer = MoELayer(cfg, group=group)
    layer.load_weights(init_moe_weights(cfg, seed=2))
    return layer


class PlainModel:
    """A model with no graph blockers and no hooks (for GraphedRunner on one rank)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def altered(layer: MoELayer, **changes: Any) -> MoELayer:
    """`layer` with its config replaced after construction: only the step's vote sees it."""
    layer.config = replace(layer.config, **changes)
    return layer


# Layers built from MoEConfigs that differ: (case, the field named, rank 0's and rank 1's
# ep_layer arguments). Every rank raises in the constructor, before any collective the
# backend makes (a2a builds a second process group over the ranks).
BUILT_UNLIKE = (
    ("a2a on one rank", "backend", dict(backend="naive"), dict(backend="a2a")),
    # a2a_ll adds the fields of its options (`PrepareFinalize.agreement_fields`), which
    # a2a's config lacks: named too, after the backend.
    ("a2a_ll on one rank", ("backend", "combine_chunks", "combine_groups",
                            "max_tokens_per_ubatch"),
     dict(backend="a2a"), dict(backend="a2a_ll")),
    ("top_k", "top_k", dict(top_k=2), dict(top_k=1)),
    # A chunked SBO combine issues more collectives than one combine.
    ("combine_chunks", "combine_chunks", dict(backend="a2a_ll"),
     dict(backend="a2a_ll", combine_chunks=2)),
    # So does a combine by expert group (one collective per group).
    ("combine_groups", "combine_groups", dict(backend="a2a_ll"),
     dict(backend="a2a_ll", combine_groups=2)),
    # The ones below change only the math: the ranks would run a silently mixed model.
    ("intermediate_size", "intermediate_size", {}, dict(intermediate_size=12)),
    ("scoring", "scoring", {}, dict(scoring="sigmoid")),
    ("routed_scaling_factor", "routed_scaling_factor", {}, dict(routed_scaling_factor=2.5)),
)


def mismatched_configs(rank: int, world_size: int) -> dict[str, Any]:
    group = dbo.new_group(timeout_s=GROUP_TIMEOUT_S)
    on = DBOConfig(split="tokens", min_decode_tokens=2)
    x = torch.randn(8 + rank, 16)
    one = rank == 1
    out: dict[str, Any] = {}
    for case, _, rank0, rank1 in BUILT_UNLIKE:
        out[f"built: {case}"] = outcome(lambda: ep_layer(group, **(rank1 if one else rank0)))
    cases = {
        "top_k": DBORunner(altered(ep_layer(group), top_k=1) if one else ep_layer(group), on,
                           group=group),
        "enabled": DBORunner(ep_layer(group), DBOConfig(enabled=not one), group=group),
        # Joined experts meet where split experts do not: the ranks' steps would differ.
        "joined_experts": DBORunner(ep_layer(group), replace(on, joined_experts=one),
                                    group=group),
        "cuda_graph": (DBORunner(PlainModel(), on, group=group) if one
                       else GraphedRunner(DBORunner(PlainModel(), on, group=group))),
    }
    out.update({name: outcome(lambda: runner(x)) for name, runner in cases.items()})
    # Alike again, the group is intact; disabled alike, the runners vote on every step.
    same = DBORunner(ep_layer(group), DBOConfig(enabled=False), group=group)
    logs = []
    with torch.no_grad():
        for _ in range(2):
            with record_collectives() as log:
                same(x)
            logs.append([name for name, _ in log])
    out["disabled_alike"] = logs
    return out


@pytest.mark.distributed
def test_configurations_that_differ_raise_the_same_named_error_on_every_rank() -> None:
    for rank, out in enumerate(run_distributed(2, mismatched_configs)):
        for case, named, rank0, rank1 in BUILT_UNLIKE:
            result = out[f"built: {case}"]
            assert result["type"] == "ConfigMismatchError", (rank, case, result)
            names = named if isinstance(named, tuple) else (named,)
            assert result["fields"] == names, (rank, case, result)
            field = names[0]
            value0 = rank0.get(field, ep_layer_default(field))
            value1 = rank1.get(field, ep_layer_default(field))
            assert f"{field}: rank 0: {value0}, rank 1: {value1}" in result["text"], result
            assert "Build every rank's MoEConfig alike" in result["text"], result
            assert result["elapsed"] < QUICK_S, result
        for case, field in (("top_k", "top_k"), ("enabled", "DBOConfig.enabled"),
                            ("joined_experts", "DBOConfig.joined_experts"),
                            ("cuda_graph", "cuda_graph")):
            result = out[case]
            assert result["type"] == "ConfigMismatchError", (rank, case, result)
            assert field in result["fields"] and f"{field}: rank 0:" in result["text"], result
            assert result["elapsed"] < QUICK_S and NEXT_STEP_RUNS in result["notes"], result
        assert out["top_k"]["fields"] == ("top_k",)
        assert "top_k: rank 0: 2, rank 1: 1" in out["top_k"]["text"]
        if rank == 0:  # its own rejection (CPU input to GraphedRunner) is told too
            assert "the first tensor argument must be on a CUDA device" in \
                out["cuda_graph"]["text"]
        first, second = out["disabled_alike"]
        assert first == second and first[0] == "all_reduce", (first, second)  # the vote
        assert "all_reduce" not in first[1:], first  # then the model's collectives


def test_errors_are_runtime_errors() -> None:
    # Code that caught the RuntimeError GraphedRunner raised for a peer still catches it.
    assert issubclass(ConfigMismatchError, RuntimeError)
    assert issubclass(PeerInputError, RuntimeError)


def test_capacity_is_the_smallest_a_module_reports() -> None:
    """The runner's capacity comes from the model's modules (stated once, in MoEConfig)."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)
    capped = nn.ModuleList([MoELayer(replace(cfg, max_tokens_per_rank=n)) for n in (32, 8)])
    assert collect_capacity(nn.ModuleList([MoELayer(cfg)])) is None
    assert collect_capacity(capped) == 8
    capped.append(MoELayer(cfg))  # a layer without a limit does not lift the others'
    assert collect_capacity(capped) == 8

    class Bad:
        def dbo_max_tokens_per_rank(self) -> int:
            return 0

    with pytest.raises(TypeError, match=r"dbo_max_tokens_per_rank\(\) returned 0"):
        collect_capacity(Bad())


def freed_after_a_stopped_step(rank: int, world_size: int) -> dict[str, Any]:
    """A step stopped at the vote (rank 1's inputs rejected): with the garbage collector
    off, dropping the runner must free it. No frame of the error's traceback may keep the
    error (a reference cycle would keep the runner, its model and, under GraphedRunner,
    its CUDA graphs alive until a collection)."""
    import gc
    import weakref

    gc.disable()
    try:
        model = nn.Linear(4, 4)
        runner = DBORunner(model, DBOConfig(split="tokens", min_decode_tokens=2),
                           group=torch.distributed.group.WORLD)
        x = torch.randn(8, 4)
        with torch.no_grad():
            runner(x)
            outcome_type = outcome(lambda: runner(x, torch.randn(3)) if rank == 1
                                   else runner(x))["type"]
        refs = [weakref.ref(runner), weakref.ref(model)]
        del runner, model
        return {"type": outcome_type, "alive": [r() is not None for r in refs]}
    finally:
        gc.enable()


@pytest.mark.distributed
def test_a_step_stopped_at_the_vote_leaves_no_reference_cycle() -> None:
    rank0, rank1 = run_distributed(2, freed_after_a_stopped_step)
    assert (rank0["type"], rank1["type"]) == ("PeerInputError", "ValueError")
    assert rank0["alive"] == rank1["alive"] == [False, False]
