"""The expert benchmark and tile tuner's command lines (layer 4 tools, run on the Triton
interpreter on CPU): `python -m moe.bench.experts` (planning, the no-CUDA exit, tiny
interpreted runs, EP routing, the outputs, sustained load, clocks, the profile window)
and `python -m moe.bench.tune` (candidates, argument errors).
"""
from __future__ import annotations

import pytest
import torch

from tests.moe.triton_problems import DEVICE, needs_triton  # noqa: F401 (fixture)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("needs_triton")]


def test_bench_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark's CPU side: planning, the no-CUDA exit, and a tiny interpreted run."""
    import json

    from moe.bench import experts as bench_experts

    argv = ["--dry-run", "--shapes", "ds-e8,qwen-e128", "--tokens", "64,4096"]
    assert bench_experts.main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 * 2 * len(bench_experts.PATHS)
    if not torch.cuda.is_available():
        assert bench_experts.main(["--shapes", "tiny", "--tokens", "4"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    if DEVICE.type == "cpu":
        argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "5", "--rounds", "1"]
        argv += ["--paths", "triton,reference"]
        assert bench_experts.main(argv) == 0
        record = json.loads(capsys.readouterr().out.splitlines()[-1])
        triton_point = next(p for p in record["points"] if p["path"] == "triton")
        assert triton_point["err"] < 1e-2 and triton_point["tokens"] == 5


def test_bench_profile_window(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--profile-window`: one more call per path after the rounds, alone between
    cudaProfilerStart and Stop (stopped even when the call fails); CUDA only."""
    from moe.bench import experts as bench_experts

    with pytest.raises(SystemExit):
        bench_experts.main(["--profile-window", "--device", "cpu", "--dry-run"])
    assert "--profile-window needs --device cuda" in capsys.readouterr().err

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    bench_experts.profile_one_call(lambda: events.append("call"), DEVICE, "a point")
    assert events == ["sync", "start", "call", "sync", "stop"]
    assert "profile window: a point" in capsys.readouterr().err

    def fail() -> None:
        raise RuntimeError("kernel failed")

    events.clear()
    with pytest.raises(RuntimeError, match="kernel failed"):
        bench_experts.profile_one_call(fail, DEVICE, "a point")
    assert events == ["sync", "start", "stop"]

    if DEVICE.type == "cpu":  # the wiring: one window per path that ran, after its rounds
        # (the same for every path: reference and dense, not the interpreted triton's
        # seconds; test_bench_cli and test_bench_ep_routing run that one)
        monkeypatch.undo()
        windows: list[str] = []
        monkeypatch.setattr(bench_experts, "profile_one_call",
                            lambda fn, device, label: windows.append(label) or fn())
        args = bench_experts.parse_args(["--device", "cpu", "--shapes", "tiny", "--tokens",
                                         "4", "--paths", "reference,dense", "--rounds", "1"])
        args.profile_window = True
        points = bench_experts.bench_shape("tiny", args, DEVICE, 2, [0])
        assert [p.path for p in points] == ["reference", "dense"]
        assert [w.split(":")[0] for w in windows] == ["tiny T=4 reference", "tiny T=4 dense"]
        assert all("GB, x " in w for w in windows)


def test_bench_ep_routing(capsys: pytest.CaptureFixture[str]) -> None:
    """`--ep-ranks W`: one rank's view of EP routing (ids of other ranks -1, every token
    with a local expert), FLOPs over the local rows; a bad W is a usage error."""
    import json

    from moe.bench import experts as bench_experts

    ids_1 = bench_experts.random_tokens("tiny", 200, torch.float32,
                                        torch.Generator().manual_seed(0))[2]
    gen = torch.Generator().manual_seed(0)
    x, weights, ids = bench_experts.random_tokens("tiny", 200, torch.float32, gen, ep_ranks=4)
    num_experts = bench_experts.SHAPES["tiny"][3]
    assert ((ids >= -1) & (ids < num_experts)).all() and (ids_1 >= 0).all()
    assert (ids >= 0).any(dim=1).all(), "every received token has a local expert"
    assert (ids == -1).any(), "ids of the other ranks' experts arrive as -1"
    torch.testing.assert_close(weights.sum(1), torch.ones(200))
    with pytest.raises(SystemExit):
        bench_experts.main(["--ep-ranks", "0", "--dry-run"])
    with pytest.raises(SystemExit):
        bench_experts.main(["--rounds", "0", "--dry-run"])
    if DEVICE.type == "cpu":
        argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "6", "--ep-ranks", "2",
                "--paths", "triton,reference,dense", "--rounds", "1"]
        assert bench_experts.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("one rank of 2 under EP")
        record = json.loads(out[-1])
        assert record["ep_ranks"] == 2
        points = {p["path"]: p for p in record["points"]}
        assert points["triton"]["err"] < 1e-2
        # "of dense": each path's rate over the dense chain's at the same point.
        for path in ("triton", "reference"):
            assert points[path]["vs_dense"] == pytest.approx(
                points[path]["tflops"] / points["dense"]["tflops"])
        assert points["dense"]["vs_dense"] is None and "of dense" in out[1]


def test_bench_writes_table_json_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out`: the table, the JSON record and a PNG of every timed point; `--no-plot`
    leaves the PNG out; a plot of points without times is not drawn."""
    import json

    pytest.importorskip("matplotlib")
    from moe.bench import experts as bench_experts
    from moe.bench.experts_plot import plot_experts

    if DEVICE.type != "cpu":
        pytest.skip("the interpreted smoke run is the CPU path")
    # Any path writes them alike: reference, not the interpreted triton's seconds.
    argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4,8",
            "--paths", "reference,dense", "--rounds", "1", "--out", str(tmp_path / "a")]
    assert bench_experts.main(argv) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert json.loads((tmp_path / "a" / "experts.json").read_text())["points"] == record["points"]
    assert "of dense" in (tmp_path / "a" / "experts.txt").read_text()
    png = (tmp_path / "a" / "experts.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    no_plot = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4", "--paths", "dense",
               "--rounds", "1", "--out", str(tmp_path / "b"), "--no-plot"]
    assert bench_experts.main(no_plot) == 0
    assert (tmp_path / "b" / "experts.json").exists()
    assert not (tmp_path / "b" / "experts.png").exists()
    failed = bench_experts.Point("tiny", 4, "triton", None, None, None, 0.1, note="failed")
    assert not plot_experts([failed], tmp_path / "c.png", title="t")
    assert not (tmp_path / "c.png").exists()


def test_bench_sustain(capsys: pytest.CaptureFixture[str]) -> None:
    """`--sustain S` loads each path for S seconds before each timed round; the table
    and JSON carry the clock columns ('-' / null where no clock can be read)."""
    import json
    import time

    from moe.bench import experts as bench_experts

    calls = []
    start = time.perf_counter()
    assert bench_experts.sustain(lambda: calls.append(1), torch.device("cpu"), 0.05) == len(calls)
    assert len(calls) >= 4 and time.perf_counter() - start >= 0.05
    assert bench_experts.sustain(lambda: calls.append(1), torch.device("cpu"), 0.0) == 0
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            bench_experts.main(["--sustain", bad, "--dry-run"])
    capsys.readouterr()
    if DEVICE.type == "cpu":
        # Paths without the interpreter: sustain calls a path at least 4 times a round.
        argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4", "--paths",
                "reference,dense", "--rounds", "1", "--sustain", "0.02"]
        assert bench_experts.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        assert "SM MHz" in out[0] and "capped" in out[0]
        record = json.loads(out[-1])
        assert record["sustain_s"] == 0.02
        for point in record["points"]:
            assert point["ms"] > 0 and point["sm_mhz"] is None and point["capped"] == ""


def test_bench_clock_fields() -> None:
    """A point's clock: the median over the rounds that were read, and the capped count."""
    from moe.bench.experts import clock_fields
    from moe.bench.gpu_clocks import ClockSample

    samples = [ClockSample(1500, 690.0, True), None, ClockSample(1900, 300.0, False),
               ClockSample(1400, 700.0, True)]
    assert clock_fields(samples) == {"sm_mhz": 1500, "capped": "2/3"}
    assert clock_fields([None, None]) == {}


def test_tune_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """The tile sweep's CPU side: the candidate list, argument errors, the no-CUDA exit."""
    from moe.bench import tune as tune_experts

    assert tune_experts.main(["--dry-run", "--shapes", "ds-e8,qwen-e128", "--block-m", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 2 and all("tiles:" in line for line in lines)
    # Every listed tile fits the register budget (GEMM1 holds two fp32 accumulators).
    gemm1 = tune_experts.candidate_tiles(64, gated=True, n=2048, k=7168)
    assert gemm1 and all(t.block_n * 64 * 2 // (t.num_warps * 32) <= 128 for t in gemm1)
    assert any(t.block_n == 256 for t in tune_experts.candidate_tiles(64, gated=False, n=7168,
                                                                        k=2048))
    for bad in (["--block-m", "48"], ["--shapes", "nope"], ["--tokens", "x"],
                ["--block-k", "24"], ["--variants", "tma,fast"]):
        with pytest.raises(SystemExit):
            tune_experts.main(bad)
    if not torch.cuda.is_available():
        assert tune_experts.main(["--shapes", "tiny", "--tokens", "4"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
