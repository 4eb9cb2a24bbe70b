"""Tokenizers with fill-in-the-middle tokens for the tests: the bundled tokenizer with special
tokens added (nothing downloaded)."""
from __future__ import annotations

import pytest
import tokenizers
from tokenizers import AddedToken

from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.tokenizer import Tokenizer

QWEN_FIM_TEXTS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>")
BUNDLED_VOCAB = 4096   # the added tokens' ids follow it


def added_special_tokenizer(texts=QWEN_FIM_TEXTS, add_bos: bool = False) -> Tokenizer:
    """The bundled tokenizer with `texts` added as special tokens (ids 4096, 4097, ... in
    that order: Qwen2.5-Coder's FIM tokens by default, in Qwen's order), <|endoftext|> (0)
    its end of text; no BOS unless `add_bos` (Qwen's vocabulary has none)."""
    file = CHECKPOINTS_DIR / BUNDLED_TARGET / "tokenizer.json"
    if not file.exists():
        pytest.skip("the bundled checkpoint is not in this checkout")
    backend = tokenizers.Tokenizer.from_file(str(file))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts])
    return Tokenizer(backend, bos_token_id=0 if add_bos else None, eos_token_ids=(0,),
                     add_bos_token=add_bos)
