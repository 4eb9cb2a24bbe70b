"""DSpark training: its init (DFlash's), the teacher-forced Markov term, the loss, and the
Platt calibration fitted after training."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from head_helpers import random_fill
from specjax.models.dspark_head import GREEDY, SAMPLED, identity_calibration
from specjax.train.config import TrainConfig
from specjax.train.heads.calibration import calibrate, dspark_report, fit_platt
from specjax.train.heads.loss import head_loss, target_outputs
from specjax.train.heads.parallel import dflash_logits, dspark_outputs
from specjax.train.heads.sources import CorpusSource
from specjax.train.heads.spec import HeadSpec, new_head, split_head
from specjax.train.heads.training import train_head, validation_metrics
from test_heads_training import Stream, synthetic_stream

DSPARK = HeadSpec(kind="dspark", depth=3, num_layers=8, drafter_layers=1,
                  capture_layers=(1, 4, 6), markov_rank=8)
DFLASH = HeadSpec(kind="dflash", depth=3, num_layers=8, drafter_layers=1,
                  capture_layers=(1, 4, 6))


def test_new_head_is_dflash_init_plus_fresh_heads(target):
    """Same body draws as the DFlash head of the same seed; Markov out and confidence zero,
    calibration the identity: a fresh DSpark head drafts exactly as its DFlash body."""
    spark, flash = new_head(DSPARK, target, 3), new_head(DFLASH, target, 3)
    np.testing.assert_array_equal(np.asarray(spark.fc[...]), np.asarray(flash.fc[...]))
    for name, p in flash.body.layers.items():
        np.testing.assert_array_equal(np.asarray(spark.body.layers[name][...]), np.asarray(p[...]))
    assert not np.asarray(spark.markov_out[...]).any()
    assert not np.asarray(spark.confidence[...]).any()
    np.testing.assert_array_equal(np.asarray(spark.calibration[...]),
                                  np.asarray(identity_calibration(3)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 9)), jnp.int32)
    _, captured = target.forward(tokens, capture_layers=DSPARK.needed_layers)
    a = dspark_outputs(spark, target, captured, tokens, 3)[0]
    b = dflash_logits(flash, target, captured, tokens, 3)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_markov_term_reads_the_true_previous_token(target):
    """Draft k of anchor row a reads tokens[:, a+k-1]: changing that one token changes draft k's
    logits (and its confidence logit) at that anchor, while the DFlash logits of the same body
    (which see only the anchor's own token and the context before it) do not move."""
    head = random_fill(new_head(DSPARK, target, 0), seed=1, scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (1, 12)), jnp.int32)
    _, captured = target.forward(tokens, capture_layers=DSPARK.needed_layers)
    a, k = 3, 3                          # anchor row 3 (index t = 2), draft 3 reads tokens[:, 5]
    changed = tokens.at[0, a + k - 1].set((tokens[0, a + k - 1] + 7) % 64)
    (before, z0), (after, z1) = (dspark_outputs(head, target, captured, t, 3) for t in
                                 (tokens, changed))
    t = a - 1
    assert not np.allclose(np.asarray(before[k - 1][0, t]), np.asarray(after[k - 1][0, t]))
    assert float(z0[k - 1][0, t]) != float(z1[k - 1][0, t])
    for j in range(3):                   # earlier drafts of the anchor do not read that token
        if j != k - 1:
            np.testing.assert_allclose(np.asarray(before[j][0, t]), np.asarray(after[j][0, t]),
                                       rtol=1e-6, atol=1e-6)
    flash_before = dflash_logits(head, target, captured, tokens, 3)
    flash_after = dflash_logits(head, target, captured, changed, 3)
    np.testing.assert_array_equal(np.asarray(flash_before[k - 1][0, t]),
                                  np.asarray(flash_after[k - 1][0, t]))


def test_dspark_loss_is_finite_and_decreases(target, tmp_path):
    source = Stream(synthetic_stream(400, 0), synthetic_stream(100, 1))
    tc = TrainConfig(steps=20, batch_size=4, seq_len=16, lr=1e-2, warmup=3, log_every=10,
                     eval_every=20, eval_windows=4, save_every=20)
    val = source.val_batches(tc.batch_size, tc.seq_len, tc.eval_windows)
    before = validation_metrics(DSPARK, new_head(DSPARK, target, tc.seed), target, val)
    head, entries = train_head(DSPARK, tc, target, source, tmp_path, progress=False)
    after = validation_metrics(DSPARK, head, target, val)
    assert np.isfinite(before["val_loss"]) and np.isfinite(after["val_loss"])
    assert after["val_loss"] < 0.95 * before["val_loss"], (before, after)
    assert "step_tv" in entries[0] and len(entries[0]["step_bce"]) == 3
    assert np.asarray(head.confidence[...]).any()   # the BCE term trains the confidence head


def test_fit_platt_recovers_a_known_pair():
    rng = np.random.default_rng(0)
    z = rng.standard_normal(20000) * 2
    p = 1 / (1 + np.exp(-(1.7 * z - 0.6)))
    scale, bias = fit_platt(z, rng.random(z.size) < p)
    assert scale == pytest.approx(1.7, abs=0.08) and bias == pytest.approx(-0.6, abs=0.06)
    scale, bias = fit_platt(z, p)                   # soft labels (the sampled rule's)
    assert scale == pytest.approx(1.7, abs=1e-3) and bias == pytest.approx(-0.6, abs=1e-3)
    assert np.isfinite(fit_platt(np.zeros(50), np.ones(50))).all()  # degenerate: stays finite
    u = rng.standard_normal(z.size)                 # with the certainty feature
    p = 1 / (1 + np.exp(-(1.7 * z - 0.6 + 0.9 * u)))
    np.testing.assert_allclose(fit_platt(z, p, u), [1.7, -0.6, 0.9], atol=1e-3)


def test_calibrate_fits_each_position_over_the_anchors_that_reach_it():
    """Position k's maps see only anchors whose depths 1..k-1 agreed; known maps come back."""
    rng = np.random.default_rng(1)
    K, N, maps = 2, 40000, [(2.0, 0.5, 0.7), (0.8, -1.0, -0.4)]
    z, u = rng.standard_normal((K, N)), rng.standard_normal((K, N))
    agree = np.stack([rng.random(N) < 1 / (1 + np.exp(-(s * z[k] + b + g * u[k])))
                      for k, (s, b, g) in enumerate(maps)])
    tv = 1 - 1 / (1 + np.exp(-(1.5 * z + 0.2 + 0.3 * u)))
    table, fitted = calibrate({"agree": agree, "z": z, "u": u, "tv": tv,
                               "mask": np.ones(N, bool)}, K)
    for k, m in enumerate(maps):
        np.testing.assert_allclose(table[GREEDY, k], m, atol=0.1)
        np.testing.assert_allclose(table[SAMPLED, k], [1.5, 0.2, 0.3], atol=1e-2)
    reached = agree[0]
    assert fitted["per_depth"][1]["measured_sampled"] == pytest.approx((1 - tv[1][reached]).mean())


def test_report_drafts_sequentially_and_calibration_matches_agreement(target):
    """The report feeds each draft into the next one's Markov term (brute force per anchor),
    and after fitting, the mean calibrated c at each position equals the measured conditional
    agreement (the fitted bias makes the means match)."""
    head = random_fill(new_head(DSPARK, target, 0), seed=4, scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 64, (2, 10)), jnp.int32)
    batches = [{"tokens": tokens, "valid": jnp.ones_like(tokens, bool)}]
    report = dspark_report(DSPARK, head, target, batches, fit=True)
    assert report["anchors"] == 18 and not np.allclose(np.asarray(head.calibration[...]),
                                                       np.asarray(identity_calibration(3)))
    for d in report["per_depth"]:
        if d["reached"] and 0 < d["conditional_agreement"] < 1:
            assert d["calibration_error"] < 1e-3, d
    # Brute force: anchor t of row 0, drafts one at a time.
    from specjax.train.heads.calibration import dspark_outcomes
    from specjax.train.heads.parallel import dflash_hidden
    from specjax.train.heads.report import greedy_chain_tokens
    out = dspark_outcomes(DSPARK, head, target, batches)
    _, captured = target.forward(tokens, capture_layers=DSPARK.needed_layers)
    base = head.logits(target, dflash_hidden(head, target, captured, tokens, 3))
    g = np.asarray(greedy_chain_tokens(target, tokens, 3))
    for t in range(9):
        prev, ok = int(tokens[0, t + 1]), []
        for k in range(1, 4):
            prev = int(jnp.argmax(base[0, t, k] + head.markov(jnp.asarray(prev))[1]))
            ok.append(prev == g[k - 1, 0, t])
        np.testing.assert_array_equal(out["agree"][:, t], ok)


def test_auc_counts_ranked_pairs_and_ties():
    from specjax.train.heads.calibration import auc
    rng = np.random.default_rng(2)
    s = np.round(rng.standard_normal(500), 1)            # ties on purpose
    y = rng.random(500) < 1 / (1 + np.exp(-2 * s))
    pos, neg = s[y], s[~y]
    brute = ((pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean())
    assert auc(s, y) == pytest.approx(brute)
    assert np.isnan(auc(s, np.ones(500, bool)))
