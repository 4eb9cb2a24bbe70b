"""Timing for the benches: the decode phase of finished requests (after each first token), and
the compiled generation step alone, through the public step API -- what the engine's host loop
adds on top of it, and what verifying D+1 tokens costs against 1."""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import jax
import numpy as np

from specjax.core import Params, empty_batch, make_generation_step, set_row
from specjax.engine.engine import Engine


def decode_seconds(outs) -> float:
    """The requests' time after their first token, summed: the decode phase, prefill left out."""
    return sum(o.stats.finish_time - o.stats.first_token_time for o in outs)


def decode_rate(outs) -> float:
    """Tokens per second after each request's first token (1 / TPOT): the phase speculation
    speeds up, without the prompt's prefill, which both sides pay alike."""
    return sum(len(o.token_ids) - 1 for o in outs) / decode_seconds(outs)


def decode_step_time(outs) -> float:
    """Seconds per decode step: the requests' time after their first token over their steps
    after the prefill (whose token `decoding_iterations` counts too). Prefill and setup are
    left out; requests of one batch share their steps, so this is the engine's step time."""
    return decode_seconds(outs) / sum(o.stats.decoding_iterations - 1 for o in outs)


def time_generation_steps(engine: Engine, batch_size: int, widths: Sequence[int],
                          start_pos: int, iters: int = 20, rounds: int = 3) -> list[float]:
    """Seconds per back-to-back call of the target-only generation step (no drafter: a
    width > 1 run verifies host-given drafts) for `batch_size` rows of each of `widths` tokens,
    on the engine's own weights and pool (garbage context is fine for timing).

    Every width is timed at the same mean position `start_pos` with the same block tables, so
    the widths differ in their query tokens alone. A width-1 step (plain decoding) takes its
    run from slot state (`runs_on_device`) and moves one position per call, as the engine's
    does: its rows' slots are set before each round so that the round's calls centre on
    `start_pos`; wider runs come from the batch and stay at `start_pos`. Rows use the engine's
    own slots 0 .. batch_size-1 (the engine is idle: a request's prefill rewrites its slot)
    and KV blocks taken from its allocator and given back after: blocks picked by number could
    be a cached prompt's, and the next request that hit the prefix cache would read the
    garbage written there. The widths alternate for `rounds` rounds of `iters` calls each and
    each keeps its fastest round, so machine noise hits them alike."""
    ex = engine.executor
    if batch_size > ex.spare_slot:
        raise ValueError(f"batch_size {batch_size} > the engine's {ex.spare_slot} slots")
    first = start_pos - iters // 2  # a width-1 round runs from here to first + iters - 1
    if first < 0:
        raise ValueError(f"start_pos {start_pos} < iters // 2 ({iters // 2})")
    last = max(first + iters, start_pos + max(widths))
    blocks = -(-last // engine.config.tokens_per_block)
    if blocks > ex.blocks_per_seq:
        raise ValueError(f"positions up to {last} need {blocks} blocks per sequence; the "
                         f"engine has {ex.blocks_per_seq}")
    with _borrowed_blocks(engine, batch_size, blocks) as tables:
        return _time_steps(engine, batch_size, widths, iters, rounds, first, start_pos, tables)


@contextlib.contextmanager
def _borrowed_blocks(engine: Engine, rows: int, blocks: int):
    """`rows` block tables of `blocks` blocks each, taken from the engine's allocator as a
    request's would be (free blocks first, then cached ones evicted) and given back after."""
    alloc = engine.allocator
    if rows * blocks > alloc.num_free_blocks:
        raise ValueError(f"{rows} rows of {blocks} blocks need {rows * blocks} free KV blocks; "
                         f"the engine has {alloc.num_free_blocks}")
    seq_ids = [-1 - i for i in range(rows)]  # request ids are >= 0
    try:
        for seq in seq_ids:
            alloc.allocate(seq)
            alloc.add_tokens(seq, blocks * engine.config.tokens_per_block)
        yield [alloc.blocks(seq) for seq in seq_ids]
    finally:
        for seq in seq_ids:
            alloc.free(seq)


def _time_steps(engine: Engine, batch_size: int, widths: Sequence[int], iters: int,
                rounds: int, first: int, start_pos: int, tables: list[list[int]]) -> list[float]:
    ex = engine.executor
    fn = make_generation_step(ex.graphdef)
    params = Params(target=ex.params.target)
    rows = next(b for b in ex.decode_buckets if b >= batch_size)
    batches = []
    for width in widths:
        batch = empty_batch(rows, width, ex.blocks_per_seq, ex.spare_slot,
                            ex.mask_shape(width, "generation"))
        for i in range(batch_size):
            set_row(batch, i, run=[0] * width, start_pos=start_pos, slot=i, blocks=tables[i],
                    max_len=10**6)
        batches.append(batch)
    slot_ids = np.arange(batch_size)

    def rewind(state):
        """Put the rows' slots at `first` with no drafts (outside the timed calls)."""
        slots = state.slots.replace(start=state.slots.start.at[slot_ids].set(first),
                                    num_drafts=state.slots.num_drafts.at[slot_ids].set(0))
        return jax.block_until_ready(state.replace(slots=slots))

    def timed(engine_state):
        state = engine_state.replace(draft=None)  # the target-only step never sees it
        for batch in batches:  # compile and warm each width
            state = rewind(state)
            for _ in range(3):
                state, out = fn(params, state, batch)
            jax.block_until_ready(out)
        best = [float("inf")] * len(widths)
        for _ in range(rounds):
            for k, batch in enumerate(batches):
                state = rewind(state)
                start = time.perf_counter()
                for _ in range(iters):
                    state, out = fn(params, state, batch)
                jax.block_until_ready(out)
                best[k] = min(best[k], (time.perf_counter() - start) / iters)
        # The step donated every leaf it was given (KV, slots, SA history, penalty counts):
        # the engine keeps the returned ones, and its drafter state.
        return state.replace(draft=engine_state.draft), best

    return ex.drive(timed)


def copy_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes per second a memory-to-memory copy moves where the model's weights live (read +
    write, the STREAM convention), the best of `repeats`: the physical floor a decode step's
    weight reads run against. On a CPU a numpy copy through host memory; on an accelerator a
    jitted elementwise pass through its own memory (HBM), four times larger. The buffer is
    far larger than any cache."""
    if jax.default_backend() == "cpu":
        src = np.ones(megabytes * 2**20 // 4, np.float32)
        dst = np.empty_like(src)
        copy = lambda: np.copyto(dst, src)
    else:
        src = jax.numpy.ones(4 * megabytes * 2**20 // 4, np.float32)
        add = jax.jit(lambda x: x + 1)  # reads and writes every byte once
        copy = lambda: add(src).block_until_ready()
        copy()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def decode_weight_bytes(engine: Engine) -> int:
    """Bytes of target weights one decode step must read: every parameter but the embedding
    table, of which a step reads only its rows' entries (a tied table is read whole, as the LM
    head, unless the CPU kernel's layout gave the head a packed copy of its own)."""
    params = engine.executor.params.target
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if "lm_head" in params:
        total -= params["embed"].nbytes
    return total


def cpu_name() -> str:
    """The host CPU's model name (figures depend on it: print it beside them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()
