"""A target whose greedy next token is mostly a fixed permutation of the current one, and
EAGLE-3 / MTP heads built by hand to know that permutation: drafts both accepted and
rejected, with no training.

The target is a tiny 8-layer Llama; its layers perturb the permutation depending on context,
which is where the heads' drafts go wrong.
"""
import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import Llama
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.mtp_head import MTPHeads
from tests.conftest import TINY

CFG = TINY.replace(num_layers=8, tie_word_embeddings=False)
LAYERS = (1, 3, 4)  # EAGLE-3's default for 8 layers
# Prompts the drafter tests share, and how many tokens they generate after each.
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7],
           [9, 9, 9, 9, 9], [33, 2]]
MAX_TOKENS = 24


def _unit_rows(x):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True))


def perm_target(cfg=CFG) -> tuple[Llama, np.ndarray]:
    """(target, perm): greedy next token = perm[current] about 80% of the time. `cfg`: CFG or
    a variant of it (other head counts)."""
    CFG = cfg
    model = Llama(CFG, rngs=nnx.Rngs(0))
    perm = np.random.default_rng(0).permutation(CFG.vocab_size)
    unit = _unit_rows(np.asarray(model.embed[...]))
    head = np.zeros((CFG.hidden_size, CFG.vocab_size), np.float32)
    head[:, perm] = unit.T
    model.lm_head.value = jnp.asarray(head)
    model.layers["o_proj"].value = model.layers["o_proj"][...] * 1.3
    model.layers["down_proj"].value = model.layers["down_proj"][...] * 1.3
    return model, perm


def eagle_head(target, perm, seed=1):
    """fc keeps the lowest captured layer (about the current token's embedding), the midlayer
    adds nothing, lm_head predicts perm(perm(token)): right for draft 1 whenever the target
    follows the permutation, and the draft vocabulary drops 8 ids through d2t."""
    CFG = target.config
    head = Eagle3Head(Eagle3HeadConfig.for_target(CFG, draft_vocab_size=CFG.vocab_size - 8),
                      nnx.Rngs(seed))
    H, Vd = CFG.hidden_size, CFG.vocab_size - 8
    fc = np.zeros((3 * H, H), np.float32)
    fc[:H] = np.eye(H)
    head.fc.value = jnp.asarray(fc)
    head.midlayer["o_proj"].value = jnp.zeros_like(head.midlayer["o_proj"][...])
    head.midlayer["down_proj"].value = jnp.zeros_like(head.midlayer["down_proj"][...])
    # Draft vocabulary: every target id except 8 (sorted), d2t = target id - draft id.
    dropped = set(perm[perm[np.arange(8)]].tolist())
    kept = np.asarray([t for t in range(CFG.vocab_size) if t not in dropped])
    head.d2t.value = jnp.asarray(kept - np.arange(Vd), jnp.int32)
    head.t2d.value = jnp.asarray(np.isin(np.arange(CFG.vocab_size), kept))
    unit = _unit_rows(np.asarray(target.embed[...]))
    lm = np.zeros((H, Vd), np.float32)
    where = {t: d for d, t in enumerate(kept)}
    for token in range(CFG.vocab_size):
        target_id = perm[perm[token]]
        if target_id in where:
            lm[:, where[target_id]] = unit[token]
    head.lm_head.value = jnp.asarray(lm)
    return head


def mtp_heads(num_modules, seed=2, cfg=CFG):
    """Each module passes the embedded token through (eh_proj = [I; 0], the block adds
    nothing), so with the target's lm_head it predicts perm(token): exact for the target's
    permutation part."""
    CFG = cfg
    heads = MTPHeads(CFG, num_modules, nnx.Rngs(seed))
    H = CFG.hidden_size
    for module in heads.modules:
        eh = np.zeros((2 * H, H), np.float32)
        eh[:H] = np.eye(H)
        module.eh_proj.value = jnp.asarray(eh)
        module.block["o_proj"].value = jnp.zeros_like(module.block["o_proj"][...])
        module.block["down_proj"].value = jnp.zeros_like(module.block["down_proj"][...])
    return heads


def perm_stream(perm, n=20_000, follow=0.8, seed=0):
    """Text like the perm target's: the next token is perm[token] with probability `follow`,
    else a random one."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, np.int32)
    out[0] = 1
    jumps, fresh = rng.random(n) >= follow, rng.integers(0, len(perm), n)
    for t in range(1, n):
        out[t] = fresh[t] if jumps[t] else perm[out[t - 1]]
    return out


def trained_parallel_drafter(kind, target, perm, work, depth=3, steps=150):
    """A PARD model or DFlash drafter trained by the trainer (`specjax.train.heads`) for a few
    seconds on perm text: its drafts are right at every depth often, not always."""
    from specjax.train.config import TrainConfig
    from specjax.train.heads.sources import CorpusSource
    from specjax.train.heads.spec import HeadSpec
    from specjax.train.heads.training import train_head

    spec = HeadSpec(kind=kind, depth=depth, num_layers=CFG.num_layers, drafter_layers=2,
                    capture_layers=LAYERS if kind == "dflash" else ())
    tc = TrainConfig(steps=steps, batch_size=8, seq_len=32, lr=1e-2, warmup=10,
                     weight_decay=0.0, log_every=steps, eval_every=10**6, save_every=10**6)
    stream = perm_stream(perm)
    head, _ = train_head(spec, tc, target, CorpusSource(stream, stream[:2000]), work,
                         progress=False)
    return head


# The depth both parallel-drafter modules train at (test_parallel_engine verifies 3 drafts a
# step; test_sa_enhancer runs the same drafters at 4: a PARD model or DFlash drafter runs at
# any depth). One depth, so the two modules can share one training when they share a process.
PARALLEL_DEPTH = 3


@functools.cache
def shared_parallel_drafter(kind, depth=PARALLEL_DEPTH):
    """`trained_parallel_drafter(kind)` for `perm_target()` (deterministic: the same weights in
    every process), trained once per process: test modules on the same worker share it
    instead of training it again. Callers must not change it."""
    target, perm = perm_target()
    work = Path(tempfile.mkdtemp(prefix=f"specjax-tests-{kind}-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    return trained_parallel_drafter(kind, target, perm, work, depth=depth)
