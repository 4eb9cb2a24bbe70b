"""Run drafting modes at several tensor-parallel sizes on forced CPU devices; print JSON.

Started by tests/engine/test_tensor_parallel.py in a subprocess, so that the rest of the
suite keeps one device: `python -m tests.engine.tp_run '{"modes": [...], "sizes": [2]}'`.
For each mode and size it reports greedy and seeded sampled tokens, acceptance statistics,
compilations after warm-up, whether the pool is full again, and (for the target) each weight's
partition spec with its bytes on one device against its total. Size 1 is always run: it is
what the others must equal.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# The test run's compilation cache (tests/conftest.py), when a test started this.
os.environ.setdefault("SPECJAX_COMPILATION_CACHE", "off")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import LLM, SamplingParams  # noqa: E402
from pallas_kernels.rejection_sampling.reference import sample_inverse_cdf  # noqa: E402
from specjax.core import sharding  # noqa: E402
from specjax.engine.compile_counter import count_compilations  # noqa: E402
from specjax.speculative.config import (DFlashConfig, DraftTargetConfig,  # noqa: E402
                                        DSparkConfig, EagleConfig, MTPConfig, NGramConfig,
                                        PARDConfig, SAConfig)
from tests.spec_checks import full_depth, truncated_copy  # noqa: E402
from tests.speculative.perm_models import (CFG, PROMPTS, eagle_head, mtp_heads,  # noqa: E402
                                           perm_target)

# Four KV heads, so that 2 and 4 devices both split them; 5 layers instead of the perm target's
# 8 (every layer is split alike, and the steps compile in about half the time), where every
# drafter below still has drafts both accepted and rejected. EAGLE-3's default capture layers
# need more than 5 layers: these are its default's pattern (1, L//2 - 1, L - 4 = 1, 3, 4 at 8).
TP_CFG = CFG.replace(num_kv_heads=4, num_layers=5)
CAPTURE = (1, 2, 3)
MAX_TOKENS = 16


# The bundled target (2 KV heads: 1 or 2 devices) with its shipped, trained drafters, on code.
BUNDLED_MODES = {"bundled_plain": lambda: None,
                 "bundled_pard": lambda: PARDConfig(max_draft_len=3,
                                                    speculative_model="bundled-pard"),
                 "bundled_dflash": lambda: DFlashConfig(max_draft_len=3,
                                                        speculative_model="bundled-dflash"),
                 "bundled_dspark": lambda: DSparkConfig(max_draft_len=3,
                                                        speculative_model="bundled-dspark")}
CODE = ["def fibonacci(n):\n", "import os\n\nfor root, dirs, files in os.walk(",
        "class Stack:\n    def __init__(self):\n", "def add(a, b):\n    return", "# sort\n"]


def speculation(mode, target, perm):
    if mode in BUNDLED_MODES:
        return BUNDLED_MODES[mode]()
    return {
        "plain": lambda: None,
        "ngram": lambda: NGramConfig(max_draft_len=3),
        "sa": lambda: SAConfig(max_draft_len=3),
        "draft_target": lambda: DraftTargetConfig(max_draft_len=3,
                                                  speculative_model=truncated_copy(target, 2)),
        "eagle3": lambda: EagleConfig(max_draft_len=3, speculative_model=eagle_head(target, perm),
                                      eagle3_layers_to_capture=CAPTURE),
        "mtp": lambda: MTPConfig(max_draft_len=3, num_nextn_predict_layers=1,
                                 speculative_model=mtp_heads(1, cfg=target.config)),
        "tree": lambda: EagleConfig(max_draft_len=3, use_dynamic_tree=True,
                                    dynamic_tree_max_topK=2, max_total_draft_tokens=6,
                                    speculative_model=eagle_head(target, perm),
                                    eagle3_layers_to_capture=CAPTURE),
    }[mode]()


def placement(llm) -> dict:
    """Each target weight (the stacked layers `[L, ...]`, or each unrolled layer's, embedding,
    head) and the pool: spec, bytes on one device, total bytes."""
    executor = llm.engine.executor
    target = executor.params.target
    layers = target["layers"]
    if "input_norm" not in layers:  # unrolled (the CPU default): one weight set per layer
        layers = {f"{i}.{k}": v for i, layer in layers.items() for k, v in layer.items()}
    named = {**{f"layers.{k}": v for k, v in layers.items()},
             **{k: v for k, v in target.items() if k != "layers"},
             "kv_pool.k": executor.state.target.k}
    return {name: dict(spec=str(tuple(a.sharding.spec)),
                       local=int(a.addressable_shards[0].data.nbytes), total=int(a.nbytes))
            for name, a in named.items()}


def run(mode: str, size: int, target, perm) -> dict:
    bundled = mode in BUNDLED_MODES
    spec = speculation(mode, target, perm)
    if spec is not None and spec.max_draft_len:  # one length: these runs compare device
        # counts, and warm-up would otherwise compile every length the cost model may pick
        spec = full_depth(spec)
    # One generation batch shape and one prompt row per prefill step: warm-up compiles one
    # program of each (5 prompts for 4 rows: one request waits for a free row).
    llm = LLM("bundled" if bundled else target, speculative_config=spec,
              max_batch_size=4, batch_sizes=(4,), max_model_len=128 if bundled else 64,
              tokens_per_block=4, prefill_chunk=8 if not bundled else 32, max_prefill_rows=1,
              tensor_parallel_size=size, seed=0, progress=False, warmup=True)
    prompts = CODE if bundled else PROMPTS
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=10 + i)
               for i in range(len(prompts))]
    with count_compilations() as compiles:
        greedy = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        stats = llm.stats
        drafted, accepted = stats.drafted_tokens, stats.accepted_draft_tokens
        draws = llm.generate(prompts, sampled)
        # Penalties start from the prompt on the device (`Executor.start_penalties`);
        # log-probabilities come from sharded logits.
        penalised = llm.generate(prompts[:2], SamplingParams(
            max_tokens=MAX_TOKENS, presence_penalty=0.5, repetition_penalty=1.3, logprobs=2))
    allocator = llm.engine.allocator
    return dict(greedy=[o.token_ids for o in greedy], sampled=[o.token_ids for o in draws],
                penalised=[o.token_ids for o in penalised],
                logprobs=[[sorted(e.items()) for e in o.logprobs] for o in penalised],
                drafted=drafted, accepted=accepted, compiles_after_warmup=compiles(),
                pool_full=allocator.num_free_blocks == allocator.total_blocks,
                placement=placement(llm) if size > 1 else None)


def refusals(target) -> dict:
    """What a user is told for sizes that cannot work (before anything compiles)."""
    out = {}
    for size in (3, 8):
        try:
            LLM(target, tensor_parallel_size=size, progress=False)
            out[str(size)] = None
        except ValueError as e:
            out[str(size)] = str(e)
    return out


def boundary_draws(rows: int = 512, vocab: int = 4096) -> dict:
    """Inverse-CDF draws from softmax(logits) with each row's uniform on a CDF boundary (as
    one device adds it up), logits split by vocabulary over 2 devices: how many differ from
    one device's, taken split as they are and through `whole_vocab`."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    draw = lambda x, u: sample_inverse_cdf(jax.nn.softmax(x, axis=-1), u)  # noqa: E731
    cdf = np.asarray(jax.jit(lambda x: jnp.cumsum(jax.nn.softmax(x, axis=-1), axis=-1))(logits))
    at = rng.integers(0, vocab // 2, rows)
    u = (cdf[np.arange(rows), at] / cdf[:, -1]).astype(np.float32)
    one = np.asarray(jax.jit(draw)(logits, u))
    tp = sharding.TensorParallel(sharding.make_mesh(2))
    split = tp.put(logits, tp.sharding(jax.sharding.PartitionSpec(None, sharding.TP)))

    def whole(x, u):
        with sharding.tracing(tp):
            return draw(sharding.whole_vocab(x), u)
    return {"split": int(np.sum(np.asarray(jax.jit(draw)(split, u)) != one)),
            "whole_vocab": int(np.sum(np.asarray(jax.jit(whole)(split, u)) != one))}


def main(spec: dict) -> dict:
    target, perm = perm_target(TP_CFG)
    out = {"devices": len(jax.devices()), "refusals": refusals(target),
           "boundary_draws": boundary_draws()}
    for mode in spec["modes"]:
        out[mode] = {str(size): run(mode, size, target, perm)
                     for size in [1] + [s for s in spec["sizes"] if s != 1]}
    return out


if __name__ == "__main__":
    print("TP_RESULT " + json.dumps(main(json.loads(sys.argv[1]))))
