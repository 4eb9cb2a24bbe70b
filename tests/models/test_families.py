"""Model families as data (`specjax.models.families`), tested from the table itself: every record
with a GGUF architecture as a tiny file written by our writer, read back exactly and against
transformers' own GGUF loader; every record's config.json bias rules against the modules
transformers builds; the lookups and the table's own consistency."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Llama, ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from specjax.models.checkpoint_io import CheckpointError
from specjax.models.families import FAMILIES, PATTERN, family_for_gguf, family_for_hf
from specjax.models.gguf_checkpoint import gguf_config, gguf_metadata, gguf_tensors, load_gguf, \
    write_gguf
from specjax.tokenizer import PRE_TOKENIZERS

IDS = [f.model_type for f in FAMILIES]
PROMPTS = np.random.default_rng(0).integers(0, 128, size=(2, 9))
# What transformers' GGUF loader assumes where the file holds no key it reads: Qwen3Config's
# default head_dim (it reads no key_length for qwen3), and Gemma 3's query_pre_attn_scalar of
# 256 where llama.cpp scales queries by the head size (so the two agree at 256). Its other
# architectures read the head size from the file, or need it to be hidden / heads.
TRANSFORMERS_HEAD_DIM = {"qwen3": 128, "gemma3": 256}
# The architectures whose sliding window transformers' GGUF loader reads (for the others it
# builds full attention, so their files here have none).
TRANSFORMERS_WINDOW = {"gemma3"}


def tiny_gguf_config(family) -> ModelConfig:
    """2 layers, hidden 64, what llama.cpp assumes of the family's files; a window of 3 (shorter
    than the prompts) where transformers reads one."""
    arch = family.gguf_architecture
    head_dim = TRANSFORMERS_HEAD_DIM.get(arch, 32)
    window = 3 if arch in TRANSFORMERS_WINDOW else None
    return ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=head_dim, max_position_embeddings=64,
                       rms_norm_eps=1e-5, rope_theta=1e6, model_type=family.model_type,
                       tie_word_embeddings=family.tie_word_embeddings,
                       **family.gguf_fields(64, 2, head_dim, 2, window))


def randomized(model: Llama, seed: int) -> Llama:
    """Norms 1 + noise and biases noise: a norm or bias read wrongly (or skipped) shows."""
    key = jax.random.key(seed)
    for name in model.layers:
        if name.endswith("norm") or name.endswith("bias"):
            key, sub = jax.random.split(key)
            w = model.layers[name][...]
            noise = 0.3 * jax.random.normal(sub, w.shape, w.dtype)
            model.layers[name].value = noise + (1.0 if name.endswith("norm") else 0.0)
    model.final_norm.value = 1 + 0.3 * jax.random.normal(key, model.final_norm[...].shape)
    return model


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_tiny_gguf_of_each_family_loads_exactly_and_as_transformers_does(family, tmp_path):
    """Our writer's file of each architecture loads back to the weights it was written from
    (the q/k interleave undone where llama.cpp applies it, Gemma's norms as held), as the
    family llama.cpp reads it as; and transformers' GGUF loader gives the same logits from it
    (an independent dequantizer, q/k un-permutation and family mapping)."""
    if family.gguf_architecture is None:
        pytest.skip(f"{family.title}: no GGUF architecture (llama.cpp writes none for it)")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    config = tiny_gguf_config(family)
    # weights 5x the default scale: logits far enough from zero that 1e-4 means something
    model = randomized(Llama(config.replace(initializer_range=0.1), rngs=nnx.Rngs(1)), seed=2)
    path = write_gguf(tmp_path / "tiny.gguf", gguf_metadata(config), gguf_tensors(model))

    loaded = load_gguf(path, dtype="float32")
    read_as = family_for_gguf(family.gguf_architecture)  # Mistral: llama.cpp's "llama"
    assert loaded.config == config.replace(model_type=read_as.model_type)
    for key, value in model.layer_params().items():
        np.testing.assert_array_equal(np.asarray(loaded.layer_params()[key]), np.asarray(value),
                                      err_msg=key)
    np.testing.assert_array_equal(np.asarray(loaded.embed[...]), np.asarray(model.embed[...]))

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    assert hf.config.model_type == read_as.model_type
    logits = np.asarray(loaded.forward(jnp.asarray(PROMPTS, jnp.int32))[0])
    with torch.no_grad():
        expected = hf(torch.tensor(PROMPTS)).logits.numpy()
    err = float(np.abs(logits - expected).max())
    print(f"{family.title}: max |logit diff| vs transformers' GGUF loader {err:.1e} "
          f"(logits up to {np.abs(expected).max():.2f})")
    assert np.abs(expected).max() > 0.5 and err <= 1e-4


HF_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=64)


@pytest.mark.parametrize("switched", [False, True], ids=["biases_off", "biases_on"])
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_config_bias_keys_give_the_biases_transformers_builds(family, switched, tmp_path):
    """attention_bias and mlp_bias in a family's config.json bias what transformers' model of
    it biases, nothing more (Qwen2: q/k/v always; Qwen3: o too; Mistral: neither key); with
    them on, the folder transformers saves gives its logits, and ours saved back loads in
    transformers to them."""
    if family.hybrid:
        pytest.skip(f"{family.title}: its mixers need their own sizes "
                    "(tests/models/test_hf_parity.py's bamba, attention_bias on)")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(family.model_type, **HF_TINY,
                                                  attention_bias=switched, mlp_bias=switched)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    assert type(hf).__name__ == family.hf_architecture
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():  # fresh biases are zero and norms one: a skipped one hides
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf", dtype="float32")
    layer = hf.model.layers[0]
    attn = layer.self_attn
    assert (model.config.qkv_bias, model.config.o_bias, model.config.mlp_bias) == (
        attn.q_proj.bias is not None, attn.o_proj.bias is not None,
        layer.mlp.gate_proj.bias is not None)
    if not switched:
        return
    tokens = np.random.default_rng(1).integers(0, 97, size=(2, 7))
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits.numpy()
    logits = np.asarray(model.forward(jnp.asarray(tokens, jnp.int32))[0])
    assert float(np.abs(logits - expected).max()) <= 1e-4
    save_hf_checkpoint(model, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert float(np.abs(again(torch.tensor(tokens)).logits.numpy() - expected).max()) <= 1e-4


def test_lookups_name_what_is_supported():
    assert [family_for_hf(f.model_type) for f in FAMILIES] == list(FAMILIES)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2' .*supported: llama, "
                                         "mistral, qwen2, qwen3, gemma3_text, bamba"):
        family_for_hf("gpt2")
    with pytest.raises(CheckpointError, match="GGUF architecture 'gptneox' is not supported "
                                              r"\(supported: llama, mistral, qwen2"):
        family_for_gguf("gptneox")
    # llama.cpp writes Mistral as llama: a llama file is a Llama; the name "mistral" is read too
    assert family_for_gguf("llama").model_type == "llama"
    assert family_for_gguf(family_for_hf("mistral").gguf_architecture).model_type == "llama"
    assert family_for_gguf("mistral").model_type == "mistral"


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_each_family_names_pre_tokenizers_that_exist(family):
    """A family's byte-level GGUF files split text by a pre-tokenizer specjax implements (a
    name missing from the table would fall back to GPT-2's split: other token ids)."""
    assert set(family.gguf_pre) <= set(PRE_TOKENIZERS)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.gguf_architecture], ids=lambda f:
                         f.model_type)
def test_sliding_windows_round_trip_through_gguf_or_are_refused(family):
    """One window size is a GGUF key; the layers it covers are what llama.cpp assumes of the
    family (Gemma 3: every sixth global). A config whose layers are otherwise is refused,
    naming the field, rather than written as a file that loads as another model."""
    base = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=6,
                       num_heads=2, num_kv_heads=1, head_dim=16, model_type=family.model_type)
    config = base.replace(**family.gguf_fields(32, 2, 16, 6, 4))
    assert config.sliding_windows == ((4, 4, 4, 4, 4, None) if family.windows == PATTERN
                                      else (4,) * 6)
    assert gguf_config(gguf_metadata(config)).sliding_windows == config.sliding_windows
    with pytest.raises(ValueError, match=r"not what llama.cpp assumes .*sliding_windows"):
        gguf_metadata(config.replace(sliding_windows=(None, 4, 4, 4, 4, 4)))


def test_window_rules_read_config_json_as_transformers_does():
    """Which layers slide, per family, from the keys its config.json uses: as the layer types
    transformers' own config gives (Llama and Mistral have none: Llama never slides, Mistral's
    window covers every layer)."""
    transformers = pytest.importorskip("transformers")
    common = dict(HF_TINY, num_hidden_layers=4, sliding_window=3)
    cases = {"llama": {}, "mistral": {},
             "qwen2": {"use_sliding_window": True, "max_window_layers": 1},
             "qwen3": {},  # use_sliding_window defaults to false
             "gemma3_text": {"sliding_window_pattern": 2}}
    assert set(cases) == {f.model_type for f in FAMILIES if not f.hybrid}
    seen = set()
    for model_type, extra in cases.items():
        hf = transformers.AutoConfig.for_model(model_type, **common, **extra)
        window, types = getattr(hf, "sliding_window", None), getattr(hf, "layer_types", None)
        if model_type == "llama" or window is None:
            expected = None
        else:
            expected = tuple(window if t == "sliding_attention" else None
                             for t in types or ["sliding_attention"] * 4)
        assert ModelConfig.from_hf_dict(hf.to_dict()).sliding_windows == expected, model_type
        seen.add(expected)
    assert {None, (3, 3, 3, 3), (None, 3, 3, 3), (3, None, 3, None)} == seen
    # Gemma 3's config.json before transformers wrote layer_types: its pattern key, else 6.
    old = {k: v for k, v in transformers.AutoConfig.for_model(
        "gemma3_text", **dict(common, num_hidden_layers=7)).to_dict().items()
        if k != "layer_types"}
    assert ModelConfig.from_hf_dict(old).sliding_windows == (3,) * 5 + (None, 3)
    assert ModelConfig.from_hf_dict({**old, "sliding_window_pattern": 3}).sliding_windows == (
        3, 3, None, 3, 3, None, 3)
