"""The drafters shipped for the bundled target, the default speculation for a model, and the
`--speculative-config` command-line value every CLI (serve, generate, bench) parses alike."""
from __future__ import annotations

import json
import os
from pathlib import Path

from specjax.models.registry import CHECKPOINTS_DIR
from specjax.speculative.config import (DraftTargetConfig, EagleConfig, MTPConfig, NGramConfig,
                                        SpeculativeConfig)

BUNDLED_DRAFT = "stdlib-draft"
BUNDLED_EAGLE3 = "stdlib-eagle3"
BUNDLED_MTP = "stdlib-mtp"


def shipped(name: str) -> Path | None:
    """The folder of a drafter shipped in `checkpoints/`, or None when it is absent."""
    folder = CHECKPOINTS_DIR / name
    return folder if (folder / "config.json").exists() else None


def default_speculative_config(model: str | os.PathLike) -> SpeculativeConfig | None:
    """The fastest mode shipped for `model` (`python -m specjax.bench spec`): for the bundled
    target, EAGLE-3 with its trained head, else draft-target with the draft model (whichever
    folder exists); none for other models."""
    if str(model) == "bundled":
        if head := shipped(BUNDLED_EAGLE3):
            return EagleConfig(max_draft_len=4, speculative_model=str(head))
        if draft := shipped(BUNDLED_DRAFT):
            return DraftTargetConfig(max_draft_len=4, speculative_model=str(draft))
    return None


def shipped_configs(max_draft_len: int) -> list[SpeculativeConfig]:
    """NGram, then each drafter shipped for the bundled target: draft model, EAGLE-3 head and
    MTP modules (MTP drafts at most one token per module)."""
    D = max_draft_len
    configs: list[SpeculativeConfig] = [NGramConfig(max_draft_len=D, max_matching_ngram_size=3)]
    if draft := shipped(BUNDLED_DRAFT):
        configs.append(DraftTargetConfig(max_draft_len=D, speculative_model=str(draft)))
    if head := shipped(BUNDLED_EAGLE3):
        configs.append(EagleConfig(max_draft_len=D, speculative_model=str(head)))
    if mtp := shipped(BUNDLED_MTP):
        n = json.loads((mtp / "config.json").read_text())["num_nextn_predict_layers"]
        configs.append(MTPConfig(max_draft_len=min(D, n), num_nextn_predict_layers=n,
                                 use_mtp_vanilla=True, speculative_model=str(mtp)))
    return configs


def parse_speculative_config(value: str | None,
                             model: str | os.PathLike) -> SpeculativeConfig | None:
    """--speculative-config: unset -> the default for `model`; "none" -> off; JSON text
    (`SpeculativeConfig.to_json()`'s format) or a file holding it."""
    if value is None:
        return default_speculative_config(model)
    if value.strip().lower() == "none":
        return None
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"--speculative-config: {value!r} is neither 'none', JSON, nor a "
                             "file")
        text = path.read_text()
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:  # json.JSONDecodeError is a ValueError too
        raise ValueError(f"--speculative-config: {e}") from None
