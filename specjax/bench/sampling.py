"""Rejection sampling on the bundled target + draft: does sampled output follow the target, and
how much more is accepted than with strict matching?

Each sampled sequence contributes one independent observation (its tokens 3 and 4: token 1
comes from prefill and token 2 from a step with no drafts yet, so token 3 is the first that
verification decides). Speculative and plain samples are compared with a two-sample chi-square
homogeneity test (categories with a pooled expected count below 5 merged; critical value at
alpha = 1e-4 by the Wilson-Hilferty approximation). The draft model's own samples, compared the
same way, show the test's power.
"""
from __future__ import annotations

import argparse
import collections
import math

from specjax.llm import LLM
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import DraftTargetConfig
from specjax.speculative.defaults import BUNDLED_DRAFT

PROMPT = "def fibonacci(n):"
Z_1E4 = 3.719  # standard normal quantile for alpha = 1e-4


def chi_square(a: list, b: list, z: float = Z_1E4) -> tuple[float, int, float]:
    """Two-sample chi-square homogeneity test: (statistic, degrees of freedom, critical value
    at the level whose standard normal quantile is z). The samples differ if stat > critical."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    na, nb = len(a), len(b)
    keys = set(ca) | set(cb)
    big = {k for k in keys if (ca[k] + cb[k]) * min(na, nb) / (na + nb) >= 5}
    rows = [(ca[k], cb[k]) for k in big]
    rows.append((sum(ca[k] for k in keys - big), sum(cb[k] for k in keys - big)))
    rows = [r for r in rows if sum(r)]
    stat = 0.0
    for x, y in rows:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(len(rows) - 1, 1)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, df, critical


def make_llm(model: str, max_draft_len: int = 0, rejection_sampling: bool = False) -> LLM:
    spec = None
    if max_draft_len:
        spec = DraftTargetConfig(max_draft_len=max_draft_len,
                                 speculative_model=str(CHECKPOINTS_DIR / BUNDLED_DRAFT),
                                 use_rejection_sampling=rejection_sampling)
    # Compiled lazily: only the shapes these runs use.
    return LLM(model, max_batch_size=8, max_prefill_rows=4, prefill_chunk=16, max_model_len=64,
               speculative_config=spec, warmup=False, progress=False)


def observations(llm: LLM, n: int, seed_offset: int, top_k: int) -> list[tuple[int, int]]:
    """(token 3, token 4) of n sequences sampled at temperature 1 (and top-k, 0 = off)."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, seed=seed_offset + i,
                             ignore_eos=True) for i in range(n)]
    return [tuple(o.token_ids[2:4]) for o in llm.generate([PROMPT] * n, params)]


def acceptance_rate(llm: LLM, requests: int, max_tokens: int) -> float:
    before = (llm.stats.accepted_draft_tokens, llm.stats.drafted_tokens)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i)
              for i in range(requests)]
    llm.generate([PROMPT] * requests, params)
    return ((llm.stats.accepted_draft_tokens - before[0])
            / max(llm.stats.drafted_tokens - before[1], 1))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=1000, help="sequences per method")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--max-draft-len", type=int, default=3)


def run(args: argparse.Namespace) -> None:
    target = str(CHECKPOINTS_DIR / BUNDLED_TARGET)
    D = args.max_draft_len
    plain = observations(make_llm(target), args.samples, 0, args.top_k)
    rs_llm = make_llm(target, D, rejection_sampling=True)
    rs = observations(rs_llm, args.samples, 10**6, args.top_k)
    draft = observations(make_llm(str(CHECKPOINTS_DIR / BUNDLED_DRAFT)), args.samples, 10**6,
                         args.top_k)
    print(f"{args.samples} sequences per method, temperature 1, top-k {args.top_k}, D={D}; "
          f"chi-square vs plain sampling (alpha = 1e-4)")
    print(f"{'sample':>22} {'stat':>8} {'df':>4} {'critical':>9} {'differs':>8}")
    for name, sample, pick in [("rejection, unigram", rs, lambda t: t[0]),
                               ("rejection, bigram", rs, lambda t: t),
                               ("draft model, unigram", draft, lambda t: t[0])]:
        stat, df, crit = chi_square([pick(t) for t in plain], [pick(t) for t in sample])
        print(f"{name:>22} {stat:>8.1f} {df:>4} {crit:>9.1f} {str(stat > crit):>8}")
    strict = acceptance_rate(make_llm(target, D), 16, 32)
    rejection = acceptance_rate(rs_llm, 16, 32)
    print(f"acceptance at temperature 1 (16 requests x 32 tokens): rejection sampling "
          f"{rejection:.1%}, strict matching {strict:.1%}")
