"""Where a greedy speculative output parts from the autoregressive one, and whether that is a numerical tie.

Greedy speculation is exact when a verify forward computes the same logits as the decode forward it stands in
for. In float32 on our exact paths it does (the tests prove token-for-token equality); in bfloat16 / float16 a
verify over several tokens and a one-token decode run different GEMM shapes and attention splits, so their
logits round differently, and where the target's two best tokens are within that rounding the two runs may
take different tokens — and from there, different texts. A benchmark that finds greedy outputs differing
reports the first parting: which request, which output position, and the target's top-2 logit gap there
(one fresh batch-1 forward). A gap within a few rounding steps of the logits' dtype is a tie that forwards of
different shapes may break either way; a larger one, or any difference in float32, is a bug.
"""

from __future__ import annotations

import math

import torch

# mantissa bits of each logits dtype: the spacing of representable values near x is 2^(floor(log2|x|) - bits)
_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
TIE_STEPS = 4  # a gap within this many rounding steps of the top logit is a numerical tie (verify ≠ decode shapes)


def first_divergence(a_rows: list[list[int]], b_rows: list[list[int]]) -> dict[str, int] | None:
    """The first row whose tokens differ and the first output position where they do (None if none does)."""
    b = next((i for i, (x, y) in enumerate(zip(a_rows, b_rows)) if x != y), None)
    if b is None:
        return None
    x, y = a_rows[b], b_rows[b]
    position = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return {"row": b, "position": position}


def divergence_logits(logits_of, prompt: list[int], ar_ids: list[int], spec_ids: list[int], position: int) -> dict:
    """Why a greedy speculative output parts from the AR output at output `position`: the target's logits
    for that token after the prompt and AR's tokens before it. logits_of: token ids → [V] logits (an engine's
    `prompt_logits`, or `partial(engine.prefill.fresh_logits, model)`).

    top2_gap: its two largest logits' difference; top_logit: the largest; logit_gap: AR's token's logit minus
    the speculative token's.
    """
    logits = logits_of(list(prompt) + list(ar_ids[:position])).float()  # [V]
    top = logits.topk(2)
    out = {"top2_gap": float(top.values[0] - top.values[1]), "top_logit": float(top.values[0])}
    if position < min(len(ar_ids), len(spec_ids)):
        a, b = ar_ids[position], spec_ids[position]
        out.update(ar_token=a, spec_token=b, logit_gap=float(logits[a] - logits[b]))
    return out


def rounding_step(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s representable values near x (its unit in the last place)."""
    bits = _MANTISSA_BITS.get(dtype, 23)
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - bits)


def is_numerical_tie(d: dict, dtype: torch.dtype) -> bool:
    """Whether a parting (`divergence_logits`' view) is a tie that `dtype`'s rounding may break either way:
    never in float32 (verify logits equal decode logits there), else a top-2 gap within TIE_STEPS steps."""
    if dtype == torch.float32 or "top2_gap" not in d:
        return False
    return d["top2_gap"] <= TIE_STEPS * rounding_step(d.get("top_logit", d["top2_gap"]), dtype)


def describe(d: dict, dtype: torch.dtype) -> str:
    """One line on a parting: where, the gap, and what it means in this dtype."""
    text = f"request {d['row']} parts at output token {d['position']}"
    if "top2_gap" in d:
        text += f"; the target's top-2 logit gap there {d['top2_gap']:.4g}"
        if "top_logit" in d:
            text += f" (top logit {d['top_logit']:.4g}, {str(dtype).removeprefix('torch.')} step "
            text += f"{rounding_step(d['top_logit'], dtype):.3g})"
    return text
