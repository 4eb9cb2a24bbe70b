"""Fixtures the hidden-state drafter tests share: the perm target (`perm_models`) and plain
greedy's continuations of the shared prompts."""
import pytest

from specjax.models.dense_greedy import dense_greedy
from tests.speculative import perm_models
from tests.speculative.perm_models import MAX_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def perm_target():
    return perm_models.perm_target()


@pytest.fixture(scope="module")
def refs(perm_target):
    """Plain greedy's MAX_TOKENS tokens after each of PROMPTS, by prompt."""
    model, _ = perm_target
    return {tuple(p): dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS}
