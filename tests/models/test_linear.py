"""The CPU kernel's weight layout (`specjax.models.linear`): what is packed, that a packed
model computes what the unpacked one does, and that an engine reports and uses the path it
runs (the kernel, or XLA's dot when told or when the kernel is not there)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import cpu_matmul
from specjax import LLM, SamplingParams
from specjax.models import Llama
from specjax.models.linear import PROJECTIONS, linear, packed_for_cpu
from tests.conftest import TINY

kernel = pytest.mark.skipif(not cpu_matmul.available(), reason=cpu_matmul.status())


def leaves(module):
    return nnx.to_pure_dict(nnx.split(module)[1])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scan", [True, False])
def test_packed_model_computes_the_same_logits(tied, scan):
    model = Llama(TINY.replace(tie_word_embeddings=tied), rngs=nnx.Rngs(3)).for_inference(scan)
    packed = packed_for_cpu(model)
    flat = jax.tree_util.tree_flatten_with_path(leaves(packed))[0]
    names = {str(path[-1].key): leaf for path, leaf in flat}
    # every projection packed as [(L,) P, in, 32]; the embedding and norms untouched
    for name, leaf in names.items():
        if name in PROJECTIONS:
            assert leaf.shape[-1] == cpu_matmul.PANEL and leaf.ndim == (4 if scan and name !=
                                                                       "lm_head" else 3), name
    assert names["embed"].shape == (TINY.vocab_size, TINY.hidden_size)
    # a tied head gets a packed copy of the embedding's transpose; the original is untouched
    assert names["lm_head"].shape == (TINY.vocab_size // 32, TINY.hidden_size, 32)
    assert hasattr(model, "lm_head") == (not tied)
    tokens = jnp.asarray([[1, 5, 9, 2, 7, 3]])
    np.testing.assert_allclose(packed(tokens), model(tokens), rtol=0, atol=2e-5)


def test_linear_takes_both_layouts_and_refuses_others():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((16, 64)), jnp.float32)
    x = jnp.ones((2, 3, 16))
    np.testing.assert_allclose(linear(x, cpu_matmul.pack_weight(w)), x @ w, atol=1e-5)
    np.testing.assert_array_equal(linear(x, w), x @ w)
    with pytest.raises(ValueError, match="packed"):
        linear(x, jnp.ones((1, 2, 16, 32)))


def test_weights_that_do_not_fill_panels_or_are_not_float32_keep_xla():
    model = Llama(TINY.replace(vocab_size=70, dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert all(leaf.ndim <= 3 for leaf in jax.tree.leaves(leaves(packed_for_cpu(model))))
    odd = Llama(TINY.replace(vocab_size=70), rngs=nnx.Rngs(0)).for_inference(False)
    packed = leaves(packed_for_cpu(odd))
    assert packed["lm_head"].shape == (TINY.hidden_size, 70)  # 70 columns: XLA's dot
    assert packed["layers"][0]["o_proj"].ndim == 3


PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]
SIZES = dict(max_batch_size=2, batch_sizes=(2,), prefill_chunk=16, max_prefill_rows=1,
             max_model_len=64, progress=False)


@kernel
def test_the_engine_runs_the_kernel_and_xla_alike(tiny_model):
    """The same greedy tokens through either path (tiny model: no near-ties), each reported
    where users look; `cpu_matmul="xla"` leaves every weight unpacked."""
    params = SamplingParams(max_tokens=12)
    outs, paths = [], []
    for choice in (None, "xla"):
        llm = LLM(tiny_model, cpu_matmul=choice, **SIZES)
        target = llm.engine.executor.params.target
        packed = [x for x in jax.tree.leaves(target) if x.ndim == 3]
        assert bool(packed) == (choice is None)
        outs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        paths.append(llm.stats.matmul)
        llm.reset_stats()
        assert llm.stats.matmul == paths[-1]  # kept by reset
    assert outs[0] == outs[1]
    assert paths == [cpu_matmul.status(), "xla (cpu_matmul='xla')"]


def test_cpu_matmul_choices_are_checked(monkeypatch):
    from specjax.engine.config import EngineConfig
    with pytest.raises(ValueError, match="cpu_matmul must be"):
        EngineConfig(cpu_matmul="fast")
    with pytest.raises(ValueError, match="tensor parallelism keeps XLA's dot"):
        EngineConfig(cpu_matmul="kernel", tensor_parallel_size=2)
    monkeypatch.setenv("SPECJAX_CPU_MATMUL", "xla")
    with pytest.raises(ValueError, match="cannot run here: xla"):
        EngineConfig(cpu_matmul="kernel")
    assert EngineConfig().matmul_path() == "xla (SPECJAX_CPU_MATMUL=xla)"
    assert not EngineConfig().packs_weights()
    assert EngineConfig(tensor_parallel_size=2).matmul_path() == "xla (tensor parallelism)"
