"""Prompts for self-distillation data: snippets of a target's training split, as JSONL.

`python scripts/snippet_prompts.py --target checkpoints/stdlib-llama-7m > prompts.jsonl`, then
`python -m specjax.generate --prompts-file prompts.jsonl --max-tokens 160 --max-batch-size 32
--speculative-config '{"mode": "save_hidden_states", "output_directory": "hs", "layers": [1, 4, 7]}'`
saves the target's greedy continuations with its hidden states: what the shipped PARD and
DFlash drafters were trained on (`python -m specjax.train pard|dflash --hidden-states hs`).
Each snippet starts at a line of a training-split file (4-14 lines, at most 500 characters);
the same seed gives the same snippets.
"""
import argparse
import json
import random
import sys
from pathlib import Path

from specjax.train import corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("checkpoints/stdlib-llama-7m"),
                   help="a target folder with corpus_manifest.json (default: %(default)s)")
    p.add_argument("--count", type=int, default=768, help="snippets (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = p.parse_args()
    manifest = corpus.load_manifest(args.target / corpus.MANIFEST_NAME)
    docs = [d for d in corpus.read_documents(manifest, "train") if len(d) > 2000]
    rng = random.Random(args.seed)
    for _ in range(args.count):
        lines = rng.choice(docs).splitlines(keepends=True)
        i = rng.randrange(0, max(1, len(lines) - 40))
        text = "".join(lines[i:i + rng.randint(4, 14)])[:500]
        sys.stdout.write(json.dumps({"prompt": text}) + "\n")


if __name__ == "__main__":
    main()
