"""Every speculative mode on the shipped models: greedy output equals plain greedy output, with
the prefix cache sharing blocks written while drafts were rejected and without it; with
penalties and logit bias too, and the log-probabilities reported equal plain decoding's."""
import pytest

import specjax
from specjax import (DFlashConfig, DraftTargetConfig, EagleConfig, MTPConfig, NGramConfig,
                     PARDConfig, SAConfig, SamplingParams, UserProvidedConfig)
from specjax.models.registry import CHECKPOINTS_DIR
from specjax.bench.structured import CHOICES, REGEXES, SCHEMAS
from tests.spec_checks import assert_mixed_acceptance

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_config(path):\n", "class Stack:\n"]
PARAMS = SamplingParams(max_tokens=32)
# One batch bucket and one prompt row a prefill step: the modes are the subject here, not the
# buckets or prefill batching (tests/engine runs those), and each engine compiles two programs.
SIZES = dict(max_batch_size=2, batch_sizes=(2,), prefill_chunk=32, max_prefill_rows=1,
             max_model_len=128, progress=False)
# Penalties count the drafts before each verified position; logprobs are the target's.
OPTIONS = [SamplingParams(max_tokens=24, logprobs=3, presence_penalty=0.8),
           SamplingParams(max_tokens=24, logprobs=0, frequency_penalty=0.5,
                          repetition_penalty=1.3, logit_bias={10: 3.0, 300: -2.0}),
           SamplingParams(max_tokens=24, logprobs=2, prompt_logprobs=2, repetition_penalty=1.5)]
LOGPROB_TOL = 1e-5
# Structured output beside an unconstrained row: masks at every verified position, drafts cut
# where the grammar forbids them (specjax.engine.grammar).
GUIDED = [SamplingParams(max_tokens=64, guided_json=SCHEMAS[0]),
          SamplingParams(max_tokens=24, guided_regex=REGEXES[1]),
          SamplingParams(max_tokens=24),
          SamplingParams(max_tokens=64, guided_json=SCHEMAS[-1]),
          SamplingParams(max_tokens=16, guided_choice=CHOICES[1])]
GUIDED_PROMPTS = [PROMPTS[i % len(PROMPTS)] for i in range(len(GUIDED))]


class Repeat(specjax.Drafter):
    """Guesses that the text repeats itself from two tokens back."""

    def propose(self, token_ids, max_draft_len):
        return list(token_ids[-2:]) * max_draft_len


def later_turns(first) -> list[list[int]]:
    """Prompts that extend the first round's requests mid-block (their cached prefixes were
    written while drafts were being rejected), and one that shares only part of a prompt."""
    return ([o.prompt_token_ids + o.token_ids[:21] + [5] for o in first]
            + [first[1].prompt_token_ids[:7] + [9, 9]])


@pytest.fixture(scope="module")
def plain():
    llm = specjax.LLM("bundled", enable_prefix_cache=False, **SIZES)
    first = llm.generate(PROMPTS, PARAMS)
    second = llm.generate(later_turns(first), PARAMS)
    options = llm.generate(PROMPTS, OPTIONS)
    # The options change the output: the equality below is not plain greedy's again.
    assert all(a.token_ids != b.token_ids[:24] for a, b in zip(options, first))
    guided = llm.generate(GUIDED_PROMPTS, GUIDED)
    assert all(o.finish_reason == "stop" for o in guided[:2] + guided[3:]), guided
    return [o.token_ids for o in first], [o.token_ids for o in second], options, guided


def assert_same_logprobs(outs, plain_outs):
    for out, ref in zip(outs, plain_outs):
        assert out.token_ids == ref.token_ids
        entries = out.logprobs + (out.prompt_logprobs or [None])[1:]
        ref_entries = ref.logprobs + (ref.prompt_logprobs or [None])[1:]
        assert len(entries) == len(ref_entries)
        for e, r in zip(entries, ref_entries):
            assert list(e) == list(r)
            assert max(abs(e[t] - r[t]) for t in e) <= LOGPROB_TOL


# The default run checks the default drafter (the shipped EAGLE-3 head), the shipped draft
# model and a host drafter (NGram); the other shipped checkpoints and the head's dynamic tree
# run the same test in the slow job (8-15 s each here). Their mechanisms stay in the default
# run on tiny models: MTP in test_hidden_drafters, PARD and DFlash in test_parallel_engine, SA
# in test_sa_enhancer, user drafters in test_spec_engine, trees in test_tree_engine.
slow = pytest.mark.slow
CONFIGS = [
    NGramConfig(max_draft_len=4, max_matching_ngram_size=3),
    pytest.param(UserProvidedConfig(max_draft_len=3, drafter=Repeat()), marks=slow),
    DraftTargetConfig(max_draft_len=4, speculative_model="bundled-draft"),
    # No drafter named: for the bundled target the shipped head fills in.
    EagleConfig(max_draft_len=4),
    pytest.param(MTPConfig(max_draft_len=3, num_nextn_predict_layers=3, use_mtp_vanilla=True,
                           speculative_model="bundled-mtp"), marks=slow),
    # MTP-Eagle: the shipped first module reused for every draft step.
    pytest.param(MTPConfig(max_draft_len=3, num_nextn_predict_layers=1,
                           speculative_model=str(CHECKPOINTS_DIR / "stdlib-mtp")), marks=slow),
    # A dynamic tree drafted by the shipped head.
    pytest.param(EagleConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=3,
                             max_total_draft_tokens=10), marks=slow),
    # The parallel drafters: the mask token and the capture layers from their folders.
    pytest.param(PARDConfig(max_draft_len=4, speculative_model="bundled-pard"), marks=slow),
    pytest.param(DFlashConfig(max_draft_len=4, speculative_model="bundled-dflash"), marks=slow),
    pytest.param(SAConfig(max_draft_len=4), marks=slow),
]


def config_id(config) -> str:
    return config.mode.name + ("_TREE" if getattr(config, "use_dynamic_tree", False) else "")


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_bundled_greedy_equivalence(plain, config):
    llm = specjax.LLM("bundled", speculative_config=config, **SIZES)
    if config.mode.has_draft_module():
        assert llm.engine.speculation.draft_model is not None
    first = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in first] == plain[0]
    assert llm.stats.acceptance_length is not None and llm.stats.acceptance_length > 1.0
    assert_mixed_acceptance(llm.stats, config.max_draft_len)
    assert_same_logprobs(llm.generate(PROMPTS, OPTIONS), plain[2])
    # The prefix cache on: later turns start from the first round's blocks.
    second = llm.generate(later_turns(first), PARAMS)
    assert [o.token_ids for o in second] == plain[1]
    # Vanilla MTP shares only blocks its prompts' prefill wrote (its modules keep K/V of
    # drafts), and these prompts are shorter than a block plus its lookahead.
    vanilla_mtp = getattr(config, "use_mtp_vanilla", False)
    assert vanilla_mtp or all(o.stats.num_cached_tokens > 0 for o in second[:3])
    # ... and off (emptied while idle): the same tokens, and -- the drafter saw the same
    # K/V -- the same drafts accepted (NGram's pool learns from every request, so it drafts
    # differently the second time).
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.total_blocks
    allocator.clear_cache()
    again = llm.generate(later_turns(first), PARAMS)
    assert [o.token_ids for o in again] == plain[1]
    assert all(o.stats.num_cached_tokens == 0 for o in again)
    if config.mode.name != "NGRAM":
        accepted = lambda outs: [o.stats.num_accepted_draft_tokens for o in outs]
        assert accepted(second) == accepted(again)
    assert allocator.num_free_blocks == allocator.total_blocks
    llm.reset_stats()
    guided = llm.generate(GUIDED_PROMPTS, GUIDED)
    assert [o.token_ids for o in guided] == [o.token_ids for o in plain[3]], (
        [o.text for o in guided], [o.text for o in plain[3]])
    assert llm.stats.drafted_tokens > 0


def test_rows_may_verify_fewer_drafts_than_the_step_is_wide(plain, monkeypatch):
    """A worker whose `Drafts.num` differs by row -- here a row verifies all D drafts when its
    first draft is even and one otherwise -- keeps greedy output exact, and the steps verify
    exactly what each row asked for (the base of per-request verify lengths)."""
    import dataclasses

    import jax.numpy as jnp

    from specjax.analysis.trace import trace
    from specjax.speculative.modes import SpeculativeDecodingMode
    from specjax.speculative.workers import WORKERS, Eagle3Worker

    @dataclasses.dataclass(frozen=True)
    class FewerDrafts(Eagle3Worker):
        def draft(self, *args, **kwargs):
            kv, drafts = super().draft(*args, **kwargs)
            D = drafts.tokens.shape[1]
            if D == 0:
                return kv, drafts
            num = jnp.where(drafts.tokens[:, 0] % 2 == 0, D, 1)
            return kv, drafts.replace(num=jnp.minimum(drafts.num, num))

    mode = SpeculativeDecodingMode.EAGLE3_ONE_MODEL
    made = WORKERS[mode]
    monkeypatch.setitem(WORKERS, mode, lambda *args: FewerDrafts(**vars(made(*args))))
    llm = specjax.LLM("bundled", speculative_config=EagleConfig(max_draft_len=3),
                      enable_prefix_cache=False, **SIZES)
    assert isinstance(llm.engine.speculation.worker, FewerDrafts)
    with trace(llm) as steps:
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain[0]
    verified = [v for record in steps.records for v in record.verified]
    assert 1 in verified and 3 in verified and set(verified) <= {0, 1, 3}, sorted(set(verified))


def test_a_new_in_step_drafter_is_one_class_and_one_registration(plain, monkeypatch):
    """A worker written here -- it drafts the newest token again, D times -- and registered
    for a mode (`specjax.speculative.workers.register`; monkeypatched so it is undone) runs
    inside the steps: output stays the plain greedy output, and its drafts were verified."""
    import dataclasses

    import jax.numpy as jnp

    from specjax.core import Drafts, WorkerDefaults
    from specjax.core.kv import make_kv_pool
    from specjax.speculative.modes import SpeculativeDecodingMode
    from specjax.speculative.workers import WORKERS

    @dataclasses.dataclass(frozen=True)
    class RepeatWorker(WorkerDefaults):
        capture_layers: tuple[int, ...] = ()
        rejection_sampling: bool = False

        def make_kv(self, num_blocks, tokens_per_block, dtype):
            return make_kv_pool(1, 1, 1, num_blocks, tokens_per_block, dtype)

        def catch_up(self, params, kv, batch, target, captured, following, num_drafts,
                     penalties=None):
            if not num_drafts:
                return kv, None
            return kv, Drafts.every(jnp.repeat(following[:, None], num_drafts, axis=1))

        def draft(self, params, kv, batch, target, captured, new_tokens, new_lens,
                  num_drafts, penalties=None):
            newest = jnp.take_along_axis(new_tokens, (new_lens - 1)[:, None], axis=1)
            return kv, Drafts.every(jnp.repeat(newest, num_drafts, axis=1))

    monkeypatch.setitem(WORKERS, SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL,
                        lambda config, graphdef, draft_model, target_config: RepeatWorker())
    llm = specjax.LLM("bundled", speculative_config=DraftTargetConfig(
        max_draft_len=3, speculative_model="bundled-draft"), enable_prefix_cache=False,
        **SIZES)
    assert isinstance(llm.engine.speculation.worker, RepeatWorker)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain[0]
    assert llm.stats.drafted_tokens > 0
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.total_blocks


def test_xla_dot_gives_the_kernels_greedy_output(plain):
    """The modes above run the CPU matmul kernel (the default on a CPU); XLA's dot gives the
    same greedy tokens on the bundled model, plain and with its EAGLE-3 head."""
    for config in (None, EagleConfig(max_draft_len=4)):
        llm = specjax.LLM("bundled", cpu_matmul="xla", enable_prefix_cache=False,
                          speculative_config=config, **SIZES)
        assert llm.stats.matmul.startswith("xla")
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q4_0"])
def test_a_quantized_target_drafted_by_every_mode_equals_its_plain_output(kind):
    """Exactness is relative to the quantized target: the bundled model quantized at load,
    plain greedy output against a chain head's, a draft model's and a parallel drafter's
    (drafters stay float; what makes every mode exact is the kernel's rows being the same
    alone or together, tests/pallas_kernels/test_cpu_matmul_quant.py)."""
    plain = specjax.LLM("bundled", quantize=kind, **SIZES)
    expected = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    for config in (EagleConfig(max_draft_len=4),
                   DraftTargetConfig(max_draft_len=4, speculative_model="bundled-draft"),
                   PARDConfig(max_draft_len=4, speculative_model="bundled-pard")):
        llm = specjax.LLM("bundled", quantize=kind, speculative_config=config, **SIZES)
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected, config_id(config)
        assert llm.stats.acceptance_length > 1.0, config_id(config)
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
