"""specjax.validation: one set of checks and messages for SamplingParams, Engine.validate and
the server; every error names its argument in `param` and in the message."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import SamplingParams
from specjax.core.batch import empty_batch
from specjax.core.sampling import filter_logits
from specjax.validation import (BOUNDS, InvalidArgument, check_bound, check_draft_tokens,
                                check_int, check_max_tokens, check_prompt, check_request,
                                check_room, check_stop, check_temperature, check_unsupported)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(min_p=-0.1), "min_p"),
    (dict(seed=2**32), "seed"), (dict(top_k=2**31), "top_k"),
    (dict(temperature=1e-7), "temperature"), (dict(stop=[3]), "stop"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
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


_BATCH_FIELD = {"max_tokens": "max_lens", "temperature": "temperature", "top_k": "top_k",
                "top_p": "top_p", "min_p": "min_p", "seed": "seeds", "logit_bias": "bias_values",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                "repetition_penalty": "repetition_penalty"}


def test_every_bound_names_a_batch_field():
    assert set(BOUNDS) == set(_BATCH_FIELD)


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_bound_fits_its_device_dtype(name):
    """The extremes a request may hold are written into the step batch exactly as they are
    (no overflow, no wrap, no rounding to 0 or inf); for integers, one past the bound is what
    would have crashed the step for every request."""
    b, field = BOUNDS[name], _BATCH_FIELD[name]
    batch = empty_batch(1, 2, 1, spare_slot=0)
    array = getattr(batch, field)
    cell = (0,) * array.ndim     # the first row's (first) entry
    assert array.dtype == np.dtype(b.dtype)
    for value in (b.low, b.high):
        array[cell] = value
        if b.integer:
            assert int(array[cell]) == value
        else:
            assert np.isfinite(array[cell]) and (array[cell] > 0) == (value > 0)
    if b.integer:
        with pytest.raises(OverflowError):
            array[cell] = b.high + 1
        with pytest.raises(InvalidArgument):
            check_bound(name, b.high + 1)


def test_extreme_accepted_parameters_sample_finite_distributions():
    """The smallest temperature and top_p, the largest top_k: a proper distribution, no NaN."""
    logits = jnp.array([[80.0, -80.0, 3.0, 79.9]])
    one = lambda x, dtype=jnp.float32: jnp.array([x], dtype)
    for t, k, p in [(BOUNDS["temperature"].low, BOUNDS["top_k"].high, BOUNDS["top_p"].low),
                    (BOUNDS["temperature"].high, 0, 1.0)]:
        filtered = filter_logits(logits, one(t), one(k, jnp.int32), one(p), one(0.0))
        probs = np.asarray(jax.nn.softmax(filtered, axis=-1))
        assert np.all(np.isfinite(probs)) and abs(probs.sum() - 1) < 1e-5


def test_room_message_says_both_numbers():
    check_room(10, 14, 24)
    with pytest.raises(InvalidArgument, match="max_completion_tokens is 1000 but the prompt has "
                                              "1000 tokens and the context holds 1024") as info:
        check_room(1000, 1000, 1024, param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens" and "at most 24 tokens" in str(info.value)


def test_messages_never_echo_unbounded_input():
    huge = "x" * 200_000
    for check in (lambda: check_int("n", huge), lambda: check_stop([huge, 3]),
                  lambda: check_unsupported("opt", huge)):
        with pytest.raises(InvalidArgument) as info:
            check()
        assert len(str(info.value)) < 200


@pytest.mark.parametrize("drafts, match", [
    ([1, 64], "token id 64, outside"), ([1, -1], "token id -1"), ([1.0], "token id 1.0"),
    (None, "must return a sequence")])
def test_drafter_proposals_are_checked(drafts, match):
    assert check_draft_tokens((np.int64(5), 6), 3, 64) == [5, 6]
    assert check_draft_tokens([1, 2, 3, 4, 99], 3, 64) == [1, 2, 3]  # cut to what is verified
    with pytest.raises(InvalidArgument, match=match):
        check_draft_tokens(drafts, 3, 64)
