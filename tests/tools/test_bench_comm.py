"""Layers 1-2: `dbo bench-comm` on CPU. Argument errors, routing, the bandwidth and SM
arithmetic on synthetic numbers with hand-computed answers, the eager and graphed timing
arithmetic on a fake clock (graphs: a stand-in capture and stand-in CUDA events), which
engines a graph can capture, the graphed outputs (layer 1, in-process); the command end
to end on the two gloo ranks it spawns itself (layer 2). DeepEP's raw calls, real CUDA
graphs and the SM count from real kernels are GPU only (tests/tools/test_bench_comm_gpu.py).
"""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from moe.bench.comm import CommBenchConfig, CommResult, RankTiming, Skip, make_point
from moe.bench.comm_metrics import (algbw_gbps, comm_kernel_sms, expert_slots, make_routing,
                                    rows_to_ranks)
from moe.bench.comm_engines import bench_names
from moe.bench.comm_report import folded_skips

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- layer 1: in-process
@pytest.mark.parametrize("argv, message", [
    (["--backends", "a2a,nope"], "unknown backend 'nope': choose from naive, naive_mono, a2a, a2a_ll"),
    (["--backends", "local"], "unknown backend 'local'"),
    (["--tokens", "16,0"], "tokens must be positive ints, got 0"),
    (["--tokens", "-4"], "tokens must be positive ints, got -4"),
    (["--tokens", "16,abc"], "expected integers"),
    (["--num-experts", "9", "--top-k", "2"], "num_experts=9 is not divisible by the 2 ranks"),
    (["--num-experts", "8", "--top-k", "9"], "top_k=9 exceeds num_experts=8"),
    (["--iters", "0"], "iters=0: must be an int >= 1"),
    (["--hidden", "0"], "hidden=0: must be an int >= 1"),
    (["--routing", "skewed"], "argument --routing: invalid choice: 'skewed'"),
    (["--out", "FILE"], "that is an existing file"),
    (["--backends", "symm_mem,deepep_raw_ht,deepep_raw_ll,deepep_ht,deepep_ll,a2a_ll"],
     "symm_mem cannot run in one process with deepep_raw_ll, deepep_ll (once symm_mem's"),
    (["--backends", "deepep_raw_ll,symm_mem"], "then --backends deepep_raw_ll"),
    (["--graph-layers", "4"], "--graph-layers 4 does nothing without --cuda-graph"),
    (["--cuda-graph", "--graph-layers", "0"], "graph_layers=0: must be an int >= 1"),
])
def test_bad_arguments_exit_with_the_fix(argv: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import dbo.cli.bench_comm

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started")

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(dbo.cli.bench_comm, "launch", refuse)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        dbo.cli.bench_comm.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("dbo bench-comm: ") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without a GPU")
def test_cuda_graph_is_refused_on_cpu_before_any_rank_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    test_bad_arguments_exit_with_the_fix(
        ["--cuda-graph", "--tokens", "1"], "--cuda-graph needs CUDA GPUs, and none is "
        "visible here: drop --cuda-graph", tmp_path, capsys, monkeypatch)
    with pytest.raises(ValueError, match="--cuda-graph needs CUDA GPUs"):
        CommBenchConfig(cuda_graph=True).check_device(torch.device("cpu"))
    CommBenchConfig(cuda_graph=False).check_device(torch.device("cpu"))
    with pytest.raises(TypeError, match="cuda_graph=1: must be True or False"):
        CommBenchConfig(cuda_graph=1)


def test_command_is_registered_with_its_defaults(capsys: pytest.CaptureFixture) -> None:
    from dbo import cli

    assert cli.COMMANDS["bench-comm"][0] == "dbo.cli.bench_comm"
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench-comm", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: dbo bench-comm ")
    assert "(default 1,128,512,2048,4096,8192)" in out and "(default: 7168)" in out
    assert ("deepep_raw_ht, deepep_raw_ll, deepep_v2_raw_prefill, deepep_v2_raw_decode, "
            "nccl_ep_raw_ll, nccl_ep_raw_ht (default: all);") in out
    assert "NAME:FIELD=VALUE, e.g. nccl_ep:mode=ht" in out


def test_bandwidth_is_received_bytes_over_time() -> None:
    # 1000 rows of H 7168 bf16 in 50 us: 14,336,000 B / 50e-6 s = 286.72 GB/s.
    assert algbw_gbps(1000 * 7168 * 2, 0.05) == pytest.approx(286.72)
    assert algbw_gbps(1.0, 0.0) is None and algbw_gbps(1.0, None) is None
    # E 8 over W 2: experts 0-3 on rank 0, 4-7 on rank 1; -1 goes nowhere.
    ids = torch.tensor([[0, 1], [0, 5], [6, 7], [-1, 3]])
    assert rows_to_ranks(ids, num_experts=8, world_size=2) == [3, 2]
    assert expert_slots(ids) == 7


def test_point_folds_ranks_with_hand_computed_figures() -> None:
    # H 1024 bf16: 2048 B per row. Rank 0 receives 1000 rows, rank 1 500.
    def timing(d_ms: float, c_ms: float) -> RankTiming:
        return RankTiming(dispatch_ms=d_ms, combine_ms=c_ms, total_ms=d_ms + c_ms,
                          host_dispatch_us=10.0 * d_ms, host_combine_us=20.0 * c_ms,
                          host_total_us=30.0 * d_ms)

    ranks = [{"rank_rows": 1000, "expert_slots": 3000, "rows_delivered": 1000,
              "timing": timing(0.1, 0.2), "sms": (24, 20), "kernels": {"nccl_a": 24}},
             {"rank_rows": 500, "expert_slots": 1000, "rows_delivered": 512,
              "timing": timing(0.08, 0.1), "sms": (24, 32), "kernels": {}}]
    p = make_point("a2a", 64, ranks, itemsize=2, hidden=1024)
    assert (p.dispatch_us, p.combine_us) == pytest.approx((100.0, 200.0))  # slowest rank
    assert p.total_us == pytest.approx(300.0)
    assert (p.host_dispatch_us, p.host_combine_us) == pytest.approx((1.0, 4.0))
    assert p.host_total_us == pytest.approx(3.0)
    # dispatch: rank 0 2,048,000 B / 0.1 ms = 20.48 GB/s; rank 1 1,024,000 / 0.08 = 12.8.
    assert p.algbw_dispatch_gbps == pytest.approx((20.48 + 12.8) / 2)
    # combine: 2,048,000 / 0.2 = 10.24; 1,024,000 / 0.1 = 10.24.
    assert p.algbw_combine_gbps == pytest.approx(10.24)
    # d+c: twice the bytes over the d+c time: 4,096,000 / 0.3; 2,048,000 / 0.18.
    assert p.algbw_total_gbps == pytest.approx((4.096e6 / 0.3e6 + 2.048e6 / 0.18e6) / 2)
    # LL: 2 x slots x 2048 B: 12,288,000 / 0.3 ms = 40.96; 4,096,000 / 0.18 ms = 22.76.
    assert p.algbw_ll_total_gbps == pytest.approx((12.288e6 / 0.3e6 + 4.096e6 / 0.18e6) / 2)
    assert (p.sms_dispatch, p.sms_combine) == (24, 32)
    assert p.per_rank["rank_bytes"] == [2_048_000, 1_024_000]
    assert p.per_rank["rows_delivered"] == [1000, 512]


def test_sms_are_comm_kernel_grids_capped_at_the_sm_count() -> None:
    def kernel(name: str, grid: list[int]) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "args": {"grid": grid}}

    events = [kernel("ncclDevKernel_SendRecv(ncclDevKernelArgs)", [2, 1, 1]),
              kernel("void deep_ep::intranode::dispatch<2, 768>(...)", [24, 1, 1]),
              kernel("pack_rows_kernel", [4096, 1, 1]),              # compute: not counted
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel"}]
    is_comm = lambda name: "nccl" in name.lower() or "deep_ep" in name  # noqa: E731
    got = comm_kernel_sms(events, sm_count=132, is_comm=is_comm)
    assert got.sms == 24 and set(got.blocks) == {events[0]["name"], events[1]["name"]}
    # 128 x 2 blocks = 256 > 132 SMs: the kernel can hold every SM, no more.
    wide = comm_kernel_sms([kernel("deep_ep::internode_ll::dispatch", [128, 2, 1])],
                           sm_count=132, is_comm=is_comm)
    assert wide.sms == 132 and wide.blocks == {"deep_ep::internode_ll::dispatch": 256}
    assert comm_kernel_sms(events[2:], sm_count=132, is_comm=is_comm).sms is None


def test_sms_from_a_real_profiler_trace() -> None:
    # A torch.profiler trace of a2a on 2x H200 (traces/data): its NCCL SendRecv kernels
    # ran with grids of 2 and 4 blocks (12 launches); every other kernel is compute.
    import gzip

    from traces.classify import Classifier

    with gzip.open(REPO / "traces/data/h200x2_a2a_T4096_dbo-off.json.gz", "rt") as f:
        doc = json.load(f)
    got = comm_kernel_sms(doc["traceEvents"], sm_count=132, is_comm=Classifier().is_comm_name)
    assert got.sms == 4
    assert got.blocks == {"ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": 4}


def test_routing_is_reproducible_distinct_and_balanced() -> None:
    cpu = torch.device("cpu")
    kwargs = dict(num_experts=16, top_k=4, seed=3, device=cpu)
    ids, weights = make_routing(32, rank=1, mode="random", **kwargs)
    again, _ = make_routing(32, rank=1, mode="random", **kwargs)
    other, _ = make_routing(32, rank=0, mode="random", **kwargs)
    assert torch.equal(ids, again) and not torch.equal(ids, other)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert torch.allclose(weights.sum(dim=1), torch.ones(32))
    ids, _ = make_routing(32, rank=1, mode="balanced", **kwargs)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert torch.bincount(ids.flatten(), minlength=16).tolist() == [8] * 16  # 32*4/16
    assert rows_to_ranks(ids, num_experts=16, world_size=4) == [32] * 4


def test_skips_of_every_point_fold_into_one_line() -> None:
    cfg = CommBenchConfig(tokens=(1, 16), iters=1)
    result = CommResult(cfg, 2, "cpu", None, skipped=[
        Skip("deepep_ht", 1, "ImportError: x"), Skip("deepep_ht", 16, "ImportError: x"),
        Skip("deepep_raw_ll", 16, "ValueError: too many"), Skip("naive_mono", None, "r")])
    assert folded_skips(result) == [Skip("deepep_ht", None, "ImportError: x"),
                                    Skip("deepep_raw_ll", 16, "ValueError: too many"),
                                    Skip("naive_mono", None, "r")]


# ------------------------------------------------------- layer 2: the command, 2 ranks
POINT_KEYS = {"backend", "tokens", "dispatch_us", "combine_us", "total_us",
              "host_dispatch_us", "host_combine_us", "host_total_us", "algbw_dispatch_gbps",
              "algbw_combine_gbps", "algbw_total_gbps", "algbw_ll_total_gbps",
              "sms_dispatch", "sms_combine"}


@pytest.mark.distributed
def test_command_end_to_end_on_two_gloo_ranks(tmp_path: Path, capfd: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo.cli.bench_comm import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(name, raising=False)  # not under torchrun: it spawns its ranks
    # No --backends: every engine is tried, and those that cannot run here are skipped
    # with their reason (a named one is refused before any rank starts). main() runs in
    # this process (the ranks it spawns import torch, this process has): capfd also sees
    # the ranks' stderr.
    code = main(["--hidden", "64", "--num-experts", "8", "--top-k", "2", "--tokens", "1,16",
                 "--iters", "2", "--warmup", "1", "--out", str(tmp_path)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    final = json.loads(lines[-1])
    assert final["bench"] == "comm" and final["world_size"] == 2
    assert final["regime"] == "CPU gloo" and final["functional"] is True
    assert final["cuda_graph"] is False and final["graph_layers"] is None
    assert final["shapes"] == {"hidden": 64, "top_k": 2, "num_experts": 8,
                               "dtype": "bfloat16", "routing": "random", "seed": 0}
    points = final["points"]
    ran = ("naive", "a2a", "a2a_ll")  # the engines of torch.distributed
    assert [(p["backend"], p["tokens"]) for p in points] == [(b, t) for b in ran
                                                             for t in (1, 16)]
    for p in points:
        assert set(p) == POINT_KEYS
        assert 0 < p["dispatch_us"] and 0 < p["combine_us"] and 0 < p["total_us"]
        assert p["host_dispatch_us"] > 0 and p["algbw_total_gbps"] > 0
        assert p["host_total_us"] > 0
        assert p["sms_dispatch"] is None and p["sms_combine"] is None  # GPU only
    skipped = {skip["backend"]: skip for skip in final["skipped"]}
    assert sorted(skipped) == sorted(set(bench_names()) - set(ran))
    assert all(skip["tokens"] is None for skip in skipped.values())  # the whole engine
    assert "runs NVSHMEM kernels on CUDA GPUs" in skipped["symm_mem"]["reason"]
    assert "dispatches router logits" in skipped["naive_mono"]["reason"]
    if importlib.util.find_spec("deep_ep") is None:  # not installed here
        assert ("backend 'deepep_raw_ht' needs DeepEP (deep_ep.Buffer), which is not "
                "installed") in skipped["deepep_raw_ht"]["reason"]
    table = "\n".join(lines[:-1])
    assert "regime=CPU gloo" in table and "functional check" in table
    assert "skipped deepep_raw_ht: rank 0: " in table
    assert sum(line.startswith(tuple(f"{b} " for b in ran)) for line in lines) == 6
    progress = [line for line in stderr.splitlines() if line.startswith("[bench-comm] ")]
    assert sum(": dispatch " in line for line in progress) == 6  # one line per point run
    for name in skipped:  # and its skip, per point or for the whole engine
        assert any(line.startswith(f"[bench-comm] {name}") and "skipped: " in line
                   for line in progress), name

    files = final["files"]
    assert Path(files["csv"]).name == "bench_comm_w2_cpu.csv"
    for kind in ("csv", "json", "png"):
        assert Path(files[kind]).stat().st_size > 0, kind
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["regime"] for r in rows} == {"CPU gloo"}
    doc = json.loads(Path(files["json"]).read_text())
    assert "algbw" in doc["definitions"] and "sms" in doc["definitions"]
    for p in doc["points"]:
        per_rank = p["per_rank"]
        assert len(per_rank["dispatch_us"]) == 2
        # Every backend at a point is credited with the same bytes (the routing's).
        assert per_rank["rank_bytes"] == [rows * 64 * 2 for rows in per_rank["rank_rows"]]
    by_point = {(p["backend"], p["tokens"]): p["per_rank"] for p in doc["points"]}
    assert by_point[("a2a", 16)]["rank_rows"] == by_point[("a2a_ll", 16)]["rank_rows"]
    # a2a_ll pads every peer's slot to the capacity (16): 2 x 16 rows delivered per rank.
    assert by_point[("a2a_ll", 16)]["rows_delivered"] == [32, 32]


class _RefusingSource:
    """A source whose engine refuses 16 tokens per rank at bind, as `deepep_ll` refuses a
    capacity beyond DeepEP's buffer limit (ValueError from the backend's constructor)."""

    name = "fake"

    def bind(self, x_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
             topk_ids_TK: torch.Tensor) -> object:
        if x_TH.shape[0] == 16:
            raise ValueError("backend 'deepep_ll': MoEConfig.max_tokens_per_rank=16 ... "
                             "needs a 40.0 GiB low-latency buffer, beyond DeepEP's 32 GiB")
        return _EchoEngine(x_TH)

    def close(self) -> None:
        pass


class _EchoEngine:
    def __init__(self, x_TH: torch.Tensor) -> None:
        self.x_TH = x_TH

    def dispatch(self) -> torch.Tensor:
        return self.x_TH.clone()

    def combine(self, state: torch.Tensor) -> torch.Tensor:
        return state + 0

    def rows_delivered(self, state: torch.Tensor) -> int:
        return int(state.shape[0])

    def graph_blocker(self) -> None:
        return None


def _sweep_with_a_refused_point(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import moe.bench.comm as comm

    comm.make_source = lambda name, shapes, group, tokens: _RefusingSource()  # this rank only
    cfg = CommBenchConfig(tokens=(1, 16, 4), hidden=8, top_k=2, num_experts=4, iters=2,
                          warmup=1, backends=("a2a_ll", "naive"))
    result = comm.run_comm_sweep(cfg, group=dist.group.WORLD, device=torch.device("cpu"))
    return {"points": [(p.backend, p.tokens) for p in result.points],
            "skipped": [(s.backend, s.tokens, s.reason) for s in result.skipped]}


@pytest.mark.distributed
def test_a_point_refused_at_bind_is_skipped_and_the_run_goes_on() -> None:
    from tests.dist_utils import run_distributed

    for out in run_distributed(2, _sweep_with_a_refused_point):
        assert out["points"] == [("a2a_ll", 1), ("a2a_ll", 4), ("naive", 1), ("naive", 4)]
        assert [(b, t) for b, t, _ in out["skipped"]] == [("a2a_ll", 16), ("naive", 16)]
        assert all(r.startswith("rank 0: ValueError: backend 'deepep_ll'") and
                   "beyond DeepEP's 32 GiB" in r for _, _, r in out["skipped"])
