"""Layer 1 (CPU, in process): `dbo plan` end to end (table, thresholds, the losing
regime, plot file, final JSON line, every output labelled a prediction), its phase
times from a model shape (`dbo.cli.plan_model`) and its argument errors (one line,
exit code 2)."""
from __future__ import annotations

import json

import pytest

from dbo import cli
from dbo.calibration import Calibration
from dbo.cost_model import predict
from dbo.cli.plan_model import Cluster, step_inputs
from moe.models.presets import get_preset

HEADLINE = ["plan", "--preset", "deepseek-v3-like", "--layers", "58", "--gpus-per-node", "8",
            "--ep", "96", "--redundant-experts", "32", "--inter-gbs", "50", "--fp8-dispatch",
            "--cuda-graph",
            "--sweep", "16,256,1024"]


def run_plan(args: list[str], capsys) -> tuple[str, dict]:
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_plan_end_to_end_with_plot_and_json(tmp_path, capsys):
    out, result = run_plan([*HEADLINE, "--tokens", "4096", "--requests", "256",
                            "--out", str(tmp_path)], capsys)
    assert result["plan"] == "prediction"
    assert [p["phase"] for p in result["phases"]] == ["prefill", "decode"]
    assert (tmp_path / "plan.png").stat().st_size > 0 and result["plot"].endswith("plan.png")
    prefill = result["phases"][0]
    assert [r["tokens"] for r in prefill["sweep"]] == [16, 256, 1024, 4096]
    assert prefill["point"]["tokens"] == 4096
    # Weight-bound at 16 tokens (splitting reads the experts twice), comm to hide at 4096.
    assert 16 in prefill["overlap_loses_at"]
    assert prefill["point"]["chosen"] == "dbo"
    assert prefill["thresholds"]["dbo"] in (256, 1024)
    for line in out.splitlines():
        if "gain" in line or "wins" in line or "plot" in line:
            assert "prediction" in line or line.lstrip().startswith("tokens"), line
    assert out.count("prediction, ") == 2


def test_plan_without_a_point_plans_prefill_4096(capsys):
    _, result = run_plan(["plan", "--preset", "tiny", "--ep", "2", "--sweep", "16"], capsys)
    assert [(p["phase"], p["point"]["tokens"]) for p in result["phases"]] == [("prefill", 4096)]
    assert result["plot"] is None


def test_plan_reads_a_calibration_file(tmp_path, capsys):
    slow = Calibration(memory_gbs=10.0)  # every weight read dominates: DBO never pays
    slow.save(tmp_path / "cal.json")
    args = [*HEADLINE, "--tokens", "1024", "--calibration", str(tmp_path / "cal.json")]
    _, result = run_plan(args, capsys)
    assert result["calibration"].endswith("cal.json")
    assert result["phases"][0]["point"]["gains"]["dbo"] < 0


def test_step_inputs_comm_grows_with_nodes_and_shrinks_with_bandwidth():
    model, cal = get_preset("deepseek-v3-like"), Calibration()

    def dispatch(ep: int, inter: float) -> float:
        cluster = Cluster(gpus_per_node=8, ep_size=ep, intra_gbs=400, intra_latency_us=0,
                          inter_gbs=inter, inter_latency_us=0)
        times, _ = step_inputs(model, cluster, cal, tokens=1024, decode=False, context_len=4096,
                               layers=1, fp8_dispatch=False, kernels_per_layer=0,
                               redundant_experts=-256 % ep)  # 96: 32 (288 = 3 x 96)
        return times.dispatch

    one_node, many = dispatch(8, 50), dispatch(96, 50)
    assert many > 5 * one_node
    assert dispatch(96, 100) == pytest.approx(many / 2)
    # One node: 1024 tokens x (8 experts over 8 ranks: 5.25 distinct, 4.59 others) x
    # 7168 x 2 bytes at 400 GB/s.
    assert one_node == pytest.approx(1024 * 8 * (1 - (7 / 8) ** 8) * 7 / 8 * 7168 * 2 / 400e6)


def test_sbo_groups_reach_the_prediction(capsys):
    # The plan's SBO column with --sbo-groups 2 is the cost model's grouped term on the
    # same roofline inputs; none and DBO do not move.
    _, one = run_plan([*HEADLINE, "--tokens", "4096"], capsys)
    out, grouped = run_plan([*HEADLINE, "--tokens", "4096", "--sbo-groups", "2"], capsys)
    assert (grouped["sbo_chunks"], grouped["sbo_groups"]) == (1, 2)
    assert (one["sbo_chunks"], one["sbo_groups"]) == (1, 1)
    assert "sbo: combine by 2 expert groups, each under the next group's experts" in out
    model, cal = get_preset("deepseek-v3-like"), Calibration()
    cluster = Cluster(**grouped["cluster"])
    for a, b in zip(one["phases"][0]["sweep"], grouped["phases"][0]["sweep"]):
        times, shape = step_inputs(model, cluster, cal, tokens=b["tokens"], decode=False,
                                   context_len=4096, layers=58, fp8_dispatch=True,
                                   kernels_per_layer=0, redundant_experts=32)
        expected = predict(times, shape, cal, sbo_groups=2).times_ms
        # The JSON rounds to 4 decimals.
        assert b["times_ms"]["sbo"] == pytest.approx(expected["sbo"], abs=1e-4)
        assert b["times_ms"]["none"] == a["times_ms"]["none"]
        assert b["times_ms"]["dbo"] == a["times_ms"]["dbo"]
    # At 16 tokens the experts are weight-bound: the default SBO step's own-rows pass
    # reads all the weights again, the groups read each expert's once.
    first_one, first_grouped = one["phases"][0]["sweep"][0], grouped["phases"][0]["sweep"][0]
    assert first_grouped["tokens"] == 16
    assert first_grouped["times_ms"]["sbo"] < first_one["times_ms"]["sbo"]


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dbo plan ")
    assert "(default: deepseek-v3-like)" in out and "(default: 0.01)" in out


@pytest.mark.parametrize("args, words", [
    (["--ep", "0"], "argument --ep: '0': must be an int >= 1"),
    (["--ep", "512"], "more ranks than the model's 256 experts"),
    (["--ep", "3"], "--ep 3: 256 experts do not split over 3 ranks (each rank holds the same "
                    "number): use an EP size that divides 256 (e.g. 2 or 4), or hold "
                    "redundant experts as DeepSeek's deployment does: --redundant-experts 2 "
                    "(258 = 86 x 3)"),
    (["--ep", "96", "--redundant-experts", "16"], "--ep 96: 256 experts + 16 redundant do not "
                                                  "split over 96 ranks"),
    (["--redundant-experts", "-1"], "argument --redundant-experts: '-1': must be an int >= 0"),
    (["--backend", "bogus"], "argument --backend: invalid choice: 'bogus' (choose from 'a2a', "
                             "'a2a_ll', "),
    (["--backend", "a2a"], "--backend a2a picks the --calibration file's measured points of "
                           "that backend, and there is no --calibration"),
    (["--sbo-groups", "0"], "argument --sbo-groups: '0': must be an int >= 1"),
    (["--sbo-groups", "2", "--sbo-chunks", "4"], "--sbo-chunks 4 and --sbo-groups 2: SBO "
                                                 "chunks its combine by rows or by expert "
                                                 "group, not both: drop one"),
    (["--sweep", "a,b"], "argument --sweep: 'a,b': give tokens per rank >= 1"),
    (["--sweep", "0,16"], "argument --sweep: '0,16': give tokens per rank >= 1"),
    (["--margin", "2"], "--margin 2.0"),
    (["--inter-gbs", "0"], "--inter-gbs"),
    (["--calibration", "/nonexistent/cal.json"], "calibration file"),
    (["--preset", "nope"], "--preset"),
])
def test_argument_errors_are_one_line_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--sweep", "16", *args] if args[0] != "--sweep" else ["plan", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo plan: ") and words in err and err.count("\n") == 1, err


def test_thresholds_read_as_words_where_a_mode_never_wins(capsys):
    # EP 2 of the tiny preset on one node: overlap never pays at these sizes.
    out, result = run_plan(["plan", "--preset", "tiny", "--ep", "2", "--sweep", "16,64"], capsys)
    assert result["phases"][0]["thresholds"] == {"dbo": None, "sbo": None, "joined": None}
    assert "prediction: DBO wins at no point of the sweep; SBO wins at no point of the sweep" \
        in out
    assert "None" not in out.rsplit("\n", 2)[0]  # the table and lines, not the JSON
    out, result = run_plan(HEADLINE, capsys)
    assert f"DBO wins from {result['phases'][0]['thresholds']['dbo']} tokens" in out


def test_joined_experts_are_offered_with_the_flag(capsys):
    # DeepSeek-V3 decode on 16 ranks (2 nodes): the table has the joined columns either way; with
    # --joined-experts the split mode chosen from (and named in the thresholds line) is
    # joined, and the chosen mode is never plain "dbo".
    argv = ["plan", "--ep", "16", "--requests", "128", "--sweep", "32,512,4096"]
    out, plain = run_plan(argv, capsys)
    assert "joined ms" in out and "DBO wins" in out and "JOINED wins" not in out
    out, joined = run_plan(argv + ["--joined-experts"], capsys)
    assert "JOINED wins" in out and "DBO wins" not in out
    rows = joined["phases"][0]["sweep"]
    assert {r["chosen"] for r in rows} <= {"joined", "sbo", "none"}
    # the same predicted times: only the choice differs
    assert [r["times_ms"] for r in rows] == [r["times_ms"] for r in plain["phases"][0]["sweep"]]


def test_redundant_experts_split_the_experts_evenly():
    from dbo.cli.plan_model import check_expert_split

    check_expert_split(256, 8)
    check_expert_split(256, 96, redundant=32)  # 288 = 3 x 96
    with pytest.raises(ValueError, match="--redundant-experts 32 \\(288 = 3 x 96\\)"):
        check_expert_split(256, 96)
    # Each rank holds 3 experts instead of 256 / 96: more weight to read per rank.
    model, cal = get_preset("deepseek-v3-like"), Calibration()
    cluster = Cluster(gpus_per_node=8, ep_size=96, intra_gbs=400, intra_latency_us=0,
                      inter_gbs=50, inter_latency_us=0)
    _, even = step_inputs(model, cluster, cal, tokens=16, decode=True, context_len=4096,
                          layers=1, fp8_dispatch=False, kernels_per_layer=0,
                          redundant_experts=32)
    assert even.rows_per_expert == pytest.approx(16 * 8 / 3)


def test_out_that_is_a_file_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--sweep", "16", "--out", str(tmp_path / "f")])
    assert exc.value.code == 2
    assert "existing file" in capsys.readouterr().err
