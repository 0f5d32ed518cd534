"""The target service's edge: GenerateRequest in; GenerateResponse, InfoResponse and the typed
INVALID_ARGUMENT out. No other module of the target reads or builds a target message.

The request's values are validated here only as far as the wire form goes (a prompt is given, the
chat template applies, max_tokens fits the context); the engine validates the rest once, when it
takes the request (:meth:`~specd.services.engine.engine.Engine.add_request`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from specd.services.common.constants import DEFAULT_SPECULATION_METHOD, default_num_tokens
from specd.services.common.convert import sampling_from_pb
from specd.services.common.wire import REQUEST_ERROR_METADATA_KEY, method_from_pb, methods_to_pb
from specd.services.engine.chat import encode_chat, encode_text
from specd.services.engine.engine import EngineLimits, Request, SpecConfig, StepOutput
from specd.services.engine.errors import ErrorCode, Field, RequestError
from specd.services.engine.stats import SpecStats
from specd.v1 import common_pb2, target_pb2

_FIELDS = {
    Field.NONE: target_pb2.REQUEST_FIELD_UNSPECIFIED,
    Field.PROMPT: target_pb2.REQUEST_FIELD_PROMPT,
    Field.MESSAGES: target_pb2.REQUEST_FIELD_MESSAGES,
    Field.SPECULATION: target_pb2.REQUEST_FIELD_SPECULATION,
}
_CODES = {
    ErrorCode.INVALID_VALUE: target_pb2.REQUEST_ERROR_CODE_INVALID_VALUE,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: target_pb2.REQUEST_ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
}
_FINISH = {
    None: target_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": target_pb2.FINISH_REASON_STOP,
    "length": target_pb2.FINISH_REASON_LENGTH,
    "abort": target_pb2.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for what it leaves unset."""

    method: str = DEFAULT_SPECULATION_METHOD
    num_tokens: int | None = None  # None: default_num_tokens(method)

    def k(self, method: str) -> int:
        return self.num_tokens if self.num_tokens is not None else default_num_tokens(method)


def request_from_pb(
    msg: target_pb2.GenerateRequest, tokenizer, limits: EngineLimits, defaults: RequestDefaults
) -> Request:
    """Tokenize (or template) the prompt and build the engine's Request; :class:`RequestError` for
    what the client must fix. Milliseconds for a long prompt: call it off the event loop."""
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        prompt = encode_text(tokenizer, msg.text)
    elif kind == "chat":
        if not msg.chat.messages:
            raise RequestError("messages must not be empty", Field.MESSAGES)
        try:
            prompt = encode_chat(tokenizer, [{"role": m.role, "content": m.content} for m in msg.chat.messages])
        except Exception as e:  # jinja errors from the model's template (e.g. a role it rejects)
            raise RequestError(f"could not apply the chat template: {e}", Field.MESSAGES) from None
    elif kind == "tokens":
        prompt = list(msg.tokens.token_ids)
    else:
        raise RequestError("a prompt is required", Field.PROMPT)
    max_len = limits.max_len
    if msg.max_tokens and len(prompt) + msg.max_tokens > max_len:
        raise RequestError(
            f"this model's maximum context length is {max_len} tokens; you requested "
            f"{len(prompt) + msg.max_tokens} tokens ({len(prompt)} in the prompt, {msg.max_tokens} to generate)",
            Field.PROMPT,
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        )
    # Unset max_tokens: up to the context. (An empty or over-long prompt is refused by the engine;
    # max(1, ...) only keeps SamplingParams from refusing it first.)
    max_tokens = msg.max_tokens or max(1, max_len - len(prompt))
    params = sampling_from_pb(msg.sampling, max_tokens=max_tokens, stop=tuple(msg.stop), ignore_eos=msg.ignore_eos)
    try:
        method = method_from_pb(msg.speculation.method) or defaults.method
    except ValueError as e:
        raise RequestError(str(e), Field.SPECULATION) from None
    num = msg.speculation.num_tokens or defaults.k(method)
    spec = SpecConfig(method, 0 if method == "none" else num)
    return Request(msg.request_id or uuid.uuid4().hex, tuple(prompt), params, spec, msg.cache_salt)


def request_error_status(err: RequestError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """``context.abort`` arguments for a client's mistake: INVALID_ARGUMENT, the message, and the
    typed RequestError the gateway reads (never the message)."""
    typed = target_pb2.RequestError(field=_FIELDS[err.field], code=_CODES[err.code])
    return grpc.StatusCode.INVALID_ARGUMENT, err.message, ((REQUEST_ERROR_METADATA_KEY, typed.SerializeToString()),)


def header_pb(prompt_tokens: int) -> target_pb2.GenerateResponse:
    """The first message: the request is accepted."""
    return target_pb2.GenerateResponse(prompt_tokens=prompt_tokens)


def _stats_pb(st: SpecStats) -> target_pb2.SpeculationStats:
    return target_pb2.SpeculationStats(
        proposed_tokens=st.proposed_tokens,
        accepted_tokens=st.accepted_tokens,
        target_forward_passes=st.target_forward_passes,
        block_tokens=st.block_tokens,
    )


def response_to_pb(out: StepOutput, completion_tokens: int) -> target_pb2.GenerateResponse:
    n, d = len(out.token_ids), out.num_from_draft
    return target_pb2.GenerateResponse(
        token_ids=out.token_ids,
        sources=[target_pb2.TOKEN_SOURCE_DRAFT] * d + [target_pb2.TOKEN_SOURCE_TARGET] * (n - d),
        text=out.text,
        finish_reason=_FINISH[out.finish_reason],
        completion_tokens=completion_tokens,
        stats=_stats_pb(out.stats) if out.stats is not None else None,
        cached_prompt_tokens=out.cached_prompt_tokens,
    )


def info_pb(model_name: str, limits: EngineLimits, max_speculative_tokens: int) -> common_pb2.InfoResponse:
    return common_pb2.InfoResponse(
        model_name=model_name,
        vocab_size=limits.vocab_size,
        max_context=limits.max_len,
        role="target",
        speculation_methods=methods_to_pb(limits.speculation_methods),
        max_speculative_tokens=max_speculative_tokens,
    )
