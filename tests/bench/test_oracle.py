"""Oracle drafts (`specjax.bench.oracle`): a known acceptance length, exactly, with the
EAGLE-3 head's real drafting work; the speculative figure of `python -m specjax.bench shapes`
rests on it."""
import math

import pytest
from flax import nnx

from specjax.bench.oracle import OracleEagle3Worker, oracle_drafts
from specjax.bench.shapes import SHAPES, random_model
from specjax.llm import LLM
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import EagleConfig
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.registry import WORKERS

N = 25
PROMPT = [5, 17, 300, 42, 8, 99, 123]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(SHAPES["tiny"])


@pytest.fixture(scope="module")
def reference(model):
    plain = LLM(model, max_batch_size=2, max_model_len=128, progress=False)
    out = plain.generate([PROMPT], greedy(N + 8))[0]
    return PROMPT + list(out.token_ids)


def test_each_step_accepts_exactly_the_right_drafts(model, reference):
    """correct = 2: a step of D = 1 accepts its draft (2 tokens a step), D = 2 both drafts
    and D = 3 two of three (3 tokens a step; the last step what is left of N), each step
    verifying D drafts; the output stays the plain greedy one; two identical prompts in one
    batch both follow the reference."""
    head = Eagle3Head(Eagle3HeadConfig.for_target(model.config), nnx.Rngs(1))
    original = WORKERS[SpeculativeDecodingMode.EAGLE3_ONE_MODEL]
    with oracle_drafts(reference, correct=2):
        llm = LLM(model, max_batch_size=2, max_model_len=128, progress=False,
                  speculative_config=EagleConfig(speculative_model=head, max_draft_len=3,
                                                 use_rejection_sampling=False))
    assert WORKERS[SpeculativeDecodingMode.EAGLE3_ONE_MODEL] is original
    assert isinstance(llm.engine.speculation.worker, OracleEagle3Worker)
    for D in (1, 2, 3):
        llm.engine.length_policy.pinned = D
        per_step = min(2, D) + 1
        for out in llm.generate([PROMPT, PROMPT], greedy(N)):
            st = out.stats
            assert list(out.token_ids) == reference[len(PROMPT):len(PROMPT) + N], D
            assert st.decoding_iterations - 1 == math.ceil((N - 1) / per_step), D
            assert st.num_draft_tokens >= D * (st.num_steps_with_drafts - 1), D
            assert st.num_draft_tokens <= D * st.num_steps_with_drafts, D
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks - 1


def test_no_right_drafts_means_one_token_per_step(model, reference):
    head = Eagle3Head(Eagle3HeadConfig.for_target(model.config), nnx.Rngs(1))
    with oracle_drafts(reference, correct=0):
        llm = LLM(model, max_batch_size=1, max_model_len=128, progress=False,
                  speculative_config=EagleConfig(speculative_model=head, max_draft_len=2,
                                                 use_rejection_sampling=False,
                                                 draft_len_schedule={1: 2}))
    out = llm.generate([PROMPT], greedy(N))[0]
    assert list(out.token_ids) == reference[len(PROMPT):len(PROMPT) + N]
    assert out.stats.decoding_iterations - 1 == N - 1


def test_oracle_refuses_trees_and_an_empty_reference(model):
    with pytest.raises(ValueError, match="non-empty"):
        with oracle_drafts([], 1):
            pass
    head = Eagle3Head(Eagle3HeadConfig.for_target(model.config), nnx.Rngs(1))
    with oracle_drafts([1, 2, 3], 1), pytest.raises(ValueError, match="chains"):
        LLM(model, max_batch_size=1, max_model_len=128, progress=False,
            speculative_config=EagleConfig(speculative_model=head, max_draft_len=2,
                                           use_dynamic_tree=True,
                                           dynamic_tree_max_topK=2))
