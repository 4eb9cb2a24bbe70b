"""Head training: the distance to the target shrinks over a few dozen steps."""
import dataclasses

import numpy as np
import pytest

from head_helpers import EAGLE
from specjax.train.config import TrainConfig
from specjax.train.heads.sources import CorpusSource
from specjax.train.heads.spec import HeadSpec, new_head
from specjax.train.heads.training import train_head, validation_metrics


class Stream(CorpusSource):
    pass


def synthetic_stream(n, seed):
    """Repeated short phrases: a predictable stream the target's hidden states can carry."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, 64, size=rng.integers(3, 7)) for _ in range(6)]
    return np.concatenate([phrases[i] for i in rng.integers(0, 6, size=n)]).astype(np.int32)


@pytest.mark.parametrize("spec", [
    dataclasses.replace(EAGLE, depth=2, draft_vocab=32),
    HeadSpec(kind="mtp", depth=2, num_layers=8, num_modules=2),
    HeadSpec(kind="pard", depth=3, num_layers=8, drafter_layers=2),
    HeadSpec(kind="dflash", depth=3, num_layers=8, drafter_layers=1, capture_layers=(1, 4, 6)),
], ids=["eagle3_reduced_vocab", "mtp", "pard", "dflash"])
def test_loss_decreases(target, spec, tmp_path):
    """On fixed validation windows, the distance to the target (the soft cross-entropy less the
    labels' own entropy) shrinks over a few dozen steps."""
    source = Stream(synthetic_stream(400, 0), synthetic_stream(100, 1))
    tc = TrainConfig(steps=30, batch_size=4, seq_len=16, lr=1e-2, warmup=3, log_every=10,
                     eval_every=30, eval_windows=4, save_every=30)
    val = source.val_batches(tc.batch_size, tc.seq_len, tc.eval_windows)
    before = validation_metrics(spec, new_head(spec, target, tc.seed, source.token_counts(64)),
                                target, val)
    head, entries = train_head(spec, tc, target, source, tmp_path, progress=False)
    after = validation_metrics(spec, head, target, val)
    assert after["val_kl"] < 0.85 * before["val_kl"], (before, after)
    assert after["val_loss"] < before["val_loss"]
    assert entries[-1]["val_loss"] == pytest.approx(after["val_loss"], rel=1e-5)

