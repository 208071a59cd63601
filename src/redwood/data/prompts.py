"""Prompt builders for the benchmarks, in the shapes the seed papers used; deterministic for a given seed.

- `long_context_prompts`: windows of exactly `length` tokens cut at distinct offsets from the concatenated
  text of a book / essay dataset, one per batch row (MagicDec's PG-19 setting);
- `short_prefix_prompts`: the first `prefix_tokens` (128) tokens of each document (Sequoia's C4 / OWT / CNN);
- `chat_prompts`: MT-Bench first turns, HumanEval prompts, GSM8K questions through the chat template;
- `build_prompts`: picks one of the above from the dataset's kind (`redwood bench … --dataset NAME`).

`tokenizer` is any Hugging-Face-like object with `encode(text, add_special_tokens=...)` (or `__call__`
returning `input_ids`) and, for chat prompts, `apply_chat_template`. `dataset` is a dataset name (see
`redwood.data.recipes`, fetched on first use) or an already loaded list of `{"id", "text", ...}` documents.
Every builder returns a list of lists of token ids.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from redwood.data.recipes import dataset_kind, get_recipe, load_dataset
from redwood.errors import ConfigError

DEFAULT_PREFIX_TOKENS = 128
DOC_SEPARATOR = "\n\n"


def _docs(dataset: str | Sequence[dict]) -> tuple[str, list[dict]]:
    if isinstance(dataset, str):
        return dataset, load_dataset(dataset)
    docs = list(dataset)
    return "<documents>", docs


def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text` with an HF-like tokenizer (no length warnings, no special tokens by default)."""
    if hasattr(tokenizer, "encode"):
        try:
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False)
        except TypeError:  # a tokenizer whose encode() has no `verbose`
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if hasattr(ids, "ids"):  # a raw `tokenizers.Encoding`
        ids = ids.ids
    return [int(t) for t in ids]


def _chunks(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut just before a line that starts a word."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = start + size
        m = _LINE_START.search(text, cut)
        if m is None:
            break
        pieces.append(text[start : m.start() + 1])
        start = m.start() + 1
    pieces.append(text[start:])
    return pieces


_LINE_START = re.compile(r"\n(?=\S)")
LONG_CHUNK_CHARS = 50_000


def encode_long(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a long text, encoded in line-aligned chunks (batched: much faster than one huge string).

    The ids can differ from one-piece encoding only where a token would span a chunk boundary (a newline
    followed by a word), which doesn't matter for prompt windows; they are deterministic for a tokenizer.
    """
    pieces = _chunks(text, LONG_CHUNK_CHARS)
    if len(pieces) > 1 and callable(tokenizer) and hasattr(tokenizer, "batch_decode"):  # an HF tokenizer
        try:
            batch = tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]
        except TypeError:
            batch = tokenizer(pieces, add_special_tokens=False)["input_ids"]
        return [int(t) for ids in batch for t in ids]
    return [t for piece in pieces for t in encode(tokenizer, piece)]


def _check_positive(what: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")


def _bos(tokenizer: Any, add_bos: bool) -> list[int]:
    if not add_bos:
        return []
    bos = getattr(tokenizer, "bos_token_id", None)
    return [] if bos is None else [int(bos)]


def window_offsets(total: int, length: int, count: int, seed: int) -> list[int]:
    """`count` distinct start offsets of `length`-token windows in a `total`-token text.

    The windows don't overlap when the text is long enough (`count * length <= total`); otherwise they
    overlap but still start at distinct offsets. Deterministic for a given seed.
    """
    rng = random.Random(seed)
    if count * length <= total:
        slack = total - count * length  # spread the unused tokens randomly into the gaps between windows
        cuts = sorted(rng.randint(0, slack) for _ in range(count))
        offsets = [c + i * length for i, c in enumerate(cuts)]
        rng.shuffle(offsets)
        return offsets
    return rng.sample(range(total - length + 1), count)


_CONCAT_CACHE: list[tuple[Any, str, list[int]]] = []  # (tokenizer, dataset name, ids): the last two


def _concatenated_ids(tokenizer: Any, dataset: str | Sequence[dict], docs: list[dict]) -> list[int]:
    """Token ids of the documents joined by a blank line; named datasets are cached (sweeps re-use them)."""
    if isinstance(dataset, str):
        for tok, name, ids in _CONCAT_CACHE:
            if tok is tokenizer and name == dataset:
                return ids
    ids = encode_long(tokenizer, DOC_SEPARATOR.join(d["text"] for d in docs))
    if isinstance(dataset, str):
        _CONCAT_CACHE.insert(0, (tokenizer, dataset, ids))
        del _CONCAT_CACHE[2:]
    return ids


def long_context_prompts(
    tokenizer: Any, dataset: str | Sequence[dict], length: int, count: int, seed: int = 0, *, add_bos: bool = False
) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, cut from the concatenated documents at distinct offsets.

    Documents are joined with a blank line (in dataset order) and tokenized once. With `add_bos` the
    tokenizer's BOS token starts each prompt (still `length` tokens in all).
    """
    _check_positive("prompt count", count)
    _check_positive("prompt length", length)
    name, docs = _docs(dataset)
    bos = _bos(tokenizer, add_bos)
    need = length - len(bos)
    ids = _concatenated_ids(tokenizer, dataset, docs)
    if need > len(ids) - (count - 1) or need <= 0:
        raise ConfigError(
            f"dataset {name} has {len(ids):,} tokens with this tokenizer: too short for {count} distinct "
            f"windows of {length:,} tokens (needs at least {need + count - 1:,}); use a shorter length, fewer "
            f"prompts, or a longer text (essays ≈ 680K tokens, shakespeare ≈ 1.5M)"
            if need > 0
            else f"prompt length {length} leaves no room after the BOS token"
        )
    return [bos + ids[o : o + need] for o in window_offsets(len(ids), need, count, seed)]


def short_prefix_prompts(
    tokenizer: Any,
    dataset: str | Sequence[dict],
    count: int,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    seed: int = 0,
    *,
    add_bos: bool = False,
) -> list[list[int]]:
    """The first `prefix_tokens` tokens of `count` documents (seeded choice; shorter documents skipped)."""
    _check_positive("prompt count", count)
    _check_positive("prefix_tokens", prefix_tokens)
    name, docs = _docs(dataset)
    bos = _bos(tokenizer, add_bos)
    need = prefix_tokens - len(bos)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    out: list[list[int]] = []
    for i in order:
        ids = encode(tokenizer, docs[i]["text"])
        if len(ids) >= need:
            out.append(bos + ids[:need])
            if len(out) == count:
                return out
    raise ConfigError(
        f"dataset {name} has only {len(out)} documents of at least {prefix_tokens} tokens with this tokenizer, "
        f"{count} requested; ask for fewer prompts or use a bigger set (openwebtext / wikipedia: 1,050 docs)"
    )


def _chat_text(doc: dict) -> str:
    if "prompt" in doc:
        return doc["prompt"]
    if doc.get("turns"):
        return doc["turns"][0]
    return doc["text"]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def chat_prompt_ids(tokenizer: Any, content: str) -> list[int]:
    """One user message through the tokenizer's chat template, generation prompt appended."""
    if not has_chat_template(tokenizer):
        raise ConfigError("this tokenizer has no chat template; use plain prompts (chat=False)")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    # the template writes any BOS itself, so the tokenizer must not add special tokens again
    return encode(tokenizer, text, add_special_tokens=False)


def chat_prompts(
    tokenizer: Any, dataset: str | Sequence[dict], count: int | None = None, seed: int = 0, *, chat: bool = True
) -> list[list[int]]:
    """`count` (None: all) questions in seeded order: MT-Bench first turns, HumanEval prompts, GSM8K questions.

    `chat=True` wraps each as a user message in the chat template (with the generation prompt);
    `chat=False` gives the plain text (e.g. HumanEval as a code-completion prompt) with the tokenizer's
    usual special tokens.
    """
    name, docs = _docs(dataset)
    if count is None:
        count = len(docs)
    _check_positive("prompt count", count)
    if count > len(docs):
        raise ConfigError(f"dataset {name} has {len(docs)} prompts, {count} requested")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    picked = [_chat_text(docs[i]) for i in order[:count]]
    if chat:
        return [chat_prompt_ids(tokenizer, p) for p in picked]
    return [encode(tokenizer, p, add_special_tokens=True) for p in picked]


def build_prompts(
    tokenizer: Any, dataset: str, count: int, length: int | None = None, seed: int = 0, chat: bool | None = None
) -> list[list[int]]:
    """Prompts for `redwood bench … --dataset NAME`, by the dataset's kind.

    - ``long`` datasets (essays, shakespeare): `length` is required; windows of exactly `length` tokens;
    - ``prefix`` datasets (c4, openwebtext, wikipedia, news): the first `length` (default 128) tokens of
      each document;
    - ``chat`` datasets (mt-bench, humaneval, gsm8k): `length` is ignored; `chat=None` uses the chat
      template when the tokenizer has one, plain text otherwise.
    """
    kind = dataset_kind(dataset)
    if kind == "long":
        if length is None:
            raise ConfigError(f"dataset {dataset} gives long-context prompts: pass a prompt length (tokens per prompt)")
        return long_context_prompts(tokenizer, dataset, length, count, seed)
    if kind == "prefix":
        return short_prefix_prompts(tokenizer, dataset, count, prefix_tokens=length or DEFAULT_PREFIX_TOKENS, seed=seed)
    if kind == "chat":
        use_chat = has_chat_template(tokenizer) if chat is None else chat
        return chat_prompts(tokenizer, dataset, count, seed, chat=use_chat)
    raise ConfigError(f"dataset {get_recipe(dataset).name} has unknown kind {kind!r}")
