"""EAGLE-3, MTP-Eagle and MTP inside the engine: exact greedy output across batch sizes, real
acceptance, drafts equal to a dense reference, clear errors, SAVE_HIDDEN_STATES files.

The target is a tiny 8-layer Llama whose greedy next token is mostly a fixed permutation of
the current one (its layers perturb that, depending on context), so heads built by hand to
know the permutation get drafts both accepted and rejected (`perm_models`).
"""
import dataclasses
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import SamplingParams
from specjax.engine.compile_counter import count_compilations
from specjax.engine.hidden_states import load_hidden_states
from specjax.models import Llama
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.llama import dense_attention
from specjax.models.mtp_head import MTPHeads
from specjax.speculative.config import EagleConfig, MTPConfig, SaveHiddenStatesConfig
from tests.conftest import TINY
from tests.spec_checks import assert_mixed_acceptance, spec_llm
from tests.speculative.perm_models import CFG, LAYERS, MAX_TOKENS, PROMPTS, eagle_head, mtp_heads


MODES = {
    "eagle3": lambda target, perm, D: EagleConfig(max_draft_len=D,
                                                  speculative_model=eagle_head(target, perm)),
    "mtp_eagle": lambda target, perm, D: MTPConfig(max_draft_len=D, num_nextn_predict_layers=1,
                                                   speculative_model=mtp_heads(1)),
    "mtp": lambda target, perm, D: MTPConfig(max_draft_len=D, num_nextn_predict_layers=3,
                                             speculative_model=mtp_heads(3)),
}



def _full_pool(llm):
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


# Every mode at batch 4; at batch 1 (its own programs: ~5 s a mode) EAGLE-3 in the default run,
# the MTP modes in the slow job.
@pytest.mark.parametrize("max_batch_size, mode", [
    pytest.param(b, m, marks=pytest.mark.slow if b == 1 and m != "eagle3" else ())
    for b in (1, 4) for m in sorted(MODES)])
def test_greedy_output_equals_plain_decoding(perm_target, refs, mode, max_batch_size):
    target, perm = perm_target
    # Every step at full depth, so every path of the worker runs (warm-up turns the cost
    # model on, which picks its own lengths: tests/speculative/test_verify_lengths.py).
    config = dataclasses.replace(MODES[mode](target, perm, 3), draft_len_schedule={1: 3})
    llm = spec_llm(target, config, max_batch_size=max_batch_size, warmup=True)
    with count_compilations() as compiled:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        assert compiled() == 0  # warm-up compiled every shape serving uses
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == refs[tuple(prompt)], (mode, prompt)
    # Drafts were both accepted and rejected, at full depth, so every path of the worker ran.
    assert_mixed_acceptance(llm.stats, 3)
    assert _full_pool(llm)


@pytest.mark.parametrize("mode", ["mtp", "mtp_eagle"])
def test_mtp_acceptance_is_exactly_the_oracle_count(perm_target, refs, mode):
    """The hand-built MTP modules draft perm^j(newest) at depth j, so every step's accepted
    count is fixed by the reference sequence alone: the engine must match it step for step
    in total -- a wrong token shift or hidden-state hand-off in any module shows here."""
    target, perm = perm_target
    D = 3
    llm = spec_llm(target, MODES[mode](target, perm, D))
    llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    accepted = drafted = 0
    verified_hist, accepted_hist = np.zeros(D + 1, int), np.zeros(D + 1, int)
    for prompt in PROMPTS:
        ref = refs[tuple(prompt)]
        # The prompt step emits one token; chain drafters (MTP-Eagle) also draft after it,
        # vanilla MTP starts drafting with the first generation step.
        generated, first = 1, mode == "mtp"
        while generated < MAX_TOKENS:
            room = MAX_TOKENS - generated - 1  # a step may not pass max_tokens
            d = 0 if first else min(D, room)
            token, n = ref[generated - 1], 0
            while n < d:
                token = perm[token]
                if ref[generated + n] != token:
                    break
                n += 1
            accepted, drafted = accepted + n, drafted + d
            if d:
                verified_hist[d] += 1
                accepted_hist[n] += 1
            generated += n + 1
            first = False
    stats = llm.stats
    assert (stats.accepted_draft_tokens, stats.drafted_tokens) == (accepted, drafted)
    # The acceptance-length distribution, step by step, not only its sum.
    assert stats.verified_histogram == np.trim_zeros(verified_hist, "b").tolist()
    assert stats.accepted_histogram == np.trim_zeros(accepted_hist, "b").tolist()
    assert_mixed_acceptance(stats, D)


def test_eagle3_drafts_equal_a_dense_reference(perm_target):
    """After a prompt and one generation step, the engine's drafts are exactly the head run
    densely over the sequence: fuse the captured layers for every verified row, then chain
    single rows that attend to all earlier rows."""
    target, perm = perm_target
    head = Eagle3Head(Eagle3HeadConfig.for_target(CFG), nnx.Rngs(5))  # random: no ties
    D = 3
    llm = spec_llm(target, EagleConfig(max_draft_len=D, speculative_model=head),
                   overlap_scheduler=False, max_batch_size=1)
    engine = llm.engine
    prompt = PROMPTS[1]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=10))
    request = engine.requests[rid]
    while len(request.output_ids) < 2:  # prompt chunks, then one generation step
        engine.step()
    seq = request.all_ids
    n = len(seq) - 1  # rows 0..n-1 are in the target's KV; seq[n] is the newest token
    _, captured = target.forward(jnp.asarray([seq[:n]]), capture_layers=LAYERS)
    embeds = target.embed_tokens(jnp.asarray([seq[1:n + 1]]))
    hidden = head.fuse(captured)
    positions = jnp.arange(n)[None]
    q, k, v, residual = head.qkv_and_residual(embeds, hidden, positions)
    keys, values, pos = k, v, positions
    out = head.finish(dense_attention(q, keys, values, positions, pos), residual)
    h = out[:, -1:]
    expected = []
    for step in range(D):
        token = head.to_target_ids(jnp.argmax(head.logits(h[:, 0]), -1))
        expected.append(int(token[0]))
        row_pos = jnp.asarray([[n + step]])
        q, k, v, residual = head.qkv_and_residual(target.embed_tokens(token[None]), h, row_pos)
        keys = jnp.concatenate([keys, k], 1)
        values = jnp.concatenate([values, v], 1)
        pos = jnp.concatenate([pos, row_pos], 1)
        h = head.finish(dense_attention(q, keys, values, row_pos, pos), residual)
    assert request.draft_tokens == expected
    engine.abort(rid)
    assert _full_pool(llm)


def test_rejection_sampling_mode_keeps_greedy_rows_exact(perm_target, refs):
    target, perm = perm_target
    spec = EagleConfig(max_draft_len=3, speculative_model=eagle_head(target, perm),
                       use_rejection_sampling=True)
    llm = spec_llm(target, spec)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=i)
              for i, t in enumerate([0, 1.0, 0, 0.7, 0])]
    outs = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert len(out.token_ids) == MAX_TOKENS
        assert all(0 <= t < CFG.vocab_size for t in out.token_ids)
        if p.temperature == 0:
            assert out.token_ids == refs[tuple(prompt)]
    assert_mixed_acceptance(llm.stats, 3)
    assert _full_pool(llm)


# ---- errors: named before any work starts ------------------------------------------------

def test_default_capture_layers_refused_for_shallow_targets():
    shallow = Llama(TINY.replace(num_layers=5), rngs=nnx.Rngs(0))
    head = Eagle3Head(Eagle3HeadConfig.for_target(shallow.config), nnx.Rngs(1))
    with pytest.raises(ValueError, match="5 layers"):
        spec_llm(shallow, EagleConfig(max_draft_len=2, speculative_model=head), warmup=False)


def test_capture_layer_outside_the_target_is_named(perm_target):
    target, perm = perm_target
    spec = EagleConfig(max_draft_len=2, speculative_model=eagle_head(target, perm),
                       eagle3_layers_to_capture=(1, 3, 8))
    with pytest.raises(ValueError, match=r"layer\(s\) \[8\] outside the target's 8 layers"):
        spec_llm(target, spec, warmup=False)


def test_head_for_another_target_is_refused(perm_target):
    target, _ = perm_target
    wide = Eagle3Head(Eagle3HeadConfig.for_target(CFG.replace(hidden_size=48, head_dim=12)),
                      nnx.Rngs(1))
    with pytest.raises(ValueError, match="hidden_size 48 but the target's is 32"):
        spec_llm(target, EagleConfig(max_draft_len=2, speculative_model=wide), warmup=False)
    other_vocab = MTPHeads(CFG.replace(vocab_size=80), 1, nnx.Rngs(1))
    with pytest.raises(ValueError, match="vocab_size 80 but the target's is 64"):
        spec_llm(target, MTPConfig(max_draft_len=2, speculative_model=other_vocab), warmup=False)


def test_missing_head_and_too_few_modules_are_named(perm_target):
    target, _ = perm_target
    with pytest.raises(ValueError, match="EagleConfig needs speculative_model"):
        spec_llm(target, EagleConfig(max_draft_len=2), warmup=False)
    spec = MTPConfig(max_draft_len=3, num_nextn_predict_layers=3, speculative_model=mtp_heads(2))
    with pytest.raises(ValueError, match="needs that many modules; the heads have 2"):
        spec_llm(target, spec, warmup=False)


# ---- SAVE_HIDDEN_STATES ------------------------------------------------------------------

def test_save_hidden_states_writes_the_target_residual_streams(perm_target, refs, tmp_path):
    target, _ = perm_target
    layers = (1, 3, 4, 7)
    spec = SaveHiddenStatesConfig(output_directory=tmp_path, write_interval=3,
                                  file_prefix="run")
    llm = spec_llm(target, spec, max_batch_size=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == refs[tuple(prompt)]  # the target runs exactly as plain decoding
    files = sorted(tmp_path.glob("run_*.safetensors"))
    assert files and llm.engine.recorder.files == files
    saved = []
    for path in files:
        file_layers, records = load_hidden_states(path)
        assert file_layers == layers  # default: EAGLE-3's three plus the last
        saved += records
    assert len(saved) == len(PROMPTS)
    by_prompt = {tuple(tokens[:len(p)].tolist()): (tokens, hidden)
                 for tokens, hidden in saved for p in PROMPTS if len(tokens) > len(p)
                 and tokens[:len(p)].tolist() == p}
    for prompt, out in zip(PROMPTS, outs):
        tokens, hidden = by_prompt[tuple(prompt)]
        assert tokens.tolist() == prompt + out.token_ids
        assert hidden.shape == (len(tokens) - 1, len(layers), CFG.hidden_size)
        _, captured = target.forward(jnp.asarray([tokens[:-1]]), capture_layers=layers)
        np.testing.assert_allclose(hidden, np.asarray(captured[:, 0]).transpose(1, 0, 2),
                                   rtol=2e-4, atol=2e-4)
    assert _full_pool(llm)


def test_capture_layers_come_from_the_config_then_the_head_then_the_default(perm_target):
    target, perm = perm_target
    head = eagle_head(target, perm)
    trained_on = Eagle3Head(head.config.replace(aux_hidden_state_layers=(2, 5, 7)), nnx.Rngs(3))
    assert Eagle3HeadConfig.from_hf_dict(trained_on.config.to_hf_dict()) == trained_on.config
    layers = lambda h, **kw: spec_llm(
        target, EagleConfig(max_draft_len=2, speculative_model=h, **kw),
        warmup=False).engine.speculation.worker.capture_layers
    assert layers(head) == LAYERS                      # nothing recorded: (1, L//2-1, L-4)
    assert layers(trained_on) == (2, 5, 7)             # what the head was trained on
    assert layers(trained_on, eagle3_layers_to_capture=(0, 1, 2)) == (0, 1, 2)
    too_deep = Eagle3Head(head.config.replace(aux_hidden_state_layers=(2, 5, 9)), nnx.Rngs(3))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids .*\[9\] outside"):
        layers(too_deep)
