"""EagleConfig, MTPConfig, SaveHiddenStatesConfig: defaults, validation naming the field,
mode selection, the registry (MTPConfig stands for two modes) and JSON round trips."""
import json
import pathlib

import pytest
from flax import nnx

from specjax.speculative.config import (EagleConfig, MTPConfig, NGramConfig,
                                        SaveHiddenStatesConfig, SpeculativeConfig,
                                        default_eagle3_layers)
from specjax.speculative.modes import SpeculativeDecodingMode as M


@pytest.mark.parametrize("L, layers", [(7, (1, 2, 3)), (8, (1, 3, 4)), (16, (1, 7, 12)),
                                       (32, (1, 15, 28)), (61, (1, 29, 57)), (80, (1, 39, 76))])
def test_default_capture_layers(L, layers):
    assert default_eagle3_layers(L) == layers
    assert EagleConfig(max_draft_len=3).layers_to_capture(L) == layers
    assert SaveHiddenStatesConfig(output_directory="d").layers_to_capture(L) == (*layers, L - 1)


@pytest.mark.parametrize("L", [1, 2, 3, 4, 5])
def test_default_capture_needs_more_than_five_layers(L):
    with pytest.raises(ValueError, match=rf"the target has {L} layers: .*need more than 5"):
        EagleConfig(max_draft_len=3).layers_to_capture(L)


def test_six_layers_would_repeat_a_layer():
    # (1, 6//2 - 1, 6 - 4) = (1, 2, 2): the fc needs three distinct states.
    with pytest.raises(ValueError, match=r"6 layers: .*\(1, 2, 2\) repeat a layer"):
        EagleConfig(max_draft_len=3).layers_to_capture(6)
    assert EagleConfig(eagle3_layers_to_capture=[0, 2, 5]).layers_to_capture(6) == (0, 2, 5)


def test_explicit_layers_are_checked_against_the_target():
    config = EagleConfig(eagle3_layers_to_capture=[0, 1, 3])
    assert config.eagle3_layers_to_capture == (0, 1, 3)  # stored hashable
    assert config.layers_to_capture(4) == (0, 1, 3)      # explicit: fine below 6 layers
    with pytest.raises(ValueError, match=r"layer\(s\) \[3\] outside the target's 3 layers "
                                         r"\(0\.\.2\)"):
        config.layers_to_capture(3)
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\] outside the target's 4 layers"):
        SaveHiddenStatesConfig(output_directory="d", layers=[2, 7]).layers_to_capture(4)


@pytest.mark.parametrize("make, match", [
    (lambda: EagleConfig(eagle3_layers_to_capture=[1, 2]), "exactly 3 layers.*got 2"),
    (lambda: EagleConfig(eagle3_layers_to_capture=[1, 2, 3, 4]), "exactly 3 layers.*got 4"),
    (lambda: EagleConfig(eagle3_layers_to_capture=[1, 1, 3]), "distinct layers"),
    (lambda: EagleConfig(eagle3_layers_to_capture=[3, 1, 2]), "sorted ascending"),
    (lambda: EagleConfig(eagle3_layers_to_capture=[-1, 1, 2]), "ints >= 0"),
    (lambda: EagleConfig(eagle3_layers_to_capture=[True, 1, 2]), "ints >= 0"),
    (lambda: EagleConfig(eagle3_layers_to_capture=5), "must be a list of layer indices"),
    (lambda: EagleConfig(max_draft_len=0), "max_draft_len must be a positive int"),
    (lambda: EagleConfig(speculative_model=3), "speculative_model must be a folder path or an "
                                               "Eagle3Head, got int"),
    (lambda: EagleConfig(dynamic_tree_max_topK=4), "dynamic_tree_max_topK is only used with"),
    (lambda: EagleConfig(max_draft_len=3, max_total_draft_tokens=5),
     r"max_total_draft_tokens \(5\) must equal max_draft_len \(3\)"),
    (lambda: EagleConfig(use_dynamic_tree=True), "dynamic_tree_max_topK is required"),
    (lambda: EagleConfig(use_dynamic_tree=True, dynamic_tree_max_topK=0),
     "dynamic_tree_max_topK must be a positive int"),
    (lambda: EagleConfig(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2,
                         max_total_draft_tokens=7), r"\[max_draft_len, .*\] = \[3, 6\]"),
    (lambda: EagleConfig(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2,
                         max_total_draft_tokens=2), r"= \[3, 6\]"),
    (lambda: EagleConfig(use_dynamic_tree=1), "use_dynamic_tree must be a bool"),
    (lambda: MTPConfig(num_nextn_predict_layers=0), "num_nextn_predict_layers must be a positive"),
    (lambda: MTPConfig(use_mtp_vanilla="no"), "use_mtp_vanilla must be a bool"),
    (lambda: MTPConfig(max_draft_len=3, num_nextn_predict_layers=2),
     r"max_draft_len \(3\) exceeds num_nextn_predict_layers \(2\)"),
    (lambda: MTPConfig(max_draft_len=2, use_mtp_vanilla=True),
     r"max_draft_len \(2\) exceeds num_nextn_predict_layers \(1\)"),
    (lambda: MTPConfig(speculative_model=1.5), "speculative_model must be a folder path or an "
                                               "MTPHeads, got float"),
    (lambda: SaveHiddenStatesConfig(), "output_directory is required"),
    (lambda: SaveHiddenStatesConfig(output_directory=""), "output_directory is required"),
    (lambda: SaveHiddenStatesConfig(output_directory="d", write_interval=0),
     "write_interval must be a positive int"),
    (lambda: SaveHiddenStatesConfig(output_directory="d", file_prefix="a/b"),
     "file_prefix must be a non-empty file name"),
    (lambda: SaveHiddenStatesConfig(output_directory="d", layers=[]), "at least one layer"),
    (lambda: SaveHiddenStatesConfig(output_directory="d", layers=[4, 2]), "layers must be sorted"),
])
def test_errors_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_dynamic_tree_total_draft_tokens():
    assert EagleConfig(max_draft_len=4).total_draft_tokens == 4
    assert EagleConfig(max_draft_len=4, max_total_draft_tokens=4).total_draft_tokens == 4
    tree = EagleConfig(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=4)
    assert tree.total_draft_tokens == 12 and tree.max_total_draft_tokens is None
    assert EagleConfig(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=4,
                       max_total_draft_tokens=5).total_draft_tokens == 5


@pytest.mark.parametrize("layers, vanilla, draft, mode", [
    (1, False, 4, M.MTP_EAGLE_ONE_MODEL),   # one module reused for 4 draft steps
    (1, True, 1, M.MTP),
    (3, False, 3, M.MTP),
    (3, True, 2, M.MTP),
])
def test_mtp_mode_follows_the_fields(layers, vanilla, draft, mode):
    config = MTPConfig(max_draft_len=draft, num_nextn_predict_layers=layers,
                       use_mtp_vanilla=vanilla)
    assert config.mode is mode
    assert mode.use_one_engine() and mode.has_spec_decoder()
    data = json.loads(config.to_json())
    assert data["mode"] == int(mode) and "registered_modes" not in data
    again = SpeculativeConfig.from_json(config.to_json())
    assert type(again) is MTPConfig and again == config and again.mode is mode


def test_stored_mode_must_agree_with_the_mtp_fields():
    data = MTPConfig(max_draft_len=2).to_dict()        # MTP-Eagle
    data["mode"] = int(M.MTP)
    with pytest.raises(ValueError, match=r"stored mode MTP \(1\) does not match the fields, "
                                         r"which give MTP_EAGLE_ONE_MODEL \(3\)"):
        SpeculativeConfig.from_dict(data)


def test_registry_entries():
    assert type(SpeculativeConfig.from_dict({"mode": 5})) is EagleConfig
    assert type(SpeculativeConfig.from_dict({"mode": 3})) is MTPConfig
    assert type(SpeculativeConfig.from_dict(
        {"mode": 1, "max_draft_len": 2, "num_nextn_predict_layers": 2})) is MTPConfig
    assert type(SpeculativeConfig.from_dict({"mode": 11, "output_directory": "d"})) is \
        SaveHiddenStatesConfig
    assert type(SpeculativeConfig.from_dict({"mode": 6})) is NGramConfig   # untouched
    with pytest.raises(ValueError, match=r"unknown field\(s\) for EagleConfig: bogus"):
        SpeculativeConfig.from_dict({"mode": 5, "bogus": 1})


@pytest.mark.parametrize("config", [
    EagleConfig(max_draft_len=3, speculative_model="heads/eagle3", eagle3_layers_to_capture=[2, 5, 9],
                draft_len_schedule={1: 3, 8: 1}, use_rejection_sampling=True),
    EagleConfig(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2,
                max_total_draft_tokens=5),
    EagleConfig(max_draft_len=2, speculative_model=pathlib.Path("heads/eagle3")),
    MTPConfig(max_draft_len=3, num_nextn_predict_layers=3, speculative_model="heads/mtp",
              acceptance_rate_window_size=8, acceptance_rate_threshold=0.2),
    SaveHiddenStatesConfig(output_directory=pathlib.Path("out"), write_interval=5,
                           file_prefix="run1", layers=[1, 3, 7]),
    SaveHiddenStatesConfig(output_directory="out"),
])
def test_json_round_trip(config):
    text = config.to_json()
    assert json.loads(text)["mode"] == int(config.mode)
    again = SpeculativeConfig.from_json(text)
    assert type(again) is type(config) and again == config
    assert again.to_dict() == config.to_dict()
    hash(again)  # still usable as a static argument


def test_path_like_model_is_stored_as_str():
    assert EagleConfig(speculative_model=pathlib.Path("a/b")).speculative_model == "a/b"
    assert SaveHiddenStatesConfig(output_directory=pathlib.Path("o")).output_directory == "o"
    assert SaveHiddenStatesConfig(output_directory="o").max_draft_len == 1


def test_model_instances_are_accepted_but_not_serialisable():
    from specjax.models import ModelConfig
    from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
    from specjax.models.mtp_head import MTPHeads
    head = nnx.eval_shape(lambda: Eagle3Head(Eagle3HeadConfig(
        hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
        vocab_size=10, draft_vocab_size=10), nnx.Rngs(0)))
    config = EagleConfig(max_draft_len=2, speculative_model=head)
    assert config.speculative_model is head
    with pytest.raises(ValueError, match=r"speculative_model is an Eagle3Head instance, which "
                                         r"cannot be serialised: save it with save_eagle3_head"):
        config.to_json()
    target = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=4)
    heads = nnx.eval_shape(lambda: MTPHeads(target, 1, nnx.Rngs(0)))
    mtp = MTPConfig(max_draft_len=2, speculative_model=heads)
    with pytest.raises(ValueError, match="speculative_model is an MTPHeads instance"):
        mtp.to_json()
