"""Token streams and batches.

Documents are concatenated into one stream, each preceded by the BOS/EOS token. A training batch is a
set of random windows whose offsets depend only on (seed, step), so a resumed run sees exactly the
batches the uninterrupted run would have seen, and no data-loader state needs checkpointing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def encode_stream(tok: Tokenizer, docs: Sequence[str], bos_id: int) -> np.ndarray:
    """`[N]` int32: `bos, doc0..., bos, doc1..., ...`."""
    pieces = []
    for enc in tok.encode_batch(list(docs), add_special_tokens=False):
        pieces.append(np.asarray([bos_id] + enc.ids, np.int32))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def cached_stream(path: Path, tok: Tokenizer, docs: Sequence[str], bos_id: int) -> np.ndarray:
    """Encoding the stdlib takes seconds; a resumed run reuses the saved stream."""
    path = Path(path)
    if path.exists():
        return np.load(path)
    stream = encode_stream(tok, docs, bos_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, stream)
    return stream


def batch_for_step(stream: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """`[B, T + 1]` int32 windows for training step `step` (inputs `[:, :-1]`, targets `[:, 1:]`)."""
    if len(stream) < seq_len + 1:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
    return np.stack([stream[s : s + seq_len + 1] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """`[N, T + 1]` consecutive windows overlapping by one token, so every token after the first is a
    target exactly once. The tail that does not fill a window is dropped."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
