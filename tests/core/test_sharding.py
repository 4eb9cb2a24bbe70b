"""The tensor-parallel plan on this process's one device: which weight splits where, what is
refused, and that a split pool keeps its mesh through the steps' updates. (Several devices:
tests/engine/test_tensor_parallel.py, in a subprocess.)"""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from specjax.core.kv import make_kv_pool
from specjax.core.sharding import TensorParallel, make_mesh
from specjax.engine.engine import EngineConfig


@pytest.fixture(scope="module")
def tp():
    return TensorParallel(make_mesh(1))


@pytest.mark.parametrize("name, shape, spec", [
    ("q_proj", (32, 32), P(None, "tp")), ("k_proj", (32, 16), P(None, "tp")),
    ("v_proj", (32, 16), P(None, "tp")), ("gate_proj", (32, 64), P(None, "tp")),
    ("up_proj", (32, 64), P(None, "tp")), ("q_bias", (32,), P("tp")),
    ("o_proj", (32, 32), P("tp", None)), ("down_proj", (64, 32), P("tp", None)),
    ("embed", (64, 32), P("tp", None)), ("lm_head", (32, 64), P(None, "tp")),
    ("input_norm", (32,), P()), ("final_norm", (32,), P()), ("q_norm", (8,), P()),
    ("o_bias", (32,), P()), ("down_bias", (32,), P()),
])
def test_each_weight_splits_where_megatron_splits_it(tp, name, shape, spec):
    assert tp.weight_spec(name, shape) == spec


def test_the_drafter_is_replicated_and_the_pool_split_by_kv_heads(tp):
    from specjax.core.state import EngineState, Params, make_slot_state
    params = Params(target={"embed": np.zeros((64, 32)),
                            "layers": [{"o_proj": np.zeros((32, 32))}]},
                    draft={"q_proj": np.zeros((32, 32))})
    shardings = tp.param_shardings(params)
    assert shardings.target["layers"][0]["o_proj"].spec == P("tp", None)
    assert shardings.draft["q_proj"].spec == P()
    state = EngineState(target=make_kv_pool(2, 2, 8, 4, 4, "float32", tp.mesh),
                        slots=make_slot_state(2, 1),
                        draft=make_kv_pool(1, 2, 8, 4, 4, "float32"))
    placed = tp.state_shardings(state)
    assert placed.target.k.spec == P(None, None, "tp", None, None)
    assert placed.draft.k.spec == P() and placed.slots.run.spec == P()


def test_a_pool_keeps_its_mesh_through_updates(tp):
    pool = make_kv_pool(1, 2, 8, 4, 4, "float32", tp.mesh)
    updated = jax.jit(lambda p: p.replace(k=p.k + 1))(pool)
    assert updated.mesh is tp.mesh


def test_sizes_and_meshes_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 devices; 1 available"):
        make_mesh(2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        EngineConfig(tensor_parallel_size=0)
    mesh = make_mesh(1)
    with pytest.raises(ValueError, match="disagrees with the mesh's 'tp' axis"):
        EngineConfig(tensor_parallel_size=2, mesh=mesh)
    other = Mesh(np.asarray(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="the mesh needs an axis named 'tp'"):
        EngineConfig(mesh=other).tensor_parallel()
