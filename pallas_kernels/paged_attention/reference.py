"""Plain-jnp attention: the oracle every paged-attention kernel is checked against, and the
dense attention the models' reference forwards use (one home for the masked-softmax math).

`paged_attention_reference` also takes an optional draft-tree mask (`tree_mask`, one int32
bitmask of visible run slots per query row) for verifying a dynamic draft tree in one step;
see its docstring for the contract.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_gather.reference import gather_kv_pages_reference

NO_WINDOW = 2**30  # stands for "no sliding window" in a traced per-layer window array
TREE_MAX_NODES = 32  # run slots a tree_mask can address (bits of an int32)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                    k_positions: jax.Array, window: jax.Array | int = NO_WINDOW,
                    k_valid: jax.Array | None = None,
                    mask: jax.Array | None = None, with_lse: bool = False):
    """Grouped-query attention with a causal (and optional sliding-window) mask on positions.

    q `[B, T, H, hd]`, k/v `[B, S, KV, hd]`, q_positions `[B, T]`, k_positions `[B, S]`,
    k_valid `[B, S]` bool (optional) -> `[B, T, H, hd]`. Softmax runs in float32.
    `mask` `[B, T, S]` bool (optional) replaces the positional causal/window test (query t
    sees key s iff `mask[b, t, s]`); `k_valid` still applies on top. Rows that see no key
    give zeros. `with_lse`: also return each row's log-sum-exp of its scores `[B, T, H]`
    float32 (-inf where it sees no key), so attention over two sets of keys can be computed
    apart and merged (`merge_attention`).
    """
    B, T, H, hd = q.shape
    KV = k.shape[2]
    # Heads-major operands make both products plain batched matmuls [B, KV] x [T*G, S]: on
    # XLA:CPU markedly faster than a five-index einsum, and the same on GPU.
    qh = _query_rows(q, KV)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, S, hd]
    scores = jnp.matmul(qh, kh.swapaxes(-1, -2)).astype(jnp.float32) * (hd ** -0.5)
    visible = _row_visibility(q_positions, k_positions, window, k_valid, mask, H // KV)
    probs, lse = masked_softmax(scores, visible)
    out = jnp.matmul(probs.astype(v.dtype), vh)  # [B, KV, T*G, hd]
    out, lse = _head_outputs(out, lse, T)
    return (out, lse) if with_lse else out


def _query_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q `[B, T, H, hd]` -> `[B, KV, T*G, hd]`: each KV head's queries, row t*G + g (G query
    heads share a KV head)."""
    B, T, H, hd = q.shape
    G = H // num_kv_heads
    return q.reshape(B, T, num_kv_heads, G, hd).transpose(0, 2, 1, 3, 4).reshape(
        B, num_kv_heads, T * G, hd)


def _head_outputs(out: jax.Array, lse: jax.Array, T: int) -> tuple[jax.Array, jax.Array]:
    """`_query_rows`' order back: out `[B, KV, T*G, hd]`, lse `[B, KV, T*G, 1]` ->
    (`[B, T, H, hd]`, `[B, T, H]`)."""
    B, KV, rows, hd = out.shape
    G = rows // T
    out = out.reshape(B, KV, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, KV * G, hd)
    return out, lse.reshape(B, KV, T, G).transpose(0, 2, 1, 3).reshape(B, T, KV * G)


def _row_visibility(q_positions: jax.Array, k_positions: jax.Array, window: jax.Array | int,
                    k_valid: jax.Array | None, mask: jax.Array | None, G: int) -> jax.Array:
    """`[B, 1, T*G, S]` bool, rows as `_query_rows`: which keys each query row sees (see
    `dense_attention`). k_positions `[B, S]` or `[S]`."""
    if mask is None:
        distance = jnp.repeat(q_positions, G, axis=1)[:, :, None] - k_positions[..., None, :]
        mask = (distance >= 0) & (distance < window)  # [B, T*G, S], t-major like qh
    else:
        mask = jnp.repeat(mask, G, axis=1)  # [B, T*G, S], t-major like qh
    if k_valid is not None:
        mask = mask & k_valid[:, None, :]
    return mask[:, None]


def masked_softmax(scores: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scores `[B, KV, T*G, S]` float32 over the keys `visible` (`_row_visibility`) ->
    (probabilities, lse `[B, KV, T*G, 1]`: -inf where a row sees no key)."""
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    probs = jnp.where(visible, jnp.exp(scores - top), 0.0)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    # Rows with no visible key get zeros, not NaN.
    probs = probs / jnp.maximum(total, 1e-30)
    lse = jnp.where(total > 0, top + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)
    return probs, lse


def merge_attention(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
                    ) -> tuple[jax.Array, jax.Array]:
    """Attention over the union of two disjoint key sets from each set's (out `[B, T, H, hd]`,
    lse `[B, T, H]`) (`dense_attention(..., with_lse=True)`): each part weighted by its share
    of the softmax mass -> (out, lse) of the union. Rows that see no key in either give
    zeros."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    wa, wb = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = wa + wb
    safe = jnp.maximum(total, 1e-30)
    out = (out_a.astype(jnp.float32) * (wa / safe)[..., None]
           + out_b.astype(jnp.float32) * (wb / safe)[..., None])
    lse = jnp.where(total > 0, top + jnp.log(safe), -jnp.inf)
    return out.astype(out_a.dtype), lse


def tree_visibility(q_positions: jax.Array, k_slots: jax.Array, window: jax.Array | int,
                    tree_mask: jax.Array) -> jax.Array:
    """`[B, T, S]` bool: which slots each query row of a draft-tree run may see, before the
    context-length test (see `paged_attention_reference`). k_slots `[B, S]` or `[S]`; the
    slot of page m's offset s is m * tokens_per_block + s."""
    k_slots = jnp.broadcast_to(k_slots, (q_positions.shape[0], k_slots.shape[-1]))
    run_start = q_positions[:, :1]                                   # [B, 1]: the root
    j = (k_slots - run_start)[:, None, :]                            # [B, 1, S]
    bit = (tree_mask.astype(jnp.int32)[:, :, None] >> jnp.clip(j, 0, TREE_MAX_NODES - 1)) & 1
    in_tree = (bit == 1) & (j < TREE_MAX_NODES)
    distance = q_positions[:, :, None] - k_slots[:, None, :]
    in_context = (distance >= 0) & (distance < window)
    return jnp.where(j >= 0, in_tree, in_context)


def page_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                   k_slots: jax.Array, context_lens: jax.Array, window: jax.Array | int,
                   tree_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """q `[B, T, H, hd]` over gathered pages k/v `[B, KV, M, bs, hd]`
    (`gather_kv_pages_reference`) whose keys sit at slots `k_slots` `[M * bs]` (slot =
    position), those below `context_lens` `[B]` written -> (out `[B, T, H, hd]` in v's dtype,
    lse `[B, T, H]`). Masks as `paged_attention_reference`."""
    B, T, H, hd = q.shape
    _, KV, M, bs, _ = k.shape
    dt = jnp.result_type(q, k)
    # Pages times queries, the pages the product's lhs as gathered: XLA:CPU reads them in
    # place. Flattened to keys `[B, KV, M*bs, hd]`, XLA turns the product around (queries
    # times keys) and repacks every key as its rhs: about twice the time.
    scores = jax.lax.dot_general(k.astype(dt), _query_rows(q, KV).astype(dt),
                                 (((4,), (3,)), ((0, 1), (0, 1))))   # [B, KV, M, bs, T*G]
    scores = scores.transpose(0, 1, 4, 2, 3).reshape(B, KV, -1, M * bs)
    scores = scores.astype(jnp.float32) * (hd ** -0.5)
    mask = None if tree_mask is None else tree_visibility(q_positions, k_slots, window,
                                                          tree_mask)
    visible = _row_visibility(q_positions, k_slots, window,
                             k_slots < context_lens[:, None], mask, H // KV)
    probs, lse = masked_softmax(scores, visible)
    out = jax.lax.dot_general(probs.astype(v.dtype).reshape(B, KV, -1, M, bs), v,
                              (((3, 4), (2, 3)), ((0, 1), (0, 1))))  # [B, KV, T*G, hd]
    return _head_outputs(out, lse, T)


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                              layer: jax.Array | int, block_tables: jax.Array,
                              q_positions: jax.Array, context_lens: jax.Array,
                              window: jax.Array | int = NO_WINDOW,
                              tree_mask: jax.Array | None = None, *,
                              chunk_blocks: int | None = None,
                              interpret: bool | None = None) -> jax.Array:
    """Attention of a run of query tokens per request over that request's cached positions.

    q `[B, T, H, hd]`; k_pool/v_pool `[L, num_blocks, KV, tokens_per_block, hd]`, read at
    `layer` (indexing pool and blocks together gathers only the request's pages);
    block_tables `[B, M]` (padded with the null block 0); q_positions `[B, T]`;
    context_lens `[B]` = positions held in the pool for the request (the run's own K/V
    already written). Causal on positions, so a run attends to itself causally and to
    everything before it; `window`: a key at position s is seen by a query at position p only
    if `p - s < window`. Returns `[B, T, H, hd]`; rows with context_len 0 give zeros.

    `tree_mask` `[B, T]` int32 (optional): the run is a draft tree, not a chain. Row 0 is the
    root (the request's newest token), rows 1.. its nodes (parents before children); row i's
    K/V sit at slot (linear index in the table) `run_start + i` while its position is
    `run_start + depth_i`, where `run_start[b] = q_positions[b, 0]` (the root has depth 0).
    Query row i of request b sees the key at slot s iff `s < context_lens[b]` and
      - `s < run_start[b]` (the committed context): `0 <= q_positions[b, i] - s < window`;
      - `s >= run_start[b]` (the run): bit `s - run_start[b]` of `tree_mask[b, i]` is set
        (the row's ancestors and itself); slots `run_start + 32` and on are never seen.
    Run keys get no window test: windows are assumed wider than the tree. Padding rows give
    `tree_mask` 0 (they see only context). `tree_mask=None` is the plain causal run above.
    `chunk_blocks`: read the table `chunk_blocks` blocks at a time, only as many chunks as
    the longest context needs (a loop with a dynamic trip count, partial softmaxes merged):
    the cost follows the batch's context, not the table's width, in one compiled body. None:
    the whole table at once (the oracle).
    `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    M = block_tables.shape[1]
    if chunk_blocks is not None and chunk_blocks < M:
        return paged_attention_chunks(q, k_pool, v_pool, layer, block_tables, q_positions,
                                      context_lens, window, tree_mask, chunk_blocks)[0]
    k = gather_kv_pages_reference(k_pool, layer, block_tables)
    v = gather_kv_pages_reference(v_pool, layer, block_tables)
    slots = jnp.arange(M * k_pool.shape[3])
    return page_attention(q, k, v, q_positions, slots, context_lens, window, tree_mask)[0]


def paged_attention_chunks(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           layer: jax.Array | int, block_tables: jax.Array,
                           q_positions: jax.Array, context_lens: jax.Array,
                           window: jax.Array | int = NO_WINDOW,
                           tree_mask: jax.Array | None = None, chunk_blocks: int = 8
                           ) -> tuple[jax.Array, jax.Array]:
    """`paged_attention_reference` over `chunk_blocks` blocks of the table at a time ->
    (out `[B, T, H, hd]` float32, lse `[B, T, H]`: for `merge_attention` with keys that are
    not in the pool). Each row reads from the chunk holding the first key its window lets
    its earliest query see, up to its context: a sliding-window layer reads about its
    window, whatever the context; the loop runs as many chunks as the widest row needs."""
    B, M = block_tables.shape
    chunks = -(-M // chunk_blocks)
    tables = jnp.pad(block_tables, ((0, 0), (0, chunks * chunk_blocks - M)))  # null block
    S = chunk_blocks * k_pool.shape[3]
    slots = jnp.arange(S)
    live = context_lens > 0
    # The earliest key any query of the row may see: its first query's window start (a
    # tree's run keys sit at slots past its root, inside that).
    first_key = jnp.maximum(jnp.min(q_positions, axis=1) - window + 1, 0)
    first = jnp.where(live, jnp.minimum(first_key // S, chunks), 0)           # [B]
    last = jnp.where(live, jnp.minimum((context_lens + S - 1) // S, chunks), 0)
    rows = jnp.arange(B)[:, None]

    def chunk(i, acc):
        at = jnp.minimum(first + i, chunks - 1)                                # [B]
        t = tables[rows, at[:, None] * chunk_blocks + jnp.arange(chunk_blocks)]
        k = gather_kv_pages_reference(k_pool, layer, t)
        v = gather_kv_pages_reference(v_pool, layer, t)
        # A row past its last chunk reads a chunk again with nothing visible in it.
        lens = jnp.where(first + i < last, context_lens, 0)
        out, lse = page_attention(q, k, v, q_positions, at[:, None] * S + slots, lens,
                                  window, tree_mask)
        return merge_attention(acc, (out.astype(jnp.float32), lse))

    needed = jnp.max(last - first)
    # Made from q, so that under shard_map the carry varies over the mesh as the body's does.
    zero = q.astype(jnp.float32) * 0
    empty = (zero, zero[..., 0] - jnp.inf)
    return jax.lax.fori_loop(0, needed, chunk, empty)
