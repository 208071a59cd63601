"""The engine's token policy: which ids end a generation, how a prompt becomes ids, which prompts fit."""

from __future__ import annotations

from redwood.errors import ConfigError, ContextLengthError

# Special tokens that end a generation wherever a vocabulary has them (as llama.cpp's end-of-generation
# set): e.g. Qwen instruct files name only <|im_end|> as EOS, yet the model may also emit <|endoftext|>.
END_OF_GENERATION = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "</s>",
    "<|end|>",
    "<end_of_turn>",
)


def eos_token_ids(config, tokenizer) -> frozenset[int]:
    """EOS ids: the model config's, the tokenizer's EOS, and its end-of-generation special tokens."""
    ids = set(config.eos_token_ids)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        added = getattr(tokenizer, "added_tokens_encoder", {}) or {}
        for text in END_OF_GENERATION:
            if text in special or text in added:
                tid = tokenizer.convert_tokens_to_ids(text)
                if isinstance(tid, int) and 0 <= tid < config.vocab_size:
                    ids.add(tid)
    return frozenset(ids)


def encode_prompt(tokenizer, prompt, chat: bool = False, model_name: str = "the model") -> list[int]:
    """Token ids for a text prompt (through the chat template when `chat`), or ids as given."""
    if not isinstance(prompt, str):
        if chat:
            raise ConfigError("chat=True needs text prompts, not token ids")
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ConfigError("a prompt is a string or a sequence of token ids") from None
    if tokenizer is None:
        raise ConfigError(f"{model_name} has no tokenizer; pass token ids instead of text")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{model_name} has no chat template; drop --chat / chat=True")
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A ContextLengthError for an empty prompt, ids outside the vocabulary, or no room to generate."""
    if not ids:
        raise ContextLengthError("the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ContextLengthError(f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens but the context is {max_model_len} tokens "
            f"(at most {max_model_len - 1} prompt tokens leave room to generate)"
        )


def check_max_model_len(max_model_len, context: int) -> int:
    """max_model_len (None → the model's context), checked against the context."""
    if max_model_len is None:
        return context
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or not 2 <= max_model_len <= context:
        raise ConfigError(
            f"max_model_len must be an integer in [2, {context}] (the model's context), got {max_model_len!r}"
        )
    return max_model_len
