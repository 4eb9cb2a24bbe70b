"""EAGLE-3 / MTP head training: the training-time-test attention against a per-anchor brute
force, the greedy-chain acceptance report against an explicit simulation, draft-vocabulary
maps, loss going down, the command line end to end, and training from saved hidden states."""
import dataclasses
import inspect
import json
import textwrap
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from specjax.models import Llama, ModelConfig, dense_attention, save_hf_checkpoint
from specjax.models.eagle3_checkpoint import load_eagle3_head
from specjax.models.mtp_checkpoint import load_mtp_heads
from specjax.models.mtp_head import target_lm_head
from specjax.train import corpus, heads
from specjax.train import tokenizer_training as toks
from specjax.train.__main__ import main
from specjax.train.target import TrainConfig

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     rms_norm_eps=1e-5)
EAGLE = heads.HeadSpec(kind="eagle3", depth=3, num_layers=8, capture_layers=(1, 3, 4),
                       draft_vocab=64)


def random_fill(module, seed, scale=0.3):
    """Every parameter random (vectors around 1), so no piece is an identity by accident."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.standard_normal(x.shape) * scale + (len(x.shape) == 1), x.dtype)
              for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


@pytest.fixture(scope="module")
def target():
    return random_fill(Llama(TARGET, rngs=nnx.Rngs(0)), seed=0)


@pytest.fixture(scope="module")
def window():
    return jnp.asarray(np.random.default_rng(5).integers(1, 64, size=(2, 9)), jnp.int32)


# ---- the training-time test ----------------------------------------------------------------


def reference_chain(qkv, finish, hidden1, step_embeds, b, anchor):
    """Anchor `anchor` of batch row `b`, drafted as the engine does: step 1 over every row
    (dense causal), then for j >= 2 one query at position anchor+j-1 attending to a KV cache
    holding the step-1 entries of rows <= anchor and the chain's own entries (a fixed-size
    cache with a validity mask, so one compilation serves every anchor).
    -> the anchor's hidden_outs [K, H]."""
    K, B, T, _ = step_embeds.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    q, k, v, res = qkv(step_embeds[0], hidden1, positions)
    out1 = finish(dense_attention(q, k, v, positions, positions), res)
    cache_k = jnp.concatenate([k[b:b + 1], jnp.zeros_like(k[b:b + 1, :K - 1])], axis=1)
    cache_v = jnp.concatenate([v[b:b + 1], jnp.zeros_like(v[b:b + 1, :K - 1])], axis=1)
    cache_pos = jnp.concatenate([jnp.arange(T), anchor + jnp.arange(1, K)])[None]
    hidden = jax.lax.dynamic_slice_in_dim(out1[b:b + 1], anchor, 1, axis=1)
    outs = [hidden[0, 0]]
    for j in range(1, K):
        pos = jnp.reshape(anchor + j, (1, 1))
        e = jax.lax.dynamic_slice_in_dim(step_embeds[j][b:b + 1], anchor, 1, axis=1)
        q, k, v, res = qkv(e, hidden, pos)
        cache_k = cache_k.at[:, T + j - 1].set(k[:, 0])
        cache_v = cache_v.at[:, T + j - 1].set(v[:, 0])
        valid = jnp.concatenate([jnp.arange(T) <= anchor, jnp.arange(1, K) <= j])[None]
        hidden = finish(dense_attention(q, cache_k, cache_v, pos, cache_pos, k_valid=valid), res)
        outs.append(hidden[0, 0])
    return jnp.stack(outs)


@pytest.mark.parametrize("kind", ["eagle3", "mtp_eagle"])
def test_ttt_attention_equals_per_anchor_engine_chain(target, kind):
    rng = np.random.default_rng(1)
    K, B, T, H = 3, 2, 6, 32
    step_embeds = jnp.asarray(rng.standard_normal((K, B, T, H)), jnp.float32)
    hidden1 = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    if kind == "eagle3":
        spec = EAGLE
        head = random_fill(heads.new_head(spec, target, 0), seed=2)
        qkv, finish = head.qkv_and_residual, head.finish
    else:
        spec = heads.HeadSpec(kind="mtp", depth=K, num_layers=8, num_modules=1)
        module = random_fill(heads.new_head(spec, target, 0), seed=3).modules[0]
        qkv, finish = module.qkv_and_residual, module.finish
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    got = jnp.stack(heads.chain_hidden_outs([qkv] * K, [finish] * K, hidden1, step_embeds,
                                            positions))
    reference = jax.jit(partial(reference_chain, qkv, finish), static_argnums=2)  # b static
    for b in range(B):
        for anchor in range(T):
            want = reference(hidden1, step_embeds, b, anchor)
            np.testing.assert_allclose(np.asarray(got[:, b, anchor]), np.asarray(want),
                                       rtol=2e-5, atol=2e-5)


def test_dense_chain_matches_mtp_heads_forward(target, window):
    """Vanilla MTP trains the dense chain of `MTPHeads.forward`."""
    spec = heads.HeadSpec(kind="mtp", depth=3, num_layers=8, num_modules=3)
    mtp = random_fill(heads.new_head(spec, target, 0), seed=4)
    _, captured = target.forward(window, capture_layers=spec.needed_layers)
    T = window.shape[1] - 1
    got = heads.run_chain(spec, mtp, target, captured,
                          heads.teacher_forced_step_tokens(window, 3))
    want, _ = mtp.forward(target.embed_tokens(window[:, :T + 1])[:, :T + 1],
                          captured[-1], target_lm_head(target))
    # forward's row i of step k predicts token i+k+2 from embeds shifted by k+1: rows < T-k-1
    # have a real input token in both.
    for k in range(3):
        rows = T - k - 1
        np.testing.assert_allclose(np.asarray(got[k][:, :rows]), np.asarray(want[k][:, :rows]),
                                   rtol=1e-5, atol=1e-5)


# ---- the acceptance report ------------------------------------------------------------------


def test_chain_report_statistics():
    rng = np.random.default_rng(0)
    agree = rng.random((4, 500)) < 0.7
    mask = rng.random(500) < 0.9
    report = heads.chain_report(agree, mask)
    a = agree[:, mask]
    leading = np.array([next((k for k in range(4) if not a[k, n]), 4) for n in range(a.shape[1])])
    assert report["expected_acceptance_length"] == pytest.approx(1 + leading.mean())
    for k in range(4):
        d = report["per_depth"][k]
        assert d["agreement"] == pytest.approx(a[k].mean())
        reached = leading >= k
        assert d["reached"] == reached.sum()
        assert d["conditional_agreement"] == pytest.approx(a[k][reached].mean())


SMALL = TARGET.replace(vocab_size=3)


def explicit_acceptance(spec, head, target, tokens):
    """For every anchor on its own, simulate greedy drafting and verification: the target's
    greedy continuation from explicit sequences, the head's chain (`reference_chain`) fed with
    it. -> the number of leading depths that agree, per anchor `[B*T]`."""
    B, T1 = tokens.shape
    T, K = T1 - 1, spec.depth
    forward = jax.jit(lambda seq: target.forward(seq, capture_layers=spec.needed_layers))
    _, captured = forward(tokens)
    hidden1 = head.fuse(captured[:3, :, :T])
    chain = jax.jit(partial(reference_chain, head.qkv_and_residual, head.finish),
                    static_argnums=2)
    counts = []
    for b in range(B):
        for a in range(T):
            seq = list(np.asarray(tokens[b, :a + 2]))
            greedy = []
            for _ in range(K):  # padded to one length: causal, so the padding is harmless
                padded = jnp.asarray([seq + [0] * (T1 + K - len(seq))], jnp.int32)
                greedy.append(int(jnp.argmax(forward(padded)[0][0, len(seq) - 1])))
                seq.append(greedy[-1])
            # Step j >= 2 of this anchor reads the embedding of greedy token j-1.
            inputs = [tokens[:, 1:]] + [jnp.full((B, T), g, jnp.int32) for g in greedy[:-1]]
            embeds = jnp.stack([target.embed_tokens(x) for x in inputs])
            outs = chain(hidden1, embeds, b, a)
            draft = np.asarray(head.to_target_ids(jnp.argmax(head.logits(outs), axis=-1)))
            n = 0
            while n < K and draft[n] == greedy[n]:
                n += 1
            counts.append(n)
    return np.asarray(counts)


def test_report_expected_acceptance_length_equals_explicit_simulation():
    # A 3-token vocabulary, so that agreement (and so depths >= 2) is common.
    target = random_fill(Llama(SMALL, rngs=nnx.Rngs(0)), seed=7, scale=0.5)
    spec = dataclasses.replace(EAGLE, draft_vocab=3)
    head = random_fill(heads.new_head(spec, target, 0), seed=25, scale=0.5)  # reaches depth 3
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 3, size=(2, 9)), jnp.int32)
    batch = {"tokens": tokens, "valid": jnp.ones(tokens.shape, bool)}
    report = heads.acceptance_report(spec, head, target, [batch])
    counts = explicit_acceptance(spec, head, target, tokens)
    assert report["anchors"] == counts.size
    assert report["expected_acceptance_length"] == pytest.approx(1 + counts.mean())
    assert (counts >= 2).any(), "the case should exercise depths beyond the first"


def test_greedy_chain_tokens_equal_explicit_greedy(target, window):
    g = np.asarray(heads.greedy_chain_tokens(target, window, 3))
    B, T1 = window.shape
    forward = jax.jit(lambda seq: target.forward(seq)[0])
    for b in range(B):
        for a in range(T1 - 1):
            seq = list(np.asarray(window[b, :a + 2]))
            for k in range(3):  # padded to one length: causal, so the padding is harmless
                logits = forward(jnp.asarray([seq + [0] * (T1 + 3 - len(seq))], jnp.int32))
                seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
                assert g[k, b, a] == seq[-1], (b, a, k)


# ---- draft vocabulary -----------------------------------------------------------------------


def test_draft_vocab_maps_round_trip(target):
    counts = np.zeros(64, np.int64)
    counts[[3, 10, 11, 40, 63]] = [5, 9, 1, 7, 7]
    d2t, t2d = heads.draft_vocab_maps(counts, 4)
    ids = np.arange(4) + d2t
    np.testing.assert_array_equal(ids, [3, 10, 40, 63])  # top 4 by count, ascending ids
    assert t2d.sum() == 4 and t2d[ids].all()
    spec = dataclasses.replace(EAGLE, depth=2, draft_vocab=4)
    head = heads.new_head(spec, target, 0, counts)
    np.testing.assert_array_equal(np.asarray(head.to_target_ids(jnp.arange(4))), ids)
    # The head's LM head starts as the target's at exactly those ids.
    np.testing.assert_array_equal(np.asarray(head.lm_head[...]),
                                  np.asarray(target_lm_head(target))[:, ids])


# ---- training -------------------------------------------------------------------------------


class Stream(heads.CorpusSource):
    pass


def synthetic_stream(n, seed):
    """Repeated short phrases: a predictable stream the target's hidden states can carry."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, 64, size=rng.integers(3, 7)) for _ in range(6)]
    return np.concatenate([phrases[i] for i in rng.integers(0, 6, size=n)]).astype(np.int32)


@pytest.mark.parametrize("spec", [
    dataclasses.replace(EAGLE, depth=2, draft_vocab=32),
    heads.HeadSpec(kind="mtp", depth=2, num_layers=8, num_modules=2),
], ids=["eagle3_reduced_vocab", "mtp"])
def test_loss_decreases(target, spec, tmp_path):
    """On fixed validation windows, the distance to the target (the soft cross-entropy less the
    labels' own entropy) shrinks over a few dozen steps."""
    source = Stream(synthetic_stream(400, 0), synthetic_stream(100, 1))
    tc = TrainConfig(steps=30, batch_size=4, seq_len=16, lr=1e-2, warmup=3, log_every=10,
                     eval_every=30, eval_windows=4, save_every=30)
    val = source.val_batches(tc.batch_size, tc.seq_len, tc.eval_windows)
    before = heads.validation_metrics(spec, heads.new_head(spec, target, tc.seed,
                                                           source.token_counts(64)), target, val)
    head, entries = heads.train_head(spec, tc, target, source, tmp_path, progress=False)
    after = heads.validation_metrics(spec, head, target, val)
    assert after["val_kl"] < 0.85 * before["val_kl"], (before, after)
    assert after["val_loss"] < before["val_loss"]
    assert entries[-1]["val_loss"] == pytest.approx(after["val_loss"], rel=1e-5)


# ---- command line ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """A tiny target folder as `train target` writes it: weights, tokenizer, corpus manifest."""
    root = tmp_path_factory.mktemp("stdlib")
    source = inspect.getsource(textwrap)
    for i in range(30):  # mod28.py lands in the validation split
        (root / f"mod{i}.py").write_text(source[i * 400: i * 400 + 1200])
    folder = tmp_path_factory.mktemp("target")
    manifest = corpus.build_manifest(root)
    corpus.write_manifest(manifest, folder / corpus.MANIFEST_NAME)
    tok = toks.train_tokenizer(corpus.read_documents(manifest, "train", root), 300)
    toks.save_tokenizer(tok, folder)
    config = TARGET.replace(vocab_size=tok.get_vocab_size(), bos_token_id=0, eos_token_id=0)
    save_hf_checkpoint(random_fill(Llama(config, rngs=nnx.Rngs(0)), seed=0, scale=0.1), folder)
    return folder, root, config


CLI_FLAGS = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
             "--eval-windows", "2", "--report-windows", "2", "--no-progress", "--depth", "2"]


def test_cli_eagle3_end_to_end(target_folder, tmp_path, monkeypatch, capsys):
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "eagle3"
    assert main(["eagle3", "--target", str(folder), "--out", str(out), "--draft-vocab", "200",
                 *CLI_FLAGS]) == 0
    head = load_eagle3_head(out)
    assert head.config.draft_vocab_size == 200 and head.config.vocab_size == config.vocab_size
    assert json.loads((out / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # the default for 8 layers
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    assert size <= 10_000_000
    log = json.loads((out / "training_log.json").read_text())
    assert log["report"]["depth"] == 2 and log["commands"][-1].startswith(
        "python -m specjax.train eagle3 --target")
    assert "E[AL]" in capsys.readouterr().out
    assert "E[AL]" in (out / "MODEL_CARD.md").read_text()


def test_cli_mtp_end_to_end(target_folder, tmp_path, monkeypatch):
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "mtp"
    assert main(["mtp", "--target", str(folder), "--out", str(out), "--num-modules", "2",
                 *CLI_FLAGS]) == 0
    heads_ = load_mtp_heads(out, config)
    assert heads_.num_modules == 2
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sum(f.stat().st_size for f in out.iterdir() if f.is_file()) <= 10_000_000
    assert json.loads((out / "training_log.json").read_text())["report"]["depth"] == 2


# ---- saved hidden states --------------------------------------------------------------------


def write_hidden_states(folder, target, layers, lengths, seed=0):
    """Hand-written SAVE_HIDDEN_STATES files: per request tokens [N+1] and hidden [N, C, H]."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors, saved = {}, []
    for i, n in enumerate(lengths):
        tokens = rng.integers(1, 64, size=n + 1).astype(np.int32)
        _, captured = target.forward(jnp.asarray(tokens[None, :n]), capture_layers=layers)
        tensors[f"tokens_{i}"] = tokens
        tensors[f"hidden_{i}"] = np.asarray(captured[:, 0].transpose(1, 0, 2), np.float32)
        saved.append((tokens, tensors[f"hidden_{i}"]))
    save_file(tensors, str(folder / "data_00000.safetensors"),
              metadata={"format": "specjax-hidden-states-v1", "layers": json.dumps(list(layers))})
    return saved


def test_train_from_hidden_states(target, tmp_path):
    folder = tmp_path / "hs"
    saved = write_hidden_states(folder, target, (1, 3, 4, 7), [20, 9, 30, 12])
    source = heads.HiddenStatesSource(folder, EAGLE.needed_layers, 32, "EAGLE-3")
    assert len(source.val) == 1  # the last request is held out
    batch = source.train_batch(0, 0, 6, 16)
    assert batch["captured"].shape == (4, 6, 17, 32)
    # Each window is a crop of one request (a short one padded): its tokens and the saved
    # states of layers (1, 3, 4, 7) at the same rows.
    for b in range(6):
        n = int(batch["valid"][b].sum())
        tokens = batch["tokens"][b, :n]
        hits = [(t, h, s) for t, h in saved for s in range(len(h) - n + 1)
                if np.array_equal(t[s:s + n], tokens)]
        assert hits, b
        _, hidden, start = hits[0]
        np.testing.assert_array_equal(batch["captured"][:, b, :n],
                                      hidden[start:start + n].transpose(1, 0, 2))
        assert n == 17 or start == 0
    tc = TrainConfig(steps=4, batch_size=3, seq_len=16, warmup=1, log_every=2, eval_every=4,
                     eval_windows=4, save_every=4)
    head, entries = heads.train_head(EAGLE, tc, target, source, tmp_path / "work", progress=False)
    assert np.isfinite([e["loss"] for e in entries if "loss" in e]).all()
    assert np.isfinite([e["val_loss"] for e in entries if "val_loss" in e]).all()


def test_hidden_states_missing_layer_is_a_clear_error(target, tmp_path):
    folder = tmp_path / "hs"
    write_hidden_states(folder, target, (1, 3, 4), [10])  # no last layer (7) for the labels
    with pytest.raises(ValueError, match=r"hold layers \[1, 3, 4\].*missing: \[7\]"):
        heads.HiddenStatesSource(folder, EAGLE.needed_layers, 32, "EAGLE-3")
