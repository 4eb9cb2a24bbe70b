"""What the SA engine tests share (`test_suffix_engine.py`: SA alone, `test_sa_enhancer.py`: the
enhancer): engines on the perm target, the enhanced configs of every in-step drafter, and the
greedy check on prompts that repeat the target's own text (the `repetitive` fixture)."""
from specjax import SamplingParams
from specjax.engine.compile_counter import count_compilations
from specjax.speculative.config import (DFlashConfig, DraftTargetConfig, EagleConfig, MTPConfig,
                                        PARDConfig, SAEnhancerConfig)
from tests.spec_checks import spec_llm, truncated_copy
from tests.speculative.perm_models import CFG, eagle_head, mtp_heads

D = 4
MAX_TOKENS = 24


def make_llm(target, spec, **kw):
    # One prompt chunk per prefill step: one prefill shape to compile per engine.
    return spec_llm(target, spec, **{"max_prefill_rows": 1, **kw})


def full_pool(llm):
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def greedy(llm, prompts, batch):
    return [out for i in range(0, len(prompts), batch)
            for out in llm.generate(prompts[i:i + batch], SamplingParams(max_tokens=MAX_TOKENS))]


def built_on_first_use(make):
    """kind -> make(kind), each made once (`.made` holds them)."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = make(kind)
        return made[kind]

    get.made = made
    return get


def enhanced(kind, target, perm, drafters=None, threshold=4, **kw):
    """`kind`'s config with the SA enhancer; PARD and DFlash take their trained drafter from
    `drafters(kind)`."""
    sa = SAEnhancerConfig(threshold=threshold)
    if kind == "eagle3":
        return EagleConfig(max_draft_len=D, speculative_model=eagle_head(target, perm),
                           sa_config=sa, **kw)
    if kind == "eagle3-tree":
        return EagleConfig(max_draft_len=D, speculative_model=eagle_head(target, perm),
                           use_dynamic_tree=True, dynamic_tree_max_topK=2,
                           max_total_draft_tokens=8, sa_config=sa, **kw)
    if kind == "mtp":
        return MTPConfig(max_draft_len=D, num_nextn_predict_layers=1, speculative_model=mtp_heads(1),
                         sa_config=sa, **kw)
    if kind == "draft_target":
        return DraftTargetConfig(max_draft_len=D, speculative_model=truncated_copy(target, 1),
                                 sa_config=sa, **kw)
    if kind == "pard":
        return PARDConfig(max_draft_len=D, speculative_model=drafters("pard"),
                          mask_token_id=CFG.vocab_size, sa_config=sa, **kw)
    return DFlashConfig(max_draft_len=D, speculative_model=drafters("dflash"), sa_config=sa, **kw)


def check_greedy(llm, repetitive, batch, overlap, compiles=False):
    """The repetitive prompts, `batch` at a time: plain greedy's tokens, nothing compiled
    (unless `compiles`: an engine's first run compiles its shapes), the pool full again; ->
    the run's statistics."""
    prompts, refs = repetitive
    llm.engine.overlap = overlap
    llm.reset_stats()
    with count_compilations() as compiled:
        outs = greedy(llm, prompts, batch)
        assert compiles or compiled() == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == refs[tuple(prompt)], prompt
    assert full_pool(llm)
    return llm.stats
