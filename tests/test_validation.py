"""specjax.validation: one set of checks and messages for SamplingParams, Engine.validate and
the server; every error names its argument in `param` and in the message."""
import numpy as np
import pytest

from specjax import SamplingParams
from specjax.validation import (InvalidArgument, check_int, check_max_tokens, check_prompt,
                                check_request, check_stop, check_temperature, check_unsupported)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(min_p=-0.1), "min_p"),
    (dict(seed=2**32), "seed"), (dict(stop=[3]), "stop"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(temperature=True), "temperature"),
])
def test_sampling_params_errors_carry_the_param(kwargs, param):
    with pytest.raises(InvalidArgument, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_numpy_ints_are_ints_and_bools_are_not():
    check_int("n", np.int64(3), low=0)
    with pytest.raises(InvalidArgument, match="n must be an int, got bool"):
        check_int("n", True, low=0)
    with pytest.raises(InvalidArgument, match="n must be <= 4, got 5"):
        check_int("n", 5, low=0, high=4)


def test_server_limits():
    check_max_tokens(100, cap=100)
    with pytest.raises(InvalidArgument, match="max_tokens must be <= 100 .*got 101"):
        check_max_tokens(101, cap=100)
    check_temperature(2.0, high=2.0)
    with pytest.raises(InvalidArgument, match="temperature must be <= 2, got inf"):
        check_temperature(float("inf"), high=2.0)
    with pytest.raises(InvalidArgument, match="at most 4 strings, got 5"):
        check_stop(list("abcde"), max_count=4)


@pytest.mark.parametrize("value, allowed, ok", [
    (None, (None, 1), True), (1, (None, 1), True), (2, (None, 1), False),
    (True, (None, 1), False),          # True == 1 in Python, but not here
    (0.0, (None, 0), True), (0.5, (None, 0), False), (False, (None, False), True),
    (0, (None, False), False), ({}, (None, {}), True), ({"1": 2}, (None, {}), False),
    ("none", (None, "none"), True), ("auto", (None, "none"), False),
])
def test_check_unsupported(value, allowed, ok):
    if ok:
        check_unsupported("opt", value, allowed)
    else:
        with pytest.raises(InvalidArgument, match="opt is not supported by specjax") as info:
            check_unsupported("opt", value, allowed)
        assert info.value.param == "opt"


def test_prompt_checks_name_their_source():
    check_prompt([1, 2], vocab_size=8, max_len=3)
    with pytest.raises(InvalidArgument, match="^prompt has 3 tokens; the context holds 3"):
        check_prompt([1, 2, 3], vocab_size=8, max_len=3)
    with pytest.raises(InvalidArgument, match="^messages: prompt is empty") as info:
        check_prompt([], vocab_size=8, max_len=3, param="messages")
    assert info.value.param == "messages"
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        check_prompt([True], vocab_size=8, max_len=3)


def test_request_checks_params_again(tiny_llm):
    """A SamplingParams altered after construction (frozen, but not unbreakable) is caught by
    the engine, which runs the same checks."""
    params = SamplingParams()
    object.__setattr__(params, "top_p", 7.0)
    with pytest.raises(InvalidArgument, match=r"top_p must be in \(0, 1\]"):
        tiny_llm.engine.validate([1, 2], params)
    with pytest.raises(InvalidArgument, match="stop_token_ids: token id 64 is outside"):
        tiny_llm.engine.validate([1, 2], SamplingParams(stop_token_ids=(64,)))
    with pytest.raises(InvalidArgument, match="sampling_params must be a SamplingParams"):
        check_request([1], {"max_tokens": 3}, SamplingParams, 8, 4)
    assert not tiny_llm.engine.has_unfinished()
