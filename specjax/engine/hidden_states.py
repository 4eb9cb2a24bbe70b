"""SAVE_HIDDEN_STATES: collect the target's captured residual streams per request and write
them to disk -- the training data of hidden-state drafters (`python -m specjax.train eagle3 |
mtp --hidden-states DIR`).

File format (`<output_directory>/<file_prefix>_<k:05d>.safetensors`, one per flush): for each
finished request i in the file, `tokens_{i}` int32 `[N + 1]` (prompt + output) and `hidden_{i}`
float32 `[N, C, H]`, where `hidden_{i}[t, c]` is the residual stream after layer `layers[c]`
at position t -- the state from which the target predicted `tokens_{i}[t + 1]`. Metadata:
{"format": FORMAT, "layers": JSON list, "request_ids": JSON list}.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.models.checkpoint_io import save_safetensors

FORMAT = "specjax-hidden-states-v1"


class HiddenStateRecorder:
    def __init__(self, config, layers: tuple[int, ...]):
        self.directory = Path(config.output_directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = config.file_prefix
        self.write_interval = config.write_interval
        self.layers = tuple(layers)
        self._rows: dict[int, dict[int, np.ndarray]] = {}   # request -> {start position: [n, C, H]}
        self._done: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._next_file = 0
        self.files: list[Path] = []

    def record(self, request, start: int, hidden: np.ndarray) -> None:
        """hidden `[C, n, H]` for positions start .. start+n-1 of `request`."""
        self._rows.setdefault(request.request_id, {})[start] = np.ascontiguousarray(
            hidden.transpose(1, 0, 2), np.float32)

    def record_step(self, rows, hidden: np.ndarray) -> None:
        """A generation step's rows at once: `rows` (request, start position, batch row),
        `hidden` `[C, B, T, H]` of which position 0 of each row is recorded. One copy for the
        whole step, a view of it per row (joined into one array per request at `finish`)."""
        if not rows:
            return
        step = np.ascontiguousarray(hidden[:, :, 0].transpose(1, 0, 2), np.float32)
        for request, start, i in rows:
            self._rows.setdefault(request.request_id, {})[start] = step[i:i + 1]

    def drop(self, request) -> None:
        """Preempted: every position is recomputed (and recorded) again."""
        self._rows.pop(request.request_id, None)

    def finish(self, request) -> None:
        pieces = self._rows.pop(request.request_id, {})
        if not pieces:
            return
        rows, expected = [], 0
        for start in sorted(pieces):
            if start != expected:  # cannot happen: every processed position is recorded once
                raise RuntimeError(f"request {request.request_id}: hidden states missing for "
                                   f"positions {expected}..{start - 1}")
            rows.append(pieces[start])
            expected = start + len(pieces[start])
        hidden = np.concatenate(rows)
        tokens = np.asarray(request.all_ids[:len(hidden) + 1], np.int32)
        self._done.append((request.request_id, tokens, hidden[:len(tokens) - 1]))

    def maybe_flush(self, step: int, idle: bool) -> None:
        if self._done and (idle or step % self.write_interval == 0):
            self.flush()

    def flush(self) -> Path | None:
        """Write every finished request not yet written to a new file; returns its path."""
        if not self._done:
            return None
        tensors, ids = {}, []
        for i, (request_id, tokens, hidden) in enumerate(self._done):
            tensors[f"tokens_{i}"] = tokens
            tensors[f"hidden_{i}"] = hidden
            ids.append(request_id)
        path = self.directory / f"{self.prefix}_{self._next_file:05d}.safetensors"
        save_safetensors(tensors, path, metadata={
            "format": FORMAT, "layers": json.dumps(self.layers), "request_ids": json.dumps(ids)})
        self._next_file += 1
        self._done = []
        self.files.append(path)
        return path


def load_hidden_states(path: str | Path) -> tuple[tuple[int, ...], list[tuple[np.ndarray, np.ndarray]]]:
    """Read one file: (layers, [(tokens `[N+1]` int32, hidden `[N, C, H]`), ...]); every
    tensor's presence and shape is checked, and the error names the file and the tensor."""
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (metadata format={meta.get('format')!r})")
        layers = tuple(json.loads(meta["layers"]))
        names = set(f.keys())
        records = []
        for i in range(sum(1 for n in names if n.startswith("tokens_"))):
            if f"hidden_{i}" not in names or f"tokens_{i}" not in names:
                raise ValueError(f"{path}: tokens_{i} / hidden_{i} missing")
            tokens, hidden = f.get_tensor(f"tokens_{i}"), f.get_tensor(f"hidden_{i}")
            if hidden.ndim != 3 or hidden.shape[0] != len(tokens) - 1 or \
                    hidden.shape[1] != len(layers):
                raise ValueError(f"{path}: hidden_{i} has shape {hidden.shape}, expected "
                                 f"[{len(tokens) - 1}, {len(layers)}, H] for tokens_{i} of "
                                 f"{len(tokens)} and layers {list(layers)}")
            records.append((tokens.astype(np.int32), hidden))
    return layers, records


def read_hidden_states(directory: str | Path) -> tuple[tuple[int, ...], list[tuple[np.ndarray, np.ndarray]]]:
    """Every `*.safetensors` file of a SAVE_HIDDEN_STATES folder, in name order: (captured
    layers, [(tokens, hidden), ...]) over all files, requests without hidden states skipped."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--hidden-states {directory}: no *.safetensors files")
    layers, requests = None, []
    for path in files:
        file_layers, records = load_hidden_states(path)
        if layers is not None and file_layers != layers:
            raise ValueError(f"{path}: layers {list(file_layers)} differ from the other "
                             f"files' {list(layers)}")
        layers = file_layers
        requests += [(tokens, hidden) for tokens, hidden in records if len(hidden)]
    if not requests:
        raise ValueError(f"--hidden-states {directory}: no saved requests with hidden states")
    return layers, requests
