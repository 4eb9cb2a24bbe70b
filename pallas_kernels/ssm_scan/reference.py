"""Plain-jnp Mamba-2 selective state-space scan (SSD): the oracle and references of the
ssm_scan kernel.

`ssm_scan_sequential` is the exact recurrence (`lax.scan` over positions): the oracle every
other form is tested against. `ssm_scan_chunked_reference` is the chunked (SSD) form the
Pallas kernel implements, in jnp: a quadratic, attention-like product inside each chunk plus
a scan over chunk states -- matmuls instead of T sequential steps. `ssm_scan_reference`, what
`ssm_scan` runs off the GPU, is that chunked form: on a CPU the sequential scan pays ~70 us
per position whatever its size (measured: T = 5, 365 us sequential vs 86 us chunked; T = 64,
2.9 ms vs 0.3 ms; 6 heads x 64 x state 32). `ssm_scan_states_reference` returns the state
after every position, which speculative verification needs to commit the state at the
accepted depth (a rejected draft suffix must not advance it); it is the one-chunk quadratic
form, for the short runs a verify step holds.

Numerics: decays are always `exp` of a non-positive segment sum of `dt * A` (the sum from
position j+1 to i, -inf above the diagonal), never `exp(-cumsum)` on its own, which overflows
for long chunks with strong decay. Segment sums are summed directly (`segment_sums`), not
taken as differences of one cumulative sum, which cancel badly when the decay is strong.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Matmuls in the chunked form ask for float32 products (a GPU's DEFAULT is TF32, ~1e-3 off).
_HIGHEST = jax.lax.Precision.HIGHEST


def check_shapes(x, dt, A, b, c, h0) -> tuple[int, int, int, int, int, int]:
    """Validate the ssm_scan argument shapes; returns (B, T, H, P, G, N)."""
    B, T, H, P = x.shape
    G, N = b.shape[2], b.shape[3]
    if (dt.shape != (B, T, H) or A.shape != (H,) or b.shape != (B, T, G, N)
            or c.shape != b.shape or h0.shape != (B, H, P, N)):
        raise ValueError(f"ssm_scan shapes do not fit: x {x.shape}, dt {dt.shape}, A {A.shape}, "
                         f"b {b.shape}, c {c.shape}, h0 {h0.shape}")
    if G == 0 or H % G:
        raise ValueError(f"heads ({H}) must be a multiple of groups ({G})")
    return B, T, H, P, G, N


def segment_sums(a: jax.Array, axis: int) -> jax.Array:
    """seg[..., i, j, ...] = sum_{j < k <= i} a_k (i, j along `axis` and the axis after it),
    -inf for j > i: exp(seg) is the decay from position j to position i.

    Summed directly (a masked cumsum over k), not as s_i - s_j of one cumsum s: both are
    finite, but the difference of two large cumulative sums loses the small segment sums near
    the diagonal to cancellation (1e-4 relative once the chunk's total decay reaches ~-500).
    """
    a = jnp.moveaxis(a, axis, -1)                             # [..., L]
    L = a.shape[-1]
    k = jnp.arange(L)
    terms = jnp.where(k[:, None] > k[None, :], a[..., :, None], 0.0)   # [..., L(k), L(j)]
    seg = jnp.where(k[:, None] >= k[None, :], jnp.cumsum(terms, axis=-2), -jnp.inf)
    return jnp.moveaxis(seg, (-2, -1), (axis, axis + 1))


def _heads(v: jax.Array, H: int) -> jax.Array:
    """[B, T, G, N] -> [B, T, H, N]: head h reads group h // (H // G)."""
    return jnp.repeat(v, H // v.shape[2], axis=2)


def _recurrence(x, dt, A, b, c, h0):
    """The sequential scan of `ssm_scan_sequential`: (y [B, T, H, P], h_final [B, H, P, N])."""
    H = check_shapes(x, dt, A, b, c, h0)[2]
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    x, dt, A, h0 = f32(x), f32(dt), f32(A), f32(h0)
    bh, ch = _heads(f32(b), H), _heads(f32(c), H)
    time_major = lambda v: jnp.moveaxis(v, 1, 0)

    def step(h, inp):                                   # h [B, H, P, N]
        xt, dtt, bt, ct = inp                           # [B,H,P], [B,H], [B,H,N], [B,H,N]
        decay = jnp.exp(dtt * A)[..., None, None]       # dt == 0 -> exactly 1
        h = decay * h + (dtt[..., None] * xt)[..., None] * bt[:, :, None, :]
        return h, jnp.sum(h * ct[:, :, None, :], axis=-1)   # y [B, H, P]

    h_final, y = jax.lax.scan(step, h0, tuple(map(time_major, (x, dt, bh, ch))))
    return time_major(y), h_final


def ssm_scan_sequential(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array,
                        c: jax.Array, h0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Mamba-2 selective scan, exactly as the recurrence (float32): the oracle.

    x `[B, T, H, P]` per-head inputs; dt `[B, T, H]` step sizes, already discretised (softplus
    and clamp done by the caller), dt == 0 marks a padding position that leaves the state
    unchanged; A `[H]` negative decay rates; b, c `[B, T, G, N]` input/output projections
    (head h uses group h // (H // G)); h0 `[B, H, P, N]` the initial state. Per row and head,
    for t = 0..T-1:

        h_t = exp(dt_t * A) * h_{t-1} + dt_t * outer(x_t, b_t)      # [P, N]
        y_t = h_t @ c_t                                              # [P]

    Returns (y `[B, T, H, P]`, h_final `[B, H, P, N]` = h_{T-1}; h0 when T == 0). No D skip
    term and no gating (the caller adds them).
    """
    return _recurrence(x, dt, A, b, c, h0)


def ssm_scan_reference(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
                       h0: jax.Array, *,
                       interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The contract of `ssm_scan_sequential`, computed in chunked form (chunks of up to 64
    positions; one chunk for shorter runs), equal to it up to float32 rounding. `interpret`
    is accepted for signature parity with the kernel and ignored."""
    del interpret
    return ssm_scan_chunked_reference(x, dt, A, b, c, h0, chunk=max(1, min(64, x.shape[1])))


def ssm_scan_states_reference(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array,
                              c: jax.Array, h0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """As `ssm_scan_reference`, but returns (y `[B, T, H, P]`, states `[B, T, H, P, N]`):
    states[:, t] is the state after position t (states[:, -1] is h_final). Speculative
    verification commits states[b, accepted_depth_b].

    Every state at once, in closed form: states_i = exp(sum_{k<=i} a_k) h0 + sum_{j<=i}
    exp(seg[i, j]) dt_j outer(x_j, b_j) with a = dt * A -- O(T^2) work, no sequential steps:
    for the few positions of a verify step.
    """
    H = check_shapes(x, dt, A, b, c, h0)[2]
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    x, dt, A, h0 = f32(x), f32(dt), f32(A), f32(h0)
    bh, ch = _heads(f32(b), H), _heads(f32(c), H)
    a = dt * A                                                # [B, T, H], <= 0
    seg = segment_sums(a, axis=1)                             # [B, T(i), T(j), H]
    from_start = jnp.exp(jnp.cumsum(a, axis=1))               # decay of h0 up to i
    states = (from_start[..., None, None] * h0[:, None]
              + jnp.einsum("bijh,bjh,bjhp,bjhn->bihpn", jnp.exp(seg), dt, x, bh,
                           precision=_HIGHEST))
    y = jnp.einsum("bihn,bihpn->bihp", ch, states, precision=_HIGHEST)
    return y, states


def ssm_scan_chunked_reference(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array,
                               c: jax.Array, h0: jax.Array,
                               chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The same scan in chunked (SSD) form: the algorithm of the Pallas kernel, in jnp.

    T is padded to a multiple of `chunk` with dt = 0 (state unchanged). Per chunk of L
    positions, with a = dt * A, s = cumsum(a) inside the chunk and s_i - s_j meaning the
    segment sum `segment_sums(a)[i, j]`:
      y_intra[i] = sum_{j <= i} (c_i . b_j) exp(s_i - s_j) dt_j x_j   (the decay-masked C B^T)
      y_state[i] = exp(s_i) (h_in @ c_i)                              (the carried state)
      h_out      = exp(s_{L-1}) h_in + sum_j exp(s_{L-1} - s_j) dt_j outer(x_j, b_j)
    and a scan over chunks passes h_out on. Equal to `ssm_scan_reference` up to float32
    rounding.
    """
    B, T, H, P, _, _ = check_shapes(x, dt, A, b, c, h0)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    x, dt, A, h0 = f32(x), f32(dt), f32(A), f32(h0)
    b, c = f32(b), f32(c)
    L = chunk
    nc = -(-T // L)
    pad = nc * L - T
    tpad = lambda v: jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
    # [B, nc, L, ...]; b/c per head ([B, nc, L, H, N]).
    split = lambda v: tpad(v).reshape(B, nc, L, *v.shape[2:])
    xc, dtc = split(x), split(dt)
    bc, cc = split(_heads(b, H)), split(_heads(c, H))

    a = dtc * A                                               # [B, nc, L, H], <= 0
    s = jnp.cumsum(a, axis=2)
    seg = segment_sums(a, axis=2)                             # [B, nc, L(i), L(j), H]
    scores = jnp.einsum("bcihn,bcjhn->bcijh", cc, bc, precision=_HIGHEST)
    m = scores * jnp.exp(seg) * dtc[:, :, None, :, :]
    y_intra = jnp.einsum("bcijh,bcjhp->bcihp", m, xc, precision=_HIGHEST)

    w = jnp.exp(seg[:, :, -1]) * dtc                          # exp(s_{L-1} - s_j) dt_j
    chunk_states = jnp.einsum("bclh,bclhp,bclhn->bchpn", w, xc, bc, precision=_HIGHEST)
    chunk_decay = jnp.exp(s[:, :, -1])                        # [B, nc, H]

    def pass_state(h, inp):                                   # h [B, H, P, N]
        decay, new = inp
        return decay[..., None, None] * h + new, h            # (h_out, h_in)

    h_final, h_in = jax.lax.scan(pass_state, h0, (jnp.moveaxis(chunk_decay, 1, 0),
                                                  jnp.moveaxis(chunk_states, 1, 0)))
    h_in = jnp.moveaxis(h_in, 0, 1)                           # [B, nc, H, P, N]
    y_state = (jnp.einsum("bclhn,bchpn->bclhp", cc, h_in, precision=_HIGHEST)
               * jnp.exp(s)[..., None])
    y = (y_intra + y_state).reshape(B, nc * L, H, P)[:, :T]
    return y, h_final
