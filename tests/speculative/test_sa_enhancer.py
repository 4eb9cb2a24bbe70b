"""The SA enhancer inside the engine: with `sa_config` on every in-step drafter's config
(EAGLE-3 chain and tree, MTP-Eagle, draft-target, PARD, DFlash) greedy output equals plain
decoding (batch 1 and 4, overlap on and off, nothing compiled once a batch size has run,
the pool back to full); the enhancer chooses per request; rows verifying SA's drafts are accepted
by strict matching under rejection sampling (checked token by token), beside greedy rows.

The prompts repeat spans of the perm target's own greedy text (`repetitive`), so SA finds
matches that are right for a while and then wrong.
"""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import SamplingParams
from specjax.core.sampling import sample, sampling_keys
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy
from specjax.speculative.config import DraftTargetConfig, SAEnhancerConfig
from tests.speculative.perm_models import CFG, shared_parallel_drafter
from tests.speculative.sa_engines import (D, MAX_TOKENS, built_on_first_use, check_greedy,
                                          enhanced, full_pool, make_llm)


@pytest.fixture(scope="module")
def drafters():
    """PARD and DFlash drafters trained for the perm target, once per process (at
    `PARALLEL_DEPTH`, shared with `test_parallel_engine`; they run at any depth, here D)."""
    return shared_parallel_drafter


@pytest.fixture(scope="module")
def llms(perm_target, drafters):
    """One engine per drafter with the enhancer, built on first use (its first run compiles
    the shapes it uses; later runs compile nothing); every pool full at the end."""
    target, perm = perm_target
    get = built_on_first_use(lambda kind: make_llm(target, enhanced(kind, target, perm,
                                                                      drafters)))
    yield get
    for llm in get.made.values():
        assert full_pool(llm)


ENHANCED = ["eagle3", "eagle3-tree", "mtp", "draft_target", "pard", "dflash"]
# The default run enhances a hidden-state drafter and a draft model (the two ways a step feeds
# its drafter); the enhancer's rows are the same for the rest, which run in the slow job (each
# drafter's first batch compiles its engine: 7-16 s here).
DEFAULT_RUN = ("eagle3", "draft_target")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k in DEFAULT_RUN else
                                               pytest.mark.slow) for k in ENHANCED])
@pytest.mark.parametrize("batch,overlap", [(1, True), (4, True), (4, False)])
def test_enhanced_greedy_output_equals_plain_decoding(llms, repetitive, kind, batch, overlap):
    llm = llms(kind)
    ran = llm.__dict__.setdefault("batches_run", set())
    # A batch size's first run compiles its shapes; a later run (overlap off) compiles nothing.
    stats = check_greedy(llm, repetitive, batch, overlap, compiles=batch not in ran)
    ran.add(batch)
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens, kind


def _wrong_drafter(target):
    """A draft model of random weights: its drafts are almost never the target's."""
    return Llama(target.config.replace(num_layers=1), rngs=nnx.Rngs(7))


def test_the_enhancer_switches_per_request(perm_target, repetitive):
    """One batch: a request whose context repeats and one whose does not, with a drafter
    that is always wrong. Only the repeating request accepts drafts -- SA's, which replace the
    drafter's for it alone -- and the other verifies the drafter's (all rejected)."""
    target, _ = perm_target
    prompts, refs = repetitive
    rng = np.random.default_rng(5)
    fresh = rng.permutation(CFG.vocab_size)[:6].tolist()  # no token repeats: no match at first
    params = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=8)]
    spec = DraftTargetConfig(max_draft_len=D, speculative_model=_wrong_drafter(target),
                             sa_config=SAEnhancerConfig(threshold=3))
    llm = make_llm(target, spec, max_batch_size=2)
    outs = llm.generate([prompts[1], fresh], params)
    assert outs[0].token_ids == refs[tuple(prompts[1])]
    assert outs[1].token_ids == dense_greedy(target, fresh, 8)
    accepted = [o.stats.num_accepted_draft_tokens for o in outs]
    drafted = [o.stats.num_draft_tokens for o in outs]
    assert accepted[0] >= 6 and accepted[1] == 0 and drafted[1] >= 4, (accepted, drafted)
    assert full_pool(llm)


def test_strict_rows_and_rejection_rows_in_one_step(perm_target, repetitive):
    """Greedy and sampled requests together with EAGLE-3 + SA under rejection sampling: the
    greedy ones stay plain greedy's, every request finishes, and the pool is full again."""
    target, perm = perm_target
    prompts, refs = repetitive
    llm = make_llm(target, enhanced("eagle3", target, perm, None))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8 * (i % 2), seed=i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == MAX_TOKENS
        if i % 2 == 0:
            assert out.token_ids == refs[tuple(prompt)]
    assert llm.engine.state.slots.strict is not None
    assert full_pool(llm)


def test_sa_rows_are_accepted_strictly_under_rejection_sampling(llms, perm_target, repetitive):
    """EAGLE-3 + SA with rejection sampling, sampled: every token emitted by a step that
    verified SA's drafts is the target's own draw for its position -- the request's key at
    that position applied to the target's distribution given the tokens before it -- as
    strict matching makes it. (Rejection sampling would judge SA's drafts against the head's
    distribution, which did not draw them, and emit other tokens.)"""
    prompts, _ = repetitive
    llm = llms("eagle3")  # EAGLE-3 with rejection sampling (the default) + SA (threshold 4)
    llm.engine.overlap = False  # the slot state read after a step is what the next verifies
    engine = llm.engine
    requests = [engine.requests[engine.add_request(
        p, SamplingParams(max_tokens=20, temperature=1.0, seed=i))] for i, p in enumerate(prompts)]
    from_sa = {}
    checked = []  # (request, position in prompt + output) of tokens from SA-verifying steps
    while engine.has_unfinished():
        before = [len(r.output_ids) for r in requests]
        engine.step()
        for i, r in enumerate(requests):
            if from_sa.get(i):
                checked += [(i, len(r.prompt_ids) + k) for k in range(before[i],
                                                                       len(r.output_ids))]
        slots = engine.executor.state.slots
        strict, num = np.asarray(slots.strict), np.asarray(slots.num_drafts)
        for i, r in enumerate(requests):
            from_sa[i] = (r.finish_reason is None and r.slot is not None
                          and bool(strict[r.slot]) and num[r.slot] > 0)
    assert len(checked) >= 20, len(checked)
    target, _ = perm_target
    sampled_rows = 0
    for i, r in enumerate(requests):
        seq = r.prompt_ids + r.output_ids
        logits = target(jnp.asarray([seq], jnp.int32))[0]
        positions = [t for j, t in checked if j == i]
        if not positions:
            continue
        t = jnp.asarray(positions)
        want = sample(logits[t - 1], jnp.ones(len(t)), jnp.zeros(len(t), jnp.int32),
                      jnp.ones(len(t)), jnp.zeros(len(t)),
                      sampling_keys(jnp.full(len(t), r.seed, jnp.uint32), t))
        assert [seq[p] for p in positions] == want.tolist(), i
        sampled_rows += 1
    assert sampled_rows >= 3
    assert full_pool(llm)
