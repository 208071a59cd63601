"""The cost model (redwood.speculation.costs) and its calibration cache (costs_cache, engine.calibrate): the
curves' interpolation, the online correction, and cache files that are missing, stale, corrupt or from another
setup — rebuilt with a message, never used."""

from __future__ import annotations

import json
import math

import pytest

from redwood.speculation.costs import CATCH_UP, CostModel, CostTable, ForwardCurve, StepShape
from redwood.speculation.costs_cache import costs_path, load_costs, save_costs


def curve(lo=(1.0, 1.2, 1.6, 2.4), hi=(2.0, 2.4, 3.2, 4.8), tokens=(1, 2, 4, 8)) -> ForwardCurve:
    return ForwardCurve(list(tokens), 16, 1040, list(lo), list(hi))


def test_curve_interpolates_between_points_and_extends_past_the_last():
    c = curve()
    assert c.seconds(1, 1, 16) == pytest.approx(1.0)
    assert c.seconds(1, 3, 16) == pytest.approx(1.4)  # halfway between N = 2 and 4
    assert c.seconds(1, 16, 16) == pytest.approx(2.4 + 0.2 * 8)  # the last slope (0.2 s a token) continues
    # context: linear between the two calibrated contexts, per row
    assert c.seconds(1, 1, 528) == pytest.approx(1.5)
    assert c.seconds(2, 1, 528) == pytest.approx(1.2 + 2 * 0.5)  # N = 2 tokens, two rows' reads
    # a bucket's finished rows compute their tokens but read no context
    assert c.seconds(4, 1, 528, live=1) == pytest.approx(1.6 + 1 * 0.5)
    assert c.seconds(4, 1, 528, live=4) == c.seconds(4, 1, 528)


def test_curve_rejects_bad_tables():
    with pytest.raises(ValueError):
        ForwardCurve([1, 2], 16, 8, [1.0, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ForwardCurve([1, 2], 16, 32, [1.0, float("nan")], [1.0, 2.0])


def test_step_shapes_add_draft_levels_at_their_context():
    table = CostTable(curve(), draft=curve(lo=(0.1, 0.12, 0.16, 0.24), hi=(0.2, 0.24, 0.32, 0.48)))
    m = CostModel(table)
    verify = table.target.seconds(1, 4, 528)
    self_spec = StepShape(4, (1, 1, 1), draft_model=False, draft_context=16)
    assert m.raw(self_spec, 1, 528) == pytest.approx(verify + 3 * table.target.seconds(1, 1, 16))
    model = StepShape(4, (2, 1, 1), draft_model=True)
    expect = verify + table.draft.seconds(1, 2, 528) + 2 * table.draft.seconds(1, 1, 528)
    assert m.raw(model, 1, 528) == pytest.approx(expect)


def test_online_correction_learns_the_measured_ratio_per_family_and_bucket():
    m = CostModel(CostTable(curve()))
    shape = StepShape(1)
    raw = m.raw(shape, 1, 16)
    for _ in range(60):
        m.observe("ar", shape, 1, 1, 16, 3 * raw)
    assert m.predict("ar", shape, 1, 1, 16) == pytest.approx(3 * raw, rel=1e-3)
    # a family never measured takes plain decoding's ratio at the bucket (the table's error there)
    assert m.predict("ngram", shape, 1, 1, 16) == pytest.approx(3 * raw, rel=1e-3)
    assert m.correction(CATCH_UP, 1) == 1.0  # (not the catch-ups: a draft model's forward, not the target's step)
    # a bucket never measured borrows the nearest measured one of its family
    assert m.correction("ar", 4) == pytest.approx(3, rel=1e-3)
    m.observe("ar", shape, 1, 1, 16, float("nan"))  # ignored, not poisoning the mean
    assert math.isfinite(m.correction("ar", 1))


def test_a_bucket_a_family_never_ran_at_moves_with_plain_decodings_ratio():
    """The table's error grows with the batch for every family alike (its per-slot cost is taken from one row):
    a family measured only at bucket 16 is costed at 64 by its ratio at 16 times plain decoding's ratio at 64
    over its ratio at 16 — an H100 measured ar 0.51 at 16 and 0.20 at 64, self-speculation 0.82 at 16 (and ~0.3
    at 64 in another run); borrowed unchanged, 0.82 kept it from ever running at 64."""
    m = CostModel(CostTable(curve()))
    shape = StepShape(1)
    for bucket, ratio in ((16, 0.51), (64, 0.20)):
        for _ in range(60):
            m.observe("ar", shape, bucket, bucket, 16, ratio * m.raw(shape, bucket, 16))
    for _ in range(60):
        m.observe("self", StepShape(4, (1, 1, 1)), 16, 16, 16, 0.82 * m.raw(StepShape(4, (1, 1, 1)), 16, 16))
    assert m.correction("self", 16) == pytest.approx(0.82, rel=1e-3)
    assert m.correction("self", 64) == pytest.approx(0.82 * 0.20 / 0.51, rel=1e-3)
    assert m.correction("self", 32) == pytest.approx(0.82, rel=1e-3)  # (plain decoding not measured at 32)
    assert m.correction("ar", 32) == pytest.approx(0.51, rel=1e-3)  # (the yardstick borrows plainly: 16 is nearest)


def test_a_run_shape_is_costed_by_its_own_measurements_others_by_their_family():
    """The calibration's error can differ by step size (its curve was measured once): the shape in use learns
    its own ratio; shapes never run take the family's."""
    m = CostModel(CostTable(curve()))
    four, five, two = StepShape(4), StepShape(5), StepShape(2)
    for _ in range(60):
        m.observe("ngram", four, 1, 1, 16, 2 * m.raw(four, 1, 16))
    for _ in range(60):
        m.observe("ngram", two, 1, 1, 16, 0.5 * m.raw(two, 1, 16))
    assert m.predict("ngram", four, 1, 1, 16) == pytest.approx(2 * m.raw(four, 1, 16), rel=1e-3)
    assert m.predict("ngram", two, 1, 1, 16) == pytest.approx(0.5 * m.raw(two, 1, 16), rel=1e-3)
    # never run: the family's running ratio (the latest observations weigh most)
    assert m.predict("ngram", five, 1, 1, 16) == pytest.approx(m.raw(five, 1, 16) * m.correction("ngram", 1), rel=1e-9)
    assert m.correction("ngram", 1) == pytest.approx(0.5, rel=1e-3)


def test_an_old_ratio_weighs_less_against_a_new_one():
    """A shape probed now and then is costed by its latest probe: the old ratio's weight decays with the
    steps (of any plan) since it was updated, not only per observation of its own."""
    m = CostModel(CostTable(curve()))
    ar, four = StepShape(1), StepShape(4)
    for _ in range(30):
        m.observe("ar", ar, 1, 1, 16, 2 * m.raw(ar, 1, 16))  # warm-up: twice the table
    for _ in range(40):
        m.observe("ngram", four, 1, 1, 16, m.raw(four, 1, 16))  # another plan runs for a while
    m.observe("ar", ar, 1, 1, 16, m.raw(ar, 1, 16))  # one probe at the table's time
    # the old ratio keeps 0.8 · 0.97^40 ≈ 0.24 of its weight (without ageing 0.8: the probe would barely move it)
    assert m.correction("ar", 1, ar) == pytest.approx(2 ** (0.8 * 0.97**40), rel=1e-6)
    assert m.correction("ar", 1, ar) < 2**0.25
    back_to_back = CostModel(CostTable(curve()))
    for _ in range(30):
        back_to_back.observe("ar", ar, 1, 1, 16, 2 * m.raw(ar, 1, 16))
    back_to_back.observe("ar", ar, 1, 1, 16, m.raw(ar, 1, 16))
    assert back_to_back.correction("ar", 1, ar) == pytest.approx(2**0.8, rel=1e-6)


def test_monotone_keeps_the_smallest_time_that_bounds_each_point():
    """Noise only adds time: a point above a larger forward's time (more tokens, or a longer context) is
    lowered to it; a quiet curve is unchanged."""
    quiet = curve()
    assert quiet.monotone() == quiet and quiet.implausible() is None
    noisy = curve(lo=(1.7, 0.46, 1.09, 1.6), hi=(0.33, 0.35, 0.48, 2.0))  # measured under load (a real file)
    assert "1 new tokens timed 3.7x slower than 2" in noisy.implausible()
    fixed = noisy.monotone()
    assert fixed.lo_s == [0.33, 0.35, 0.48, 1.6] and fixed.hi_s == [0.33, 0.35, 0.48, 2.0]
    assert fixed.implausible() is None
    slower_short = curve(lo=(1.0, 1.2, 1.6, 2.4), hi=(0.5, 2.4, 3.2, 4.8))
    assert "slower at context 16 than at 1040" in slower_short.implausible()


KEY = {"device": "cpu:test", "target": {"config": "x"}, "threads": 1, "version": "0"}


def test_cache_round_trip(tmp_path):
    table = CostTable(curve(), curve())
    save_costs(KEY, table, tmp_path)
    loaded, why = load_costs(KEY, tmp_path)
    assert why == "" and loaded.to_dict() == table.to_dict()


@pytest.mark.parametrize(
    "damage, says",
    [
        (None, "no calibration"),
        (lambda p: p.write_text("{not json"), "unreadable"),
        (lambda p: p.write_text(json.dumps({"format": "redwood.costs/0"})), "format"),
        (lambda p: _edit(p, key={**KEY, "device": "cuda:other"}), "another setup"),
        (lambda p: _edit(p, table={"target": {"tokens": [1]}}), "corrupt"),
        (lambda p: _edit(p, table=CostTable(curve(lo=(1.7, 0.46, 1.09, 1.6))).to_dict()), "implausible"),
    ],
)
def test_bad_cache_files_are_reported_and_not_used(tmp_path, damage, says):
    if damage is not None:
        save_costs(KEY, CostTable(curve()), tmp_path)
        damage(costs_path(KEY, tmp_path))
    table, why = load_costs(KEY, tmp_path)
    assert table is None and says in why


def _edit(path, **changes):
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_load_or_calibrate_rebuilds_a_corrupt_file_with_a_message(tmp_path, capsys):
    """engine.calibrate: a corrupt cache is replaced by a fresh calibration (and said so); the next engine
    reads the new file without calibrating."""
    from redwood.engine.calibrate import cost_key, load_or_calibrate

    model = _tiny_model()
    key = cost_key(model)
    path = costs_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("garbage")
    table = load_or_calibrate(model, None, 256, show=False, root=tmp_path)
    err = capsys.readouterr().err
    assert "unreadable" in err and "calibrated" in err
    assert table.target.lo_s[0] > 0 and table.implausible() is None and table.target.monotone() == table.target
    assert json.loads(path.read_text())["key"] == json.loads(json.dumps(key))
    again = load_or_calibrate(model, None, 256, show=False, root=tmp_path)
    assert capsys.readouterr().err == "" and again.to_dict() == table.to_dict()


def _tiny_model():
    import torch

    from redwood.config import ModelConfig
    from redwood.models.transformer import Transformer

    cfg = ModelConfig(
        arch="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()
