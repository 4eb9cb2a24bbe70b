"""Verify lengths chosen by the cost model against plain decoding and every fixed draft length, per batch size, in one run.

For each method (--config; default EAGLE-3 and NGram), each --temperatures value and each
--batch-sizes value: tokens/s of plain decoding (an engine without speculation), of the method
pinned at each fixed draft length in --fixed and at 0 (one engine,
`DraftLengthPolicy.pinned`; at 0 the drafter still keeps up with every token), and of
the method as it runs by default -- the cost model choosing each step's draft length
(`specjax.speculative.cost_model`; its own engine, so the pinned runs teach it nothing). Runs
alternate; each keeps the fastest of --repeats. A batch size B runs max(B, 8) requests, B at a
time (the bench's completion prompts, or a chat model's held-out requests, repeated as needed).

Printed per method: the step costs its engine measured at warm-up (ms per compiled step, by
batch bucket and run width), then per temperature a table: tok/s of each variant, auto over
max(plain, best fixed), the steps auto ran at each draft length, its AL, and whether every
greedy run gave plain decoding's tokens.
"""
from __future__ import annotations

import argparse
import os

import jax

from specjax.analysis.timing import cpu_name
from specjax.bench.spec import CHAT_PROMPTS, PROMPTS, _run
from specjax.chat import ChatTemplate
from specjax.llm import LLM
from specjax.models.registry import resolve_model_path
from specjax.sampling_params import SamplingParams
from specjax.speculative.defaults import parse_speculative_config
from specjax.tokenizer import Tokenizer

DEFAULT_CONFIGS = ("eagle3", "ngram")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled", help="target: a name or a folder/GGUF")
    parser.add_argument("--config", action="append", default=[],
                        help="a method (a --speculative-config value); repeatable; default: "
                             + ", ".join(DEFAULT_CONFIGS))
    parser.add_argument("--batch-sizes", default="1,4,8,16,32", help="comma-separated")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated")
    parser.add_argument("--fixed", default="1,2,3,4",
                        help="fixed draft lengths to compare with (each <= the method's "
                             "max_draft_len)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant (fastest kept)")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise SystemExit(f"--{name}: at least one value, none negative, got {text!r}")
    return values


def _prompts(path, n: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_model(path)
    if tokenizer.chat_template is not None:
        template = ChatTemplate.from_tokenizer(tokenizer)
        texts = [p for group in CHAT_PROMPTS.values() for p in group]
        ids = [template.prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    else:
        ids = [tokenizer.encode(p, add_bos=None) for group in PROMPTS.values() for p in group]
    return [ids[i % len(ids)] for i in range(n)]


def run(args: argparse.Namespace) -> None:
    try:
        path = resolve_model_path(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--model: {e}") from None
    batch_sizes = _ints(args.batch_sizes, "batch-sizes")
    fixed = _ints(args.fixed, "fixed")
    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--temperatures: comma-separated numbers, got "
                         f"{args.temperatures!r}") from None
    if not temperatures or min(temperatures) < 0:
        raise SystemExit("--temperatures: at least one, none negative")
    if min(batch_sizes) < 1:
        raise SystemExit("--batch-sizes: each >= 1")
    try:
        configs = [parse_speculative_config(c, args.model)
                   for c in (args.config or DEFAULT_CONFIGS)]
    except ValueError as e:
        raise SystemExit(str(e).replace("--speculative-config", "--config")) from None
    for c in configs:
        if c is None or c.schedule is not None:
            raise SystemExit("--config: a speculative method without a draft_len_schedule "
                             "(the cost model is what this bench measures)")
        if max(fixed) > c.max_draft_len:
            raise SystemExit(f"--fixed {max(fixed)} exceeds {c.mode.name}'s max_draft_len "
                             f"{c.max_draft_len}")
    requests = max(max(batch_sizes), 8)
    prompts = _prompts(path, requests)
    common = dict(max_batch_size=max(batch_sizes), max_model_len=512, progress=False,
                  warmup=True)
    plain = LLM(str(path), speculative_config=None, **common)
    print(f"target: {path.name}, batch sizes {batch_sizes}, max(B, 8) requests x "
          f"{args.max_tokens} tokens, jax {jax.__version__} on {jax.devices()[0].platform} "
          f"({cpu_name()}, {os.cpu_count()} cores), fastest of {args.repeats}")
    for config in configs:
        pinned = LLM(str(path), speculative_config=config, **common)
        auto = LLM(str(path), speculative_config=config, **common)
        name = type(config).__name__.replace("Config", "")
        print(f"\n== {name} (max_draft_len {config.max_draft_len}): step costs measured at "
              f"warm-up (the auto engine's)\n{auto.engine.length_policy.costs.format()}")
        for temperature in temperatures:
            greedy = temperature == 0
            # Sampled requests name no seed: a named one pins its steps at the configured
            # length (its text must repeat; `DraftLengthPolicy.decides_output`).
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                    ignore_eos=True)
            print(f"\n{name}, {'greedy' if greedy else f'temperature {temperature:g}'}: tok/s")
            print(f"{'batch':>5} {'plain':>8} " + " ".join(f"{'D=' + str(d):>8}"
                                                           for d in [0, *fixed])
                  + f" {'auto':>8} {'auto/max':>8}  auto steps per D      AL    exact")
            for B in batch_sizes:
                work = prompts[:max(B, 8)]
                variants = [("plain", plain, None), (0, pinned, 0)] + [
                    (d, pinned, d) for d in fixed] + [("auto", auto, None)]
                best: dict = {}
                reference, exact, steps, al = None, True, None, None
                for _ in range(args.repeats):
                    for key, llm, pin in variants:
                        llm.engine.length_policy.pinned = pin
                        llm.reset_stats()
                        outs, seconds = _run(llm, work, params, B)
                        tps = sum(len(o.token_ids) for o in outs) / seconds
                        best[key] = max(best.get(key, 0.0), tps)
                        if key == "plain":
                            reference = reference or outs
                        elif greedy:
                            exact &= all(a.token_ids == b.token_ids
                                         for a, b in zip(outs, reference))
                        if key == "auto":
                            steps = list(llm.stats.draft_len_histogram)
                            al = llm.stats.acceptance_length
                top = max([best["plain"]] + [best[d] for d in fixed])
                print(f"{B:>5} {best['plain']:8.0f} "
                      + " ".join(f"{best[d]:8.0f}" for d in [0, *fixed])
                      + f" {best['auto']:8.0f} {best['auto'] / top:8.2f}  {str(steps):<20} "
                      f"{al or 0:5.2f} {'yes' if exact else 'NO' if greedy else '-':>6}",
                      flush=True)
        print(f"\nthe auto engine's step costs after the runs (observed: median of real "
              f"iterations)\n{auto.engine.length_policy.costs.format()}")
    print("\nLegend: plain = an engine without speculation; D=d = the method with every "
          "step at d drafts (D=0: its engine decoding plainly, the drafter still keeping "
          "up with every token); auto = the method as it runs by default (the cost model picks "
          "each step's draft length, 0 = plain, from measured step costs and per-request "
          "acceptance); auto/max = auto over the best of plain and every fixed D; auto steps "
          "per D = generation steps auto ran at each draft length (index 0 = plain) in its "
          "last run; AL = accepted + 1 per step with drafts; exact = every greedy run gave "
          "plain decoding's tokens.")
