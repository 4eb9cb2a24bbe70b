"""`python -m specjax.generate --prompt ...`: continue a prompt and report tokens/s."""
from __future__ import annotations

import argparse
import sys
import time

from specjax.llm import LLM
from specjax.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specjax.generate", description=__doc__)
    parser.add_argument("--prompt", action="append",
                        help="text to continue (repeat for a batch; default 'def fibonacci(n):')")
    parser.add_argument("--model", default="bundled",
                        help="'bundled' or a local Hugging Face / specjax checkpoint folder")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--max-batch-size", type=int, default=8)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = args.prompt or ["def fibonacci(n):"]
    try:  # every argument is checked before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, max_batch_size=args.max_batch_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(prompt + out.text)
        if len(prompts) > 1:
            print("-" * 40)
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s; "
          f"model {llm.model_path}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
