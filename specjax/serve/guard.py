"""ASGI middleware in front of every route: a concurrency limit, the API-key check, and the
request body's size and time limits.

They run before FastAPI parses anything, so an unauthenticated, oversized or slow request
costs no JSON parsing and never reaches a handler. Every refusal is an OpenAI-style JSON error:

- more than `max_concurrency` requests in flight: 503 `server_busy` at once (GET /health and
  /metrics are exempt, so probes and scrapes still answer under load). This is a middleware
  rather than uvicorn's `limit_concurrency`, which also counts idle keep-alive connections and
  answers in plain text;
- a missing or wrong API key: 401;
- a body over `max_body_bytes` (whatever Content-Length claims, chunked too): 413;
- a body not received within `request_timeout` seconds of the request head: 408. The head
  itself is timed by the HTTP protocol (`http_server.py`).

A 408 or 413 closes the connection, since the rest of that body is never read.
"""
from __future__ import annotations

import asyncio
import hmac
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specjax.serve.errors import error_response

OPEN_PATHS = frozenset({"/health"})               # load balancers probe it without credentials
UNLIMITED_PATHS = frozenset({"/health", "/metrics"})  # cheap, and wanted most under load
CLOSE = {"Connection": "close"}


async def reject(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 on_reject: Callable[[int], None] | None = None) -> None:
    if on_reject is not None:
        on_reject(status)
    await error_response(status, message, None, code, headers)(scope, receive, send)


class ConcurrencyLimit:
    """At most `limit` HTTP requests in flight (streams included, until they end)."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[int], None] | None = None):
        if limit < 1:
            raise ValueError(f"the concurrency limit must be >= 1, got {limit}")
        self.app, self.limit, self.on_reject = app, limit, on_reject
        self.in_flight = 0   # the event loop is one thread: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            return await reject(scope, receive, send, 503,
                                f"the server is at its limit of {self.limit} concurrent "
                                "requests; retry later", "server_busy",
                                {"Retry-After": "1"}, self.on_reject)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class _TooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 on_reject: Callable[[int], None] | None = None,
                 request_timeout: float | None = None):
        # An empty key is refused where settings are made (`ServerSettings`), not again here.
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
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
                return await self._reject(scope, receive, send, 400, "invalid Content-Length",
                                          headers=CLOSE)
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        try:
            async with asyncio.timeout(self.request_timeout):
                body = await self._read_body(receive)
        except _TooLarge:
            return await self._too_large(scope, receive, send)
        except TimeoutError:
            return await self._reject(scope, receive, send, 408, f"the request body was not "
                                      f"received within {self.request_timeout:g} s",
                                      code="request_timeout", headers=CLOSE)
        if body is None:
            return  # the client left
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, bounded, whatever Content-Length claims (or chunked encoding);
        None if the client disconnected."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._reject(scope, receive, send, 413, f"request body exceeds "
                           f"{self.max_body_bytes} bytes", code="request_too_large",
                           headers=CLOSE)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, status: int,
                      message: str, code: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
        await reject(scope, receive, send, status, message, code, headers, self.on_reject)
