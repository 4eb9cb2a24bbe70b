"""The device side of specjax, and its public step API.

Everything here is pure JAX over fixed-shape arrays; the host loop (`specjax.engine`) only builds
batches, calls the steps and reads their small outputs. To drive the steps from your own code:

    graphdef, params = split_model(target, draft_module)          # Params: traced arguments
    state = init_state(target.config, num_slots=..., num_blocks=..., tokens_per_block=...,
                       max_draft_len=D, worker=worker)              # EngineState: donated
    prefill = make_prefill_step(graphdef, worker)                  # jitted, cached
    generate = make_generation_step(graphdef, worker)
    batch = empty_batch(rows, width, blocks_per_seq, spare_slot=num_slots)
    set_row(batch, 0, run=prompt_ids, start_pos=0, blocks=[1, 2, 3], slot=0, max_len=...)
    state, out = prefill(params, state, batch)                     # out.tokens [B]
    state, out = generate(params, state, batch_of_width_D_plus_1)  # out.new_tokens [B, D+1]

`worker` is None for plain decoding and host drafters (NGram, your own): then a generation
batch of width D+1 > 1 carries [newest token, drafts] per row. A tree worker's generation
batches are 1 + T wide (T = `worker.tree.nodes_for(depth)`), and `out.new_tokens` is
`[B, depth+1]` (`specjax.core.tree`). In-step drafters (draft model,
EAGLE-3, MTP) come from `specjax.speculative.build_speculation(config, target)`, and their
steps read each row's run from the device (`runs_on_device`). SA drafts inside the steps
too: pass `suffix=SuffixSpec(...)` to both step makers and to `init_state` (with
`history_len`), alone or beside a worker (the enhancer; `Speculation.suffix` is what a config
gives). `examples/custom_loop.py` drives NGram and EAGLE-3 this way and checks the tokens
against `LLM.generate`.
"""
from specjax.core.accept import rejection_accept, strict_accept, target_tokens
from specjax.core.batch import GenerationOutput, PrefillOutput, StepBatch, empty_batch, set_row
from specjax.core.forward import PagedAttention, paged_forward
from specjax.core.kv import NULL_BLOCK, KVPool, make_kv_pool
from specjax.core.sampling import filter_logits, sample, sampling_keys
from specjax.core.state import (EngineState, Params, SlotState, init_state, make_slot_state,
                                split_model)
from specjax.core.steps import make_generation_step, make_prefill_step, runs_on_device
from specjax.core.suffix import SuffixSpec, SuffixState
from specjax.core.tree import TreeShape, relocate_path, tree_accept, tree_layout
from specjax.core.worker import Drafts, DraftWorker, WorkerDefaults

__all__ = ["Drafts", "DraftWorker", "WorkerDefaults", "EngineState", "GenerationOutput", "KVPool", "NULL_BLOCK",
           "PagedAttention", "Params", "PrefillOutput", "SlotState", "StepBatch", "empty_batch",
           "filter_logits", "init_state", "make_generation_step", "make_kv_pool",
           "make_prefill_step", "make_slot_state", "paged_forward", "rejection_accept",
           "relocate_path", "runs_on_device", "sample", "sampling_keys", "set_row",
           "split_model", "strict_accept", "SuffixSpec", "SuffixState", "target_tokens", "TreeShape", "tree_accept",
           "tree_layout"]
