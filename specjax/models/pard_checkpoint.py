"""PARD draft models: a Hugging Face Llama folder whose config.json also names the mask token
(`pard_token`, as PARD checkpoints do; `mask_token_id` is read too). A target whose vocabulary
has no spare token gets a draft model with one more embedding row: the mask token is then id
`vocab_size - 1` of the draft model, one past the target's last id."""
from __future__ import annotations

import json
import os
from pathlib import Path

from specjax.models.checkpoint_io import checkpoint_folder, read_config
from specjax.models.hf_checkpoint import save_hf_checkpoint
from specjax.models.llama import Llama

MASK_FIELDS = ("pard_token", "mask_token_id")


def read_mask_token(folder: str | os.PathLike) -> int | None:
    """The mask token a PARD folder's config.json names, or None."""
    hf = read_config(checkpoint_folder(folder, "PARD draft model"))
    for name in MASK_FIELDS:
        if isinstance(hf.get(name), int) and not isinstance(hf.get(name), bool):
            return hf[name]
    return None


def save_pard_model(model: Llama, folder: str | os.PathLike, mask_token_id: int,
                    dtype: str | None = None) -> None:
    """`save_hf_checkpoint` plus `pard_token` in config.json."""
    save_hf_checkpoint(model, folder, dtype)
    path = Path(folder) / "config.json"
    hf = json.loads(path.read_text())
    hf["pard_token"] = mask_token_id
    path.write_text(json.dumps(hf, indent=2) + "\n")
