"""The FastAPI app: OpenAI routes, and llama.cpp's /completion and /infill (for editors), over
one `EngineThread`.

A request is validated completely (types by pydantic, values by `specjax.validation`, prompt
against the vocabulary and context, output length against the room the prompt leaves) before
it is handed to the engine thread; only then does a 200 or an event stream start. Rendering and
tokenising the prompt run in a worker thread (`prepare.py`), never on the event loop; text
deltas are computed incrementally on the loop (`text_stream.py`).

A request with several choices (`n`, batched prompts) submits one engine request per choice,
all at once or none (429); its stream interleaves the choices' chunks, each with its `index`,
and the choices' text and logprobs are computed by `choices.ChoiceStream` whether streamed or
not. A request that fails in the engine gets an error of its own (a 500 body, or an error event
and `data: [DONE]` in a stream) -- any failing choice fails its whole request and cancels the
other choices; other requests go on. Shutdown is bounded: `begin_shutdown` (called
when uvicorn starts shutting down, see `http_server.py`) refuses new requests with 503 and
gives those in flight `shutdown_timeout` seconds before ending them with a 503 error.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse

from specjax.llm import LLM
from specjax.chat import ChatTemplate
from specjax.infill import FimFormat
from specjax.serve.engine_thread import (EngineFailure, EngineStopped, EngineThread, Event,
                                         QueueFull, Submission)
from specjax.serve.errors import APIError, error_body, install_error_handlers
from specjax.serve.guard import ConcurrencyLimit, GuardMiddleware
from specjax.serve.hosts import LOOPBACK_HOSTS, HostGuard, normalize_host
from specjax.serve.metrics import CONTENT_TYPE, ServerMetrics
from specjax.serve.choices import ChoiceStream
from specjax.serve.logprobs import TokenTexts
from specjax.serve.prepare import Prepared, RequestPreparer
from specjax.serve.protocol import (ChatCompletionRequest, ChatFormat, CompletionFormat,
                                    CompletionRequest, InfillRequest, LlamaCompletionRequest,
                                    LlamaCppRequest, LlamaFormat, request_field_names,
                                    total_usage)

log = logging.getLogger("specjax.serve")

SHUTDOWN_FAILURE = EngineFailure("the server shut down before the request completed", 503,
                                 "shutting_down")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Limits and identity of one server."""

    model_names: tuple[str, ...] = ("specjax",)  # the first is listed by /v1/models
    api_key: str | None = None        # None: no auth; an empty key is refused
    max_queue: int = 256              # requests waiting for a slot before 429s
    max_tokens_cap: int | None = None  # default: the context length
    max_body_bytes: int = 1 << 20
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # Host headers answered; "*": any
    max_concurrency: int = 512        # HTTP requests in flight before 503s
    request_timeout: float = 30.0     # seconds to receive a request's head, and its body
    shutdown_timeout: float = 30.0    # seconds requests get to finish once shutdown starts

    def __post_init__(self):
        if not self.model_names:
            raise ValueError("model_names must hold at least one name")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a key, or none to serve without auth")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("request_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts must hold at least one host (or '*')")
        object.__setattr__(self, "allowed_hosts",
                           tuple(normalize_host(h) for h in self.allowed_hosts))


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Server:
    """Route logic, kept apart from FastAPI wiring so it reads top to bottom."""

    def __init__(self, llm: LLM, settings: ServerSettings, chat_template: ChatTemplate):
        if llm.tokenizer is None:
            raise ValueError("the server needs a tokenizer: load a checkpoint folder with "
                             "tokenizer.json, or pass LLM(..., tokenizer=...)")
        self.llm, self.settings, self.chat_template = llm, settings, chat_template
        self.tokenizer = llm.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)
        engine = llm.engine
        # Immutable engine facts, read here once so handlers never touch the engine.
        self.vocab_size = engine.model_config.vocab_size
        self.max_len = engine.max_len
        self.matmul = engine.stats.matmul   # which matmul the steps run (/health)
        self.max_tokens_cap = min(settings.max_tokens_cap or self.max_len, self.max_len)
        self.eos_token_ids = tuple(engine.eos_token_ids)
        self.prepare = RequestPreparer(self.tokenizer, chat_template, settings.model_names,
                                       self.vocab_size, self.max_len, self.max_tokens_cap,
                                       engine.grammars, FimFormat(self.tokenizer))
        self.metrics = ServerMetrics()
        self.engine_thread = EngineThread(engine, settings.max_queue,
                                          on_finished=self.metrics.observe_finished)
        self.metrics.watch(self.engine_thread)
        self.created = int(time.time())
        self.shutting_down = False
        self._shutdown_timer: asyncio.TimerHandle | None = None

    # -- generation ----------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prepared = await run_in_threadpool(self.prepare.completion, body)
        fmt = CompletionFormat(self.settings.model_names[0], self.token_texts)
        return await self.generate(request, prepared, body.stream, body.include_usage, fmt,
                                   logprobs=body.logprobs is not None)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        prepared = await run_in_threadpool(self.prepare.chat, body)
        fmt = ChatFormat(self.settings.model_names[0], self.token_texts, body.top_logprobs or 0)
        return await self.generate(request, prepared, body.stream, body.include_usage, fmt,
                                   logprobs=bool(body.logprobs))

    async def llama_completion(self, body: LlamaCompletionRequest, request: Request) -> Response:
        return await self.llama(body, request, self.prepare.llama_completion)

    async def infill(self, body: InfillRequest, request: Request) -> Response:
        return await self.llama(body, request, self.prepare.infill)

    async def llama(self, body: LlamaCppRequest, request: Request,
                    prepare: Callable[[Any], Prepared]) -> Response:
        """llama.cpp's endpoints: one choice, its payloads (`protocol.LlamaFormat`)."""
        prepared = await run_in_threadpool(prepare, body)
        params = prepared.params[0]
        fmt = LlamaFormat(self.settings.model_names[0], self.tokenizer,
                          self.eos_token_ids + params.stop_token_ids, params.stop,
                          warm_up=body.n_predict == 0, truncated=prepared.truncated,
                          return_tokens=body.return_tokens, response_fields=body.response_fields)
        return await self.generate(request, prepared, body.stream, False, fmt, logprobs=False)

    async def generate(self, request: Request, prepared: Prepared, stream: bool | None,
                       include_usage: bool, fmt: CompletionFormat, logprobs: bool) -> Response:
        """Submit every choice of the request (all or none), then answer with one body or a
        stream. Any choice that fails fails the whole request and cancels the others."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", None, "shutting_down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        choices = prepared.choices()

        def deliver_to(index: int):
            return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (index, event))

        limits = prepared.limits
        subs = [Submission(c.prompt_ids, c.params, stream=bool(stream),
                           deliver=deliver_to(c.index),
                           until=limits.start(self.tokenizer) if limits else None)
                for c in choices]
        streams = [ChoiceStream(c.index, self.tokenizer, c.params.stop, logprobs, c.echo)
                   for c in choices]
        try:
            self.engine_thread.submit_all(subs)
        except QueueFull as e:
            raise APIError(429, str(e), None, "queue_full") from None
        except EngineStopped as e:
            raise APIError(503, str(e), None, "engine_stopped") from None
        if stream:
            return StreamingResponse(self.stream(subs, streams, queue, fmt, include_usage,
                                                 prepared.n),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        finals = await self.wait_final(request, subs, queue)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        failure = next((e for e in finals if isinstance(e, EngineFailure)), None)
        if failure is not None:
            raise APIError(failure.status, failure.message, None, failure.code)
        body = []
        for cs, out in zip(streams, finals):
            text, entries = cs.update(out)
            body.append(fmt.choice(cs.index, text, entries, out))
        return JSONResponse(fmt.response(body, total_usage(finals, prepared.n)))

    def cancel_all(self, subs: list[Submission]) -> None:
        for sub in subs:   # a no-op for those already over
            self.engine_thread.cancel(sub)

    async def wait_final(self, request: Request, subs: list[Submission],
                         queue: asyncio.Queue[tuple[int, Event]]) -> list[Event] | None:
        """Every choice's final event in choice order -- or, as soon as one fails, that
        failure (and the others cancelled); None (all cancelled) if the client disconnects."""
        finals: dict[int, Event] = {}
        gone = asyncio.ensure_future(_disconnected(request))
        get: asyncio.Future | None = None
        try:
            while len(finals) < len(subs):
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    return None
                index, event = get.result()
                if isinstance(event, EngineFailure):
                    return [event]
                finals[index] = event
            return [finals[i] for i in range(len(subs))]
        finally:
            if get is not None:
                get.cancel()
            gone.cancel()
            # Whatever ended this wait (answered, a failure, the client left, or the handler
            # was cancelled at shutdown), nothing of this request may go on running.
            self.cancel_all(subs)

    async def stream(self, subs: list[Submission], streams: list[ChoiceStream],
                     queue: asyncio.Queue[tuple[int, Event]], fmt: CompletionFormat,
                     include_usage: bool, n: int) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's format: the choices' chunks interleave, each with its
        index and its own finish chunk; one usage chunk at the end if asked for. A failing
        choice ends the stream with an error event (the others are cancelled). Leaving early
        (the client disconnected and Starlette cancelled us) cancels every choice, which frees
        their KV blocks."""
        finished = 0
        try:
            for chunk in fmt.first_chunks(len(subs)):
                yield _sse(chunk)
            while finished < len(subs):
                failure = None
                for index, event in (await _newest(queue)).items():
                    if isinstance(event, EngineFailure):
                        failure = event
                        break
                    cs = streams[index]
                    delta, entries = cs.update(event)
                    if event.finished:
                        finished += 1
                    if delta or entries or event.finished:
                        for chunk in fmt.chunks(index, delta, entries, event, include_usage):
                            yield _sse(chunk)
                if failure is not None:
                    self.cancel_all(subs)
                    yield _sse(error_body(failure.status, failure.message, None, failure.code))
                    break
            else:
                if include_usage:
                    yield _sse(fmt.usage_chunk(total_usage([cs.final for cs in streams], n)))
            if fmt.sse_done:
                yield SSE_DONE
        finally:
            self.cancel_all(subs)

    # -- shutdown ------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Refuse new requests; those in flight get `shutdown_timeout` seconds, then a 503
        error. Called on the event loop when uvicorn starts shutting down."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self.engine_thread.begin_stop()
        timeout = self.settings.shutdown_timeout
        log.info("shutting down: %d request(s) in flight get %g s to finish",
                 self.engine_thread.num_active, timeout)
        self._shutdown_timer = asyncio.get_running_loop().call_later(timeout,
                                                                     self.fail_remaining)

    def fail_remaining(self) -> None:
        failed = self.engine_thread.fail_all(SHUTDOWN_FAILURE)
        if failed:
            log.warning("shutdown: ended %d unfinished request(s) with an error", failed)

    async def stop_engine(self) -> None:
        """The end of the app's lifespan: nothing may outlive it, and the engine thread gets
        a bounded time to stop (a step hung on the device leaves its daemon thread behind)."""
        self.shutting_down = True
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        self.fail_remaining()
        await asyncio.to_thread(self.engine_thread.stop, self.settings.shutdown_timeout)

    # -- the rest ------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.settings.model_names[0], "object": "model", "created": self.created,
             "owned_by": "specjax", "max_model_len": self.max_len}]}


async def _newest(queue: asyncio.Queue[tuple[int, Event]]) -> dict[int, Event]:
    """Per choice, its newest queued event (outputs are cumulative, so it says it all); a
    failure, a request's last event, is never replaced."""
    index, event = await queue.get()
    newest = {index: event}
    while not queue.empty():
        index, event = queue.get_nowait()
        newest[index] = event
    return newest


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(llm: LLM, settings: ServerSettings = ServerSettings(),
               chat_template: ChatTemplate | None = None) -> FastAPI:
    """An app serving `llm` (already warmed up). The engine thread starts and stops with the
    app's lifespan; `app.state.server` exposes it (and the metrics) to tests and tools. Run it
    with `http_server.build_server`, which adds the header timeout and bounded shutdown."""
    if chat_template is None:
        chat_template = ChatTemplate.from_tokenizer(llm.tokenizer)
    server = Server(llm, settings, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_thread.start()
        try:
            yield
        finally:
            await server.stop_engine()

    app = FastAPI(title="specjax", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    reject = lambda status: server.metrics.rejected.labels(status=str(status)).inc()
    install_error_handlers(app, on_error=reject, fields=request_field_names())
    # The last added runs first: Host check, then the concurrency limit, then auth and body.
    app.add_middleware(GuardMiddleware, api_key=settings.api_key,
                       max_body_bytes=settings.max_body_bytes, on_reject=reject,
                       request_timeout=settings.request_timeout)
    app.add_middleware(ConcurrencyLimit, limit=settings.max_concurrency, on_reject=reject)
    app.add_middleware(HostGuard, allowed_hosts=settings.allowed_hosts, on_reject=reject)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    # llama.cpp's own endpoints, for the editors and tools written against its server.
    @app.post("/completion")
    async def llama_completion(body: LlamaCompletionRequest, request: Request) -> Response:
        return await server.llama_completion(body, request)

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request) -> Response:
        return await server.infill(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not server.engine_thread.alive:
            status = "shutting down" if server.shutting_down else "engine stopped"
            return JSONResponse({"status": status}, status_code=503)
        # Answered while a first start still compiles in the background: requests are
        # served meanwhile (each compiles what it needs first).
        return JSONResponse({"status": "ok", "warming_up": server.engine_thread.warming,
                             "matmul": server.matmul})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app
