"""A request body -> the prompt ids and `SamplingParams` the engine gets, every check included.

`RequestPreparer` is plain synchronous code: the app runs it in a worker thread, because
rendering a chat template and tokenising a prompt of up to the body limit (1 MiB, about a
second of tokenising) would stall every other connection if it ran on the event loop. The
tokenizer is called through `encode_batch_fast`, which releases the GIL; `encode` holds it
and would stall the loop even from a worker thread. It reads only immutable engine facts,
never the engine. Failures raise `InvalidArgument` or `APIError`: 400s naming the parameter.

Lengths follow one rule: a client that names an output length (`max_tokens`,
`max_completion_tokens`) gets it or a 400 saying how much room the prompt left; without one,
the default is cut to the room left (chat: all of it; completions: OpenAI's 16 at most).

A request may make several choices (`n`, and a list of prompts for completions): every prompt
and the choice count are checked before anything is handed to the engine, so a request is
refused whole or not at all.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specjax.sampling_params import SamplingParams
from specjax.engine.grammar import Grammars, check_guided
from specjax.chat import ChatTemplate
from specjax.infill import FimFormat
from specjax.serve.choices import Echo, prompt_offsets
from specjax.serve.errors import APIError
from specjax.serve.line_limits import LineLimits
from specjax.serve.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_CHOICES,
                                    ChatCompletionRequest, CompletionRequest,
                                    GenerationRequest, InfillRequest, LlamaCompletionRequest,
                                    LlamaCppRequest, sample_seed)
from specjax.tokenizer import Tokenizer
from specjax.validation import InvalidArgument, check_prompt, check_request, check_room, shown


@dataclasses.dataclass(frozen=True)
class Choice:
    """One engine request of an HTTP request."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: Echo | None = None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Every choice of one HTTP request, prompt-major: index = prompt_index * n + i."""

    prompts: list[list[int]]
    params: list[SamplingParams]   # per prompt (its max_tokens fitted to its room)
    n: int = 1
    echoes: list[Echo] | None = None   # per prompt, with echo
    limits: LineLimits | None = None   # llama.cpp's n_indent and t_max_predict_ms
    truncated: bool = False            # a fill-in-the-middle prompt was cut to fit

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]

    def choices(self) -> list[Choice]:
        out = []
        for p, (prompt, params) in enumerate(zip(self.prompts, self.params)):
            for i in range(self.n):
                sample = (params if i == 0 else
                          dataclasses.replace(params, seed=sample_seed(params.seed, i)))
                out.append(Choice(p * self.n + i, prompt, sample,
                                  self.echoes[p] if self.echoes else None))
        return out


def check_text(param: str, text: str) -> None:
    """Text the tokenizer can take: JSON may carry lone surrogates ("\\ud800"), which are
    not Unicode scalar values and which no UTF-8 tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(param, f"{param} is not valid Unicode text: it holds the lone "
                                     f"surrogate U+{ord(text[e.start]):04X} at index "
                                     f"{e.start}") from None


def encode_text(tokenizer: Tokenizer, text: str, add_bos: bool | None) -> list[int]:
    """The one call that tokenises request text (`Tokenizer.encode` lets other threads run
    meanwhile); a seam for tests."""
    return tokenizer.encode(text, add_bos=add_bos)


@dataclasses.dataclass(frozen=True)
class RequestPreparer:
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    model_names: tuple[str, ...]
    vocab_size: int
    max_len: int           # the context: prompt + output
    max_tokens_cap: int    # the server's limit on one request's output
    grammars: Grammars | None = None   # structured output's compiler (the engine's)
    fim: FimFormat | None = None       # fill-in-the-middle prompts (the tokenizer's tokens)

    def completion(self, body: CompletionRequest) -> Prepared:
        self.check_model(body.model)
        params = body.sampling_params(COMPLETIONS_DEFAULT_MAX_TOKENS, self.max_tokens_cap)
        self.check_stops(params.stop)
        if body.suffix is not None:
            self.fim.require("suffix")
            check_text("suffix", body.suffix)
            if body.echo:
                raise InvalidArgument("echo", "echo is not supported with suffix (the prompt "
                                              "is rendered as fill-in-the-middle)")
            params = self.fim.with_end_ids(params)
        given = body.prompts()
        if not given:
            raise InvalidArgument("prompt", "prompt must hold at least one prompt")
        self.check_choices(len(given), body.num_samples)
        prompts, fitted = [], []
        for j, p in enumerate(given):
            try:
                ids = (self.completion_prompt(p) if body.suffix is None
                       else self.suffix_prompt(p, body.suffix, params.max_tokens))
                fitted.append(self.fit(body, ids, params, "prompt"))
            except InvalidArgument as e:
                if len(given) == 1:
                    raise
                # Say which prompt of the batch (the parameter keeps its name).
                raise InvalidArgument(e.param, f"prompt[{j}]: {e}") from None
            prompts.append(ids)
        echoes = None
        if body.echo:
            texts = [p if isinstance(p, str) else self.tokenizer.decode(ids)
                     for p, ids in zip(given, prompts)]
            echoes = [Echo(text, prompt_offsets(self.tokenizer, ids, text)
                           if body.logprobs is not None else ())
                      for text, ids in zip(texts, prompts)]
        return Prepared(prompts, fitted, body.num_samples, echoes)

    def chat(self, body: ChatCompletionRequest) -> Prepared:
        self.check_model(body.model)
        params = body.sampling_params(self.max_tokens_cap, self.max_tokens_cap)
        self.check_stops(params.stop)
        self.check_choices(1, body.num_samples)
        prompt = self.chat_prompt(body)
        return Prepared([prompt], [self.fit(body, prompt, params, "messages")],
                        body.num_samples)

    @staticmethod
    def check_choices(num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_CHOICES:
            raise InvalidArgument("n" if num_prompts == 1 else "prompt",
                                  f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} "
                                  f"choices; this server makes at most {MAX_CHOICES} per request")

    def check_model(self, model: str | None, optional: bool = False) -> None:
        """`optional`: llama.cpp's endpoints need no model; an empty one names none."""
        if optional and not model:
            return
        if model not in self.model_names:
            raise APIError(400, f"model {shown(model)} is not served here; this server serves "
                                f"{self.model_names[0]!r}", "model", "model_not_found")

    @staticmethod
    def check_stops(stops: Sequence[str]) -> None:
        for stop in stops:
            check_text("stop", stop)

    def completion_prompt(self, prompt: Any) -> list[int]:
        """One prompt of the request: text or token ids."""
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return encode_text(self.tokenizer, prompt, add_bos=None)
        return list(prompt)

    def suffix_prompt(self, prefix: Any, suffix: str, max_tokens: int) -> list[int]:
        """OpenAI's `suffix`: the prompt is the text before the gap."""
        if not isinstance(prefix, str):
            raise InvalidArgument("prompt", "with suffix, prompt must be text (the text "
                                            "before the gap), not token ids")
        check_text("prompt", prefix)
        return self.fim.render(prefix, suffix, max_len=self.max_len, n_predict=max_tokens,
                               param="prompt").ids

    # -- llama.cpp's /completion and /infill -------------------------------------------------

    def llama_completion(self, body: LlamaCompletionRequest) -> Prepared:
        self.check_model(body.model, optional=True)
        params = self.llama_params(body)
        # llama.cpp ends every request at the vocabulary's end-of-generation tokens, the FIM
        # ones included: clients that lay out FIM prompts themselves rely on it.
        return self.llama_prepared(self.completion_prompt(body.prompt),
                                   self.fim.with_end_ids(params), body, "prompt")

    def infill(self, body: InfillRequest) -> Prepared:
        self.check_model(body.model, optional=True)
        self.fim.require()
        params = self.llama_params(body)
        extra = [(c.filename, c.text) for c in body.input_extra]
        for name, text in [("input_prefix", body.input_prefix),
                           ("input_suffix", body.input_suffix), ("prompt", body.prompt)] + [
                (f"input_extra[{i}].{key}", value) for i, chunk in enumerate(extra)
                for key, value in zip(("filename", "text"), chunk)]:
            check_text(name, text)
        rendered = self.fim.render(body.input_prefix, body.input_suffix, extra, body.prompt,
                                   max_len=self.max_len, n_predict=max(body.n_predict, 0),
                                   param="prompt")
        return self.llama_prepared(rendered.ids, self.fim.with_end_ids(params), body,
                                   "input_prefix", truncated=rendered.truncated)

    def llama_params(self, body: LlamaCppRequest) -> SamplingParams:
        params = body.sampling_params(self.max_tokens_cap)
        self.check_stops(params.stop)
        return params

    def llama_prepared(self, ids: list[int], params: SamplingParams, body: LlamaCppRequest,
                       param: str, truncated: bool = False) -> Prepared:
        """n_predict as llama.cpp reads it: -1 until the context is full (the server's cap
        applies), 0 the prompt's prefill alone (the one token it samples is not reported)."""
        check_prompt(ids, self.vocab_size, self.max_len, param=param)
        if body.n_predict > 0:
            check_room(len(ids), body.n_predict, self.max_len, param="n_predict")
        max_tokens = (body.n_predict if body.n_predict > 0 else 1 if body.n_predict == 0
                      else min(self.max_len - len(ids), self.max_tokens_cap))
        params = dataclasses.replace(params, max_tokens=max_tokens)
        check_request(ids, params, SamplingParams, self.vocab_size, self.max_len)
        limits = LineLimits(max(body.n_indent, 0), max(body.t_max_predict_ms, 0))
        return Prepared([ids], [params], limits=limits, truncated=truncated)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise InvalidArgument("messages", "messages must hold at least one message")
        for i, message in enumerate(body.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    check_text(f"messages[{i}].content[{j}].text", part.text)
            elif message.content is not None:
                check_text(f"messages[{i}].content", message.content)
        text = self.chat_template.render([{"role": m.role, "content": m.text()}
                                          for m in body.messages])
        check_text("messages", text)  # a checkpoint's template could still produce one
        return encode_text(self.tokenizer, text, add_bos=self.chat_template.add_bos)

    def fit(self, body: GenerationRequest, prompt_ids: list[int], params: SamplingParams,
            param: str) -> SamplingParams:
        """The prompt checks `Engine.validate` runs, and the output length fitted to the room
        the prompt leaves."""
        check_prompt(prompt_ids, self.vocab_size, self.max_len, param=param)
        requested, name = body.requested_max_tokens()
        if requested is not None:
            check_room(len(prompt_ids), requested, self.max_len, param=name)
        else:
            room = self.max_len - len(prompt_ids)   # >= 1: check_prompt made sure
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        check_request(prompt_ids, params, SamplingParams, self.vocab_size, self.max_len)
        check_guided(self.grammars, params)
        return params
