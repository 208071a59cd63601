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
    return RequestState(
        prompt_ids=[1],
        params=SamplingParams(max_new_tokens=20, **params),
        tokenizer=tok,
        eos_ids=frozenset({9}),
        max_new_tokens=20,
    )


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


# ------------------------------------------------------------------ sources and text spans


def _stream(state, tokens, sources):
    """Append tokens one by one (stopping when the request finishes), popping a delta after each;
    → the deltas as (text, spans)."""
    out = []
    for tok, src in zip(tokens, sources):
        done = state.append(tok, src)
        out.append(state.pop_delta_spans())
        if done:
            break
    return out


def test_spans_give_each_token_its_own_characters_with_its_source():
    r = _request(CountingTokenizer())
    deltas = _stream(r, [1, 2, 3, 4, 5], ["target", "draft", "draft", "target", "draft"])
    assert [spans for _, spans in deltas] == [
        [("Hel", "target")],
        [("lo", "draft")],
        [(" wor", "draft")],
        [("ld", "target")],
        [("!", "draft")],
    ]
    assert r.output_sources == ["target", "draft", "draft", "target", "draft"]


def test_held_back_text_keeps_its_tokens_and_a_stop_string_leaves_no_span():
    # With the stop string " END" the last 3 characters are held back while running: a token's
    # characters arrive split over later deltas, each piece still its token's; " END" is cut (its token
    # gets no span, nothing of it is ever emitted).
    r = _request(CountingTokenizer(), stop=[" END"])
    deltas = _stream(r, [1, 2, 4, 6], ["target", "draft", "target", "draft"])
    assert r.finish_reason == "stop" and r.text == "Hellold"
    assert deltas == [
        ("", []),
        ("He", [("He", "target")]),
        ("ll", [("l", "target"), ("l", "draft")]),
        ("old", [("o", "draft"), ("ld", "target")]),
    ]


def test_eos_gets_no_span():
    r = _request(CountingTokenizer())
    deltas = _stream(r, [1, 9], ["draft", "target"])
    assert r.finish_reason == "stop" and r.output_sources == ["draft", "target"]
    assert [spans for _, spans in deltas] == [[("Hel", "draft")], []]


def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte is written as one printable character — the printable
    Latin-1 bytes as themselves, the rest as chr(256 + k) in byte order (GPT-2's mapping)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _expected_owners(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """Oracle: (text, owner token of each character). A character is released by the first token at
    whose end the bytes so far end on a character boundary, at or after the character's last byte."""
    byte_of = _byte_of_char()
    data, ends = b"", []
    for t in ids:
        data += bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(t))
        ends.append(len(data))
    text = data.decode("utf-8")
    char_end, pos = [], 0  # byte offset after each character
    for ch in text:
        pos += len(ch.encode("utf-8"))
        char_end.append(pos)
    boundaries = set(char_end) | {0}
    owners = [next(i for i, e in enumerate(ends) if e >= ce and e in boundaries) for ce in char_end]
    return text, owners


def test_spans_match_a_byte_level_oracle_over_random_streams(tokenizer):
    """Random texts of ASCII and multi-byte characters (split into byte tokens by the tokenizer), random
    sources, random stop strings (often present) and an EOS sometimes: every delta's spans are the runs of
    its characters by owner token, each with that token's source, and they join to the delta's text."""
    import random

    rng = random.Random(7)
    alphabet = ["a", "b", "c", " ", " the", "\n", "é", "ß", "中", "€", "🙂", ".", "ab"]
    eos = tokenizer.eos_token_id
    for trial in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        full, owners = _expected_owners(tokenizer, ids)
        assert full == text == tokenizer.decode(ids)
        stop = []
        if rng.random() < 0.5:
            a = rng.randrange(len(text))
            stop = [text[a : a + rng.randint(1, 3)]]
        with_eos = rng.random() < 0.3
        sources = [rng.choice(["draft", "target"]) for _ in ids] + ["target"]
        state = RequestState(
            prompt_ids=[1],
            params=SamplingParams(max_new_tokens=100, stop=stop),
            tokenizer=tokenizer,
            eos_ids=frozenset({eos}),
            max_new_tokens=100,
        )
        deltas = _stream(state, ids + ([eos] if with_eos else []), sources)
        final = state.text
        want_text = text[: text.find(stop[0])] if stop and stop[0] in text else text
        assert final == want_text, (trial, text, stop)
        assert "".join(t for t, _ in deltas) == final
        at = 0
        for delta_text, spans in deltas:
            assert "".join(t for t, _ in spans) == delta_text
            runs = []  # the delta's characters grouped by owner token, in order
            for c in range(at, at + len(delta_text)):
                if runs and runs[-1][0] == owners[c]:
                    runs[-1][1] += final[c]
                else:
                    runs.append([owners[c], final[c]])
            assert spans == [(t, sources[i]) for i, t in runs], (trial, text, stop)
            at += len(delta_text)


def test_fast_and_window_detokenizers_agree_with_decode_over_random_ids(tokenizer, monkeypatch):
    """Random id streams (any token, incl. special tokens and stray UTF-8 bytes): the fast path
    (tokenizers' DecodeStream) and the two-call window path both build exactly
    `tokenizer.decode(ids, skip_special_tokens=True)`, less a trailing incomplete UTF-8 sequence, token by
    token (the text read after every token equals the decode of the ids so far, so deltas are the same)."""
    import random

    from redwood.engine import request as request_module

    rng = random.Random(11)
    streams = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(120)]

    def texts(ids):
        state = RequestState(
            prompt_ids=[1],
            params=SamplingParams(max_new_tokens=100),
            tokenizer=tokenizer,
            eos_ids=frozenset(),
            max_new_tokens=100,
        )
        out = []
        for t in ids:
            state.append(t)
            out.append(state.text)
        return out, state._stream

    for ids in streams:
        want = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
        fast, stream = texts(ids)
        assert stream, "the tiny fast tokenizer should take the DecodeStream path"
        for got, ref in zip(fast, want):
            assert ref.startswith(got) and (got == ref or ref[len(got) :].strip("\ufffd") == ""), (got, ref)
        assert fast[-1] == want[-1].rstrip("\ufffd") or fast[-1] == want[-1]
        with monkeypatch.context() as m:
            m.setattr(request_module, "_decode_stream", lambda tok: None)
            window, stream = texts(ids)
        assert stream is False and window == fast
