"""The parameter-role table (`specjax.models.roles`) names every parameter a layer can hold,
once per checkpoint format, with a role its shape agrees with."""
from specjax.models import ModelConfig
from specjax.models.llama import layer_param_shapes
from specjax.models.roles import BIAS, LAYER, NORM, PROJECTION, ROLES, gguf_layer_names, \
    hf_layer_names

EVERY_OPTION = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=32, qkv_bias=True, o_bias=True,
                           mlp_bias=True, qk_norm=True, sandwich_norms=True)


def test_every_layer_parameter_has_a_role_its_shape_agrees_with():
    shapes = layer_param_shapes(EVERY_OPTION)
    assert set(shapes) == set(LAYER)
    for name, shape in shapes.items():
        role = LAYER[name]
        assert len(shape) == (2 if role.kind == PROJECTION else 1), name
        if role.kind == BIAS:
            # a bias is split as its projection's output features are, or not at all
            projection = ROLES[name.replace("_bias", "_proj")]
            assert role.tp_axis == (-1 if projection.tp_axis == -1 else None), name
            assert shape[-1] == shapes[name.replace("_bias", "_proj")][-1], name
        if role.kind == NORM:
            assert role.tp_axis is None, name


def test_each_format_names_each_parameter_once():
    for sandwich in (False, True):
        names = hf_layer_names(sandwich)
        assert len({n for n, _ in names.values()}) == len(names), sandwich
        assert ("attn_out_norm" in names) == sandwich
    assert hf_layer_names(True)["post_norm"][0] == "pre_feedforward_layernorm.weight"
    gguf = gguf_layer_names()
    assert len(set(gguf.values())) == len(gguf)
    assert all(transpose == (LAYER[n].kind == PROJECTION)
               for n, (_, transpose) in hf_layer_names(True).items())
