"""The gateway's door: the body size limit (413), the in-flight count, and refusals while draining (503).

A pure ASGI middleware, so it sees a streamed response end (the app's call returns only after the
last byte), which a request-level hook does not.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from specd.gateway.errors import error_body
from specd.services.common.drain import Drain

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a full 32k-token prompt as token ids is ~200 KB of JSON


async def _send_error(send, status: int, message: str, code: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Wraps the app; :attr:`in_flight` counts API requests until their last byte is sent."""

    def __init__(self, app, drain: Drain, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.drain = drain
        self.max_body_bytes = max_body_bytes
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)  # /health, /metrics, lifespan: never refused
            return
        if self.drain.draining:
            await _send_error(
                send, 503, "the server is shutting down; retry the request", "service_unavailable",
                [(b"connection", b"close")],
            )  # fmt: skip
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, 413, f"the request body is over {self.max_body_bytes} bytes", "request_too_large")
            return
        receive = self._limited(receive)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _limited(self, receive):
        """``receive`` that fails once a body sent without (or beyond) its Content-Length passes the
        limit (an HTTPException, which FastAPI's body reader passes on to the error handlers)."""
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, f"the request body is over {self.max_body_bytes} bytes")
            return message

        return limited
