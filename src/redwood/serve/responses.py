"""OpenAI response objects from Engine deltas: completions and chat, whole and streamed chunks, usage,
logprobs in each endpoint's format, and redwood's stats extension.

A *choice* is one Engine request (choice i of prompt p has index p·n + i). `ChoiceState` gathers what a
choice produced so far; the builders turn it (or one delta of it) into JSON-ready dicts.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

# finish reasons a client sees (an "abort" only ends requests whose client is gone). OpenAI has no value for
# a context that filled up before max_tokens (`redwood.engine.request.FINISH_CONTEXT`): "length" on the
# wire, as vLLM sends; the engine's own reason stays in the `redwood` extension ("finish_reason").
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj) -> str:
    """One Server-Sent Event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when asked for
    finish_reason: str | None = None  # as OpenAI's clients see it (FINISH_REASONS)
    engine_finish_reason: str | None = None  # the Engine's own ("context" stays "context")
    stats: dict | None = None
    text_offset: int = 0  # characters of text already streamed (completions' logprobs text_offset)

    def add(self, delta) -> None:
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = FINISH_REASONS.get(delta.finish_reason, delta.finish_reason)
            self.engine_finish_reason = delta.finish_reason
            self.stats = delta.stats


def usage(prompt_lens: list[int], choices) -> dict:
    """OpenAI usage: each prompt counted once (n choices share it), every choice's generated tokens."""
    prompt = sum(prompt_lens)
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def redwood_stats(stats_list: list[dict]) -> dict:
    """redwood's extension: speculation counters and decode speed, summed over the choices given
    (acceptance fields are None without speculation). tokens_per_s: decode tokens per second of one
    sequence (the first token, from the prefill, left out), over all the choices' decode time."""
    decode_tokens = sum(max(s["generated_tokens"] - 1, 0) for s in stats_list)
    decode_s = sum(s["decode_s"] for s in stats_list)
    out = {
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "drafted": None,
        "accepted": None,
        "steps": None,
        "tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else 0.0,
    }
    specs = [s["speculative"] for s in stats_list if s.get("speculative")]
    if specs:
        drafted, accepted, steps = (sum(s[k] for s in specs) for k in ("drafted", "accepted", "steps"))
        out.update(
            drafted=drafted,
            accepted=accepted,
            steps=steps,
            acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
            mean_accepted_length=round((accepted + steps) / steps, 4) if steps else 0.0,
        )
    return out


def redwood_extension(choices: list[ChoiceState]) -> dict:
    """A whole response's `redwood` field: the stats summed over its choices, and each choice's finish
    reason as the Engine gave it ("context" where the wire says "length"), in choice order."""
    return {**redwood_stats([c.stats for c in choices]), "finish_reasons": [c.engine_finish_reason for c in choices]}


# ---------------------------------------------------------------------- token text and bytes
@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet: byte-level BPE vocabularies spell each byte as one
    printable character — printable Latin-1 bytes as themselves, the other 68 bytes as the characters
    from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenText:
    """A token's text and UTF-8 bytes, as OpenAI's logprobs show them (cached per id).

    Byte-level BPE tokens map back to their exact bytes (a token may hold part of a character; its text
    then has U+FFFD where the rest is missing); other vocabularies decode the token alone.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"<{token_id}>", list(f"<{token_id}>".encode())
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_level_decoder()
        special = piece in (getattr(self.tokenizer, "all_special_tokens", None) or ())
        if isinstance(piece, str) and piece and not special and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def chat_logprobs(token_text: TokenText, logprobs, num_top: int) -> dict:
    """Chat's format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        top = [
            {"token": t, "logprob": p, "bytes": b} for (t, b), p in ((token_text(i), p) for i, p in lp.top[:num_top])
        ]
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(token_text: TokenText, logprobs, num_top: int, offset: int) -> tuple[dict, int]:
    """Completions' format: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
    (text_offset: where each token's text starts in the generated text, from `offset`); → (it, next offset)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        text, _ = token_text(lp.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({token_text(i)[0]: p for i, p in lp.top[:num_top]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


# ---------------------------------------------------------------------- whole responses
def completion_response(
    rid: str,
    model: str,
    choices: list[ChoiceState],
    prompt_lens: list[int],
    token_text: TokenText,
    num_logprobs: int | None,
    stats: bool,
) -> dict:
    out = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt_lens, choices),
        "system_fingerprint": None,
    }
    for c in choices:
        lp = None
        if num_logprobs is not None:
            lp, _ = completion_logprobs(token_text, c.logprobs, num_logprobs, 0)
        out["choices"].append(
            {"index": c.index, "text": "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason}
        )
    if stats:
        out["redwood"] = redwood_extension(choices)
    return out


def chat_response(
    rid: str,
    model: str,
    choices: list[ChoiceState],
    prompt_lens: list[int],
    token_text: TokenText,
    num_logprobs: int | None,
    stats: bool,
) -> dict:
    out = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt_lens, choices),
        "system_fingerprint": None,
    }
    for c in choices:
        lp = chat_logprobs(token_text, c.logprobs, num_logprobs) if num_logprobs is not None else None
        out["choices"].append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }
        )
    if stats:
        out["redwood"] = redwood_extension(choices)
    return out


# ---------------------------------------------------------------------- stream chunks
class ChunkMaker:
    """Stream chunks of one response (one id, one created time) for either endpoint."""

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        token_text: TokenText,
        num_logprobs: int | None,
        stats: bool,
        include_usage: bool,
    ):
        self.rid, self.model, self.chat = rid, model, chat
        self.token_text, self.num_logprobs, self.stats = token_text, num_logprobs, stats
        self.include_usage = include_usage
        self.created = int(time.time())

    def _chunk(self, choices: list[dict]) -> dict:
        out = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.include_usage:
            out["usage"] = None  # (OpenAI: null on every chunk but the last)
        return out

    def role(self, index: int) -> dict:
        """Chat's first chunk of a choice: the assistant role, empty content."""
        return self._chunk(
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def delta(self, choice: ChoiceState, delta) -> dict | None:
        """The chunk for one Engine delta of `choice` (already added to it), or None when it carries
        nothing a client sees (no text, no logprobs, not the end)."""
        finish = choice.finish_reason if delta.finish_reason is not None else None
        logprobs = None
        if self.num_logprobs is not None and delta.logprobs:
            if self.chat:
                logprobs = chat_logprobs(self.token_text, delta.logprobs, self.num_logprobs)
            else:
                logprobs, choice.text_offset = completion_logprobs(
                    self.token_text, delta.logprobs, self.num_logprobs, choice.text_offset
                )
        if not delta.text and logprobs is None and finish is None:
            return None
        if self.chat:
            body = {
                "index": choice.index,
                "delta": {"content": delta.text} if delta.text or finish is None else {},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            body = {"index": choice.index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}
        out = self._chunk([body])
        if self.stats:
            extra = {"spans": [list(s) for s in delta.spans]}
            if finish is not None and choice.stats is not None:
                extra.update(redwood_stats([choice.stats]), finish_reason=choice.engine_finish_reason)
            out["redwood"] = extra
        return out

    def usage(self, prompt_lens: list[int], choices) -> dict:
        out = self._chunk([])
        out["usage"] = usage(prompt_lens, choices)
        return out
