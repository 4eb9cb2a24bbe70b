"""The two jitted steps: prefill (prompt chunks) and generation (verify, accept, draft).

    prefill    (params, state, batch [B, chunk]) -> (state, PrefillOutput)
    generation (params, state, batch [B, D+1])   -> (state, GenerationOutput)

Generation is one skeleton for chains and trees (`make_generation_step`). Both are pure:
parameters are traced arguments (`Params`), the device state (`EngineState`) is
donated so XLA updates the pools in place, and the static configuration -- the target's graph
definition, the in-step drafter (`DraftWorker`), the layers to save -- is closed over. Each
compiles once per (batch bucket, run width); D comes from the batch's shape, so the generation
step compiles once per runtime draft length. D = 0 is plain decoding: every generation step goes
through the same function.

Both steps end by writing each row's newest token and drafts to the slot state
(`write_slots`), so a generation step can start where the last step ended without a host round
trip (`runs_on_device`): that is what lets the host dispatch step N+1 before reading step N.

With SA (`suffix`, static like the worker) both steps also record each row's committed tokens
in its history (`specjax.core.suffix`) and draft from it: alone (mode SA), or as the enhancer
that replaces the worker's drafts for rows whose context repeats. A sampled row's SA drafts
are accepted by strict matching (`SlotState.strict`): they have no draft distribution.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import backend
from specjax.core import aux_state
from specjax.core.accept import (rejection_accept, strict_accept, target_distributions,
                                 target_tokens)
from specjax.core.batch import GenerationOutput, PrefillOutput, StepBatch
from specjax.core.forward import last_rows, paged_forward
from specjax.core.logits import apply_bias, apply_token_mask, mask_bits, maybe_logprobs
from specjax.core.penalties import chain_context, penalize, record_generated, tree_context
from specjax.core.sampling import sample, sampling_keys
from specjax.core.sharding import TensorParallel, tracing, whole_vocab
from specjax.core.state import EngineState, Params, SlotState, write_slots
from specjax.core.suffix import SuffixSpec, SuffixState, prefer, propose, record, retire
from specjax.core.tree import relocate_path, tree_accept, tree_layout, tree_rejection_accept
from specjax.core.worker import Drafts, DraftWorker, tree_of


def _jit(step, tp: TensorParallel | None, pallas: str | None):
    """The step jitted with its state donated, traced under the kernel choice it was made with
    (`pallas`); with `tp`, its outputs pinned to the shardings its inputs came in with
    (`TensorParallel.pin`), so the next call does not compile."""
    @functools.wraps(step)
    def traced(params: Params, state: EngineState, batch: StepBatch):
        with backend.forcing(pallas), tracing(tp):
            out = step(params, state, batch)
        return out if tp is None else tp.pin(*out)
    return jax.jit(traced, donate_argnums=(1,))


def _cached(make):
    """`make` cached by its arguments -- engines over one model share compiled steps -- and by
    what `SPECJAX_PALLAS` forces when it is called (`backend.forced`), its `pallas` argument:
    a step traces its kernels under that choice, so one made under another is never reused."""
    cached = functools.lru_cache(maxsize=None)(make)

    @functools.wraps(make)
    def made(*args, **kwargs):
        return cached(*args, pallas=backend.forced(), **kwargs)
    made.cache_clear = cached.cache_clear
    return made


def runs_on_device(worker: DraftWorker | None, draft_len: int,
                   suffix: SuffixSpec | None = None) -> bool:
    """Whether a generation step takes its runs from slot state rather than from the host: an
    in-step drafter's (or SA's) drafts exist only on the device, and plain decoding needs
    nothing the device does not hold. Host drafters' drafts come from the host with the batch."""
    return worker is not None or suffix is not None or draft_len == 0


def runs_from_slots(batch: StepBatch, slots: SlotState, D: int) -> StepBatch:
    """Take each row's run from slot state: its newest token and up to D of its drafts. Rows
    the host marked real (query_lens > 0) stay real; padded rows stay empty; rows marked
    `host_runs` keep the run the host wrote."""
    drafts = jnp.minimum(slots.num_drafts[batch.slots], D)
    tokens = slots.run[batch.slots, :D + 1]
    query_lens = jnp.where(batch.query_lens > 0, 1 + drafts, 0)
    if batch.host_runs is not None:  # rows whose run the host wrote keep it
        tokens = jnp.where(batch.host_runs[:, None], batch.tokens, tokens)
        query_lens = jnp.where(batch.host_runs, batch.query_lens, query_lens)
    return batch.replace(tokens=tokens, start_pos=slots.start[batch.slots],
                         query_lens=query_lens)


def clip_to_room(batch: StepBatch) -> StepBatch:
    """Verify no more drafts than the row's `max_lens` leaves room for: a step emits
    drafts + 1 tokens after the newest one, whoever drafted them."""
    room = batch.max_lens - batch.start_pos - 2
    drafts = jnp.clip(jnp.minimum(batch.query_lens - 1, room), 0)
    return batch.replace(query_lens=jnp.where(batch.query_lens > 0, 1 + drafts, 0))


def clip_to_mask(batch: StepBatch) -> StepBatch:
    """Verify no draft past the first one the row's grammar forbids (structured output): row j
    of `token_mask` is the mask after the drafts before draft j + 1, and the host computed
    masks only that far."""
    if batch.token_mask is None or batch.tokens.shape[1] == 1:
        return batch
    D = batch.tokens.shape[1] - 1
    allowed = mask_bits(batch.token_mask[:, :D], batch.tokens[:, 1:])       # [B, D]
    obeyed = jnp.sum(jnp.cumprod(allowed.astype(jnp.int32), axis=1), axis=1)
    drafts = jnp.minimum(batch.query_lens - 1, obeyed)
    return batch.replace(query_lens=jnp.where(batch.query_lens > 0, 1 + drafts, 0))


def target_logits(raw: jax.Array, penalties, batch: StepBatch,
                  context: jax.Array | None = None) -> jax.Array:
    """The target's raw logits `[B, W, V]` as every step decides from them, in one order:
    the rows' logit bias, then penalties (the slots' counts plus, with `context` `[W, R]` or
    `[B, W, R]`, the run's tokens before each position: `chain_context`, `tree_context`), then
    the grammar's masks. Sampling filters come after, where tokens are drawn."""
    biased = apply_bias(raw, batch.bias_ids, batch.bias_values)
    run = None if context is None else batch.tokens
    return apply_token_mask(penalize(biased, penalties, batch, run, context), batch.token_mask)


def _capture_layers(worker: DraftWorker | None, save_layers: tuple[int, ...]) -> tuple[int, ...]:
    return worker.capture_layers if worker is not None else save_layers


def record_prompt_chunk(history: SuffixState, batch: StepBatch, following: jax.Array
                        ) -> SuffixState:
    """A prompt chunk's tokens and the token after it go into each row's history; a row that
    starts a request first hands what its slot held to the global pool."""
    B, C = batch.tokens.shape
    history = retire(history, batch.slots, (batch.start_pos == 0) & (batch.query_lens > 0))
    seq = jnp.concatenate([batch.tokens, jnp.zeros((B, 1), batch.tokens.dtype)], axis=1)
    seq = jnp.where(jnp.arange(C + 1) == batch.query_lens[:, None], following[:, None], seq)
    return record(history, batch.slots, batch.start_pos, seq, batch.query_lens + 1)


@_cached
def make_prefill_step(graphdef: nnx.GraphDef, worker: DraftWorker | None = None,
                      save_layers: tuple[int, ...] = (), suffix: SuffixSpec | None = None,
                      tp: TensorParallel | None = None, *, pallas: str | None = None):
    """The jitted prompt-chunk step for targets of this graph definition. Each row's run is a
    chunk of its prompt; the output is the token sampled after each row's run (meaningful for
    rows whose run ends the prompt). An in-step drafter processes the same runs, so its pool
    stays level with the target's, and may draft after a prompt's last chunk; SA records the
    chunk and drafts there too. With `save_layers` the output carries the residual streams
    after those layers. With `tp`, the step runs on its mesh (`specjax.core.sharding`)."""
    capture = _capture_layers(worker, save_layers)

    def prefill(params: Params, state: EngineState, batch: StepBatch
                ) -> tuple[EngineState, PrefillOutput]:
        batch = batch.check()
        model = nnx.merge(graphdef, params.target)
        runs = aux_state.begin(state.aux, batch, verify=False)
        kv_target, hidden, captured = paged_forward(model, state.target, batch, capture,
                                                    aux=runs)
        aux = aux_state.commit(state.aux, runs, batch.slots, batch.query_lens, verify=False)
        raw = whole_vocab(model.logits(last_rows(hidden, batch.query_lens)))
        logits = target_logits(raw[:, None], state.penalties, batch)[:, 0]
        keys = sampling_keys(batch.seeds, batch.start_pos + batch.query_lens)
        tokens = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, keys)
        run, num_drafts, kv_draft = tokens[:, None], jnp.zeros_like(tokens), state.draft
        # The token after each run: the next prompt token, or the one just sampled.
        ends = batch.next_tokens < 0
        following = jnp.where(ends, tokens, batch.next_tokens)
        penalties = state.penalties
        if penalties is not None:  # a prompt's last chunk generates its first token
            penalties = record_generated(penalties, batch.slots, tokens[:, None],
                                         (ends & (batch.query_lens > 0)).astype(jnp.int32))
        logprobs = maybe_logprobs(batch.logprobs, lambda: raw, tokens)
        B, C = batch.tokens.shape
        after = jnp.concatenate([batch.tokens[:, 1:], following[:, None]], axis=1)
        after = jnp.where(jnp.arange(C) == batch.query_lens[:, None] - 1, following[:, None],
                          after)
        prompt_logprobs = maybe_logprobs(batch.prompt_logprobs,
                                         lambda: whole_vocab(model.logits(hidden)),
                                         after)
        tree = tree_of(worker)
        depth = tree.max_depth if tree else state.slots.run.shape[1] - 1
        drafts = num = probs = parents = from_sa = None
        if worker is not None:
            kv_draft, proposed = worker.catch_up(params.draft, kv_draft, batch, model,
                                                 captured, following, depth,
                                                 penalties=penalties)
            if proposed is not None:
                drafts, num = proposed.tokens, proposed.num
                probs, parents = proposed.probs, proposed.parents
        history = state.suffix
        if suffix is not None and worker is not None and drafts is None:
            # The drafter drafts from the first generation step on; SA may already now.
            drafts, num = jnp.zeros((tokens.shape[0], depth), jnp.int32), jnp.zeros_like(tokens)
        if suffix is not None:
            history = record_prompt_chunk(history, batch, following)
            drafts, num, from_sa, parents = prefer(
                suffix, propose(suffix, history, batch.slots, depth), drafts, num, parents)
        if drafts is not None:  # the first generation step verifies these
            run = jnp.concatenate([run, drafts], axis=1)
            num_drafts = jnp.where(ends & (batch.query_lens > 0), num, 0)
        slots = write_slots(state.slots, batch.slots, run, batch.start_pos + batch.query_lens,
                            num_drafts, probs, parents, from_sa)
        return (EngineState(target=kv_target, slots=slots, draft=kv_draft, suffix=history,
                            penalties=penalties, aux=aux),
                PrefillOutput(tokens=tokens, hidden_states=captured if save_layers else None,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs).check(B, C))

    return _jit(prefill, tp, pallas)


def rejection_rows(batch: StepBatch, slots: SlotState) -> tuple[bool, jax.Array]:
    """(whether the step can accept by rejection sampling at all -- decided by shapes:
    without draft distributions acceptance fails closed to strict --, the rows it decides
    `[B]`: sampled rows whose drafts came with a distribution, not SA's (`strict`) nor the
    host's)."""
    rejection = slots.draft_probs is not None and batch.tokens.shape[1] > 1
    rows = batch.temperature > 0 if rejection else jnp.zeros(batch.slots.shape, bool)
    if rejection and slots.strict is not None:
        rows = rows & ~slots.strict[batch.slots]
    if rejection and batch.host_runs is not None:
        rows = rows & ~batch.host_runs
    return rejection, rows


def accept_chain(logits: jax.Array, batch: StepBatch, slots: SlotState
                 ) -> tuple[jax.Array, jax.Array]:
    """A chain's acceptance: strict matching against the target's tokens, and rejection
    sampling for the rows `rejection_rows` picks -> (new_tokens `[B, D+1]`, lens `[B]` =
    accepted + 1)."""
    D = batch.tokens.shape[1] - 1
    rejection, by_rejection = rejection_rows(batch, slots)
    # Rows rejection sampling decides need no strict sample.
    strict_temperature = jnp.where(by_rejection, 0.0, batch.temperature)
    positions = batch.start_pos[:, None] + jnp.arange(D + 1)
    targets = target_tokens(logits, positions, strict_temperature,
                            batch.top_k, batch.top_p, batch.min_p, batch.seeds)
    drafts_in, draft_lens = batch.tokens[:, 1:], batch.query_lens - 1
    new_tokens, lens = strict_accept(drafts_in, draft_lens, targets)
    if rejection:
        new_tokens, lens = rejection_accept(
            logits, batch.replace(temperature=jnp.where(by_rejection, batch.temperature, 0.0)),
            drafts_in, draft_lens, slots.draft_probs[batch.slots, :D], new_tokens, lens)
    return new_tokens, lens


def accept_tree(logits: jax.Array, batch: StepBatch, slots: SlotState, parents: jax.Array,
                layout, depth: int, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A tree's acceptance: the walk that accepts a child holding the target's own token
    (`tree_accept`), and for the rows `rejection_rows` picks, recursive rejection sampling over
    siblings drawn without replacement (`tree_rejection_accept`) -> (new_tokens
    `[B, depth+1]`, lens `[B]`, path `[B, depth+1]`)."""
    rejection, by_rejection = rejection_rows(batch, slots)
    positions = batch.start_pos[:, None] + layout.depths
    targets = target_tokens(logits, positions, jnp.where(by_rejection, 0.0, batch.temperature),
                            batch.top_k, batch.top_p, batch.min_p, batch.seeds)
    walked = tree_accept(batch.tokens, parents, layout, targets, depth)
    if not rejection:
        return walked
    B, W, _ = logits.shape
    T = W - 1

    def sampled():
        drawn = tree_rejection_accept(batch.tokens, parents, layout,
                                      target_distributions(logits, batch),
                                      slots.draft_probs[batch.slots, :T], batch.seeds,
                                      batch.start_pos, depth, top_k)
        return jax.tree.map(lambda r, w: jnp.where(
            by_rejection.reshape(B, *([1] * (r.ndim - 1))), r, w), drawn, walked)

    return jax.lax.cond(jnp.any(by_rejection), sampled, lambda: walked)


@_cached
def make_generation_step(graphdef: nnx.GraphDef, worker: DraftWorker | None = None,
                         save_layers: tuple[int, ...] = (), suffix: SuffixSpec | None = None,
                         tp: TensorParallel | None = None, *, pallas: str | None = None):
    """The jitted generation step: verify each row's run, accept, and -- with an in-step
    drafter or SA -- draft the next one. One skeleton for chains and trees, which differ only
    in their layout, their acceptance and what the worker hands back:

        runs -> target forward -> logits (`target_logits`) -> accept -> commit auxiliary
        state, penalties, SA history -> draft -> write slots

    A chain run is [newest token, D drafts] (padded to D + 1, query_lens = 1 + the row's
    drafts): strict or rejection acceptance (`accept_chain`). A tree run is [newest token,
    T nodes] (T fixes the depth): the tree is verified in one pass, its accepted path walked
    (`tree_accept`) and that path's K/V moved to linear positions. Without a drafter or SA,
    D > 0 runs verify the drafts the host put in the batch."""
    capture = _capture_layers(worker, save_layers)
    tree = tree_of(worker)

    def generation(params: Params, state: EngineState, batch: StepBatch
                   ) -> tuple[EngineState, GenerationOutput]:
        batch = batch.check()
        W = batch.tokens.shape[1] - 1  # drafts per chain, or nodes per tree
        if runs_on_device(worker, W, suffix):
            batch = runs_from_slots(batch, state.slots, W)
        model = nnx.merge(graphdef, params.target)
        if tree is None:
            D, layout = W, None
            batch = clip_to_mask(clip_to_room(batch))
            context = chain_context(W + 1)
        else:
            # A node the grammar forbids is never accepted (its parent's masked token is
            # never it), so a tree needs its nodes' masks but no cut.
            D = tree.depth_for(W)
            verified_parents = state.slots.tree_parents[batch.slots, :W]
            room = batch.max_lens - batch.start_pos - 2  # the deepest node that still fits
            layout = tree_layout(verified_parents, jnp.maximum(batch.query_lens - 1, 0), room, D)
            context = tree_context(layout.ancestors)
        # D = 0 (plain decoding) commits every position it runs: no depth to choose.
        runs = aux_state.begin(state.aux, batch, verify=D > 0)
        kv_target, hidden, captured = paged_forward(model, state.target, batch, capture,
                                                    layout, aux=runs)
        raw = whole_vocab(model.logits(hidden))
        logits = target_logits(raw, state.penalties, batch, context)
        real = batch.query_lens > 0
        if tree is None:
            new_tokens, lens = accept_chain(logits, batch, state.slots)
            verified, emitted_raw = batch.query_lens - 1, lambda: raw
        else:
            new_tokens, lens, path = accept_tree(logits, batch, state.slots, verified_parents,
                                                 layout, D, tree.top_k)
            kv_target = relocate_path(kv_target, batch.start_pos, batch.block_tables, path,
                                      jnp.where(real, lens - 1, 0), batch.slots)
            # The worker reads the accepted rows' hidden states in sequence order, as after
            # a chain; each emitted token's logits row is its node's.
            captured = jnp.take_along_axis(captured, path[None, :, :, None], axis=2)
            deepest = jnp.max(jnp.where(layout.valid, layout.depths, 0), axis=1)
            verified = jnp.where(real, deepest, 0)
            emitted_raw = lambda: jnp.take_along_axis(raw, path[:, :, None], axis=1)  # noqa: E731
        logprobs = maybe_logprobs(batch.logprobs, emitted_raw, new_tokens)
        # The state after the accepted tokens (newest and drafts, not the bonus token):
        # recurrent layers absorbed every draft, so this is their rollback.
        aux = aux_state.commit(state.aux, runs, batch.slots,
                               jnp.where(batch.query_lens > 0, lens, 0), verify=D > 0)
        penalties = state.penalties
        if penalties is not None:
            penalties = record_generated(penalties, batch.slots, new_tokens, lens)
        B = batch.tokens.shape[0]
        proposed, kv_draft = Drafts.every(jnp.zeros((B, 0), jnp.int32)), state.draft
        if worker is not None:
            kv_draft, proposed = worker.draft(params.draft, kv_draft, batch, model, captured,
                                              new_tokens, lens, D, penalties=penalties)
        drafts, num, probs = proposed.tokens, proposed.num, proposed.probs
        parents = proposed.parents
        history, from_sa = state.suffix, None
        if suffix is not None:
            history = record(history, batch.slots, batch.start_pos + 1, new_tokens, lens)
            if D > 0:
                drafts, num, from_sa, parents = prefer(
                    suffix, propose(suffix, history, batch.slots, D),
                    drafts if worker is not None else None, num, parents)
        newest = jnp.take_along_axis(new_tokens, (lens - 1)[:, None], axis=1)
        slots = write_slots(state.slots, batch.slots, jnp.concatenate([newest, drafts], axis=1),
                            batch.start_pos + lens, num, probs, parents, from_sa)
        return (EngineState(target=kv_target, slots=slots, draft=kv_draft, suffix=history,
                            penalties=penalties, aux=aux),
                GenerationOutput(new_tokens, lens, drafts, verified,
                                 captured if save_layers else None, logprobs,
                                 proposed.confidence).check(B, D))

    return _jit(generation, tp, pallas)
