"""Where greedy speculative output parts from AR's, and whether the dtype's rounding explains it."""

from __future__ import annotations

import torch

from redwood.bench.divergence import describe, first_divergence, is_numerical_tie, rounding_step
from redwood.bench.throughput import _parting_lines


def test_first_divergence_row_and_position():
    assert first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_divergence([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == {"row": 1, "position": 1}
    # one output a prefix of the other: they part where the shorter ends
    assert first_divergence([[1, 2, 3]], [[1, 2]]) == {"row": 0, "position": 2}


def test_rounding_step_per_dtype():
    assert rounding_step(20.0, torch.bfloat16) == 2.0**-3  # [16, 32): 2^4 with 7 mantissa bits
    assert rounding_step(20.0, torch.float16) == 2.0**-6
    assert rounding_step(-0.75, torch.bfloat16) == 2.0**-8


def test_numerical_tie_only_within_the_dtypes_rounding_and_never_in_float32():
    near = {"top2_gap": 0.25, "top_logit": 20.0}  # two bf16 steps at 20
    far = {"top2_gap": 1.5, "top_logit": 20.0}  # twelve steps: not rounding
    assert is_numerical_tie(near, torch.bfloat16) and not is_numerical_tie(far, torch.bfloat16)
    assert not is_numerical_tie({"top2_gap": 0.0, "top_logit": 20.0}, torch.float32)
    assert not is_numerical_tie({}, torch.bfloat16)  # no logits measured: not explained
    assert "request 3 parts at output token 7" in describe({"row": 3, "position": 7, **near}, torch.bfloat16)
    assert "bfloat16 step 0.125" in describe({"row": 3, "position": 7, **near}, torch.bfloat16)


def _result(dtype: str, tie: bool) -> dict:
    parting = {"row": 2, "position": 40, "top2_gap": 0.125 if tie else 3.0, "top_logit": 18.0, "numerical_tie": tie}
    spec = {"identical_to_ar": False, "request_rate": "inf", "num_requests": 8, "requests_identical_to_ar": 5}
    return {"settings": {"dtype": dtype}, "runs": [{"identical_to_ar": None}, {**spec, "first_divergence": parting}]}


def test_parting_lines_note_a_bf16_tie_and_warn_otherwise():
    note = _parting_lines(_result("bfloat16", tie=True))
    assert note[0].startswith("note: greedy outputs differ from AR's at a near-tie of bfloat16 rounding")
    assert "3 of 8 requests differ; request 2 parts at output token 40" in note[1]
    warn = _parting_lines(_result("bfloat16", tie=False))
    assert warn[0].startswith("WARNING: greedy speculative output differs")
    assert _parting_lines(_result("float32", tie=False))[0].startswith("WARNING")
