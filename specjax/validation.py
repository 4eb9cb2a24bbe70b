"""Argument checks shared by the request API, the engine and the HTTP server.

Every check raises `InvalidArgument` (a `ValueError`) whose message names the argument and
whose `param` attribute holds that name, so the server can answer with an OpenAI-style error
body and the Python API with the same words. `SamplingParams` runs the field checks at
construction, `Engine.validate` runs them again with the model-dependent ones, and the server
runs the same functions before it opens a response.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

MAX_SEED = 2**32  # seeds key a uint32 PRNG stream


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
        raise InvalidArgument(name, f"{name} must be an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise InvalidArgument(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidArgument(name, f"{name} must be <= {high}, got {value}")


def check_number(name: str, value: Any) -> None:
    """A real number: int or float, not a bool and not NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or value != value:
        raise InvalidArgument(name, f"{name} must be a number, got {value!r}")


def check_max_tokens(value: Any, cap: int | None = None) -> None:
    """At least one token; at most `cap` where a server sets one."""
    check_int("max_tokens", value, low=1)
    if cap is not None and value > cap:
        raise InvalidArgument("max_tokens", f"max_tokens must be <= {cap} (this server's "
                                            f"limit), got {value}")


def check_temperature(value: Any, high: float | None = None) -> None:
    check_number("temperature", value)
    if value < 0:
        raise InvalidArgument("temperature", f"temperature must be >= 0, got {value}")
    if high is not None and value > high:
        raise InvalidArgument("temperature", f"temperature must be <= {high:g}, got {value}")


def check_top_k(value: Any) -> None:
    check_int("top_k", value, low=0)


def check_top_p(value: Any) -> None:
    check_number("top_p", value)
    if not 0 < value <= 1:
        raise InvalidArgument("top_p", f"top_p must be in (0, 1], got {value}")


def check_min_p(value: Any) -> None:
    check_number("min_p", value)
    if not 0 <= value <= 1:
        raise InvalidArgument("min_p", f"min_p must be in [0, 1], got {value}")


def check_seed(value: Any) -> None:
    if value is None:
        return
    check_int("seed", value, low=0)
    if value >= MAX_SEED:
        raise InvalidArgument("seed", f"seed must be < 2**32, got {value}")


def check_stop(stop: Sequence[Any], max_count: int | None = None) -> None:
    """Non-empty strings; at most `max_count` of them where a server sets a limit."""
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InvalidArgument("stop", f"stop must hold non-empty strings, got {s!r}")
    if max_count is not None and len(stop) > max_count:
        raise InvalidArgument("stop", f"stop may hold at most {max_count} strings, "
                                      f"got {len(stop)}")


def check_stop_token_ids(ids: Sequence[Any], vocab_size: int | None = None) -> None:
    for t in ids:
        check_int("stop_token_ids", t, low=0)
        if vocab_size is not None and t >= vocab_size:
            raise InvalidArgument("stop_token_ids", f"stop_token_ids: token id {t} is "
                                                    f"outside the vocabulary [0, {vocab_size})")


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
    if not isinstance(params.ignore_eos, bool):
        raise InvalidArgument("ignore_eos", f"ignore_eos must be a bool, got {params.ignore_eos!r}")


def check_prompt(prompt_ids: Sequence[Any], vocab_size: int, max_len: int,
                 param: str = "prompt") -> None:
    """Token ids inside the vocabulary, with room for at least one generated token. `param`
    names what the prompt was made from (e.g. a chat's "messages"), if not "prompt" itself."""
    where = "" if param == "prompt" else f"{param}: "
    if len(prompt_ids) == 0:
        raise InvalidArgument(param, f"{where}prompt is empty")
    for t in prompt_ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidArgument(param, f"{where}prompt token id {t!r} is outside the "
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
    shown = " or ".join(repr(v) if v is not None else "null" for v in allowed)
    raise InvalidArgument(name, f"{name} is not supported by specjax (it must be {shown}), "
                                f"got {value!r}")
