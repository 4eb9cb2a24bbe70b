"""Committing a Mamba-2 mixer's state after any prefix of a verified run: the state kept at
depth n is the state a run of only those n positions leaves, from the same starting state,
whichever way it is committed ("states": the scan's per-position state; "replay": the scan
re-run over the accepted inputs)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.recurrent import COMMIT_MODES, commit_mixer
from specjax.models.bamba import Bamba, mamba_mixer, state_shapes
from specjax.models.config import ATTENTION, MAMBA, MambaConfig, ModelConfig

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=8, partial_rotary_factor=0.5,
                  layer_types=(MAMBA, ATTENTION),
                  mamba=MambaConfig(num_heads=4, head_dim=8, num_groups=2, state_size=4,
                                    conv_kernel=4))
B, T = 3, 6


@pytest.fixture(scope="module")
def setup():
    model = Bamba(CFG, rngs=nnx.Rngs(0))
    lp = {n: p[...] for n, p in model.layers[0].items()}
    keys = jax.random.split(jax.random.key(1), 3)
    (K1, C), ssm = state_shapes(CFG)
    h = jax.random.normal(keys[0], (B, T, CFG.hidden_size))
    conv0 = jax.random.normal(keys[1], (B, K1, C))
    h0 = jax.random.normal(keys[2], (B, *ssm))
    _, tape = mamba_mixer(CFG, lp, h, conv0, h0, None, keep_states=True)
    return lp, h, conv0, h0, tape


@pytest.mark.parametrize("mode", COMMIT_MODES)
def test_state_at_depth_n_is_the_state_of_the_first_n_positions(setup, mode):
    lp, h, conv0, h0, tape = setup
    for n in range(T + 1):
        conv, ssm = commit_mixer(tape, jnp.full((B,), n), mode)
        if n == 0:
            want_conv, want_ssm = conv0, h0
        else:
            _, short = mamba_mixer(CFG, lp, h[:, :n], conv0, h0, None, keep_states=False)
            want_conv = short.conv_seq[:, n:]  # the last K-1 inputs
            want_ssm = short.h_final
        np.testing.assert_allclose(np.asarray(conv), np.asarray(want_conv), atol=1e-6,
                                   err_msg=f"conv window at depth {n}")
        np.testing.assert_allclose(np.asarray(ssm), np.asarray(want_ssm), atol=1e-5,
                                   err_msg=f"SSM state at depth {n}")


def test_rows_commit_their_own_depths(setup):
    """Per-row depths in one call: each row gets its own, and the two modes agree."""
    _, _, _, _, tape = setup
    n = jnp.asarray([0, 2, T])
    states = commit_mixer(tape, n, "states")
    replay = commit_mixer(tape, n, "replay")
    for a, b in zip(states, replay):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for row, depth in enumerate([0, 2, T]):
        conv, ssm = commit_mixer(tape, jnp.full((B,), depth), "states")
        np.testing.assert_array_equal(np.asarray(states[0][row]), np.asarray(conv[row]))
        np.testing.assert_array_equal(np.asarray(states[1][row]), np.asarray(ssm[row]))
    # The depths differ, so the states do: a commit that ignored n would pass the rest.
    assert not np.allclose(np.asarray(states[1][1]), np.asarray(states[1][2]))


def test_masked_positions_leave_the_state_alone(setup):
    """Padding past a prompt chunk's length (valid = False) does not move the final state:
    what a prompt-chunk step commits."""
    lp, h, conv0, h0, tape = setup
    valid = jnp.arange(T)[None, :] < jnp.asarray([[1], [4], [T]])
    _, masked = mamba_mixer(CFG, lp, h, conv0, h0, valid, keep_states=False)
    lens = jnp.asarray([1, 4, T])
    _, want = commit_mixer(tape, lens, "states")
    np.testing.assert_allclose(np.asarray(masked.h_final), np.asarray(want), atol=1e-5)
