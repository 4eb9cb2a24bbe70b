"""PARD and DFlash inside the engine: greedy output equal to plain decoding (batch 1 and 4,
overlap on and off, requests joining mid-run, nothing compiled after warm-up), drafts equal to
the trainer's dense layout of the same drafter, sampled output equal to plain sampling with
strict matching, config errors, and the pool returning to full.

The drafters are trained by the trainer itself (`perm_models.trained_parallel_drafter`, a few
seconds on text like the perm target's), so their drafts are right at every depth often, not
always.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import SamplingParams
from specjax.engine.compile_counter import count_compilations
from specjax.models import DFlashHead, DFlashHeadConfig, Llama, load_dflash_head, save_dflash_head
from specjax.models.pard_checkpoint import read_mask_token, save_pard_model
from specjax.speculative.config import DFlashConfig, PARDConfig, SpeculativeConfig
from specjax.train.heads.parallel import dflash_logits, pard_logits
from tests.spec_checks import assert_mixed_acceptance, join_mid_run, spec_llm
from tests.speculative.perm_models import (CFG, LAYERS, MAX_TOKENS, PARALLEL_DEPTH, PROMPTS,
                                           shared_parallel_drafter)

V = CFG.vocab_size
D = 3



def _full_pool(llm):
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def _config(kind, drafter, **kw):
    if kind == "pard":
        return PARDConfig(max_draft_len=D, speculative_model=drafter, mask_token_id=V, **kw)
    return DFlashConfig(max_draft_len=D, speculative_model=drafter, **kw)


@pytest.fixture(scope="module")
def drafters():
    """Trained for the perm target at depth D, once per process (`test_sa_enhancer` uses the
    same ones)."""
    assert PARALLEL_DEPTH == D
    return {kind: shared_parallel_drafter(kind) for kind in ("pard", "dflash")}


@pytest.fixture(scope="module")
def llms(perm_target, drafters):
    """One warmed-up engine per drafter, built on first use. Strict matching: sampled rows
    then emit the target's own draws (rejection sampling is judged statistically on the
    shipped drafters, `test_rejection_sampling_e2e`). The schedule pins full depth: these
    tests check what a block does, and warm-up would otherwise turn on the cost model, whose
    choices follow this machine's timings (`test_verify_lengths` tests them)."""
    target, _ = perm_target
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = spec_llm(target, _config(kind, drafters[kind],
                                                   use_rejection_sampling=False,
                                                   draft_len_schedule={1: D}), warmup=True)
        return cache[kind]

    yield get
    for llm in cache.values():
        assert _full_pool(llm)


@pytest.mark.parametrize("kind", ["pard", "dflash"])
@pytest.mark.parametrize("batch,overlap", [(1, True), (4, True), (4, False)])
def test_greedy_output_equals_plain_decoding(llms, refs, kind, batch, overlap):
    llm = llms(kind)
    llm.engine.overlap = overlap
    llm.reset_stats()
    with count_compilations() as compiled:
        outs = [out for i in range(0, len(PROMPTS), batch)
                for out in llm.generate(PROMPTS[i:i + batch], SamplingParams(max_tokens=MAX_TOKENS))]
        assert compiled() == 0  # warm-up compiled every shape serving uses
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == refs[tuple(prompt)], (kind, prompt)
    assert_mixed_acceptance(llm.stats, D)
    assert llm.stats.accepted_histogram[D] > 0  # whole blocks accepted
    assert _full_pool(llm)


@pytest.mark.parametrize("kind", ["pard", "dflash"])
def test_requests_joining_mid_run(llms, refs, kind):
    llm = llms(kind)
    llm.engine.overlap = True
    join_mid_run(llm, PROMPTS, refs, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["pard", "dflash"])
def test_schedule_moves_the_draft_length_as_requests_finish(perm_target, drafters, refs, kind):
    """Batch 4 with the schedule {1: 3, 2: 2, 4: 0}: no drafts while 4 run (the worker only
    catches up), 2 for 2-3, 3 for the last; output stays plain greedy's. (Strict matching, as
    `llms`: the greedy rows accept the same either way, and its full-depth step is `llms`'s
    program.)"""
    target, _ = perm_target
    llm = spec_llm(target, _config(kind, drafters[kind], use_rejection_sampling=False,
                                   draft_len_schedule={1: 3, 2: 2, 4: 0}))
    lengths = [6, 10, 14, MAX_TOKENS]
    outs = llm.generate(PROMPTS[:4], [SamplingParams(max_tokens=n) for n in lengths])
    for prompt, n, out in zip(PROMPTS, lengths, outs):
        assert out.token_ids == refs[tuple(prompt)][:n], prompt
    verified = llm.stats.verified_histogram
    assert len(verified) == 4 and verified[2] > 0 and verified[3] > 0, verified
    assert sum(o.stats.num_steps_with_drafts for o in outs) < sum(
        o.stats.decoding_iterations for o in outs) - len(outs)  # some steps had no drafts
    assert _full_pool(llm)


SAMPLED = [SamplingParams(max_tokens=16, temperature=0.7, seed=s) for s in range(4)]


@pytest.fixture(scope="module")
def plain_sampled(perm_target):
    return [o.token_ids for o in spec_llm(perm_target[0], None).generate(PROMPTS[:4], SAMPLED)]


@pytest.mark.parametrize("kind", ["pard", "dflash"])
def test_sampled_output_with_strict_matching_equals_plain_sampling(plain_sampled, llms, kind):
    """Without rejection sampling every emitted token is the target's own draw at its
    position (the request's key), so seeded output equals plain sampling token for token."""
    llm = llms(kind)
    llm.reset_stats()
    outs = llm.generate(PROMPTS[:4], SAMPLED)
    assert [o.token_ids for o in outs] == plain_sampled
    assert llm.stats.accepted_draft_tokens > 0
    assert _full_pool(llm)


def _sequence_after(llm, prompt, steps):
    """Run one request until `steps` generation steps are done, without the overlap
    scheduler; -> (tokens so far, the drafts the next step verifies)."""
    engine = llm.engine
    engine.overlap = False
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20))
    request = engine.requests[rid]
    while len(request.output_ids) < steps + 1:
        engine.step()
    drafts = np.asarray(engine.executor.state.slots.run[request.slot, 1:1 + D]).tolist()
    seq = list(request.all_ids)
    engine.abort(rid)
    assert _full_pool(llm)
    return seq, drafts


@pytest.mark.parametrize("kind", ["pard", "dflash"])
def test_drafts_equal_the_trainers_dense_layout(perm_target, drafters, llms, kind):
    """The engine's drafts after a few steps are the argmax of the trainer's dense pass of the
    same drafter at the same anchor (paged pools, local blocks and catch-up against one dense
    forward)."""
    target, _ = perm_target
    seq, drafts = _sequence_after(llms(kind), PROMPTS[1], 3)
    tokens = jnp.asarray([seq])                      # the newest token is the last row
    if kind == "pard":
        logits = pard_logits(drafters[kind], tokens, D, V, V)
    else:
        _, captured = target.forward(tokens, capture_layers=LAYERS)
        logits = dflash_logits(drafters[kind], target, captured, tokens, D)
    dense = [int(jnp.argmax(x[0, -1])) for x in logits]   # anchor: the newest row
    assert drafts == dense


# ---- configs, checkpoints, errors ---------------------------------------------------------

def test_dflash_checkpoint_round_trip(perm_target, drafters, tmp_path):
    target, _ = perm_target
    head = drafters["dflash"]
    save_dflash_head(head, tmp_path / "d")
    loaded = load_dflash_head(tmp_path / "d", target.config)
    assert loaded.config == head.config
    for a, b in zip(nnx.to_flat_state(nnx.state(head)), nnx.to_flat_state(nnx.state(loaded))):
        assert a[0] == b[0] and np.array_equal(np.asarray(a[1][...]), np.asarray(b[1][...]))
    with pytest.raises(ValueError, match="another target"):
        load_dflash_head(tmp_path / "d", target.config.replace(hidden_size=64, head_dim=16))


def test_pard_folder_names_its_mask_token(perm_target, drafters, tmp_path):
    target, _ = perm_target
    save_pard_model(drafters["pard"], tmp_path / "p", V)
    assert read_mask_token(tmp_path / "p") == V
    llm = spec_llm(target, PARDConfig(max_draft_len=D, speculative_model=str(tmp_path / "p")))
    assert llm.engine.speculation.config.mask_token_id == V
    round_trip = SpeculativeConfig.from_json(llm.engine.speculation.config.to_json())
    assert round_trip == llm.engine.speculation.config


def test_config_errors_are_named(perm_target, drafters):
    target, _ = perm_target
    with pytest.raises(ValueError, match="speculative_model"):
        PARDConfig(max_draft_len=3)
    with pytest.raises(ValueError, match="mask_token_id"):
        spec_llm(target, PARDConfig(max_draft_len=3, speculative_model=drafters["pard"]))
    with pytest.raises(ValueError, match="mask_token_id"):
        PARDConfig(max_draft_len=3, speculative_model=drafters["pard"], mask_token_id=-1)
    with pytest.raises(ValueError, match="outside the PARD model's vocabulary"):
        spec_llm(target, PARDConfig(max_draft_len=3, speculative_model=drafters["pard"],
                                    mask_token_id=V + 1))
    small = Llama(CFG.replace(vocab_size=V - 1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="smaller than the target's"):
        spec_llm(target, PARDConfig(max_draft_len=3, speculative_model=small, mask_token_id=0))
    with pytest.raises(ValueError, match="differ from the layers the drafter was trained on"):
        spec_llm(target, DFlashConfig(max_draft_len=3, speculative_model=drafters["dflash"],
                                      target_layer_ids=(0, 1)))
    other = DFlashHead(DFlashHeadConfig.for_target(CFG.replace(hidden_size=64, head_dim=16), 1,
                                                   (1,), 3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_size"):
        spec_llm(target, DFlashConfig(max_draft_len=3, speculative_model=other))
    with pytest.raises(ValueError, match="mask_token_id"):
        spec_llm(target, DFlashConfig(max_draft_len=3, speculative_model=drafters["dflash"],
                                      mask_token_id=V + 1))


def test_modes_are_parallel_drafts():
    from specjax.speculative.modes import SpeculativeDecodingMode as M
    assert M.parse("pard") is M.PARD and M.parse("dflash") is M.DFLASH
    assert M.PARD.is_parallel_draft() and M.DFLASH.is_parallel_draft()
    assert not M.EAGLE3_ONE_MODEL.is_parallel_draft()
    assert dataclasses.replace(DFlashConfig(max_draft_len=2, speculative_model="x")).mode is M.DFLASH
