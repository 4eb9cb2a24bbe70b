"""The device as the host loop sees it: parameters, state, the compiled steps, padded batches,
and the generation step in flight.

`launch_*` pads rows into a batch bucket and dispatches a step asynchronously (JAX async
dispatch); its small outputs start their device-to-host copies at once. A row whose
preparation raises is left as padding and reported with its error, so one request's fault
never stops the others' step. With the overlap scheduler the engine reads a generation step
one call later, while the device runs the next; `unread_advance` tells the scheduler how far
such a step may still move a request.
"""
from __future__ import annotations

from typing import Callable

import jax
from tqdm.auto import tqdm

from specjax.core.batch import PrefillOutput, clear_row, empty_batch, set_row
from specjax.core.state import EngineState, Params
from specjax.core.steps import make_generation_step, make_prefill_step
from specjax.core.suffix import SuffixSpec
from specjax.core.worker import DraftWorker
from specjax.engine.allocator import BlockAllocator
from specjax.engine.bookkeeper import DispatchedStep, GenerationRow
from specjax.engine.request import Request

Failed = list[tuple[Request, Exception]]   # rows that could not be prepared, with the error


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `limit`."""
    buckets, b = [], 1
    while b < limit:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [limit])


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


class Executor:
    def __init__(self, graphdef, params: Params, make_state: Callable[[], EngineState],
                 allocator: BlockAllocator, *, worker: DraftWorker | None,
                 save_layers: tuple[int, ...], blocks_per_seq: int,
                 decode_buckets: tuple[int, ...], prefill_chunk: int, max_prefill_rows: int,
                 suffix: SuffixSpec | None = None):
        # Everything the steps take lives on one device, committed: a jitted step's signature
        # includes whether each argument is committed, so a mix (a head trained in the same
        # process is committed, a loaded one is not) would compile again after warm-up.
        device = jax.devices()[0]
        self.graphdef, self.params = graphdef, jax.device_put(params, device)
        self.make_state = lambda: jax.device_put(make_state(), device)
        self.state = state = self.make_state()
        self.allocator = allocator
        self.prefill_step = make_prefill_step(graphdef, worker, save_layers, suffix)
        self.generation_step = make_generation_step(graphdef, worker, save_layers, suffix)
        self.blocks_per_seq = blocks_per_seq
        self.spare_slot = state.slots.spare  # the slot padded rows write to
        self.prefill_chunk = prefill_chunk
        self.decode_buckets = decode_buckets
        self.prefill_buckets = power_of_two_buckets(max_prefill_rows)
        self.inflight: DispatchedStep | None = None
        self._step_id = 0

    # -- dispatch ----------------------------------------------------------------------------

    def launch_prefill(self, rows: list[tuple[Request, int]]) -> tuple[PrefillOutput, Failed]:
        """Prompt chunks: each request's next `n` tokens from its first one not in the pool.
        Returns the step's output and the rows that could not be prepared."""
        runs = []
        for request, n in rows:
            start = request.num_computed
            end = start + n
            runs.append((request, request.tokens(start, end),
                         request.token_at(end) if end < request.num_tokens else -1))
        return self._launch(self.prefill_step, runs, self.prefill_chunk, self.prefill_buckets)

    def launch_generation(self, rows: list[GenerationRow], draft_len: int,
                          verify_len: int | None = None) -> tuple[DispatchedStep, Failed]:
        """[newest token, host drafts] per row (steps that read runs from the device take them
        from slot state); each request remembers this step's reservation and largest advance.
        `verify_len`: drafts verified after the newest token (a tree's nodes; default
        `draft_len`). Returns the step and the rows that could not be prepared."""
        verify_len = draft_len if verify_len is None else verify_len
        runs = [(row.request, [row.request.last_token] + row.request.draft_tokens[:row.drafted],
                 -1) for row in rows]
        self._step_id += 1
        out, failed = self._launch(self.generation_step, runs, verify_len + 1,
                                   self.decode_buckets)
        step = DispatchedStep(self._step_id, rows, draft_len, out, verify_len)
        for row in rows:
            request = row.request
            request.latest_step, request.latest_reserve = step.step_id, row.reserve
            request.latest_advance = draft_len + 1
        return step, failed

    def _launch(self, fn, runs: list[tuple[Request, list[int], int]], width: int,
                buckets: tuple[int, ...]):
        """Row i of the batch is runs[i]; a run whose row cannot be written stays padding (it
        computes nothing and its outputs are ignored) and is returned with its error."""
        batch = empty_batch(bucket(len(runs), buckets), width, self.blocks_per_seq,
                            self.spare_slot)
        failed: Failed = []
        for i, (request, run, next_token) in enumerate(runs):
            try:
                p = request.params
                set_row(batch, i, run=run, start_pos=request.num_computed,
                        blocks=self.allocator.blocks(request.request_id), slot=request.slot,
                        max_len=request.max_len, seed=request.seed, temperature=p.temperature,
                        top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, next_token=next_token,
                        logit_bias=p.logit_bias, logprobs=p.logprobs is not None,
                        prompt_logprobs=request.wants_prompt_logprobs,
                        repetition_penalty=p.repetition_penalty,
                        frequency_penalty=p.frequency_penalty,
                        presence_penalty=p.presence_penalty)
            except Exception as e:
                clear_row(batch, i, self.spare_slot)
                failed.append((request, e))
        self.state, out = fn(self.params, self.state, batch)
        for leaf in jax.tree.leaves(out):  # start the small device->host copies now, unblocked
            leaf.copy_to_host_async()
        return out, failed

    def reset(self) -> None:
        """Fresh device state after a step failed on the device: a donated state that went
        into a failed step cannot be trusted (or may be gone). Every request that held K/V
        in it must be failed by the caller; waiting requests hold none."""
        self.inflight = None
        self.state = self.make_state()

    # -- the step in flight ------------------------------------------------------------------

    def unread_advance(self, request: Request) -> int:
        """Tokens a dispatched but unread step may still add to `request`."""
        unread = self.inflight is not None and request.latest_step == self.inflight.step_id
        return request.latest_advance if unread else 0

    def take_inflight(self) -> DispatchedStep | None:
        step, self.inflight = self.inflight, None
        return step

    # -- warm-up (our stand-in for CUDA-graph capture) ------------------------------------

    def warmup(self, generation_widths: set[tuple[int, int]], progress: bool = True) -> None:
        """Compile the prefill step for every bucket and the generation step for every
        (bucket, run width) in `generation_widths`, so serving itself never compiles."""
        shapes = ([(self.prefill_step, rows, self.prefill_chunk) for rows in self.prefill_buckets]
                  + [(self.generation_step, rows, width)
                     for rows, width in sorted(generation_widths)])
        for fn, rows, width in tqdm(shapes, desc="specjax warm-up", disable=not progress,
                                    leave=False):
            batch = empty_batch(rows, width, self.blocks_per_seq, self.spare_slot)
            self.state, out = fn(self.params, self.state, batch)
            jax.block_until_ready(out)
