"""The host loop: continuous batching over a paged KV pool, with optional speculation.

`Engine` wires four parts and runs one iteration per `step()`:

    Scheduler        who runs: admission, prompt chunks, generation rows, reservations, preemption
    Executor         the device: parameters, state, compiled steps, batches, the step in flight
    Bookkeeper       a generation step's results: accepted counts, KV give-back, statistics, gate
    OutputProcessor  tokens into outputs: stop conditions and text

Per iteration it builds small padded index arrays, dispatches at most two jitted steps (one
for prompt chunks, one for generation rows) and reads back a few ints per row.

Faults stay with the request that caused them: host work done for one request (its drafts,
its batch row, its bookkeeping, its output) that raises finishes that request alone with
finish_reason "error"; the step goes on for the others. Only a failure of the device step
itself fails every request that holds K/V on the device -- the donated state cannot be
trusted after it -- and the engine carries on with a fresh state for the waiting ones.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from specjax.core.steps import runs_on_device
from specjax.engine.allocator import BlockAllocator
from specjax.engine.bookkeeper import Bookkeeper, DispatchedStep, GenerationRow
from specjax.engine.config import (EngineConfig, EngineSnapshot,  # noqa: F401 (re-export)
                                   bucket, for_model, free_memory, kv_sizing)
from specjax.engine.costs import CostTable, measure
from specjax.engine.executor import Executor
from specjax.engine.grammar import Grammars, check_guided
from specjax.engine.hidden_states import HiddenStateRecorder
from specjax.engine.output import OutputProcessor
from specjax.engine.prefix_cache import PrefixCachePolicy, pool_lookahead, rewrites_committed
from specjax.engine.request import Request, RequestOutput, Status
from specjax.engine.scheduler import Scheduler
from specjax.engine.stats import EngineStats
from specjax.models.llama import Llama
from specjax.sampling_params import SamplingParams
from specjax.speculative.build import build_speculation
from specjax.speculative.config import SpeculativeConfig
from specjax.speculative.cost_model import AcceptanceModel, candidate_lengths, choose_draft_len
from specjax.speculative.defaults import resolve_auto
from specjax.tokenizer import Tokenizer
from specjax.validation import check_draft_tokens, check_request

log = logging.getLogger("specjax.engine")
# Every this many generation steps the cost model runs, for EXPLORE_STEPS steps, the draft
# length whose real cost it observed longest ago (`CostTable.stalest`) instead of its
# choice, so no length's cost or acceptance estimate goes stale -- a request whose text
# turned repetitive, sampled rows that cost more than the warm-up's empty batches. A step's
# cost is observed only after a step of the same shape (`_observe_cost`): several in a row.
EXPLORE_EVERY = 128
EXPLORE_STEPS = 3


class Engine:
    def __init__(self, model: Llama, tokenizer: Tokenizer | None = None,
                 config: EngineConfig = EngineConfig(), seed: int | None = None,
                 speculative_config: SpeculativeConfig | None = None):
        mc = model.config
        config, tp, self.max_len = for_model(config, mc)
        self.config, self.model_config, self.tokenizer = config, mc, tokenizer
        # AUTO: a Llama instance ships no drafter, so the heuristic decides (LLM resolves it
        # first with the model's name).
        speculative_config = resolve_auto(speculative_config, None, config.max_batch_size)
        self.speculation = spec = build_speculation(speculative_config, model, self.max_len)
        self.stats = EngineStats()
        self.gate = spec.make_gate()
        self.recorder = (HiddenStateRecorder(spec.save_hidden_states, spec.save_layers)
                         if spec.save_hidden_states else None)
        blocks_per_seq, num_blocks = kv_sizing(config, spec, self.max_len, mc, free_memory())
        self.allocator = BlockAllocator(num_blocks, config.tokens_per_block, pool_lookahead(spec.worker))
        self.prefix_cache = (PrefixCachePolicy(self.allocator, self.stats,
                                               prefill_only=not rewrites_committed(spec.worker),
                                               recording=self.recorder is not None)
                             if config.enable_prefix_cache else None)
        self.scheduler = Scheduler(self.allocator, config.max_batch_size, config.prefill_chunk,
                                   config.max_prefill_rows, spec.max_draft_len, spec.drafts_in_step,
                                   on_preempt=self._on_preempt, verify_len=spec.verify_len,
                                   prefix_cache=self.prefix_cache)
        # Generation ends at the model's end-of-text ids and at every end-of-turn id its
        # tokenizer declares (a chat model's <|im_end|>, <|eot_id|>).
        self.eos_token_ids = tuple(dict.fromkeys(
            mc.eos_token_ids + (tokenizer.eos_token_ids if tokenizer is not None else ())))
        # Structured output needs the tokenizer: grammars are compiled against its vocabulary.
        self.grammars = (None if tokenizer is None else
                         Grammars(tokenizer, mc.vocab_size, self.eos_token_ids))
        self.executor = Executor(model, spec, config, max_len=self.max_len,
                                 blocks_per_seq=blocks_per_seq, num_blocks=num_blocks,
                                 allocator=self.allocator, tp=tp, grammars=self.grammars,
                                 stats=self.stats)
        # The cost model (`specjax.speculative.cost_model`): the default wherever no
        # `draft_len_schedule` is configured; it needs measured step costs (`warmup`,
        # `measure_costs`), and verifies the configured length where none are.
        self.costs = CostTable()
        self.adaptive = spec.drafting and spec.config.schedule is None
        self.acceptance = (AcceptanceModel(spec.max_draft_len, getattr(
            spec.config, "confidence_scheduling", False)) if spec.drafting else None)
        self.candidates = candidate_lengths(spec.max_draft_len, spec.tree is not None)
        self.pinned_draft_len: int | None = None  # an experiment's fixed length (benches)
        self._since_explore, self._exploring = 0, None
        self._current: int | None = None   # the cost model's last choice (not exploring)
        self._explored = False   # the last choice was an exploration
        self._last_read: tuple[float, int, tuple[int, int]] | None = None  # time, id, shape
        self._prefill_since_read = False
        self.bookkeeper = Bookkeeper(self.allocator, self.stats, spec.rewinds, self.gate,
                                     self.recorder, self.prefix_cache, self.acceptance)
        self.outputs = OutputProcessor(self.eos_token_ids, tokenizer, self.stats)
        self.overlap = config.overlap_scheduler
        self.requests: dict[int, Request] = {}
        self._advanced: dict[int, Request] = {}
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        self.num_steps = 0

    # -- what the rest of specjax reads ------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def worker(self):
        return self.speculation.worker

    @property
    def state(self):
        """The device state (`specjax.core.EngineState`)."""
        return self.executor.state

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.stats, self.scheduler, self.allocator, self.num_steps)

    def draft_len_for(self, batch_size: int) -> int:
        """The draft length of a generation batch of this size before the cost model's choice
        (0 = plain decoding): the schedule's (or the longest), 0 once the gate has tripped."""
        if self.gate is not None and self.gate.disabled:
            return 0
        return self.speculation.draft_len_for(batch_size)

    def _length_decides_output(self, request: Request) -> bool:
        """Whether this request's tokens depend on the draft lengths its steps verify: a
        sampled request that names its seed (its text must repeat), accepted by rejection
        sampling along a chain or down a tree (the draws consumed depend on where steps
        start). Strict matching emits the target's own (seed, position) draws at any length."""
        spec = self.speculation
        return (request.params.seed is not None and request.params.temperature > 0
                and bool(spec.config.use_rejection_sampling) and spec.worker is not None)

    def step_costs(self, batch_size: int) -> dict[int, float]:
        """draft length -> measured seconds of its step, for the bucket of this batch size
        ({} where that bucket is not measured)."""
        measured = self.costs.for_bucket(bucket(batch_size, self.executor.decode_buckets))
        width = lambda d: self.speculation.verify_len(d) + 1
        return {d: measured[width(d)] for d in self.candidates if width(d) in measured}

    def choose_draft_len(self, requests: list[Request], caps=None,
                         longest: int | None = None) -> int:
        """This step's draft length for these rows: the cost model's choice among the
        measured lengths (up to `longest`; `caps` `[rows]`: drafts each row can verify), or
        `draft_len_for` where there is no choice to make."""
        fixed = self.draft_len_for(len(requests))
        if longest is not None:
            fixed = min(fixed, longest)
        if self.pinned_draft_len is not None and fixed:
            return min(self.pinned_draft_len, self.speculation.max_draft_len)
        if not (self.adaptive and fixed) or any(map(self._length_decides_output, requests)):
            return fixed
        costs = self.step_costs(len(requests))
        if longest is not None:
            costs = {d: t for d, t in costs.items() if d <= longest}
        if 0 not in costs or len(costs) < 2:
            return fixed if longest is None else min(fixed, longest)
        if longest is not None:  # a host drafter's second look: its proposals are known
            if self._explored:   # an exploring step runs the length it explores
                return longest
            survival = self.acceptance.survival([r.request_id for r in requests])
            return choose_draft_len(survival, costs, caps)
        self._since_explore += 1
        self._explored = True
        if self._exploring and self._exploring[1] > 0 and self._exploring[0] in costs:
            self._exploring = (self._exploring[0], self._exploring[1] - 1)
            return self._exploring[0]
        if self._since_explore >= EXPLORE_EVERY:
            self._since_explore = 0
            b = bucket(len(requests), self.executor.decode_buckets)
            width = {self.speculation.verify_len(d) + 1: d for d in costs}
            stalest = self.costs.stalest(b, width)
            self.costs.touch(b, stalest)
            choice = width[stalest]
            self._exploring = (choice, EXPLORE_STEPS - 1)
            return choice
        self._explored = False
        survival = self.acceptance.survival([r.request_id for r in requests])
        # A drafter's own confidences move with its drafts step by step, and a block drafted
        # at full width makes a switch between draft lengths free: the hysteresis holds only
        # against leaving plain decoding, whose step drafted nothing for the next to verify.
        current = self._current
        if self.acceptance.drafter_confidence and current:
            current = None
        self._current = choose_draft_len(survival, costs, caps, current)
        return self._current

    def _overlaps(self, draft_len: int, rows: list[GenerationRow]) -> bool:
        """Whether a generation step of this draft length may be read one call late: its runs
        come from the device, speculation (if it drafts) supports the overlap scheduler, and
        no row is constrained (a grammar's next masks need this step's tokens)."""
        return (self.overlap and runs_on_device(self.worker, draft_len, self.speculation.suffix)
                and (draft_len == 0 or self.speculation.overlap)
                and not any(r.request.grammar is not None for r in rows))

    # -- warm-up -----------------------------------------------------------------------------

    def generation_shapes(self) -> set[tuple[int, int]]:
        """(batch bucket, run width) of every generation step serving can dispatch: with the
        cost model, one per candidate draft length."""
        buckets = self.executor.decode_buckets
        width = lambda d: self.speculation.verify_len(d) + 1
        shapes = {(bucket(n, buckets), width(self.draft_len_for(n)))
                  for n in range(1, self.config.max_batch_size + 1)}
        if self.gate is not None:  # after the gate trips
            shapes |= {(b, 1) for b in buckets}
        if self.adaptive:
            shapes |= {(b, width(d)) for b in buckets for d in self.candidates}
        return shapes

    def warmup(self, progress: bool = True) -> None:
        """Compile every step shape serving can use, so serving itself never compiles, and
        measure what each costs (the cost model's table)."""
        self.executor.warmup(self.generation_shapes(), progress)
        if self.adaptive:
            self.measure_costs()

    def measure_costs(self, repeats: int = 7) -> CostTable:
        """Time every compiled generation shape on this machine (`specjax.engine.costs`):
        the table the cost model chooses draft lengths from. Run again after the machine's
        load changes. Compiles any shape not yet compiled."""
        if self.executor.inflight is not None:
            self._drain()
        self.costs = measure(self.executor.run_empty, self.generation_shapes(), repeats)
        self.stats.step_costs = self.costs
        log.info("generation step costs:\n%s", self.costs.format())
        return self.costs

    # -- requests ----------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the argument if this request cannot be served (the checks
        of `specjax.validation`, shared with `SamplingParams` and the server)."""
        check_request(prompt_ids, params, SamplingParams, self.model_config.vocab_size,
                      self.max_len)
        check_guided(self.grammars, params)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        self.validate(prompt_ids, params)
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        request = Request(request_id, [int(t) for t in prompt_ids], params, seed,
                          max_len=min(self.max_len, len(prompt_ids) + params.max_tokens))
        if params.guided is not None:
            request.grammar = self.grammars.matcher(params)
        self.requests[request_id] = request
        self.scheduler.waiting.append(request)
        return request_id

    def abort(self, request_id: int) -> None:
        """Cancel a request wherever it is; its KV blocks and slot are freed at once."""
        request = self.requests.get(request_id)
        if request is not None and request.status is not Status.FINISHED:
            self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        # An unread step whose rows have all finished is no work: its results are dropped.
        return bool(self.waiting or self.running)

    # -- one iteration -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, schedule, run, and update. Returns outputs of requests that advanced or
        finished (a request whose own work failed finishes with finish_reason "error").

        With the overlap scheduler the generation step dispatched here is read in the next
        call, while the device runs that call's step; the host then sees results one step
        late, so KV reservations cover the unread step's largest possible advance too.
        """
        start = time.perf_counter()
        self._advanced = {}
        self.executor.start_slots(self.scheduler.admit())
        prefill = self.scheduler.schedule_prefill()
        rows, draft_len = self._schedule_generation()
        # Making room for generation rows may have preempted a request scheduled for a prompt
        # chunk above (its blocks are gone): it runs when readmitted, not in this step.
        prefill = [(r, n) for r, n in prefill if r.status is Status.RUNNING]
        try:
            self._run(prefill, rows, draft_len)
        except Exception as e:
            self._device_fault(e)
        self.num_steps += 1
        if self.recorder is not None:
            self.recorder.maybe_flush(self.num_steps, idle=not self.has_unfinished())
        self.stats.step_time += time.perf_counter() - start
        return [r.output() for r in self._advanced.values()]

    def _observe_cost(self, step: DispatchedStep) -> None:
        """What a generation shape really costs: the time from reading one generation step to
        reading the next of the same shape, when no prompt chunk ran between (the caller's
        loop included; with the overlap scheduler that is the device's time for the step
        read, or the host's iteration where the host is slower)."""
        now = time.perf_counter()
        shape = (bucket(len(step.rows), self.executor.decode_buckets), step.verified_len + 1)
        last, self._last_read = self._last_read, (now, step.step_id, shape)
        if (last is None or self._prefill_since_read or step.step_id != last[1] + 1
                or shape != last[2]):  # on a CPU, host and steps share the cores: a step
            self._prefill_since_read = False  # after another shape times a mix of both
            return
        self.costs.observe(*shape, now - last[0])

    def _run(self, prefill: list[tuple[Request, int]], rows: list[GenerationRow],
             draft_len: int) -> None:
        """Dispatch this iteration's steps and apply the results that are due."""
        prefill_out = dispatched = None
        drafts = self.executor.slot_drafts(rows, draft_len)
        if prefill:
            self._prefill_since_read = True
            prefill_out, failed = self.executor.launch_prefill(prefill)
            self._fail_all(failed, "preparing its prompt-chunk row")
        if rows:
            dispatched, failed = self.executor.launch_generation(
                rows, draft_len, self.speculation.verify_len(draft_len), drafts)
            self._fail_all(failed, "preparing its generation row")
        overlap = self._overlaps(draft_len, rows)
        previous = self.executor.take_inflight()
        self.executor.inflight = dispatched if overlap else None
        if previous is not None:  # read step N while step N+1 runs
            self._apply_generation(previous)
        if dispatched is not None and not overlap:
            self._apply_generation(dispatched)
        if prefill:
            self._apply_prefill(prefill, prefill_out)

    def _schedule_generation(self) -> tuple[list[GenerationRow], int]:
        """Rows whose newest token is pending, with their reservations, and the step's runtime
        draft length."""
        candidates = self.scheduler.generation_candidates()
        draft_len = self.choose_draft_len(candidates) if candidates else 0
        if (not runs_on_device(self.worker, draft_len, self.speculation.suffix)
                or any(r.grammar is not None for r in candidates)):
            # A host drafter needs every token so far, and so does a grammar's next masks.
            self._drain()
            candidates = [r for r in candidates if r.status is Status.RUNNING]
        forced = self._forced_len(candidates)
        draft_len = max(draft_len, forced)
        reserve = self.scheduler.reserve_for(draft_len)
        unread = self.executor.unread_advance
        positions = lambda r: max(0, r.num_computed + unread(r) + reserve
                                  - self.allocator.length(r.request_id))
        if (self.executor.inflight is not None
                and self.scheduler.blocks_needed(candidates, positions)
                > self.allocator.num_free_blocks):
            self._drain()  # exact lengths free the unread step's worst-case reservation
            candidates = [r for r in candidates if r.status is Status.RUNNING]
        rows = []
        drafter = self.speculation.drafter
        reserved = []
        for request in self.scheduler.reserve(candidates, positions):
            if draft_len and drafter is not None:
                try:
                    request.draft_tokens = self._propose(drafter, request, draft_len)
                except Exception as e:
                    self._fail(request, "drafting for it", e)
                    continue
            room = request.max_len - request.num_tokens - 1
            reserved.append((request, max(0, min(len(request.draft_tokens), draft_len, room))))
        if draft_len and drafter is not None and reserved and self.adaptive:
            # A host drafter's proposals are known now: choose again, counting only the
            # drafts each row has (a row without a match gains nothing from a longer step).
            caps = np.asarray([n for _, n in reserved])
            draft_len = max(self.choose_draft_len([r for r, _ in reserved], caps, draft_len),
                            forced)
        for request, drafted in reserved:
            held = request.drafts_held
            if drafter is not None:
                held, drafted = drafted, min(drafted, draft_len)
            request.drafts_held = draft_len  # what this step drafts for the next (in-step)
            rows.append(GenerationRow(request, reserve, drafted, proposed=held))
        return rows, draft_len

    def _forced_len(self, candidates: list[Request]) -> int:
        """The most tokens a row's grammar forces next (capped at the longest chain), where
        the cost model chooses lengths: the step verifies them whatever it chose, since they
        are accepted unless the target spells the same text otherwise, and a step of 1 + k
        tokens costs less than k + 1 steps. Not for trees (a tree's run is its nodes), nor
        where a schedule, the gate or a pinned length decides."""
        D = self.speculation.max_draft_len
        if (not self.adaptive or self.speculation.tree is not None
                or self.pinned_draft_len is not None or not candidates
                or not self.draft_len_for(len(candidates))):
            return 0
        return max((len(r.grammar.forced(D)) for r in candidates if r.grammar is not None),
                   default=0)

    def _propose(self, drafter, request: Request, draft_len: int) -> list[int]:
        """A host drafter's proposal, checked before it can reach a device array."""
        t0 = time.perf_counter()
        try:
            drafts = drafter.propose_for(request.request_id, request.all_ids, draft_len)
            return check_draft_tokens(drafts, draft_len, self.model_config.vocab_size)
        finally:
            self.stats.draft_time += time.perf_counter() - t0

    def _drain(self) -> None:
        """Read the unread step now (before a host drafter looks, or to free reservations)."""
        step = self.executor.take_inflight()
        if step is not None:
            try:
                self._apply_generation(step)
            except Exception as e:
                self._device_fault(e)

    def _apply_generation(self, step: DispatchedStep) -> None:
        if self.adaptive:
            self._observe_cost(step)
        advanced, gate_tripped, failed = self.bookkeeper.apply(step)
        self._fail_all(failed, "settling its generation step")
        for request, tokens, logprobs in advanced:
            self._emit(request, tokens, logprobs)
        if gate_tripped:
            for request in self.running:
                request.draft_tokens = []

    def _apply_prefill(self, rows: list[tuple[Request, int]], out) -> None:
        advanced, failed = self.bookkeeper.apply_prefill(rows, out)
        self._fail_all(failed, "settling its prompt chunk")
        for request, tokens, logprobs in advanced:
            # A prompt's last chunk drafts the longest length for the first generation step.
            request.drafts_held = self.speculation.max_draft_len
            self._emit(request, tokens, logprobs)

    def _emit(self, request: Request, tokens: list[int],
              logprobs: list[dict[int, float]] | None = None) -> None:
        try:
            reason = self.outputs.append(request, tokens, logprobs)
            if self.prefix_cache is not None:
                self.prefix_cache.publish(request)
        except Exception as e:
            self._fail(request, "processing its output", e)
            return
        if reason is not None:
            self._finish(request, reason)
        self._advanced[request.request_id] = request

    def _on_preempt(self, request: Request) -> None:
        self.stats.num_preemptions += 1
        if self.recorder is not None:
            self.recorder.drop(request)

    # -- failures ----------------------------------------------------------------------------

    def _fail(self, request: Request, doing: str, error: BaseException) -> None:
        """Finish one request whose own host work raised; the others go on."""
        log.error("request %d failed while %s", request.request_id, doing, exc_info=error)
        if request.status is Status.FINISHED:
            return
        request.error = f"failed while {doing}: {type(error).__name__}: {error}"[:500]
        self._finish(request, "error")

    def _fail_all(self, failed: list[tuple[Request, Exception]], doing: str) -> None:
        for request, error in failed:
            self._fail(request, doing, error)

    def _device_fault(self, error: BaseException) -> None:
        """A step failed as a whole: fail every request holding K/V on the device, start a
        fresh device state; waiting requests (they hold none) are served as usual."""
        log.error("a device step failed; failing %d running request(s)", len(self.running),
                  exc_info=error)
        self.executor.reset()
        self.allocator.clear_cache()  # the blocks' contents went with the old state
        message = f"the device step failed: {type(error).__name__}: {error}"[:500]
        for request in list(self.running):
            request.error = message
            self._finish(request, "error")

    def _finish(self, request: Request, reason: str) -> None:
        # Blocks and slot go back first, whatever the hooks below do.
        self.scheduler.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.stats.num_failed_requests += reason == "error"
        self.requests.pop(request.request_id, None)
        self._advanced[request.request_id] = request
        request.stats.finish_time = time.perf_counter()
        hooks = [self.outputs.finish]
        if self.acceptance is not None:
            hooks.append(lambda r: self.acceptance.forget(r.request_id))
        if self.prefix_cache is not None:
            hooks.append(self.prefix_cache.forget)
        if self.speculation.drafter is not None:
            hooks.append(lambda r: self.speculation.drafter.on_request_finished(r.request_id))
        if self.recorder is not None:
            hooks.append(self.recorder.finish)
        for hook in hooks:
            try:
                hook(request)
            except Exception as e:  # the request is over either way; say why it went wrong
                log.error("finishing request %d failed", request.request_id, exc_info=e)
                if reason != "error":
                    request.finish_reason = reason = "error"
                    self.stats.num_failed_requests += 1
                    request.error = f"failed while finishing: {type(e).__name__}: {e}"[:500]
