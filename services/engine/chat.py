"""Prompt encoding shared by the CLI, the benchmark and the gateway."""

from __future__ import annotations


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of raw text, without BOS/EOS additions."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already wrote any special tokens it wants; don't add more.
    return encode_text(tokenizer, text)
