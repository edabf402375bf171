"""Layers 1-2 and 4 (CPU, two gloo processes; GPU-marked): CUDA graphs of DBO steps
(`dbo.graphs`): input checks and keys on CPU, the vote's extra values over gloo,
and capture/replay on one and two GPUs (marked gpu).

Run the GPU part on a GPU machine: `python -m pytest tests/dbo/test_graphs.py -q`.
"""
from __future__ import annotations

from dataclasses import replace
import json
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from dbo.cli.bench.config import NVLINK_REGIME, BenchConfig
from dbo.cli.bench.launch import build_parser, config_from_args
from dbo.graphs import (GraphedRunner, _signature, capture_graph, decided_step,
                        graph_blockers)
from dbo.cli.run_config import BACKENDS, GRAPH_BACKENDS, RunConfig
from dbo.vote import vote_min
from moe.config import MoEConfig
from moe.layer import MoELayer
from tests.dist_utils import run_distributed

SPLIT = DBOConfig(split="tokens", min_decode_tokens=2, min_prefill_tokens=2)


def _layer(backend: str, *, experts: str = "triton", device: str = "cpu",
           group: Any = None, **moe: Any) -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16, **moe)
    return MoELayer(replace(cfg, backend=backend, experts=experts), group=group, device=device)


# ------------------------------------------------------------------------------- CPU
def test_graphed_runner_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="wraps a DBORunner"):
        GraphedRunner(lambda x: x)  # type: ignore[arg-type]
    runner = DBORunner(lambda x: x, SPLIT)
    for kwargs in ({"warmup": 0}, {"max_graphs": 0}, {"warmup": True}):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            GraphedRunner(runner, **kwargs)
    with pytest.raises(ValueError, match="first tensor argument must be on a CUDA device"):
        GraphedRunner(runner)(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="need a CUDA device"):
        capture_graph(lambda: None, device=torch.device("cpu"))


def test_layers_that_read_device_values_on_the_host_are_refused_before_any_capture() -> None:
    assert _layer("a2a_ll", max_tokens_per_rank=8).cuda_graph_blocker is None
    assert _layer("local").cuda_graph_blocker is None
    assert _layer("naive", max_tokens_per_rank=8).cuda_graph_blocker is None
    assert "backend 'naive'" in _layer("naive").cuda_graph_blocker
    assert "experts 'reference'" in _layer("local", experts="reference").cuda_graph_blocker
    assert "check_finite_logits" in _layer("local", check_finite_logits=True).cuda_graph_blocker
    model = torch.nn.Sequential(_layer("local"), _layer("naive"))
    assert graph_blockers(model) == [f"1: {_layer('naive').cuda_graph_blocker}"]
    with pytest.raises(ValueError, match="cannot run in a CUDA graph: 1: backend 'naive'"):
        GraphedRunner(DBORunner(model, SPLIT))


def test_signature_keys_shapes_and_values_not_cuda_contents() -> None:
    a = _signature((torch.zeros(3, 2),), {"seq_lens": [1, 2]})
    assert a == _signature((torch.zeros(3, 2),), {"seq_lens": [1, 2]})
    assert a != _signature((torch.ones(3, 2),), {"seq_lens": [1, 2]})  # CPU: by value
    assert a != _signature((torch.zeros(3, 2),), {"seq_lens": [2, 1]})
    assert a != _signature((torch.zeros(3, 2),), {"seq_lens": (1, 2)})
    with pytest.raises(ValueError, match="pass it on the CUDA device"):
        _signature((torch.zeros(5000),), {})
    with pytest.raises(TypeError, match="cannot be hashed"):
        _signature((bytearray(b"x"),), {})


def test_decided_step_runs_the_runner_s_plan_without_a_vote() -> None:
    calls: list[int] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * 2

    x = torch.arange(6.0).reshape(6, 1)
    assert torch.equal(decided_step(DBORunner(model, SPLIT), (x,), {}, split=True)(), x * 2)
    assert calls == [3, 3]  # split as planned
    calls.clear()
    assert torch.equal(decided_step(DBORunner(model, SPLIT), (x,), {}, split=False)(), x * 2)
    assert calls == [6]  # as a veto would leave it
    calls.clear()
    disabled = DBORunner(model, DBOConfig(enabled=False))
    assert torch.equal(decided_step(disabled, (x,), {}, split=True)(), x * 2)
    assert calls == [6]  # DBO disabled: never split


def test_bench_cuda_graph_options_are_checked() -> None:
    with pytest.raises(ValueError, match="needs --device cuda"):
        BenchConfig(device="cpu", cuda_graph=True)
    with pytest.raises(ValueError, match="cannot capture backend 'a2a'"):
        BenchConfig(device="cuda", regime=NVLINK_REGIME, backends=("a2a", "a2a_ll"),
                    cuda_graph=True)
    with pytest.raises(ValueError, match="reference experts"):
        BenchConfig(device="cuda", regime=NVLINK_REGIME, backends=("a2a_ll",),
                    experts="reference", cuda_graph=True)
    with pytest.raises(ValueError, match="trace without --cuda-graph"):
        BenchConfig(device="cuda", regime=NVLINK_REGIME, backends=("a2a_ll",), trace=True,
                    cuda_graph=True)
    ok = BenchConfig(device="cuda", regime=NVLINK_REGIME, backends=("a2a_ll",), cuda_graph=True)
    assert ok.summary()["cuda_graph"] is True
    args = build_parser().parse_args(["--cuda-graph", "--device", "cpu"])
    with pytest.raises(ValueError, match="needs --device cuda"):
        config_from_args(args, {})


def test_dbo_run_takes_every_backend_but_a2a_and_deepep_ht_with_cuda_graphs() -> None:
    for backend in GRAPH_BACKENDS:
        assert RunConfig(backend=backend, cuda_graph=True).backend == backend
    # deepep_ht is capturable only with DeepEPHTOptions.worst_case_dispatch, which
    # `dbo run` does not set. (Over today's backends: a new one joins by its traits.)
    from tests.tools.test_backend_lists import today
    assert set(today(set(BACKENDS) - set(GRAPH_BACKENDS))) == {"a2a", "deepep_ht"}
    with pytest.raises(ValueError, match="a2a: that backend reads device values on the host"):
        RunConfig(backend="a2a", cuda_graph=True)


def _vote_min_worker(rank: int, world_size: int) -> list[int]:
    return vote_min([3 - rank, 1 + 4 * rank, rank], dist.group.WORLD)


@pytest.mark.distributed
def test_vote_min_takes_each_value_s_minimum_over_ranks() -> None:
    assert vote_min([1, -5, 0]) == [1, -5, 0]  # no process group: this rank's values
    assert run_distributed(2, _vote_min_worker) == [[2, 1, 0], [2, 1, 0]]


def _split_step_worker(rank: int, world_size: int) -> dict[str, Any]:
    from dbo.cli.bench.ceiling import record_collectives
    from dbo.cli.bench.workload import WorkloadFactory

    factory = WorkloadFactory(BenchConfig(layers=2), group=dist.group.WORLD,
                              device=torch.device("cpu"))
    on = factory.get(tokens=10, backend="a2a_ll", dbo=True)
    expected = on.step()
    with record_collectives(on.model) as voted:
        on.step()
    with record_collectives(on.model) as decided:
        split = on.split_step()
    names = lambda rec: sorted({op.name for seg in rec.segments for op in seg})  # noqa: E731
    return {"equal": torch.equal(split, expected), "voted": names(voted),
            "decided": names(decided)}


@pytest.mark.distributed
def test_the_bench_s_decided_split_step_matches_and_skips_the_vote() -> None:
    """What `--cuda-graph` captures for the split-compute probe: the runner's split step
    without its vote (a graph cannot read the vote), recorded the same way."""
    for out in run_distributed(2, _split_step_worker):
        assert out["equal"], out
        assert "all_reduce" in out["voted"] and "all_reduce" not in out["decided"], out
        assert out["decided"] == ["all_to_all_single"], out


def test_host_buffers_go_to_the_collecting_capture_else_live_for_the_process() -> None:
    from dbo import graph_host

    a, b = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])
    with graph_host.collect_graph_host_buffers() as outer:
        with graph_host.collect_graph_host_buffers() as inner:
            assert graph_host.keep_for_graph(a) is a
        assert graph_host.keep_for_graph(b) is b
    assert inner == [a] and outer == [b], "each buffer joins the innermost collection"
    before = graph_host.num_process_lifetime_buffers()
    value = torch.tensor([7, -1, 123456789])  # no other test keeps this value
    kept = graph_host.keep_for_graph(value)
    assert kept is value and graph_host.num_process_lifetime_buffers() == before + 1
    again = graph_host.keep_for_graph(value.clone())
    assert again is value, "an equal buffer kept for the process is shared"
    assert graph_host.num_process_lifetime_buffers() == before + 1


def test_dropped_graphs_are_let_go_only_after_their_gpus_finish(monkeypatch) -> None:
    """A queued replay may still read a dropped graph's pinned buffers: `_release`
    waits for each graph's device while the entries are still held."""
    import weakref

    from dbo import graphs

    class Buffer:  # a stand-in for a pinned tensor, weakly referenceable
        pass

    buffer = Buffer()
    entries = [graphs._Entry(graphs.CapturedGraph(None, None, [buffer]), (), {},
                             torch.device("cuda", i % 2)) for i in range(3)]
    ref = weakref.ref(buffer)
    del buffer
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: synced.append((device, ref() is not None)))
    graphs._release(entries)
    assert sorted(d.index for d, _ in synced) == [0, 1], "each device once"
    assert all(alive for _, alive in synced), "the buffers are held while waiting"
    graphs._release([])
    assert len(synced) == 2


# ------------------------------------------------------------------------------- GPU
def _stack(group: Any, backend: str, device: torch.device, capacity: int) -> torch.nn.Module:
    from dbo.cli.bench.layer_stack import LayerStack
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64,
                    num_shared_experts=1, dtype=torch.bfloat16, max_tokens_per_rank=capacity)
    model = LayerStack(replace(cfg, backend=backend, experts="triton"), num_layers=2,
                       attn_context=64, group=group, device=device)
    model.init_weights(seed=5)
    return model


def _inputs(tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tokens, 128, generator=gen, device=device).to(torch.bfloat16)


@pytest.mark.gpu
def test_a_captured_graph_owns_its_host_buffers_and_frees_them_with_it() -> None:
    import gc
    import weakref

    from dbo import graph_host
    from moe.models.attention import causal_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = [3, 5, 3, 5, 2]  # unequal groups: attention copies a row index from the host
    q, k, v = (torch.randn(sum(seq_lens), 4, 64, generator=gen, device="cuda")
               for _ in range(3))
    eager = causal_attention(q, k, v, seq_lens)
    before = graph_host.num_process_lifetime_buffers()
    captured = capture_graph(lambda: causal_attention(q, k, v, seq_lens),
                             device=q.device, warmup=1)
    assert len(captured.host_buffers) >= 1 and all(t.is_pinned() for t in captured.host_buffers)
    assert graph_host.num_process_lifetime_buffers() == before, "owned by the graph instead"
    assert torch.equal(captured.replay(), eager)
    torch.cuda.synchronize()
    refs = [weakref.ref(t) for t in captured.host_buffers]
    del captured
    gc.collect()
    assert all(r() is None for r in refs), "the buffers are freed with their graph"


@pytest.mark.gpu
def test_graphed_steps_replay_the_eager_results_on_one_gpu() -> None:
    device = torch.device("cuda", 0)
    model = _stack(None, "local", device, capacity=64)
    runner = DBORunner(model, SPLIT)
    graphed = GraphedRunner(runner, max_graphs=2)
    with torch.no_grad():
        x1, x2, x3 = (_inputs(48, s, device) for s in (1, 2, 3))
        first = graphed(x1)
        assert runner.last_decision.split and graphed.num_captures == 1
        assert torch.equal(first, runner(x1))
        second = graphed(x2)  # same shape: the new values are copied in, no capture
        assert graphed.num_captures == 1 and torch.equal(second, runner(x2))
        assert torch.equal(first, runner(x1)), "an earlier result was overwritten"
        y = _inputs(20, 4, device)
        assert torch.equal(graphed(y), runner(y)) and graphed.num_captures == 2
        graphed(x3[:10])  # a third shape: the least recently used graph (48 rows) goes
        assert torch.equal(graphed(x3), runner(x3)) and graphed.num_captures == 4
    # The timing helper's graph path gives a time for the replays.
    from dbo.cli.bench.timing import time_steps
    with torch.no_grad():
        t = time_steps(lambda: model(x1), device=device, group=None, warmup=1, iters=3,
                       cuda_graph=True)
    assert t.max_ms > 0


def _two_gpu_worker(rank: int, world_size: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    model = _stack(dist.group.WORLD, "a2a_ll", device, capacity=32)
    runner = DBORunner(model, SPLIT, group=dist.group.WORLD)
    graphed = GraphedRunner(runner)
    out: dict[str, Any] = {}
    with torch.no_grad():
        x = _inputs(40 + 8 * rank, 10 + rank, device)  # ranks differ in tokens
        out["same"] = torch.equal(graphed(x), runner(x))
        out["split"] = graphed.last_decision.split
        x2 = _inputs(40 + 8 * rank, 20 + rank, device)
        out["same2"] = torch.equal(graphed(x2), runner(x2))
        if rank == 1:
            graphed.reset()  # only rank 1 lost its graph: the vote makes both capture
        out["same3"] = torch.equal(graphed(x), runner(x))
        out["captures"] = graphed.num_captures
        try:  # rank 1's inputs are rejected: rank 0 must not wait in the step for it
            graphed(x, junk=bytearray(b"x")) if rank == 1 else graphed(x)
            out["bad"] = "no error"
        except (TypeError, RuntimeError) as exc:
            out["bad"] = f"{type(exc).__name__}: {exc}"
        out["after_bad"] = torch.equal(graphed(x), runner(x))
        try:  # the eager runner's vote cannot be captured
            capture_graph(lambda: runner(x), device=device, warmup=1)
            out["eager_capture"] = "no error"
        except RuntimeError as exc:
            out["eager_capture"] = str(exc)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.multigpu
def test_graphed_dbo_steps_over_nccl_match_eager_and_recapture_together() -> None:
    for rank, out in enumerate(run_distributed(2, _two_gpu_worker, backend="nccl")):
        assert out["same"] and out["same2"] and out["same3"] and out["split"], out
        assert out["captures"] == 2, out  # rank 0 too: a peer lacked its graph
        expected = ("TypeError: GraphedRunner keys" if rank
                    else "PeerInputError: rank 1 of the group rejected its inputs")
        assert out["bad"].startswith(expected) and out["after_bad"], out
        assert "dbo.graphs.GraphedRunner" in out["eager_capture"], out


def _naive_capacity_worker(rank: int, world_size: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    model = _stack(dist.group.WORLD, "naive", device, capacity=32)
    runner = DBORunner(model, SPLIT, group=dist.group.WORLD)
    graphed = GraphedRunner(runner)
    with torch.no_grad():
        xs = [_inputs(40 + 8 * rank, seed + rank, device) for seed in (30, 40)]
        same = [torch.equal(graphed(x), runner(x)) for x in xs]
    torch.cuda.synchronize()
    return {"same": same, "split": graphed.last_decision.split,
            "captures": graphed.num_captures}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_naive_with_a_fixed_capacity_is_captured_and_matches_eager() -> None:
    for out in run_distributed(2, _naive_capacity_worker, backend="nccl"):
        assert out == {"same": [True, True], "split": True, "captures": 1}, out


def _graph_bench_worker(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    from dbo.cli.bench.report import final_line, write_outputs
    from dbo.cli.bench.sweep import run_sweep

    cfg = BenchConfig(preset="tiny", tokens=(64,), backends=("a2a_ll",), iters=2, warmup=1,
                      rounds=2, device="cuda", regime=NVLINK_REGIME, cuda_graph=True,
                      out_dir=out_dir,
                      plot=False, progress=False, gate_min_tokens=0)
    result = run_sweep(cfg, group=dist.group.WORLD, device=torch.device("cuda", rank))
    return json.loads(final_line(result, write_outputs(result))) if rank == 0 else {}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_bench_sweep_with_cuda_graphs_times_every_step_and_probe(tmp_path) -> None:
    final = run_distributed(2, _graph_bench_worker, str(tmp_path), backend="nccl")[0]
    assert final["cuda_graph"] is True, final
    (point,) = final["points"]
    assert point["dbo_split"] and len(point["trial_speedups"]) == 2, point
    for name in ("t_nodbo_ms", "t_dbo_ms", "t_compute_ms", "t_comm_ms", "t_both_ms",
                 "t_split_ms"):
        assert point[name] > 0, (name, point)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "naive"])
def test_dbo_run_with_cuda_graphs_checks_the_graphed_step_against_eager(tmp_path,
                                                                        backend) -> None:
    # Every visible GPU as a rank (auto: a2a_ll on several, local on one; naive with the
    # capacity dbo run sets).
    proc = subprocess.run([sys.executable, "-m", "dbo.cli", "run", "--cuda-graph", "--tokens",
                           "96", "--requests", "6", "--steps", "2", "--backend", backend,
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda_graph"] is True and summary["device"] == "cuda", summary
    expected = backend if backend != "auto" else (
        "a2a_ll" if summary["world_size"] > 1 else "local")
    assert summary["backend"] == expected, summary
    assert summary["split"] is True and summary["outputs_match"] is True, summary
    assert summary["step_ms"]["dbo_on"] > 0 and summary["step_ms"]["dbo_off"] > 0
    assert "both modes ran as CUDA graph replays" in proc.stdout
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_bench_config_regime_must_fit_the_device() -> None:
    """A CUDA config left with the CPU label would report its speedups as null
    (a functional run)."""
    with pytest.raises(ValueError, match="does not fit device='cuda'"):
        BenchConfig(device="cuda", backends=("a2a_ll",))
