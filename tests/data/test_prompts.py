"""Prompt builders, with a tiny real tokenizer trained offline on fixture text."""

from __future__ import annotations

import random

import pytest

from redwood.data import prompts, recipes
from redwood.data.prompts import build_prompts, chat_prompts, long_context_prompts, short_prefix_prompts, window_offsets
from redwood.errors import ConfigError

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]


def _book(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = "the king queen castle sword river night morning letter speaks walks sleeps and of to a".split()
    return " ".join(rng.choice(words) for _ in range(n_words))


BOOKS = [{"id": f"book-{i}", "text": _book(1500, i)} for i in range(3)]
ARTICLES = [{"id": f"doc-{i}", "text": _book(40 if i % 3 == 0 else 300, 10 + i)} for i in range(12)]
QUESTIONS = [{"id": f"q-{i}", "prompt": f"What is {i} plus {i}?", "text": f"What is {i} plus {i}?"} for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([d["text"] for d in BOOKS + ARTICLES + QUESTIONS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_long_context_exact_length_distinct_windows(tokenizer):
    full = _ids(tokenizer, "\n\n".join(d["text"] for d in BOOKS))
    out = long_context_prompts(tokenizer, BOOKS, length=200, count=5, seed=3)
    assert len(out) == 5 and all(len(p) == 200 for p in out)
    starts = []
    for p in out:  # every prompt is a window of the tokenized concatenation
        hits = [o for o in range(len(full) - 199) if full[o : o + 200] == p]
        assert hits
        starts.append(hits[0])
    assert len(set(starts)) == 5
    spans = sorted(starts)
    assert all(b - a >= 200 for a, b in zip(spans, spans[1:]))  # room enough: no overlap


def test_long_context_deterministic_per_seed(tokenizer):
    a = long_context_prompts(tokenizer, BOOKS, 64, 4, seed=1)
    assert a == long_context_prompts(tokenizer, BOOKS, 64, 4, seed=1)
    assert a != long_context_prompts(tokenizer, BOOKS, 64, 4, seed=2)


def test_window_offsets_overlap_only_when_needed():
    offs = window_offsets(total=1000, length=100, count=10, seed=0)
    assert sorted(offs) == list(range(0, 1000, 100))  # exactly fills the text
    offs = window_offsets(total=1000, length=400, count=50, seed=0)
    assert len(set(offs)) == 50 and max(offs) <= 600 and min(offs) >= 0
    for seed in range(20):
        offs = sorted(window_offsets(total=5000, length=300, count=7, seed=seed))
        assert offs[-1] + 300 <= 5000 and all(b - a >= 300 for a, b in zip(offs, offs[1:]))


def test_long_context_too_short(tokenizer):
    n = len(_ids(tokenizer, "\n\n".join(d["text"] for d in BOOKS)))
    assert len(long_context_prompts(tokenizer, BOOKS, n, 1)) == 1
    assert len(long_context_prompts(tokenizer, BOOKS, n - 3, 4)) == 4  # overlapping, distinct offsets
    with pytest.raises(ConfigError, match="too short"):
        long_context_prompts(tokenizer, BOOKS, n + 1, 1)
    with pytest.raises(ConfigError, match="too short"):
        long_context_prompts(tokenizer, BOOKS, n - 3, 5)
    with pytest.raises(ConfigError):
        long_context_prompts(tokenizer, BOOKS, 0, 1)


def test_long_context_with_bos(tokenizer):
    out = long_context_prompts(tokenizer, BOOKS, 50, 3, seed=0, add_bos=True)
    assert all(len(p) == 50 and p[0] == tokenizer.bos_token_id for p in out)
    assert all(tokenizer.bos_token_id not in p[1:] for p in out)


def test_short_prefix(tokenizer):
    out = short_prefix_prompts(tokenizer, ARTICLES, count=6, prefix_tokens=128, seed=0)
    assert len(out) == 6 and all(len(p) == 128 for p in out)
    firsts = {tuple(_ids(tokenizer, d["text"])[:128]) for d in ARTICLES if len(_ids(tokenizer, d["text"])) >= 128}
    assert all(tuple(p) in firsts for p in out)
    assert len({tuple(p) for p in out}) == 6  # different documents
    assert out == short_prefix_prompts(tokenizer, ARTICLES, 6, seed=0)
    assert out != short_prefix_prompts(tokenizer, ARTICLES, 6, seed=5)
    # only 8 documents are long enough (4 of the 12 are 40 words)
    assert len(short_prefix_prompts(tokenizer, ARTICLES, 8)) == 8
    with pytest.raises(ConfigError, match="only 8 documents of at least 128 tokens"):
        short_prefix_prompts(tokenizer, ARTICLES, 9)


def test_chat_prompts_apply_template(tokenizer):
    out = chat_prompts(tokenizer, QUESTIONS, count=4, seed=0)
    assert len(out) == 4
    texts = [tokenizer.decode(p) for p in out]
    for ids, text in zip(out, texts):
        assert ids[0] == tokenizer.bos_token_id
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
        assert text.startswith("<s><|user|>What is ") and text.endswith("?<|end|><|assistant|>")
    q = text[len("<s><|user|>") : -len("<|end|><|assistant|>")]
    assert (
        ids
        == tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    assert out == chat_prompts(tokenizer, QUESTIONS, 4, seed=0)
    assert chat_prompts(tokenizer, QUESTIONS, seed=0) != chat_prompts(tokenizer, QUESTIONS, seed=1)
    assert len(chat_prompts(tokenizer, QUESTIONS)) == 6
    with pytest.raises(ConfigError, match="has 6 prompts, 7 requested"):
        chat_prompts(tokenizer, QUESTIONS, 7)


def test_chat_prompts_plain_and_missing_template(tokenizer):
    plain = chat_prompts(tokenizer, QUESTIONS, 6, chat=False)
    assert sorted(tokenizer.decode(p) for p in plain) == sorted(d["prompt"] for d in QUESTIONS)
    no_template = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>")
    with pytest.raises(ConfigError, match="no chat template"):
        chat_prompts(no_template, QUESTIONS, 2, chat=True)


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """Datasets written straight into a temporary cache (as a fetch would)."""
    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path / "home"))
    archive = tmp_path / "fixture.whl"
    archive.write_bytes(b"fixture")
    humaneval = [
        {"id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """Return x."""\n', "text": f"def f{i}(x):\n"}
        for i in range(3)
    ]
    mt = [
        {
            "id": f"mt-bench-{81 + i}",
            "prompt": f"Turn one {i}",
            "turns": [f"Turn one {i}", "Turn two"],
            "text": f"Turn one {i}\n\nTurn two",
        }
        for i in range(3)
    ]
    for name, docs in (("essays", BOOKS), ("c4", ARTICLES), ("humaneval", humaneval), ("mt-bench", mt)):
        recipes._write_dataset(recipes.get_recipe(name), docs, archive, "0" * 64)
    prompts._CONCAT_CACHE.clear()
    return tmp_path / "home"


def test_build_prompts_by_kind(tokenizer, cached, monkeypatch):
    def no_download(*a, **k):
        raise AssertionError("no download expected")

    monkeypatch.setattr(recipes, "download_package", no_download)
    long = build_prompts(tokenizer, "essays", count=3, length=100, seed=7)
    assert long == long_context_prompts(tokenizer, BOOKS, 100, 3, seed=7)
    assert build_prompts(tokenizer, "essays", count=3, length=100, seed=7) == long  # from the token cache
    with pytest.raises(ConfigError, match="pass a prompt length"):
        build_prompts(tokenizer, "essays", count=3)

    prefix = build_prompts(tokenizer, "c4", count=4, seed=1)
    assert all(len(p) == 128 for p in prefix) and prefix == short_prefix_prompts(tokenizer, ARTICLES, 4, seed=1)
    assert all(len(p) == 32 for p in build_prompts(tokenizer, "c4", count=4, length=32))

    chat = build_prompts(tokenizer, "mt-bench", count=2, length=999)  # length ignored for chat sets
    assert all(tokenizer.decode(p).startswith("<s><|user|>Turn one ") for p in chat)
    assert not any("Turn two" in tokenizer.decode(p) for p in chat)  # first turns only
    code = build_prompts(tokenizer, "humaneval", count=3, chat=False)
    assert all(tokenizer.decode(p).startswith("def f") for p in code)
    assert all(tokenizer.decode(p).startswith("<s><|user|>def f") for p in build_prompts(tokenizer, "humaneval", 3))
    with pytest.raises(ConfigError, match="unknown dataset"):
        build_prompts(tokenizer, "pg19", 1, 10)


def test_minimal_tokenizer_interface():
    class Minimal:  # an HF-like object with encode() but no verbose kwarg and no chat template
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    out = long_context_prompts(Minimal(), [{"id": "a", "text": "abcdefghij"}], length=4, count=2, seed=0)
    assert all(len(p) == 4 for p in out) and out[0] != out[1]


def test_long_text_is_encoded_in_chunks_with_the_same_ids(tokenizer, monkeypatch):
    text = "\n".join(_book(12, i) for i in range(60)) + "\n\n  indented line\nlast"
    monkeypatch.setattr(prompts, "LONG_CHUNK_CHARS", 150)
    assert len(prompts._chunks(text, 150)) > 5 and "".join(prompts._chunks(text, 150)) == text
    assert prompts.encode_long(tokenizer, text) == _ids(tokenizer, text)
