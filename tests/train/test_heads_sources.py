"""Training from saved hidden states (SAVE_HIDDEN_STATES files)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from head_helpers import EAGLE
from specjax.train.config import TrainConfig
from specjax.train.heads.sources import HiddenStatesSource
from specjax.train.heads.training import train_head


def write_hidden_states(folder, target, layers, lengths, seed=0):
    """Hand-written SAVE_HIDDEN_STATES files: per request tokens [N+1] and hidden [N, C, H]."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors, saved = {}, []
    for i, n in enumerate(lengths):
        tokens = rng.integers(1, 64, size=n + 1).astype(np.int32)
        _, captured = target.forward(jnp.asarray(tokens[None, :n]), capture_layers=layers)
        tensors[f"tokens_{i}"] = tokens
        tensors[f"hidden_{i}"] = np.asarray(captured[:, 0].transpose(1, 0, 2), np.float32)
        saved.append((tokens, tensors[f"hidden_{i}"]))
    save_file(tensors, str(folder / "data_00000.safetensors"),
              metadata={"format": "specjax-hidden-states-v1", "layers": json.dumps(list(layers))})
    return saved


def test_train_from_hidden_states(target, tmp_path):
    folder = tmp_path / "hs"
    saved = write_hidden_states(folder, target, (1, 3, 4, 7), [20, 9, 30, 12])
    source = HiddenStatesSource(folder, EAGLE.needed_layers, 32, "EAGLE-3")
    assert len(source.val) == 1  # the last request is held out
    batch = source.train_batch(0, 0, 6, 16)
    assert batch["captured"].shape == (4, 6, 17, 32)
    # Each window is a crop of one request (a short one padded): its tokens and the saved
    # states of layers (1, 3, 4, 7) at the same rows.
    for b in range(6):
        n = int(batch["valid"][b].sum())
        tokens = batch["tokens"][b, :n]
        hits = [(t, h, s) for t, h in saved for s in range(len(h) - n + 1)
                if np.array_equal(t[s:s + n], tokens)]
        assert hits, b
        _, hidden, start = hits[0]
        np.testing.assert_array_equal(batch["captured"][:, b, :n],
                                      hidden[start:start + n].transpose(1, 0, 2))
        assert n == 17 or start == 0
    tc = TrainConfig(steps=4, batch_size=3, seq_len=16, warmup=1, log_every=2, eval_every=4,
                     eval_windows=4, save_every=4)
    head, entries = train_head(EAGLE, tc, target, source, tmp_path / "work", progress=False)
    assert np.isfinite([e["loss"] for e in entries if "loss" in e]).all()
    assert np.isfinite([e["val_loss"] for e in entries if "val_loss" in e]).all()


def test_dflash_trains_from_hidden_states(target, tmp_path):
    """SAVE_HIDDEN_STATES files train a DFlash drafter as they train EAGLE-3: its layers and
    the last one (the labels)."""
    from specjax.train.heads.spec import HeadSpec
    spec = HeadSpec(kind="dflash", depth=2, num_layers=8, drafter_layers=1, capture_layers=(1, 4))
    folder = tmp_path / "hs"
    write_hidden_states(folder, target, (1, 4, 7), [20, 9, 30, 12])
    source = HiddenStatesSource(folder, spec.needed_layers, 32, "DFlash")
    tc = TrainConfig(steps=3, batch_size=3, seq_len=16, warmup=1, log_every=3, eval_every=3,
                     eval_windows=2, save_every=3)
    head, entries = train_head(spec, tc, target, source, tmp_path / "work", progress=False)
    assert np.isfinite([e["loss"] for e in entries if "loss" in e]).all()
    assert head.config.target_layer_ids == (1, 4)


def test_hidden_states_missing_layer_is_a_clear_error(target, tmp_path):
    folder = tmp_path / "hs"
    write_hidden_states(folder, target, (1, 3, 4), [10])  # no last layer (7) for the labels
    with pytest.raises(ValueError, match=r"hold layers \[1, 3, 4\].*missing: \[7\]"):
        HiddenStatesSource(folder, EAGLE.needed_layers, 32, "EAGLE-3")
