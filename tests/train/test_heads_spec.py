"""Draft-vocabulary maps and the head's warm start from the target."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from head_helpers import EAGLE
from specjax.models.mtp_head import target_lm_head
from specjax.train.heads.spec import draft_vocab_maps, new_head


def test_draft_vocab_maps_round_trip(target):
    counts = np.zeros(64, np.int64)
    counts[[3, 10, 11, 40, 63]] = [5, 9, 1, 7, 7]
    d2t, t2d = draft_vocab_maps(counts, 4)
    ids = np.arange(4) + d2t
    np.testing.assert_array_equal(ids, [3, 10, 40, 63])  # top 4 by count, ascending ids
    assert t2d.sum() == 4 and t2d[ids].all()
    spec = dataclasses.replace(EAGLE, depth=2, draft_vocab=4)
    head = new_head(spec, target, 0, counts)
    np.testing.assert_array_equal(np.asarray(head.to_target_ids(jnp.arange(4))), ids)
    # The head's LM head starts as the target's at exactly those ids.
    np.testing.assert_array_equal(np.asarray(head.lm_head[...]),
                                  np.asarray(target_lm_head(target))[:, ids])

