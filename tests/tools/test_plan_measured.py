"""Layer 1 (CPU, in process): `dbo plan --calibration FILE` rescales its roofline phase
times by a calibration's measured points (`dbo.cli.plan_measured`): synthetic points
whose phases are chosen multiples of the roofline at their own shape, the ratios,
their interpolation, what stays roofline, and the plan end to end."""
from __future__ import annotations

import dataclasses
import json

import pytest

from dbo import cli
from dbo.calibration import Calibration, MeasuredPoint
from dbo.cli.plan_measured import measured_scale
from dbo.cli.plan_model import Cluster, step_inputs
from dbo.cost_model import PhaseTimes
from moe.models.presets import get_preset

CAL = Calibration()
MODEL = get_preset("tiny")  # 8 experts, top-2, one shared expert, H 64
# The ratios measured / roofline each synthetic point is built with, per token count.
RATIOS = {64: dict(attention=3.0, shared=1.0, experts=2.0, dispatch=1.5, combine=1.5),
          256: dict(attention=3.0, shared=1.0, experts=4.0, dispatch=0.5, combine=0.5)}


def roofline(tokens: int, *, world: int = 2, experts: int = 8, context: int = 128
             ) -> PhaseTimes:
    link = CAL.regime("nvlink")
    cluster = Cluster(gpus_per_node=world, ep_size=world, intra_gbs=link.bandwidth_gbs,
                      intra_latency_us=link.latency_us, inter_gbs=link.bandwidth_gbs,
                      inter_latency_us=link.latency_us)
    model = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, num_experts=experts))
    times, _ = step_inputs(model, cluster, CAL, tokens=tokens, decode=True,
                           context_len=context, layers=2, fp8_dispatch=False,
                           kernels_per_layer=0)
    return times


def measured(tokens: int, *, backend: str = "a2a", mode: str = "decode") -> MeasuredPoint:
    roof = roofline(tokens)
    phases = {k: getattr(roof, k) * r for k, r in RATIOS[tokens].items()}
    return MeasuredPoint(tokens=tokens, decode=True, layers=2, backend=backend, preset="tiny",
                         mode=mode, num_experts=8, world_size=2, regime="nvlink", context=128,
                         **phases)


def test_ratios_interpolated_and_held_flat_outside():
    cal = dataclasses.replace(CAL, points=(measured(64), measured(256)))
    scale = measured_scale(cal, MODEL, "tiny", decode=True, backend=None, context_len=4096)
    assert scale.ratio("experts", 64) == pytest.approx(2.0)
    assert scale.ratio("experts", 160) == pytest.approx(3.0)   # halfway: (2 + 4) / 2
    assert scale.ratio("experts", 16) == pytest.approx(2.0)    # below: the nearest, flat
    assert scale.ratio("experts", 4096) == pytest.approx(4.0)
    assert scale.ratio("dispatch", 160) == pytest.approx(1.0)
    assert scale.ratio("attention", 1000) == pytest.approx(3.0)
    plan = PhaseTimes(attention=1.0, shared=1.0, experts=1.0, dispatch=1.0, combine=1.0)
    same_link = scale.apply(plan, tokens=160, comm_regime="nvlink")
    assert (same_link.attention, same_link.shared, same_link.experts, same_link.dispatch,
            same_link.combine) == pytest.approx((3.0, 1.0, 3.0, 1.0, 1.0))
    other_link = scale.apply(plan, tokens=64, comm_regime="scale_out")
    assert (other_link.experts, other_link.dispatch) == pytest.approx((2.0, 1.0))
    line = scale.describe("scale_out")
    assert "experts x2@64, x4@256" in line and "attention x3@64, x3@256" in line
    assert "dispatch (points crossed nvlink, the plan's comm is bound by scale_out)" in line


def test_layer_points_keep_the_roofline_attention_serve_both_phases_and_other_presets_are_ignored():
    cal = dataclasses.replace(CAL, points=(measured(64, mode="layer"),))
    scale = measured_scale(cal, MODEL, "tiny", decode=True, backend=None, context_len=4096)
    assert scale.ratio("attention", 64) is None and scale.ratio("experts", 64) == pytest.approx(2.0)
    assert "roofline: attention" in scale.describe("nvlink")
    assert measured_scale(cal, MODEL, "mixtral-like", decode=True, backend=None,
                          context_len=4096) is None
    # Its MoE phases serve the prefill plan too (they depend on the tokens alone); a
    # decode-mode point serves only decode.
    prefill = measured_scale(cal, MODEL, "tiny", decode=False, backend=None, context_len=4096)
    assert prefill is not None and prefill.ratio("experts", 64) == pytest.approx(2.0)
    assert measured_scale(dataclasses.replace(CAL, points=(measured(64),)), MODEL, "tiny",
                          decode=False, backend=None, context_len=4096) is None
    unknown = dataclasses.replace(measured(64), preset="", num_experts=0, world_size=0)
    assert measured_scale(dataclasses.replace(CAL, points=(unknown,)), MODEL, "tiny",
                          decode=True, backend=None, context_len=4096) is None


def test_several_backends_need_one_picked():
    cal = dataclasses.replace(CAL, points=(measured(64), measured(64, backend="naive")))
    with pytest.raises(ValueError, match="--backend NAME"):
        measured_scale(cal, MODEL, "tiny", decode=True, backend=None, context_len=4096)
    scale = measured_scale(cal, MODEL, "tiny", decode=True, backend="naive", context_len=4096)
    assert scale.source.startswith("naive decode points at [64]")


def test_plan_prints_and_predicts_from_the_rescaled_phases(tmp_path, capsys):
    path = tmp_path / "cal.json"
    dataclasses.replace(CAL, points=(measured(64), measured(256))).save(path)
    args = ["plan", "--preset", "tiny", "--layers", "2", "--ep", "2", "--gpus-per-node", "2",
            "--requests", "160", "--sweep", "64", "--context-len", "128", "--cuda-graph",
            "--calibration", str(path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "phase times: measured rescale (a2a decode points at [64, 256] tokens" in out
    result = json.loads(out.strip().splitlines()[-1])
    decode = result["phases"][0]
    # One node of 2 on nvlink, the points' link: every phase rescaled. At 160 requests:
    # attention x3, shared x1, experts x3 (halfway), dispatch and combine x1; no overlap
    # is their sum (graphed: no launch floor).
    roof = roofline(160)
    none = (3 * roof.attention + roof.shared + 3 * roof.experts + roof.dispatch + roof.combine)
    assert decode["point"]["times_ms"]["none"] == pytest.approx(none, abs=1e-4)
    assert decode["phase_times"].startswith("measured rescale")
    assert cli.main([a for a in args if a not in ("--calibration", str(path))]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["phases"][0]
    assert plain["point"]["times_ms"]["none"] == pytest.approx(
        roof.attention + roof.shared + roof.experts + roof.dispatch + roof.combine, abs=1e-4)


def test_plan_with_several_backends_and_no_backend_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "cal.json"
    dataclasses.replace(CAL, points=(measured(64), measured(64, backend="naive"))).save(path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--preset", "tiny", "--ep", "2", "--requests", "64",
                  "--calibration", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo plan: ") and err.count("\n") == 1, err
    assert ("--calibration holds decode points of tiny for backends ['a2a', 'naive']: pick "
            "one with --backend NAME") in err
