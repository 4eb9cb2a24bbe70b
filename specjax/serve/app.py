"""The FastAPI app: OpenAI routes over one `EngineThread`.

A request is validated completely (types by pydantic, values by `specjax.validation`, prompt
against the vocabulary and context) before it is handed to the engine thread; only then does a
200 or an event stream start. Text deltas are computed on the event loop from the cumulative
token ids the engine thread delivers.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specjax.llm import LLM
from specjax.sampling_params import SamplingParams
from specjax.serve.chat import ChatTemplate
from specjax.serve.engine_thread import (EngineFailure, EngineStopped, EngineThread, Event,
                                         QueueFull, Submission)
from specjax.serve.errors import INTERNAL_ERROR, APIError, error_body, install_error_handlers
from specjax.serve.guard import GuardMiddleware
from specjax.serve.metrics import CONTENT_TYPE, ServerMetrics
from specjax.serve.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest,
                                    ChatFormat, CompletionFormat, CompletionRequest,
                                    finish_reason, request_field_names)
from specjax.serve.text_stream import TextStream
from specjax.validation import InvalidArgument, check_prompt, check_request


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Limits and identity of one server."""

    model_names: tuple[str, ...] = ("specjax",)  # the first is listed by /v1/models
    api_key: str | None = None
    max_queue: int = 256              # requests waiting for a slot before 429s
    max_tokens_cap: int | None = None  # default: the context length
    max_body_bytes: int = 1 << 20

    def __post_init__(self):
        if not self.model_names:
            raise ValueError("model_names must hold at least one name")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")


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
        engine = llm.engine
        # Immutable engine facts, read here once so handlers never touch the engine.
        self.vocab_size = engine.model_config.vocab_size
        self.max_len = engine.max_len
        self.max_tokens_cap = min(settings.max_tokens_cap or self.max_len, self.max_len)
        self.metrics = ServerMetrics()
        self.engine_thread = EngineThread(engine, settings.max_queue,
                                          on_finished=self.metrics.observe_finished)
        self.metrics.watch(self.engine_thread)
        self.created = int(time.time())

    # -- validation ----------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.settings.model_names:
            raise APIError(400, f"model {model!r} is not served here; this server serves "
                                f"{self.settings.model_names[0]!r}", "model", "model_not_found")

    def check_prompt_ids(self, prompt_ids: Sequence[int], params: SamplingParams,
                         param: str) -> None:
        """What `Engine.validate` will check, run here so that failures are 400s."""
        check_prompt(prompt_ids, self.vocab_size, self.max_len, param=param)
        check_request(prompt_ids, params, SamplingParams, self.vocab_size, self.max_len)

    def completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument("prompt", f"prompt holds {len(prompt)} prompts; this "
                                                "server takes one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=True)
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise InvalidArgument("messages", "messages must hold at least one message")
        text = self.chat_template.render([{"role": m.role, "content": m.text()}
                                          for m in body.messages])
        return self.tokenizer.encode(text, add_bos=self.chat_template.add_bos)

    # -- generation ----------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        params = body.sampling_params(COMPLETIONS_DEFAULT_MAX_TOKENS, self.max_tokens_cap)
        prompt_ids = self.completion_prompt(body.prompt)
        self.check_prompt_ids(prompt_ids, params, "prompt")
        return await self.generate(request, prompt_ids, params, body.stream, body.include_usage,
                                   CompletionFormat(self.settings.model_names[0]))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        params = body.sampling_params(self.max_tokens_cap, self.max_tokens_cap)
        prompt_ids = self.chat_prompt(body)
        self.check_prompt_ids(prompt_ids, params, "messages")
        return await self.generate(request, prompt_ids, params, body.stream, body.include_usage,
                                   ChatFormat(self.settings.model_names[0]))

    async def generate(self, request: Request, prompt_ids: list[int], params: SamplingParams,
                       stream: bool | None, include_usage: bool,
                       fmt: CompletionFormat) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        sub = Submission(prompt_ids, params, stream=bool(stream),
                         deliver=lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
        try:
            self.engine_thread.submit(sub)
        except QueueFull as e:
            raise APIError(429, str(e), None, "queue_full") from None
        except EngineStopped as e:
            raise APIError(503, str(e), None, "engine_stopped") from None
        if stream:
            return StreamingResponse(self.stream(sub, queue, fmt, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        event = await self.wait_final(request, sub, queue)
        if event is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(event, EngineFailure):
            raise APIError(500, INTERNAL_ERROR, None, "internal_error")
        return JSONResponse(fmt.response(event.text, event))

    async def wait_final(self, request: Request, sub: Submission,
                         queue: asyncio.Queue[Event]) -> Event | None:
        """The final event, or None (and the request cancelled) if the client disconnects."""
        get = asyncio.ensure_future(queue.get())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                return get.result()
            return None
        finally:
            answered = get.done() and not get.cancelled()
            get.cancel()
            gone.cancel()
            if not answered:  # the client left, or this handler was cancelled (shutdown)
                self.engine_thread.cancel(sub)

    async def stream(self, sub: Submission, queue: asyncio.Queue[Event], fmt: CompletionFormat,
                     include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's format. Leaving early (the client disconnected and
        Starlette cancelled us) cancels the request, which frees its KV blocks."""
        text = TextStream(self.tokenizer, sub.params.stop)
        over = False
        try:
            for chunk in fmt.first_chunks():
                yield _sse(chunk)
            while not over:
                event = await queue.get()
                while not queue.empty():  # outputs are cumulative: the newest says it all
                    event = queue.get_nowait()
                if isinstance(event, EngineFailure):
                    over = True
                    yield _sse(error_body(500, INTERNAL_ERROR, None, "internal_error"))
                    break
                delta = text.delta(event.token_ids, event.finished, event.text)
                over = event.finished
                if delta or over:
                    yield _sse(fmt.chunk(delta, finish_reason(event) if over else None,
                                         include_usage))
                if over and include_usage:
                    yield _sse(fmt.usage_chunk(event))
            yield SSE_DONE
        finally:
            if not over:
                self.engine_thread.cancel(sub)

    # -- the rest ------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.settings.model_names[0], "object": "model", "created": self.created,
             "owned_by": "specjax", "max_model_len": self.max_len}]}


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(llm: LLM, settings: ServerSettings = ServerSettings(),
               chat_template: ChatTemplate | None = None) -> FastAPI:
    """An app serving `llm` (already warmed up). The engine thread starts and stops with the
    app's lifespan; `app.state.server` exposes it (and the metrics) to tests and tools."""
    if chat_template is None:
        chat_template = ChatTemplate.from_folder(llm.model_path)
    server = Server(llm, settings, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_thread.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine_thread.stop)

    app = FastAPI(title="specjax", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    reject = lambda status: server.metrics.rejected.labels(status=str(status)).inc()
    install_error_handlers(app, on_error=reject, fields=request_field_names())
    app.add_middleware(GuardMiddleware, api_key=settings.api_key,
                       max_body_bytes=settings.max_body_bytes, on_reject=reject)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        if not server.engine_thread.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app
