"""The OpenAI request bodies (pydantic, strict types) and the response/chunk payloads, and
llama.cpp's for its /completion and /infill (`LlamaCppRequest`, `LlamaFormat`).

Types are checked by pydantic (FastAPI's 422 becomes a 400, see `errors.py`); values by
`specjax.validation`, the same checks `SamplingParams` and the engine run. Options the engine
cannot honour are declared here so they are refused by name rather than silently ignored.

One HTTP request may ask for several choices: `n` samples of each prompt (and, for
/v1/completions, a list of prompts). Each choice is one engine request; choice `index` is
`prompt_index * n + i`, and a seeded request gives sample i the seed `seed + i` (mod 2**32).
`usage` counts each prompt's tokens once (not once per choice: OpenAI's and vLLM's rule) and
every choice's generated tokens.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from specjax.engine.request import RequestOutput
from specjax.sampling_params import SamplingParams
from specjax.serve.logprobs import TokenLogprob, TokenTexts, chat_logprobs, completion_logprobs
from specjax.validation import (GUIDED_FIELDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, UINT32_MAX,
                                InvalidArgument,
                                check_int, check_logprobs, check_max_tokens,
                                check_stop, check_temperature, check_unsupported, shown)

Number = StrictFloat | StrictInt
MAX_STOP_STRINGS = 4          # OpenAI's limit
MAX_TEMPERATURE = 2.0         # OpenAI's range is [0, 2]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_N = 128                   # choices per prompt (OpenAI's limit for chat)
MAX_CHOICES = 128             # choices per HTTP request: n x the number of prompts
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")   # a logit_bias key: a token id, in decimal


class _Strict(BaseModel):
    # Unknown fields are refused by name, as OpenAI does.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM's; refused unless false


def parse_logit_bias(bias: dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> (id, bias) pairs; ranges are checked by
    `validation.check_logit_bias` (with the vocabulary, in `check_request`)."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:   # before anything is converted
        raise InvalidArgument("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} "
                                            f"tokens, got {len(bias)}")
    pairs = []
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidArgument("logit_bias", f"logit_bias keys must be token ids (decimal "
                                                f"integers >= 0), got {shown(key)}")
        pairs.append((int(key), value))
    return tuple(pairs)


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
    n: StrictInt | None = None
    logit_bias: dict[str, Number] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None        # extension (vLLM)
    # Structured output: OpenAI's response_format, and vLLM's guided_* extensions.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def unsupported(self) -> dict[str, tuple[Any, tuple]]:
        """{field: (value, allowed values)} for the options the engine cannot honour."""
        return {"stream_options.continuous_usage_stats": (
                    self.stream_options and self.stream_options.continuous_usage_stats,
                    (None, False))}

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested output length and the field that holds it."""
        return self.max_tokens, "max_tokens"

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    def logprob_fields(self) -> dict[str, int | None]:
        """SamplingParams' `logprobs` / `prompt_logprobs`, checked (endpoint-specific)."""
        return {}

    def sampling_params(self, default_max_tokens: int, max_tokens_cap: int) -> SamplingParams:
        """Every value check, in field order; raises InvalidArgument naming the field.
        The parameters of the first choice (sample i: `choice_params`)."""
        for name, (value, allowed) in self.unsupported().items():
            check_unsupported(name, value, allowed)
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options", "stream_options is only allowed when "
                                                    "stream is true")
        if self.n is not None:
            check_int("n", self.n, low=1, high=MAX_N)
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
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos),
            logit_bias=parse_logit_bias(self.logit_bias), **self.logprob_fields(),
            **self.guided_fields(),
            **{name: value for name, value in (
                ("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
                ("repetition_penalty", self.repetition_penalty)) if value is not None})

    def guided_fields(self) -> dict[str, Any]:
        """SamplingParams' structured-output field: from `response_format` ({"type": "text"},
        "json_object", or "json_schema" with its "schema") or a guided_* extension (one)."""
        fields = {name: value for name in GUIDED_FIELDS
                  if (value := getattr(self, name)) is not None}
        fmt = self.response_format
        if fmt is None:
            return fields
        kind = fmt.get("type")
        if kind == "text":
            return fields
        if fields:
            raise InvalidArgument("response_format", f"response_format and {next(iter(fields))} "
                                                     "were both given; send one constraint")
        if kind == "json_object":
            return {"guided_json": True}
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidArgument("response_format", "response_format of type json_schema "
                                                         "needs json_schema.schema, a JSON "
                                                         "schema object")
            return {"guided_json": schema}
        raise InvalidArgument("response_format", f"response_format type must be text, "
                                                 f"json_object or json_schema, got {shown(kind)}")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def sample_seed(seed: int | None, i: int) -> int | None:
    """Sample i of a seeded request draws with `seed + i` (within uint32); unseeded samples
    each get their own seed from the engine."""
    return None if seed is None else (seed + i) % (UINT32_MAX + 1)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (batched); with
    `suffix`, each text prompt is the prefix of a fill-in-the-middle prompt
    (`specjax.infill`)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> dict[str, tuple[Any, tuple]]:
        # best_of = n changes nothing (the n samples are the n best of n).
        return {**super().unsupported(), "best_of": (self.best_of, (None, self.num_samples))}

    def logprob_fields(self) -> dict[str, int | None]:
        if self.logprobs is None:
            return {}
        check_logprobs("logprobs", self.logprobs)
        # echo with logprobs reports the prompt's tokens first.
        return {"logprobs": self.logprobs,
                "prompt_logprobs": self.logprobs if self.echo else None}

    def sampling_params(self, default_max_tokens: int, max_tokens_cap: int) -> SamplingParams:
        if self.echo and self.max_tokens == 0:
            raise InvalidArgument("max_tokens", "max_tokens must be >= 1: echo with "
                                                "max_tokens 0 (scoring the prompt alone) is "
                                                "not supported, every choice generates at "
                                                "least one token")
        return super().sampling_params(default_max_tokens, max_tokens_cap)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per list element for a batch."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


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

    def unsupported(self) -> dict[str, tuple[Any, tuple]]:
        return {**super().unsupported(),
                "tools": (self.tools, (None, [])),
                "tool_choice": (self.tool_choice, (None, "none")),
                "functions": (self.functions, (None, [])),
                "function_call": (self.function_call, (None, "none"))}

    def logprob_fields(self) -> dict[str, int | None]:
        if self.top_logprobs is not None:
            check_int("top_logprobs", self.top_logprobs, low=0, high=MAX_LOGPROBS)
            # vLLM's rule: 0 asks for nothing and is accepted alone.
            if self.top_logprobs > 0 and not self.logprobs:
                raise InvalidArgument("top_logprobs", "top_logprobs requires logprobs: true")
        if not self.logprobs:
            return {}
        return {"logprobs": self.top_logprobs or 0}

    def requested_max_tokens(self) -> tuple[int | None, str]:
        # The newer name wins; both are accepted, as by OpenAI.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# -- llama.cpp's /completion and /infill ---------------------------------------------------------

# llama.cpp's sampling defaults (common/common.h) and its sampler names, with their aliases.
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
LLAMA_DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                          "min_p", "xtc", "temperature")
LLAMA_SAMPLERS = {**{name: name for name in LLAMA_DEFAULT_SAMPLERS + ("infill",)},
                  "top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "min-p": "min_p",
                  "temp": "temperature", "typ-p": "typ_p", "typ": "typ_p",
                  "typical": "typ_p", "typical-p": "typ_p", "top-n-sigma": "top_n_sigma"}
LLAMA_RANDOM_SEED = UINT32_MAX        # llama.cpp's "draw one", as is -1
MAX_LLAMA_STOP_STRINGS = 16           # editors' FIM templates send about ten


class LlamaCppRequest(_Strict):
    """The fields of llama.cpp's generation endpoints specjax honours, with llama.cpp's
    defaults. A sampler left out of `samplers` is off (llama.cpp's rule: without
    "temperature" the draw is at 1); those specjax lacks ("dry", "xtc", "typ_p",
    "top_n_sigma", "penalties") are off by their defaults, and their fields are refused;
    "infill" (llama.cpp's end-of-text heuristic) is not applied. Penalties are refused unless
    neutral: llama.cpp counts the last `repeat_last_n` tokens, specjax every token."""

    model: StrictStr | None = None
    n_predict: StrictInt = -1               # -1: until the context is full; 0: prefill only
    temperature: Number | None = None
    top_k: StrictInt | None = None
    top_p: Number | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: list[StrictStr] | None = None
    samplers: list[StrictStr] | None = None
    repeat_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    stream: StrictBool = False
    return_tokens: StrictBool = False
    response_fields: list[StrictStr] | None = None
    n_indent: StrictInt = 0                 # these two: off at 0 or below, as in llama.cpp
    t_max_predict_ms: StrictInt = 0
    # Accepted, changing nothing: the prefix cache is always on, the engine places requests,
    # and llama.cpp itself does not implement t_max_prompt_ms.
    cache_prompt: StrictBool | None = None
    id_slot: StrictInt | None = None
    t_max_prompt_ms: StrictInt | None = None

    def sampling_params(self, max_tokens_cap: int) -> SamplingParams:
        """Every value check, naming the field; max_tokens stands in for n_predict, which
        the prompt's room decides (`prepare.RequestPreparer.llama_prepared`)."""
        check_int("n_predict", self.n_predict, low=-1)
        if self.n_predict > max_tokens_cap:
            raise InvalidArgument("n_predict", f"n_predict must be <= {max_tokens_cap} (this "
                                               f"server's limit), got {self.n_predict}")
        on = set()
        for name in LLAMA_DEFAULT_SAMPLERS if self.samplers is None else self.samplers:
            if name not in LLAMA_SAMPLERS:
                known = ", ".join(sorted(set(LLAMA_SAMPLERS.values())))
                raise InvalidArgument("samplers", f"samplers: unknown sampler {shown(name)}; "
                                                  f"llama.cpp's are {known}")
            on.add(LLAMA_SAMPLERS[name])
        for name, neutral in (("repeat_penalty", 1), ("presence_penalty", 0),
                              ("frequency_penalty", 0)):
            check_unsupported(name, getattr(self, name), (None, neutral))

        def pick(name: str, off: float) -> Any:
            value = getattr(self, name)
            return off if name not in on else LLAMA_DEFAULTS[name] if value is None else value

        stop = list(self.stop or ())
        check_stop(stop, MAX_LLAMA_STOP_STRINGS)
        seed = None if self.seed in (None, -1, LLAMA_RANDOM_SEED) else self.seed
        return SamplingParams(max_tokens=max(self.n_predict, 1),
                              temperature=pick("temperature", 1.0),
                              top_k=max(pick("top_k", 0), 0), top_p=pick("top_p", 1.0),
                              min_p=pick("min_p", 0.0), seed=seed, stop=tuple(stop))


class LlamaCompletionRequest(LlamaCppRequest):
    """POST /completion: text (special tokens parsed, BOS as the tokenizer says) or ids."""

    prompt: StrictStr | list[StrictInt]


class ExtraChunk(_Strict):
    filename: StrictStr = "tmp"      # llama.cpp's name for a chunk without one
    text: StrictStr
    time: Any = None                 # llama.vim's, unused (as by llama.cpp)


class InfillRequest(LlamaCppRequest):
    """POST /infill (`specjax.infill`)."""

    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[ExtraChunk] = []
    prompt: StrictStr = ""


# -- responses ---------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def total_usage(finals: Sequence[RequestOutput], n: int) -> dict[str, int]:
    """Over the final outputs of one HTTP request, in choice order: each prompt's tokens once
    (choices prompt-major, `n` per prompt), every choice's generated tokens."""
    prompt = sum(len(out.prompt_token_ids) for out in finals[::n])
    return usage(prompt, sum(len(out.token_ids) for out in finals))


OPENAI_FINISH_REASONS = frozenset({"stop", "length"})


def finish_reason(out: RequestOutput) -> str | None:
    # The engine's "abort" and "error" have no OpenAI counterpart; an errored request gets an
    # error body instead (engine_thread.py), so neither is ever sent as a finish_reason.
    return out.finish_reason if out.finish_reason in OPENAI_FINISH_REASONS else None


class CompletionFormat:
    """Payloads of /v1/completions. `texts` spells tokens for logprobs; `top_k` is the number
    of top logprobs a chat token lists (unused here: completions list the engine's dict)."""

    object_name, chunk_object = "text_completion", "text_completion"
    sse_done = True   # a stream ends with `data: [DONE]`

    def __init__(self, model: str, texts: TokenTexts | None = None, top_k: int = 0):
        self.id, self.model, self.created = new_id("cmpl"), model, int(time.time())
        self.texts, self.top_k = texts, top_k

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if entries is None else completion_logprobs(entries, self.texts)

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def chunks(self, index: int, text: str, entries: list[TokenLogprob] | None,
               out: RequestOutput, with_usage: bool) -> list[dict[str, Any]]:
        """The events one output of a stream makes."""
        return [self.chunk(index, text, entries, finish_reason(out) if out.finished else None,
                           with_usage)]

    def chunk(self, index: int, text: str, entries: list[TokenLogprob] | None,
              reason: str | None, with_usage: bool) -> dict[str, Any]:
        body = {**self._head(self.chunk_object), "choices": [
            {"index": index, "text": text, "logprobs": self.logprobs(entries),
             "finish_reason": reason}]}
        if with_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def usage_chunk(self, totals: dict[str, int]) -> dict[str, Any]:
        return {**self._head(self.chunk_object), "choices": [], "usage": totals}

    def choice(self, index: int, text: str, entries: list[TokenLogprob] | None,
               out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self.logprobs(entries),
                "finish_reason": finish_reason(out)}

    def response(self, choices: list[dict[str, Any]], totals: dict[str, int]) -> dict[str, Any]:
        return {**self._head(self.object_name), "choices": choices, "usage": totals}


class ChatFormat(CompletionFormat):
    """Payloads of /v1/chat/completions."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, texts: TokenTexts | None = None, top_k: int = 0):
        super().__init__(model, texts, top_k)
        self.id = new_id("chatcmpl")

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if entries is None else chat_logprobs(entries, self.texts, self.top_k)

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._chat_chunk(i, {"role": "assistant", "content": ""}, None, None)
                for i in range(num_choices)]

    def _chat_chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
                    reason: str | None) -> dict[str, Any]:
        return {**self._head(self.chunk_object), "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def chunk(self, index: int, text: str, entries: list[TokenLogprob] | None,
              reason: str | None, with_usage: bool) -> dict[str, Any]:
        body = self._chat_chunk(index, {"content": text} if text or reason is None else {},
                                self.logprobs(entries), reason)
        if with_usage:
            body["usage"] = None
        return body

    def choice(self, index: int, text: str, entries: list[TokenLogprob] | None,
               out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(entries), "finish_reason": finish_reason(out)}


class LlamaFormat:
    """Payloads of llama.cpp's /completion and /infill (one choice): `content`, `stop`, token
    counts, `stop_type` ("eos", "word", "limit") and `stopping_word`, `truncated`,
    `tokens_cached` and `timings`; streamed as `{"content": ..., "stop": false}` events, then
    a final `stop: true` object and no [DONE]. A warm-up (n_predict 0) reports nothing
    generated. `response_fields` picks fields as llama.cpp does ("timings/prompt_n": a flat key
    for a nested value). `end_ids` are the ids that end a request as "eos"."""

    sse_done = False

    def __init__(self, model: str, tokenizer: Any, end_ids: Sequence[int], stops: Sequence[str],
                 warm_up: bool = False, truncated: bool = False, return_tokens: bool = False,
                 response_fields: Sequence[str] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.end_ids, self.stops = frozenset(end_ids), tuple(stops)
        self.warm_up, self.truncated, self.return_tokens = warm_up, truncated, return_tokens
        self.response_fields = response_fields
        self._streamed = 0    # tokens reported by the events so far

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def chunks(self, index: int, text: str, entries: Any, out: RequestOutput,
               with_usage: bool) -> list[dict[str, Any]]:
        events = []
        if text and not self.warm_up:
            ids = out.token_ids_from(self._streamed)   # only the new ones: no copy per event
            self._streamed += len(ids)
            events.append({"index": index, "content": text,
                           "tokens": ids if self.return_tokens else [], "stop": False,
                           **self._counts(out, self._streamed)})
        if out.finished:   # its text went out in the events before (llama.cpp's too)
            events.append(self.final(out, "", streamed=True))
        return events

    def choice(self, index: int, text: str, entries: Any, out: RequestOutput) -> dict[str, Any]:
        return self.final(out, text)

    def response(self, choices: list[dict[str, Any]], totals: dict[str, int]) -> dict[str, Any]:
        return choices[0]

    def _counts(self, out: RequestOutput, generated: int | None = None) -> dict[str, int]:
        generated = len(out.token_ids) if generated is None else generated
        return {"tokens_predicted": 0 if self.warm_up else generated,
                "tokens_evaluated": len(out.prompt_token_ids)}

    def final(self, out: RequestOutput, text: str, streamed: bool = False) -> dict[str, Any]:
        text = "" if self.warm_up else text
        stop_type, word = self._stop(out)
        listed = self.return_tokens and not (self.warm_up or streamed)
        body = {"index": 0, "content": text, "tokens": out.token_ids if listed else [],
                "stop": True, "model": self.model, **self._counts(out),
                "has_new_line": "\n" in text,
                "truncated": self.truncated, "stop_type": stop_type, "stopping_word": word,
                "tokens_cached": out.stats.num_cached_tokens, "timings": self._timings(out)}
        return body if self.response_fields is None else pick_fields(body, self.response_fields)

    def _stop(self, out: RequestOutput) -> tuple[str, str]:
        if out.finish_reason != "stop":
            return "limit", ""
        if out.token_ids and out.token_ids[-1] in self.end_ids:
            return "eos", ""
        whole = self.tokenizer.decode(out.token_ids)
        return "word", next((s for s in self.stops if whole.startswith(s, len(out.text))), "")

    def _timings(self, out: RequestOutput) -> dict[str, float]:
        """llama.cpp's timings; the prompt's from the request's arrival (queueing
        included) to its first token."""
        s, now = out.stats, time.perf_counter()
        first = s.first_token_time or now
        timings = {"cache_n": s.num_cached_tokens}
        for phase, n, ms in (
                ("prompt", len(out.prompt_token_ids) - s.num_cached_tokens,
                 (first - s.arrival_time) * 1e3),
                ("predicted", self._counts(out)["tokens_predicted"],
                 ((s.finish_time or now) - first) * 1e3)):
            # JSON has no inf: a phase without tokens or time rates 0.
            timings.update({f"{phase}_n": n, f"{phase}_ms": ms,
                            f"{phase}_per_token_ms": ms / n if n else 0.0,
                            f"{phase}_per_second": 1e3 * n / ms if ms > 0 else 0.0})
        if s.num_draft_tokens:
            timings.update(draft_n=s.num_draft_tokens,
                           draft_n_accepted=s.num_accepted_draft_tokens)
        return timings


def pick_fields(body: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: each "a/b" path that exists, as a flat key."""
    picked = {}
    for path in paths:
        value, found = body, True
        for key in path.split("/"):
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        if found:
            picked[path] = value
    return picked


def request_field_names() -> frozenset[str]:
    """Every field name of the request models (to tell them from pydantic's union tags)."""
    models = (StreamOptions, CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
              LlamaCompletionRequest, InfillRequest, ExtraChunk)
    return frozenset(name for m in models for name in m.model_fields)

