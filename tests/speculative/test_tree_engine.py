"""EAGLE-3 dynamic trees inside the engine: greedy output equal to plain decoding, a tree
equal to the head run densely, a hand-built head whose accepted path, emitted tokens and
relocated K/V are known, sampled output equal to plain sampling and following the target
distribution, config errors.

Two heads: the hand-built `perm_models.eagle_head` (a real EAGLE-3 head), and table heads --
a worker whose node distributions come from a table indexed by the node's token, so every
top-K list, and with it the tree, is known in advance.
"""
import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import SamplingParams
from specjax.bench.sampling import chi_square_exact
from specjax.engine.compile_counter import count_compilations
from specjax.models.dense_greedy import dense_greedy
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.llama import dense_attention
from specjax.speculative import workers
from specjax.speculative.config import EagleConfig, MTPConfig, SpeculativeConfig
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.tree import grow_tree
from tests.spec_checks import assert_mixed_acceptance, join_mid_run, spec_llm
from tests.speculative import perm_models
from tests.speculative.perm_models import CFG, LAYERS, MAX_TOKENS, PROMPTS

V = CFG.vocab_size
EAGLE3 = SpeculativeDecodingMode.EAGLE3_ONE_MODEL


def tree_config(head, K=2, D=3, T=6, **kw):
    return EagleConfig(max_draft_len=D, use_dynamic_tree=True, dynamic_tree_max_topK=K,
                       max_total_draft_tokens=T, speculative_model=head, **kw)



def _full_pool(llm):
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def table_worker(table: np.ndarray):
    """An EAGLE-3 worker whose node distributions are `table[token]` (log-probs `[V, V]`): the
    head still runs (its K/V, its catch-up), but every top-K list is the table's."""
    log_table = np.asarray(table, np.float32)

    class TableWorker(workers.Eagle3Worker):
        def _node_log_probs(self, head, target, hidden_out, tokens):
            return jnp.asarray(log_table)[tokens]

        def _to_target(self, head, ids):  # the table is over the target's vocabulary
            return ids

        def _to_target_vocab(self, head, probs):
            return probs

    return TableWorker


def use_table(mp: pytest.MonkeyPatch, table: np.ndarray) -> None:
    """Register, until `mp` undoes it, an EAGLE-3 worker that reads `table`: the registered
    one's, as a `table_worker`."""
    made, cls = workers.WORKERS[EAGLE3], table_worker(table)
    mp.setitem(workers.WORKERS, EAGLE3, lambda *args: cls(**vars(made(*args))))


@pytest.fixture
def table_head(monkeypatch):
    """Use as `table_head(table)` before building an LLM: its EAGLE-3 worker reads `table`."""
    return lambda table: use_table(monkeypatch, table)


def perm_table(perm, decoy_seed=0):
    """Each token's best guess is perm[token] (what the target mostly does), then two decoys:
    trees hold the target's path often, and its alternatives."""
    rng = np.random.default_rng(decoy_seed)
    table = np.full((V, V), 0.02 / V)
    for t in range(V):
        decoys = rng.choice([u for u in range(V) if u != perm[t]], 2, replace=False)
        table[t, perm[t]], table[t, decoys[0]], table[t, decoys[1]] = 0.8, 0.12, 0.06
    return np.log(table / table.sum(1, keepdims=True))


@pytest.fixture(scope="module")
def tree_llm(perm_target):
    """One warmed-up engine for most tests (compiling is most of their cost): the perm target,
    a table head that mostly knows the permutation, K = 3, depth 4, 10 nodes, 4 slots."""
    target, perm = perm_target
    with pytest.MonkeyPatch.context() as mp:
        use_table(mp, perm_table(perm))
        # Every step at full depth (warm-up turns the cost model on, which picks its own:
        # tests/speculative/test_verify_lengths.py): these tests check what a tree does.
        config = dataclasses.replace(
            tree_config(perm_models.eagle_head(target, perm), K=3, D=4, T=10),
            draft_len_schedule={1: 4})
        llm = spec_llm(target, config, warmup=True)
    yield llm
    assert _full_pool(llm)


@pytest.fixture(scope="module")
def strict_tree_llm(perm_target):
    """`tree_llm`'s engine with use_rejection_sampling=False (compiled on first use)."""
    target, perm = perm_target
    with pytest.MonkeyPatch.context() as mp:
        use_table(mp, perm_table(perm))
        config = dataclasses.replace(
            tree_config(perm_models.eagle_head(target, perm), K=3, D=4, T=10,
                        use_rejection_sampling=False), draft_len_schedule={1: 4})
        llm = spec_llm(target, config)
    yield llm
    assert _full_pool(llm)


# ---- greedy: token for token plain decoding --------------------------------------------

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_tree_equals_plain_decoding(tree_llm, refs, batch, overlap):
    """Batches of 1 and 4, with and without the overlap scheduler, nothing compiled after the
    warm-up; drafts accepted to depth 4 and rejected."""
    tree_llm.engine.overlap = overlap
    tree_llm.reset_stats()
    with count_compilations() as compiled:
        outs = [out for i in range(0, len(PROMPTS), batch)
                for out in tree_llm.generate(PROMPTS[i:i + batch],
                                             SamplingParams(max_tokens=MAX_TOKENS))]
        assert compiled() == 0  # warm-up compiled every shape serving uses
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == refs[tuple(prompt)], prompt
    assert_mixed_acceptance(tree_llm.stats, 4)
    assert tree_llm.stats.accepted_histogram[4] > 0  # whole paths down to depth 4
    assert _full_pool(tree_llm)


MTP_EAGLE_TREE = lambda: MTPConfig(max_draft_len=3, num_nextn_predict_layers=1,
                                   use_dynamic_tree=True, dynamic_tree_max_topK=2,
                                   max_total_draft_tokens=6,
                                   speculative_model=perm_models.mtp_heads(1))


def test_greedy_tree_with_requests_joining_mid_run(tree_llm, refs):
    tree_llm.engine.overlap = True
    tree_llm.reset_stats()
    join_mid_run(tree_llm, PROMPTS, refs, MAX_TOKENS)
    assert_mixed_acceptance(tree_llm.stats, 4)


def test_mtp_eagle_tree_reuses_its_module_at_every_depth(perm_target, refs):
    """MTP-Eagle's one hand-built module (it predicts perm(token)) drafts the tree."""
    target, _ = perm_target
    llm = spec_llm(target, MTP_EAGLE_TREE())
    join_mid_run(llm, PROMPTS, refs, MAX_TOKENS)
    assert_mixed_acceptance(llm.stats, 3)


def test_greedy_tree_on_a_random_tiny_model():
    """A random target and a random head, batch 4, the schedule moving the depth as requests
    finish: 0 (plain decoding through the tree step) while 4 run, 2 for 2-3, 3 for the last."""
    cfg = CFG.replace(num_layers=3)
    target = specjax.models.Llama(cfg, rngs=nnx.Rngs(3))
    head = Eagle3Head(Eagle3HeadConfig.for_target(cfg), nnx.Rngs(4))
    head.lm_head.value = head.lm_head[...] * 40  # peaked: the best nodes lie deep
    spec = tree_config(head, K=4, D=3, T=9, draft_len_schedule={1: 3, 2: 2, 4: 0},
                       eagle3_layers_to_capture=(0, 1, 2))
    llm = spec_llm(target, spec)
    prompts = [[5, 9, 2], [11] * 7, [60, 1], [3, 3, 8, 40, 22]]
    lengths = [6, 10, 14, 30]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == dense_greedy(target, prompt, n), prompt
    verified = llm.stats.verified_histogram
    assert len(verified) == 4 and verified[2] > 0 and verified[3] > 0, verified
    assert sum(o.stats.num_steps_with_drafts for o in outs) < sum(
        o.stats.decoding_iterations for o in outs) - len(outs)  # some steps had depth 0
    assert _full_pool(llm)


# ---- the tree itself --------------------------------------------------------------------

def test_tree_equals_the_head_run_densely(perm_target):
    """After a prompt and one generation step, the tree in slot state is the head run densely
    over the sequence: each expanded node one row attending to the context, its ancestors'
    rows and itself (by position), its distribution from that row's hidden_out."""
    target, perm = perm_target
    head = Eagle3Head(Eagle3HeadConfig.for_target(CFG), nnx.Rngs(5))  # random: no ties
    # Peaked distributions, so that the best nodes lie deep, where ancestors' rows matter.
    head.lm_head.value = head.lm_head[...] * 40
    K, D, T = 3, 3, 8
    llm = spec_llm(target, tree_config(head, K=K, D=D, T=T), overlap_scheduler=False,
                   max_batch_size=1)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=10))
    request = engine.requests[rid]
    while len(request.output_ids) < 2:  # prompt chunks, then one generation step
        engine.step()
    seq = request.all_ids
    n = len(seq) - 1  # rows 0..n-1 are in the KV pools; seq[n] is the newest token
    _, captured = target.forward(jnp.asarray([seq[:n]]), capture_layers=LAYERS)
    positions = jnp.arange(n)[None]
    q, k, v, residual = head.qkv_and_residual(target.embed_tokens(jnp.asarray([seq[1:n + 1]])),
                                              head.fuse(captured), positions)
    h0 = head.finish(dense_attention(q, k, v, positions, positions), residual)[:, -1]
    log_probs = lambda h: jax.nn.log_softmax(head.logits(h))

    def expand(level, tokens, node, shared):  # per frontier node, densely
        hidden, anc_k, anc_v = node            # [1, K, H], [1, K, level-1, KV, hd]
        outs, ks, vs = [], [], []
        for f in range(K):
            pos = jnp.asarray([[n + level - 1]])
            qf, kf, vf, rf = head.qkv_and_residual(target.embed_tokens(tokens[:, f:f + 1]),
                                                   hidden[:, f:f + 1], pos)
            keys = jnp.concatenate([k, anc_k[:, f], kf], 1)
            values = jnp.concatenate([v, anc_v[:, f], vf], 1)
            key_pos = jnp.concatenate([positions, n + jnp.arange(level)[None]], 1)
            outs.append(head.finish(dense_attention(qf, keys, values, pos, key_pos), rf))
            ks.append(kf)
            vs.append(vf)
        h = jnp.concatenate(outs, 1)
        children = (h, jnp.concatenate([anc_k, jnp.stack(ks, 1)], 2),
                    jnp.concatenate([anc_v, jnp.stack(vs, 1)], 2))
        return log_probs(h), children, shared

    empty = jnp.zeros((1, K, 0, CFG.num_kv_heads, CFG.head_dim))
    tokens, parents, _ = grow_tree(log_probs(h0), expand,
                                (jnp.broadcast_to(h0[:, None], (1, K, CFG.hidden_size)), empty,
                                 empty), None, K, D, T, head.to_target_ids)
    slots = engine.executor.state.slots
    assert np.asarray(slots.run[request.slot, 1:1 + T]).tolist() == np.asarray(tokens[0]).tolist()
    assert np.asarray(slots.tree_parents[request.slot, :T]).tolist() == \
        np.asarray(parents[0]).tolist()
    assert max(np.asarray(parents[0])) > K  # nodes below level 1: the ancestor rows mattered
    engine.abort(rid)
    assert _full_pool(llm)


def dense_kv(model, tokens):
    """Each layer's K and V `[len, KV, hd]` for `tokens`, from a dense causal forward."""
    model = model.for_inference(scan_layers=False)  # the list of K/V grows layer by layer
    pos = jnp.arange(len(tokens))[None]
    record = lambda q, k, v, layer, kvs: (dense_attention(q, k, v, pos, pos), kvs + [(k, v)])
    _, _, kvs = model.run_layers(model.embed_tokens(jnp.asarray([tokens])), pos, record, [])
    return np.stack([np.asarray(k[0]) for k, _ in kvs]), np.stack([np.asarray(v[0]) for _, v in kvs])


def test_hand_built_tree_accepts_its_known_path_and_relocates_its_kv(perm_target, table_head):
    """The table puts the target's next two tokens at tree rows 2 and 5 (under a decoy at row
    1) and no right third token: one step must accept exactly two nodes, emit the target's
    three tokens, and leave the pool's K/V rows for the sequence so far equal to a dense
    forward over it -- the path's rows moved from slots 2 and 5 to positions 1 and 2."""
    target, perm = perm_target
    prompt = next(p for p in ([i, i + 1, i + 2] for i in range(1, 60))
                  if len(set(dense_greedy(target, p, 4))) == 4)
    g = dense_greedy(target, prompt, 4)
    x, y, p, q, z, w = [t for t in range(V) if t not in g][:6]
    table = np.full((V, V), 0.1 / V)
    edges = {g[0]: [(x, .5), (g[1], .4)], g[1]: [(g[2], .8), (y, .15)], x: [(p, .5), (q, .45)],
             g[2]: [(z, .5), (w, .45)]}
    for token, children in edges.items():
        for child, prob in children:
            table[token, child] = prob
    table_head(np.log(table))
    # Tree by score: x .5, g1 .4, g2 .32, p .25, q .225, z .16 -> rows in candidate order:
    # 1 x, 2 g1, 3 p, 4 q, 5 g2, 6 z.
    llm = spec_llm(target, tree_config(perm_models.eagle_head(target, perm), K=2, D=3, T=6),
                   overlap_scheduler=False, max_batch_size=1)
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12))
    request = engine.requests[rid]
    engine.step()  # the prompt: g0, and the tree after it
    slots = engine.executor.state.slots
    assert np.asarray(slots.run[request.slot, :7]).tolist() == [g[0], x, g[1], p, q, g[2], z]
    assert np.asarray(slots.tree_parents[request.slot, :6]).tolist() == [0, 0, 1, 1, 2, 5]
    engine.step()  # one generation step
    assert request.output_ids == g[:4]
    assert llm.stats.accepted_histogram == [0, 0, 1]  # one step, two nodes accepted
    start = len(prompt) + 3  # prompt, g0, g1, g2 computed; g3 is the newest token
    assert request.num_computed == start
    pool = engine.executor.state.target
    blocks = engine.allocator.blocks(rid)
    bs = pool.tokens_per_block
    row = lambda kv, i: np.asarray(kv[:, blocks[i // bs], :, i % bs])  # [L, KV, hd]
    got_k = np.stack([row(pool.k, i) for i in range(start)], 1)
    got_v = np.stack([row(pool.v, i) for i in range(start)], 1)
    want_k, want_v = dense_kv(target, prompt + g[:3])
    np.testing.assert_allclose(got_k, want_k, atol=2e-5)
    np.testing.assert_allclose(got_v, want_v, atol=2e-5)
    engine.abort(rid)
    assert _full_pool(llm)


# ---- sampled requests -------------------------------------------------------------------

def test_sampled_tree_output_is_plain_sampling_token_for_token(perm_target, strict_tree_llm):
    """Without rejection sampling, tree verification draws each node's target token with the
    request's key for that position, exactly as plain sampling does, and descends only on a
    match: seeded output is plain sampling's, token for token, while drafts are accepted."""
    tree_llm = strict_tree_llm
    target, _ = perm_target
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, top_k=k, seed=s)
              for s, (t, k) in enumerate([(0.7, 0), (1.0, 0), (0.5, 8), (1.3, 0), (0.9, 20)])]
    plain = specjax.LLM(target, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                        progress=False).generate(PROMPTS, params)
    tree_llm.reset_stats()
    outs = tree_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert tree_llm.stats.accepted_draft_tokens > 20
    assert _full_pool(tree_llm)


@pytest.mark.slow   # 1200 sampled requests (~13 s); sampled trees stay in the default run
# through tests/core/test_tree.py's distribution tests and the token-for-token test above
def test_sampled_tree_tokens_follow_the_target_distribution(perm_target, tree_llm):
    """The second generated token (decided in a tree step: the first comes from the prompt's
    step) over 1200 seeds, each against its exact distribution p(. | prompt, first token)
    computed densely: the bench's chi-square statistic for draws from varying distributions
    (`chi_square_exact`, categories with expected count < 5 merged) must stay under its
    critical value at alpha = 1e-5. With fixed seeds the test is deterministic."""
    target, perm = perm_target
    prompt, N, temperature = [4, 5, 6], 1200, 1.0
    tree_llm.reset_stats()
    outs = tree_llm.generate([prompt] * N, [SamplingParams(max_tokens=3, temperature=temperature,
                                                           seed=s) for s in range(N)])
    assert tree_llm.stats.accepted_draft_tokens > N // 4  # the second token often from a node
    first = np.asarray([o.token_ids[0] for o in outs])
    second = np.asarray([o.token_ids[1] for o in outs])
    logits = target.forward(jnp.asarray([prompt + [t] for t in range(V)]))[0][:, -1]
    p2 = np.asarray(jax.nn.softmax(logits / temperature), np.float64)   # [first, second]
    stat, df, critical = chi_square_exact(p2[first], second)
    assert df >= 3 and stat < critical, (stat, df, critical)
    # The statistic has power: the same tokens judged against the draft table fail.
    q2 = np.exp(perm_table(perm).astype(np.float64))
    q2 /= q2.sum(1, keepdims=True)
    assert chi_square_exact(q2[first], second)[0] > critical
    assert _full_pool(tree_llm)


# ---- configs ----------------------------------------------------------------------------

def test_tree_config_round_trip_and_errors():
    cfg = tree_config(None, K=4, D=4, T=16)
    assert cfg.use_rejection_sampling is True  # as for a chain: sampled rows by rejection
    assert cfg.tree_shape.nodes_for(4) == 16 and cfg.tree_shape.nodes_for(2) == 8
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg
    strict = tree_config(None, use_rejection_sampling=False)
    assert SpeculativeConfig.from_dict(strict.to_dict()).use_rejection_sampling is False
    with pytest.raises(ValueError, match="at most 31 draft tokens"):
        EagleConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=8)
    assert EagleConfig(max_draft_len=4).tree_shape is None
    mtp = MTP_EAGLE_TREE()
    assert mtp.tree_shape.max_nodes == 6 and mtp.use_rejection_sampling is True
    with pytest.raises(ValueError, match="use_dynamic_tree needs MTP-Eagle"):
        MTPConfig(max_draft_len=2, num_nextn_predict_layers=2, use_dynamic_tree=True,
                  dynamic_tree_max_topK=2)


def test_top_k_wider_than_the_draft_vocabulary_is_refused(perm_target):
    target, _ = perm_target
    head = Eagle3Head(Eagle3HeadConfig.for_target(CFG, draft_vocab_size=4), nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"dynamic_tree_max_topK \(5\) exceeds the drafter's "
                                         r"vocabulary \(4 tokens\)"):
        spec_llm(target, tree_config(head, K=5, D=2, T=6))
