"""The host loop: request queue, slots, KV blocks, continuous batching, chunked prefill, and
the speculative pipeline (draft schedule, KV reserve/rewind, acceptance bookkeeping, gate).

It stays thin: per iteration it builds small padded index arrays, dispatches at most two jitted
steps (one for prompt chunks, one for generation rows) and reads back a few ints per row.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from specjax.engine.batch import StepBatch, make_slot_state
from specjax.engine.kv_cache import NULL_BLOCK, BlockAllocator, OutOfBlocks, make_kv_pool
from specjax.engine.request import Request, RequestOutput, Status
from specjax.engine.stats import EngineStats
from specjax.engine.step import make_step
from specjax.models.llama import Llama
from specjax.sampling_params import SamplingParams
from specjax.engine.hidden_states import HiddenStateRecorder
from specjax.speculative.config import SaveHiddenStatesConfig, SpeculativeConfig
from specjax.speculative.factory import get_spec_drafter, get_spec_worker
from specjax.speculative.schedule import SpeculationGate, get_draft_len_for_batch_size
from specjax.speculative.step import make_spec_step
from specjax.tokenizer import Tokenizer
from specjax.validation import check_request


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `limit`."""
    buckets, b = [], 1
    while b < limit:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [limit])


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine sizing; every compiled shape follows from it."""

    max_batch_size: int = 8
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    tokens_per_block: int = 16
    num_kv_blocks: int | None = None    # default: room for max_batch_size full-length requests
    prefill_chunk: int = 64             # run width of prompt-chunk steps
    max_prefill_rows: int = 2           # per-step prompt token budget = chunk x rows
    # Dispatch step N+1 before reading step N, in modes whose next inputs stay on device.
    overlap_scheduler: bool = True

    def __post_init__(self):
        for name in ("max_batch_size", "tokens_per_block", "prefill_chunk", "max_prefill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 2):
                raise ValueError(f"{name} must be an int >= 2, got {value!r}")


class Engine:
    """Continuous-batching inference over a paged KV pool, with optional speculation."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None = None,
                 config: EngineConfig = EngineConfig(), seed: int | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 draft_model: Llama | None = None):
        model = model.unstacked()  # per-layer weights: a decode step reads them in place
        if isinstance(draft_model, Llama):
            draft_model = draft_model.unstacked()
        self.config = config
        self.model_config = mc = model.config
        self.tokenizer = tokenizer
        self.max_len = config.max_model_len or mc.max_position_embeddings
        if self.max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        bs = config.tokens_per_block
        self.spec = speculative_config
        # SAVE_HIDDEN_STATES drafts nothing: the steps only hand back captured hidden states.
        self.recorder = None
        save_layers: tuple[int, ...] = ()
        if isinstance(speculative_config, SaveHiddenStatesConfig):
            save_layers = speculative_config.layers_to_capture(mc.num_layers)
            self.recorder = HiddenStateRecorder(speculative_config, save_layers)
            self.spec = speculative_config = None
        self.max_draft_len = speculative_config.max_draft_len if speculative_config else 0
        self.worker = get_spec_worker(speculative_config, draft_model, mc)
        self.drafter = get_spec_drafter(speculative_config, self.max_len)
        # Verify and in-step drafting may write up to 2D positions past the newest token.
        self.blocks_per_seq = -(-(self.max_len + 2 * self.max_draft_len) // bs)
        num_blocks = config.num_kv_blocks or config.max_batch_size * self.blocks_per_seq + 1
        if (num_blocks - 1) < self.blocks_per_seq:
            raise ValueError(f"num_kv_blocks {num_blocks} cannot hold one request of "
                             f"max_model_len {self.max_len} ({self.blocks_per_seq} blocks + null)")
        self.graphdef, state = nnx.split(model)
        self.params = {"target": nnx.to_pure_dict(state)}
        self.kv = {"target": make_kv_pool(mc, num_blocks, bs)}
        if self.worker is not None:
            self.params["draft"] = nnx.to_pure_dict(nnx.split(draft_model)[1])
            self.kv["draft"] = self.worker.make_kv(num_blocks, bs, mc.dtype)
        # Rejection sampling needs the drafts' distributions from one step to the next; only
        # in-step drafters have them (host drafters fail closed to strict acceptance).
        keep_probs = getattr(self.worker, "rejection_sampling", False)
        self.kv["slots"] = make_slot_state(config.max_batch_size, self.max_draft_len,
                                           mc.vocab_size if keep_probs else 0)
        self.allocator = BlockAllocator(num_blocks, bs)
        self._step = make_step(self.graphdef, self.worker, save_layers)
        # Every generation step, plain decoding (D = 0) included.
        self._spec_step = make_spec_step(self.graphdef, self.worker, save_layers)
        spec = speculative_config
        self.gate = (SpeculationGate(spec.acceptance_rate_window_size, spec.acceptance_rate_threshold)
                     if spec and spec.acceptance_rate_window_size > 0 else None)
        self.stats = EngineStats()
        # Steps whose runs come from device state (plain decoding, in-step drafters) may be
        # dispatched before the previous one is read; host drafters need the newest tokens.
        self.overlap = bool(config.overlap_scheduler and (
            self.worker is None or spec.mode.support_overlap_scheduler()))
        self._inflight = None       # (step id, rows, draft_len, output) of an unread step
        self._step_id = 0
        self._advanced: dict[int, Request] = {}
        self.decode_buckets = power_of_two_buckets(config.max_batch_size)
        self.prefill_buckets = power_of_two_buckets(config.max_prefill_rows)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        self.num_steps = 0

    # -- warm-up (our stand-in for CUDA-graph capture) ------------------------------------

    def draft_len_for(self, batch_size: int) -> int:
        """The runtime draft length for a generation batch of this size (0 = plain decoding)."""
        if self.spec is None or (self.gate is not None and self.gate.disabled):
            return 0
        return get_draft_len_for_batch_size(self.spec.schedule, batch_size, self.max_draft_len)

    def warmup_shapes(self) -> list[tuple[str, int, int]]:
        """(step kind, batch bucket, run width) for every step serving can dispatch."""
        shapes = [("prefill", b, self.config.prefill_chunk) for b in self.prefill_buckets]
        generation = {(self._bucket(n, self.decode_buckets), self.draft_len_for(n))
                      for n in range(1, self.config.max_batch_size + 1)}
        if self.gate is not None:  # after the gate trips
            generation |= {(b, 0) for b in self.decode_buckets}
        return shapes + [("generation", b, d + 1) for b, d in sorted(generation)]

    def warmup(self, progress: bool = True) -> None:
        """Compile every step shape serving can use, so serving itself never compiles."""
        for kind, rows, width in tqdm(self.warmup_shapes(), desc="specjax warm-up",
                                      disable=not progress, leave=False):
            fn = self._step if kind == "prefill" else self._spec_step
            self.kv, out = fn(self.params, self.kv, self._empty_batch(rows, width))
            jax.block_until_ready(out)

    # -- requests ------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the argument if this request cannot be served.

        The checks live in `specjax.validation`, shared with `SamplingParams` and the server.
        """
        check_request(prompt_ids, params, SamplingParams, self.model_config.vocab_size,
                      self.max_len)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        self.validate(prompt_ids, params)
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        request = Request(request_id, [int(t) for t in prompt_ids], params, seed,
                          max_len=min(self.max_len, len(prompt_ids) + params.max_tokens))
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: int) -> None:
        """Cancel a request wherever it is; its KV blocks and slot are freed at once."""
        request = self.requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        # An unread step whose rows have all finished is no work: its results are dropped.
        return bool(self.waiting or self.running)

    # -- one iteration -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, schedule, run, and update. Returns outputs of requests that advanced.

        With the overlap scheduler the generation step dispatched here is read in the next
        call, while the device runs that call's step; the host then sees results one step
        late, so KV reservations cover the unread step's largest possible advance too.
        """
        start = time.perf_counter()
        self._advanced = {}
        self._admit()
        prefill = self._schedule_prefill()
        generation, draft_len = self._schedule_generation()
        prefill_out = None
        if prefill:
            runs = [(r, r.all_ids[r.num_computed:r.num_computed + n]) for r, n in prefill]
            prefill_out = self._launch(self._step, runs, self.config.prefill_chunk,
                                       self.prefill_buckets)
        dispatched = None
        if generation:
            # Runs of device-run steps come from slot state; the host's copy may be stale.
            runs = [(r, [r.last_token] + r.draft_tokens[:drafted]) for r, _, drafted in generation]
            self._step_id += 1
            dispatched = (self._step_id, generation, draft_len,
                          self._launch(self._spec_step, runs, draft_len + 1, self.decode_buckets))
            for request, reserve, _ in generation:
                request.latest_step, request.latest_reserve = self._step_id, reserve
                request.latest_advance = draft_len + 1
        overlap = self.overlap and self._runs_on_device(draft_len)
        previous, self._inflight = self._inflight, (dispatched if overlap else None)
        if previous is not None:  # read step N while step N+1 runs
            self._apply_generation(*previous)
        if dispatched is not None and not overlap:
            self._apply_generation(*dispatched)
        if prefill:
            tokens = np.asarray(prefill_out.tokens)
            if self.recorder is not None:
                hidden = np.asarray(prefill_out.hidden_states)
            for i, (request, n) in enumerate(prefill):
                if self.recorder is not None:
                    self.recorder.record(request, request.num_computed, hidden[:, i, :n])
                request.num_computed += n
                if request.num_computed == request.num_tokens:
                    request.prefilled = True
                    self._append(request, [int(tokens[i])])
                    self._advanced[request.request_id] = request
        self.num_steps += 1
        if self.recorder is not None:
            self.recorder.maybe_flush(self.num_steps, idle=not self.has_unfinished())
        self.stats.step_time += time.perf_counter() - start
        return [r.output() for r in self._advanced.values()]

    def _runs_on_device(self, draft_len: int) -> bool:
        """Whether a generation step of this draft length takes its runs from slot state."""
        return self.worker is not None or draft_len == 0

    def _drain(self) -> None:
        """Read the unread step now (before preempting, or when reservations do not fit)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._apply_generation(*inflight)

    def _unread_advance(self, request: Request) -> int:
        """Tokens a dispatched but unread step may still add to `request`."""
        unread = self._inflight is not None and request.latest_step == self._inflight[0]
        return request.latest_advance if unread else 0

    def _admit(self) -> None:
        # Blocks already promised to running requests' unprocessed tokens are not free to give.
        headroom = 1 + 2 * self.max_draft_len  # what one generation step may reserve
        budget = self.allocator.num_free_blocks - sum(
            self.allocator.blocks_needed(r.request_id, r.pending + headroom) for r in self.running)
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            # Room for the whole prompt (plus the first token) now, so admission cannot thrash.
            need = self.allocator.blocks_needed(None, request.num_tokens + headroom)
            if need > budget:
                break
            budget -= need
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.slot = self._free_slots.pop()
            self.allocator.allocate(request.request_id)
            self.running.append(request)

    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        rows = []
        for request in self.running:
            if len(rows) == self.config.max_prefill_rows:
                break
            if not request.prefilled:
                n = min(request.pending, self.config.prefill_chunk)
                if self.allocator.can_add(request.request_id, n):
                    self.allocator.add_tokens(request.request_id, n)
                    rows.append((request, n))
        return rows

    def _schedule_generation(self) -> tuple[list[tuple[Request, int, int]], int]:
        """Rows whose newest token is pending, each with (request, reserved positions, real
        draft length as the host knows it), and the runtime draft length of the step."""
        candidates = [r for r in self.running if r.prefilled]
        draft_len = self.draft_len_for(len(candidates)) if candidates else 0
        if not self._runs_on_device(draft_len):
            self._drain()  # a host drafter needs every token so far
            candidates = [r for r in candidates if r.status is Status.RUNNING]
        # Verify writes the newest token + D drafts; an in-step drafter D more.
        reserve = 1 + draft_len * (2 if self.worker is not None else 1)
        need = lambda r: max(0, r.num_computed + self._unread_advance(r) + reserve
                             - self.allocator.length(r.request_id))
        if self._inflight is not None and sum(
                self.allocator.blocks_needed(r.request_id, need(r)) for r in candidates
        ) > self.allocator.num_free_blocks:
            self._drain()  # exact lengths free the unread step's worst-case reservation
            candidates = [r for r in candidates if r.status is Status.RUNNING]
        rows = []
        for request in candidates:
            if request.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier row
            while True:
                try:
                    self.allocator.add_tokens(request.request_id, need(request))
                    rows.append(request)
                    break
                except OutOfBlocks:
                    victim = self._pick_victim(exclude=request)
                    if victim is None:
                        break  # cannot happen while one request fits the pool; wait a step
                    if victim in rows:
                        rows.remove(victim)
                    self._preempt(victim)
        out = []
        for request in rows:
            if draft_len and self.drafter is not None:
                t0 = time.perf_counter()
                request.draft_tokens = self.drafter.propose_for(
                    request.request_id, request.all_ids, draft_len)
                self.stats.draft_time += time.perf_counter() - t0
            room = request.max_len - request.num_tokens - 1
            drafted = max(0, min(len(request.draft_tokens), draft_len, room))
            out.append((request, reserve, drafted))
        return out, draft_len

    def _apply_generation(self, step_id: int, rows: list[tuple[Request, int, int]],
                          draft_len: int, out) -> None:
        """Apply a generation step's results, in the order that keeps stats and KV right."""
        new_tokens = np.asarray(out.new_tokens)
        lens = np.asarray(out.new_tokens_lens)
        draft_lens = np.asarray(out.draft_lens)
        next_drafts = np.asarray(out.next_draft_tokens)
        hidden = np.asarray(out.hidden_states) if self.recorder is not None else None
        accepted_sum = drafted_sum = with_drafts = 0
        for i, (request, reserve, _) in enumerate(rows):
            if request.status is not Status.RUNNING:
                continue  # finished or cancelled while this step was in flight
            num_accepted = int(lens[i]) - 1
            verified_len = draft_len
            drafted_len = int(draft_lens[i])  # the device's real length, snapshotted unpadded
            num_drafts_verified = min(drafted_len, verified_len)
            rewind_len = verified_len - num_accepted
            if hidden is not None:
                self.recorder.record(request, request.num_computed, hidden[:, i, :1])
            request.num_computed += num_accepted + 1
            # Give back the rejected positions and the unused reserve (what an in-step drafter
            # wrote past them) -- but keep what a newer, still unread step may write.
            newer = request.latest_reserve if request.latest_step != step_id else 0
            give_back = self.allocator.length(request.request_id) - request.num_computed - newer
            assert newer or give_back == rewind_len + reserve - 1 - verified_len
            self.allocator.rewind(request.request_id, give_back)
            # Only now do the next drafts replace the verified ones.
            request.draft_tokens = [int(t) for t in next_drafts[i, :draft_len]]
            stats = request.stats
            stats.num_draft_tokens += num_drafts_verified
            stats.num_accepted_draft_tokens += num_accepted
            if num_drafts_verified > 0:
                stats.num_steps_with_drafts += 1
                with_drafts += 1
                accepted_sum += num_accepted
                drafted_sum += num_drafts_verified
            self._append(request, [int(t) for t in new_tokens[i, :num_accepted + 1]])
            self._advanced[request.request_id] = request
        self.stats.record_step(with_drafts, accepted_sum, drafted_sum)
        if self.gate is not None and drafted_sum > 0:
            disabled_now, _ = self.gate.record_acceptance_rate(accepted_sum / drafted_sum)
            if disabled_now:
                for request in self.running:
                    request.draft_tokens = []

    def _pick_victim(self, exclude: Request) -> Request | None:
        for request in reversed(self.running):  # the most recently admitted goes first
            if request is not exclude:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it to be recomputed from its tokens.

        Sampling keys depend on (seed, position) only, so the recomputed request continues
        exactly as it would have.
        """
        self.allocator.free(request.request_id)
        self.running.remove(request)
        self._free_slots.append(request.slot)
        request.slot, request.num_computed = None, 0
        if self.recorder is not None:
            self.recorder.drop(request)
        request.prefilled = False  # recompute every token, then sample the next one
        request.draft_tokens = []
        request.status = Status.WAITING
        request.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    @staticmethod
    def _bucket(n: int, buckets: tuple[int, ...]) -> int:
        return next(b for b in buckets if b >= n)

    def _launch(self, fn, runs: list[tuple[Request, list[int]]], width: int,
                buckets: tuple[int, ...]):
        """Pad (request, run tokens) rows into a batch and dispatch `fn` asynchronously. A run
        starts at the request's first token not yet in the KV pool."""
        batch = self._empty_batch(self._bucket(len(runs), buckets), width, as_numpy=True)
        for i, (request, run) in enumerate(runs):
            batch["tokens"][i, :len(run)] = run
            batch["start_pos"][i] = request.num_computed
            batch["query_lens"][i] = len(run)
            blocks = self.allocator.blocks(request.request_id)
            batch["block_tables"][i, :len(blocks)] = blocks
            p = request.params
            batch["temperature"][i] = p.temperature
            batch["top_k"][i] = p.top_k
            batch["top_p"][i] = p.top_p
            batch["min_p"][i] = p.min_p
            batch["seeds"][i] = request.seed
            batch["slots"][i] = request.slot
            batch["max_lens"][i] = request.max_len
            end = request.num_computed + len(run)
            batch["next_tokens"][i] = request.all_ids[end] if end < request.num_tokens else -1
        self.kv, out = fn(self.params, self.kv, StepBatch(**batch))
        for leaf in jax.tree.leaves(out):  # start the small device->host copies now, unblocked
            leaf.copy_to_host_async()
        return out

    def _empty_batch(self, rows: int, width: int, as_numpy: bool = False):
        batch = dict(
            tokens=np.zeros((rows, width), np.int32),
            start_pos=np.zeros(rows, np.int32),
            query_lens=np.zeros(rows, np.int32),
            block_tables=np.full((rows, self.blocks_per_seq), NULL_BLOCK, np.int32),
            temperature=np.zeros(rows, np.float32),
            top_k=np.zeros(rows, np.int32),
            top_p=np.ones(rows, np.float32),
            min_p=np.zeros(rows, np.float32),
            seeds=np.zeros(rows, np.uint32),
            slots=np.full(rows, self.config.max_batch_size, np.int32),  # the spare slot
            max_lens=np.zeros(rows, np.int32),
            next_tokens=np.full(rows, -1, np.int32),
        )
        return batch if as_numpy else StepBatch(**batch)

    # -- stopping ------------------------------------------------------------------------

    def _append(self, request: Request, tokens: list[int]) -> None:
        """Append a step's tokens one at a time, stopping at the first stop condition (the
        rest of an accepted run is discarded with the request's blocks)."""
        stats = request.stats
        stats.decoding_iterations += 1
        if stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()
        p = request.params
        for token in tokens:
            request.output_ids.append(token)
            stats.num_generated_tokens += 1
            self.stats.num_generated_tokens += 1
            if (not p.ignore_eos and token in self.model_config.eos_token_ids) or \
                    token in p.stop_token_ids:
                return self._finish(request, "stop")
            if p.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(request.output_ids)
                hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
                if hits:
                    request.text = text[:min(hits)]
                    return self._finish(request, "stop", decode=False)
            if request.num_tokens >= request.max_len:
                return self._finish(request, "length")

    def _finish(self, request: Request, reason: str, decode: bool = True) -> None:
        if request.status is Status.RUNNING:
            self.allocator.free(request.request_id)
            self.running.remove(request)
            self._free_slots.append(request.slot)
            request.slot = None
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)
        if self.drafter is not None:
            self.drafter.on_request_finished(request.request_id)
        if self.recorder is not None:
            self.recorder.finish(request)
        request.stats.finish_time = time.perf_counter()
        if decode and self.tokenizer is not None:
            request.text = self.tokenizer.decode(request.output_ids)
