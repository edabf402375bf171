"""Layer 1 (CPU): `Calibration.load` of malformed calibration files. Whatever a file holds,
loading it ends in one ValueError line naming the file, the field (a point by its index)
and what the field must be; never an AttributeError, TypeError, OverflowError or
RecursionError.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from dbo.calibration import Calibration

POINT = dict(tokens=64, decode=False, layers=2, attention=1.0, experts=2.0, dispatch=0.5,
             combine=0.5, measured_ms={"none": 4.0, "dbo": 3.5}, backend="a2a",
             regime="nvlink")
HUGE = 10 ** 400  # a JSON integer no float holds


def _file(tmp_path, *, point: dict[str, Any] | None = None, **top: Any):
    data = {**Calibration().to_json(), "points": [POINT, {**POINT, **(point or {})}], **top}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    return path


def test_a_good_file_with_points_loads(tmp_path):
    cal = Calibration.load(_file(tmp_path))
    assert len(cal.points) == 2 and cal.points[1].measured_ms == {"none": 4.0, "dbo": 3.5}


@pytest.mark.parametrize("change, field, must", [
    (dict(measured_ms=[1]), "points[1].measured_ms", "must be an object"),
    (dict(measured_ms={"dbo": "fast"}), "points[1].measured_ms['dbo']", "finite number"),
    (dict(measured_ms={"dbo": HUGE}), "points[1].measured_ms['dbo']", "finite number"),
    (dict(regime=["nvlink"]), "points[1].regime", "must be a string"),
    (dict(backend=7), "points[1].backend", "must be a string"),
    (dict(label=None), "points[1].label", "must be a string"),
    (dict(preset={"a": 1}), "points[1].preset", "must be a string"),
    (dict(mode=1.5), "points[1].mode", "must be a string"),
    (dict(tokens=HUGE), "points[1].tokens", "must be an int"),
    (dict(layers=2.0), "points[1].layers", "must be an int"),
    (dict(attention=HUGE), "points[1].attention", "finite number"),
    (dict(compute_scale=HUGE), "points[1].compute_scale", "finite number"),
    (dict(rows_per_expert=HUGE), "points[1].rows_per_expert", "finite number"),
    (dict(own_row_share=HUGE), "points[1].own_row_share", "[0, 1)"),
    (dict(sbo_groups=0), "points[1].sbo_groups", "must be an int >= 1"),
    (dict(sbo_groups=2.0), "points[1].sbo_groups", "must be an int >= 1"),
    (dict(sbo_groups=2, sbo_chunks=4), "points[1].sbo_groups",
     "must be 1 where sbo_chunks=4 (an SBO step chunks its combine by rows or by expert "
     "group, not both)"),
    (dict(tflops=1), "points[1]", "unknown keys ['tflops']"),
], ids=lambda v: str(v)[:30] if not isinstance(v, dict) else None)
def test_a_bad_point_is_named_by_index_and_field(tmp_path, change, field, must):
    path = _file(tmp_path, point=change)
    with pytest.raises(ValueError) as exc:
        Calibration.load(path)
    message = str(exc.value)
    assert message.startswith(f"calibration file {path}: ") and "\n" not in message, message
    assert f"{field}=" in message or f"{field}:" in message, message
    assert must in message, message
    assert "0" * 100 not in message, message  # a huge value is shown cut short


def test_a_points_sbo_form_round_trips(tmp_path):
    # Written by save, read back by load: the row chunks and the expert groups each.
    path = _file(tmp_path, point=dict(sbo_groups=4))
    cal = Calibration.load(path)
    assert [(p.sbo_chunks, p.sbo_groups) for p in cal.points] == [(1, 1), (1, 4)]
    cal.save(tmp_path / "again.json")
    assert Calibration.load(tmp_path / "again.json") == cal
    saved = json.loads((tmp_path / "again.json").read_text())["points"][1]
    assert saved["sbo_groups"] == 4 and saved["sbo_chunks"] == 1


def test_a_point_missing_a_field_is_named(tmp_path):
    point = {k: v for k, v in POINT.items() if k != "dispatch"}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**Calibration().to_json(), "points": [point]}))
    with pytest.raises(ValueError, match=r"cal.json: points\[0\]: missing keys \['dispatch'\]"):
        Calibration.load(path)


@pytest.mark.parametrize("top, field, must", [
    (dict(dense_tflops=HUGE), "dense_tflops", "finite number"),
    (dict(memory_gbs=HUGE), "memory_gbs", "finite number"),
    (dict(overlap_clock=HUGE), "overlap_clock", "(0, 1]"),
    (dict(persistent_min_rows=HUGE), "persistent_min_rows", "finite number"),
    (dict(gemm_efficiency=[[HUGE, 0.5]]), "gemm_efficiency", "> 0"),
    (dict(gemm_efficiency=[[16, HUGE]]), "gemm_efficiency", "(0, 1]"),
    (dict(regimes={"ib": {"bandwidth_gbs": HUGE, "latency_us": 1}}),
     "regimes['ib'].bandwidth_gbs", "finite number"),
    (dict(regimes={"ib": {"bandwidth_gbs": 1, "latency_us": HUGE}}),
     "regimes['ib'].latency_us", "finite number"),
    (dict(device=5), "device", "must be a string"),
    (dict(torch_version=["2.9"]), "torch_version", "must be a string"),
    (dict(date=None), "date", "must be a string"),
    (dict(points={"a": 1}), "points", "must be a list of objects"),
], ids=lambda v: None)
def test_a_bad_top_level_field_is_named(tmp_path, top, field, must):
    path = _file(tmp_path, **top)
    with pytest.raises(ValueError) as exc:
        Calibration.load(path)
    message = str(exc.value)
    assert message.startswith(f"calibration file {path}: ") and "\n" not in message, message
    assert field in message and must in message, message
    assert "0" * 100 not in message, message


@pytest.mark.parametrize("text, must", [
    ('{"points": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("[1, 2]", "must be an object"),
], ids=["deep", "list"])
def test_an_unreadable_file_is_named(tmp_path, text, must):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        Calibration.load(path)
    message = str(exc.value)
    assert message.startswith(f"calibration file {path}: ") and must in message, message


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "cal.json"
    path.write_bytes(b'{"device": "\xff\xfe"}')
    with pytest.raises(ValueError, match="cal.json: not UTF-8"):
        Calibration.load(path)
