"""uvicorn for the app, with the limits uvicorn 0.54 leaves out. `build_server(app, host, port)`
returns a `uvicorn.Server` to `run()`; it takes its limits from the app's `ServerSettings`.

What uvicorn 0.54 offers and what is added here:

- Request heads: uvicorn has no header timeout (`timeout_keep_alive` only runs between requests
  and stops at the first byte), so a client that sends half a request line holds its connection
  forever. `TimedH11Protocol`, the h11 protocol with a deadline, closes a connection whose
  request head is not complete `request_timeout` seconds after its first byte (or after the
  connection opened), answering a 408 JSON error if part of a head had arrived. Heads are at
  most 16 KiB (h11's `h11_max_incomplete_event_size` default; more is a 400). The body is
  timed by `guard.GuardMiddleware`, which reads it (also `request_timeout`, also a 408).
  The protocol is always h11, even where httptools is installed.
- Concurrency: `guard.ConcurrencyLimit` (a JSON 503), not uvicorn's `limit_concurrency`, which
  counts idle keep-alive connections as if they were requests and answers in plain text.
  Connections themselves are bounded in time, not number: idle ones by `timeout_keep_alive`
  (5 s) and the header deadline.
- Shutdown: on SIGINT/SIGTERM (or `should_exit`) uvicorn stops accepting and waits for the
  requests in flight. `GracefulServer` first calls the app's `begin_shutdown`, which refuses
  new requests with 503 and, after `shutdown_timeout` seconds, ends the rest with an error (a
  503 body, or an error event and `data: [DONE]`). uvicorn's `timeout_graceful_shutdown`, a few
  seconds longer, cancels whatever handler still runs after that; the engine thread then gets
  `shutdown_timeout` seconds to stop.
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from specjax.serve.errors import error_body

SHUTDOWN_BACKSTOP_S = 5.0   # uvicorn cancels handlers this long after the app failed them


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head."""

    request_timeout: float = 30.0   # set by `build_server` on a subclass

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False   # a byte of the next request head has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:   # these bytes begin a request
            self._head_started = True
            if self._head_timer is None:
                self._arm()
        super().data_received(data)
        if self.cycle is not cycle:   # a head was parsed: its request runs now
            self._disarm()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        # A pipelined head that had arrived only in part is timed from now.
        if (self.cycle is cycle and self.conn.trailing_data[0]
                and not self.transport.is_closing()):
            self._head_started = True
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm_timer()
        self._head_timer = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        self._disarm_timer()
        self._head_started = False

    def _disarm_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_started:   # h11 cannot answer a request it has not parsed: raw bytes
            body = json.dumps(error_body(408, f"the request head was not received within "
                                              f"{self.request_timeout:g} s", None,
                                         "request_timeout")).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                 b"content-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (len(body), body))
        self.transport.close()


class GracefulServer(uvicorn.Server):
    """A uvicorn server that tells the app when shutdown starts, so that it is bounded."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets=sockets)


def build_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info", **config: Any) -> GracefulServer:
    """A server for an app made by `create_app`; `config` goes to `uvicorn.Config`."""
    server = app.state.server
    settings = server.settings
    protocol = type("TimedH11Protocol", (TimedH11Protocol,),
                    {"request_timeout": settings.request_timeout})
    grace = math.ceil(settings.shutdown_timeout + SHUTDOWN_BACKSTOP_S)
    # No WebSocket routes: an Upgrade request is served as plain HTTP (and its head timed).
    uvicorn_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    http=protocol, ws="none", timeout_graceful_shutdown=grace,
                                    **config)
    return GracefulServer(uvicorn_config, on_shutdown=server.begin_shutdown)
