"""Rejection sampling on the bundled target with each in-step drafter: does every token follow
the target's distribution, at every draft depth, and how much more is accepted than with strict
matching?

Sequences are sampled long enough that steps verify full chains of D drafts, so every depth
and the bonus token after a full chain are decided many times. Each generated token is tagged
with what decided it: a step without drafts ("plain"), the draft at depth k = 1..D (accepted,
or the correction drawn from the residual at the first rejection), or the bonus after k - 1
accepted drafts. Its exact target distribution p(. | prefix) is computed afterwards by a dense
forward of the target over the finished sequence (float64 softmax of logits / temperature).

The test, per group of tokens (one group per depth): tokens are put in categories that depend
only on what was known before the token was drawn -- the token's rank under p (bins 0, 1, 2-3,
4-7, 8-15, 16+) crossed with whether p > q at it (q: the draft distribution at that depth,
read from the engine's slot state before the step; 0 for bonus and plain tokens). Under
exactness each token's category is a draw from its own P_i(c) = sum of p over the category,
so O - E (observed minus expected counts) is a sum of martingale differences with covariance
S = sum_i diag(P_i) - P_i P_i^T; the statistic (O - E)^T S^-1 (O - E) (one category dropped)
is chi-square with C - 1 degrees of freedom in the limit (martingale CLT). Categories whose
expected count is below 5 are merged. A group fails when the statistic exceeds the critical
value at alpha = 1e-5 (Wilson-Hilferty). The same statistic applied to the draft tokens
themselves (drawn from q, not p) must fail: that shows its power.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from specjax.llm import LLM
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import SpeculativeConfig
from specjax.speculative.defaults import shipped_configs

PROMPT = "def fibonacci(n):"
Z_1E5 = 4.265  # standard normal quantile for alpha = 1e-5
RANK_EDGES = (1, 2, 4, 8, 16)  # rank bins [0], [1], [2, 4), [4, 8), [8, 16), [16, V)


def critical_value(df: int, z: float = Z_1E5) -> float:
    """Chi-square critical value for `df` degrees of freedom at the level whose standard normal
    quantile is z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def in_step_configs(max_draft_len: int, rejection_sampling: bool = True
                    ) -> dict[str, SpeculativeConfig]:
    """The in-step drafters shipped for the bundled target (they carry draft distributions)."""
    return {c.mode.name.lower(): dataclasses.replace(c, use_rejection_sampling=rejection_sampling)
            for c in shipped_configs(max_draft_len) if c.mode.name != "NGRAM"}


def make_llm(spec: SpeculativeConfig | None, max_batch_size: int = 16,
             max_model_len: int = 64) -> LLM:
    """The bundled target (float32), overlap off so the slot state read after each step holds
    exactly the drafts the next step verifies. Compiled lazily: only the shapes used, one
    batch size (the tail of a run pads instead of compiling each smaller bucket) and one
    prompt row a prefill step (one prefill program: its prompts are short)."""
    return LLM(str(CHECKPOINTS_DIR / BUNDLED_TARGET), max_batch_size=max_batch_size,
               batch_sizes=(max_batch_size,),
               max_prefill_rows=1, prefill_chunk=16, max_model_len=max_model_len,
               speculative_config=spec, overlap_scheduler=False, warmup=False, progress=False)


@dataclasses.dataclass
class Decided:
    """Generated tokens tagged by what decided them (parallel arrays, one entry per token)."""

    seq: np.ndarray        # [n] which sequence
    pos: np.ndarray        # [n] index of the token in prompt + output
    kind: np.ndarray       # [n] 0 plain (no drafts), 1 draft depth (accepted or corrected), 2 bonus
    depth: np.ndarray      # [n] k = 1-based index of the token within its step's emission
    full_chain: np.ndarray  # [n] bonus after the step's full D drafts
    draft: np.ndarray      # [n] the draft token at this depth (-1 for plain and bonus)
    q: list                # [n] the draft distribution `[V]` (None for plain and bonus)
    sequences: list[list[int]]


def _add_seeded(llm: LLM, n: int, max_tokens: int, temperature: float, seed_offset: int,
                prompt: str | list[int]) -> list:
    """`n` requests of `prompt` with seeds seed_offset + i, added to an engine whose steps are
    read before the next is dispatched (the drafts the next step verifies are read in between)."""
    engine = llm.engine
    if engine.overlap:
        raise ValueError("tagging needs overlap_scheduler=False (drafts read after each step)")
    ids = llm.encode(prompt) if isinstance(prompt, str) else list(prompt)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             seed=seed_offset + i, ignore_eos=True) for i in range(n)]
    return [engine.requests[engine.add_request(ids, p)] for p in params]


def sample_and_tag(llm: LLM, D: int, n: int, max_tokens: int, temperature: float,
                   seed_offset: int, prompt: str | list[int] = PROMPT) -> Decided:
    """Sample `n` sequences of `max_tokens` tokens at `temperature` after `prompt` (text, or
    token ids for a model without a tokenizer), driving the engine step by step, and tag
    every generated token with the depth that decided it."""
    engine = llm.engine
    requests = _add_seeded(llm, n, max_tokens, temperature, seed_offset, prompt)
    pending = {}  # request index -> (drafts, q `[d, V]`) to be verified by its next step
    cols = {k: [] for k in ("seq", "pos", "kind", "depth", "full_chain", "draft")}
    qs = []
    preemptions = engine.stats.num_preemptions
    while engine.has_unfinished():
        before = [(len(r.output_ids), r.stats.num_draft_tokens) for r in requests]
        engine.step()
        slots = engine.executor.state.slots
        probs = None if slots.draft_probs is None else np.asarray(slots.draft_probs)
        # The drafts the next step verifies, from where that step reads them: a prompt's last
        # chunk drafts too (chain drafters), and no host-side record of those exists.
        runs, num_drafts = np.asarray(slots.run), np.asarray(slots.num_drafts)
        for i, r in enumerate(requests):
            emitted = len(r.output_ids) - before[i][0]
            if emitted:
                d = r.stats.num_draft_tokens - before[i][1]
                drafts, q = pending.pop(i, ([], None))
                if r.output_ids[before[i][0]:before[i][0] + emitted - 1] != drafts[:emitted - 1]:
                    raise AssertionError("emitted tokens before the last are not the drafts")
                for k in range(1, emitted + 1):
                    cols["seq"].append(i)
                    cols["pos"].append(len(r.prompt_ids) + before[i][0] + k - 1)
                    kind = 0 if d == 0 else (1 if k <= d else 2)
                    cols["kind"].append(kind)
                    cols["depth"].append(k)
                    cols["full_chain"].append(kind == 2 and d == D)
                    cols["draft"].append(drafts[k - 1] if kind == 1 else -1)
                    qs.append(q[k - 1] if kind == 1 else None)
            if r.finish_reason is None and r.slot is not None and num_drafts[r.slot]:
                n_drafts = int(num_drafts[r.slot])
                pending[i] = (runs[r.slot, 1:1 + n_drafts].tolist(),
                              probs[r.slot, :n_drafts].copy() if probs is not None else None)
    if engine.stats.num_preemptions != preemptions:
        raise AssertionError("a request was preempted: size the KV pool for the whole batch")
    if any(len(r.output_ids) != max_tokens for r in requests):
        raise AssertionError("a sequence finished early")
    return Decided(**{k: np.asarray(v) for k, v in cols.items()}, q=qs,
                   sequences=[r.prompt_ids + r.output_ids for r in requests])


def target_probs(llm: LLM, sequences: list[list[int]], temperature: float,
                 batch: int = 32) -> np.ndarray:
    """The target's exact next-token distributions `[N, L, V]` float64 (row t: p(. | seq[:t+1]))
    from a dense forward of the model over whole sequences."""
    out = []
    for i in range(0, len(sequences), batch):
        logits = np.asarray(llm.model(jnp.asarray(sequences[i:i + batch], jnp.int32)), np.float64)
        x = logits / temperature
        x -= x.max(-1, keepdims=True)
        e = np.exp(x)
        out.append(e / e.sum(-1, keepdims=True))
    return np.concatenate(out)


def categorise(p: np.ndarray, q: np.ndarray, tokens: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """p `[n, V]`, q `[n, V]` (zeros where there is no draft distribution), tokens `[n]` ->
    (P `[n, C]` = p's mass per category, each token's category `[n]`).
    Categories: rank bin under p x (p > q)."""
    n, V = p.shape
    order = np.argsort(-p, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(V)[None], axis=1)
    cat = np.searchsorted(np.asarray(RANK_EDGES), rank, side="right") * 2 + (p > q)
    C = 2 * (len(RANK_EDGES) + 1)
    P = np.zeros((n, C))
    np.add.at(P, (np.arange(n)[:, None], cat), p)
    return P, cat[np.arange(n), tokens]


def chi_square_exact(P: np.ndarray, observed: np.ndarray) -> tuple[float, int, float]:
    """P `[n, C]` (each observation's category probabilities), observed `[n]` categories ->
    (statistic, degrees of freedom, critical value at alpha 1e-5); see the module docstring."""
    n, C = P.shape
    E = P.sum(0)
    keep = [c for c in np.argsort(-E) if E[c] >= 5]
    rest = [c for c in range(C) if c not in keep]
    if rest and P[:, rest].sum() < 5 and keep:  # too small alone: fold into the smallest kept
        rest.append(keep.pop())
    groups = [[c] for c in keep] + ([rest] if rest else [])
    M = np.stack([P[:, g].sum(1) for g in groups], 1)                     # [n, G]
    onehot = np.zeros((n, C))
    onehot[np.arange(n), observed] = 1
    O = np.stack([onehot[:, g].sum(1) for g in groups], 1).sum(0)
    E = M.sum(0)
    if len(groups) < 2:
        return 0.0, 0, float("inf")
    d = (O - E)[:-1]
    S = np.diag(E[:-1]) - M[:, :-1].T @ M[:, :-1]
    # S is singular when some combination of the counts cannot vary (e.g. every observation
    # certain of one category): exactness makes that combination of O - E zero, so any other
    # value is an infinite statistic; the rest is chi-square with rank(S) degrees of freedom.
    w, U = np.linalg.eigh(S)
    varies = w > 1e-9 * max(w.max(), 1.0)
    z = U.T @ d
    if np.any(np.abs(z[~varies]) > 1e-6):
        stat = float("inf")
    else:
        stat = float(np.sum(z[varies] ** 2 / w[varies]))
    df = int(varies.sum())
    if df == 0:
        return stat if stat == float("inf") else 0.0, 0, float("inf")
    return stat, df, critical_value(df)


@dataclasses.dataclass
class GroupResult:
    name: str
    count: int
    stat: float
    df: int
    critical: float

    @property
    def differs(self) -> bool:
        return self.stat > self.critical


def depth_groups(tags: Decided, D: int) -> dict[str, np.ndarray]:
    """Index sets: tokens decided by a step without drafts, at draft depth k, and bonus tokens
    (after a full chain of D, and after a shorter one)."""
    groups = {"plain": np.flatnonzero(tags.kind == 0)}
    for k in range(1, D + 1):
        groups[f"depth {k}"] = np.flatnonzero((tags.kind == 1) & (tags.depth == k))
    groups["bonus (full chain)"] = np.flatnonzero((tags.kind == 2) & tags.full_chain)
    groups["bonus (short chain)"] = np.flatnonzero((tags.kind == 2) & ~tags.full_chain)
    return groups


def judge_groups(tags: Decided, p: np.ndarray, D: int, drafted: bool = False
                ) -> list[GroupResult]:
    """The statistic for every group. `drafted`: judge the draft tokens (drawn from q) instead
    of the emitted ones, at draft depths only -- the power check, which must fail."""
    results = []
    for name, idx in depth_groups(tags, D).items():
        if drafted and not name.startswith("depth"):
            continue
        if len(idx) == 0:
            results.append(GroupResult(name, 0, 0.0, 0, float("inf")))
            continue
        seqs, pos = tags.seq[idx], tags.pos[idx]
        V = p.shape[-1]
        q = np.stack([np.zeros(V) if tags.q[j] is None else tags.q[j] for j in idx])
        tokens = (tags.draft[idx] if drafted
                  else np.asarray([tags.sequences[s][t] for s, t in zip(seqs, pos)]))
        P, obs = categorise(p[seqs, pos - 1], q, tokens)
        stat, df, crit = chi_square_exact(P, obs)
        results.append(GroupResult(name, len(idx), stat, df, crit))
    return results


def acceptance_rate(llm: LLM, requests: int, max_tokens: int, temperature: float = 1.0) -> float:
    before = (llm.stats.accepted_draft_tokens, llm.stats.drafted_tokens)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
              for i in range(requests)]
    llm.generate([PROMPT] * requests, params)
    return ((llm.stats.accepted_draft_tokens - before[0])
            / max(llm.stats.drafted_tokens - before[1], 1))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=512, help="sequences per drafter")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens sampled per sequence (EOS ignored)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="the sampling temperature of every sequence")
    parser.add_argument("--max-draft-len", type=int, default=3,
                        help="D, the most drafts per step (MTP: at most its number of modules)")


def run(args: argparse.Namespace) -> None:
    D0 = args.max_draft_len
    print(f"{args.samples} sequences x {args.max_tokens} tokens per drafter, temperature "
          f"{args.temperature}, D={D0}; generalized chi-square against the target's exact "
          f"distribution per depth (alpha = 1e-5)")
    for name, spec in in_step_configs(D0).items():
        llm = make_llm(spec)
        D = spec.max_draft_len
        tags = sample_and_tag(llm, D, args.samples, args.max_tokens, args.temperature, 0)
        p = target_probs(llm, tags.sequences, args.temperature)
        print(f"\n{name} D={D}: acceptance {llm.stats.acceptance_rate:.1%}, "
              f"AL {llm.stats.acceptance_length:.2f}")
        print(f"{'tokens decided by':>22} {'n':>6} {'stat':>8} {'df':>4} {'critical':>9} "
              f"{'differs':>8}")
        for r in judge_groups(tags, p, D):
            print(f"{r.name:>22} {r.count:>6} {r.stat:>8.1f} {r.df:>4} {r.critical:>9.1f} "
                  f"{str(r.differs):>8}")
        for r in judge_groups(tags, p, D, drafted=True):
            print(f"{'drafts, ' + r.name:>22} {r.count:>6} {r.stat:>8.1f} {r.df:>4} "
                  f"{r.critical:>9.1f} {str(r.differs):>8}")
        strict = acceptance_rate(make_llm(dataclasses.replace(spec, use_rejection_sampling=False)), 16, 32)
        rejection = acceptance_rate(llm, 16, 32)
        print(f"acceptance at temperature 1 (16 requests x 32 tokens): rejection sampling "
              f"{rejection:.1%}, strict matching {strict:.1%}")


# ---- draft trees: recursive rejection sampling over siblings drawn without replacement ----

@dataclasses.dataclass
class TreeDecided:
    """Generated tokens of sampled tree steps, one entry per (token, sibling reached): the
    token at depth k of its step was decided after its node's siblings 1..i-1 were rejected.
    Under exactness it follows p_i, the residual the rejections leave (`residuals`)."""

    seq: np.ndarray         # [n] which sequence
    pos: np.ndarray         # [n] index of the token in prompt + output
    depth: np.ndarray       # [n] k: the token's depth in its step's emission (1-based)
    sibling: np.ndarray     # [n] i: the sibling the decision reached (1-based; a node with
                            # i - 1 children: the correction or bonus after all of them)
    rejected: list          # [n] the tokens of siblings 1..i-1
    q: list                 # [n] the distribution the node's children were drawn from, or None
    draft: np.ndarray       # [n] sibling i's token (-1 past the node's last child)
    sequences: list[list[int]]


def tree_path(tokens: list[int], parents: list[int], emitted: list[int], max_depth: int
              ) -> list[list[int]]:
    """One tree step: the run's tokens `[1+T]` (root first), parents `[T]`, the tokens the
    step emitted -> for each emitted token, the rows of its node's children in the order they
    were drawn (children deeper than `max_depth` are not part of the tree). Every emitted
    token but the last is one of them: the child accepted."""
    par = [-1] + list(parents)
    depth = [0] * len(par)
    for r in range(1, len(par)):
        depth[r] = depth[par[r]] + 1 if 0 <= par[r] < r else max_depth + 1
    node, out = 0, []
    for k, token in enumerate(emitted):
        kids = [r for r in range(1, len(par)) if par[r] == node and depth[r] <= max_depth]
        out.append(kids)
        if k == len(emitted) - 1:
            break
        node = next((r for r in kids if tokens[r] == token), None)
        if node is None:
            raise AssertionError(f"emitted token {k} ({token}) is no child of its node")
    return out


def residuals(p: np.ndarray, q: np.ndarray | None, rejected: list[int]) -> np.ndarray:
    """p after rejecting `rejected` (in order) with children drawn without replacement from
    q: p <- normalise(max(0, p - q)), q <- q without the rejected token, renormalised (float64;
    p itself when a residual has no mass)."""
    p = np.asarray(p, np.float64)
    if q is None:
        return p
    q = np.asarray(q, np.float64).copy()
    for token in rejected:
        r = np.maximum(p - q / q.sum(), 0.0)
        p = r / r.sum() if r.sum() > 0 else p
        q[token] = 0.0
    return p


class TreeTagger:
    """Collects `TreeDecided` entries step by step."""

    def __init__(self):
        self.cols = {k: [] for k in ("seq", "pos", "depth", "sibling", "draft")}
        self.rejected, self.q = [], []

    def add(self, seq: int, first_pos: int, tokens: list[int], parents: list[int],
            q: np.ndarray | None, emitted: list[int], max_depth: int) -> None:
        """One step of sequence `seq`: the tree it verified (run tokens `[1+T]`, parents, the
        nodes' distributions `[T, V]`; no drafts: `[root]`, [], None), the tokens it emitted
        from position `first_pos` on, the deepest node that could be accepted."""
        for k, (token, kids) in enumerate(zip(emitted, tree_path(tokens, parents, emitted,
                                                                  max_depth))):
            # Children drawn after the support ran out (q = 0) are skipped, not rejected.
            drawn = [tokens[c] for c in kids if q is not None and q[c - 1][tokens[c]] > 0]
            stop = drawn.index(token) + 1 if k < len(emitted) - 1 else len(drawn) + 1
            for i in range(1, stop + 1):
                for key, value in (("seq", seq), ("pos", first_pos + k), ("depth", k + 1),
                                   ("sibling", i),
                                   ("draft", drawn[i - 1] if i <= len(drawn) else -1)):
                    self.cols[key].append(value)
                self.rejected.append(drawn[:i - 1])
                self.q.append(q[kids[0] - 1] if kids and q is not None else None)

    def done(self, sequences: list[list[int]]) -> TreeDecided:
        return TreeDecided(**{k: np.asarray(v) for k, v in self.cols.items()},
                           rejected=self.rejected, q=self.q, sequences=sequences)


def sample_and_tag_tree(llm: LLM, n: int, max_tokens: int, temperature: float,
                        seed_offset: int, prompt: str | list[int] = PROMPT) -> TreeDecided:
    """Sample `n` sequences from an engine drafting trees at full depth, step by step, and tag
    every generated token with the siblings its decision reached (`TreeDecided`)."""
    engine = llm.engine
    requests = _add_seeded(llm, n, max_tokens, temperature, seed_offset, prompt)
    D = engine.speculation.worker.tree.max_depth
    pending = {}  # request index -> (run tokens, parents, q `[T, V]`) its next step verifies
    tagger = TreeTagger()
    preemptions = engine.stats.num_preemptions
    while engine.has_unfinished():
        before = [len(r.output_ids) for r in requests]
        engine.step()
        slots = engine.executor.state.slots
        runs, num, parents = (np.asarray(slots.run), np.asarray(slots.num_drafts),
                              np.asarray(slots.tree_parents))
        probs = np.asarray(slots.draft_probs)
        for i, r in enumerate(requests):
            emitted = r.output_ids[before[i]:]
            if emitted:
                tokens, par, q = pending.pop(i, ([0], [], None))
                tagger.add(i, len(r.prompt_ids) + before[i], tokens, par, q, emitted,
                           min(D, max_tokens - before[i] - 1))
            if r.finish_reason is None and r.slot is not None and num[r.slot]:
                T = int(num[r.slot])
                pending[i] = (runs[r.slot, :1 + T].tolist(), parents[r.slot, :T].tolist(),
                              probs[r.slot, :T].copy())
    if engine.stats.num_preemptions != preemptions:
        raise AssertionError("a request was preempted: size the KV pool for the whole batch")
    if any(len(r.output_ids) != max_tokens for r in requests):
        raise AssertionError("a sequence finished early")
    return tagger.done([r.prompt_ids + r.output_ids for r in requests])


def tree_groups(tags: TreeDecided) -> dict[str, np.ndarray]:
    """Index sets per (depth k, sibling reached i)."""
    keys = sorted(set(zip(tags.depth.tolist(), tags.sibling.tolist())))
    return {f"depth {k}, sibling {i}": np.flatnonzero((tags.depth == k) & (tags.sibling == i))
            for k, i in keys}


def judge_tree_groups(tags: TreeDecided, p: np.ndarray, drafted: bool = False,
                      min_count: int = 1) -> list[GroupResult]:
    """The statistic per (depth, sibling) group with at least `min_count` tokens: each token
    against its residual p_i, categories rank under p_i x (p_i > q_i). `drafted`: judge
    sibling i's own token instead (drawn from q_i, not p_i) -- the power check, which must
    fail."""
    results = []
    V = p.shape[-1]
    for name, idx in tree_groups(tags).items():
        if drafted:
            idx = idx[tags.draft[idx] >= 0]
        if len(idx) < min_count:
            continue
        P_rows, Q_rows, tokens = [], [], []
        for j in idx:
            s, t = tags.seq[j], tags.pos[j]
            q = tags.q[j]
            P_rows.append(residuals(p[s, t - 1], q, tags.rejected[j]))
            if q is None:
                Q_rows.append(np.zeros(V))
            else:
                q_left = np.asarray(q, np.float64).copy()
                q_left[tags.rejected[j]] = 0.0
                Q_rows.append(q_left / max(q_left.sum(), 1e-300))
            tokens.append(tags.draft[j] if drafted else tags.sequences[s][t])
        P, obs = categorise(np.stack(P_rows), np.stack(Q_rows), np.asarray(tokens))
        stat, df, crit = chi_square_exact(P, obs)
        results.append(GroupResult(name, len(idx), stat, df, crit))
    return results
