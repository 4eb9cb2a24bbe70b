"""Mode values and predicates, config validation, JSON round trips, factories."""
import json

import pytest

import specjax
from specjax import (DraftTargetConfig, NGramConfig, SpeculativeConfig, SpeculativeDecodingMode,
                     UserProvidedConfig)
from specjax.speculative.drafters import NGramDrafter

M = SpeculativeDecodingMode


def test_values_are_the_stable_serialised_ones():
    assert {m.name: int(m) for m in M} == {
        "MTP": 1, "MTP_EAGLE_ONE_MODEL": 3, "EAGLE3_ONE_MODEL": 5, "NGRAM": 6, "SA": 7,
        "DRAFT_TARGET_ONE_MODEL": 9, "USER_PROVIDED": 10, "SAVE_HIDDEN_STATES": 11, "PARD": 12,
        "DFLASH": 13, "DSPARK": 14, "NONE": 15, "AUTO": 16}


ONE_ENGINE = {M.MTP, M.MTP_EAGLE_ONE_MODEL, M.EAGLE3_ONE_MODEL, M.SA, M.PARD, M.DFLASH, M.DSPARK,
              M.DRAFT_TARGET_ONE_MODEL}


@pytest.mark.parametrize("mode", list(M))
def test_predicates(mode):
    one = mode in ONE_ENGINE
    assert mode.use_one_engine() == one
    # Every mode whose drafts the target verifies in its pool, USER_PROVIDED included.
    assert mode.needs_kv_cache_rewind() == (one or mode in {M.NGRAM, M.USER_PROVIDED})
    assert mode.support_overlap_scheduler() == one
    assert mode.has_spec_decoder() == one
    assert mode.has_spec_drafter() == (mode in {M.NGRAM, M.USER_PROVIDED})
    assert not (mode.has_spec_decoder() and mode.has_spec_drafter())


class Echo(specjax.Drafter):
    def propose(self, token_ids, max_draft_len):
        return list(token_ids[-max_draft_len:])


@pytest.mark.parametrize("config", [
    NGramConfig(max_draft_len=3, draft_len_schedule={1: 3, 4: 1, 8: 0}, max_matching_ngram_size=4,
                is_keep_all=False, acceptance_rate_window_size=5, acceptance_rate_threshold=0.3),
    DraftTargetConfig(max_draft_len=2, speculative_model="checkpoints/some-draft"),
    UserProvidedConfig(max_draft_len=5, drafter="tests.speculative.test_modes_and_configs:Echo"),
])
def test_json_round_trip_stores_mode_as_int(config):
    text = config.to_json()
    assert json.loads(text)["mode"] == int(config.mode)
    again = SpeculativeConfig.from_json(text)
    assert type(again) is type(config) and again.to_dict() == config.to_dict()


@pytest.mark.parametrize("make, match", [
    (lambda: NGramConfig(max_draft_len=0), "max_draft_len must be a positive int"),
    (lambda: NGramConfig(max_draft_len=2, max_matching_ngram_size=0), "max_matching_ngram_size"),
    (lambda: NGramConfig(acceptance_rate_threshold=1.5), "acceptance_rate_threshold"),
    (lambda: NGramConfig(acceptance_rate_window_size=-1), "acceptance_rate_window_size"),
    (lambda: NGramConfig(max_draft_len=4, draft_len_schedule={1: 2}), "must equal max_draft_len"),
    (lambda: NGramConfig(max_draft_len=4, draft_len_schedule={1: 4, 8: 5}), r"\[0, max_draft_len=4\]"),
    (lambda: NGramConfig(max_draft_len=4, draft_len_schedule={0: 4}), "threshold 0 must be >= 1"),
    (lambda: NGramConfig(is_public_pool="yes"), "is_public_pool must be a bool"),
    (lambda: DraftTargetConfig(max_draft_len=2), "speculative_model is required"),
    (lambda: UserProvidedConfig(drafter=object()), "drafter must be a specjax.Drafter"),
    (lambda: UserProvidedConfig(drafter="no.such.module:X"), "cannot be imported"),
    (lambda: SpeculativeConfig.from_dict({"mode": 99}), "unknown speculative decoding mode"),
    (lambda: SpeculativeConfig.from_dict({"mode": 6, "bogus": 1}), "unknown field.*bogus"),
    (lambda: SpeculativeConfig.from_dict({"max_draft_len": 2}), "needs a 'mode' field"),
])
def test_config_errors_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_factories_follow_the_predicates():
    assert isinstance(specjax.get_spec_drafter(NGramConfig()), NGramDrafter)
    drafter = Echo()
    assert specjax.get_spec_drafter(UserProvidedConfig(drafter=drafter)) is drafter
    assert specjax.get_spec_worker(NGramConfig()) is None
    assert specjax.get_spec_drafter(DraftTargetConfig(speculative_model="x")) is None
    assert specjax.get_spec_worker(None) is None and specjax.get_spec_drafter(None) is None


def test_every_mode_with_a_drafter_module_registers_its_worker_and_loader():
    from specjax.speculative.workers import DRAFTERS, WORKERS
    modules = {m for m in M if m.has_draft_module()}
    assert set(WORKERS) == set(DRAFTERS) == modules


@pytest.mark.parametrize("scan", [True, False])
def test_the_drafter_is_put_in_the_steps_layout_once_scanned_as_the_target(tiny_model, scan):
    from flax import nnx

    spec = specjax.build_speculation(DraftTargetConfig(max_draft_len=2,
                                                       speculative_model=tiny_model),
                                     tiny_model, scan_layers=scan)
    draft = spec.draft_model
    assert draft.fused and draft.stacked == scan and draft.for_inference(scan) is draft
    assert spec.worker.graphdef == nnx.graphdef(draft)


def test_llm_rejects_a_non_config(tiny_model):
    with pytest.raises(ValueError, match="speculative_config must be a SpeculativeConfig"):
        specjax.LLM(tiny_model, speculative_config={"mode": 6}, warmup=False)


def test_draft_vocab_must_match(tiny_model):
    from flax import nnx

    from specjax.models import Llama
    other = Llama(tiny_model.config.replace(vocab_size=32), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="speculative_model vocab_size 32 differs"):
        specjax.LLM(tiny_model, warmup=False,
                    speculative_config=DraftTargetConfig(max_draft_len=2, speculative_model=other))


def test_rejection_sampling_is_on_by_default_where_a_draft_distribution_exists():
    from specjax import EagleConfig, MTPConfig
    in_step = [DraftTargetConfig(speculative_model="x"), EagleConfig(),
               MTPConfig(num_nextn_predict_layers=1), MTPConfig(max_draft_len=2,
                                                                num_nextn_predict_layers=2)]
    for config in in_step:
        assert config.mode.has_spec_decoder() and config.use_rejection_sampling is True
    for config in (NGramConfig(), UserProvidedConfig(drafter=Echo())):
        assert config.use_rejection_sampling is False  # host drafters have no distribution
    off = DraftTargetConfig(speculative_model="x", use_rejection_sampling=False)
    assert off.use_rejection_sampling is False
    # The JSON round trip keeps an explicit choice.
    assert SpeculativeConfig.from_json(off.to_json()).use_rejection_sampling is False
    with pytest.raises(ValueError, match="use_rejection_sampling must be a bool"):
        NGramConfig(use_rejection_sampling="yes")


@pytest.mark.parametrize("value, mode", [
    (5, M.EAGLE3_ONE_MODEL), ("5", M.EAGLE3_ONE_MODEL), ("eagle3", M.EAGLE3_ONE_MODEL),
    ("EAGLE3_ONE_MODEL", M.EAGLE3_ONE_MODEL), ("draft-target", M.DRAFT_TARGET_ONE_MODEL),
    ("mtp_eagle", M.MTP_EAGLE_ONE_MODEL), ("mtp", M.MTP), ("ngram", M.NGRAM),
    (M.NGRAM, M.NGRAM),
])
def test_modes_parse_from_integers_and_names(value, mode):
    assert M.parse(value) is mode


@pytest.mark.parametrize("value", ["eagle", "", "5.0", None, True, 2])
def test_unknown_modes_are_named_in_the_error(value):
    with pytest.raises(ValueError, match="speculative decoding mode"):
        M.parse(value)


def test_from_dict_takes_mode_names():
    assert SpeculativeConfig.from_dict({"mode": "ngram", "max_draft_len": 2}) == \
        NGramConfig(max_draft_len=2)
    from specjax import MTPConfig
    # "mtp" by name means one module per draft (MTP), not MTP-Eagle.
    assert SpeculativeConfig.from_dict({"mode": "mtp", "max_draft_len": 1}).mode is M.MTP
    assert SpeculativeConfig.from_dict({"mode": "mtp_eagle"}) == MTPConfig()
