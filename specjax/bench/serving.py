"""Serving features on the bundled target: what the prefix cache saves, and what logprobs cost.

Prefix cache: R requests arrive together, each a shared prefix of P tokens (a long system
prompt) followed by a distinct suffix, greedy, N new tokens each, with the default
speculation. Two engines, prefix cache on and off, warmed up and run alternately (the best
of --repeats runs each); on every run the cache starts empty, so the first request computes
the prefix and the others reuse its blocks (admission holds them until those blocks are
published rather than computing them twice). The outputs of both engines must be equal.

Logprobs: B requests of N tokens decoded together, without logprobs and with the top k, on
one engine (the log-softmax and top-k run in the step only when a row asks for them).
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from specjax.bench.table import Column, Table
from specjax.llm import LLM
from specjax.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled", help="a checkpoint folder or name")
    parser.add_argument("--requests", type=int, default=16, help="requests sharing the prefix")
    parser.add_argument("--prefix-len", type=int, default=1000, help="shared prefix tokens")
    parser.add_argument("--suffix-len", type=int, default=8, help="distinct tokens after it")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="new tokens per request in the prefix-cache runs")
    parser.add_argument("--logprobs-batch", type=int, default=8,
                        help="requests decoded together in the logprobs runs")
    parser.add_argument("--logprobs-tokens", type=int, default=128,
                        help="new tokens per request in the logprobs runs")
    parser.add_argument("--top", type=int, nargs="+", default=[0, 5, 20],
                        help="logprobs k values to time (besides none)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the best counts")


def _timed(llm: LLM, prompts, params) -> tuple[float, list[float], list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    total = time.perf_counter() - start
    return total, [o.stats.time_to_first_token for o in outs], outs


def prefix_cache_table() -> Table:
    return Table([
        Column("prefix cache", "the engine's enable_prefix_cache", 12, left=True),
        Column("TTFT mean", "time to first token, mean over the requests (s)", 9, "{:.3f}"),
        Column("TTFT p50", "median time to first token (s)", 8, "{:.3f}"),
        Column("TTFT max", "the last request's time to first token (s)", 8, "{:.3f}"),
        Column("total s", "wall time until every request finished", 7, "{:.3f}"),
        Column("hit rate", "prompt tokens served from the cache / prompt tokens", 8, "{:.1%}"),
    ], notes=[("speedup", "cache off / cache on, for mean TTFT and total time")])


def logprobs_table() -> Table:
    return Table([
        Column("logprobs", "SamplingParams.logprobs (none: not asked)", 8, left=True),
        Column("tok/s", "generated tokens per second over the batch", 8, "{:.1f}"),
        Column("vs none", "tok/s relative to the run without logprobs", 7, "{:.1%}"),
    ])


def run(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    P, S, N, R = args.prefix_len, args.suffix_len, args.max_tokens, args.requests
    max_len = P + S + N
    sides = {flag: LLM(args.model, max_batch_size=R, max_model_len=max_len,
                       enable_prefix_cache=flag, progress=False, warmup=True)
             for flag in (True, False)}
    V = sides[True].model.config.vocab_size
    prefix = rng.integers(1, V, P).tolist()
    prompts = [prefix + rng.integers(1, V, S).tolist() for _ in range(R)]
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    print(f"model: {args.model}, {R} requests of a shared {P}-token prefix + {S} distinct "
          f"tokens, {N} new tokens each; jax {jax.__version__} on {jax.devices()[0].platform}")
    best: dict[bool, tuple] = {}
    for _ in range(args.repeats):
        for flag, llm in sides.items():
            llm.engine.allocator.clear_cache()
            llm.engine.stats.reset()
            total, ttft, outs = _timed(llm, prompts, params)
            row = (float(np.mean(ttft)), float(np.median(ttft)), max(ttft), total,
                   llm.engine.stats.prefix_cache_hit_rate or 0.0, outs)
            if flag not in best or row[3] < best[flag][3]:
                best[flag] = row
    on, off = best[True], best[False]
    if [o.token_ids for o in on[5]] != [o.token_ids for o in off[5]]:
        raise AssertionError("the prefix cache changed the output")
    tab = prefix_cache_table()
    print("\n" + tab.header())
    for flag in (True, False):
        print(tab.row("on" if flag else "off", *best[flag][:5]))
    print(f"speedup: TTFT {off[0] / on[0]:.2f}x, total {off[3] / on[3]:.2f}x")
    print(tab.legend())

    llm = sides[True]
    B, N = args.logprobs_batch, args.logprobs_tokens
    prompts = [rng.integers(1, V, 16).tolist() for _ in range(B)]
    print(f"\nlogprobs: {B} requests decoded together, {N} new tokens each")
    settings = [None] + list(args.top)
    rates: dict = {}
    for _ in range(args.repeats):
        for k in settings:
            total, _, outs = _timed(llm, prompts, SamplingParams(max_tokens=N, ignore_eos=True,
                                                                 logprobs=k))
            rate = sum(len(o.token_ids) for o in outs) / total
            rates[k] = max(rates.get(k, 0.0), rate)
    tab = logprobs_table()
    print("\n" + tab.header())
    for k in settings:
        print(tab.row("none" if k is None else str(k), rates[k], rates[k] / rates[None]))
    print(tab.legend())
