"""Pallas paged KV relocation and page gather.

`relocate_kv_kernel` runs two pallas_calls over a (request, move) grid: the first copies every
performed move's source rows (all layers, K and V) into a small staging buffer
`[B, R, L, KV, hd]` (both padded to powers of two), the second writes them to their
destinations in the pools, which are aliased input->output (`input_output_aliases`), so under
jit with donated pools the update is in place. The kernel boundary is what makes "all sources
are read before any destination is written" hold on a GPU, where the programs of one kernel run
concurrently with no ordering. Pools are head-major inside a block, so a token's row of one
(layer, block, slot) is KV runs of hd elements, `tokens_per_block*hd` apart, loaded and stored
as one masked `[KV, hd]` tile.

`gather_kv_pages_kernel` copies each request's pages at one layer: grid (request, kv head,
table entry), `chunk` elements per step of the head's contiguous `tokens_per_block*hd` run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a JAX without the Pallas Triton API: dispatch then runs the references
    plgpu = None

from pallas_kernels.backend import gpu_compiler_params


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _token_tile(KV: int, hd: int) -> tuple[int, int, jax.Array]:
    """A token's `[KV, hd]` row as a power-of-two tile: (rows, lanes, mask of the real ones)."""
    KVp, Hp = _next_pow2(KV), _next_pow2(hd)
    mask = (jnp.arange(KVp)[:, None] < KV) & (jnp.arange(Hp)[None, :] < hd)
    return KVp, Hp, mask


def _stage_kernel(k_ref, v_ref, sb_ref, so_ref, n_ref, kbuf_ref, vbuf_ref, *, L: int, KV: int,
                  hd: int):
    b, r = pl.program_id(0), pl.program_id(1)
    KVp, Hp, mask = _token_tile(KV, hd)

    @pl.when(r < n_ref[b])
    def _():
        blk, off = sb_ref[b, r], so_ref[b, r]

        def layer(l, carry):
            for src, buf in ((k_ref, kbuf_ref), (v_ref, vbuf_ref)):
                buf[l] = plgpu.load(src.at[l, blk, pl.ds(0, KVp), off, pl.ds(0, Hp)],
                                    mask=mask, other=0)
            return carry

        jax.lax.fori_loop(0, L, layer, 0)


def _write_kernel(kbuf_ref, vbuf_ref, db_ref, do_ref, n_ref, k_in_ref, v_in_ref, k_ref, v_ref,
                  *, L: int, KV: int, hd: int):
    del k_in_ref, v_in_ref  # aliased to k_ref/v_ref
    b, r = pl.program_id(0), pl.program_id(1)
    KVp, Hp, mask = _token_tile(KV, hd)

    @pl.when(r < n_ref[b])
    def _():
        blk, off = db_ref[b, r], do_ref[b, r]

        def layer(l, carry):
            for buf, dst in ((kbuf_ref, k_ref), (vbuf_ref, v_ref)):
                plgpu.store(dst.at[l, blk, pl.ds(0, KVp), off, pl.ds(0, Hp)], buf[l],
                            mask=mask)
            return carry

        jax.lax.fori_loop(0, L, layer, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def _relocate(k_pool, v_pool, src_blocks, src_offsets, dst_blocks, dst_offsets, num_moves, *,
              interpret: bool, num_warps: int):
    L, N, KV, bs, hd = k_pool.shape
    B, R = src_blocks.shape
    KVp, Hp = _next_pow2(KV), _next_pow2(hd)
    i32 = lambda x: x.astype(jnp.int32)
    num_moves = jnp.clip(i32(num_moves), 0, R)
    params = None if interpret else gpu_compiler_params(num_warps=num_warps)
    whole = pl.BlockSpec()
    buf_spec = pl.BlockSpec((None, None, L, KVp, Hp), lambda b, r: (b, r, 0, 0, 0))
    kbuf, vbuf = pl.pallas_call(
        functools.partial(_stage_kernel, L=L, KV=KV, hd=hd),
        grid=(B, R),
        in_specs=[whole] * 5,
        out_specs=[buf_spec, buf_spec],
        out_shape=[jax.ShapeDtypeStruct((B, R, L, KVp, Hp), k_pool.dtype),
                   jax.ShapeDtypeStruct((B, R, L, KVp, Hp), v_pool.dtype)],
        interpret=interpret, compiler_params=params, name="relocate_kv_stage",
    )(k_pool, v_pool, i32(src_blocks), i32(src_offsets), num_moves)
    return pl.pallas_call(
        functools.partial(_write_kernel, L=L, KV=KV, hd=hd),
        grid=(B, R),
        in_specs=[buf_spec, buf_spec] + [whole] * 5,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        input_output_aliases={5: 0, 6: 1},
        interpret=interpret, compiler_params=params, name="relocate_kv_write",
    )(kbuf, vbuf, i32(dst_blocks), i32(dst_offsets), num_moves, k_pool, v_pool)


def relocate_kv_kernel(k_pool: jax.Array, v_pool: jax.Array, src_blocks: jax.Array,
                       src_offsets: jax.Array, dst_blocks: jax.Array, dst_offsets: jax.Array,
                       num_moves: jax.Array, *, interpret: bool | None = None,
                       num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel; arguments and results as `relocate_kv_reference`."""
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ")
    shapes = {src_blocks.shape, src_offsets.shape, dst_blocks.shape, dst_offsets.shape}
    if len(shapes) != 1 or num_moves.shape != (src_blocks.shape[0],):
        raise ValueError("src/dst blocks/offsets must share one [B, R] shape, num_moves [B]")
    if src_blocks.size == 0:
        return k_pool, v_pool
    return _relocate(k_pool, v_pool, src_blocks, src_offsets, dst_blocks, dst_offsets,
                     num_moves, interpret=bool(interpret), num_warps=num_warps)


def _gather_kernel(pool_ref, bt_ref, layer_ref, out_ref, *, E: int, C: int):
    b, h, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    blk = bt_ref[b, m]
    layer = layer_ref[0]
    lanes = jnp.arange(C, dtype=jnp.int32)

    def step(i, carry):
        start = i * C
        mask = lanes + start < E
        x = plgpu.load(pool_ref.at[layer, blk, h, pl.ds(start, C)], mask=mask, other=0)
        plgpu.store(out_ref.at[pl.ds(start, C)], x, mask=mask)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(E, C), step, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk", "num_warps"))
def _gather_pages(pool, layer, block_tables, *, interpret: bool, chunk: int, num_warps: int):
    L, N, KV, bs, hd = pool.shape
    B, M = block_tables.shape
    E = bs * hd
    C = min(_next_pow2(chunk), _next_pow2(E))
    out = pl.pallas_call(
        functools.partial(_gather_kernel, E=E, C=C),
        grid=(B, KV, M),
        in_specs=[pl.BlockSpec()] * 3,
        out_specs=pl.BlockSpec((None, None, None, E), lambda b, h, m: (b, h, m, 0)),
        out_shape=jax.ShapeDtypeStruct((B, KV, M, E), pool.dtype),
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(num_warps=num_warps),
        name="gather_kv_pages",
    )(pool.reshape(L, N, KV, E), block_tables.astype(jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1))
    return out.reshape(B, KV, M, bs, hd)


def gather_kv_pages_kernel(pool: jax.Array, layer: jax.Array | int, block_tables: jax.Array, *,
                           interpret: bool | None = None, chunk: int = 4096,
                           num_warps: int = 4) -> jax.Array:
    """The Pallas kernel; arguments and result as `gather_kv_pages_reference`."""
    B, M = block_tables.shape
    _, _, KV, bs, hd = pool.shape
    if B == 0 or M == 0:
        return jnp.zeros((B, KV, M, bs, hd), pool.dtype)
    return _gather_pages(pool, layer, block_tables, interpret=bool(interpret), chunk=chunk,
                         num_warps=num_warps)
