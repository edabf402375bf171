"""The expert benchmark's baselines and diagnostic routing (layer 1 on CPU; the CLI's
interpreted run is layer 3): `moe.bench.baselines` (the dense chain, the balanced batched
chain `bmm`) and `moe.bench.experts --routing balanced`.
"""
from __future__ import annotations

import json

import pytest
import torch

from moe.bench import experts as bench_experts
from moe.bench import problems
from moe.bench.baselines import BASELINES, batched_chain, dense_chain, gemm_flops

HIDDEN, INTER, EXPERTS = 24, 10, 4


def _operands(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, dtype=torch.float64)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, dtype=torch.float64)
    return x, w13, w2


def test_dense_chain_is_one_experts_gemms_over_the_routed_rows() -> None:
    x, w13, w2 = _operands(5)
    chain = dense_chain(x, w13, w2, rows=12)  # top-k copies of each token, in place
    a = x.repeat_interleave(3, dim=0)[:12]
    want = (a @ w13[0].t())[:, :INTER] @ w2[0].t()
    torch.testing.assert_close(chain.fn(), want)
    assert chain.flops == gemm_flops(12, HIDDEN, INTER, 1) == 2.0 * 12 * 3 * HIDDEN * INTER
    weights = w13[0].numel() + w2[0].numel()
    assert chain.min_gb == pytest.approx((12 * HIDDEN + weights + 12 * (2 * INTER + HIDDEN))
                                         * 8 / 1e9)
    assert "one expert's weights" in chain.note


def test_batched_chain_runs_every_expert_on_its_own_weights() -> None:
    """10 rows over 4 experts: 3 rows each (rounded up), FLOPs and note counting 12."""
    x, w13, w2 = _operands(4, seed=1)
    chain = batched_chain(x, w13, w2, rows=10)
    a = x.repeat_interleave(3, dim=0)[:12].view(EXPERTS, 3, HIDDEN)
    got = chain.fn()
    assert got.shape == (EXPERTS, 3, HIDDEN)
    for e in range(EXPERTS):
        torch.testing.assert_close(got[e], (a[e] @ w13[e].t())[:, :INTER] @ w2[e].t())
    assert chain.flops == gemm_flops(12, HIDDEN, INTER, 1)
    elems = a.numel() + w13.numel() + w2.numel() + 12 * (2 * INTER + HIDDEN)
    assert chain.min_gb == pytest.approx(elems * 8 / 1e9)
    assert chain.note == "ceiling: 3 rows x 4 experts, no routing"
    assert set(BASELINES) == {"dense", "bmm"} and BASELINES["bmm"] is batched_chain


def test_balanced_ids() -> None:
    """Distinct experts per token, every expert within one row of T*K/E; top-k over the
    experts is an error."""
    ids = problems.balanced_ids(37, 3, 8, torch.device("cpu"))
    assert ids.shape == (37, 3) and ids.dtype == torch.int64
    assert all(len(set(row.tolist())) == 3 for row in ids)
    counts = torch.bincount(ids.view(-1), minlength=8)
    assert counts.sum() == 111 and counts.max() - counts.min() <= 1
    exact = torch.bincount(problems.balanced_ids(16, 2, 4, torch.device("cpu")).view(-1))
    assert exact.tolist() == [8, 8, 8, 8]
    with pytest.raises(ValueError, match="top-k <= experts"):
        problems.balanced_ids(4, 5, 4, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x, weights, ids = bench_experts.random_tokens("tiny", 10, torch.float32, gen,
                                                  routing="balanced")
    assert torch.equal(ids, problems.balanced_ids(10, 2, 4, torch.device("cpu")))
    torch.testing.assert_close(weights.sum(1), torch.ones(10))
    with pytest.raises(ValueError, match="one rank"):
        bench_experts.random_tokens("tiny", 10, torch.float32, gen, ep_ranks=2,
                                    routing="balanced")


def test_plot_draws_bmm_as_a_baseline(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Baselines are told apart from the expert paths: `bmm` and dense dashed, the expert
    paths solid, one colour per path; `bmm` has its rate and its share of dense, dense
    no share line."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from moe.bench import experts_plot as bench_experts_plot

    drawn: list[tuple[str, str, str]] = []
    plot = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), kwargs.get("color"), kwargs.get("ls")))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    point = bench_experts.Point
    points = [point("tiny", t, path, 1.0, rate, None, 0.1, vs_dense=share)
              for t in (64, 4096)
              for path, rate, share in (("triton", 50.0, 0.5), ("dense", 100.0, None),
                                        ("bmm", 70.0, 0.7))]
    assert bench_experts_plot.plot_experts(points, tmp_path / "e.png", title="t")
    assert (tmp_path / "e.png").read_bytes().startswith(b"\x89PNG")
    lines: dict[str, list[tuple[str, str]]] = {}
    for label, colour, ls in drawn:
        lines.setdefault(label, []).append((colour, ls))
    assert {label: len(styles) for label, styles in lines.items()} == {
        "triton": 2, "dense": 1, "bmm": 2}  # rate, share of dense (none for dense itself)
    styles = {label: set(styles) for label, styles in lines.items()}
    assert all(len(style) == 1 for style in styles.values()), "one style per path"
    (triton,), (dense,), (bmm,) = styles["triton"], styles["dense"], styles["bmm"]
    assert triton[1] == "-" and dense[1] == bmm[1] == "--"
    assert len({triton[0], dense[0], bmm[0]}) == 3 and None not in (dense[0], bmm[0])


@pytest.mark.triton
def test_bench_cli_balanced_routing_and_bmm(capsys: pytest.CaptureFixture[str]) -> None:
    """`--routing balanced` is refused with EP; on CPU (interpreted) the table says it,
    the JSON records it, and `bmm` is timed against its own FLOPs beside dense."""
    with pytest.raises(SystemExit):
        bench_experts.main(["--routing", "balanced", "--ep-ranks", "2", "--dry-run"])
    assert "--routing balanced is one rank's routing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_experts.main(["--routing", "skewed", "--dry-run"])
    capsys.readouterr()
    if torch.cuda.is_available():
        return  # the interpreted run below is the CPU path
    argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "5", "--rounds", "1",
            "--paths", "triton,reference,dense,bmm", "--routing", "balanced"]
    assert bench_experts.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("balanced routing")
    record = json.loads(out[-1])
    assert record["routing"] == "balanced"
    points = {p["path"]: p for p in record["points"]}
    assert points["triton"]["err"] < 1e-2
    hidden, inter, top_k, experts = bench_experts.SHAPES["tiny"]
    # 10 routed rows over 4 experts: bmm computes 3 rows each and counts those.
    bmm = points["bmm"]
    assert bmm["tflops"] == pytest.approx(gemm_flops(12, hidden, inter, 1) / bmm["ms"] / 1e9)
    assert bmm["vs_dense"] == pytest.approx(bmm["tflops"] / points["dense"]["tflops"])
    assert bmm["note"] == "ceiling: 3 rows x 4 experts, no routing"
    assert points["dense"]["tflops"] == pytest.approx(
        gemm_flops(5 * top_k, hidden, inter, 1) / points["dense"]["ms"] / 1e9)
