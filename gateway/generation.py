"""From an OpenAI request to a target Generate stream and back: the gateway's one piece of logic.

:func:`open_generation` picks a target (least outstanding first), sends the request and waits for
the target's header message, so every validation error surfaces *before* any HTTP response starts
(a proper 400, not a broken stream). Unreachable or draining targets are skipped, and so are full
ones (RESOURCE_EXHAUSTED, the target's typed "queue full"); with none left it is a 429 with
Retry-After if any target was full, else a 503.

The call carries a gRPC deadline (``request_timeout``): past it the target frees the request itself.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from specd.gateway.errors import APIError, invalid_request
from specd.gateway.schemas import ChatCompletionRequest, CompletionRequest
from specd.gateway.target_pool import TargetClient, TargetPool
from specd.services.common.wire import method_to_pb
from specd.v1 import common_pb2, target_pb2

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN)


def to_generate_request(body: ChatCompletionRequest | CompletionRequest, request_id: str) -> target_pb2.GenerateRequest:
    """The one conversion out: an OpenAI request (validated by its schema) as a Generate call."""
    sampling = common_pb2.SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(0, body.top_k or 0),
        top_p=1.0 if body.top_p is None else body.top_p,
    )
    if body.seed is not None:
        sampling.seed = body.seed % 2**64
    msg = target_pb2.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        max_tokens=body.token_limit() or 0,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        cache_salt=body.cache_salt or "",
    )
    if body.speculation is not None:
        method = body.speculation.method
        if method != "none" and body.speculation.num_tokens == 0:
            method = "none"  # zero guesses is speculation off
        msg.speculation.method = method_to_pb(method)
        msg.speculation.num_tokens = body.speculation.num_tokens or 0
    if isinstance(body, ChatCompletionRequest):
        msg.chat.messages.extend(target_pb2.ChatMessage(role=m.role, content=m.text()) for m in body.messages)
    elif isinstance(body.prompt, str):
        msg.text = body.prompt
    elif isinstance(body.prompt[0], str):
        msg.text = body.prompt[0]
    else:
        msg.tokens.token_ids.extend(body.prompt)
    return msg


@dataclass
class Generation:
    """An accepted generation on one target."""

    target: TargetClient
    call: grpc.aio.UnaryStreamCall
    request_id: str
    prompt_tokens: int

    async def messages(self) -> AsyncIterator[target_pb2.GenerateResponse]:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            yield msg

    def close(self) -> None:
        """Cancel the call if still running (frees the target's and the draft's state) and release
        the target's slot in the least-outstanding count. Idempotent."""
        if self.target is not None:
            self.call.cancel()
            self.target.outstanding -= 1
            self.target = None


async def open_generation(
    pool: TargetPool,
    body: ChatCompletionRequest | CompletionRequest,
    timeout: float,
    request_timeout: float | None = None,
    retry_after: int = 1,
) -> Generation:
    """``timeout``: seconds for a target to accept; ``request_timeout``: the whole call's deadline."""
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    request_id = uuid.uuid4().hex
    msg = to_generate_request(body, request_id)
    full = 0
    for target in pool.candidates():
        call = target.stub.Generate(msg, timeout=request_timeout)
        target.outstanding += 1
        header = None
        try:
            header = await asyncio.wait_for(call.read(), timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid_request(e, prompt_param) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                full += 1  # healthy, only busy: try the next one
            elif e.code() not in RETRYABLE:
                raise APIError(
                    503, "the target service failed to start the generation", code="service_unavailable"
                ) from None
            target.healthy = False  # until the next probe says otherwise
        except TimeoutError:
            pass  # try the next target
        finally:
            # Not accepted (an error, a timeout, an empty stream, or the client left while we
            # waited): give the slot back and make sure the call is gone.
            if header is None or header is grpc.aio.EOF:
                call.cancel()
                target.outstanding -= 1
        if header is not None and header is not grpc.aio.EOF:
            return Generation(target, call, request_id, header.prompt_tokens)
    if full:
        raise APIError(
            429,
            "the server is overloaded (every target's queue is full); retry after a moment",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )
    raise APIError(503, "no target service is available; retry later", code="service_unavailable")
