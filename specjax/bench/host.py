"""The host loop's cost per step at large batches: what the engine's Python adds to each
generation step, on a model whose compiled step is small enough to expose it.

Per batch size B (one engine of max_batch_size = the largest): B requests of --prompt-len
random tokens are admitted and prefilled; once all B decode together, --steps engine steps
run back to back (the overlap scheduler as users get it: 'step ms'), then --steps more each
begun with the device idle -- the step in flight and the state waited for outside the
timing -- so that 'host ms' is the host's own work per step, whatever the overlap hides: the
median of those `Engine.step()` calls. 'dispatch ms' is the part of it inside the jitted
call (JAX's argument handling and launch: `EngineStats.dispatch_time`), 'compiled ms' the
compiled step alone at the same batch and position. The requests are aborted after, and the
KV pool must be whole again.

The default model is a tiny random Llama (`--model tiny`): its step costs well under a
millisecond at batch 1, so the host's share is what is left. `--model bundled` (or a
checkpoint) gives the same figures where the step does real work; `--speculative-config`
adds a drafting mode's host work (a host drafter proposes per request; in-step drafters add
almost none).
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from flax import nnx

from specjax.analysis.timing import cpu_name, time_generation_steps
from specjax.bench.table import Column, Table
from specjax.llm import LLM
from specjax.models import Llama, ModelConfig
from specjax.sampling_params import SamplingParams
from specjax.speculative.defaults import parse_speculative_config

# A Llama small enough that the host dominates its step on any machine.
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                   eos_token_id=None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (a random 2-layer Llama, d=64: the host's cost laid "
                             "bare), 'bundled', or a checkpoint folder or name")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 256],
                        help="batch sizes to time, one row each")
    parser.add_argument("--steps", type=int, default=64,
                        help="steps timed per batch size, in each of the two ways")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per random prompt")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (0: greedy)")
    parser.add_argument("--speculative-config", default=None,
                        help="a --speculative-config value (default: plain decoding)")


def table(steps: int) -> Table:
    return Table([
        Column("batch", "B, requests decoding together", 5, "{}"),
        Column("step ms", f"the engine's time per step, {steps} steps back to back (the overlap "
               "scheduler hides host work behind the device where it can)", 8),
        Column("compiled ms", "the compiled generation step alone, same batch and position", 11),
        Column("host ms", f"median Engine.step() begun with the device idle, over {steps} "
               "steps: the host's own work per step, dispatch included", 8, "{:.3f}"),
        Column("dispatch ms", "of host ms, the time inside the jitted call (JAX's argument "
               "handling and launch)", 11, "{:.3f}"),
        Column("us/row", "(host ms - dispatch ms) / B: the Python per request and step", 6,
               "{:.1f}"),
        Column("host %", "host ms / (compiled ms + host ms): the step's share the host would "
               "take without any overlap", 6, "{:.1%}"),
    ])


def _model(name: str):
    return Llama(TINY, rngs=nnx.Rngs(0)) if name == "tiny" else name


def _decoding(engine, batch: int) -> None:
    """Step until `batch` requests decode together (every prompt prefilled, none waiting)."""
    while engine.waiting or len(engine.running) < batch or not all(
            r.prefilled for r in engine.running):
        engine.step()


def measure(llm: LLM, batch: int, steps: int, prompt_len: int, temperature: float,
            rng: np.random.Generator) -> dict[str, float]:
    """One row's figures (seconds) for `batch` requests decoding together on `llm`."""
    engine = llm.engine
    vocab = llm.model.config.vocab_size
    config = engine.config
    ramp = -(-batch // config.max_prefill_rows) * -(-prompt_len // config.prefill_chunk)
    # None finishes while timed, even accepting every draft.
    tokens = (ramp + 2 * steps + 16) * (engine.speculation.max_draft_len + 1)
    if prompt_len + tokens > engine.max_len:
        raise SystemExit(f"batch {batch}: {prompt_len} + {tokens} tokens exceed the model's "
                         f"{engine.max_len} positions: fewer --steps or a smaller batch")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature)
    ids = [engine.add_request(rng.integers(0, vocab, prompt_len).tolist(), params)
           for _ in range(batch)]
    try:
        _decoding(engine, batch)
        for _ in range(4):
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step = (time.perf_counter() - start) / steps
        host, dispatch = [], []
        for _ in range(steps):
            inflight = engine.executor.inflight
            if inflight is not None:
                jax.block_until_ready(inflight.out)
            jax.block_until_ready(engine.executor.state)
            before = engine.stats.dispatch_time
            start = time.perf_counter()
            engine.step()
            host.append(time.perf_counter() - start)
            dispatch.append(engine.stats.dispatch_time - before)
        position = min(r.num_tokens for r in engine.running)
        if len(engine.running) != batch:
            raise RuntimeError(f"batch {batch}: {len(engine.running)} requests still decode")
    finally:
        for request_id in ids:
            engine.abort(request_id)
        while engine.executor.inflight is not None:
            engine.step()
    if engine.allocator.num_free_blocks != engine.allocator.total_blocks:
        raise RuntimeError("the KV pool is not whole after the requests ended")
    compiled = time_generation_steps(engine, batch, [1], position, iters=20, rounds=2)[0]
    i = int(np.argsort(host)[len(host) // 2])
    return {"step": step, "compiled": compiled, "host": host[i], "dispatch": dispatch[i]}


def run(args: argparse.Namespace) -> None:
    config = (None if args.speculative_config is None else
              parse_speculative_config(args.speculative_config, args.model))
    start = time.perf_counter()
    llm = LLM(_model(args.model), max_batch_size=max(args.batch_sizes),
              max_prefill_rows=min(32, max(args.batch_sizes)), speculative_config=config,
              progress=False, warmup=True, seed=0)
    cfg = llm.model.config
    print(f"model: {args.model} ({cfg.num_params / 1e6:.2f}M parameters, {cfg.num_layers} "
          f"layers, d={cfg.hidden_size}), speculation: {args.speculative_config or 'none'}, "
          f"temperature {args.temperature}, prompt {args.prompt_len} tokens; jax "
          f"{jax.__version__} on {jax.devices()[0].platform} ({cpu_name()}, {os.cpu_count()} "
          f"cores); load + warm-up {time.perf_counter() - start:.1f} s")
    tab = table(args.steps)
    print("\n" + tab.header())
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        f = measure(llm, batch, args.steps, args.prompt_len, args.temperature, rng)
        print(tab.row(batch, f["step"] * 1e3, f["compiled"] * 1e3, f["host"] * 1e3,
                      f["dispatch"] * 1e3, (f["host"] - f["dispatch"]) / batch * 1e6,
                      f["host"] / (f["compiled"] + f["host"])), flush=True)
    print("\n" + tab.legend())
