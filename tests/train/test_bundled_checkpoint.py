"""The shipped default model: present, loadable, in budget, documented."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "stdlib-llama-7m"


def test_bundled_checkpoint_loads_and_predicts():
    from specjax.models import load_hf_checkpoint
    from specjax.train import corpus
    from specjax.train import tokenizer_training as toks

    model = load_hf_checkpoint(BUNDLED)
    cfg = model.config
    assert cfg.num_layers >= 8
    tok = toks.load_tokenizer(BUNDLED)
    assert cfg.vocab_size == tok.get_vocab_size()
    assert cfg.bos_token_id == cfg.eos_token_id == toks.special_token_id(tok)
    size = sum(p.stat().st_size for p in BUNDLED.glob("*.safetensors"))
    assert size <= 40 * 2**20
    for name in ("MODEL_CARD.md", "training_log.json", corpus.MANIFEST_NAME):
        assert (BUNDLED / name).exists()
    ids = [cfg.bos_token_id] + tok.encode("def fibonacci(n):\n").ids
    logits = model(jnp.asarray([ids], jnp.int32))
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()
