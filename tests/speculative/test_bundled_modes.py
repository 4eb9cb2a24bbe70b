"""Every speculative mode on the shipped models: greedy output equals plain greedy output."""
import pytest

import specjax
from specjax import (DFlashConfig, DraftTargetConfig, EagleConfig, MTPConfig, NGramConfig,
                     PARDConfig, SamplingParams, UserProvidedConfig)
from specjax.models.registry import CHECKPOINTS_DIR
from tests.spec_checks import assert_mixed_acceptance

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_config(path):\n", "class Stack:\n"]
PARAMS = SamplingParams(max_tokens=32)
SIZES = dict(max_batch_size=2, prefill_chunk=32, max_model_len=128, progress=False)


class Repeat(specjax.Drafter):
    """Guesses that the text repeats itself from two tokens back."""

    def propose(self, token_ids, max_draft_len):
        return list(token_ids[-2:]) * max_draft_len


@pytest.fixture(scope="module")
def plain():
    return [o.token_ids for o in specjax.LLM("bundled", **SIZES).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("config", [
    NGramConfig(max_draft_len=4, max_matching_ngram_size=3),
    UserProvidedConfig(max_draft_len=3, drafter=Repeat()),
    DraftTargetConfig(max_draft_len=4, speculative_model="bundled-draft"),
    # No drafter named: for the bundled target the shipped head fills in.
    EagleConfig(max_draft_len=4),
    MTPConfig(max_draft_len=3, num_nextn_predict_layers=3, use_mtp_vanilla=True,
              speculative_model="bundled-mtp"),
    # MTP-Eagle: the shipped first module reused for every draft step.
    MTPConfig(max_draft_len=3, num_nextn_predict_layers=1,
              speculative_model=str(CHECKPOINTS_DIR / "stdlib-mtp")),
    # A dynamic tree drafted by the shipped head.
    EagleConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=3,
                max_total_draft_tokens=10),
    # The parallel drafters: the mask token and the capture layers from their folders.
    PARDConfig(max_draft_len=4, speculative_model="bundled-pard"),
    DFlashConfig(max_draft_len=4, speculative_model="bundled-dflash"),
], ids=lambda c: c.mode.name + ("_TREE" if getattr(c, "use_dynamic_tree", False) else ""))
def test_bundled_greedy_equivalence(plain, config):
    llm = specjax.LLM("bundled", speculative_config=config, **SIZES)
    if config.mode.has_spec_decoder():
        assert llm.engine.speculation.draft_model is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    assert llm.stats.acceptance_length is not None and llm.stats.acceptance_length > 1.0
    assert_mixed_acceptance(llm.stats, config.max_draft_len)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
