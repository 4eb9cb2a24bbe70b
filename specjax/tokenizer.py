"""Text <-> token ids, backed by a Hugging Face `tokenizer.json` (the `tokenizers` library)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import tokenizers


class Tokenizer:
    """Thin wrapper that also knows the model's special ids from the checkpoint folder."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = ()):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} is missing")
        backend = tokenizers.Tokenizer.from_file(str(file))
        bos, eos = None, ()
        config = folder / "config.json"
        if config.exists():
            hf = json.loads(config.read_text())
            bos = hf.get("bos_token_id")
            eos = hf.get("eos_token_id")
            eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        return cls(backend, bos, eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # The batch entry points release the GIL while they work (plain `encode` holds it: a
        # 1 MiB prompt would stall every other thread, a server's event loop among them);
        # `encode_batch_fast` also skips the offsets nobody reads here.
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        ids = batch([text], add_special_tokens=False)[0].ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
