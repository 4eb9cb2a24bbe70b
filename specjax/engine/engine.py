"""The host loop: continuous batching over a paged KV pool, with optional speculation.

`Engine` wires these parts and runs one iteration per `step()`:

    Scheduler          who runs: admission, prompt chunks, generation rows, reservations, preemption
    GenerationPlanner  a generation step's rows, their reservations and host drafts
    DraftLengthPolicy  each generation step's draft length (`specjax.speculative.length_policy`)
    Executor           the device: parameters, state, compiled steps, batches, the step in flight
    Bookkeeper         a generation step's results: accepted counts, KV give-back, statistics, gate
    OutputProcessor    tokens into outputs: stop conditions and text

Per iteration it dispatches at most two jitted steps (prompt chunks, generation rows) over
small padded index arrays and reads back a few ints per row.

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
from specjax.engine.planner import GenerationPlanner
from specjax.engine.prefix_cache import PrefixCachePolicy, pool_lookahead, rewrites_committed
from specjax.engine.request import Request, RequestOutput, Status
from specjax.engine.scheduler import Scheduler
from specjax.engine.stats import EngineStats
from specjax.models.llama import Llama
from specjax.sampling_params import SamplingParams
from specjax.speculative.build import build_speculation
from specjax.speculative.config import SpeculativeConfig
from specjax.speculative.length_policy import DraftLengthPolicy
from specjax.tokenizer import Tokenizer
from specjax.validation import check_request

log = logging.getLogger("specjax.engine")


class Engine:
    def __init__(self, model: Llama, tokenizer: Tokenizer | None = None,
                 config: EngineConfig = EngineConfig(), seed: int | None = None,
                 speculative_config: SpeculativeConfig | None = None):
        mc = model.config
        config, tp, self.max_len = for_model(config, mc)
        self.config, self.model_config, self.tokenizer = config, mc, tokenizer
        self.speculation = spec = build_speculation(speculative_config, model, self.max_len,
                                                    config.layers_scanned(),
                                                    packed=config.packs_weights())
        self.stats = EngineStats(matmul=config.matmul_path())
        log.info("dense projections: %s", self.stats.matmul)
        self.gate = spec.make_gate()
        self.recorder = (HiddenStateRecorder(spec.save_hidden_states, spec.save_layers)
                         if spec.save_hidden_states else None)
        blocks_per_seq, num_blocks = kv_sizing(config, spec, self.max_len, mc, free_memory(), tp)
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
        lengths = self.length_policy = DraftLengthPolicy(
            spec, CostTable(), lambda n: bucket(n, self.executor.decode_buckets), self.gate)
        self.bookkeeper = Bookkeeper(self.allocator, self.stats, spec.rewinds, self.gate,
                                     self.recorder, self.prefix_cache, lengths.acceptance)
        self.planner = GenerationPlanner(self.scheduler, self.allocator, self.executor, spec,
                                         lengths, self.stats, mc.vocab_size, self._drain,
                                         self._fail)
        self.outputs = OutputProcessor(self.eos_token_ids, tokenizer, self.stats)
        self.overlap = config.overlap_scheduler
        self.requests: dict[int, Request] = {}
        self._advanced: dict[int, Request] = {}
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        self.num_steps = 0
        self._measure_pending = False   # a background warm-up's step costs, once compiled

    # -- what the rest of specjax reads ------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def state(self):
        """The device state (`specjax.core.EngineState`)."""
        return self.executor.state

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.stats, self.scheduler, self.allocator, self.num_steps)

    def _overlaps(self, draft_len: int, rows: list[GenerationRow]) -> bool:
        """Whether a generation step of this draft length may be read one call late: its runs
        come from the device, speculation (if it drafts) supports the overlap scheduler, and
        no row is constrained (a grammar's next masks need this step's tokens)."""
        return (self.overlap and runs_on_device(self.speculation.worker, draft_len,
                                                  self.speculation.suffix)
                and (draft_len == 0 or self.speculation.overlap)
                and not any(r.request.grammar is not None for r in rows))

    # -- warm-up -----------------------------------------------------------------------------

    def generation_shapes(self) -> list[tuple[int, int]]:
        """(batch bucket, run width) of every generation step serving can dispatch, in the
        order the first requests need them (`DraftLengthPolicy.shapes`)."""
        return self.length_policy.shapes(self.executor.decode_buckets,
                                         self.config.max_batch_size)

    def warmup(self, progress: bool = True, background: bool = False) -> None:
        """Compile every step shape serving can use, so serving never compiles, and measure
        each one's cost (the cost model's table); `background`: compile while steps run,
        measure once all are compiled (`background_work`)."""
        if background:
            self.executor.warmup_in_background(self.generation_shapes())
            self._measure_pending = self.length_policy.adaptive
            return
        self.executor.warmup(self.generation_shapes(), progress)
        if self.length_policy.adaptive:
            self.measure_costs()

    def background_work(self, idle: bool) -> bool:
        """A background warm-up starts a compile only while the engine is `idle`; once all is
        compiled an idle engine measures the step costs (fixed lengths run until then).
        Returns whether warm-up work is left."""
        programs = self.executor.programs
        programs.idle.set() if idle else programs.idle.clear()
        if idle and self._measure_pending and not programs.compiling:
            self._measure_pending = False
            self.measure_costs()
        return programs.compiling or self._measure_pending

    def measure_costs(self, repeats: int = 7) -> CostTable:
        """Time every compiled generation shape on this machine (`specjax.engine.costs`):
        the table the cost model chooses draft lengths from. Run again after the machine's
        load changes. Compiles any shape not yet compiled."""
        self._drain()
        costs = measure(self.executor.run_empty, self.generation_shapes(), repeats)
        self.length_policy.costs = self.stats.step_costs = costs
        log.info("generation step costs:\n%s", costs.format())
        return costs

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
        rows, draft_len = self.planner.plan()
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

    def _run(self, prefill: list[tuple[Request, int]], rows: list[GenerationRow],
             draft_len: int) -> None:
        """Dispatch this iteration's steps and apply the results that are due."""
        prefill_out = dispatched = None
        drafts = self.executor.slot_drafts(rows, draft_len)
        if prefill:
            self.length_policy.prefill_ran()
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

    def _drain(self) -> None:
        """Read the unread step now (before a host drafter looks, or to free reservations)."""
        step = self.executor.take_inflight()
        if step is not None:
            try:
                self._apply_generation(step)
            except Exception as e:
                self._device_fault(e)

    def _apply_generation(self, step: DispatchedStep) -> None:
        self.length_policy.observe(len(step.rows), step.verified_len, step.step_id)
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
        drafter = self.speculation.drafter
        hooks = [self.outputs.finish, lambda r: self.length_policy.forget(r.request_id),
                 self.prefix_cache and self.prefix_cache.forget,
                 drafter and (lambda r: drafter.on_request_finished(r.request_id)),
                 self.recorder and self.recorder.finish]
        for hook in filter(None, hooks):
            try:
                hook(request)
            except Exception as e:  # the request is over either way; say why it went wrong
                log.error("finishing request %d failed", request.request_id, exc_info=e)
                if reason != "error":
                    request.finish_reason = reason = "error"
                    self.stats.num_failed_requests += 1
                    request.error = f"failed while finishing: {type(e).__name__}: {e}"[:500]
