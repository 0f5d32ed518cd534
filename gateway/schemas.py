"""OpenAI request shapes (plus specd's extensions), validated strictly.

Wrong types are errors, not coercions (``"max_tokens": "10"`` is refused). Parameters specd does
not implement are refused with a clear message when set to anything but their neutral value,
rather than silently ignored; fields it does not know are ignored, as OpenAI clients add new ones.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specd.services.common.constants import MAX_SPECULATIVE_TOKENS, SPECULATION_METHODS

MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 1024  # a salt is a tenant's name or key, not a payload
MAX_JSON_DEPTH = 32  # the deepest request nests 5 levels; deeper is an attack, not a request
# Counts and ids travel as 32-bit integers to the target; larger values are refused here, not
# overflowed there (a context is far shorter than this anyway, and the target checks the vocabulary).
MAX_INT32 = 2**31 - 1
# C0 control characters other than tab, newline and carriage return: no tokenizer input needs them,
# and NUL in particular truncates text in C-based tooling downstream.
_CONTROL = frozenset(chr(c) for c in range(32)) - {"\t", "\n", "\r"}


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: text holds a lone UTF-16 surrogate (not valid Unicode)") from None
    if not _CONTROL.isdisjoint(s):
        c = next(ch for ch in s if ch in _CONTROL)
        raise ValueError(f"{where}: control character U+{ord(c):04X} is not allowed in text")


def check_raw_json(value: Any) -> None:
    """Refuse what no schema would: nesting past MAX_JSON_DEPTH, lone surrogates and control
    characters in any string (key or value). Iterative, so a deep document cannot exhaust the stack."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "body")]
    while stack:
        v, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"the request nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str):
                    _check_text(k, where)
                stack.append((item, depth + 1, k if where == "body" else f"{where}.{k}"))
        elif isinstance(v, list):
            stack.extend((item, depth + 1, where) for item in v)


class _Strict(BaseModel):
    # No NaN or infinity: Python's JSON parser accepts them, no OpenAI parameter means anything by them.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class Speculation(_Strict):
    """specd extension: how this request speculates."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal[SPECULATION_METHODS] | None = None
    num_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32)] | None = None  # extension; 0 or -1 = off (as vLLM)
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension (vLLM)
    return_token_ids: bool = False  # extension (as vLLM): each choice also carries its token ids
    # extension: each choice also carries, per token, "draft" (an accepted guess) or "target"
    return_token_sources: bool = False
    speculation: Speculation | None = None
    # extension (vLLM): the prefix cache serves this request only what requests with the same salt
    # left there (tenants that must not learn from each other's timing)
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    user: str | None = None
    # Accepted only at their neutral values (see module docstring).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    tools: list | None = None
    response_format: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _raw(cls, data: Any) -> Any:
        check_raw_json(data)
        return data

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v):
        if v is not None and not -(2**63) <= v < 2**64:
            raise ValueError("seed must fit in 64 bits")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported; send n separate requests (with different seeds) instead")
        if self.presence_penalty not in (None, 0.0) or self.frequency_penalty not in (None, 0.0):
            raise ValueError("presence_penalty / frequency_penalty are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        if self.echo or (self.best_of not in (None, 1)) or self.suffix:
            raise ValueError("echo, best_of and suffix are not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only type 'text' is supported")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: (
        str
        | Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT32)]], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_non_empty(cls, v):
        if v == "" or v == [""]:
            raise ValueError("prompt must not be empty")
        return v

    def token_limit(self) -> int | None:
        # OpenAI's completions default is 16 tokens.
        return self.max_tokens or 16
