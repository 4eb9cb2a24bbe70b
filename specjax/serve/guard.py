"""ASGI middleware in front of every route: API-key check and request-body size limit.

It runs before FastAPI parses anything, so an unauthenticated or oversized request costs no
JSON parsing and never reaches a handler.
"""
from __future__ import annotations

import hmac
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specjax.serve.errors import error_response

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 on_reject: Callable[[int], None] | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject or (lambda status: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            # compare_digest: the time taken does not depend on how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return await self._reject(scope, receive, send, 401,
                                          "missing or invalid API key (send 'Authorization: "
                                          "Bearer <key>')", code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await self._reject(scope, receive, send, 400, "invalid Content-Length")
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        # Read the body here, bounded, whatever Content-Length claims (or chunked encoding).
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._reject(scope, receive, send, 413, f"request body exceeds "
                           f"{self.max_body_bytes} bytes", code="request_too_large")

    async def _reject(self, scope: Scope, receive: Receive, send: Send, status: int,
                      message: str, code: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
        self.on_reject(status)
        await error_response(status, message, None, code, headers)(scope, receive, send)
