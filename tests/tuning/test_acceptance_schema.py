"""The redwood.acceptance/1 record: validation, JSON I/O, legacy conversion."""

from __future__ import annotations

import json

import pytest

from redwood.errors import ConfigError
from redwood.tuning.acceptance import (
    FORMAT,
    AcceptanceVector,
    acceptance_from_legacy,
    load_acceptance,
    save_acceptance,
)


def _record(**over):
    d = {
        "format": FORMAT,
        "models": {"target": "t", "draft": "d"},
        "method": "dynamic",
        "width": 3,
        "temperature": 0.6,
        "top_p": 1.0,
        "dataset": "c4",
        "samples": 100,
        "values": [0.5, 0.2, 0.1],
        "p_none": 0.2,
    }
    d.update(over)
    return d


def test_round_trip(tmp_path):
    vec = AcceptanceVector.from_dict(_record(per_depth=[[0.6, 0.2, 0.1], [0.4, 0.2, 0.1]], notes={"k": 1}))
    assert vec.width == 3 and vec.values == (0.5, 0.2, 0.1) and vec.p_none == 0.2
    path = save_acceptance(vec, tmp_path / "a" / "v.json")
    back = load_acceptance(path)
    assert back == vec
    assert back.models == {"target": "t", "draft": "d"} and back.notes == {"k": 1}
    d = json.loads(path.read_text())
    assert d["format"] == FORMAT and d["width"] == 3 and d["p_none"] == 0.2
    assert d["per_depth"][1] == [0.4, 0.2, 0.1]


def test_rows_by_depth():
    vec = AcceptanceVector.from_dict(_record(per_depth=[[0.6, 0.2, 0.1], [0.4, 0.2, 0.1]]))
    assert vec.row(1) == (0.6, 0.2, 0.1)
    assert vec.row(2) == vec.row(9) == (0.4, 0.2, 0.1)
    assert AcceptanceVector.from_values([0.3]).row(4) == (0.3,)
    with pytest.raises(ConfigError):
        vec.row(0)


def test_minimal_and_static():
    vec = AcceptanceVector.from_dict({"format": FORMAT, "values": [0.7]})
    assert vec.method == "manual" and vec.p_none is None and vec.per_depth is None
    s = AcceptanceVector.from_dict(_record(method="static", p_none=None))
    assert s.method == "static" and "p_none" in s.to_dict()


@pytest.mark.parametrize(
    "over, message",
    [
        ({"format": "sequoia"}, "format"),
        ({"format": None}, "format"),
        ({"values": [0.5, -0.1, 0.1]}, "negative"),
        ({"values": [0.6, 0.3, 0.2], "p_none": None}, "sums to 1.1"),
        ({"values": [0.5, 0.2, 0.1], "p_none": 0.3}, "p_none sum"),
        ({"values": [0.5, "x", 0.1]}, "not a number"),
        ({"values": [0.5, float("nan"), 0.1]}, "not finite"),
        ({"values": []}, "empty"),
        ({"values": 0.5}, "list of numbers"),
        ({"width": 4}, "width is 4"),
        ({"method": "magic"}, "method"),
        ({"p_none": -0.1}, "p_none"),
        ({"per_depth": [[0.5, 0.2]]}, "has 2 ranks"),
        ({"per_depth": [[0.9, 0.2, 0.1]]}, "per_depth\\[depth 1\\] sums"),
        ({"per_depth": []}, "per_depth"),
        ({"samples": -3}, "samples"),
        ({"temperature": -1}, "temperature"),
        ({"models": ["a"]}, "models"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_validation_errors(over, message):
    with pytest.raises(ConfigError, match=message):
        AcceptanceVector.from_dict(_record(**over))


def test_missing_values_and_non_object():
    d = _record()
    del d["values"]
    with pytest.raises(ConfigError, match="missing 'values'"):
        AcceptanceVector.from_dict(d)
    with pytest.raises(ConfigError, match="JSON object"):
        AcceptanceVector.from_dict([0.5])


def test_small_rounding_tolerated():
    vec = AcceptanceVector.from_values([0.33334, 0.33334, 0.33334])  # sums to 1.00002
    assert vec.width == 3


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_acceptance(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_acceptance(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(_record(values=[2.0, 0, 0])))
    with pytest.raises(ConfigError, match="wrong.json"):
        load_acceptance(wrong)


def test_legacy_layouts():
    dyn = acceptance_from_legacy([0.0, 0.5, 0.2, 0.1, 0.2], layout="dynamic")
    assert dyn.values == (0.5, 0.2, 0.1) and dyn.p_none == 0.2 and dyn.method == "dynamic"
    st = acceptance_from_legacy([0.0, 0.5, 0.2, 0.1], layout="static")
    assert st.values == (0.5, 0.2, 0.1) and st.p_none is None and st.method == "static"
    with pytest.raises(ConfigError, match="layout"):
        acceptance_from_legacy([0.0, 0.5], layout="auto")
