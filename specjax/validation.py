"""Argument checks shared by the request API, the engine and the HTTP server, and the one
table of bounds (`BOUNDS`) every value that reaches a device array is checked against.

Every check raises `InvalidArgument` (a `ValueError`) whose message names the argument and
whose `param` attribute holds that name, so the server can answer with an OpenAI-style error
body and the Python API with the same words. `SamplingParams` runs the field checks at
construction, `Engine.validate` runs them again with the model-dependent ones, and the server
runs the same functions before it opens a response.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from specjax.core.logits import MAX_LOGIT_BIAS, TOP_LOGPROBS

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
FLOAT32_TINY = 1.1754943508222875e-38   # the smallest normal float32: below it, 0
MAX_LOGPROBS = TOP_LOGPROBS   # top log-probabilities per position (OpenAI's top_logprobs limit)


@dataclasses.dataclass(frozen=True)
class Bound:
    """What one value may hold: its meaning's range, inside the dtype of the device array it
    is written to (`dtype`), so that no accepted value can overflow, wrap or turn to NaN
    there. `zero_ok` allows an exact 0 below `low` (the "off" value of a parameter whose
    positive range starts higher)."""

    low: float
    high: float
    dtype: str
    zero_ok: bool = False
    integer: bool = False

    def describe(self) -> str:
        lo, hi = _fmt(self.low), _fmt(self.high)
        interval = f"[{lo}, {hi}]"
        return f"0 or in {interval}" if self.zero_ok else f"in {interval}"


def _fmt(x: float) -> str:
    if isinstance(x, int) and x >= 2**16:
        return f"2**{x.bit_length()}-1" if (x + 1) & x == 0 else str(x)
    return f"{x:g}"


# Every per-request value that reaches a device array (core/batch.py's StepBatch), with the
# range it is checked against at validation. Token ids are bounded by the vocabulary and
# lengths by the context, which are model facts (`check_prompt`, `check_stop_token_ids`).
BOUNDS: dict[str, Bound] = {
    # StepBatch.max_lens is int32; the context cuts it further (`check_room`).
    "max_tokens": Bound(1, INT32_MAX, "int32", integer=True),
    # logits / temperature in float32: below 1e-5 the quotient can overflow to inf (and the
    # softmax to NaN); 0 means greedy.
    "temperature": Bound(1e-5, 1e4, "float32", zero_ok=True),
    # int32; 0 is off, and any k >= the vocabulary keeps every token.
    "top_k": Bound(0, INT32_MAX, "int32", integer=True),
    # float32: a positive value under the smallest normal float32 would round to 0, and
    # top_p = 0 keeps nothing.
    "top_p": Bound(FLOAT32_TINY, 1, "float32"),
    "min_p": Bound(0, 1, "float32"),
    # uint32 PRNG seeds.
    "seed": Bound(0, UINT32_MAX, "uint32", integer=True),
    # float32, added to logits (OpenAI's range).
    "logit_bias": Bound(-100, 100, "float32"),
    # float32, OpenAI's ranges; a repetition penalty divides or multiplies logits.
    "presence_penalty": Bound(-2, 2, "float32"),
    "frequency_penalty": Bound(-2, 2, "float32"),
    "repetition_penalty": Bound(0.01, 100, "float32"),
}


def shown(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: error messages never echo unbounded input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class InvalidArgument(ValueError):
    """A request argument that cannot be served; `param` names it (e.g. "top_p")."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    """An int (never a bool) in [low, high]."""
    if not _is_int(value):
        raise InvalidArgument(name, f"{name} must be an int, got {type(value).__name__} "
                                    f"{shown(value)}")
    if low is not None and value < low:
        raise InvalidArgument(name, f"{name} must be >= {low}, got {shown(value)}")
    if high is not None and value > high:
        raise InvalidArgument(name, f"{name} must be <= {high}, got {shown(value)}")


def check_number(name: str, value: Any) -> None:
    """A real number: int or float, not a bool and not NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or value != value:
        raise InvalidArgument(name, f"{name} must be a number, got {shown(value)}")


def check_bound(name: str, value: Any) -> None:
    """`value` within `BOUNDS[name]`, with a message naming the range and the dtype."""
    b = BOUNDS[name]
    if b.integer:
        check_int(name, value)
    else:
        check_number(name, value)
    if b.zero_ok and value == 0:
        return
    if not b.low <= value <= b.high:
        raise InvalidArgument(name, f"{name} must be {b.describe()} ({b.dtype} on the "
                                    f"device), got {shown(value)}")


def check_max_tokens(value: Any, cap: int | None = None) -> None:
    """At least one token; at most `cap` where a server sets one."""
    check_int("max_tokens", value, low=1)
    if cap is not None and value > cap:
        raise InvalidArgument("max_tokens", f"max_tokens must be <= {cap} (this server's "
                                            f"limit), got {shown(value)}")
    check_bound("max_tokens", value)


def check_temperature(value: Any, high: float | None = None) -> None:
    check_number("temperature", value)
    if value < 0:
        raise InvalidArgument("temperature", f"temperature must be >= 0, got {shown(value)}")
    if high is not None and value > high:
        raise InvalidArgument("temperature", f"temperature must be <= {high:g}, "
                                             f"got {shown(value)}")
    check_bound("temperature", value)


def check_top_k(value: Any) -> None:
    check_bound("top_k", value)


def check_top_p(value: Any) -> None:
    check_number("top_p", value)
    if not 0 < value <= 1:
        raise InvalidArgument("top_p", f"top_p must be in (0, 1], got {shown(value)}")
    check_bound("top_p", value)


def check_min_p(value: Any) -> None:
    check_bound("min_p", value)


def check_seed(value: Any) -> None:
    if value is not None:
        check_bound("seed", value)


def check_room(prompt_len: int, max_tokens: int, max_len: int, param: str = "max_tokens"
               ) -> None:
    """The prompt and the output it asks for fit in the context (the server's rule: a client
    that names a length gets it or a 400, never a silent cut)."""
    if prompt_len + max_tokens > max_len:
        raise InvalidArgument(param, f"{param} is {max_tokens} but the prompt has "
                                     f"{prompt_len} tokens and the context holds {max_len} "
                                     f"(max_model_len): at most {max(max_len - prompt_len, 0)} "
                                     f"tokens can be generated")


def check_stop(stop: Sequence[Any], max_count: int | None = None) -> None:
    """Non-empty strings; at most `max_count` of them where a server sets a limit."""
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InvalidArgument("stop", f"stop must hold non-empty strings, got {shown(s)}")
    if max_count is not None and len(stop) > max_count:
        raise InvalidArgument("stop", f"stop may hold at most {max_count} strings, "
                                      f"got {len(stop)}")


def check_stop_token_ids(ids: Sequence[Any], vocab_size: int | None = None) -> None:
    for t in ids:
        check_int("stop_token_ids", t, low=0)
        if vocab_size is not None and t >= vocab_size:
            raise InvalidArgument("stop_token_ids", f"stop_token_ids: token id {t} is "
                                                    f"outside the vocabulary [0, {vocab_size})")


def check_logprobs(name: str, value: Any) -> None:
    """How many top log-probabilities per position: the step's outputs are MAX_LOGPROBS wide
    (only a flag per row reaches the device)."""
    check_int(name, value, low=0, high=MAX_LOGPROBS)


def check_logit_bias(pairs: Sequence[Any], vocab_size: int | None = None) -> None:
    """(token id, bias) pairs: ids in the vocabulary, each once, biases within bounds."""
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidArgument("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} "
                                            f"tokens, got {len(pairs)}")
    seen = set()
    for t, bias in pairs:
        check_int("logit_bias", t, low=0)
        if vocab_size is not None and t >= vocab_size:
            raise InvalidArgument("logit_bias", f"logit_bias: token id {t} is outside the "
                                                f"vocabulary [0, {vocab_size})")
        if t in seen:
            raise InvalidArgument("logit_bias", f"logit_bias: token id {t} appears twice")
        seen.add(t)
        check_bound("logit_bias", bias)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def check_guided_fields(params: Any) -> None:
    """At most one structured-output field, of its type; whether the grammar compiles is
    checked with the tokenizer (`specjax.engine.grammar.Grammars.check`)."""
    given = [name for name in GUIDED_FIELDS if getattr(params, name) not in (None, False)]
    if len(given) > 1:
        raise InvalidArgument(given[1], f"{given[0]} and {given[1]} were both given; a request "
                                        "takes at most one structured-output constraint")
    schema = params.guided_json
    if schema is not None and not isinstance(schema, (str, bool)):
        raise InvalidArgument("guided_json", f"guided_json must be a JSON schema (a dict or its "
                                             f"JSON text) or true, got {shown(schema)}")
    for name in ("guided_regex", "guided_grammar"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidArgument(name, f"{name} must be a non-empty string, got {shown(value)}")
    choice = params.guided_choice
    if choice is not None and (not isinstance(choice, tuple) or not choice or not all(
            isinstance(c, str) and c for c in choice)):
        raise InvalidArgument("guided_choice", f"guided_choice must be a non-empty list of "
                                               f"non-empty strings, got {shown(choice)}")


def check_sampling_fields(params: Any) -> None:
    """Every field of a `SamplingParams` (duck-typed, so this module imports nothing of it)."""
    check_max_tokens(params.max_tokens)
    check_temperature(params.temperature)
    check_top_k(params.top_k)
    check_top_p(params.top_p)
    check_min_p(params.min_p)
    check_seed(params.seed)
    check_stop(params.stop)
    check_stop_token_ids(params.stop_token_ids)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            check_logprobs(name, getattr(params, name))
    check_logit_bias(params.logit_bias)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        check_bound(name, getattr(params, name))
    if not isinstance(params.ignore_eos, bool):
        raise InvalidArgument("ignore_eos", f"ignore_eos must be a bool, "
                                            f"got {shown(params.ignore_eos)}")
    check_guided_fields(params)


def check_prompt(prompt_ids: Sequence[Any], vocab_size: int, max_len: int,
                 param: str = "prompt") -> None:
    """Token ids inside the vocabulary, with room for at least one generated token. `param`
    names what the prompt was made from (e.g. a chat's "messages"), if not "prompt" itself."""
    where = "" if param == "prompt" else f"{param}: "
    if len(prompt_ids) == 0:
        raise InvalidArgument(param, f"{where}prompt is empty")
    for t in prompt_ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidArgument(param, f"{where}prompt token id {shown(t)} is outside the "
                                         f"vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= max_len:
        raise InvalidArgument(param, f"{where}prompt has {len(prompt_ids)} tokens; the context "
                                     f"holds {max_len} (max_model_len), leaving no room to "
                                     "generate")


def check_request(prompt_ids: Sequence[Any], params: Any, params_type: type,
                  vocab_size: int, max_len: int) -> None:
    """What `Engine.validate` checks: the parameter object, its fields, the prompt."""
    if not isinstance(params, params_type):
        raise InvalidArgument("sampling_params", f"sampling_params must be a "
                                                 f"{params_type.__name__}, got "
                                                 f"{type(params).__name__}")
    check_sampling_fields(params)
    check_stop_token_ids(params.stop_token_ids, vocab_size)
    check_logit_bias(params.logit_bias, vocab_size)
    check_prompt(prompt_ids, vocab_size, max_len)


# -- options an OpenAI client may send that the engine cannot honour -----------------------

def check_unsupported(name: str, value: Any, allowed: Sequence[Any] = (None,)) -> None:
    """Reject `value` unless it is one of `allowed` (the values that change nothing)."""
    for ok in allowed:
        # A bool never stands in for a number (True == 1 in Python), nor the reverse.
        if (value is None or ok is None) and value is not ok:
            continue
        if isinstance(value, bool) == isinstance(ok, bool) and value == ok:
            return
    allowed_text = " or ".join(repr(v) if v is not None else "null" for v in allowed)
    raise InvalidArgument(name, f"{name} is not supported by specjax (it must be {allowed_text}), "
                                f"got {shown(value)}")


def check_draft_tokens(tokens: Any, max_draft_len: int, vocab_size: int) -> list[int]:
    """A host drafter's proposal, before it reaches a device array: token ids inside the
    vocabulary. Returns the first `max_draft_len` of them as a list of ints (a longer
    proposal is cut, as verification would cut it)."""
    try:
        drafts = list(tokens)[:max_draft_len]
    except TypeError:
        raise InvalidArgument("drafts", f"a drafter must return a sequence of token ids, got "
                                        f"{type(tokens).__name__}") from None
    for t in drafts:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidArgument("drafts", f"the drafter proposed token id {shown(t)}, "
                                            f"outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in drafts]
