"""Response building without a server: token text/bytes for logprobs, usage and the stats extension."""

from __future__ import annotations

import pytest

from redwood.engine.request import TokenLogprob
from redwood.serve.responses import TokenText, _byte_level_decoder, chat_logprobs, completion_logprobs, redwood_stats


def test_byte_level_alphabet_is_a_bijection_onto_bytes():
    decoder = _byte_level_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert decoder["A"] == ord("A") and decoder["Ġ"] == ord(" ") and decoder["Ċ"] == ord("\n")


def test_token_bytes_concatenate_to_the_text(tokenizer):
    """A multi-byte character split over tokens: each token's bytes are exact, and they join to the text."""
    text = "héllo wörld → ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tt = TokenText(tokenizer)
    assert b"".join(bytes(tt(i)[1]) for i in ids).decode("utf-8") == text
    assert tt(tokenizer.eos_token_id)[0] == "<|im_end|>"  # special tokens by name


def test_logprob_formats():
    tt = TokenText(None)  # (no tokenizer: tokens shown as <id>)
    lps = [TokenLogprob(5, -0.1, [(5, -0.1), (7, -2.5)]), TokenLogprob(7, -1.0, [(3, -0.5), (7, -1.0)])]
    chat = chat_logprobs(tt, lps, 1)["content"]
    assert [c["token"] for c in chat] == ["<5>", "<7>"] and [len(c["top_logprobs"]) for c in chat] == [1, 1]
    out, offset = completion_logprobs(tt, lps, 2, offset=10)
    assert out["text_offset"] == [10, 13] and offset == 16
    assert out["top_logprobs"][1] == {"<3>": -0.5, "<7>": -1.0}


def test_stats_sum_over_choices():
    def stats(drafted, accepted, steps, generated, decode_s):
        return {
            "generated_tokens": generated,
            "decode_s": decode_s,
            "speculative": {"drafted": drafted, "accepted": accepted, "steps": steps},
        }

    s = redwood_stats([stats(30, 12, 10, 23, 1.0), stats(30, 18, 10, 29, 1.0)])
    assert (s["drafted"], s["accepted"], s["steps"]) == (60, 30, 20)
    assert s["acceptance_rate"] == 0.5 and s["mean_accepted_length"] == 2.5
    assert s["tokens_per_s"] == pytest.approx(25.0)  # (22 + 28) decode tokens over 2 s
    plain = redwood_stats([{"generated_tokens": 1, "decode_s": 0.0}])
    assert plain["acceptance_rate"] is None and plain["tokens_per_s"] == 0.0


def test_context_finish_is_length_for_openai_and_context_for_redwood():
    """The Engine's "context" (the model's context filled before max_tokens): "length" in the choice (OpenAI
    has no other value) and in the vLLM-named success counter, "context" in the `redwood` extension."""
    from types import SimpleNamespace

    from redwood.engine.output import RequestDelta
    from redwood.serve.metrics import ServerMetrics
    from redwood.serve.responses import ChoiceState, ChunkMaker, completion_response

    stats = {"generated_tokens": 3, "decode_s": 0.1}
    choices = [ChoiceState(0, 0), ChoiceState(1, 0)]
    for c, reason in zip(choices, ("context", "length")):
        c.add(RequestDelta(f"r{c.index}", [5, 6, 7], "abc", reason, stats))
    assert [c.finish_reason for c in choices] == ["length", "length"]
    out = completion_response("cmpl-x", "m", choices, [4], TokenText(None), None, stats=True)
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert out["redwood"]["finish_reasons"] == ["context", "length"]
    maker = ChunkMaker(
        "cmpl-x", "m", chat=False, token_text=TokenText(None), num_logprobs=None, stats=True, include_usage=False
    )
    last = maker.delta(choices[0], RequestDelta("r0", [7], "c", "context", stats))
    assert last["choices"][0]["finish_reason"] == "length" and last["redwood"]["finish_reason"] == "context"

    metrics = ServerMetrics("m")
    handle = SimpleNamespace(t_first=0.0, t_last=0.0, t_arrival=0.0, prompt_len=4)
    metrics.on_request(handle, RequestDelta("r0", [], "", "context", stats), now=1.0)
    text = metrics.render().decode()
    assert 'redwood:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
    assert "context" not in text
