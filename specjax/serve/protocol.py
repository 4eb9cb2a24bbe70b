"""The OpenAI request bodies (pydantic, strict types) and the response/chunk payloads.

Types are checked by pydantic (FastAPI's 422 becomes a 400, see `errors.py`); values by
`specjax.validation`, the same checks `SamplingParams` and the engine run. Options the engine
cannot honour are declared here so they are refused by name rather than silently ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from specjax.engine.request import RequestOutput
from specjax.sampling_params import SamplingParams
from specjax.validation import (InvalidArgument, check_max_tokens, check_stop,
                                check_temperature, check_unsupported)

Number = StrictFloat | StrictInt
MAX_STOP_STRINGS = 4          # OpenAI's limit
MAX_TEMPERATURE = 2.0         # OpenAI's range is [0, 2]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    # Unknown fields are refused by name, as OpenAI does.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM's; refused unless false


class GenerationRequest(_Strict):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None          # extension (vLLM): -1 or 0 = off
    min_p: Number | None = None             # extension (vLLM)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None   # extension (vLLM)
    ignore_eos: StrictBool | None = None            # extension (vLLM)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None                   # accepted, unused
    # Accepted only at the values that change nothing:
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None

    def unsupported(self) -> dict[str, tuple[Any, tuple]]:
        """{field: (value, allowed values)} for the options the engine cannot honour."""
        return {"n": (self.n, (None, 1)),
                "presence_penalty": (self.presence_penalty, (None, 0)),
                "frequency_penalty": (self.frequency_penalty, (None, 0)),
                "repetition_penalty": (self.repetition_penalty, (None, 1)),
                "logit_bias": (self.logit_bias, (None, {})),
                "stream_options.continuous_usage_stats": (
                    self.stream_options and self.stream_options.continuous_usage_stats,
                    (None, False))}

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested output length and the field that holds it."""
        return self.max_tokens, "max_tokens"

    def sampling_params(self, default_max_tokens: int, max_tokens_cap: int) -> SamplingParams:
        """Every value check, in field order; raises InvalidArgument naming the field."""
        for name, (value, allowed) in self.unsupported().items():
            check_unsupported(name, value, allowed)
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options", "stream_options is only allowed when "
                                                    "stream is true")
        max_tokens, name = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(default_max_tokens, max_tokens_cap)
        try:
            check_max_tokens(max_tokens, max_tokens_cap)
        except InvalidArgument as e:  # name the field the client actually sent
            raise InvalidArgument(name, str(e).replace("max_tokens", name, 1)) from None
        temperature = 1.0 if self.temperature is None else self.temperature
        check_temperature(temperature, MAX_TEMPERATURE)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        check_stop(stop, MAX_STOP_STRINGS)
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. One prompt: text, or token ids (a one-element list of either is
    accepted too)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> dict[str, tuple[Any, tuple]]:
        return {**super().unsupported(), "best_of": (self.best_of, (None, 1)),
                "echo": (self.echo, (None, False)), "logprobs": (self.logprobs, (None,)),
                "suffix": (self.suffix, (None, ""))}


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions (text messages; no tools)."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> dict[str, tuple[Any, tuple]]:
        return {**super().unsupported(), "logprobs": (self.logprobs, (None, False)),
                "top_logprobs": (self.top_logprobs, (None, 0)),
                "tools": (self.tools, (None, [])), "tool_choice": (self.tool_choice, (None, "none")),
                "functions": (self.functions, (None, [])),
                "function_call": (self.function_call, (None, "none")),
                "response_format": (self.response_format, (None, {"type": "text"}))}

    def requested_max_tokens(self) -> tuple[int | None, str]:
        # The newer name wins; both are accepted, as by OpenAI.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# -- responses ---------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


OPENAI_FINISH_REASONS = frozenset({"stop", "length"})


def finish_reason(out: RequestOutput) -> str | None:
    # The engine's "abort" and "error" have no OpenAI counterpart; an errored request gets an
    # error body instead (engine_thread.py), so neither is ever sent as a finish_reason.
    return out.finish_reason if out.finish_reason in OPENAI_FINISH_REASONS else None


class CompletionFormat:
    """Payloads of /v1/completions."""

    object_name, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: str):
        self.id, self.model, self.created = new_id("cmpl"), model, int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, text: str, reason: str | None, with_usage: bool) -> dict[str, Any]:
        body = {**self._head(self.chunk_object), "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
        if with_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(out)}

    def response(self, text: str, out: RequestOutput) -> dict[str, Any]:
        return {**self._head(self.object_name), "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(out)}],
            "usage": usage(out)}


class ChatFormat(CompletionFormat):
    """Payloads of /v1/chat/completions."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str):
        super().__init__(model)
        self.id = new_id("chatcmpl")

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chat_chunk({"role": "assistant", "content": ""}, None)]

    def _chat_chunk(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {**self._head(self.chunk_object), "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    def chunk(self, text: str, reason: str | None, with_usage: bool) -> dict[str, Any]:
        body = self._chat_chunk({"content": text} if text or reason is None else {}, reason)
        if with_usage:
            body["usage"] = None
        return body

    def response(self, text: str, out: RequestOutput) -> dict[str, Any]:
        return {**self._head(self.object_name), "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": finish_reason(out)}], "usage": usage(out)}


def request_field_names() -> frozenset[str]:
    """Every field name of the request models (to tell them from pydantic's union tags)."""
    models = (StreamOptions, CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart)
    return frozenset(name for m in models for name in m.model_fields)

