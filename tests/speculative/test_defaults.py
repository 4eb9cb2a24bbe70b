"""The drafters shipped per target: what a config naming no drafter, the default and AUTO
read for the bundled target and for SmolLM2."""
import json

import pytest

from specjax.speculative import defaults
from specjax.speculative.modes import SpeculativeDecodingMode as M
from specjax.speculative.config import (AutoConfig, DFlashConfig, EagleConfig, MTPConfig,
                                        NGramConfig)
from specjax.speculative.defaults import (default_speculative_config, parse_speculative_config,
                                          resolve_auto, shipped_configs, with_shipped_drafter)


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """An empty checkpoints/ folder; `ship(name)` adds a drafter folder to it."""
    monkeypatch.setattr(defaults, "CHECKPOINTS_DIR", tmp_path)

    def ship(folder, config=None):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config or {}))
    return ship


def test_smollm2_reads_its_own_eagle3_head_and_dflash_drafter(checkpoints, monkeypatch):
    # Measured: NGram asking for evidence is SmolLM2's fastest, and needs nothing shipped;
    # its default and AUTO take it, while a config naming a mode reads the shipped drafter.
    assert default_speculative_config("smollm2") == defaults.EVIDENCE_NGRAM
    checkpoints("smollm2-dflash")
    checkpoints("smollm2-eagle3")
    assert default_speculative_config("smollm2") == defaults.EVIDENCE_NGRAM
    assert resolve_auto(AutoConfig(), "smollm2", 4) == defaults.EVIDENCE_NGRAM
    assert (defaults.EVIDENCE_NGRAM.min_matching_ngram_size,
            defaults.EVIDENCE_NGRAM.min_followed_ratio) == (2, 0.5)
    # A target measured fastest plainly lists no modes: its default and AUTO do not speculate.
    monkeypatch.setitem(defaults.DEFAULT_ORDER, "smollm2", ())
    assert default_speculative_config("smollm2") is None
    assert resolve_auto(AutoConfig(), "smollm2", 4) is None
    assert with_shipped_drafter(EagleConfig(max_draft_len=3), "smollm2").speculative_model \
        == "smollm2-eagle3"
    assert parse_speculative_config("dflash", "smollm2").speculative_model == "smollm2-dflash"
    # Once a drafter measures faster and joins the order, the default and AUTO take it; a
    # model given another way ships nothing (AUTO: the NGram heuristic).
    monkeypatch.setitem(defaults.DEFAULT_ORDER, "smollm2", (M.EAGLE3_ONE_MODEL, M.DFLASH))
    assert default_speculative_config("smollm2") == EagleConfig(
        max_draft_len=4, speculative_model="smollm2-eagle3")
    assert resolve_auto(AutoConfig(), "smollm2", 4).speculative_model == "smollm2-eagle3"
    other = resolve_auto(AutoConfig(), "/some/file.gguf", 4)
    assert isinstance(other, NGramConfig) and other.min_matching_ngram_size == 2
    assert [type(c) for c in shipped_configs(4, "smollm2")] == [NGramConfig, EagleConfig,
                                                                DFlashConfig]
    # The bundled target's drafters are not SmolLM2's.
    assert default_speculative_config("bundled") is None
    assert with_shipped_drafter(EagleConfig(), "bundled").speculative_model is None


def test_the_bundled_target_keeps_its_drafters(checkpoints):
    checkpoints("stdlib-eagle3")
    checkpoints("stdlib-mtp", {"num_nextn_predict_layers": 2})
    assert default_speculative_config("bundled").speculative_model == "bundled-eagle3"
    mtp = [c for c in shipped_configs(4) if isinstance(c, MTPConfig)][0]
    assert (mtp.max_draft_len, mtp.num_nextn_predict_layers, mtp.use_mtp_vanilla) == (2, 2, True)
    assert default_speculative_config("smollm2") == defaults.EVIDENCE_NGRAM
