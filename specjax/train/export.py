"""Final export of a trained target: HF-layout weights, compact training log and a model card."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

from specjax.models import Llama, save_hf_checkpoint
from specjax.train.evaluate import greedy_continue, perplexity
from specjax.train.workdir import hardware

# No trailing newline: BPE merges a newline with the next line's indentation, so a prompt ending in a
# bare "\n" ends on a token boundary the model has rarely seen and derails it.
CARD_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef read_config(path):",
                "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):")


def compact_log(entries: list[dict]) -> list[dict]:
    """The committed log keeps interval means, not every step's loss."""
    return [{k: v for k, v in e.items() if k != "step_losses"} for e in entries]


def write_model_card(out: Path, model: Llama, tok: Tokenizer, *, name: str, commands: list[str],
                     eval_command: str, val_loss: float, val_tokens: int, tokens_seen: int,
                     train_meta: dict, manifest: dict, wall_s: float | None,
                     role: str = "the bundled specjax target model") -> str:
    cfg = model.config
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(model))
    files = manifest["files"]
    n_val = sum(f["split"] == "val" for f in files)
    samples = []
    for prompt in CARD_PROMPTS:
        cont = greedy_continue(model, tok, prompt, 64, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id)
        samples.append(f"Prompt {prompt!r}, then at most 64 greedy tokens:\n\n```python\n{prompt}{cont}\n```\n")
    tc = train_meta["train_config"]
    arch = "Llama-architecture"
    layers = f"{cfg.num_layers} layers"
    if cfg.is_hybrid:
        m = cfg.mamba
        arch = "hybrid (Bamba: Mamba-2 mixers and attention layers)"
        layers = (f"{cfg.num_layers} layers: {len(cfg.kv_layers)} attention "
                  f"{list(cfg.kv_layers)}, {len(cfg.recurrent_layers)} Mamba-2 of {m.num_heads} "
                  f"heads x {m.head_dim}, state {m.state_size}, {m.num_groups} group(s), conv "
                  f"{m.conv_kernel}; half-rotary RoPE")
    lines = [
        f"# {name}: {role}\n",
        f"A small {arch} causal LM trained from scratch by `specjax.train` on the Python "
        "standard library source, so that specjax runs out of the box with no download. It writes "
        "plausible-looking Python and is useful for speculative-decoding experiments, not for real work.\n",
        "## Model\n",
        f"- parameters: {n_params:,} ({layers}, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, MLP {cfg.intermediate_size}, "
        f"tied embeddings, RoPE theta {cfg.rope_theta:g})",
        f"- vocabulary: {cfg.vocab_size} byte-level BPE tokens (`tokenizer.json`); `<|endoftext|>` "
        f"(id {cfg.bos_token_id}) is both BOS and EOS and separates documents",
        f"- weights: `model.safetensors` ({cfg.dtype}, Hugging Face "
        f"{'Bamba' if cfg.is_hybrid else 'Llama'} layout, `config.json`)\n",
        "## Data\n",
        f"- {len(files)} `.py` files of the CPython {manifest['python_version']} standard library (tests, "
        "site-packages and generated codec tables excluded; `pydoc_data/topics.py` included for English "
        "prose); exact list with sha256 in `corpus_manifest.json`",
        f"- validation: {n_val} held-out files chosen by a hash of their path ({val_tokens:,} tokens)\n",
        "## Training\n",
        f"- command: `{commands[-1]}`",
        *(["- the run was resumed from saved steps; its invocations, in order: "
            + "; ".join(f"`{c}`" for c in commands)
            + " (a changed `--steps` re-stretches the cosine decay from the resumed step on)"]
          if len(commands) > 1 else []),
        f"- {tc['steps']} steps of {tc['batch_size']} x {tc['seq_len']} tokens = {tokens_seen:,} tokens seen",
        f"- AdamW (b1 {tc['b1']}, b2 {tc['b2']}, weight decay {tc['weight_decay']}), peak lr {tc['lr']:g}, "
        f"{tc['warmup']} warm-up steps then cosine decay to {tc['lr'] * tc['min_lr_ratio']:g}, "
        f"global-norm clip {tc['clip_norm']}",
        f"- hardware: {hardware()}, JAX {jax.__version__}"
        + (f", {wall_s / 60:.0f} min wall time" if wall_s else ""),
        "- loss curve: `training_log.json`\n",
        "## Evaluation\n",
        f"- validation loss **{val_loss:.4f}** nats/token, perplexity **{perplexity(val_loss):.2f}** "
        f"(all held-out files, windows of {tc['seq_len']} tokens)",
        f"- reproduce: `{eval_command}` (on another Python version the files differ; it warns and the "
        "number is not comparable)\n",
        "## Samples (greedy)\n",
        *samples,
        f"_Exported {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC._\n",
    ]
    text = "\n".join(lines)
    (out / "MODEL_CARD.md").write_text(text)
    return text


def export(out: Path, model: Llama, entries: list[dict], meta: dict, dtype: str = "float32") -> None:
    save_hf_checkpoint(model, out, dtype=dtype)
    (out / "training_log.json").write_text(json.dumps({**meta, "entries": compact_log(entries)}, indent=0) + "\n")
