"""`python -m specjax.train eval --model checkpoints/<name>`: held-out loss of an exported target."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specjax.models import load_hf_checkpoint
from specjax.train import corpus, data
from specjax.train import tokenizer_training as toks
from specjax.train.evaluate import loss_over_windows, perplexity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True,
                   help="folder with config.json, model.safetensors, tokenizer.json, corpus_manifest.json")
    p.add_argument("--seq-len", type=int, default=256, help="evaluation window length (tokens)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--max-windows", type=int, default=None,
                   help="evaluate only the first N windows (default: all of them)")


def validation_stream(folder: Path) -> tuple[Tokenizer, np.ndarray]:
    """-> (tokenizer, `[N]` int32 validation stream) from the folder's manifest and this stdlib."""
    tok = toks.load_tokenizer(folder)
    manifest = corpus.load_manifest(folder / corpus.MANIFEST_NAME)
    corpus.warn_if_mismatched(manifest)
    docs = corpus.read_documents(manifest, "val")
    return tok, data.encode_stream(tok, docs, toks.special_token_id(tok))


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    model = load_hf_checkpoint(args.model)
    _, stream = validation_stream(args.model)
    windows = data.eval_windows(stream, args.seq_len, args.max_windows)
    loss = loss_over_windows(model, windows, args.batch_size)
    print(f"validation loss {loss:.4f} nats/token, perplexity {perplexity(loss):.2f} "
          f"({len(windows)} windows x {args.seq_len} tokens)")
    return 0
