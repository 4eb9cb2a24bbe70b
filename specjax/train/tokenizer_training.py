"""Byte-level BPE for the bundled model, trained with Hugging Face `tokenizers`.

Byte level means every string encodes (no unknown token) and decoding gives back the exact bytes, which
matters for Python where indentation is syntax. No prefix space is added and no normalizer runs, so
`decode(encode(s)) == s` holds for any text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# One special token as both BOS and EOS (GPT-2 style): each document starts with it, so it also marks
# the boundary between concatenated documents.
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT,)
TOKENIZER_NAME = "tokenizer.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train on `texts`; special tokens take the first ids, so `<|endoftext|>` is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so bytes absent from the training text still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def special_token_id(tok: Tokenizer, token: str = ENDOFTEXT) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"tokenizer has no {token!r}")
    return tid


def load_tokenizer(path: Path) -> Tokenizer:
    path = Path(path)
    return Tokenizer.from_file(str(path / TOKENIZER_NAME if path.is_dir() else path))


def save_tokenizer(tok: Tokenizer, folder: Path) -> Path:
    path = Path(folder) / TOKENIZER_NAME
    tok.save(str(path))
    return path
