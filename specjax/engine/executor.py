"""The device as the host loop sees it: parameters, state, the compiled steps, padded batches,
and the generation step in flight.

`launch_*` pads rows into a batch bucket and dispatches a step asynchronously (JAX async
dispatch); its small outputs start their device-to-host copies at once. A row whose
preparation raises is left as padding and reported with its error, so one request's fault
never stops the others' step. With the overlap scheduler the engine reads a generation step
one call later, while the device runs the next; `unread_advances` tells the scheduler how far
such a step may still move a request.
"""
from __future__ import annotations

import atexit
import logging
import time
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import cpu_matmul
from specjax.core.aux_state import aux_bytes_per_slot
from specjax.core.batch import (PrefillOutput, clear_row, empty_batch, gather_rows,
                                set_request, set_run)
from specjax.core.kv import NULL_BLOCK
from specjax.core.penalties import start_penalties
from specjax.core.sharding import TensorParallel
from specjax.core.state import init_state, split_model
from specjax.core.steps import make_generation_step, make_prefill_step, runs_on_device
from specjax.core.suffix import start_history
from specjax.engine.allocator import BlockAllocator
from specjax.engine.bookkeeper import DispatchedStep, GenerationRow
from specjax.engine.config import (EngineConfig, bucket, local_kv_layers, power_of_two_buckets,
                                   ring_blocks)
from specjax.engine.distributed import Channel, is_leader
from specjax.engine.grammar import Grammars, mask_width
from specjax.engine.programs import Programs
from specjax.engine.progress import tqdm
from specjax.engine.request import Request
from specjax.engine.stats import EngineStats
from specjax.models.llama import Llama
from specjax.speculative.build import Speculation

log = logging.getLogger("specjax.engine")
Failed = list[tuple[Request, Exception]]   # rows that could not be prepared, with the error


class Executor:
    def __init__(self, model: Llama, speculation: Speculation, config: EngineConfig, *,
                 max_len: int, blocks_per_seq: int, num_blocks: int,
                 allocator: BlockAllocator, tp: TensorParallel | None = None,
                 grammars: Grammars | None = None, stats: EngineStats | None = None):
        spec, mc = speculation, model.config
        worker, suffix, save_layers = spec.worker, spec.suffix, spec.save_layers
        graphdef, params = split_model(model, spec.draft_model, fused=tp is None,
                                       scan_layers=config.layers_scanned(),
                                       packed=config.packs_weights())
        local = local_kv_layers(config, mc, tp, max_len)
        widest_run = max(config.prefill_chunk, spec.verify_len(spec.max_draft_len) + 1)
        ring = (dict(ring_layers=local, ring_blocks=ring_blocks(config, mc, widest_run))
                if local else {})
        make_state = lambda: init_state(mc, num_slots=config.max_batch_size,
                                        num_blocks=num_blocks,
                                        tokens_per_block=config.tokens_per_block,
                                        max_draft_len=spec.verify_len(spec.max_draft_len),
                                        worker=worker, suffix=suffix, history_len=max_len,
                                        mesh=None if tp is None else tp.mesh,
                                        recurrent_commit=config.recurrent_commit, **ring)
        if mc.is_hybrid:
            log.info("recurrent state: %.1f KiB per request, %.2f MiB for %d slots (beside "
                     "the K/V pool)", aux_bytes_per_slot(mc) / 1024,
                     aux_bytes_per_slot(mc) * config.max_batch_size / 2**20,
                     config.max_batch_size)
        self.tp = tp
        self.max_len = max_len  # the longest request: a slot start's token buffer
        self.stats = stats
        self.worker, self.suffix, self.grammars = worker, suffix, grammars
        if tp is None:
            # Everything the steps take lives on one device, committed: a jitted step's
            # signature includes whether each argument is committed, so a mix (a head trained
            # in the same process is committed, a loaded one is not) would compile again
            # after warm-up.
            device = jax.devices()[0]
            self.params = jax.device_put(params, device)
            self.make_state = lambda: jax.device_put(make_state(), device)
            if config.packs_weights():
                moved = cpu_matmul.collapse_to_huge_pages(self.params)
                log.info("packed weights: %.0f MB on 2 MiB pages", moved / 1e6)
        else:
            # On a mesh: weights split by the plan, and the state built in place, sharded
            # (a target's pool may not fit one device).
            self.params = tp.put(params, tp.param_shardings(params))
            self.make_state = jax.jit(make_state, out_shardings=tp.state_shardings(
                jax.eval_shape(make_state)))
        self.graphdef = graphdef
        self.state = state = self.make_state()
        # The state's shapes and placements, for compiling steps ahead of their first call
        # (`programs`): never the buffers, which each step donates.
        self._state_spec = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        self.programs = Programs(self._compile)
        self.allocator = allocator
        self.steps = {"prefill": make_prefill_step(graphdef, worker, save_layers, suffix, tp),
                      "generation": make_generation_step(graphdef, worker, save_layers, suffix,
                                                         tp)}
        # Several processes (`specjax.engine.distributed`): process 0 sends every device
        # update to the others before it makes it; they apply it in `follow`.
        self.channel = None
        if jax.process_count() > 1:
            if tp is None or tp.mesh.size != jax.device_count():
                raise ValueError(f"{jax.process_count()} processes run one mesh over all "
                                 f"{jax.device_count()} devices: tensor_parallel_size "
                                 f"{jax.device_count()}")
            self.channel = Channel()
            if is_leader():
                atexit.register(self.close)
        self.blocks_per_seq = blocks_per_seq
        self.spare_slot = state.slots.spare  # the slot padded rows write to
        # The host's copy of each slot's request fields (`set_request`), the spare's row
        # padding; who wrote each row and from which block list (`_request_row`).
        self._rows = empty_batch(self.spare_slot + 1, 1, blocks_per_seq, self.spare_slot)
        self._row_owner: list[Request | None] = [None] * (self.spare_slot + 1)
        self._row_version = [-1] * (self.spare_slot + 1)
        self.prefill_chunk = config.prefill_chunk
        self.decode_buckets = config.decode_buckets
        self.prefill_buckets = power_of_two_buckets(config.max_prefill_rows)
        self.inflight: DispatchedStep | None = None
        self._step_id = 0

    # -- dispatch ----------------------------------------------------------------------------


    def target_view(self) -> nnx.Module | None:
        """The target as the steps hold it (q/k/v and gate/up fused; on a CPU unrolled), over
        the very same arrays, where that layout is a model like any other: quantized or
        unpacked projections on one device. None where the kernel took float weights packed
        (`packed_for_cpu`), or a mesh split them. `LLM` keeps this rather than the model it
        loaded, so a model's weights are held once, not twice."""
        if self.tp is not None or any(
                jnp.issubdtype(a.dtype, jnp.floating) and a.ndim >= 3
                for a in jax.tree.leaves(self.params.target)):
            return None
        return nnx.merge(self.graphdef, self.params.target)
    def launch_prefill(self, rows: list[tuple[Request, int]]) -> tuple[PrefillOutput, Failed]:
        """Prompt chunks: each request's next `n` tokens from its first one not in the pool.
        Returns the step's output and the rows that could not be prepared."""
        runs = []
        for request, n in rows:
            start = request.num_computed
            end = start + n
            runs.append((request, request.tokens(start, end),
                         request.token_at(end) if end < request.num_tokens else -1))
        return self._launch("prefill", runs, self.prefill_chunk, self.prefill_buckets)

    def mask_shape(self, width: int, kind: str) -> tuple[int, int] | None:
        """Token masks of a batch: one per verified position (prefill: the sampled one)."""
        if self.grammars is None:
            return None
        return (1 if kind == "prefill" else width, mask_width(self.grammars.vocab_size))

    def launch_generation(self, rows: list[GenerationRow], draft_len: int,
                          verify_len: int | None = None, slot_drafts=None
                          ) -> tuple[DispatchedStep, Failed]:
        """[newest token, host drafts] per row (steps that read runs from the device take them
        from slot state); each request remembers this step's reservation and largest advance.
        `verify_len`: drafts verified after the newest token (a tree's nodes; default
        `draft_len`); `slot_drafts`: constrained rows' device drafts (`slot_drafts`, read
        before the step's prompt chunks). Returns the step and the rows that could not be
        prepared."""
        verify_len = draft_len if verify_len is None else verify_len
        runs = [(row.request, [row.request.last_token] + row.request.draft_tokens[:row.drafted],
                 -1) for row in rows]
        self._step_id += 1
        out, failed = self._launch("generation", runs, verify_len + 1, self.decode_buckets,
                                   slot_drafts)
        step = DispatchedStep(self._step_id, rows, draft_len, out, verify_len)
        for row in rows:
            request = row.request
            request.latest_step, request.latest_reserve = step.step_id, row.reserve
            request.latest_advance = draft_len + 1
        return step, failed

    def _launch(self, kind: str, runs: list[tuple[Request, list[int], int]], width: int,
                buckets: tuple[int, ...], slot_drafts=None):
        """Row i of the batch is runs[i]; a run whose row cannot be written stays padding (it
        computes nothing and its outputs are ignored) and is returned with its error."""
        slots = np.full(bucket(len(runs), buckets), self.spare_slot, np.int32)
        failed: Failed = []
        for i, (request, _, _) in enumerate(runs):
            try:
                self._request_row(request)
                slots[i] = request.slot
            except Exception as e:   # stays padding: the spare slot's row
                failed.append((request, e))
        batch = gather_rows(self._rows, slots, width, self.mask_shape(width, kind))
        unprepared = {id(r) for r, _ in failed}
        for i, (request, run, next_token) in enumerate(runs):
            if id(request) in unprepared:
                continue
            try:
                set_run(batch, i, run=run, start_pos=request.num_computed, next_token=next_token,
                        prompt_logprobs=request.wants_prompt_logprobs)
            except Exception as e:
                clear_row(batch, i, self.spare_slot)
                failed.append((request, e))
        if batch.token_mask is not None:
            t0 = time.perf_counter()
            failed += self._fill_masks(batch, kind, runs, {id(r) for r, _ in failed},
                                       slot_drafts)
            if self.stats is not None:
                self.stats.mask_time += time.perf_counter() - t0
        out = self._update("step", kind, batch)
        # Start the small device->host copies now, unblocked; log-probabilities only where a
        # row asked for them (the arrays exist either way).
        not_asked = {"logprobs": not batch.logprobs.any(),
                     "prompt_logprobs": not batch.prompt_logprobs.any()}
        for leaf in jax.tree.leaves(out.replace(**{
                name: None for name, skip in not_asked.items() if skip and hasattr(out, name)})):
            leaf.copy_to_host_async()
        return out, failed

    def _request_row(self, request: Request) -> None:
        """Bring the request's row of the host's slot table up to date (`set_request`): its
        sampling when the slot changes hands, its block table when its blocks changed
        (`BlockAllocator.version`). Steps gather their rows from the table."""
        slot, p = request.slot, request.params
        if self._row_owner[slot] is not request:
            self._row_owner[slot] = None   # half-written while this raises
            self._row_version[slot] = -1
            set_request(self._rows, slot, blocks=(), slot=slot, max_len=request.max_len,
                        seed=request.seed, temperature=p.temperature, top_k=p.top_k,
                        top_p=p.top_p, min_p=p.min_p, logit_bias=p.logit_bias,
                        logprobs=p.logprobs is not None,
                        repetition_penalty=p.repetition_penalty,
                        frequency_penalty=p.frequency_penalty,
                        presence_penalty=p.presence_penalty)
            self._row_owner[slot] = request
        version = self.allocator.version(request.request_id)
        if self._row_version[slot] != version:
            blocks = self.allocator.blocks(request.request_id)
            table = self._rows.block_tables[slot]
            table[len(blocks):] = NULL_BLOCK
            table[:len(blocks)] = blocks
            self._row_version[slot] = version

    def slot_drafts(self, rows: list[GenerationRow], draft_len: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """The drafts the device holds for the next generation step, where a constrained row
        needs them for its masks (None where no row does): slot state's runs `[S+1, D_max+1]`,
        draft counts and (trees) parents, on the host. Read before this iteration's prompt
        chunks are dispatched, so it waits for no step."""
        if not (draft_len and self.grammars is not None
                and runs_on_device(self.worker, draft_len, self.suffix)
                and any(r.request.grammar is not None for r in rows)):
            return None
        t0 = time.perf_counter()
        drafts = self._read_slot_drafts()
        if self.stats is not None:
            self.stats.mask_time += time.perf_counter() - t0
        return drafts

    def _read_slot_drafts(self):
        slots = self.state.slots
        read = lambda x: np.asarray(x.addressable_data(0))
        return (read(slots.run), read(slots.num_drafts),
                None if slots.tree_parents is None else read(slots.tree_parents))

    def _fill_masks(self, batch, kind: str, runs, failed: set[int], slot_drafts) -> Failed:
        """Structured output: each constrained row's token masks (`specjax.engine.grammar`),
        after its committed output and along the drafts it verifies -- the host's, or the
        ones the device holds (`slot_drafts`: constrained rows never leave a step in flight,
        so slot state holds exactly what the step will verify). A row whose masks cannot be
        computed becomes padding and fails alone."""
        rows = [(i, request) for i, (request, _, next_token) in enumerate(runs)
                if request.grammar is not None and id(request) not in failed
                and (kind == "generation" or next_token < 0)]
        if not rows:
            return []
        D = batch.tokens.shape[1] - 1
        device = (kind == "generation" and D > 0
                  and runs_on_device(self.worker, D, self.suffix))
        if device:
            run, num, parents = slot_drafts or self._read_slot_drafts()
        chains, errors = [], []
        for i, request in rows:
            try:
                if kind == "prefill":
                    drafts = []
                elif not device:
                    drafts = list(runs[i][1][1:])
                else:
                    slot = request.slot
                    drafts = run[slot, 1:1 + min(int(num[slot]), D)].tolist()
                    if parents is not None:
                        self.grammars.fill_tree(batch.token_mask, i, request.grammar, drafts,
                                                parents[slot, :len(drafts)].tolist())
                        continue
                forced = request.grammar.forced(D) if kind == "generation" else []
                if len(forced) > len(drafts) or (forced and drafts[:1] != forced[:1]):
                    # The grammar's own continuation replaces the drafter's, which knows
                    # nothing of the grammar (verified like any draft, by strict matching).
                    drafts = forced
                    batch.tokens[i, 1:1 + len(forced)] = forced
                    batch.query_lens[i] = 1 + len(forced)
                    batch.host_runs[i] = True
                chains.append((i, request.grammar, drafts))
            except Exception as e:
                errors.append((i, request, e))
        try:
            self.grammars.fill(batch.token_mask, chains)
        except Exception:  # the batch call failed: find out whose row did, one by one
            for i, grammar, drafts in chains:
                try:
                    self.grammars.fill(batch.token_mask, [(i, grammar, drafts)])
                except Exception as e:
                    errors.append((i, runs[i][0], e))
        for i, request, _ in errors:
            clear_row(batch, i, self.spare_slot)
        return [(request, e) for _, request, e in errors]

    # -- device updates: the only code that changes the state -------------------------------

    def _update(self, op: str, *args):
        """Apply `op` (a `_<op>` method) to the device state; a leader sends it first."""
        if self.channel is not None:
            if not is_leader():
                raise RuntimeError(f"process {jax.process_index()} follows process 0, which "
                                   "serves requests: call follow() here")
            if self.channel.closed:
                raise RuntimeError("this multi-process job was closed: the other processes "
                                   "have stopped")
            self.channel.send((op, args))
        return getattr(self, f"_{op}")(*args)

    def drive(self, fn):
        """Hand the device state to code outside the engine that calls steps of its own (the
        benches' timing of the bare step): `fn(state) -> (state, result)`, and the state it
        returns is the engine's from then on. One process only: others could not follow."""
        if self.channel is not None:
            raise RuntimeError("drive() runs on a single process; this job has several")
        self.state, result = fn(self.state)
        return result

    def _step(self, kind: str, batch):
        self.programs.ensure((kind,) + batch.tokens.shape)
        t0 = time.perf_counter()
        self.state, out = self.steps[kind](self.params, self.state, self._place(batch))
        if self.stats is not None:
            self.stats.dispatch_time += time.perf_counter() - t0
        return out

    def _place(self, tree):
        """Host inputs of a device update: as they are on one device, replicated on a mesh."""
        return tree if self.tp is None else self.tp.replicate(tree)

    # -- slot state the steps do not rebuild -------------------------------------------------

    def start_slots(self, admitted: list[Request]) -> None:
        """Slot state built from a request's tokens that the steps do not rebuild: SA's token
        history (prompt chunks record it, but tokens whose K/V came from the prefix cache pass
        through no chunk) and a penalised request's token counts. One row per call, its
        tokens padded to the longest request: one compile each, done at warm-up."""
        for r in admitted:
            if self.suffix is not None and r.num_computed:
                self.start_history(r.slot, r.tokens(0, r.num_computed))
            if r.params.penalized:
                self.start_penalties(r.slot, r.all_ids, len(r.prompt_ids))

    def _padded(self, tokens: list[int]) -> np.ndarray:
        padded = np.zeros(self.max_len, np.int32)
        padded[:len(tokens)] = tokens
        return padded

    def start_penalties(self, slot: int, tokens: list[int], prompt_len: int) -> None:
        """A penalised request (re)starting in `slot`: `tokens` are its prompt (the first
        `prompt_len`), then what it generated."""
        self._update("start_penalties", slot, self._padded(tokens), prompt_len, len(tokens))

    def _start_penalties(self, slot, tokens, prompt_len, num_tokens) -> None:
        self.programs.ensure(("start_penalties",))
        state = self.state
        self.state = state.replace(penalties=self._pinned(start_penalties(
            state.penalties, *self._penalty_args(slot, tokens, prompt_len, num_tokens))))

    def _penalty_args(self, slot, tokens, prompt_len, num_tokens):
        rows, tokens, lens = self._place((np.asarray([slot], np.int32), tokens[None],
                                          np.asarray([[prompt_len], [num_tokens]], np.int32)))
        return rows, tokens, lens[0], lens[1]

    def start_history(self, slot: int, tokens: list[int]) -> None:
        """SA's token history of a request starting in `slot` whose `tokens` pass through no
        prompt chunk (prefix cache)."""
        self._update("start_history", slot, self._padded(tokens), len(tokens))

    def _start_history(self, slot, tokens, count) -> None:
        self.programs.ensure(("start_history",))
        state = self.state
        self.state = state.replace(suffix=self._pinned(start_history(
            state.suffix, *self._history_args(slot, tokens, count))))

    def _history_args(self, slot, tokens, count):
        return self._place((np.asarray([slot], np.int32), tokens[None],
                            np.asarray([count], np.int32)))

    def _pinned(self, tree):
        """Replicated again on a mesh, so the next step's signature does not change."""
        return tree if self.tp is None else jax.device_put(
            tree, jax.tree.map(lambda _: self.tp.sharding(), tree))

    def reset(self) -> None:
        """Fresh device state after a step failed on the device: a donated state that went
        into a failed step cannot be trusted (or may be gone). Every request that held K/V
        in it must be failed by the caller; waiting requests hold none."""
        self.inflight = None
        self._update("reset_state")

    def _reset_state(self) -> None:
        self.state = self.make_state()

    # -- several processes -------------------------------------------------------------------

    def follow(self) -> None:
        """On a process other than 0: apply process 0's device updates until it stops. A
        failing update is logged and followed by the same recovery process 0 makes (it
        fails the same way on every process, and process 0 then sends a reset)."""
        if self.channel is None or is_leader():
            raise RuntimeError("follow() is for processes other than 0 of a multi-process job")
        while True:
            op, args = self.channel.receive()
            if op == "stop":
                return
            try:
                getattr(self, f"_{op}")(*args)
            except Exception:
                log.exception("device update %r failed on process %d", op, jax.process_index())

    def close(self) -> None:
        """On process 0 of a multi-process job: tell the others to stop (once)."""
        if self.channel is not None and is_leader() and not self.channel.closed:
            self.channel.send(("stop", ()))
            self.channel.closed = True

    # -- the step in flight ------------------------------------------------------------------

    def unread_advances(self, requests: list[Request]) -> list[int]:
        """Tokens a dispatched but unread step may still add to each request."""
        if self.inflight is None:
            return [0] * len(requests)
        step = self.inflight.step_id
        return [r.latest_advance if r.latest_step == step else 0 for r in requests]

    def take_inflight(self) -> DispatchedStep | None:
        step, self.inflight = self.inflight, None
        return step

    # -- warm-up (our stand-in for CUDA-graph capture) ------------------------------------

    def program_keys(self, generation_shapes) -> list[tuple]:
        """Every program serving can run, in the order the first requests need them: prompt
        chunks, slot starts, then the generation shapes ((rows, width) pairs) in the order
        given."""
        keys = [("prefill", rows, self.prefill_chunk) for rows in self.prefill_buckets]
        keys += [("start_penalties",)] + ([("start_history",)] if self.suffix else [])
        return keys + [("generation", rows, width) for rows, width in generation_shapes]

    def warmup(self, generation_shapes, progress: bool = True) -> None:
        """Compile every program in `program_keys(generation_shapes)` now, so serving itself
        never compiles."""
        keys = self.program_keys(generation_shapes)
        for key in tqdm(keys, desc="specjax warm-up", disable=not progress, leave=False):
            if self.channel is None:
                self.programs.ensure(key)
            # Several processes: each compiles as it follows the leader's device updates.
            elif key[0] == "start_penalties":
                self.start_penalties(self.spare_slot, [], 0)
            elif key[0] == "start_history":
                self.start_history(self.spare_slot, [])
            else:
                self.run_empty(key[1], key[2], key[0])

    def warmup_in_background(self, generation_shapes) -> None:
        """Compile every program on a background thread (`Programs.start`) while steps run;
        a step that needs one first compiles it, or waits for the compile under way."""
        if self.channel is not None:
            raise RuntimeError("a multi-process job warms up before serving (warmup())")
        self.programs.start(self.program_keys(generation_shapes))

    def _compile(self, key: tuple) -> None:
        """Lower and compile one program for the shapes of its real arguments."""
        spec = self._state_spec
        if key[0] == "start_penalties":
            start_penalties.lower(spec.penalties, *self._penalty_args(
                self.spare_slot, self._padded([]), 0, 0)).compile()
        elif key[0] == "start_history":
            start_history.lower(spec.suffix, *self._history_args(
                self.spare_slot, self._padded([]), 0)).compile()
        else:
            kind, rows, width = key
            batch = empty_batch(rows, width, self.blocks_per_seq, self.spare_slot,
                                self.mask_shape(width, kind))
            self.steps[kind].lower(self.params, spec, self._place(batch)).compile()

    def run_empty(self, rows: int, width: int, kind: str = "generation") -> None:
        """One step on an all-padding batch of this shape, waited for (compiles it the first
        time; `specjax.engine.costs` times it)."""
        batch = empty_batch(rows, width, self.blocks_per_seq, self.spare_slot,
                            self.mask_shape(width, kind))
        jax.block_until_ready(self._update("step", kind, batch))
