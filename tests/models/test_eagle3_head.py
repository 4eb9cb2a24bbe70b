"""EAGLE-3 head: the public checkpoint layout (written here by hand), parity of the forward
with a PyTorch/transformers re-statement of the public head, the split methods used with a KV
cache, the fuse order, the draft->target vocabulary map, and loading errors."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from specjax.models import CheckpointError, read_safetensors
from specjax.models.llama import dense_attention
from specjax.models.config import RopeScaling
from specjax.models.eagle3_checkpoint import load_eagle3_head, save_eagle3_head
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig

H, F, NH, KV, HD, V, VD = 16, 24, 4, 2, 4, 50, 20
B, T = 2, 6

# A public-style config.json, written by hand (Llama-style + draft_vocab_size), with llama3
# RoPE scaling so the head's rotary tables are checked against transformers' too.
HF_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": F, "num_hidden_layers": 1, "num_attention_heads": NH,
    "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "vocab_size": V, "draft_vocab_size": VD, "torch_dtype": "float32", "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def public_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random head weights under the public names and `[out, in]` shapes, by hand."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(np.float32)
    norm = lambda: (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)
    ids = np.sort(rng.choice(V, VD, replace=False))     # the draft vocabulary, in target ids
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    return {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, NH * HD),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": w(F, H),
        "midlayer.mlp.up_proj.weight": w(F, H),
        "midlayer.mlp.down_proj.weight": w(H, F),
        "norm.weight": norm(),
        "lm_head.weight": w(VD, H),
        "d2t": (ids - np.arange(VD)).astype(np.int64),
        "t2d": t2d,
    }


def write_folder(folder, tensors, config=HF_CONFIG):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    tensors = public_tensors(0)
    # Extra tensors public heads carry that the loader must skip: the target's embedding copy
    # and a rotary buffer.
    extra = {"embed_tokens.weight": np.ones((V, H), np.float32),
             "midlayer.self_attn.rotary_emb.inv_freq": np.ones((HD // 2,), np.float32)}
    folder = write_folder(tmp_path_factory.mktemp("eagle3"), {**tensors, **extra})
    return tensors, folder, load_eagle3_head(folder)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(7)
    embeds, captured, hidden = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                                for shape in ((B, T, H), (3, B, T, H), (B, T, H)))
    positions = jnp.broadcast_to(jnp.arange(T) + 5, (B, T))
    return embeds, captured, hidden, positions


def torch_reference(tensors, embeds, captured_or_hidden, positions, first):
    """The public EAGLE-3 head restated with transformers' Llama pieces (eager attention)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as m
    cfg = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=F, num_attention_heads=NH, num_key_value_heads=KV,
        head_dim=HD, rms_norm_eps=1e-5, vocab_size=V,
        rope_parameters={"rope_theta": 500000.0, **HF_CONFIG["rope_scaling"]})
    cfg._attn_implementation = "eager"
    t = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    lin = lambda name, n_in, n_out: _linear(torch, t[name], n_in, n_out)
    attn = m.LlamaAttention(cfg, layer_idx=0)
    attn.q_proj = lin("midlayer.self_attn.q_proj.weight", 2 * H, NH * HD)
    attn.k_proj = lin("midlayer.self_attn.k_proj.weight", 2 * H, KV * HD)
    attn.v_proj = lin("midlayer.self_attn.v_proj.weight", 2 * H, KV * HD)
    attn.o_proj = lin("midlayer.self_attn.o_proj.weight", NH * HD, H)
    mlp = m.LlamaMLP(cfg)
    mlp.gate_proj = lin("midlayer.mlp.gate_proj.weight", H, F)
    mlp.up_proj = lin("midlayer.mlp.up_proj.weight", H, F)
    mlp.down_proj = lin("midlayer.mlp.down_proj.weight", F, H)

    def norm(name):
        n = m.LlamaRMSNorm(H, eps=1e-5)
        n.weight.data = t[name].clone()
        return n

    rotary = m.LlamaRotaryEmbedding(cfg)
    with torch.no_grad():
        x = torch.from_numpy(np.array(captured_or_hidden))
        if first:  # [3, B, T, H] -> cat along features in capture order -> fc
            x = torch.cat(list(x), dim=-1) @ t["fc.weight"].T
        emb = torch.from_numpy(np.array(embeds))
        pos = torch.from_numpy(np.array(positions)).long()
        residual = x
        cat = torch.cat([norm("midlayer.input_layernorm.weight")(emb),
                         norm("midlayer.hidden_norm.weight")(x)], dim=-1)
        causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        out, _ = attn(cat, position_embeddings=rotary(cat, pos), attention_mask=causal)
        x = residual + out
        x = x + mlp(norm("midlayer.post_attention_layernorm.weight")(x))
        logits = norm("norm.weight")(x) @ t["lm_head.weight"].T
    return logits.numpy(), x.numpy()


def _linear(torch, weight, n_in, n_out):
    layer = torch.nn.Linear(n_in, n_out, bias=False)
    assert tuple(weight.shape) == (n_out, n_in)
    layer.weight.data = weight.clone()
    return layer


# ---- layout and loading --------------------------------------------------------------------

def test_loaded_parameters_are_the_public_tensors(public):
    tensors, _, head = public
    assert head.config == Eagle3HeadConfig(
        hidden_size=H, intermediate_size=F, num_heads=NH, num_kv_heads=KV, head_dim=HD,
        vocab_size=V, draft_vocab_size=VD, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16))
    np.testing.assert_array_equal(head.fc[...], tensors["fc.weight"].T)
    np.testing.assert_array_equal(head.norm[...], tensors["norm.weight"])
    np.testing.assert_array_equal(head.lm_head[...], tensors["lm_head.weight"].T)
    for key, name in [("input_layernorm", "input_layernorm"), ("hidden_norm", "hidden_norm"),
                      ("post_attention_layernorm", "post_attention_layernorm")]:
        np.testing.assert_array_equal(head.midlayer[key][...], tensors[f"midlayer.{name}.weight"])
    for key in ("q_proj", "k_proj", "v_proj", "o_proj"):
        np.testing.assert_array_equal(head.midlayer[key][...],
                                      tensors[f"midlayer.self_attn.{key}.weight"].T)
    for key in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(head.midlayer[key][...],
                                      tensors[f"midlayer.mlp.{key}.weight"].T)
    np.testing.assert_array_equal(head.d2t[...], tensors["d2t"])
    np.testing.assert_array_equal(head.t2d[...], tensors["t2d"])
    assert head.d2t[...].dtype == jnp.int32 and head.t2d[...].dtype == jnp.bool_
    # d2t/t2d are not trainable parameters; the embedding copy was not taken.
    params = nnx.state(head, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == sum(
        a.size for n, a in tensors.items() if n not in ("d2t", "t2d"))


@pytest.mark.parametrize("first", [True, False])
def test_forward_matches_the_public_head_in_transformers(public, inputs, first):
    tensors, _, head = public
    embeds, captured, hidden, positions = inputs
    x = captured if first else hidden
    logits, hidden_out = head.forward(embeds, x, positions, is_first_step=first)
    assert logits.shape == (B, T, VD) and logits.dtype == jnp.float32
    assert hidden_out.shape == (B, T, H)
    ref_logits, ref_hidden = torch_reference(tensors, embeds, x, positions, first)
    np.testing.assert_allclose(np.asarray(hidden_out), ref_hidden, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=2e-5, atol=2e-5)


def test_save_writes_the_public_layout_and_round_trips(public, inputs, tmp_path):
    tensors, _, head = public
    save_eagle3_head(head, tmp_path)
    written = read_safetensors(tmp_path)
    assert {n: a.shape for n, a in written.items()} == {n: a.shape for n, a in tensors.items()}
    for name, array in tensors.items():
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    again = load_eagle3_head(tmp_path)
    assert again.config == head.config
    embeds, captured, _, positions = inputs
    np.testing.assert_array_equal(np.asarray(again.forward(embeds, captured, positions)[0]),
                                  np.asarray(head.forward(embeds, captured, positions)[0]))


def test_sharded_index_and_dtype_override(public, tmp_path):
    tensors, _, head = public
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    again = load_eagle3_head(tmp_path, dtype="bfloat16")
    assert again.config.dtype == "bfloat16" and again.fc[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(again.fc[...], np.float32),
                                  np.asarray(head.fc[...].astype(jnp.bfloat16), np.float32))


def _edited(public, tmp_path, drop=(), **replace):
    tensors = {n: a for n, a in public[0].items() if n not in drop}
    tensors.update(replace)
    return write_folder(tmp_path / "edited", tensors)


def test_missing_tensor_is_named(public, tmp_path):
    folder = _edited(public, tmp_path, drop=("norm.weight",))
    with pytest.raises(CheckpointError, match=r"'norm\.weight' is missing"):
        load_eagle3_head(folder)


def test_wrong_shape_names_tensor_and_both_shapes(public, tmp_path):
    # q_proj built for H inputs instead of the 2H concatenation.
    folder = _edited(public, tmp_path, **{"midlayer.self_attn.q_proj.weight":
                                          np.zeros((NH * HD, H), np.float32)})
    with pytest.raises(CheckpointError, match=r"'midlayer\.self_attn\.q_proj\.weight' has "
                                              r"shape \(16, 16\), expected \(16, 32\)"):
        load_eagle3_head(folder)


def test_bin_only_folder_says_safetensors_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors only"):
        load_eagle3_head(tmp_path)


@pytest.mark.parametrize("edit, match", [
    (dict(d2t=np.full((VD,), V, np.int64)), r"'d2t' maps draft ids outside .*\[0, 50\)"),
    (dict(t2d=np.ones((V,), bool)), r"'t2d' and 'd2t' disagree"),
    (dict(d2t=np.zeros((VD,), np.float32)), r"'d2t' has dtype float32"),
    ({"midlayer.extra.weight": np.zeros(3, np.float32)}, r"does not name: midlayer\.extra"),
])
def test_bad_vocab_maps_and_unknown_tensors_are_refused(public, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        load_eagle3_head(_edited(public, tmp_path, **edit))


def test_full_vocab_head_may_omit_the_maps(public, tmp_path):
    tensors = {n: a for n, a in public[0].items() if n not in ("d2t", "t2d")}
    tensors["lm_head.weight"] = np.zeros((V, H), np.float32)
    folder = write_folder(tmp_path, tensors, {**HF_CONFIG, "draft_vocab_size": V})
    head = load_eagle3_head(folder)
    ids = jnp.arange(V)
    np.testing.assert_array_equal(head.to_target_ids(ids), ids)
    assert bool(head.t2d[...].all())
    # ... but a reduced vocabulary without them is an error naming the tensor.
    with pytest.raises(CheckpointError, match=r"'d2t' is missing"):
        load_eagle3_head(_edited(public, tmp_path, drop=("d2t",)))


@pytest.mark.parametrize("change, match", [
    (dict(num_hidden_layers=2), "num_hidden_layers=2"),
    (dict(target_hidden_size=32), "target_hidden_size=32"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(draft_vocab_size=V + 1), "draft_vocab_size .* exceeds vocab_size"),
])
def test_unsupported_config_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        Eagle3HeadConfig.from_hf_dict({**HF_CONFIG, **change})


def test_config_json_round_trip():
    config = Eagle3HeadConfig.from_hf_dict(HF_CONFIG)
    assert Eagle3HeadConfig.from_hf_dict(config.to_hf_dict()) == config
    plain = config.replace(rope_scaling=RopeScaling("linear", 2.0), dtype="bfloat16")
    assert Eagle3HeadConfig.from_hf_dict(plain.to_hf_dict()) == plain
    assert hash(config) == hash(Eagle3HeadConfig.from_hf_dict(HF_CONFIG))


# ---- the pure pieces -------------------------------------------------------------------------

def test_fuse_concatenates_captured_layers_in_order(public, inputs):
    _, _, head = public
    _, captured, _, _ = inputs
    for c in range(3):  # an fc that selects block c must return captured[c]
        fc = jnp.zeros((3 * H, H)).at[c * H:(c + 1) * H].set(jnp.eye(H))
        selected = nnx.merge(*nnx.split(head))
        selected.fc[...] = fc
        np.testing.assert_allclose(selected.fuse(captured), captured[c], atol=1e-6)
    with pytest.raises(ValueError, match=r"captured \[3, B, T, 16\]"):
        head.fuse(captured[:2])


def test_split_methods_with_a_kv_cache_equal_the_dense_forward(public, inputs):
    """Prefix through the split pieces keeping K/V, then one token attending over the cache:
    the way the paged worker will use them."""
    _, _, head = public
    embeds, captured, _, positions = inputs
    P = T - 1

    @nnx.jit  # one compilation instead of one per eager op and shape
    def run(head, embeds, captured, positions):
        dense_logits, dense_hidden = head.forward(embeds, captured, positions)
        hidden = head.fuse(captured)
        q, k, v, res = head.qkv_and_residual(embeds[:, :P], hidden[:, :P], positions[:, :P])
        prefix_out = head.finish(dense_attention(q, k, v, positions[:, :P], positions[:, :P]),
                                 res)
        q1, k1, v1, res1 = head.qkv_and_residual(embeds[:, P:], hidden[:, P:], positions[:, P:])
        attn = dense_attention(q1, jnp.concatenate([k, k1], 1), jnp.concatenate([v, v1], 1),
                               positions[:, P:], positions)
        last_out = head.finish(attn, res1)
        # run_layer threads the attend callback's state through.
        out, state = head.run_layer(
            embeds, hidden, positions,
            lambda q, k, v, s: (dense_attention(q, k, v, positions, positions), s + 1), 0)
        return dict(dense_logits=dense_logits, dense_hidden=dense_hidden, hidden=hidden, q=q,
                    k=k, v=v, res=res, prefix_out=prefix_out, last_out=last_out,
                    last_logits=head.logits(last_out), out=out, state=state)

    r = run(head, embeds, captured, positions)
    np.testing.assert_allclose(r["prefix_out"], r["dense_hidden"][:, :P], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["last_out"], r["dense_hidden"][:, P:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["last_logits"], r["dense_logits"][:, P:], rtol=1e-5, atol=1e-5)
    assert r["q"].shape == (B, P, NH, HD) and r["k"].shape == r["v"].shape == (B, P, KV, HD)
    # The residual is the un-normalised hidden.
    np.testing.assert_array_equal(r["res"], r["hidden"][:, :P])
    assert int(r["state"]) == 1
    np.testing.assert_allclose(r["out"], r["dense_hidden"], rtol=1e-6, atol=1e-6)


def test_forward_checks_the_input_rank(public, inputs):
    _, _, head = public
    embeds, captured, hidden, _ = inputs
    with pytest.raises(ValueError, match=r"is_first_step=True expects captured"):
        head.forward(embeds, hidden)
    with pytest.raises(ValueError, match=r"is_first_step=False expects hidden"):
        head.forward(embeds, captured, is_first_step=False)


def test_d2t_maps_draft_ids_and_scatters_to_the_target_vocab(public):
    tensors, _, head = public
    target_ids = np.flatnonzero(tensors["t2d"])      # the draft vocabulary, ascending
    draft = jnp.asarray([[0, 3, VD - 1]])
    np.testing.assert_array_equal(head.to_target_ids(draft), target_ids[[0, 3, VD - 1]][None])
    probs = jax.nn.softmax(jnp.asarray(np.random.default_rng(0).standard_normal((2, VD))))
    full = head.to_target_vocab(probs)
    assert full.shape == (2, V)
    np.testing.assert_allclose(full[:, target_ids], probs)
    np.testing.assert_array_equal(full[:, ~tensors["t2d"]], 0.0)
    np.testing.assert_allclose(full.sum(-1), 1.0, rtol=1e-6)
    logits = head.to_target_vocab(jnp.log(probs), fill_value=-jnp.inf)
    np.testing.assert_array_equal(jnp.argmax(logits, -1), target_ids[jnp.argmax(probs, -1)])


def test_fresh_head_shapes_and_identity_map():
    config = Eagle3HeadConfig(hidden_size=H, intermediate_size=F, num_heads=NH, num_kv_heads=KV,
                              head_dim=HD, vocab_size=V, draft_vocab_size=VD)
    head = Eagle3Head(config, nnx.Rngs(0))
    shapes = {"/".join(map(str, path)): x.shape
              for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(head)))}
    assert shapes == {
        "['fc']": (3 * H, H), "['norm']": (H,), "['lm_head']": (H, VD), "['d2t']": (VD,),
        "['t2d']": (V,),
        **{f"['midlayer']/['{k}']": s for k, s in {
            "input_layernorm": (H,), "hidden_norm": (H,), "q_proj": (2 * H, NH * HD),
            "k_proj": (2 * H, KV * HD), "v_proj": (2 * H, KV * HD), "o_proj": (NH * HD, H),
            "post_attention_layernorm": (H,), "gate_proj": (H, F), "up_proj": (H, F),
            "down_proj": (F, H)}.items()}}
    np.testing.assert_array_equal(head.to_target_ids(jnp.arange(VD)), jnp.arange(VD))
    assert int(head.t2d[...].sum()) == VD


def test_missing_folder_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle3_head(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        load_eagle3_head(tmp_path)


def test_config_for_target_copies_the_layer_shape_and_rope():
    from specjax.models import ModelConfig
    target = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=8,
                         num_heads=NH, num_kv_heads=KV, head_dim=HD, rms_norm_eps=1e-5,
                         rope_theta=5e5, rope_scaling=RopeScaling("linear", 2.0),
                         dtype="bfloat16")
    config = Eagle3HeadConfig.for_target(target, draft_vocab_size=VD)
    assert config == Eagle3HeadConfig(
        hidden_size=H, intermediate_size=F, num_heads=NH, num_kv_heads=KV, head_dim=HD,
        vocab_size=V, draft_vocab_size=VD, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling=RopeScaling("linear", 2.0), dtype="bfloat16")
    assert Eagle3HeadConfig.for_target(target).draft_vocab_size == V
    assert Eagle3HeadConfig.for_target(target, intermediate_size=8).intermediate_size == 8
