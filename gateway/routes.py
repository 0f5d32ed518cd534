"""HTTP endpoints: OpenAI chat completions and completions (streaming or not), models, health, metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import grpc
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specd.gateway.errors import APIError, error_body
from specd.gateway.generation import RETRYABLE, Generation, open_generation
from specd.gateway.metrics import TokenTimer
from specd.gateway.schemas import ChatCompletionRequest, CompletionRequest
from specd.gateway.settings import GatewaySettings
from specd.gateway.target_pool import TargetPool
from specd.v1 import target_pb2

log = logging.getLogger(__name__)

# OpenAI has no "abort": a cancelled generation (which no client sees) reads as "stop".
_FINISH = {
    target_pb2.FINISH_REASON_STOP: "stop",
    target_pb2.FINISH_REASON_LENGTH: "length",
    target_pb2.FINISH_REASON_ABORT: "stop",
}
_SOURCES = {target_pb2.TOKEN_SOURCE_DRAFT: "draft", target_pb2.TOKEN_SOURCE_TARGET: "target"}


def _state(request: Request) -> tuple[GatewaySettings, TargetPool]:
    return request.app.state.settings, request.app.state.pool


async def require_api_key(request: Request) -> None:
    settings: GatewaySettings = request.app.state.settings
    if settings.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or token.strip() != settings.api_key:
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")


def _served_model(request: Request, body_model: str | None) -> str:
    settings, pool = _state(request)
    name = settings.served_model_name or pool.model_name()
    if name is None:
        raise APIError(503, "no target service is available; retry later", code="service_unavailable")
    if body_model is not None and body_model != name:
        raise APIError(
            404, f"the model '{body_model}' does not exist; this server serves '{name}'", "model", "model_not_found"
        )
    return name


def _usage(prompt_tokens: int, last) -> dict:
    completion = last.completion_tokens if last is not None else 0
    st = last.stats if last is not None else None
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": last.cached_prompt_tokens if last is not None else 0},
        "speculation": {
            "proposed_tokens": st.proposed_tokens if st else 0,
            "accepted_tokens": st.accepted_tokens if st else 0,
            "target_forward_passes": st.target_forward_passes if st else 0,
            # Guesses asked for per verification (for "auto": what the controller chose).
            "mean_k": round(st.block_tokens / st.target_forward_passes, 3) if st and st.target_forward_passes else 0.0,
        },
    }


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Shape:
    """What differs between chat.completion and text_completion objects."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat = chat
        self.object = "chat.completion.chunk" if chat else "text_completion"  # of a streamed chunk
        self.base = {"id": rid, "created": int(time.time()), "model": model}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self.base, "object": self.object, "choices": [choice]}

    def full(self, text: str, finish: str | None, usage: dict) -> dict:
        if self.chat:
            msg = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}
            return {**self.base, "object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.base, "object": "text_completion", "choices": [choice], "usage": usage}


def _finish_reason(msg: target_pb2.GenerateResponse | None) -> str | None:
    """The OpenAI finish_reason of a Generate message (None until the last one)."""
    return _FINISH.get(msg.finish_reason) if msg is not None else None


def _token_extras(choice: dict, msg_ids, msg_sources, token_ids: bool, token_sources: bool) -> None:
    """specd's per-token extensions of a choice: the token ids and where each token came from."""
    if token_ids:
        choice["token_ids"] = list(msg_ids)
    if token_sources:
        choice["token_sources"] = [_SOURCES.get(s, "target") for s in msg_sources]


def _failure_status(e: grpc.aio.AioRpcError) -> str:
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "504"
    return "503" if e.code() in RETRYABLE else "500"


def _failure_body(e: grpc.aio.AioRpcError) -> dict:
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        # The call's own deadline (--request-timeout): the target has freed the request already.
        return error_body(504, "the generation ran past the gateway's request timeout", None, "timeout")
    if e.code() in RETRYABLE:
        return error_body(
            503,
            "the target service became unavailable during generation; retry the request",
            None,
            "service_unavailable",
        )
    return error_body(500, "the target service failed during generation; retry the request")


def _failure_response(e: grpc.aio.AioRpcError) -> Response:
    body = _failure_body(e)
    return JSONResponse(body, status_code=int(_failure_status(e)))


async def _stream(
    gen: Generation, shape: _Shape, include_usage: bool, token_ids: bool, token_sources: bool, timer: TokenTimer
) -> AsyncIterator[str]:
    status = "cancelled"  # unless we get to the end: the client went away
    last = None
    extra = {"usage": None} if include_usage else {}
    try:
        if shape.chat:
            yield _sse({**shape.chunk("", None, first=True), **extra})
        async for msg in gen.messages():
            last = msg
            timer.chunk(len(msg.token_ids))
            if msg.text or ((token_ids or token_sources) and msg.token_ids):
                chunk = shape.chunk(msg.text, None)
                _token_extras(chunk["choices"][0], msg.token_ids, msg.sources, token_ids, token_sources)
                yield _sse({**chunk, **extra})
            finish = _finish_reason(msg)
            if finish:
                yield _sse({**shape.chunk(None if shape.chat else "", finish), **extra})
                break
        if include_usage:
            yield _sse(
                {
                    **shape.base,
                    "object": shape.object,
                    "choices": [],
                    "usage": _usage(gen.prompt_tokens, last),
                }
            )
        yield "data: [DONE]\n\n"
        status = "200"
    except grpc.aio.AioRpcError as e:
        # Tokens were already sent, so the request cannot move to another target unseen: end the
        # stream with an error event the client can act on (a 503 is retryable).
        status = _failure_status(e)
        yield _sse(_failure_body(e))
        yield "data: [DONE]\n\n"
    finally:
        gen.close()
        timer.finish(status)


async def _open(pool: TargetPool, body: ChatCompletionRequest | CompletionRequest, settings: GatewaySettings):
    return await open_generation(
        pool, body, settings.first_message_timeout, settings.request_timeout, settings.retry_after
    )


async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> Response:
    timer = TokenTimer()
    try:
        model = _served_model(request, body.model)
        settings, pool = _state(request)
        gen = await _open(pool, body, settings)
    except APIError as e:
        timer.finish(str(e.status))
        raise
    shape = _Shape(chat, ("chatcmpl-" if chat else "cmpl-") + gen.request_id, model)
    if body.stream:
        return StreamingResponse(
            _stream(gen, shape, body.include_usage(), body.return_token_ids, body.return_token_sources, timer),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    # Nothing has reached the client yet, so a target that dies mid-generation costs only a retry
    # on another replica (its tokens are thrown away; only the kept attempt's are timed).
    attempts = 1
    while True:
        text, ids, sources, last, arrivals = [], [], [], None, []
        try:
            async for msg in gen.messages():
                last = msg
                arrivals.append((len(msg.token_ids), time.perf_counter()))
                text.append(msg.text)
                ids.extend(msg.token_ids)
                sources.extend(msg.sources)
            break
        except grpc.aio.AioRpcError as e:
            # The deadline is the request's own: another target would run past it too.
            retry = e.code() in RETRYABLE and e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            retry = retry and attempts < len(pool.targets)
            if not retry:
                timer.finish(_failure_status(e))
                return _failure_response(e)
            log.warning("target %s failed mid-generation (%s); retrying on another", gen.target.address, e.code())
            gen.target.healthy = False
        finally:
            gen.close()
        attempts += 1
        try:
            gen = await _open(pool, body, settings)
        except APIError as e:
            timer.finish(str(e.status))
            raise
    for n, at in arrivals:
        timer.chunk(n, at)
    timer.finish("200")
    finish = _finish_reason(last) or "stop"
    result = shape.full("".join(text), finish, _usage(gen.prompt_tokens, last))
    _token_extras(result["choices"][0], ids, sources, body.return_token_ids, body.return_token_sources)
    return JSONResponse(result)


def build_router() -> APIRouter:
    router = APIRouter()
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(request, body, chat=True)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(request, body, chat=False)

    @v1.get("/models")
    async def models(request: Request) -> dict:
        name = _served_model(request, None)
        info = request.app.state.pool.info()
        card = {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "specd"}
        if info is not None:
            card["max_model_len"] = info.max_context
        return {"object": "list", "data": [card]}

    @router.get("/health")
    async def health(request: Request) -> Response:
        pool: TargetPool = request.app.state.pool
        if request.app.state.drain.draining:  # out of the load balancer before the process goes
            return JSONResponse({"status": "draining"}, status_code=503)
        await pool.refresh()
        ready = [t for t in pool.targets if t.fully_healthy]
        body = {
            "status": "ok" if ready else "unavailable",
            "targets": [
                {
                    "address": t.address,
                    "healthy": t.healthy,
                    "drafts_healthy": t.drafts_healthy,
                    "drafts_total": t.drafts_total,
                    "outstanding": t.outstanding,
                }
                for t in pool.targets
            ],
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    router.include_router(v1)
    return router
