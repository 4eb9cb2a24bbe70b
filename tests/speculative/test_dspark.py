"""DSpark (mode 14) in the engine: the Markov head conditions each draft on the one drafted
before it (and hands rejection sampling that conditional distribution), greedy output equals
plain decoding with and without confidence scheduling, and confidence scheduling verifies what
the drafter's confidences and the step costs say. The statistical tests of sampled output are
`test_rejection_sampling_e2e.py`'s at a fixed length (every shipped in-step drafter, the bundled
DSpark among them) and the one below under confidence scheduling."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import DSparkConfig
from specjax.bench.sampling import (depth_groups, in_step_configs, judge_groups, make_llm,
                                    sample_and_tag, target_probs)
from specjax.core.batch import empty_batch
from specjax.core.sampling import filter_logits
from specjax.engine.costs import CostTable
from specjax.models.dflash_checkpoint import load_dflash_head
from specjax.models.dflash_head import DFlashHeadConfig
from specjax.models.dspark_head import DSparkHead, DSparkHeadConfig
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR, load_model
from specjax.speculative.config import SAEnhancerConfig
from specjax.speculative.workers.dspark import markov_drafts
from tests.conftest import TINY
# The prompts, engine sizes, plain reference and fixed step costs of the cost model's tests.
from tests.speculative.test_verify_lengths import (GREEDY, PROMPTS, _llm,  # noqa: F401
                                                  explore, plain_outputs, set_costs)

DFLASH = CHECKPOINTS_DIR / "stdlib-dflash"
pytestmark = pytest.mark.skipif(not (DFLASH / "config.json").exists(),
                                reason="no bundled DFlash drafter")


def tiny_head(markov_scale: float = 3.0, seed: int = 0) -> DSparkHead:
    config = DSparkHeadConfig.of(DFlashHeadConfig.for_target(TINY, 1, (0,), 4), 8)
    head = DSparkHead(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    head.markov_in[...] = jax.random.normal(key, head.markov_in.shape)
    head.markov_out[...] = markov_scale * jax.random.normal(jax.random.fold_in(key, 1),
                                                            head.markov_out.shape)
    head.confidence[...] = jax.random.normal(jax.random.fold_in(key, 2), head.confidence.shape)
    return head


def test_each_draft_is_drawn_from_its_distribution_given_the_drafted_prefix():
    """Row 0 greedy, rows 1-2 sampled (top-k on row 2): draft k is the argmax of / drawn from
    base_k + markov(draft k-1), and that filtered distribution is the one handed back."""
    head = tiny_head()
    B, K, V = 3, 4, TINY.vocab_size
    base = 2.0 * jax.random.normal(jax.random.key(7), (B, K, V))
    normed = jax.random.normal(jax.random.key(8), (B, K, TINY.hidden_size))
    newest = jnp.array([3, 11, 42], jnp.int32)
    batch = empty_batch(B, K + 1, 2, 0)
    batch.temperature[:] = [0.0, 1.0, 0.7]
    batch.top_k[:] = [0, 0, 5]
    batch.seeds[:] = [1, 2, 3]
    head.calibration[...] = jnp.broadcast_to(jnp.array([[[1.2, 0.0, -0.2]], [[1.0, 0.5, 0.3]]]),
                                             head.calibration.shape)  # greedy, sampled maps
    drafts, probs, conf = jax.jit(lambda b: markov_drafts(
        head, base, normed, newest, b, jnp.array([5, 9, 13]), True))(batch)
    drafts, probs, conf = map(np.asarray, (drafts, probs, conf))
    previous = np.asarray(newest)
    changed = 0
    for k in range(K):
        e, markov = head.markov(jnp.asarray(previous))
        logits = base[:, k] + markov
        assert drafts[0, k] == int(jnp.argmax(logits[0]))
        want = jax.nn.softmax(filter_logits(logits, batch.temperature, batch.top_k,
                                            batch.top_p, batch.min_p), axis=-1)
        np.testing.assert_allclose(probs[1:, k], np.asarray(want)[1:], atol=1e-6)
        assert np.all(probs[np.arange(1, B), k, drafts[1:, k]] > 0)
        unconditioned = jax.nn.softmax(filter_logits(base[:, k], batch.temperature,
                                                     batch.top_k, batch.top_p, batch.min_p), -1)
        changed += int(np.abs(np.asarray(unconditioned)[1:] - probs[1:, k]).max() > 0.05)
        z = np.asarray(head.confidence_logit(normed[:, k], e))
        u = np.asarray(jax.nn.log_softmax(logits, axis=-1).max(-1))
        sampled = np.asarray(batch.temperature) > 0
        logit = np.where(sampled, z + 0.5 + 0.3 * u, 1.2 * z - 0.2 * u)
        np.testing.assert_allclose(conf[:, k], 1 / (1 + np.exp(-logit)), rtol=1e-5)
        previous = drafts[:, k]
    assert changed == K  # the Markov term matters at every depth of this head


@pytest.fixture(scope="module")
def target():
    return load_model(CHECKPOINTS_DIR / BUNDLED_TARGET, "float32")


@pytest.fixture(scope="module")
def dspark_head(target):
    """The shipped DFlash drafter's body with a random Markov head strong enough to change
    its drafts, and confidence = sigmoid(bias_k) (zero weights)."""
    dflash = load_dflash_head(DFLASH, target.config)
    head = DSparkHead(DSparkHeadConfig.of(dflash.config, 16), rngs=nnx.Rngs(0))
    nnx.update(head, nnx.split(dflash)[1])
    head.markov_out[...] = 0.5 * jax.random.normal(jax.random.key(1), head.markov_out.shape)
    head.confidence[...] = 0.3 * jax.random.normal(jax.random.key(2), head.confidence.shape)
    return head


def with_confidence(head: DSparkHead, confidence) -> DSparkHead:
    """A copy whose every row's c_k is `confidence[k]` (zero weights, the bias alone)."""
    copy = nnx.merge(*nnx.split(head))
    copy.confidence[...] = jnp.zeros_like(copy.confidence[...])
    c = jnp.asarray(confidence, jnp.float32)
    copy.calibration[...] = jnp.broadcast_to(
        jnp.stack([jnp.zeros_like(c), jnp.log(c / (1 - c)), jnp.zeros_like(c)], -1)[None],
        copy.calibration.shape)
    return copy


@pytest.mark.parametrize("scheduling", [True, False], ids=["confidence", "online"])
def test_greedy_output_equals_plain_decoding(monkeypatch, plain_outputs, dspark_head,
                                             scheduling):
    """With lengths chosen step by step (by the drafter's confidences, or by online
    estimates) the output is plain decoding's."""
    monkeypatch.setattr(CostTable, "observe", lambda self, *args: None)
    spec = DSparkConfig(max_draft_len=4, speculative_model=dspark_head,
                        confidence_scheduling=scheduling)
    llm = _llm(spec)
    set_costs(llm, lambda d: 1.0 + 0.25 * d)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert llm.stats.accepted_draft_tokens > 0
    assert sum(n > 0 for n in llm.stats.draft_len_histogram) >= 2, \
        llm.stats.draft_len_histogram
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_confidence_scheduling_verifies_what_the_confidences_pay_for(monkeypatch, plain_outputs,
                                                                     dspark_head):
    """Survival 0.99, 0.98, ~0, ~0 and a step that costs 1 + 0.3 D: two drafts pay best
    (2.97 / 1.6 against 1.99 / 1.3 and 2.97 / 1.9), whatever the drafts' real acceptance."""
    monkeypatch.setattr(CostTable, "observe", lambda self, *args: None)
    head = with_confidence(dspark_head, [0.99, 0.99, 0.001, 0.001])
    llm = _llm(DSparkConfig(max_draft_len=4, speculative_model=head))
    set_costs(llm, lambda d: 1.0 + 0.3 * d)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    hist = llm.stats.draft_len_histogram
    # The first steps run on the prior (no confidences read yet); then two drafts a step.
    assert hist[2] >= 0.8 * sum(hist), hist
    # The statistics pair each verified draft with the confidence it was drafted with.
    calibration = llm.stats.calibration
    np.testing.assert_allclose([c for c, _, _ in calibration[:2]], [0.99, 0.99], atol=1e-4)
    assert all(0 <= a <= 1 and n > 0 for _, a, n in calibration)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_bad_configs_are_refused_before_any_work(target):
    dflash = load_dflash_head(DFLASH, target.config)
    with pytest.raises(ValueError, match="DSparkHead"):
        DSparkConfig(max_draft_len=4, speculative_model=dflash)
    with pytest.raises(ValueError, match="SpecjaxDSparkDrafter"):
        _llm(DSparkConfig(max_draft_len=4, speculative_model=str(DFLASH)))
    with pytest.raises(ValueError, match="sa_config"):
        DSparkConfig(max_draft_len=4, speculative_model=str(DFLASH),
                     sa_config=SAEnhancerConfig())
    with pytest.raises(ValueError, match="confidence_scheduling"):
        DSparkConfig(max_draft_len=4, speculative_model=str(DFLASH), confidence_scheduling=1)


# Sampled output with confidence scheduling, at the standard of test_rejection_sampling_e2e.py
# (which runs the shipped DSpark at a fixed length). The drafter is the shipped one with its
# Markov term made MARKOV_GAIN times stronger: its drafts then depend on the drafts before them
# enough that a q read without that dependence shows in the statistic (tests/mutants.py), which
# the shipped head's gentler term does not at this sample size. 128 sequences x 32 tokens at temperature
# 0.8, D = 3, every other step's length chosen from the drafter's confidences (step costs
# 1 + 0.1 D), the others exploring, every token judged against the target's exact distribution at
# its prefix per depth, alpha = 1e-5 per group (fixed seeds: deterministic).
SHIPPED = in_step_configs(3).get("dspark")
N, MAX_TOKENS, TEMPERATURE, D = 128, 32, 0.8, 3
MARKOV_GAIN = 4.0


def stronger_markov(config):
    head = load_dflash_head(CHECKPOINTS_DIR / "stdlib-dspark",
                            load_model(CHECKPOINTS_DIR / BUNDLED_TARGET, "float32").config)
    head.markov_out[...] = MARKOV_GAIN * head.markov_out[...]
    return dataclasses.replace(config, speculative_model=head)


@pytest.fixture(scope="module")
def scheduled_run():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CostTable, "observe", lambda self, *args: None)
        llm = make_llm(stronger_markov(SHIPPED))
        set_costs(llm, lambda d: 1.0 + 0.1 * d)
        # Every other step explores (another length); the rest are the confidences' choice.
        # Seeded rows (the test's) would pin their steps at the configured length.
        explore(llm, every=2, keep_seeded_text=False)
        tags = sample_and_tag(llm, D, N, MAX_TOKENS, TEMPERATURE, seed_offset=5 * 10**6)
    return llm, tags, target_probs(llm, tags.sequences, TEMPERATURE)


@pytest.mark.slow   # 128 sequences sampled and judged: ~37 s here
@pytest.mark.skipif(SHIPPED is None, reason="no bundled DSpark drafter")
def test_sampled_tokens_follow_the_target_under_confidence_scheduling(scheduled_run):
    llm, tags, p = scheduled_run
    hist = llm.stats.draft_len_histogram
    assert all(hist[1:4]), hist
    groups = depth_groups(tags, D)
    for name in ("depth 1", "depth 2", "depth 3", "bonus (full chain)", "bonus (short chain)"):
        assert len(groups[name]) >= (20 if name.startswith("bonus") else 100), \
            (name, len(groups[name]))
    for r in judge_groups(tags, p, D):
        if r.count:
            assert not r.differs, (f"{r.name}: chi2 {r.stat:.1f} > {r.critical:.1f} "
                                   f"(df {r.df}, n {r.count})")
    for r in judge_groups(tags, p, D, drafted=True):   # the power check
        assert r.differs, f"{r.name}: chi2 {r.stat:.1f} <= {r.critical:.1f}"
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
