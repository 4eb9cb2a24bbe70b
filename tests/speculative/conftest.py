"""Fixtures the hidden-state drafter tests share: the perm target (`perm_models`), plain
greedy's continuations of the shared prompts, and prompts that repeat the target's own text
(the SA tests)."""
import pytest

from specjax.models.dense_greedy import dense_greedy
from tests.speculative import perm_models
from tests.speculative.perm_models import MAX_TOKENS, PROMPTS
from tests.speculative.sa_engines import MAX_TOKENS as SA_TOKENS


@pytest.fixture(scope="module")
def perm_target():
    return perm_models.perm_target()


@pytest.fixture(scope="module")
def refs(perm_target):
    """Plain greedy's MAX_TOKENS tokens after each of PROMPTS, by prompt."""
    model, _ = perm_target
    return {tuple(p): dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def repetitive(perm_target):
    """Prompts that repeat the target's own text: [p, g[:12], p, g[:2]] with g plain greedy's
    continuation of p, and a short one whose repeat starts mid-prompt; with plain greedy's
    continuations."""
    target, _ = perm_target
    prompts = []
    for p in PROMPTS[:4]:
        g = dense_greedy(target, p, 12)
        prompts.append(p + g + p + g[:2])
    prompts.append([5, 6, 7, 8, 5, 6])
    return prompts, {tuple(p): dense_greedy(target, p, SA_TOKENS) for p in prompts}
