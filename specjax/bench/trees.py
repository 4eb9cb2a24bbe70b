"""Sampled requests on draft trees: acceptance length (AL) of the EAGLE-3 head's chain (rejection
sampling), its dynamic tree verified by the strict walk, and the same tree with siblings drawn
without replacement and recursive rejection sampling, at each temperature, in one run.

The bundled target (or --model) with its shipped EAGLE-3 head, batch 1, every step at full
depth (`draft_len_schedule` {1: D}: the figures are acceptance, not a cost model's choices),
the bench's held-out completion prompts (`specjax.bench.spec.PROMPTS`, code and docstrings),
--repeats seeds each, --max-tokens tokens, EOS ignored. Temperature 0 is greedy: the tree rows
keep top-K children and the walk, and the two trees must agree.
"""
from __future__ import annotations

import argparse
import dataclasses

from specjax.bench.spec import PROMPTS
from specjax.bench.table import Column, Table
from specjax.llm import LLM
from specjax.sampling_params import SamplingParams
from specjax.speculative.defaults import shipped_configs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled",
                        help="target model with a shipped EAGLE-3 head (bundled, smollm2)")
    parser.add_argument("--temperatures", default="1,0.7,0",
                        help="comma-separated temperatures (0: greedy)")
    parser.add_argument("--max-draft-len", type=int, default=4, help="D: chain length, tree depth")
    parser.add_argument("--top-k", type=int, default=4, help="K: children per expanded node")
    parser.add_argument("--nodes", type=int, default=16, help="T: nodes per tree")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=2, help="seeds per prompt")


def configs(model: str, D: int, K: int, T: int) -> dict:
    eagle = next((c for c in shipped_configs(D, model) if c.mode.name == "EAGLE3_ONE_MODEL"),
                 None)
    if eagle is None:
        raise SystemExit(f"no EAGLE-3 head is shipped for {model}")
    chain = dataclasses.replace(eagle, draft_len_schedule={1: D})
    tree = dataclasses.replace(chain, use_dynamic_tree=True, dynamic_tree_max_topK=K,
                               max_total_draft_tokens=T)
    return {"chain, rejection sampling": chain,
            f"tree K={K} T={T}, strict walk": dataclasses.replace(
                tree, use_rejection_sampling=False),
            f"tree K={K} T={T}, rejection sampling": tree}


def run(args: argparse.Namespace) -> None:
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if any(t < 0 for t in temperatures):
        raise SystemExit(f"--temperatures must be >= 0, got {args.temperatures}")
    prompts = PROMPTS["code"] + PROMPTS["docstring"]
    runs = configs(args.model, args.max_draft_len, args.top_k, args.nodes)
    table = Table([Column("method", "EAGLE-3 chain or tree (D = depth)", 38, left=True),
                   Column("temp", "sampling temperature (0: greedy)", 5, "{:.1f}"),
                   Column("AL", "tokens per verify step (accepted drafts + 1)", 6, "{:.3f}"),
                   Column("accept", "accepted / verified draft positions (a tree: its depths)",
                          7, "{:.1%}"),
                   Column("vs chain", "AL minus the chain's at the same temperature", 9,
                          "{:+.3f}")])
    print(f"{len(prompts)} held-out prompts x {args.repeats} seeds x {args.max_tokens} tokens, "
          f"batch 1, D={args.max_draft_len}")
    print(table.header())
    chain_al = {}
    for name, config in runs.items():
        llm = LLM(args.model, max_batch_size=1, speculative_config=config, warmup=False,
                  progress=False)
        for t in temperatures:
            llm.reset_stats()
            for r in range(args.repeats):
                for i, prompt in enumerate(prompts):
                    llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens,
                                                          temperature=t, seed=1000 * r + i,
                                                          ignore_eos=True))
            al = llm.stats.acceptance_length
            chain_al.setdefault(t, al)
            print(table.row(name, t, al, llm.stats.acceptance_rate, al - chain_al[t]),
                  flush=True)
    print(table.legend())
