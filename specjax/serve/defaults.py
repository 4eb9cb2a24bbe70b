"""What a server answers to when none is named; the speculation defaults live in
`specjax.speculative.defaults` (shared with the other CLIs)."""
from __future__ import annotations

import os
from pathlib import Path

from specjax.models.registry import BUNDLED_TARGET
from specjax.speculative.defaults import (default_speculative_config,  # noqa: F401 (re-export)
                                          parse_speculative_config)


def served_model_name(model: str | os.PathLike) -> str:
    """What /v1/models lists: the checkpoint folder's name ("bundled" -> the target's)."""
    return BUNDLED_TARGET if str(model) == "bundled" else Path(model).expanduser().resolve().name
