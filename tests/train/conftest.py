"""Fixtures of the head-training tests (constants and helpers: `head_helpers`)."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from head_helpers import TARGET, random_fill
from specjax.models import Llama


@pytest.fixture(scope="module")
def target():
    return random_fill(Llama(TARGET, rngs=nnx.Rngs(0)), seed=0)


@pytest.fixture(scope="module")
def window():
    return jnp.asarray(np.random.default_rng(5).integers(1, 64, size=(2, 9)), jnp.int32)
