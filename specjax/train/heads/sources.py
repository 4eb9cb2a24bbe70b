"""Where a head's training windows come from: the target's own corpus (token streams; the
target's forward computes the hidden states in the step) or a SAVE_HIDDEN_STATES folder (the
saved residual streams ride in the batch as "captured")."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specjax.engine.hidden_states import read_hidden_states
from specjax.train import corpus, data
from specjax.train import tokenizer_training as toks


class DataSource:
    """Training batches `{"tokens" [B, T+1] int32, "valid" [B, T+1] bool (, "captured"
    [C, B, T+1, H])}`, validation batches of the same shape, and training token counts."""

    description = ""

    def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> dict: ...
    def val_windows(self, seq_len: int, max_windows: int | None) -> list[dict]: ...
    def token_counts(self, vocab_size: int) -> np.ndarray: ...
    def max_token(self) -> int: ...

    def val_batches(self, batch_size: int, seq_len: int, max_windows: int | None = None
                    ) -> list[dict]:
        """Fixed validation windows in batches; the last batch is padded with invalid rows."""
        windows = self.val_windows(seq_len, max_windows)
        batches = []
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            while len(chunk) < batch_size:
                chunk.append({k: (np.zeros_like(v) if k != "captured" else v)
                              for k, v in windows[0].items()})
            batches.append({k: np.stack([w[k] for w in chunk], axis=1 if k == "captured" else 0)
                            for k in chunk[0]})
        return batches


class CorpusSource(DataSource):
    def __init__(self, train_stream: np.ndarray, val_stream: np.ndarray, description: str = ""):
        self.train_stream, self.val_stream = train_stream, val_stream
        self.description = description

    def train_batch(self, seed, step, batch_size, seq_len):
        tokens = data.batch_for_step(self.train_stream, seed, step, batch_size, seq_len)
        return {"tokens": tokens, "valid": np.ones(tokens.shape, bool)}

    def val_windows(self, seq_len, max_windows):
        windows = data.eval_windows(self.val_stream, seq_len, max_windows)
        return [{"tokens": w, "valid": np.ones(w.shape, bool)} for w in windows]

    def token_counts(self, vocab_size):
        return np.bincount(self.train_stream, minlength=vocab_size)[:vocab_size]

    def max_token(self):
        return int(max(self.train_stream.max(), self.val_stream.max()))


class HiddenStatesSource(DataSource):
    """Windows cropped from saved requests (rows s..s+T of one request; a shorter request is
    padded with invalid rows). Every 20th request (at least one, when there are two or more) is
    held out for validation."""

    def __init__(self, directory: str | Path, needed_layers: tuple[int, ...], hidden_size: int,
                 what: str):
        layers, requests = read_hidden_states(directory)
        missing = [x for x in dict.fromkeys(needed_layers) if x not in layers]
        if missing:
            raise ValueError(
                f"--hidden-states {directory}: the files hold layers {list(layers)}, but {what} "
                f"needs layers {list(dict.fromkeys(needed_layers))} (the head's inputs and the "
                f"last layer for the labels); missing: {missing}")
        H = requests[0][1].shape[2]
        if H != hidden_size:
            raise ValueError(f"--hidden-states {directory}: hidden size {H} != the target's "
                             f"{hidden_size}")
        self.columns = [layers.index(x) for x in needed_layers]
        n_val = max(1, len(requests) // 20) if len(requests) >= 2 else 0
        self.train = requests[:len(requests) - n_val]
        self.val = requests[len(requests) - n_val:] if n_val else requests
        self.description = (f"{len(requests)} saved requests from `{directory}` (layers "
                            f"{list(layers)}); {len(self.val)} held out")
        lengths = np.asarray([len(h) for _, h in self.train], np.float64)
        self.weights = lengths / lengths.sum()

    def _window(self, request, start: int, seq_len: int) -> dict:
        tokens, hidden = request
        rows = min(seq_len + 1, len(hidden) - start)
        out_tokens = np.zeros((seq_len + 1,), np.int32)
        out_tokens[:rows] = tokens[start:start + rows]
        valid = np.zeros((seq_len + 1,), bool)
        valid[:rows] = True
        captured = np.zeros((len(self.columns), seq_len + 1, hidden.shape[2]), np.float32)
        captured[:, :rows] = hidden[start:start + rows][:, self.columns].transpose(1, 0, 2)
        return {"tokens": out_tokens, "valid": valid, "captured": captured}

    def train_batch(self, seed, step, batch_size, seq_len):
        rng = np.random.default_rng([seed, step])
        picks = rng.choice(len(self.train), size=batch_size, p=self.weights)
        windows = []
        for i in picks:
            n = len(self.train[i][1])
            start = int(rng.integers(0, n - seq_len)) if n > seq_len + 1 else 0
            windows.append(self._window(self.train[i], start, seq_len))
        return {"tokens": np.stack([w["tokens"] for w in windows]),
                "valid": np.stack([w["valid"] for w in windows]),
                "captured": np.stack([w["captured"] for w in windows], axis=1)}

    def val_windows(self, seq_len, max_windows):
        windows = []
        for request in self.val:
            for start in range(0, max(len(request[1]) - 1, 1), seq_len):
                windows.append(self._window(request, start, seq_len))
        return windows[:max_windows] if max_windows is not None else windows

    def token_counts(self, vocab_size):
        return np.bincount(np.concatenate([t for t, _ in self.train]),
                           minlength=vocab_size)[:vocab_size]

    def max_token(self):
        return int(max(t.max() for t, _ in self.train + self.val))


def corpus_source(target_dir: Path, work: Path) -> CorpusSource:
    """The target's own corpus: its tokenizer and manifest (train split for training, val for
    validation and the report), token streams cached under `work`."""
    for name in (toks.TOKENIZER_NAME, corpus.MANIFEST_NAME):
        if not (target_dir / name).exists():
            raise SystemExit(f"--target: {target_dir / name} is missing (train from the corpus "
                             "needs the target's tokenizer and corpus manifest; or pass "
                             "--hidden-states)")
    manifest = corpus.load_manifest(target_dir / corpus.MANIFEST_NAME)
    corpus.warn_if_mismatched(manifest)
    tok = toks.load_tokenizer(target_dir)
    bos = toks.special_token_id(tok)
    train = data.cached_stream(work / "tokens_train.npy", tok,
                               corpus.read_documents(manifest, "train"), bos)
    val = data.cached_stream(work / "tokens_val.npy", tok, corpus.read_documents(manifest, "val"),
                             bos)
    n_val = sum(f["split"] == "val" for f in manifest["files"])
    return CorpusSource(train, val, f"the target's corpus (`{target_dir.name}/corpus_manifest.json`"
                        f": {len(train):,} train tokens; {len(val):,} validation tokens from "
                        f"{n_val} held-out files)")
