"""What a server answers to when none is named; the speculation defaults live in
`specjax.speculative.defaults` (shared with the other CLIs)."""
from __future__ import annotations

import os
from pathlib import Path

from specjax.models.registry import BUNDLED_TARGET, INSTALLED
from specjax.speculative.defaults import (default_speculative_config,  # noqa: F401 (re-export)
                                          parse_speculative_config)


def served_model_name(model: str | os.PathLike) -> str:
    """What /v1/models lists: the checkpoint folder's name ("bundled" -> the target's), an
    installed model's name ("smollm2"), a GGUF file's name without ".gguf"."""
    if str(model) == "bundled":
        return BUNDLED_TARGET
    if str(model) in INSTALLED:
        return str(model)
    path = Path(model).expanduser().resolve()
    return path.stem if path.suffix.lower() == ".gguf" else path.name
