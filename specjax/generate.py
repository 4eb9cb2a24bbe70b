"""`python -m specjax.generate --prompt ...`: continue a prompt and report tokens/s."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specjax.cli import MODEL_HELP, HelpFormatter
from specjax.llm import LLM
from specjax.sampling_params import SamplingParams
from specjax.speculative.defaults import parse_speculative_config, speculative_config_help


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specjax.generate", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--prompt", action="append",
                        help="text to continue (repeat for a batch; default: 'def fibonacci(n):')")
    parser.add_argument("--model", default="bundled",
                        help=MODEL_HELP)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy; otherwise sampled")
    parser.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this fraction of the most likely one")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: a random one per prompt)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter dtype (default: the checkpoint's; a GGUF's quantized "
                             "weights stay quantized unless a dtype is named)")
    parser.add_argument("--quantize", choices=("q8_0", "q4_0"), default=None,
                        help="quantize a float checkpoint's weights at load, its LM head to "
                             "q8_0 (default: none, the checkpoint's own weights)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="prompts decoded together in one step")
    parser.add_argument("--prompts-file", default=None,
                        help="a JSONL file of prompts ({\"prompt\": ...} per line), added to "
                             "--prompt")
    parser.add_argument("--speculative-config", default="none", help=speculative_config_help(
        "'none'; e.g. 'eagle3' drafts with the shipped EAGLE-3 head, and "
        "'{\"mode\": \"save_hidden_states\", \"output_directory\": \"hs\"}' saves the "
        "target's hidden states for head training"))
    return parser


def read_prompts_file(path: str) -> list[str]:
    """Prompts from a JSONL file: one {"prompt": "..."} object per non-empty line."""
    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--prompts-file: cannot read {path!r}: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts-file {path}:{number}: not JSON ({e})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"--prompts-file {path}:{number}: expected {{\"prompt\": \"...\"}}")
        prompts.append(item["prompt"])
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # every argument is checked before the model loads
        prompts = list(args.prompt or [])
        if args.prompts_file:
            prompts += read_prompts_file(args.prompts_file)
        prompts = prompts or ["def fibonacci(n):"]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                seed=args.seed)
        spec = parse_speculative_config(args.speculative_config, args.model)
        llm = LLM(args.model, dtype=args.dtype, quantize=args.quantize,
                  max_batch_size=args.max_batch_size,
                  speculative_config=spec)
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
    print(f"[{tokens} tokens in {elapsed:.2f} s (compiling included): "
          f"{tokens / elapsed:.1f} tokens/s; model {llm.model_path}]", file=sys.stderr)
    spec = llm.speculative_config  # what "auto" resolved to
    if spec is not None and (spec.mode.has_spec_decoder() or spec.mode.has_spec_drafter()):
        print(f"[{spec.mode.name}: {speculation_summary(llm.stats)}]", file=sys.stderr)
    return 0


def speculation_summary(stats) -> str:
    """Acceptance length and rate, per draft position, for the end-of-run line."""
    if stats.acceptance_length is None:
        return "no drafts were verified"
    per_position = " ".join(f"{a:.2f}" for a in stats.acceptance_per_position)
    return (f"acceptance length {stats.acceptance_length:.2f} over "
            f"{stats.request_steps_with_drafts} request-steps with drafts, acceptance rate "
            f"{stats.acceptance_rate:.1%} ({stats.accepted_draft_tokens}/"
            f"{stats.drafted_tokens}), accepted at least k by position k: {per_position}")


if __name__ == "__main__":
    raise SystemExit(main())
