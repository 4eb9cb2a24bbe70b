"""Where models come from: the bundled checkpoint or a local folder. Never a download."""
from __future__ import annotations

import os
from pathlib import Path

# Checkpoints trained by specjax itself live in the repository's top-level `checkpoints/`.
CHECKPOINTS_DIR = Path(os.environ.get("SPECJAX_CHECKPOINTS",
                                      Path(__file__).resolve().parents[2] / "checkpoints"))
BUNDLED_TARGET = "stdlib-llama-7m"
# Names that resolve to the shipped checkpoints from any working directory.
BUNDLED = {"bundled": BUNDLED_TARGET, "bundled-draft": "stdlib-draft",
           "bundled-eagle3": "stdlib-eagle3", "bundled-mtp": "stdlib-mtp",
           "bundled-pard": "stdlib-pard", "bundled-dflash": "stdlib-dflash"}


def resolve_model_path(model: str | os.PathLike) -> Path:
    """"bundled" -> the shipped target, "bundled-draft" / "bundled-eagle3" / "bundled-mtp" /
    "bundled-pard" / "bundled-dflash" -> its shipped drafters; anything else must be an
    existing local folder."""
    if str(model) in BUNDLED:
        path = CHECKPOINTS_DIR / BUNDLED[str(model)]
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{model!s} is missing from {path}; install specjax from a source checkout "
                "(pip install -e .) or set SPECJAX_CHECKPOINTS to its checkpoints/ folder")
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model: {str(model)!r} is neither 'bundled' nor an existing local folder "
                         "(specjax never downloads models; the shipped drafters are "
                         "'bundled-draft', 'bundled-eagle3', 'bundled-mtp', 'bundled-pard' and "
                         "'bundled-dflash')")
    return path
