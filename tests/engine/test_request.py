"""RequestState: incremental, deferred detokenization and stop handling."""

from __future__ import annotations

from redwood.engine.request import RequestState
from redwood.sampling_params import SamplingParams

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " END", 7: " more", 9: "<eos>"}


class CountingTokenizer:
    """Decodes ids by concatenating pieces (id 9 is a special EOS token, dropped when skipping)."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == 9))


def _request(tok, **params):
    return RequestState(prompt_ids=[1], params=SamplingParams(max_new_tokens=20, **params), tokenizer=tok,
                        eos_ids=frozenset({9}), max_new_tokens=20)


def test_text_is_built_only_when_read_and_equals_the_streamed_deltas():
    tok = CountingTokenizer()
    r = _request(tok)
    for t in (1, 2, 3, 4, 5):
        r.append(t)
    assert tok.calls == 0  # no stop strings: nothing detokenized inside the decode loop
    assert r.text == "Hello world!"
    streamed = _request(CountingTokenizer())
    deltas = []
    for t in (1, 2, 3, 4, 5):
        streamed.append(t)
        deltas.append(streamed.pop_delta())
    assert "".join(deltas) == "Hello world!"


def test_eos_ends_without_text_and_stop_strings_cut_the_text():
    r = _request(CountingTokenizer())
    for t in (1, 2, 9):
        if r.append(t):
            break
    assert r.finish_reason == "stop" and r.text == "Hello" and r.output_ids == [1, 2, 9]
    tok = CountingTokenizer()
    s = _request(tok, stop=[" END"])
    finished = [s.append(t) for t in (1, 2, 6)]
    assert finished == [False, False, True] and s.finish_reason == "stop"
    assert s.text == "Hello" and tok.calls > 0  # stop strings need the text every token
