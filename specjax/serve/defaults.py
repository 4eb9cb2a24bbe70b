"""Which speculative mode a server uses when none is given, and parsing --speculative-config."""
from __future__ import annotations

import os
from pathlib import Path

from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.speculative.config import DraftTargetConfig, EagleConfig, SpeculativeConfig

BUNDLED_DRAFT = "stdlib-draft"
BUNDLED_EAGLE3 = "stdlib-eagle3"


def default_speculative_config(model: str | os.PathLike) -> SpeculativeConfig | None:
    """The fastest mode shipped for `model` (`python -m specjax.bench spec`): for the bundled
    target, EAGLE-3 with its trained head, else draft-target with the draft model (whichever
    folder exists); none for other models."""
    if str(model) == "bundled":
        head = CHECKPOINTS_DIR / BUNDLED_EAGLE3
        if (head / "config.json").exists():
            return EagleConfig(max_draft_len=4, speculative_model=str(head))
        draft = CHECKPOINTS_DIR / BUNDLED_DRAFT
        if (draft / "config.json").exists():
            return DraftTargetConfig(max_draft_len=4, speculative_model=str(draft))
    return None


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


def served_model_name(model: str | os.PathLike) -> str:
    """What /v1/models lists: the checkpoint folder's name ("bundled" -> the target's)."""
    return BUNDLED_TARGET if str(model) == "bundled" else Path(model).expanduser().resolve().name
